"""Deployments for the web view (coordinator.web.deployments): imported from Camtrap DP and Wildlife Insights with
their coordinates and recorded IUCN categories, shown exactly to rangers and protected for partners. Counts are
those of the CSV files (by hand for the synthetic package); distances by the haversine formula."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.errors import DatasetError
from shared.keys import generate_signing_key, save_public_key
from shared.iucn import IUCNCategory as Cat

from coordinator.storage import DeploymentRow, Store
from coordinator.web.auth import Role
from coordinator.web.deployments import import_camtrap_dp, import_wildlife_insights, species_table_categories
from coordinator.web.location_privacy import LocationPolicy, haversine_m
from coordinator.web.views import Viewer
from tests.support import SHARED_DATA

SECRET = bytes(range(32))
SITE = "site-1"
DATA_ROOT = SHARED_DATA
TABLE = species_table_categories([SimpleNamespace(scientific_name="Panthera onca", iucn_category="NT"),
                                  SimpleNamespace(scientific_name="Tapirus bairdii", iucn_category="EN"),
                                  SimpleNamespace(scientific_name="Anas platyrhynchos", iucn_category="EN")])


def deployments_for(store: Store, role: Role, *, policy: LocationPolicy, secret: bytes) -> list[dict]:
    """What the role is shown (the web view's Viewer, with no detection records stored)."""
    return Viewer(store, role, policy=policy, secret=secret, category_of=TABLE).deployments()


def _package(root: Path, *, latitude: str = "3.5") -> Path:
    root.mkdir(parents=True)
    (root / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\n"
                                          f"d1,river,{latitude},-77.2\nd2,ridge,3.6,-77.3\n")
    (root / "observations.csv").write_text("observationID,deploymentID,scientificName\n"
                                           "o1,d1,Tapirus bairdii\no2,d1,Panthera onca\no3,d2,Panthera onca\n"
                                           "o4,d2,\n")
    return root


def test_camtrap_import_and_what_each_role_sees(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path / "data")
    assert import_camtrap_dp(store, _package(tmp_path / "pkg"), TABLE, site_id=SITE) == 2
    ranger = {d["deployment_id"]: d for d in deployments_for(store, Role.RANGER, policy=LocationPolicy(),
                                                             secret=SECRET)}
    partner = {d["deployment_id"]: d for d in deployments_for(store, Role.PARTNER, policy=LocationPolicy(),
                                                              secret=SECRET)}
    assert (ranger["d1"]["latitude"], ranger["d1"]["longitude"], ranger["d1"]["fuzzed"]) == (3.5, -77.2, False)
    assert ranger["d1"]["categories"] == ["EN", "NT"]
    # d1 recorded an endangered tapir: fuzzed within 1 km for a partner, the same point on every view
    assert partner["d1"]["fuzzed"] and 0 < haversine_m(3.5, -77.2, partner["d1"]["latitude"],
                                                       partner["d1"]["longitude"]) <= 1000.0
    assert deployments_for(store, Role.PUBLIC, policy=LocationPolicy(), secret=SECRET)[0] == partner["d1"]
    # d2 recorded only a near-threatened jaguar: exact for everyone; partners never see the categories
    assert (partner["d2"]["latitude"], partner["d2"]["longitude"], partner["d2"]["fuzzed"]) == (3.6, -77.3, False)
    assert "categories" not in partner["d1"] and "categories" not in partner["d2"]
    assert import_camtrap_dp(store, tmp_path / "pkg", TABLE, site_id=SITE) == 2  # idempotent
    with store.session() as s:
        assert s.query(DeploymentRow).count() == 2


def test_bad_coordinates_write_nothing(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path / "data")
    with pytest.raises(DatasetError, match="latitude"):
        import_camtrap_dp(store, _package(tmp_path / "pkg", latitude="95"), TABLE, site_id=SITE)
    with store.session() as s:
        assert s.query(DeploymentRow).count() == 0
    with pytest.raises(DatasetError, match="not found"):
        import_camtrap_dp(store, tmp_path / "missing", TABLE, site_id=SITE)


def test_a_camera_without_coordinates_waits_off_the_map(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path / "data")
    pkg = _package(tmp_path / "pkg", latitude="")
    text = (pkg / "deployments.csv").read_text().replace("d1,river,,-77.2", "d1,river,,")
    (pkg / "deployments.csv").write_text(text)
    with pytest.raises(DatasetError, match="latitude"):  # strict unless the caller takes the skipped ones
        import_camtrap_dp(store, pkg, TABLE, site_id=SITE)
    skipped: list[str] = []
    assert import_camtrap_dp(store, pkg, TABLE, site_id=SITE, skipped=skipped) == 1
    assert skipped == ["d1"]
    with store.session() as s:
        assert [r.deployment_id for r in s.query(DeploymentRow)] == ["d2"]


def _need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"real data not present at {path}"
                    " (set WILDFED_SHARED_DATA to the data folder; a fresh clone has no ../shared/data)")


