"""The web view's commands of ``wildfed-coordinator`` as a new user meets them: error text with square brackets
printed whole, clear errors for a file given as the export folder and for a wrong import format, warnings for a
deployment without coordinates and for species the species table does not know, the camera's UTC offset, a
truthful re-import summary, ``user set-password``, and the help of ``serve`` and ``user``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from argon2 import PasswordHasher
from PIL import Image
from typer.testing import CliRunner

import coordinator.cli as cli
import coordinator.web.auth as auth
from coordinator.cli import app
from coordinator.config import load_config
from coordinator.storage import DetectionRow, Store
from tests.coordinator.helpers import wide_cli_consoles

CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)  # fast for tests; the default is 64 MiB x 3


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide consoles, so that long temporary paths are not folded across lines in the captured output."""
    wide_cli_consoles(monkeypatch)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _federation(tmp_path: Path, species: list[dict] | None = None) -> tuple[CliRunner, str]:
    runner = CliRunner()
    home = tmp_path / "fed"
    res = runner.invoke(app, ["init", str(home), "--federation-id", "webcli"])
    assert res.exit_code == 0, res.output
    config = home / "coordinator.yaml"
    if species is not None:
        data = yaml.safe_load(config.read_text())
        data["species"] = species
        config.write_text(yaml.safe_dump(data))
    return runner, str(config)


def _enrolled(tmp_path: Path, species: list[dict] | None = None,
              sites: tuple[str, ...] = ("site-a",)) -> tuple[CliRunner, str]:
    from shared.keys import generate_signing_key, save_public_key

    runner, config = _federation(tmp_path, species)
    for site in sites:
        pub = save_public_key(generate_signing_key().public_key(), tmp_path / f"{site}.pub")
        res = runner.invoke(app, ["enrol", site, "--public-key", str(pub), "--config", config])
        assert res.exit_code == 0, res.output
    return runner, config


def _results(images: list[dict]) -> dict:
    return {"info": {"format_version": "1.4", "detector": "md_v5a.0.0.pt"},
            "detection_categories": {"1": "animal", "2": "person", "3": "vehicle"},
            "images": images}


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _package(root: Path) -> Path:
    """A small Camtrap DP package: d1 recorded a tapir and a jaguar, d2 a jaguar and an ocelot."""
    root.mkdir(parents=True)
    (root / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\n"
                                          "d1,river,3.5,-77.2\nd2,ridge,3.6,-77.3\n")
    (root / "observations.csv").write_text("observationID,deploymentID,scientificName\n"
                                           "o1,d1,Tapirus bairdii\no2,d1,Panthera onca\no3,d2,Panthera onca\n"
                                           "o4,d2,Leopardus pardalis\no5,d2,\n")
    return root


def _rows(config: str) -> list[DetectionRow]:
    cfg = load_config(Path(config))
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        with store.session() as s:
            return list(s.query(DetectionRow).order_by(DetectionRow.id))
    finally:
        store.dispose()


# ---- 1. error text in square brackets is printed, not eaten as rich markup ------------------------------------

def test_error_text_in_square_brackets_is_printed(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    md = _write(tmp_path / "md.json", _results([
        {"file": "a.JPG", "detections": [{"category": "1", "conf": 0.9, "bbox": [0.5, 0.5, 0.7, 0.2]}]}]))
    res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "d1",
                              "--config", config])
    out = _flat(res.output)
    assert res.exit_code == 2, res.output
    assert "images[0].detections[0].bbox" in out
    assert "bbox [0.5, 0.5, 0.7, 0.2] is not a normalised box inside the image" in out
    assert "give [x_min, y_min, width, height] as fractions of the image width and height" in out
    assert "Traceback" not in res.output and _rows(config) == []


# ---- 2. an existing file as the export folder ------------------------------------------------------------------

def test_export_into_an_existing_file_is_a_clear_error(tmp_path: Path) -> None:
    runner, config = _federation(tmp_path)
    target = tmp_path / "export.zip"
    target.write_text("not a folder")
    res = runner.invoke(app, ["export-camtrap-dp", str(target), "--role", "ranger", "--config", config])
    out = _flat(res.output)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert str(target) in out and "not a folder" in out and "fix: give a folder for the package" in out
    assert target.read_text() == "not a folder"
    nested = target / "pkg"  # a folder below a file
    res = runner.invoke(app, ["export-camtrap-dp", str(nested), "--role", "ranger", "--config", config])
    assert res.exit_code == 2 and str(nested) in _flat(res.output), res.output


