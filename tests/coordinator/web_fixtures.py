"""A coordinator state for the web-view tests: accounts of every role, deployments (the real Wildlife Insights
"cristales" project when ../shared/data is present, else two synthetic ones, imported as site-a's), and detection
records that came in through the verified ingest path (signed by enrolled sites), plus one forged record that ingest
rejected.

Species categories are the IUCN Red List statuses of these species (Tayassu pecari VU, Tapirus terrestris VU,
Cuniculus paca LC, Dasypus novemcinctus LC, Pecari tajacu LC; Panthera onca NT).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from argon2 import PasswordHasher

from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic

from coordinator.config import CoordinatorConfig, config_from_dict
from coordinator.detections import DetectionIngestor, StoredDetection
from coordinator.inbound.reject import Rejected
from coordinator.registry import SiteRegistry
from coordinator.storage import Store
from coordinator.web.auth import AccountStore
from coordinator.web.deployments import import_camtrap_dp, import_wildlife_insights, species_table_categories
from coordinator.web.location_privacy import haversine_m
from tests.support import SHARED_DATA

FED = "wf-web"
DATA_ROOT = SHARED_DATA
WI_CRISTALES = DATA_ROOT / "wildlife-insights" / "cristales"
SPECIES = [("Tayassu pecari", "VU"), ("Tapirus terrestris", "VU"), ("Cuniculus paca", "LC"),
           ("Dasypus novemcinctus", "LC"), ("Pecari tajacu", "LC"), ("Panthera onca", "NT")]
PASSWORDS = {"olga": "operator-password-1", "rita": "ranger-password-1", "paul": "partner-password-1",
             "pia": "public-password-1"}
ROLES = {"olga": "operator", "rita": "ranger", "paul": "partner", "pia": "public"}
#: Cheap Argon2id parameters for tests (the app's default is argon2-cffi's RFC 9106 profile).
HASHER = PasswordHasher(time_cost=1, memory_cost=64, parallelism=1)
FORGED_SPECIES = "Forged forgery"


@dataclass
class WebState:
    """What :func:`seed` built: the config, store, deployments (id -> (lat, lon, sensitive?), all of them site
    ``deployments_site``'s: deployments are keyed by site, so site-b's records are unplaced), and the ids of the
    stored detection rows by media id (``detections``: row ids, as rangers name them; ``refs``: as partners and the
    public name them, coordinator.web.views.Viewer.record_ref)."""

    config: CoordinatorConfig
    store: Store
    deployments: dict[str, tuple[float, float, bool]]
    detections: dict[str, int] = field(default_factory=dict)
    real_data: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # media id -> "site~media", how partners name a record
    deployments_site: str = "site-a"


def _synthetic_package(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\n"
                                          "dep-river,river crossing,-2.3301,34.8302\n"
                                          "dep-ridge,ridge trail,-2.3555,34.8801\n")
    (root / "observations.csv").write_text("observationID,deploymentID,scientificName\n"
                                           "o1,dep-river,Tayassu pecari\no2,dep-ridge,Cuniculus paca\n")
    return root


def _real_deployments() -> dict[str, tuple[float, float, bool]]:
    """Coordinates and protection of the cristales deployments, read here with the csv module (independently
    of the importer): protected when any image of the deployment, or of a deployment within 1000 m (the
    radius), is of a VU/EN/CR species of SPECIES."""
    sensitive_names = {n for n, c in SPECIES if c in ("VU", "EN", "CR")}
    sens: set[str] = set()
    with (WI_CRISTALES / "images.csv").open(newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if f"{r['genus'].strip()} {r['species'].strip()}" in sensitive_names:
                sens.add(r["deployment_id"])
    with (WI_CRISTALES / "deployments.csv").open(newline="", encoding="utf-8") as f:
        coords = {r["deployment_id"]: (float(r["latitude"]), float(r["longitude"])) for r in csv.DictReader(f)}
    return {d: (lat, lon, any(haversine_m(lat, lon, *coords[o]) <= 1000.0 for o in sens))
            for d, (lat, lon) in coords.items()}


def record(media: str, deployment: str, species: str | None, *, when: str, conf: float = 0.9,
           boxes: int = 1) -> DetectionRecord:
    """A detection record of a 400x300 image with ``boxes`` boxes of ``species``."""
    dets = tuple(Detection("animal", conf - 0.1 * i, (0.1 + 0.2 * i, 0.2, 0.25, 0.4), species,
                           0 if species else None, 0.8 if species else None) for i in range(boxes))
    return DetectionRecord(media_id=media, file=f"{deployment}/IMG_{media[:4]}.JPG", deployment_id=deployment,
                           timestamp=when, timestamp_source="exif", width=400, height=300, detections=dets,
                           detector="yolox_tiny_640:abc", classifier_hash="")


def seed(tmp_path: Path, *, real_data: bool = True, unknown_species: str = "ne") -> WebState:
    """Build the state (module docstring); real Wildlife Insights deployments when present and ``real_data``;
    ``unknown_species`` is the config's ``web.unknown_species``."""
    # unknown_species ne: the real projects record ~40 species and this table lists 6; the default (protect, fail
    # closed) would protect every place, so it is tested on its own (test_web_app)
    cfg = config_from_dict({"federation_id": FED, "data_dir": str(tmp_path / "data"),
                            "web": {"unknown_species": unknown_species},
                            "species": [{"scientific_name": n, "class_index": i, "iucn_category": c}
                                        for i, (n, c) in enumerate(SPECIES)]}).resolved(tmp_path)
    store = Store(cfg.database_url or "", cfg.data_dir)
    accounts = AccountStore(store, hasher=HASHER)
    for user, role in ROLES.items():
        accounts.create(user, PASSWORDS[user], role)
    category_of = species_table_categories(cfg.species)
    use_real = real_data and WI_CRISTALES.is_dir()
    state_site = WebState.deployments_site
    registry = SiteRegistry(store)
    keys = {site: generate_signing_key() for site in ("site-a", "site-b")}
    for site, key in keys.items():
        registry.enrol(site, public_key_to_pem(key.public_key()))
    if use_real:
        import_wildlife_insights(store, WI_CRISTALES, category_of, site_id=state_site)
        deployments = _real_deployments()
    else:
        import_camtrap_dp(store, _synthetic_package(tmp_path / "pkg"), category_of, site_id=state_site)
        deployments = {"dep-river": (-2.3301, 34.8302, True), "dep-ridge": (-2.3555, 34.8801, False)}
    sensitive = sorted(d for d, (_, _, s) in deployments.items() if s)
    plain = sorted(d for d, (_, _, s) in deployments.items() if not s)
    state = WebState(cfg, store, deployments, real_data=use_real)
    ingest = DetectionIngestor(federation_id=FED, store=store, registry=registry)
    plan = [  # (media, site, deployment, species, capture time)
        ("a1" * 16, "site-a", sensitive[0], "Tayassu pecari", "2024-03-05T06:12:00-05:00"),
        ("a2" * 16, "site-a", sensitive[0], "Cuniculus paca", "2024-03-18T22:40:00-05:00"),
        ("a3" * 16, "site-a", plain[0] if plain else sensitive[0], "Cuniculus paca", "2024-04-02T03:05:00-05:00"),
        ("b1" * 16, "site-b", plain[0] if plain else sensitive[-1], "Dasypus novemcinctus",
         "2024-04-20T19:30:00-05:00"),
        ("b2" * 16, "site-b", plain[0] if plain else sensitive[-1], None, "2024-05-01T12:00:00-05:00"),
    ]
    for seq, (media, site, dep, species, when) in enumerate(plan, start=1):
        rec = record(media, dep, species, when=when, boxes=2 if media.startswith("a1") else (0 if species is None
                                                                                                else 1))
        raw = seal(private_key=keys[site], federation_id=FED, site_id=site, round=0, base_model_hash="",
                   kind=MessageKind.DETECTION, sequence=seq, payload=encode_detection(rec),
                   timestamp=1_700_000_000_000 + seq).to_bytes()
        result = ingest.handle(detection_topic(FED, site), raw)
        assert isinstance(result, StoredDetection), result
    # a record signed by a key that is not site-a's: ingest rejects it, so no view may ever show it
    forged = record("f0" * 16, sensitive[0], FORGED_SPECIES, when="2024-03-06T00:00:00-05:00")
    raw = seal(private_key=generate_signing_key(), federation_id=FED, site_id="site-a", round=0, base_model_hash="",
               kind=MessageKind.DETECTION, sequence=99, payload=encode_detection(forged),
               timestamp=1_700_000_000_099).to_bytes()
    assert isinstance(ingest.handle(detection_topic(FED, "site-a"), raw), Rejected)

    from coordinator.storage import DetectionRow
    with store.session() as s:
        state.detections = {r.media_id: r.id for r in s.query(DetectionRow)}
        state.refs = {r.media_id: f"{r.site_id}~{r.media_id}" for r in s.query(DetectionRow)}
    return state
