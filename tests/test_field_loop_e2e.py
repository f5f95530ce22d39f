"""The field loop through real processes: photos dropped into a gateway's incoming folder are detected and
classified by a `wildfed-edge run` process, a ranger reviews them in a real headless Chromium on the gateway's
review page (corrects one event, confirms another), and the next round trains on exactly those two verified records:
the coordinator's stored update counts 2 and its ledger records the sampling rate B / N = 1 / 2 that only N = 2
gives. A client subscribed to every topic of the federation sees only signed envelopes (tasks, updates, acks,
receipts, detection records) and retained presence: no byte of any photo crosses the wire.

Real detector (YOLOX-tiny; skipped when its weights cannot be fetched), real backbone, the embedded broker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key
from shared.protocol import decode_detection
from shared.transfer import is_chunk

from tests.browser_support import LAUNCH_ARGS, UvicornServer, require_chromium

pytestmark = [pytest.mark.slow, pytest.mark.browser]

sync_api, CHROMIUM = require_chromium()

REPO = Path(__file__).resolve().parents[1]
PHOTOS = {"cam1": "2480.jpg", "cam2": "9455.jpg"}  # a Virginia opossum and an American black bear (ENA24)
SPECIES = ["Didelphis virginiana", "Sciurus niger", "Ursus americanus", "Corvus brachyrhynchos",
           "Mephitis mephitis", "Urocyon cinereoargenteus"]  # all LC: one CCDP category, one anchor rate
PASSWORD = "correct horse battery"


@pytest.fixture(scope="module")
def detector_weights() -> None:
    from edge_sdk.inference.weights import WeightsUnavailableError, detector_checkpoint

    try:
        detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        pytest.skip(f"the detector's weights cannot be fetched here: {exc}")


class Sniffer:
    """Every message on the federation's topics, as the broker delivers it."""

    def __init__(self, url: str, federation_id: str) -> None:
        import paho.mqtt.client as mqtt

        host, port = url.removeprefix("mqtt://").split(":")
        self.messages: list[tuple[str, bytes]] = []
        self._ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sniffer")
        self.client.on_connect = lambda c, *_: c.subscribe(f"wildfed/v1/{federation_id}/#", qos=1)
        self.client.on_subscribe = lambda *_: self._ready.set()
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, bytes(m.payload)))
        self.client.connect(host, int(port))
        self.client.loop_start()
        assert self._ready.wait(20), "the sniffer could not subscribe"

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _wait(condition: Any, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
          log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the gateway exited ({proc.returncode}): {log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.2)


@pytest.fixture
def federation(tmp_path: Path, detector_weights: None) -> Iterator[dict[str, Any]]:
    from coordinator.config import config_from_dict
    from coordinator.service import Coordinator
    from edge_sdk.config import global_model_path, load_site_config
    from edge_sdk.global_model import save_global_model
    from shared.models.kinds import model_spec
    from wildfed_sim.embedded_broker import embedded_broker

    fed = "field-e2e"
    coord_key = generate_signing_key()
    save_private_key(coord_key, tmp_path / "coordinator" / "keys" / "coordinator.key")
    coord_pub = save_public_key(coord_key.public_key(), tmp_path / "coordinator" / "keys" / "coordinator.pub")
    site_key = generate_signing_key()
    save_private_key(site_key, tmp_path / "site" / "keys" / "site.key")
    with embedded_broker(log_path=tmp_path / "broker.log") as url:
        site_cfg = {"federation_id": fed, "site_id": "site-1", "dataset": "camtrap-dp", "incoming": "incoming",
                    "species": [{"scientific_name": n, "class_index": i, "iucn_category": "LC"}
                                for i, n in enumerate(SPECIES)],
                    "num_classes": len(SPECIES), "private_key": "keys/site.key",
                    "coordinator_public_key": str(coord_pub), "broker_url": url, "outbox": "state/outbox.sqlite",
                    "backend": "torch", "threads": 1,
                    # a round-0 head names no species above 0.5: show every arg-max so a ranger can confirm one
                    "field": {"poll_interval_s": 0.5, "settle_s": 0.5, "confidence_threshold": 0.0}}
        site_yaml = tmp_path / "site" / "site.yaml"
        site_yaml.write_text(yaml.safe_dump(site_cfg))
        config = load_site_config(site_yaml)
        weights = model_spec("head", len(SPECIES), adapter_width=0).initial_weights(7)
        # the model the gateway holds from an earlier round (what a task leaves it): the coordinator's start
        save_global_model(global_model_path(config), weights, round_=0, model_hash_hex=model_hash(weights),
                          backbone_id=config.backbone_id)
        coordinator_cfg = config_from_dict({
            "federation_id": fed, "data_dir": str(tmp_path / "coordinator"), "broker_url": url,
            "signing_key_path": str(tmp_path / "coordinator" / "keys" / "coordinator.key"),
            "public_key_path": str(coord_pub), "rounds": 1, "round_deadline_s": 120, "local_steps": 1,
            "expected_batch_size": 1, "learning_rate": 1.0, "privacy": "ccdp", "model": "head",
            "adapter_width": 0, "num_classes": len(SPECIES)}).resolved(tmp_path)
        sniffer = Sniffer(url, fed)
        log = tmp_path / "gateway.log"
        with log.open("wb") as out:
            gateway = subprocess.Popen([sys.executable, "-m", "edge_sdk.cli", "run", "--config", str(site_yaml),
                                        "--ready-file", str(tmp_path / "ready")], stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        try:
            with Coordinator(coordinator_cfg, initial_weights=weights) as coordinator:
                coordinator.enrol("site-1", public_key_to_pem(site_key.public_key()), {"capacity": 2})
                _wait(lambda: (tmp_path / "ready").exists(), 180, "the gateway to connect", gateway, log)
                yield {"config": config, "coordinator": coordinator, "sniffer": sniffer, "gateway": gateway,
                       "log": log, "incoming": Path(config.incoming)}
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
            sniffer.stop()


def _review(config: Any, correct_to: str) -> None:
    """A ranger logs in, corrects the first listed event to ``correct_to`` and confirms the next one."""
    from edge_sdk.review.accounts import ReviewAccounts
    from edge_sdk.review.app import create_app
    from edge_sdk.site_paths import review_accounts_path

    accounts = ReviewAccounts(review_accounts_path(config))
    accounts.create("rita", PASSWORD)
    accounts.close()
    server = UvicornServer(create_app(config)).start()
    pw = sync_api.sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"{server.base}/events")
        page.fill("#username", "rita")
        page.fill("#password", PASSWORD)
        with page.expect_navigation():
            page.click("#login-button")
        with page.expect_navigation():
            page.click("table#events tr[data-event] a.open")
        page.select_option("#species-select", correct_to)
        with page.expect_navigation():
            page.click("#species-save")  # on to the next unreviewed event
        with page.expect_navigation():
            page.click("#confirm")
        assert page.get_attribute("#summary", "data-reviewed") == "2"
        browser.close()
    finally:
        pw.stop()
        server.stop()


def test_photos_in_verdicts_on_the_gateway_a_round_on_exactly_those_records(federation: dict[str, Any]) -> None:
    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from edge_sdk.field.store import FieldStore
    from edge_sdk.site_paths import field_index_path
    from coordinator.storage import UpdateRow
    from sqlalchemy import select

    config, coordinator = federation["config"], federation["coordinator"]
    photos = {}
    for camera, name in PHOTOS.items():
        src = REPO / "wildfed_sim" / "assets" / "ena24" / name
        photos[name] = src.read_bytes()
        (federation["incoming"] / camera).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, federation["incoming"] / camera / name)

    store_path = field_index_path(config)
    _wait(lambda: store_path.exists() and FieldStore(store_path).counts()["media"] == 2, 240,
          "the gateway to store both photos", federation["gateway"], federation["log"])
    store = FieldStore(store_path)
    events = store.events(reviewed=None)
    assert len(events) == 2 and all(e.status == "confident" for e in events)  # threshold 0: every arg-max named
    first = store.events(order="uncertain")[0]
    predicted = SPECIES[first.species_index]
    correct_to = next(n for n in SPECIES if n != predicted)
    store.close()
    assert len(load_camtrap_dp(config.dataset, config.species_table)) == 0  # nothing verified yet

    _review(config, correct_to)
    data = load_camtrap_dp(config.dataset, config.species_table)
    assert len(data) == 2 and SPECIES.index(correct_to) in data.labels.tolist()

    (result,) = list(coordinator.iter_rounds(1))
    assert result.accepted == ("site-1",) or list(result.accepted) == ["site-1"]
    with coordinator.store.session() as s:
        (update,) = s.scalars(select(UpdateRow)).all()
    assert update.num_examples == 2
    round_, events_by_category = coordinator.ledger.last_round_events("site-1")
    assert round_ == result.round and set(events_by_category) == {IUCNCategory.LC}
    assert events_by_category[IUCNCategory.LC].sampling_rate == pytest.approx(1 / 2)  # B / N, B = 1: N = 2

    messages = federation["sniffer"].messages
    kinds = set()
    for topic, payload in messages:
        for photo in photos.values():
            for start in range(0, len(photo) - 64, max(1, len(photo) // 8)):
                assert photo[start:start + 64] not in payload, f"photo bytes on {topic}"
        if topic.endswith("/status"):
            continue  # the gateway's retained presence: {"site_id", "state"}
        assert not is_chunk(payload), "nothing here is large enough to be chunked"
        env = Envelope.from_bytes(payload)
        kinds.add(env.header.kind)
        if env.header.kind == MessageKind.DETECTION:
            record = decode_detection(env.payload)
            assert record.media_id in set(data.media_ids)
    # besides tasks, updates and detection records: the coordinator's model releases and the gateway's health
    # records (public operational metadata, docs/privacy.md), none carrying photo bytes (checked above)
    assert kinds <= {MessageKind.TASK, MessageKind.UPDATE, MessageKind.ACK, MessageKind.RECEIPT,
                     MessageKind.DETECTION, MessageKind.MODEL, MessageKind.HEALTH}
    assert {MessageKind.DETECTION, MessageKind.UPDATE} <= kinds
    assert np.isfinite(events_by_category[IUCNCategory.LC].noise_multiplier)