# ---- 3. a deployment missing from the deployments table --------------------------------------------------------

def test_unknown_deployment_warns_and_export_counts_what_it_left_out(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    md = _write(tmp_path / "md.json", _results([{"file": "a.JPG", "detections": []},
                                                {"file": "b.JPG", "detections": []}]))
    res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "no-such-dep",
                              "--config", config])
    out = _flat(res.output)
    assert res.exit_code == 0, res.output
    assert "2 new" in out  # imported all the same
    assert "warning: deployment 'no-such-dep' of site site-a is not in the deployments table" in out
    assert "wildfed-coordinator import-deployments PATH --site site-a" in out
    res = runner.invoke(app, ["export-camtrap-dp", str(tmp_path / "out"), "--role", "ranger", "--config", config])
    out = _flat(res.output)
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "out" / "datapackage.json").read_text())
    assert meta["wildfed"]["recordsLeftOut"] == 2
    assert "warning: 2 record(s) left out: their deployment(s) site-a/no-such-dep have no coordinates" in out

    # once the deployment is known: no warning, nothing left out
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\nno-such-dep,x,3.5,-77.2\n")
    (pkg / "observations.csv").write_text("observationID,deploymentID,scientificName\n")
    assert runner.invoke(app, ["import-deployments", str(pkg), "-c", config]).exit_code == 0
    res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "no-such-dep",
                              "--config", config])
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    res = runner.invoke(app, ["export-camtrap-dp", str(tmp_path / "out"), "--role", "ranger", "--config", config])
    assert res.exit_code == 0 and "left out" not in res.output, res.output
    assert json.loads((tmp_path / "out" / "datapackage.json").read_text())["wildfed"]["recordsLeftOut"] == 0


# ---- 4. the camera's UTC offset --------------------------------------------------------------------------------

def test_utc_offset_applies_to_times_without_one_and_is_validated(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    md = _write(tmp_path / "md.json", _results([
        {"file": "a.JPG", "detections": [], "datetime": "2020-05-30 04:57:37"},
        {"file": "b.JPG", "detections": [], "datetime": "2020-05-30T04:57:37+02:00"}]))
    res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "d1",
                              "--utc-offset", "-05:00", "--config", config])
    assert res.exit_code == 0, res.output
    assert {r.file: r.captured_at for r in _rows(config)} == {"a.JPG": "2020-05-30T04:57:37-05:00",
                                                             "b.JPG": "2020-05-30T04:57:37+02:00"}
    for bad in ("5", "+5:00", "-05:60", "+15:00", "UTC+1", "-13:00"):
        res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "d2",
                                  "--utc-offset", bad, "--config", config])
        out = _flat(res.output)
        assert res.exit_code == 2, (bad, res.output)
        assert f"--utc-offset {bad!r}" in out and "fix: give the camera clock's offset from UTC as +HH:MM" in out
    assert len(_rows(config)) == 2  # nothing written by the refused imports


def test_utc_offset_defaults_to_utc(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    md = _write(tmp_path / "md.json", _results([{"file": "a.JPG", "detections": [],
                                                 "datetime": "2020:05:30 04:57:37"}]))
    res = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "d1",
                              "--config", config])
    assert res.exit_code == 0, res.output
    assert [r.captured_at for r in _rows(config)] == ["2020-05-30T04:57:37+00:00"]
    assert "--utc-offset" in _flat(runner.invoke(app, ["import-detections", "--help"]).output)


# ---- 5. the image summary after a re-import --------------------------------------------------------------------

def _jpeg(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, format="JPEG")
    return buf.getvalue()


