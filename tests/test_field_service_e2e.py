"""A reserve's two services through real processes and a real Mosquitto (started here; skipped without the binary):
a gateway (`wildfed-edge run` with an incoming folder) and the coordinator (`wildfed-coordinator service`).

Photos are copied into the gateway's incoming folder while the coordinator is down: one of them half-written when the
gateway first sees it, one copied twice under another name. The gateway stores each photo once (the half-written
one only once it is whole, under the id of its complete bytes) and publishes their signed detection records; the
broker keeps them for the coordinator's persistent session; when the coordinator is back they are stored, each
exactly once, and the rangers' web view lists them with their cameras and the time's source.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from shared.camtrap_dp import media_id
from shared.codec import encode_tensors, model_hash
from shared.keys import generate_signing_key, save_private_key

from coordinator.cli import app as coordinator_cli
from coordinator.config import load_config
from coordinator.detections import detection_counts
from coordinator.storage import Store
from tests.coordinator.helpers import tiny_weights
from tests.coordinator.test_service import Service, _no_service_left_running, broker  # noqa: F401 - fixtures
from tests.support import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "wildfed_sim" / "assets" / "ena24"
FED, SITE = "reserve", "site-7"
PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def detector_weights() -> None:
    from edge_sdk.inference.weights import WeightsUnavailableError, detector_checkpoint

    try:
        detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        pytest.skip(f"the detector's weights cannot be fetched here: {exc}")


def _coordinator(tmp_path: Path, broker_url: str, site_pub: Path) -> Path:
    runner = CliRunner()
    home = tmp_path / "fed"
    assert runner.invoke(coordinator_cli, ["init", str(home), "--federation-id", FED, "--broker", broker_url]
                         ).exit_code == 0
    config = home / "coordinator.yaml"
    data = yaml.safe_load(config.read_text())
    data.update(round_deadline_s=600.0, ship_ort_artifacts=False)
    config.write_text(yaml.safe_dump(data))
    res = runner.invoke(coordinator_cli, ["enrol", SITE, "--public-key", str(site_pub), "-c", str(config),
                                          "--metadata", '{"capacity": 10}'])
    assert res.exit_code == 0, res.output
    res = runner.invoke(coordinator_cli, ["user", "add", "rita", "--role", "ranger", "-c", str(config),
                                          "--password-stdin"], input=f"{PASSWORD}\n")
    assert res.exit_code == 0, res.output
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    store.put_model(model_hash(tiny_weights()), encode_tensors(tiny_weights()), round=0)
    store.dispose()
    return config


def _gateway(tmp_path: Path, broker_url: str, coordinator_pub: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    key = generate_signing_key()
    save_private_key(key, site / "keys" / "site.key")
    from shared.keys import save_public_key

    pub = save_public_key(key.public_key(), site / "keys" / "site.pub")
    config = {"federation_id": FED, "site_id": SITE, "dataset": "camtrap-dp", "incoming": "incoming",
              "species": [{"scientific_name": "Didelphis virginiana", "class_index": 0, "iucn_category": "LC"},
                          {"scientific_name": "Ursus americanus", "class_index": 1, "iucn_category": "LC"}],
              "private_key": "keys/site.key", "coordinator_public_key": str(coordinator_pub),
              "broker_url": broker_url, "outbox": "state/outbox.sqlite", "backend": "torch", "threads": 1,
              "field": {"poll_interval_s": 0.5, "settle_s": 1.0}}
    (site / "site.yaml").write_text(yaml.safe_dump(config))
    return site / "site.yaml", pub


def test_photos_arriving_while_the_coordinator_is_down_reach_the_web_view_once(tmp_path: Path, broker: str,
                                                                               detector_weights: None) -> None:
    from edge_sdk.config import load_site_config
    from edge_sdk.field.store import FieldStore
    from edge_sdk.site_paths import detection_queue_path, field_index_path
    from edge_sdk.uplink.outbox import Outbox

    # the coordinator runs once (its persistent session and subscriptions at the broker), then stops
    site_yaml, site_pub = _gateway(tmp_path, broker, tmp_path / "fed" / "keys" / "coordinator.pub")
    config = _coordinator(tmp_path, broker, site_pub)
    svc = Service(config)
    svc.wait_for(r"rounds: round 1 open")
    assert svc.stop() == 0, "".join(svc.lines)

    # the gateway starts while the coordinator is down
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        gateway = subprocess.Popen([sys.executable, "-m", "edge_sdk.cli", "run", "--config", str(site_yaml),
                                    "--ready-file", str(tmp_path / "ready")], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    try:
        site = load_site_config(site_yaml)
        incoming = Path(site.incoming)
        half = (ASSETS / "9455.jpg").read_bytes()  # a bear, arriving slowly over a cellular link
        (incoming / "cam2").mkdir(parents=True)
        (incoming / "cam2" / "IMG_0001.JPG").write_bytes(half[: len(half) // 2])
        (incoming / "cam1").mkdir(parents=True)
        for name in ("2480.jpg", "2595.jpg"):  # two opossum photos
            shutil.copyfile(ASSETS / name, incoming / "cam1" / name)
        shutil.copyfile(ASSETS / "2480.jpg", incoming / "cam1" / "copy-of-2480.jpg")  # the SD card read twice

        store_path = field_index_path(site)

        def stored() -> int:
            if gateway.poll() is not None:
                pytest.fail(f"the gateway exited ({gateway.returncode}):\n{log.read_text()[-3000:]}")
            return FieldStore(store_path).counts()["media"] if store_path.exists() else 0

        wait_for(lambda: stored() == 2 and not (incoming / "cam1" / "copy-of-2480.jpg").exists(), 240,
                 "the two whole photos stored and the copy removed")
        # the half-written photo settled before the others and was tried: it does not decode yet, so it waits
        wait_for(lambda: "IMG_0001.JPG does not decode yet" in log.read_text(), 60, "the half photo to be tried")
        assert (incoming / "cam2" / "IMG_0001.JPG").exists() and stored() == 2
        with (incoming / "cam2" / "IMG_0001.JPG").open("ab") as f:
            f.write(half[len(half) // 2:])  # the upload finishes
        wait_for(lambda: stored() == 3, 120, "the completed photo stored")
        ids = {media_id((ASSETS / n).read_bytes()) for n in ("2480.jpg", "2595.jpg", "9455.jpg")}
        store = FieldStore(store_path)
        assert {p.media_id for e in store.events(reviewed=None) for p in store.event_photos(e.event_id)} == ids
        wait_for(lambda: Outbox(detection_queue_path(site)).count() == 0, 120,
                 "the broker to take every detection record")
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)

    # the coordinator comes back: the broker delivers what it kept for its session, each photo stored once
    svc = Service(config)
    svc.wait_for(r"detections: (stored|duplicate) record", count=3)
    assert svc.stop() == 0, "".join(svc.lines)
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    counts = detection_counts(store)
    assert counts.rows == 3 and counts.outcomes["stored"] == 3 and counts.outcomes["duplicate"] == 0
    store.dispose()

    # the rangers' web view shows them, by camera, with where each time came from
    from coordinator.web.app import create_app

    client = TestClient(create_app(cfg), base_url="https://testserver")
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text).group(1)
    assert client.post("/login", data={"username": "rita", "password": PASSWORD, "csrf_token": token,
                                       "next": "/detections"}, follow_redirects=False).status_code == 303
    body = client.get("/api/detections").json()
    assert body["total"] == 3
    assert {item["media_id"] for item in body["items"]} == ids
    assert {item["deployment_id"] for item in body["items"]} == {f"{SITE}/cam1", f"{SITE}/cam2"}
