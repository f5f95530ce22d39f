"""Client-id takeover and message size (docs/security.md), against a REAL Mosquitto started here on free ports with the
configuration that `wildfed-coordinator broker-config` generates: client ids are bound to credentials, and oversized
messages are refused by the broker.

* Client-id takeover: with site A's credentials, connecting ten times under the coordinator's client id (its
  username, and the ``wildfed-coordinator-<fed>`` id older versions used) must not disconnect the coordinator once,
  and every update site B sends meanwhile arrives. The broker gives the intruder the client id ``site-a`` instead
  (``use_username_as_clientid``): site A's own gateway is the one disconnected, which shows where the id went.
  (Before the fix the coordinator was disconnected by each intruder using its id.)
* Role accounts: an ingest worker beside the coordinator, and the detection publisher beside a gateway, have
  accounts of their own and do not disconnect each other.
* Size: a 100 MB publish, and one whose payload alone is the broker's packet limit, never reach the subscriber
  (the sender gets a TransportError); a payload of the limit less ``MQTT_PUBLISH_OVERHEAD`` still does.

Skipped without the mosquitto binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES, MQTT_PUBLISH_OVERHEAD, load_broker_credentials
from shared.errors import ConfigError
from shared.keys import generate_signing_key, public_key_to_pem
from shared.topics import detection_topic, update_topic

from coordinator.broker_config import generate_broker_config
from coordinator.registry import SiteRegistry
from coordinator.storage import Store
from coordinator.transport.mqtt import transport_from_config as coordinator_transport
from edge_sdk.config import SiteConfig
from edge_sdk.uplink.site_transport import transport_from_config as site_transport
from tests.support import free_port
from edge_sdk.uplink.transport import TransportError
from tests.coordinator.helpers import make_config

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
FED = "f"
UPDATES = f"wildfed/v1/{FED}/site/+/update"


def _wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"mosquitto does not listen on {port}")


class Inbox:
    """What a subscriber received, with a condition to wait on."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._cond:
            self.messages.append((topic, payload))
            self._cond.notify_all()

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.messages), timeout=timeout_s)

    def payloads(self) -> list[bytes]:
        with self._cond:
            return [p for _, p in self.messages]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    tmp = tmp_path_factory.mktemp("sessions")
    registry = SiteRegistry(Store("sqlite://", tmp / "data"))
    for site in ("a", "b"):
        registry.enrol(site, public_key_to_pem(generate_signing_key().public_key()))
    port = free_port()
    result = generate_broker_config(registry=registry, federation_id=FED, out=tmp / "broker", tls_port=free_port(),
                                    bind_address="127.0.0.1", loopback_port=port, persistence=False,
                                    ingest_workers=1, broker_user="root" if os.geteuid() == 0 else None)
    proc = subprocess.Popen([MOSQUITTO, "-c", str(result.conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
    except RuntimeError:
        proc.kill()
        raise
    yield result, port
    proc.terminate()
    proc.wait(10)


def _coordinator_config(tmp_path: Path, broker):
    result, port = broker
    return make_config(tmp_path, federation_id=FED, broker_url=f"mqtt://127.0.0.1:{port}",
                       broker_password_file=str(result.coordinator_credentials))


def _site_config(tmp_path: Path, broker, site: str) -> SiteConfig:
    result, port = broker
    return SiteConfig(federation_id=FED, site_id=site, task="radiomap", dataset=tmp_path, private_key=tmp_path / "k",
                      coordinator_public_key=tmp_path / "c", outbox=tmp_path / "o",
                      broker_url=f"mqtt://127.0.0.1:{port}", broker_password_file=result.site_credentials[site])


def _subscribed(inbox: Inbox, sender, topic: str) -> None:
    """Wait until ``inbox`` receives what ``sender`` publishes on ``topic`` (the coordinator transport does not wait
    for its SUBACK): probe, and wait on the inbox, until one probe is through."""
    for n in range(50):
        probe = f"probe-{n}".encode()
        sender.publish(topic, probe, timeout_s=5)
        if inbox.wait_for(lambda ms: any(p == probe for _, p in ms), timeout_s=0.2):
            return
    raise AssertionError("the subscription never became active")


def _intruder(port: int, client_id: str, username: str, password: str) -> paho.Client:
    """A bare paho client connected with ``client_id`` and someone's credentials (waits for its CONNACK)."""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
    client.username_pw_set(username, password)
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set() if not rc.is_failure else None
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    assert connected.wait(10), "the broker did not accept the intruder's credentials"
    return client


def test_site_credentials_cannot_take_over_the_coordinators_session(broker, tmp_path: Path) -> None:
    # Prepare: the coordinator (built from its config), an honest gateway B publishing, site A's own gateway
    result, port = broker
    coordinator = coordinator_transport(_coordinator_config(tmp_path, broker))
    inbox = Inbox()
    coordinator.subscribe(UPDATES, inbox)
    coordinator.connect()
    assert coordinator.client_id == "coordinator-f"  # client id = username
    gateway_b = site_transport(_site_config(tmp_path, broker, "b"))
    gateway_b.connect(timeout_s=10)
    gateway_a = site_transport(_site_config(tmp_path, broker, "a"))
    gateway_a.connect(timeout_s=10)
    _subscribed(inbox, gateway_b, update_topic(FED, "b"))
    creds_a = load_broker_credentials(result.site_credentials["a"])
    stolen_ids = [coordinator.client_id, f"wildfed-coordinator-{FED}"]  # today's and the old predictable id
    try:
        # Execute: ten connections with site A's credentials under the coordinator's client ids, while B uploads
        sent = []
        for attempt in range(10):
            intruder = _intruder(port, stolen_ids[attempt % 2], creds_a.username, creds_a.password)
            payload = f"update-{attempt}".encode()
            gateway_b.publish(update_topic(FED, "b"), payload, timeout_s=10)
            sent.append(payload)
            intruder.disconnect()
            intruder.loop_stop()
        # Assert: every update arrived (messages of one connection arrive in order, so once the last is in, a
        # takeover would have been seen), and the coordinator was never disconnected
        assert inbox.wait_for(lambda ms: sent[-1] in [p for _, p in ms], timeout_s=20)
        assert [p for p in inbox.payloads() if p.startswith(b"update-")] == sent
        assert coordinator.disconnects == 0
        # ... the intruder was given client id "site-a": it took over site A's own session (at least the first
        # time; the gateway then reconnects with a back-off of its own, so later intrusions may find it away)
        assert gateway_a.disconnects >= 1
        assert gateway_b.disconnects == 0
    finally:
        for t in (gateway_a, gateway_b, coordinator):
            t.close()


def test_role_accounts_do_not_disconnect_their_identity(broker, tmp_path: Path) -> None:
    # Prepare: the coordinator and its ingest worker; a gateway and its detection publisher
    config = _coordinator_config(tmp_path, broker)
    coordinator, worker = coordinator_transport(config), coordinator_transport(config, role="ingest-1")
    assert (coordinator.client_id, worker.client_id) == ("coordinator-f", "coordinator-f@ingest-1")
    seen_by_coordinator, seen_by_worker = Inbox(), Inbox()
    coordinator.subscribe(f"wildfed/v1/{FED}/site/+/#", seen_by_coordinator)
    worker.subscribe(UPDATES, seen_by_worker)
    site = _site_config(tmp_path, broker, "a")
    gateway, detector = site_transport(site), site_transport(site, role="detect")
    try:
        for t in (coordinator, worker):
            t.connect()
        gateway.connect(timeout_s=10)
        detector.connect(timeout_s=10)
        _subscribed(seen_by_worker, gateway, update_topic(FED, "a"))
        _subscribed(seen_by_coordinator, detector, detection_topic(FED, "a"))
        # Execute: both clients of each identity publish and receive at once
        gateway.publish(update_topic(FED, "a"), b"update", timeout_s=10)
        detector.publish(detection_topic(FED, "a"), b"detection", timeout_s=10)
        # the detect account may write only detections: a forged update is dropped by the ACL
        detector.publish(update_topic(FED, "a"), b"forged by detect", timeout_s=10)
        gateway.publish(update_topic(FED, "a"), b"last", timeout_s=10)
        # Assert
        assert seen_by_worker.wait_for(lambda ms: b"last" in [p for _, p in ms], timeout_s=10)
        assert seen_by_coordinator.wait_for(lambda ms: b"last" in [p for _, p in ms], timeout_s=10)
        assert b"detection" in seen_by_coordinator.payloads()
        assert b"forged by detect" not in seen_by_coordinator.payloads() + seen_by_worker.payloads()
        assert [t.disconnects for t in (coordinator, worker, gateway, detector)] == [0, 0, 0, 0]
    finally:
        for t in (detector, gateway, worker, coordinator):
            t.close()
    # A worker without an account of its own is refused before it connects (it would take the coordinator's)
    with pytest.raises(ConfigError, match="no broker account for role 'ingest-7'") as info:
        coordinator_transport(config, role="ingest-7")
    assert info.value.field == "broker_password_file" and "broker-config" in info.value.fix


def test_the_broker_refuses_oversized_messages(broker, tmp_path: Path) -> None:
    # Prepare
    coordinator = coordinator_transport(_coordinator_config(tmp_path, broker))
    inbox = Inbox()
    coordinator.subscribe(UPDATES, inbox)
    coordinator.connect()
    gateway = site_transport(_site_config(tmp_path, broker, "b"))
    gateway.connect(timeout_s=10)
    topic = update_topic(FED, "b")
    _subscribed(inbox, gateway, topic)
    fits = b"f" * (DEFAULT_BROKER_MAX_PACKET_BYTES - MQTT_PUBLISH_OVERHEAD)  # payload + the MQTT header fit
    try:
        # Execute: 100 MB, then a payload as large as the whole packet limit: the broker drops the sender
        for size in (100_000_000, DEFAULT_BROKER_MAX_PACKET_BYTES):
            with pytest.raises(TransportError):
                gateway.publish(topic, b"x" * size, timeout_s=60)
            gateway.connect(timeout_s=20)  # the transport reconnects by itself; wait for it
        gateway.publish(topic, fits, timeout_s=20)
        gateway.publish(topic, b"sentinel", timeout_s=10)
        # Assert: what one connection sends arrives in order, so once the sentinel is in, nothing else will be
        assert inbox.wait_for(lambda ms: b"sentinel" in [p for _, p in ms], timeout_s=20)
        sizes = [len(p) for p in inbox.payloads() if not p.startswith(b"probe-")]
        assert sizes == [len(fits), len(b"sentinel")]
        assert coordinator.disconnects == 0 and gateway.disconnects == 2
    finally:
        gateway.close()
        coordinator.close()


def test_the_acl_lets_models_reach_only_their_site_and_health_records_only_the_coordinator(broker,
                                                                                         tmp_path: Path) -> None:
    from shared.topics import health_filter, health_topic, model_chunk_topic, model_filter, model_topic

    # Prepare: the coordinator releases (retained) a model to a, in two chunks, and one to b
    coordinator = coordinator_transport(_coordinator_config(tmp_path, broker))
    health = Inbox()
    coordinator.subscribe(health_filter(FED), health)
    coordinator.connect()
    released = {model_topic(FED, "a"): b"manifest-a", model_chunk_topic(FED, "a", 0): b"chunk-a-0",
                model_chunk_topic(FED, "a", 1): b"chunk-a-1", model_topic(FED, "b"): b"model-b"}
    gateway = site_transport(_site_config(tmp_path, broker, "a"))
    try:
        for topic, payload in released.items():
            coordinator.publish(topic, payload, retain=True)
        # Execute: gateway a connects later and subscribes to its own model topics and to b's
        models = Inbox()
        gateway.connect(timeout_s=10)
        gateway.subscribe(model_filter(FED, "a"), models)
        gateway.subscribe(model_filter(FED, "b"), models)
        _subscribed(health, gateway, health_topic(FED, "a"))
        gateway.publish(health_topic(FED, "b"), b"forged health of b", timeout_s=10)
        gateway.publish(health_topic(FED, "a"), b"health of a", timeout_s=10)
        # Assert: a got its three retained messages and none of b's; b's health topic is not a's to write
        assert models.wait_for(lambda ms: len(ms) >= 3, timeout_s=10)
        assert health.wait_for(lambda ms: b"health of a" in [p for _, p in ms], timeout_s=10)
        assert sorted(models.messages) == sorted((t, p) for t, p in released.items() if "/site/a/" in t)
        assert b"forged health of b" not in health.payloads()
    finally:
        for topic in released:  # the broker keeps retained messages for the module's other tests: clear them
            coordinator.publish(topic, b"", retain=True)
        gateway.close()
        coordinator.close()
