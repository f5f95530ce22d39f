"""The web view shows honest times and predictions (coordinator.web.views, the detection templates): a time that
is not the camera's is flagged, an ``unknown`` species is shown as unknown (the best guess in small print, to
rangers and operators only), an ``unexpected`` one with a badge, and the gateway's event id when present (withheld
from partners and the public with the time). Records come in through the verified ingest path, signed by an
enrolled site; the expectations are written out by hand from the records made here."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic

from coordinator.detections import DetectionIngestor, StoredDetection
from coordinator.registry import SiteRegistry
from coordinator.storage import DetectionRow
from coordinator.web.app import create_app
from tests.coordinator.test_web_app import login
from tests.coordinator.web_fixtures import FED, HASHER, seed

SITE = "site-c"
BOX = (0.1, 0.2, 0.3, 0.4)
# media -> (timestamp source, species, status, species index, probability, event id); SPECIES index 0 is
# Tayassu pecari (VU), the seed's species table
PLAN = {
    "c1" * 16: ("mtime", "Cuniculus paca", "unexpected", 2, 0.91, "evt-0001"),
    "c2" * 16: ("exif", None, "unknown", 0, 0.41, "evt-0002"),
    "c3" * 16: ("run", "Dasypus novemcinctus", "confident", 3, 0.88, None),
    "c4" * 16: ("exif", "Tayassu pecari", "confident", 0, 0.95, "evt-0004"),  # sensitive: its time is withheld
}


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    st = seed(tmp_path_factory.mktemp("flags"), real_data=False)
    key = generate_signing_key()
    registry = SiteRegistry(st.store)
    registry.enrol(SITE, public_key_to_pem(key.public_key()))
    ingest = DetectionIngestor(federation_id=FED, store=st.store, registry=registry)
    for seq, (media, (source, species, status, index, prob, event)) in enumerate(PLAN.items(), start=1):
        rec = DetectionRecord(media_id=media, file=f"cam/{seq}.JPG", deployment_id="cam", width=400, height=300,
                              timestamp=f"2024-06-0{seq}T05:00:00-05:00", timestamp_source=source, event_id=event,
                              detections=(Detection("animal", 0.9, BOX, species, index, prob, status),))
        raw = seal(private_key=key, federation_id=FED, site_id=SITE, round=0, base_model_hash="",
                   kind=MessageKind.DETECTION, sequence=seq, payload=encode_detection(rec)).to_bytes()
        assert isinstance(ingest.handle(detection_topic(FED, SITE), raw), StoredDetection)
    with st.store.session() as s:
        st.detections.update({r.media_id: r.id for r in s.query(DetectionRow).filter(DetectionRow.site_id == SITE)})
    return st


@pytest.fixture(scope="module")
def clients(state):
    app = create_app(state.config, store=state.store, hasher=HASHER)
    return {user: login(app, user)[0] for user in ("rita", "paul")}


def _row(html: str, ref: int | str) -> str:
    """The <tr> of one record in the detection list."""
    m = re.search(rf'<tr data-id="{re.escape(str(ref))}".*?</tr>', html, re.S)
    assert m is not None, ref
    return m.group(0)


def _ref(state, user: str, media: str) -> int | str:
    return state.detections[media] if user == "rita" else f"{SITE}~{media}"


def test_the_list_flags_times_and_readings(clients: dict[str, TestClient], state) -> None:
    for user, client in clients.items():
        html = client.get("/detections", params={"site": SITE}).text
        c1, c2, c3 = (_row(html, _ref(state, user, m)) for m in list(PLAN)[:3])
        assert "time from the file, not the camera" in c1 and "unexpected at this site" in c1
        assert "Cuniculus paca" in c1
        assert "time-note" not in c2 and ">unknown<" in c2
        assert "time of the detection run, not of the capture" in c3 and "unexpected" not in c3
        if user == "rita":
            assert "best guess: Tayassu pecari" in c2
        else:  # a guess is no species of the record: it must not name a sensitive species to a partner
            assert "best guess" not in c2 and "Tayassu" not in c2


def test_the_detail_page_shows_the_reading_the_event_and_the_guess_to_rangers_only(
        clients: dict[str, TestClient], state) -> None:
    unknown, sensitive = list(PLAN)[1], list(PLAN)[3]
    ranger = clients["rita"].get(f"/detections/{_ref(state, 'rita', unknown)}").text
    assert "<h1>Unknown species" in ranger and "best guess: Tayassu pecari 0.41" in ranger
    assert re.search(r'<dd id="event">evt-0002</dd>', ranger)
    partner = clients["paul"].get(f"/detections/{_ref(state, 'paul', unknown)}").text
    assert "<h1>Unknown species" in partner and "best guess" not in partner and "Tayassu" not in partner
    assert re.search(r'<dd id="event">evt-0002</dd>', partner)  # its time is shown, so is its event
    api = clients["paul"].get(f"/api/detections/{_ref(state, 'paul', unknown)}").json()
    assert (api["top_species_status"], api["top_best_guess"], api["detections"][0]["best_guess"]) == (
        "unknown", None, None)
    assert api["detections"][0]["species_confidence"] is None  # the guess's probability goes with the guess
    # a Tayassu pecari (VU) record: a partner gets its date only, and not its event id (it may spell the time)
    page = clients["paul"].get(f"/detections/{_ref(state, 'paul', sensitive)}").text
    assert "evt-0004" not in page and 'id="event"' not in page and "2024-06-04T" not in page
    ranger = clients["rita"].get(f"/api/detections/{_ref(state, 'rita', sensitive)}").json()
    assert ranger["event_id"] == "evt-0004" and ranger["time_note"] is None


def test_the_api_carries_the_flags(clients: dict[str, TestClient], state) -> None:
    items = {d["media_id"]: d for d in clients["rita"].get("/api/detections", params={"site": SITE}).json()["items"]}
    assert {m: (items[m]["time_note"], items[m]["top_species_status"], items[m]["event_id"]) for m in PLAN} == {
        "c1" * 16: ("time from the file, not the camera", "unexpected", "evt-0001"),
        "c2" * 16: (None, "unknown", "evt-0002"),
        "c3" * 16: ("time of the detection run, not of the capture", "confident", None),
        "c4" * 16: (None, "confident", "evt-0004")}
    assert items["c2" * 16]["top_best_guess"] == "Tayassu pecari"