def test_real_camtrap_dp_example(tmp_path: Path) -> None:
    pkg = DATA_ROOT / "camtrap-dp-example"
    _need(pkg)
    with (pkg / "deployments.csv").open(newline="", encoding="utf-8") as f:
        expected = {r["deploymentID"]: (float(r["latitude"]), float(r["longitude"])) for r in csv.DictReader(f)}
    with (pkg / "observations.csv").open(newline="", encoding="utf-8") as f:
        with_mallard = {r["deploymentID"] for r in csv.DictReader(f) if r["scientificName"] == "Anas platyrhynchos"}
    store = Store("sqlite://", tmp_path / "data")
    assert import_camtrap_dp(store, pkg, TABLE, site_id=SITE) == len(expected)
    # protected: a deployment that recorded a mallard (EN in this test's table) and any within 1 km of one
    protected = {d for d, (lat, lon) in expected.items()
                 if any(haversine_m(lat, lon, *expected[m]) <= 1000.0 for m in with_mallard)}
    # species the 3-species table does not list count as NE here (protect_unknown False); by default they protect
    for d in deployments_for(store, Role.PARTNER, policy=LocationPolicy(protect_unknown=False), secret=SECRET):
        lat, lon = expected[d["deployment_id"]]
        if d["deployment_id"] in protected:
            assert d["fuzzed"] and 0 < haversine_m(lat, lon, d["latitude"], d["longitude"]) <= 1000.0
        else:
            assert not d["fuzzed"] and (d["latitude"], d["longitude"]) == (lat, lon)
    assert with_mallard  # the example does record mallards
    with (pkg / "observations.csv").open(newline="", encoding="utf-8") as f:
        with_unlisted = {r["deploymentID"] for r in csv.DictReader(f)
                         if r["scientificName"] and not TABLE.known(r["scientificName"])}
    by_default = {d["deployment_id"]: d["fuzzed"] for d in
                  deployments_for(store, Role.PARTNER, policy=LocationPolicy(), secret=SECRET)}
    assert by_default == {d: d in protected or any(haversine_m(*expected[d], *expected[u]) <= 1000.0
                                                   for u in with_unlisted) for d in expected}


def test_real_wildlife_insights_project(tmp_path: Path) -> None:
    project = DATA_ROOT / "wildlife-insights" / "cajambre"
    _need(project)
    with (project / "deployments.csv").open(newline="", encoding="utf-8") as f:
        ids = {r["deployment_id"] for r in csv.DictReader(f)}
    store = Store("sqlite://", tmp_path / "data")
    assert import_wildlife_insights(store, project, TABLE, site_id=SITE) == len(ids)
    shown = deployments_for(store, Role.RANGER, policy=LocationPolicy(), secret=SECRET)
    assert {d["deployment_id"] for d in shown} == ids and not any(d["fuzzed"] for d in shown)
    assert all(set(d["categories"]) <= {c.value for c in Cat} for d in shown)


def test_import_deployments_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    cfg = str(tmp_path / "c" / "coordinator.yaml")
    pub = save_public_key(generate_signing_key().public_key(), tmp_path / "s.pub")
    assert runner.invoke(app, ["enrol", SITE, "--public-key", str(pub), "-c", cfg]).exit_code == 0
    res = runner.invoke(app, ["import-deployments", str(_package(tmp_path / "pkg")), "-c", cfg])
    assert res.exit_code == 0 and "imported 2 deployment(s)" in res.output, res.output
    res = runner.invoke(app, ["import-deployments", str(tmp_path / "pkg"), "--format", "gbif", "-c", cfg])
    assert res.exit_code == 2 and "--format" in res.output


