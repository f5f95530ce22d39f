"""A broker whose packet limit is below the configured one, against a REAL Mosquitto started here on a free port with
``max_packet_size 100000`` while both configs keep ``broker_max_packet_bytes`` at its default (1,115,136): the
start-up check passes, and the broker closes the connection on every message over 100,000 bytes.

* Gateway: a 134 KB update (smaller than one 262,144-byte chunk, so sent whole) was "dropped before the PUBACK" 233
  times and never given up. Now the agent (real EdgeAgent, real MqttTransport) gives it up on the
  ``max_chunk_requests``-th drop in a row (3 here) with an error naming ``chunk_size_bytes`` and
  ``broker_max_packet_bytes``; a message that large is then refused without being sent (no further disconnect),
  and small messages still get through.
* Coordinator: a task chunk over the limit disconnected the coordinator 163 times in 100 s (paho re-sends it after
  every reconnect) and it received no site's traffic meanwhile. Now, after ``max_drops`` (3) drops in a row with
  that message in flight, paho's copies of it are dropped, the error naming ``transfer.chunk_size_bytes`` and
  ``broker_max_packet_bytes`` is logged, the link stays up, a site's update published afterwards arrives, and a
  later publish of the same size is not sent.

Skipped without the mosquitto binary.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES

from coordinator.transport.mqtt import MqttTransport as CoordinatorTransport
from coordinator.transport.mqtt import transport_from_config as coordinator_transport
from edge_sdk.agent import EdgeAgent
from edge_sdk.config import load_site_config
from edge_sdk.uplink.site_transport import transport_from_config
from edge_sdk.uplink.transport import MessageRefusedError, TransportError
from shared.keys import generate_signing_key

from tests.coordinator.helpers import make_config

from tests.gateway_backend import GATEWAY_BACKEND
from tests.support import camera_site, free_port, poll_until

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
LIMIT = 100_000  # the broker's real max_packet_size, below what the configs say


@pytest.fixture()
def broker(tmp_path: Path):
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_packet_size {LIMIT}\n"
                    "persistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert poll_until(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 10), "mosquitto did not start"
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


class Inbox:
    """A plain paho subscriber: what it received, with a condition to wait on."""

    def __init__(self, port: int, topic: str) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"inbox-{port}-{id(self)}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=1)
        assert self._subscribed.wait(10)

    def _on_message(self, client, userdata, message) -> None:  # noqa: ANN001
        with self._cond:
            self.messages.append((message.topic, bytes(message.payload)))
            self._cond.notify_all()

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.messages), timeout=timeout_s)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_gateway_gives_up_an_update_the_broker_keeps_disconnecting_it_for(broker: int, tmp_path: Path) -> None:
    # Prepare: a site whose config keeps broker_max_packet_bytes at its default and the default chunk size
    root = tmp_path / "site"
    camera_site(root, "g1", generate_signing_key(), broker_url=f"mqtt://127.0.0.1:{broker}",
                max_chunk_requests=3, backend=GATEWAY_BACKEND)  # it trains nothing: any backend that imports
    config = load_site_config(root / "site.yaml")
    assert config.chunk_size_bytes == 262_144 and config.broker_max_packet_bytes == DEFAULT_BROKER_MAX_PACKET_BYTES
    transport = transport_from_config(config)
    agent = EdgeAgent.from_config(config, transport=transport)
    agent.start()
    topic = "wildfed/v1/testfed/site/g1/update"
    inbox = Inbox(broker, topic)
    update = bytes(134_000)  # < one chunk: sent whole; > the broker's 100,000 bytes
    agent.outbox.put("update/r0", topic, update)
    try:
        # Execute: the agent re-sends it, as it does on every reconnect
        for attempt in (1, 2):
            assert agent.resend_pending() == 0
            assert agent.outbox.count() == 1 and agent.stats["uploads_abandoned"] == 0  # not yet: 2 drops
            assert poll_until(lambda: transport.disconnects == attempt, 20)
            transport.connect(timeout_s=20)  # the transport reconnects by itself; wait for it
        assert agent.resend_pending() == 0
        # Assert: the 3rd drop in a row (max_chunk_requests) gives the update up, naming the settings
        assert agent.stats["uploads_abandoned"] == 1 and agent.outbox.count() == 0
        reason = " ".join(agent.outbox.get_state("abandoned/update/r0").split())
        assert "134000-byte message" in reason and "3 time(s) in a row" in reason
        assert "chunk_size_bytes" in reason and "broker_max_packet_bytes" in reason
        assert str(DEFAULT_BROKER_MAX_PACKET_BYTES) in reason
        # the largest chunk that fits the configured limit: 1,115,136 - 40 - 256
        assert "now 1114840 at most" in reason
        # a message that large is refused without being sent: no 4th disconnect
        assert poll_until(lambda: transport.disconnects == 3, 20)
        transport.connect(timeout_s=20)
        with pytest.raises(MessageRefusedError):
            transport.publish(topic, bytes(140_000))
        with pytest.raises(TransportError):  # MessageRefusedError is a TransportError: old callers still cope
            transport.publish(topic, update)
        # and the link carries everything else
        transport.publish(topic, b"small")
        assert inbox.wait_for(lambda ms: (topic, b"small") in ms)
        assert transport.disconnects == 3
        assert not [p for _, p in inbox.messages if len(p) > LIMIT]
    finally:
        inbox.close()
        agent.close()


def test_coordinator_stops_resending_a_task_message_the_broker_refuses(broker: int, tmp_path: Path, caplog) -> None:
    # Prepare: the coordinator's transport from its config (broker_max_packet_bytes and the chunk size at their
    # defaults, transfer.max_dropped_sends 3) and a subscriber
    config = make_config(tmp_path, federation_id="f", broker_url=f"mqtt://127.0.0.1:{broker}",
                         transfer={"max_dropped_sends": 3})
    assert config.transfer.chunk_size_bytes == 262_144
    assert config.broker_max_packet_bytes == DEFAULT_BROKER_MAX_PACKET_BYTES
    coordinator = coordinator_transport(config)
    assert isinstance(coordinator, CoordinatorTransport) and coordinator.refusals.max_drops == 3
    updates = Inbox(broker, "wildfed/v1/f/site/+/update")
    received: list[tuple[str, bytes]] = []
    coordinator.subscribe("wildfed/v1/f/site/+/update", lambda t, p: received.append((t, p)))
    coordinator.connect()
    task_topic = "wildfed/v1/f/site/a/task"
    tasks = Inbox(broker, task_topic)
    site = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="site-a")
    site.connect("127.0.0.1", broker)
    site.loop_start()
    try:
        # Execute: a 262,144-byte task chunk (the default chunk size), over the broker's 100,000 bytes
        with caplog.at_level(logging.ERROR, logger="coordinator.transport.mqtt"):
            coordinator.publish(task_topic, bytes(262_144))  # returns: it never raises for this
            # Assert: 3 drops in a row (max_drops), then paho's copy is dropped and the link stays up
            assert poll_until(lambda: coordinator.refused == 1, 20), coordinator.disconnects
            assert poll_until(lambda: coordinator._connected.is_set(), 20)
        disconnects = coordinator.disconnects
        assert disconnects == 3
        errors = " ".join(" ".join(r.getMessage() for r in caplog.records).split())
        assert "262144-byte message to wildfed/v1/f/site/a/task" in errors and "3 time(s) in a row" in errors
        assert "transfer.chunk_size_bytes" in errors and "broker_max_packet_bytes" in errors
        # a site's update published now reaches the coordinator (before: it received nothing meanwhile)
        site.publish("wildfed/v1/f/site/a/update", b"update", qos=1).wait_for_publish(10)
        assert poll_until(lambda: ("wildfed/v1/f/site/a/update", b"update") in received, 20)
        # a resend of the same chunk (a stalled download's request) is not sent: no new disconnect
        coordinator.publish(task_topic, bytes(262_144))
        assert coordinator.refused == 2
        coordinator.publish(task_topic, b"small task")
        assert tasks.wait_for(lambda ms: (task_topic, b"small task") in ms)
        assert coordinator.disconnects == disconnects
        assert not [p for _, p in tasks.messages if len(p) > LIMIT]
    finally:
        site.disconnect()
        site.loop_stop()
        tasks.close()
        updates.close()
        coordinator.close()
