"""The demo's web map is built from public facts only: the deployments' coordinates from the sites' packages, and
species and IUCN categories from published detection records, never from the training records (the packages'
observations, which no DP noise covers)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic

from coordinator.detections import DetectionIngestor, StoredDetection
from coordinator.registry import SiteRegistry
from coordinator.storage import DeploymentRow, Store
from coordinator.web.auth import Role
from coordinator.web.deployments import import_camtrap_dp, species_table_categories
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.views import Viewer
from wildfed_sim.animal_mnist import SPECIES_TABLE
from wildfed_sim.camtrap_writer import write_camtrap_dp
from wildfed_sim.demo import _import_demo_deployments
from wildfed_sim.ecology import SiteSpec

FED = "demo-fed"
CR, LC = 5, 1  # Loxodonta cyclotis (CR), Passer domesticus (LC) in the demo's species table
CONFIG = SimpleNamespace(species=[SimpleNamespace(scientific_name=e.scientific_name, iucn_category=e.iucn.value)
                                  for e in SPECIES_TABLE])


def demo_site(run_dir: Path, site_id: str, labels: list[int]) -> SiteSpec:
    """A demo site's package where the demo writes it (``<run>/sites/<id>/camtrap-dp``), its training records
    labelled ``labels``."""
    n = len(labels)
    site = SiteSpec(site_id=site_id, biome="forest", species=tuple(sorted(set(labels))),
                    indices=np.arange(n, dtype=np.int64), monitoring_months=6, latitude=0.51, longitude=11.2,
                    habitat="Central African forest")
    (run_dir / "sites" / site_id).mkdir(parents=True)
    write_camtrap_dp(run_dir / "sites" / site_id / "camtrap-dp", site=site,
                     images=np.zeros((n, 28, 28), np.uint8) + np.arange(n, dtype=np.uint8)[:, None, None],
                     labels=np.array(labels, np.int64), start_time=datetime(2024, 3, 1, tzinfo=timezone.utc))
    return site


def view(store: Store, role: Role) -> dict[tuple[str, str], dict]:
    viewer = Viewer(store, role, policy=LocationPolicy(), secret=bytes(32),
                    category_of=species_table_categories(CONFIG.species))
    return {(d["site_id"], d["deployment_id"]): d for d in viewer.deployments()}


def detection(site_id: str, key, media: str, species: str) -> bytes:
    record = DetectionRecord(media_id=media, file="x.jpg", deployment_id=site_id,  # the demo's records' deployment
                             timestamp="2024-03-02T06:00:00+00:00", timestamp_source="exif", width=100, height=80,
                             detections=(Detection("animal", 0.9, (0.1, 0.2, 0.5, 0.6), species, 0, 0.8),),
                             detector="yolox_tiny", classifier_hash="c" * 64)
    return seal(private_key=key, federation_id=FED, site_id=site_id, round=0, base_model_hash="",
                kind=MessageKind.DETECTION, sequence=1, payload=encode_detection(record)).to_bytes()


def test_the_demo_map_holds_only_what_detection_records_published(tmp_path: Path) -> None:
    # Prepare: a site whose training records hold forest elephants (CR) and sparrows (LC)
    run_dir = tmp_path / "run"
    site = demo_site(run_dir, "site-00", [CR, CR, LC, LC, LC])
    store = Store("sqlite://", tmp_path / "data")
    key = generate_signing_key()
    SiteRegistry(store).enrol(site.site_id, public_key_to_pem(key.public_key()))
    # (the package's observations are the training records: imported with species, they put CR on the map)
    control = Store("sqlite://", tmp_path / "control")
    import_camtrap_dp(control, run_dir / "sites" / site.site_id / "camtrap-dp",
                      species_table_categories(CONFIG.species), site_id=site.site_id)
    assert view(control, Role.OPERATOR)[site.site_id, site.site_id]["categories"] == ["CR", "LC"]
    assert view(control, Role.PARTNER)[site.site_id, site.site_id]["fuzzed"]
    # Execute: the demo's import
    _import_demo_deployments(store, run_dir, [site], CONFIG, SimpleNamespace(log=lambda *a, **k: None))
    # Assert: coordinates and dates, no species, no categories, nothing fuzzed
    with store.session() as s:
        (row,) = s.query(DeploymentRow).all()
    assert (row.latitude, row.longitude) == (0.51, 11.2) and row.start
    assert (row.species_json, row.categories_json) == ("[]", "[]")
    shown = view(store, Role.OPERATOR)[site.site_id, site.site_id]
    assert shown["categories"] == [] and shown["unlisted_species"] == [] and shown["detections"] == 0
    assert not view(store, Role.PARTNER)[site.site_id, site.site_id]["fuzzed"]
    # Execute: the site publishes a signed detection record of a sparrow
    ingest = DetectionIngestor(federation_id=FED, store=store, registry=SiteRegistry(store))
    sparrow = SPECIES_TABLE[LC].scientific_name
    assert isinstance(ingest.handle(detection_topic(FED, site.site_id), detection(site.site_id, key, "a" * 32,
                                                                                 sparrow)), StoredDetection)
    # Assert: the map holds exactly the published record's category; the CR training records are not on it
    shown = view(store, Role.OPERATOR)[site.site_id, site.site_id]
    assert shown["categories"] == [SPECIES_TABLE[LC].iucn.value] and shown["detections"] == 1
    assert not view(store, Role.PARTNER)[site.site_id, site.site_id]["fuzzed"]
    # and a published CR detection does protect the place, as the docs declare
    elephant = SPECIES_TABLE[CR].scientific_name
    ingest.handle(detection_topic(FED, site.site_id), detection(site.site_id, key, "b" * 32, elephant))
    assert view(store, Role.OPERATOR)[site.site_id, site.site_id]["categories"] == ["CR", "LC"]
    assert view(store, Role.PARTNER)[site.site_id, site.site_id]["fuzzed"]