def test_coordinates_only_reads_no_species_and_replaces_what_a_full_import_stored(tmp_path: Path) -> None:
    # A package whose observations are a site's training records: only its deployments table is read
    store = Store("sqlite://", tmp_path / "data")
    pkg = _package(tmp_path / "pkg")
    assert import_camtrap_dp(store, pkg, TABLE, site_id=SITE) == 2
    assert {d["deployment_id"]: d["categories"] for d in deployments_for(
        store, Role.RANGER, policy=LocationPolicy(), secret=SECRET)} == {"d1": ["EN", "NT"], "d2": ["NT"]}
    (pkg / "observations.csv").write_text("not,a,camtrap\ntable\n")  # never read
    assert import_camtrap_dp(store, pkg, TABLE, site_id=SITE, species=False) == 2
    shown = {d["deployment_id"]: d for d in deployments_for(store, Role.RANGER, policy=LocationPolicy(),
                                                               secret=SECRET)}
    assert {k: (d["latitude"], d["longitude"], d["categories"]) for k, d in shown.items()} == {
        "d1": (3.5, -77.2, []), "d2": (3.6, -77.3, [])}
    with store.session() as s:
        assert {(r.species_json, r.categories_json) for r in s.query(DeploymentRow)} == {("[]", "[]")}
    # the command line's --coordinates-only
    from typer.testing import CliRunner

    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    cfg = str(tmp_path / "c" / "coordinator.yaml")
    pub = save_public_key(generate_signing_key().public_key(), tmp_path / "s.pub")
    assert runner.invoke(app, ["enrol", SITE, "--public-key", str(pub), "-c", cfg]).exit_code == 0
    res = runner.invoke(app, ["import-deployments", str(pkg), "--coordinates-only", "-c", cfg])
    assert res.exit_code == 0 and "imported 2 deployment(s)" in res.output, res.output


def _station(root: Path, lat: float, lon: float, species: str) -> Path:
    root.mkdir(parents=True)
    (root / "deployments.csv").write_text(f"deploymentID,locationName,latitude,longitude\nStationA,pan,{lat},{lon}\n")
    (root / "observations.csv").write_text(f"observationID,deploymentID,scientificName\no1,StationA,{species}\n")
    return root


def test_two_sites_with_a_station_a_each_keep_their_own(tmp_path: Path) -> None:
    """Deployments are keyed by (site, deployment): a second site's StationA does not move the first one's, each
    site's records are placed at its own StationA, and the export names both."""
    from shared.envelope import MessageKind, seal
    from shared.keys import public_key_to_pem
    from shared.protocol import DetectionRecord, encode_detection
    from shared.topics import detection_topic

    from coordinator.detections import DetectionIngestor
    from coordinator.registry import SiteRegistry
    from coordinator.web.formats import camtrap_dp_files
    from coordinator.web.views import DetectionFilter

    # Prepare: two enrolled sites, each with a package whose one deployment is called StationA, 130 km apart
    store = Store("sqlite://", tmp_path / "data")
    registry = SiteRegistry(store)
    keys = {site: generate_signing_key() for site in ("north", "south")}
    for site, key in keys.items():
        registry.enrol(site, public_key_to_pem(key.public_key()))
    truth = {"north": (3.5, -77.2), "south": (2.3, -77.4)}
    # Execute
    for site, (lat, lon) in truth.items():
        assert import_camtrap_dp(store, _station(tmp_path / site, lat, lon, "Panthera onca"), TABLE,
                                 site_id=site) == 1
    ingest = DetectionIngestor(federation_id="f", store=store, registry=registry)
    for seq, site in enumerate(truth, start=1):
        rec = DetectionRecord(media_id=f"{seq:032x}", file="IMG_1.JPG", deployment_id="StationA",
                              timestamp="2024-05-01T06:00:00+00:00", timestamp_source="exif", width=4, height=3)
        env = seal(private_key=keys[site], federation_id="f", site_id=site, round=0, base_model_hash="",
                   kind=MessageKind.DETECTION, sequence=seq, payload=encode_detection(rec))
        assert ingest.handle(detection_topic("f", site), env.to_bytes()).status == "stored"
    # Assert: two rows, each at its own coordinates, each with its own site's one record
    ranger = Viewer(store, Role.RANGER, policy=LocationPolicy(), secret=SECRET, category_of=TABLE)
    shown = {(d["site_id"], d["deployment_id"]): d for d in ranger.deployments()}
    assert set(shown) == {("north", "StationA"), ("south", "StationA")}
    for site, (lat, lon) in truth.items():
        assert (shown[site, "StationA"]["latitude"], shown[site, "StationA"]["longitude"]) == (lat, lon)
        assert shown[site, "StationA"]["detections"] == 1
    records, total = ranger.detections(DetectionFilter())
    assert total == 2
    assert {r["site_id"]: (r["latitude"], r["longitude"]) for r in records} == truth
    # re-importing north's package moves nothing of south's
    assert import_camtrap_dp(store, tmp_path / "north", TABLE, site_id="north") == 1
    assert {(d["site_id"], d["latitude"]) for d in ranger.deployments()} == {("north", 3.5), ("south", 2.3)}
    deployments_csv = camtrap_dp_files(ranger)["deployments.csv"].decode().splitlines()
    assert sorted(line.split(",")[0] for line in deployments_csv[1:]) == ["north/StationA", "south/StationA"]
