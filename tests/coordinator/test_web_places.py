"""Protected places (coordinator.web.places), through the real CLI and the real HTTP app.

One station, one point: a camera station re-deployed 30 times with about 15 m of GPS jitter gave partners 30 independent
displaced points (each 635 m off, their average 85 m off). Now it must give exactly one point, whether the 30
deployments come in one package or in 30 imports with views in between; two stations farther apart than the join
distance keep their own points.

Protection is kept: re-importing a package without its CR observation made every place exact for partners, name
included. Protection once earned is kept through any import; only ``places lift`` (recorded: who, when, why; logged)
lifts it. A non-UTF-8 ``deployments.csv`` gave a raw traceback and a file cut mid-row imported silently: now each is a
clear error naming the file, the line and the fix, and nothing stored changes.

Positions are computed here on the sphere by hand (metres to degrees: 1 degree of latitude = pi R / 180 m), GPS
jitter is a seeded Gaussian, and distances come back through the haversine formula.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from shared.keys import generate_signing_key, public_key_to_pem

from coordinator.cli import app as cli_app
from coordinator.config import load_config
from coordinator.registry import SiteRegistry
from coordinator.storage import DeploymentRow, PlaceRow, Store
from coordinator.web.app import create_app
from coordinator.web.auth import AccountStore
from coordinator.web.location_privacy import EARTH_RADIUS_M, haversine_m
from tests.coordinator.test_web_app import login
from tests.coordinator.helpers import wide_cli_consoles
from tests.coordinator.web_fixtures import HASHER

SITE = "site-1"  # the one enrolled site every package belongs to
TRUTH = (-2.4017, 34.9123)  # the station
SPECIES = [{"scientific_name": "Diceros bicornis", "class_index": 0, "iucn_category": "CR"},
           {"scientific_name": "Phacochoerus africanus", "class_index": 1, "iucn_category": "LC"}]
USERS = {"olga": ("operator", "operator-password-1"), "paul": ("partner", "partner-password-1"),
         "pia": ("public", "public-password-1"), "rita": ("ranger", "ranger-password-1")}


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide consoles: long temporary paths are not folded across lines in the captured output."""
    wide_cli_consoles(monkeypatch)


def _flat(text: str) -> str:
    return " ".join(text.split())


def offset(lat: float, lon: float, north_m: float, east_m: float) -> tuple[float, float]:
    """(lat, lon) moved ``north_m`` and ``east_m`` metres (small offsets on the sphere)."""
    dlat = math.degrees(north_m / EARTH_RADIUS_M)
    dlon = math.degrees(east_m / (EARTH_RADIUS_M * math.cos(math.radians(lat))))
    return lat + dlat, lon + dlon


def jittered(n: int, *, sigma_m: float = 15.0, seed: int = 16) -> list[tuple[float, float]]:
    rng = np.random.default_rng(seed)
    return [offset(*TRUTH, *rng.normal(0.0, sigma_m, size=2)) for _ in range(n)]


def federation(tmp_path: Path) -> tuple[CliRunner, str]:
    runner = CliRunner()
    home = tmp_path / "fed"
    assert runner.invoke(cli_app, ["init", str(home), "--federation-id", "places"]).exit_code == 0
    config = home / "coordinator.yaml"
    data = yaml.safe_load(config.read_text())
    data["species"] = SPECIES
    config.write_text(yaml.safe_dump(data))
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    accounts = AccountStore(store, hasher=HASHER)
    for user, (role, password) in USERS.items():
        accounts.create(user, password, role)
    # one enrolled site: import-deployments then needs no --site
    SiteRegistry(store).enrol(SITE, public_key_to_pem(generate_signing_key().public_key()))
    store.dispose()
    return runner, str(config)


