"""Chunk sizes the broker refuses, and a gateway that missed the open round, through the real agent
(edge_sdk.agent.EdgeAgent) and the real coordinator (coordinator.service.Coordinator) on the in-process bus.

Chunks the broker drops:
* start-up: a chunk size that does not fit the broker's limit is refused when the site config and the coordinator
  config are loaded (and by the CLIs), naming ``chunk_size_bytes`` and the limit; the largest size that fits is
  worked out by hand (limit - 40 bytes of chunk header - 256 bytes of MQTT header);
* a link that, like a broker with a smaller limit than configured, drops every message over 8,000 bytes: the
  gateway's full 8 KiB upload chunks never arrive; once ``max_chunk_requests`` (3) receipts list a chunk sent before
  the probe they answer, the gateway gives the upload up with an error naming ``chunk_size_bytes`` (each such
  chunk was sent exactly 3 times: first, then on 2 receipts), and its task download of 16 KiB chunks is given up
  the same way (the coordinator sent each chunk 3 times: on the connect's request, then on 2 stalled requests).

A gateway that missed the open round:
* its outbox drains (the update of a round that closed meanwhile is NACKed as late) while it stays connected:
  it then asks for the open round's task and trains it (before the fix it asked only on connect);
* it connects with an update in the outbox that never drains: it asks for the open round's task anyway.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared.envelope import Envelope, MessageKind
from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.transfer import Chunk, is_chunk

from coordinator.config import load_config
from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from edge_sdk.agent import EdgeAgent
from edge_sdk.uplink.uploader import update_message_id
from edge_sdk.config import load_site_config
from tests.coordinator.helpers import make_config
from tests.gateway_backend import TORCH_INSTALLED
from tests.support import camera_site, poll_until

needs_coordinator_artifacts = pytest.mark.skipif(
    not TORCH_INSTALLED, reason="the site trains the in-process coordinator's model versions: with torch, or with "
    "ONNX Runtime on artifacts the coordinator makes with torch; torch is absent here (the Python 3.11 run covers it)")


WIDE = {"COLUMNS": "400"}  # rich must not wrap what the tests read


def _words(text: str) -> str:
    return " ".join(text.split())


class Link:
    """An edge Transport on the coordinator's bus standing for the broker: a message over ``max_bytes`` is
    acknowledged and dropped (Mosquitto's ``message_size_limit``, EMQX), and ``drop(topic, payload)`` drops
    anything else a test wants lost. ``sent`` records every payload the gateway handed over, ``delivered`` every
    payload that reached the gateway."""

    def __init__(self, bus: InMemoryTransport, *, max_bytes: int | None = None) -> None:
        self.bus = bus
        self.max_bytes = max_bytes
        self.drop = lambda topic, payload: False
        self.sent: list[tuple[str, bytes]] = []
        self.listeners = []

    def _lost(self, topic: str, payload: bytes) -> bool:
        return (self.max_bytes is not None and len(payload) > self.max_bytes) or self.drop(topic, payload)

    def connect(self, timeout_s: float = 10.0) -> None:
        for listener in self.listeners:
            listener()

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        self.sent.append((topic, bytes(payload)))
        if not self._lost(topic, payload):
            self.bus.publish(topic, payload)

    def subscribe(self, topic_filter: str, callback) -> None:
        self.bus.subscribe(topic_filter, lambda t, p: None if self._lost(t, p) else callback(t, p))

    def add_connect_listener(self, listener) -> None:
        self.listeners.append(listener)

    def close(self) -> None:
        pass


def _world(tmp_path: Path, *, site_settings: dict, transfer: dict | None = None, max_bytes: int | None = None,
           rounds: int = 1):
    key = generate_signing_key()
    bus = InMemoryTransport()
    config = make_config(tmp_path, rounds=rounds, round_deadline_s=60.0, local_steps=2, expected_batch_size=2,
                         num_classes=2, ship_ort_artifacts=False,
                         budget={"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0},
                         transfer=transfer or {"chunk_size_bytes": 4096})  # task manifests fit 8,000 bytes
    coord = Coordinator(config, transport=bus, signing_key=key)
    root = tmp_path / "site"
    site_key = camera_site(root, "g1", key, **site_settings)
    coord.enrol("g1", public_key_to_pem(site_key.public_key()), {"capacity": 8, "categories": ["VU", "NT"]})
    coord.start()
    link = Link(bus, max_bytes=max_bytes)
    return coord, bus, link, root


# ---- chunks the broker drops: start-up validation --------------------------------------------------------------
def test_site_config_refuses_chunks_over_the_brokers_limit(tmp_path: Path) -> None:
    from edge_sdk.cli import app

    site = {"federation_id": "f", "site_id": "a", "task": "radiomap", "dataset": "d", "private_key": "k",
            "coordinator_public_key": "c", "outbox": "o", "chunk_size_bytes": 1 << 20,
            "broker_max_packet_bytes": 1_000_000}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    # the loader: 1,000,000 - 40 - 256 = 999,704 is the largest chunk that fits
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert info.value.field == "chunk_size_bytes"
    assert "1000000" in info.value.message and "broker_max_packet_bytes" in info.value.message
    assert "at most 999704" in info.value.fix
    assert load_site_config(path, {"chunk_size_bytes": 999_704}).chunk_size_bytes == 999_704
    with pytest.raises(ConfigError):
        load_site_config(path, {"chunk_size_bytes": 999_705})
    # the default limit (what broker-config writes) takes the largest allowed chunk, 1 MiB
    assert load_site_config(path, {"broker_max_packet_bytes": 1_115_136}).chunk_size_bytes == 1 << 20
    # the CLI says the same and exits 2 before connecting to anything
    result = CliRunner().invoke(app, ["run", "--config", str(path)], env=WIDE)
    assert result.exit_code == 2
    assert "chunk_size_bytes" in _words(result.output) and "999704" in _words(result.output)


def test_coordinator_config_refuses_chunks_over_the_brokers_limit(tmp_path: Path) -> None:
    from coordinator.cli import app

    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump({"federation_id": "f", "broker_max_packet_bytes": 1_000_000,
                                    "transfer": {"chunk_size_bytes": 1 << 20}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "transfer.chunk_size_bytes" in str(info.value) and "at most 999704" in str(info.value)
    result = CliRunner().invoke(app, ["broker-config", "--out", str(tmp_path / "b"), "--config", str(path)], env=WIDE)
    assert result.exit_code == 2 and "transfer.chunk_size_bytes" in _words(result.output)


# ---- chunks the broker drops: asked for again and again -----------------------------------------------------------
def test_resend_tracker_counts_receipts_against_what_was_sent_before_their_probe() -> None:
    from shared.transfer import ResendTracker

    t = ResendTracker(limit=2)
    t.sent("x", [0, 1, 2])  # the first send
    for _ in range(3):  # a burst of three reconnects: three probes, nothing sent in between
        t.probed("x")
    # the three receipts list 0 and 1 (2 arrived): only the first answers a probe that followed their sending
    assert [t.answered("x", [0, 1]) for _ in range(3)] == [None, None, None]
    assert (t.receipts("x", 0), t.receipts("x", 1), t.receipts("x", 2)) == (1, 1, 0)
    t.sent("x", [0, 1])  # answer to the receipts
    t.probed("x")
    assert t.answered("x", [1]) == (1, 2)  # 0 arrived; 1 was listed twice after being sent: the limit
    assert t.answered("y", [5]) is None  # a receipt without a probe counts nothing
    t.forget("x")
    assert t.receipts("x", 1) == 0
    with pytest.raises(ValueError):
        ResendTracker(limit=1)


@needs_coordinator_artifacts
def test_gateway_gives_up_an_upload_whose_chunks_the_broker_drops(tmp_path: Path) -> None:
    # Prepare: 8 KiB chunks (the head model's update, about 11 KB, makes two), which a broker taking at most 8,000
    # bytes drops when full; the config claims the default limit
    coord, bus, link, root = _world(tmp_path, max_bytes=8000, site_settings={
        "chunk_size_bytes": 8192, "resend_interval_s": 0.2, "max_chunk_requests": 3})
    ctx = coord.rounds.open_round()  # the gateway asks for the task when it connects
    agent = EdgeAgent.from_config(root / "site.yaml", transport=link)
    # Execute: run returns once the round is trained and the outbox is empty
    trained = agent.run(max_rounds=1, idle_timeout_s=60)
    # Assert
    assert trained == 1 and agent.outbox.count() == 0 and agent.stats["uploads_abandoned"] == 1, agent.stats
    reason = agent.outbox.get_state(f"abandoned/{update_message_id(ctx.round)}")
    assert "chunk_size_bytes (8192)" in reason and "broker_max_packet_bytes" in reason
    chunks = [Chunk.from_bytes(p, max_data_bytes=8192) for t, p in link.sent if is_chunk(p)]
    full = Counter(c.index for c in chunks if len(c.data) == 8192)  # the ones over 8,000 bytes
    assert full and set(full.values()) == {3}  # each sent 3 times (max_chunk_requests), then given up
    assert coord.store.count_updates() == 0 and "g1" not in ctx.accepted
    assert coord.ledger.events("g1", IUCNCategory.VU) == []  # nothing arrived, nothing was released
    agent.close()
    coord.close()


@needs_coordinator_artifacts
def test_gateway_gives_up_a_task_download_whose_chunks_the_broker_drops(tmp_path: Path) -> None:
    # Prepare: the coordinator's task chunks are 8 KiB (the head model's task, about 11 KB, makes two); the broker
    # takes at most 8,000 bytes
    coord, bus, link, root = _world(tmp_path, max_bytes=8000, transfer={"chunk_size_bytes": 8192},
                                    site_settings={"resend_interval_s": 0.2, "max_chunk_requests": 3})
    coord.rounds.open_round()  # its task goes out before the gateway connects, which then asks for it
    agent = EdgeAgent.from_config(root / "site.yaml", transport=link)
    before = len(bus.published)
    runner = threading.Thread(target=agent.run, kwargs={"idle_timeout_s": 60})
    runner.start()
    try:
        # Execute / Assert: the stalled download is asked for again, twice, then given up
        assert poll_until(lambda: agent.stats["downloads_abandoned"] == 1, 60)
    finally:
        agent.stop()
        runner.join(timeout=30)
    task_chunks = [Chunk.from_bytes(p, max_data_bytes=8192) for t, p in bus.published[before:]
                   if t.endswith("/g1/task") and is_chunk(p)]
    assert Counter(c.index for c in task_chunks)[0] == 3  # on the connect's request, then on 2 more receipts
    assert agent.stats["tasks_trained"] == 0 and not agent._downloads
    agent.close()
    coord.close()


# ---- a gateway that missed the open round ----------------------------------------------------------------------
@needs_coordinator_artifacts
def test_gateway_asks_for_the_open_round_when_its_outbox_drains(tmp_path: Path) -> None:
    # Prepare: round 0's update is lost on the way while the gateway stays connected; round 0 closes without it,
    # and round 1's task is lost too (the gateway was unreachable for it)
    coord, bus, link, root = _world(tmp_path, rounds=2, site_settings={"resend_interval_s": 0.3})
    block = {"updates": True, "tasks": False}
    link.drop = lambda t, p: (block["updates"] and t.endswith("/update") and not _is_receipt(p)) or \
        (block["tasks"] and t.endswith("/task"))
    agent = EdgeAgent.from_config(root / "site.yaml", transport=link)
    runner = threading.Thread(target=agent.run, kwargs={"idle_timeout_s": 60})
    ctx0 = coord.rounds.open_round()
    runner.start()
    try:
        assert poll_until(lambda: agent.stats["tasks_trained"] == 1, 60)
        assert coord.rounds.close_round(ctx0).accepted == ()
        block["tasks"] = True
        ctx1 = coord.rounds.open_round()
        assert ctx1 is not None and ctx1.round == ctx0.round + 1
        block.update(updates=False, tasks=False)  # the link is whole again; no reconnect happens
        # Execute: the periodic resend of round 0's update is NACKed as late: the outbox drains
        # Assert: the gateway then asks for, trains and delivers round 1
        assert coord.rounds.wait_for_quorum(ctx1, timeout_s=60)
    finally:
        agent.stop()
        runner.join(timeout=30)
    assert agent.stats["acks_refused"] == 1 and agent.stats["tasks_trained"] == 2
    assert coord.rounds.close_round(ctx1).accepted == ("g1",)
    agent.close()
    coord.close()


@needs_coordinator_artifacts
def test_gateway_asks_for_the_open_round_on_connect_even_with_updates_pending(tmp_path: Path) -> None:
    # Prepare: an update of the first round that never gets through (no answer ever comes) is in the outbox
    coord, bus, link, root = _world(tmp_path, rounds=2, site_settings={})
    link.drop = lambda t, p: t.endswith("/update") and not _is_receipt(p) and _round(p) == 1  # round 1 is the first
    first = EdgeAgent.from_config(root / "site.yaml", transport=link)
    ctx0 = coord.rounds.open_round()
    assert first.run(max_rounds=1, idle_timeout_s=0.5) == 1 and first.outbox.count() == 1
    first.close()
    coord.rounds.close_round(ctx0)
    ctx1 = coord.rounds.open_round()  # its task goes out while the gateway is down
    # Execute: the gateway restarts and connects, round 0's update still pending
    agent = EdgeAgent.from_config(root / "site.yaml", transport=link)
    runner = threading.Thread(target=agent.run, kwargs={"idle_timeout_s": 60})
    runner.start()
    try:
        assert coord.rounds.wait_for_quorum(ctx1, timeout_s=60)
        assert poll_until(lambda: agent.stats["acks_accepted"] == 1, 60)  # its ACK is handled on the agent's thread
    finally:
        agent.stop()
        runner.join(timeout=30)
    # Assert: the open round trained and delivered; the first round's update is still waiting in the outbox
    assert [e.message_id for e in agent.outbox.pending()] == [update_message_id(ctx0.round)]
    assert coord.rounds.close_round(ctx1).accepted == ("g1",)
    agent.close()
    coord.close()


def _is_receipt(payload: bytes) -> bool:
    try:
        return Envelope.from_bytes(payload).header.kind == MessageKind.RECEIPT
    except Exception:  # noqa: BLE001 - a chunk
        return False


def _round(payload: bytes) -> int | None:
    """The round of an update envelope or manifest; None for a chunk."""
    if is_chunk(payload):
        return None
    return Envelope.from_bytes(payload).header.round