def test_reimport_summary_says_images_are_held_not_new(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    for name, color in (("a.JPG", (200, 10, 10)), ("b.JPG", (10, 200, 10)), ("p.JPG", (10, 10, 200))):
        (images / name).write_bytes(_jpeg(color))
    md = _write(tmp_path / "md.json", _results([
        {"file": "a.JPG", "detections": [{"category": "1", "conf": 0.9, "bbox": [0.1, 0.1, 0.2, 0.2]}]},
        {"file": "b.JPG", "detections": []},
        {"file": "p.JPG", "detections": [{"category": "2", "conf": 0.9, "bbox": [0.1, 0.1, 0.2, 0.2]}]},
        {"file": "gone.JPG", "detections": []}]))
    args = ["import-detections", str(md), "--site", "site-a", "--deployment", "d1", "--images", str(images),
            "--config", config]
    first = _flat(runner.invoke(app, args).output)
    assert "4 new, 0 replaced, 0 unchanged" in first
    assert "images: 2 held (2 new), 1 missing, 0 unreadable, 1 withheld (person/vehicle)" in first
    again = runner.invoke(app, args)
    out = _flat(again.output)
    assert again.exit_code == 0, again.output
    assert "0 new, 0 replaced, 4 unchanged" in out
    assert "images: 2 held (0 new), 1 missing" in out and "stored" not in out


# ---- 6. import-deployments: unknown species, a wrong --format --------------------------------------------------

def test_import_deployments_lists_species_the_table_does_not_know(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path, species=[
        {"scientific_name": "Panthera onca", "class_index": 0, "iucn_category": "NT"}])
    res = runner.invoke(app, ["import-deployments", str(_package(tmp_path / "pkg")), "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 0 and "imported 2 deployment(s)" in out, res.output
    assert ("warning: 2 species are not in the species table; the web view protects the places that recorded "
            "them (web.unknown_species: protect) until you add them to `species:` with their IUCN category: "
            "Leopardus pardalis (1 deployment), Tapirus bairdii (1 deployment)") in out
    assert "Panthera onca" not in out


def test_import_deployments_counts_deployments_per_unknown_species_of_this_import_only(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)  # no species table: every species is unknown
    other = tmp_path / "other"
    other.mkdir()
    (other / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\nz9,far,1.0,1.0\n")
    (other / "observations.csv").write_text("observationID,deploymentID,scientificName\no1,z9,Canis lupus\n")
    assert runner.invoke(app, ["import-deployments", str(other), "-c", config]).exit_code == 0
    res = runner.invoke(app, ["import-deployments", str(_package(tmp_path / "pkg")), "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 0, res.output
    assert ("3 species are not in the species table" in out
            and "Leopardus pardalis (1 deployment), Panthera onca (2 deployments), Tapirus bairdii (1 deployment)"
            in out)
    assert "Canis lupus" not in out  # recorded by another import's deployments


def test_import_deployments_known_species_give_no_warning(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path, species=[
        {"scientific_name": "Panthera onca", "class_index": 0, "iucn_category": "NT"},
        {"scientific_name": "Tapirus bairdii", "class_index": 1, "iucn_category": "EN"},
        {"scientific_name": "Leopardus pardalis", "class_index": 2, "iucn_category": "LC"}])
    res = runner.invoke(app, ["import-deployments", str(_package(tmp_path / "pkg")), "-c", config])
    assert res.exit_code == 0 and "warning" not in res.output, res.output


def test_import_deployments_wrong_format_is_a_clear_error(tmp_path: Path) -> None:
    runner, config = _enrolled(tmp_path)
    pkg = _package(tmp_path / "pkg")
    res = runner.invoke(app, ["import-deployments", str(pkg), "--format", "wildlife-insights", "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "error:" in out
    assert "not a wildlife-insights table" in out and "--format camtrap-dp" in out


def test_import_deployments_names_the_site_when_it_is_not_clear(tmp_path: Path) -> None:
    pkg = str(_package(tmp_path / "pkg"))
    runner, config = _federation(tmp_path)
    res = runner.invoke(app, ["import-deployments", pkg, "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "error: --site: no site is enrolled" in out and "then import with --site SITE" in out
    runner, config = _enrolled(tmp_path / "two", sites=("site-a", "site-b"))
    res = runner.invoke(app, ["import-deployments", pkg, "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2, res.output
    assert "2 sites are enrolled" in out and "--site SITE (one of site-a, site-b)" in out
    res = runner.invoke(app, ["import-deployments", pkg, "--site", "site-c", "-c", config])
    assert res.exit_code == 2 and "site 'site-c' is not enrolled" in _flat(res.output), res.output
    res = runner.invoke(app, ["import-deployments", pkg, "--site", "site-b", "-c", config])
    assert res.exit_code == 0 and "imported 2 deployment(s) of site site-b" in _flat(res.output), res.output


# ---- 7. user set-password; user add reads the config first -----------------------------------------------------

def test_user_set_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "PasswordHasher", lambda: CHEAP)
    runner, config = _federation(tmp_path)
    res = runner.invoke(app, ["user", "add", "ana", "--role", "ranger", "-c", config],
                        input="a long ranger password\na long ranger password\n")
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["user", "set-password", "ana", "-c", config],
                        input="another long secret\nanother long secret\n")
    assert res.exit_code == 0, res.output
    assert "another long secret" not in res.output and "password changed for ana" in _flat(res.output)
    cfg = load_config(Path(config))
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        accounts = auth.AccountStore(store, hasher=CHEAP)
        assert accounts.authenticate("ana", "another long secret") is not None
        assert accounts.authenticate("ana", "a long ranger password") is None
    finally:
        store.dispose()
    res = runner.invoke(app, ["user", "set-password", "ana", "-c", config], input="short\nshort\n")
    assert res.exit_code == 2 and "shorter than" in _flat(res.output), res.output
    res = runner.invoke(app, ["user", "set-password", "nobody", "-c", config])  # refused before any prompt
    assert res.exit_code == 2 and "'nobody' does not exist" in _flat(res.output), res.output
    assert "password:" not in res.output
    res = runner.invoke(app, ["user", "--help"])
    assert res.exit_code == 0 and "set-password" in res.output


def test_user_add_reads_the_config_before_asking_for_a_password(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["user", "add", "ana", "--role", "ranger", "-c", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2, res.output  # not 1 (aborted at a prompt with no input)
    assert "config file not found" in _flat(res.output) and "password" not in res.output


# ---- 8. serve --help -------------------------------------------------------------------------------------------

def test_serve_help_names_the_defaults_and_tls() -> None:
    res = CliRunner().invoke(app, ["serve", "--help"])
    out = _flat(res.output)
    assert res.exit_code == 0
    assert "127.0.0.1" in out and "8080" in out
    assert "web.tls_cert_file" in out and "web.tls_key_file" in out
    assert "default: web.host" in out and "default: web.port" in out  # not eaten as markup


# ---- 10. the command list of the module docstring --------------------------------------------------------------

def test_module_docstring_lists_the_web_commands() -> None:
    doc = cli.__doc__ or ""
    for command in ("import-detections", "export-camtrap-dp", "set-password", "import-deployments", "serve"):
        assert command in doc


def test_user_add_refuses_a_taken_name_before_asking_for_the_password(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "fed"), "--federation-id", "fx"]).exit_code == 0
    cfg = str(tmp_path / "fed" / "coordinator.yaml")
    from coordinator.config import load_config
    from coordinator.storage import Store
    from coordinator.web.auth import AccountStore
    from tests.coordinator.web_fixtures import HASHER

    c = load_config(cfg)
    AccountStore(Store(c.database_url, c.data_dir), hasher=HASHER).create("olga", "operator-password-1", "operator")
    r = runner.invoke(app, ["user", "add", "olga", "--role", "ranger", "--config", cfg], input="")
    assert r.exit_code == 2 and "exists" in r.output and "password" not in r.output.split("exists")[0].lower()


def test_a_password_prompt_without_a_terminal_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no terminal and nothing on standard input, user add and set-password stop with one line naming the
    fix (user add: --password-stdin), instead of click's bare 'Aborted.'."""
    monkeypatch.setattr(auth, "PasswordHasher", lambda: CHEAP)
    runner, config = _federation(tmp_path)
    res = runner.invoke(app, ["user", "add", "ana", "--role", "ranger", "-c", config], input="")
    assert res.exit_code == 2 and "--password-stdin" in _flat(res.output), res.output
    res = runner.invoke(app, ["user", "add", "ana", "--role", "ranger", "--password-stdin", "-c", config],
                        input="a long ranger password\n")
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["user", "set-password", "ana", "-c", config], input="")
    assert res.exit_code == 2 and "terminal" in _flat(res.output), res.output