def package(root: Path, deployments: list[tuple[str, str, float, float]], observations: list[tuple[str, str]]) -> Path:
    """A Camtrap DP package: ``deployments`` (id, location name, lat, lon), ``observations`` (deployment, species)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\n" + "".join(
        f"{d},{name},{lat!r},{lon!r}\n" for d, name, lat, lon in deployments), encoding="utf-8")
    (root / "observations.csv").write_text("observationID,deploymentID,scientificName\n" + "".join(
        f"o{i},{d},{sp}\n" for i, (d, sp) in enumerate(observations)), encoding="utf-8")
    return root


def web(config: str):
    cfg = load_config(Path(config))
    store = Store(cfg.database_url or "", cfg.data_dir)
    return store, create_app(cfg, store=store, hasher=HASHER)


def shown(app, user: str) -> dict[str, dict]:
    c, _ = login(app, user, USERS[user][1])
    return {d["deployment_id"]: d for d in c.get("/api/deployments").json()}


def import_deployments(runner: CliRunner, config: str, pkg: Path) -> None:
    res = runner.invoke(cli_app, ["import-deployments", str(pkg), "-c", config])
    assert res.exit_code == 0, res.output


# ---- one station, one point ---------------------------------------------------------------------------------------
def test_thirty_jittered_redeployments_in_one_package_show_one_point(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    points = jittered(30)
    assert max(haversine_m(*TRUTH, *p) for p in points) < 60.0  # about 15 m of jitter, as in the trial
    deps = [(f"cam07-s{n:02d}", "waterhole north", lat, lon) for n, (lat, lon) in enumerate(points)]
    import_deployments(runner, config, package(tmp_path / "pkg", deps, [("cam07-s00", "Diceros bicornis")]))
    store, app = web(config)
    for user in ("paul", "pia"):
        seen = shown(app, user)
        distinct = {(seen[d]["latitude"], seen[d]["longitude"]) for d, *_ in deps}
        assert len(distinct) == 1, (user, len(distinct))
        (lat, lon), = distinct
        assert all(seen[d]["fuzzed"] and seen[d]["name"] == d for d, *_ in deps)
        for d, _, tlat, tlon in deps:  # within the stated bound of every deployment it stands for
            assert haversine_m(tlat, tlon, lat, lon) <= seen[d]["radius_m"] == pytest.approx(2500.0)
        c, _ = login(app, user, USERS[user][1])
        markers = set(re.findall(r'data-lat="([^"]+)" data-lon="([^"]+)"', c.get("/map").text))
        assert len(markers) == 1
        export = c.get("/export/camtrap-dp.zip")
        assert export.status_code == 200
    ranger = shown(app, "rita")
    assert {(ranger[d]["latitude"], ranger[d]["longitude"]) for d, *_ in deps} == {(lat, lon) for *_, lat, lon in deps}
    with store.session() as s:
        assert s.query(PlaceRow).count() == 1
    store.dispose()


def test_thirty_redeployments_imported_one_at_a_time_never_show_a_second_point(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    store, app = web(config)
    ever: set[tuple[float, float]] = set()
    deps: list[tuple[str, str, float, float]] = []
    for n, (lat, lon) in enumerate(jittered(30, seed=7)):
        deps.append((f"cam07-s{n:02d}", f"season {n}", lat, lon))
        # each season's package has this season's deployment only; the rhino was seen in season 0
        import_deployments(runner, config, package(tmp_path / f"pkg{n}", deps[-1:],
                                                   [(deps[-1][0], "Diceros bicornis" if n == 0 else
                                                     "Phacochoerus africanus")]))
        seen = shown(app, "paul")
        ever |= {(seen[d]["latitude"], seen[d]["longitude"]) for d, *_ in deps}
        assert all(seen[d]["fuzzed"] for d, *_ in deps)
    assert len(ever) == 1
    store.dispose()


def test_stations_farther_apart_than_the_join_distance_keep_their_own_points(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    a = TRUTH
    b = offset(*TRUTH, 0.0, 300.0)  # 300 m east, no sensitive species: a neighbour of st-a, shown at its point
    c = offset(*TRUTH, 0.0, 2000.0)  # 2 km east, a rhino too: beyond the 500 m join distance, its own place
    far = offset(*TRUTH, 5000.0, 0.0)  # 5 km north: not protected
    import_deployments(runner, config, package(tmp_path / "pkg", [
        ("st-a", "a", *a), ("st-b", "b", *b), ("st-c", "c", *c), ("st-far", "far", *far)],
        [("st-a", "Diceros bicornis"), ("st-c", "Diceros bicornis")]))
    store, app = web(config)
    seen = shown(app, "paul")
    point = {d: (seen[d]["latitude"], seen[d]["longitude"]) for d in seen}
    assert seen["st-a"]["fuzzed"] and seen["st-b"]["fuzzed"] and seen["st-c"]["fuzzed"] and not seen["st-far"]["fuzzed"]
    assert point["st-a"] == point["st-b"] != point["st-c"]
    assert point["st-far"] == far
    store.dispose()


# ---- the two averaging cases: one protected area, one shown point ---------------------------------------------------
def _one_point(app, deps: list[tuple[str, str, float, float]], truth: tuple[float, float]) -> None:
    for user in ("paul", "pia"):
        seen = shown(app, user)
        distinct = {(seen[d]["latitude"], seen[d]["longitude"]) for d, *_ in deps}
        assert len(distinct) == 1, (user, len(distinct))
        (lat, lon), = distinct
        bound = seen[deps[0][0]]["radius_m"]
        assert bound == pytest.approx(1000.0 + 500.0 + 1000.0)  # R + J + R (location_privacy.shown_within_m)
        assert all(seen[d]["fuzzed"] and haversine_m(tlat, tlon, lat, lon) <= bound for d, _, tlat, tlon in deps)
        c, _ = login(app, user, USERS[user][1])
        assert len(set(re.findall(r'data-lat="([^"]+)" data-lon="([^"]+)"', c.get("/map").text))) == 1


@pytest.mark.parametrize("one_package", [True, False])
def test_sixty_metres_of_jitter_over_thirty_redeployments_show_one_point(tmp_path: Path, one_package: bool) -> None:
    runner, config = federation(tmp_path)
    points = jittered(30, sigma_m=60.0, seed=7)
    assert max(haversine_m(*TRUTH, *p) for p in points) > 100.0  # beyond the old 100 m join distance
    deps = [(f"otter{n:02d}", "otter holt", lat, lon) for n, (lat, lon) in enumerate(points)]
    obs = [(deps[0][0], "Diceros bicornis")] + [(d, "Phacochoerus africanus") for d, *_ in deps[1:]]
    if one_package:
        import_deployments(runner, config, package(tmp_path / "pkg", deps, obs))
    else:
        for n, (dep, o) in enumerate(zip(deps, obs)):
            import_deployments(runner, config, package(tmp_path / f"pkg{n}", [dep], [o]))
    store, app = web(config)
    _one_point(app, deps, TRUTH)
    store.dispose()


def test_a_grid_of_neighbours_around_one_cr_camera_shows_one_point(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    deps = [(f"G{k:02d}", f"grid {k}", *offset(*TRUTH, 200.0 * i, 200.0 * j))
            for k, (i, j) in enumerate((i, j) for i in range(-2, 3) for j in range(-2, 3))]
    assert deps[12][2:] == TRUTH  # the centre camera recorded the rhino; the other 24 are its neighbours
    obs = [("G12", "Diceros bicornis")] + [(d, "Phacochoerus africanus") for d, *_ in deps if d != "G12"]
    import_deployments(runner, config, package(tmp_path / "pkg", deps, obs))
    store, app = web(config)
    _one_point(app, deps, TRUTH)
    with store.session() as s:  # one place, anchored at the CR camera, with all 25 members
        places = [p for p in s.query(PlaceRow) if p.members_json != "[]"]
        assert len(places) == 1 and (places[0].latitude, places[0].longitude) == TRUTH
        assert len(json.loads(places[0].members_json)) == 25
    store.dispose()


# ---- protection earned is kept; only an operator lifts it ---------------------------------------------------------
def _thirty_places() -> list[tuple[str, str, float, float]]:
    """30 stations 5 km apart on a grid (no two are neighbours), with names that would place them."""
    return [(f"dep{n:02d}", f"pan {n} by the fig tree", *offset(*TRUTH, 5000.0 * (n // 6), 5000.0 * (n % 6)))
            for n in range(30)]


def test_reimport_without_the_cr_observation_keeps_every_place_protected(tmp_path: Path, caplog) -> None:
    runner, config = federation(tmp_path)
    deps = _thirty_places()
    import_deployments(runner, config, package(tmp_path / "with-cr", deps, [(d, "Diceros bicornis") for d, *_ in deps]))
    # the same package again, the CR observations gone (no one looked in between: the import itself keeps it)
    import_deployments(runner, config, package(tmp_path / "without-cr", deps,
                                               [(d, "Phacochoerus africanus") for d, *_ in deps]))
    store, app = web(config)
    for user in ("paul", "pia"):
        seen = shown(app, user)
        assert all(seen[d]["fuzzed"] for d, *_ in deps), user
        assert all((seen[d]["latitude"], seen[d]["longitude"]) != (lat, lon) for d, _, lat, lon in deps)
        c, _ = login(app, user, USERS[user][1])
        text = c.get("/map").text + c.get("/api/deployments").text
        assert not any(name in text for _, name, *_ in deps), user
    with store.session() as s:
        assert {r.deployment_id: r.species_json for r in s.query(DeploymentRow)}["dep00"] == '["Phacochoerus africanus"]'
        place = next(p for p in s.query(PlaceRow) if p.members_json == f'["{SITE}/dep00"]')
        assert place.earned_at is not None and "Diceros bicornis" in place.earned_reason

    # an operator lifts one place, on the record; the other 29 stay protected
    caplog.set_level(logging.WARNING, logger="coordinator.web.places")
    res = runner.invoke(cli_app, ["places", "lift", str(place.id), "--reason", "the rhino record was a mislabelled "
                                  "warthog", "--by", "olga", "-c", config])
    assert res.exit_code == 0, res.output
    assert f"lifted place {place.id} ({SITE}/dep00) by olga" in _flat(res.output)
    assert any("lifted by olga" in r.getMessage() and "mislabelled warthog" in r.getMessage() for r in caplog.records)
    seen = shown(app, "paul")
    assert not seen["dep00"]["fuzzed"] and seen["dep00"]["name"] == "pan 0 by the fig tree"
    assert all(seen[d]["fuzzed"] for d, *_ in deps[1:])
    listing = _flat(runner.invoke(cli_app, ["places", "list", "-c", config]).output)
    assert "30 place(s)" in listing and "olga: the rhino record was a mislabelled warthog" in listing
    with store.session() as s:
        row = s.get(PlaceRow, place.id)
        assert (row.lifted_by, row.lift_reason) == ("olga", "the rhino record was a mislabelled warthog")
    store.dispose()


def test_lifting_a_place_whose_data_still_records_the_species_protects_it_again(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    import_deployments(runner, config, package(tmp_path / "pkg", [("d1", "pan", *TRUTH)], [("d1", "Diceros bicornis")]))
    store, app = web(config)
    with store.session() as s:
        pid = s.query(PlaceRow).one().id
    res = runner.invoke(cli_app, ["places", "lift", str(pid), "--reason", "test", "--by", "olga", "-c", config])
    assert res.exit_code == 0 and f"place {pid} is protected again" in _flat(res.output), res.output
    assert shown(app, "paul")["d1"]["fuzzed"]
    for args, field in ((["places", "lift", "999", "--reason", "x"], "PLACE_ID"),
                        (["places", "lift", str(pid), "--reason", " "], "--reason")):
        res = runner.invoke(cli_app, [*args, "-c", config])
        assert res.exit_code == 2 and field in res.output, res.output
    store.dispose()


# ---- bad files are clear errors and change nothing ------------------------------------------------------------------
def _stored(config: str) -> list[tuple]:
    cfg = load_config(Path(config))
    store = Store(cfg.database_url or "", cfg.data_dir)
    with store.session() as s:
        out = [(r.deployment_id, r.latitude, r.longitude, r.location_name, r.species_json)
               for r in s.query(DeploymentRow).order_by(DeploymentRow.deployment_id)]
    store.dispose()
    return out


def _bad_import(runner: CliRunner, config: str, root: Path, deployments: bytes,
                observations: bytes = b"observationID,deploymentID,scientificName\n") -> str:
    root.mkdir()
    (root / "deployments.csv").write_bytes(deployments)
    (root / "observations.csv").write_bytes(observations)
    before = _stored(config)
    res = runner.invoke(cli_app, ["import-deployments", str(root), "-c", config])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    assert _stored(config) == before  # nothing stored is lost or changed
    return _flat(res.output)


GOOD_HEADER = b"deploymentID,locationName,latitude,longitude\n"


UTF16_TEXT = "deploymentID,locationName,latitude,longitude\nd1,pan,3.5,-77.2\n"


@pytest.mark.parametrize("name, deployments, observations, says", [
    ("latin-1", GOOD_HEADER + b"d1,pan,3.5,-77.2\nd2,caf\xe9 pan,3.6,-77.3\n", None,
     ["deployments.csv: line 3: not UTF-8: byte 0xe9", "iconv -f latin1", "save it as UTF-8"]),
    ("cut in a field", GOOD_HEADER + b"d1,pan,3.5,-77.2\nd2,ridge,3.6", None,
     ["deployments.csv: line 3: 3 fields, the header 4", "cut short"]),
    ("cut in a used last field", GOOD_HEADER + b"d1,pan,3.5,-77.2\nd2,ridge,3.6,-77.3", None,
     ["deployments.csv: line 3: the last line ends without a line break in column 'longitude'", "add a line break"]),
    ("cut in a quote", GOOD_HEADER + b'd1,pan,3.5,-77.2\nd2,"ridge by the', None,
     ["deployments.csv: line 3: does not parse as CSV"]),
    ("cut at a row boundary", GOOD_HEADER + b"d1,pan,3.5,-77.2\n",
     b"observationID,deploymentID,scientificName\no1,d1,Diceros bicornis\no2,d2,Diceros bicornis\n",
     ["observations.csv: line 3, column deploymentID: names deployment 'd2', which deployments.csv does not list"]),
    ("listed twice", GOOD_HEADER + b"d1,pan,3.5,-77.2\nd1,pan,3.6,-77.2\n", None,
     ["deployments.csv: line 3, column deploymentID: deployment 'd1' is listed twice (first on line 2)"]),
    ("latin-1 observations", GOOD_HEADER + b"d1,pan,3.5,-77.2\n",
     b"observationID,deploymentID,scientificName\no1,d1,Ph\xe9nix\n", ["observations.csv: line 2: not UTF-8"]),
    # files seen in the field: file, line, column and value, and the right fix
    ("decimal comma", GOOD_HEADER + b'd1,pan,3.5,-77.2\n\nd2,"B_HS_val 2",\"51,496\",4.774\n', None,
     ["deployments.csv: line 4, column latitude: '51,496' is not a number of degrees",
      "write decimal degrees with a point, 51.496"]),
    ("NUL byte", GOOD_HEADER + b"d1,pan,3.5,-77.2\nd2,ridge,51.4\x0096,4.774\n", None,
     ["deployments.csv: line 3, column latitude: '51.4\\x0096' is not a number of degrees", "NUL byte"]),
    ("out of range", GOOD_HEADER + b"d1,pan,3.5,-277.2\n", None,
     ["deployments.csv: line 2, column longitude: '-277.2' is outside [-180, 180]"]),
    ("UTF-16 with a BOM", UTF16_TEXT.encode("utf-16"), None,
     ["deployments.csv: the file is UTF-16LE text, not UTF-8", "iconv -f UTF-16 -t UTF-8 deployments.csv"]),
    ("UTF-16BE without a BOM", UTF16_TEXT.encode("utf-16-be"), None,
     ["deployments.csv: the file is UTF-16BE text, not UTF-8", "iconv -f UTF-16 -t UTF-8 deployments.csv"]),
])
def test_a_bad_deployments_package_is_a_clear_error_that_changes_nothing(tmp_path: Path, name, deployments,
                                                                         observations, says) -> None:
    runner, config = federation(tmp_path)
    import_deployments(runner, config, package(tmp_path / "good", [("d1", "pan", 3.5, -77.2), ("d9", "far", 4.0, -77.0)],
                                               [("d1", "Diceros bicornis")]))
    out = _bad_import(runner, config, tmp_path / "bad", deployments,
                      observations if observations is not None else b"observationID,deploymentID,scientificName\n")
    for text in says:
        assert text in out, (name, out)
    assert "Traceback" not in out and "{" not in out  # no dict of a row
    bad = "observations.csv" if "observations" in says[0].split(":")[0] else "deployments.csv"
    assert out.split("(fix:")[0].count(bad) == 1, (name, out)  # the file named once (the fix may name it again)
    if "UTF-16" in name:
        assert "latin1" not in out


def test_a_byte_order_mark_and_a_real_export_without_a_final_line_break_import(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    root = tmp_path / "bom"
    root.mkdir()
    (root / "deployments.csv").write_bytes(b"\xef\xbb\xbf" + GOOD_HEADER + b"d1,pan,3.5,-77.2\n")
    # no line break at the end, like real Wildlife Insights exports: fine when the last column is not one it reads
    (root / "observations.csv").write_bytes(b"observationID,deploymentID,scientificName,observationComments\n"
                                            b"o1,d1,Diceros bicornis,seen twice")
    import_deployments(runner, config, root)
    assert _stored(config) == [("d1", 3.5, -77.2, "pan", '["Diceros bicornis"]')]


def test_the_app_and_export_still_answer_as_before_for_rangers(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    import_deployments(runner, config, package(tmp_path / "pkg", [("d1", "pan", *TRUTH)], [("d1", "Diceros bicornis")]))
    store, app = web(config)
    c = TestClient(app, base_url="https://testserver")
    c, _ = login(app, "rita", USERS["rita"][1], client=c)
    d = c.get("/api/deployments").json()[0]
    assert (d["latitude"], d["longitude"], d["fuzzed"], d["name"]) == (*TRUTH, False, "pan") and d["place"] == 1
    store.dispose()


def test_a_megadetector_reimport_that_drops_the_cr_species_keeps_the_place_protected(tmp_path: Path) -> None:
    """The same for detection records: `import-detections` again with the rhino relabelled replaces the record,
    and the place it made protected stays protected (evaluated before the replacement, in its transaction)."""
    import json

    from shared.keys import generate_signing_key, save_public_key

    runner, config = federation(tmp_path)
    pub = save_public_key(generate_signing_key().public_key(), tmp_path / "site.pub")
    assert runner.invoke(cli_app, ["enrol", "site-a", "--public-key", str(pub), "-c", config]).exit_code == 0
    res = runner.invoke(cli_app, ["import-deployments", str(package(tmp_path / "pkg", [("d1", "pan", *TRUTH)],
                                                                    [("d1", "Phacochoerus africanus")])),
                                  "--site", "site-a", "-c", config])
    assert res.exit_code == 0, res.output

    def results(species: str) -> Path:
        path = tmp_path / f"md-{species.split()[0]}.json"
        path.write_text(json.dumps({"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal"},
                                    "classification_categories": {"0": species},
                                    "images": [{"file": "IMG_0001.JPG", "datetime": "2024-05-01 06:12:33",
                                                "detections": [{"category": "1", "conf": 0.9,
                                                                "bbox": [0.1, 0.2, 0.3, 0.4],
                                                                "classifications": [["0", 0.8]]}]}]}))
        return path

    for species in ("Diceros bicornis", "Phacochoerus africanus"):
        res = runner.invoke(cli_app, ["import-detections", str(results(species)), "--site", "site-a",
                                      "--deployment", "d1", "-c", config])
        assert res.exit_code == 0, res.output
    assert "1 replaced" in _flat(res.output)
    store, app = web(config)
    seen = shown(app, "paul")
    assert seen["d1"]["fuzzed"] and seen["d1"]["name"] == "d1"
    store.dispose()


# ---- places lift / list ---------------------------------------------------------------------------------------------
def test_lifting_a_place_whose_deployments_are_someone_elses_neighbours_says_so(tmp_path: Path) -> None:
    runner, config = federation(tmp_path)
    b = offset(*TRUTH, 0.0, 700.0)  # beyond the 500 m join distance (its own place), within 1 km (a neighbour)
    import_deployments(runner, config, package(tmp_path / "p1", [("st-a", "a", *TRUTH), ("st-b", "b", *b)],
                                               [("st-a", "Diceros bicornis"), ("st-b", "Diceros bicornis")]))
    # st-b's rhino was a mislabelled warthog: the data is corrected, the place keeps its earned protection
    import_deployments(runner, config, package(tmp_path / "p2", [("st-b", "b", *b)],
                                               [("st-b", "Phacochoerus africanus")]))
    store, app = web(config)
    with store.session() as s:
        ids = {json.loads(p.members_json)[0]: p.id for p in s.query(PlaceRow) if p.members_json != "[]"}
    pa, pb = ids[f"{SITE}/st-a"], ids[f"{SITE}/st-b"]
    res = runner.invoke(cli_app, ["places", "lift", str(pb), "--reason", "warthog", "--by", "olga", "-c", config])
    assert res.exit_code == 0, res.output
    out = _flat(res.output)
    assert f"lifted place {pb}" in out
    assert f"{SITE}/st-b of place {pb} are still shown fuzzed, as neighbours of place {pa} (fix: lift that place too)" in out
    seen = shown(app, "paul")
    assert seen["st-b"]["fuzzed"] and (seen["st-b"]["latitude"], seen["st-b"]["longitude"]) == (
        seen["st-a"]["latitude"], seen["st-a"]["longitude"])
    # lifting it again would change nothing a partner sees: refused, naming the place to lift instead
    res = runner.invoke(cli_app, ["places", "lift", str(pb), "--reason", "again", "--by", "olga", "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2, res.output
    assert "lifted place" not in out
    assert f"place {pb} has nothing to lift: its protection is already lifted" in out
    assert f"({SITE}/st-b) are protected as neighbours of place {pa}" in out
    with store.session() as s:
        assert s.get(PlaceRow, pb).lift_reason == "warthog"  # the refused lift changed nothing
    store.dispose()


def test_places_list_fits_80_columns_and_cuts_no_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    import coordinator.cli.web as web_cli

    runner, config = federation(tmp_path)
    deps = [(f"station-{n:03d}-season-2024", "pan", *offset(*TRUTH, 20.0 * n, 0.0)) for n in range(6)]
    deps.append(("far-away-camera-0001", "far", *offset(*TRUTH, 9000.0, 0.0)))
    import_deployments(runner, config, package(tmp_path / "p", deps, [(deps[0][0], "Diceros bicornis"),
                                                                     (deps[-1][0], "Diceros bicornis")]))
    monkeypatch.setattr(web_cli, "console", Console(width=80, force_terminal=False, color_system=None))
    res = runner.invoke(cli_app, ["places", "list", "-c", config])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    tokens = set(re.findall(r"[\w.-]+", res.output))
    assert {d for d, *_ in deps} <= tokens, res.output  # every id whole, on one line
    assert "earned" in tokens and "2 place(s)" in res.output
    assert f"{TRUTH[0]:.6f}, {TRUTH[1]:.6f}" in res.output  # the anchor, not cut
    assert "recorded Diceros bicornis" in _flat(res.output)
