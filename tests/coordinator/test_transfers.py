"""Chunked, resumable uploads and downloads (shared.transfer, coordinator.transfers, the agent's side).

What is checked, each against values worked out independently (sizes by hand, FedAvg in closed form):
* the manifest/chunk format: split then assemble gives the bytes back; inconsistent manifests, oversized chunks
  and altered chunks are refused with their reason;
* a round whose two updates arrive chunked closes with the FedAvg of the two deltas, each update accepted once;
* resume: half the chunks, then a ``resume`` manifest, gets a signed RECEIPT listing exactly the other half; sending
  those completes the update, and the chunks sent over the whole transfer are n, not 2n; a transfer staged on disk
  also resumes after the coordinator restarts (chunk files and manifest row), one staged in memory starts over;
* chunk staging holds uploads in memory while their announced sizes fit its limit, and stages the others on disk;
* a resume manifest for an update already stored is ACKed again and never aggregated twice;
* incomplete transfers expire; a message over the size limit is refused before parsing;
* a real EdgeAgent and a real Coordinator, both with 1 KiB chunks, run a round through a lossy link that drops
  chunks of the task and of the update: the agent's receipt and the coordinator's receipt fill the gaps.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from shared.envelope import Envelope, MessageKind
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import decode_ack
from shared.topics import ack_topic, update_topic
from shared.transfer import (NO_TRANSFER, CHUNK_HEADER_LENGTH, Chunk, Manifest, TransferError, assemble, check_chunk,
                             decode_manifest, decode_receipt, encode_manifest, is_chunk, send, split)

from coordinator.ingest import Rejected, RejectReason
from coordinator.service import Coordinator
from coordinator.staging import StagingLimits
from coordinator.storage import TransferRow
from coordinator.transport import InMemoryTransport
from tests.support import camera_site
from tests.coordinator.helpers import EVENT, FakeSite, make_config

CHUNK = 1024


def model() -> dict[str, np.ndarray]:
    """A float32 model of 4,098 values (16,392 bytes): big enough for 17+ chunks of 1 KiB."""
    return {"phi.w": np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64),
            "psi.b": np.array([0.5, -0.5], np.float32)}


# ---- the format ------------------------------------------------------------------------------------------------
def test_split_and_assemble_round_trip_with_hand_counted_sizes() -> None:
    data = bytes(range(256)) * 10 + b"x"  # 2,561 bytes -> chunks of 1,024, 1,024, 513
    manifest, chunks = split(data, 1024, kind=MessageKind.UPDATE)
    assert manifest.num_chunks == 3 and [len(c.data) for c in chunks] == [1024, 1024, 513]
    assert manifest.transfer_id == hashlib.sha256(data).hexdigest()
    assert manifest.chunk_sha256[2] == hashlib.sha256(data[2048:]).hexdigest()
    wire = [Chunk.from_bytes(c.to_bytes(), max_data_bytes=1024) for c in chunks]
    assert all(is_chunk(c.to_bytes()) for c in chunks) and len(chunks[0].to_bytes()) == CHUNK_HEADER_LENGTH + 1024
    for c in wire:
        check_chunk(manifest, c)
    assert assemble(manifest, [c.data for c in wire]) == data
    assert decode_manifest(encode_manifest(manifest)) == manifest


def test_bad_manifests_and_chunks_are_refused_with_their_reason() -> None:
    manifest, chunks = split(b"a" * 3000, 1024, kind="update")
    with pytest.raises(TransferError, match="lists 2 chunk digests") as info:
        Manifest(manifest.transfer_id, MessageKind.UPDATE, 3000, 1024, manifest.chunk_sha256[:2])
    assert info.value.reason == "bad_manifest"
    with pytest.raises(TransferError) as info:
        Chunk.from_bytes(chunks[0].to_bytes(), max_data_bytes=512)
    assert info.value.reason == "oversized"
    altered = Chunk(manifest.transfer_id, 1, b"b" * 1024)
    with pytest.raises(TransferError) as info:
        check_chunk(manifest, altered)
    assert info.value.reason == "chunk_digest"
    with pytest.raises(TransferError, match="has 1000 bytes"):
        check_chunk(manifest, Chunk(manifest.transfer_id, 0, b"a" * 1000))
    with pytest.raises(TransferError, match="outside"):
        check_chunk(manifest, Chunk(manifest.transfer_id, 3, b"a"))


# ---- the coordinator's receiver --------------------------------------------------------------------------------
def coordinator(tmp_path: Path, bus: InMemoryTransport, key, **overrides) -> Coordinator:
    overrides = {"budget": {"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0},
                 "ship_ort_artifacts": False, **overrides}
    config = make_config(tmp_path, rounds=1, round_deadline_s=5.0, **overrides)
    coord = Coordinator(config, transport=bus, signing_key=key, initial_weights=model())
    coord.start()
    return coord


def site(bus: InMemoryTransport, key, name: str, value: float, n: int) -> FakeSite:
    return FakeSite(name, bus, key.public_key(), value=value, num_examples=n, events={IUCNCategory.VU: EVENT})


class ChunkingBus(InMemoryTransport):
    """The in-process bus, but every site message on an update topic is sent as ``shared.transfer.send`` would:
    a manifest and 1 KiB chunks (FakeSite publishes whole envelopes)."""

    def __init__(self, keys: dict[str, object]) -> None:
        super().__init__()
        self.keys = keys

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        if topic.endswith("/update") and not is_chunk(payload) and Envelope.from_bytes(payload).header.kind == \
                MessageKind.UPDATE:
            site_id = topic.split("/")[-2]
            send(super().publish, topic, payload, private_key=self.keys[site_id], chunk_size=CHUNK)
            return
        super().publish(topic, payload, qos)


def test_a_round_of_chunked_updates_closes_with_their_fedavg(tmp_path: Path) -> None:
    key = generate_signing_key()
    sites = {}
    bus = ChunkingBus({})
    coord = coordinator(tmp_path, bus, key)
    for name, value, n in (("s1", 1.0, 30), ("s2", -2.0, 10)):
        s = site(bus, key, name, value, n).attach()
        coord.enrol(name, s.public_pem, {"num_examples": n, "categories": ["VU"]})
        bus.keys[name] = s.key
        sites[name] = s
    result = coord.run_round()
    assert result.status == "closed" and result.accepted == ("s1", "s2")
    # FedAvg by hand: (30 * 1 + 10 * -2) / 40 = 0.25 added to every weight
    _, after = coord.rounds.current_model()
    for name, w in model().items():
        np.testing.assert_allclose(after[name], w + 0.25, rtol=0, atol=1e-6)
    chunks = [p for t, p in bus.published if t.endswith("/update") and is_chunk(p)]
    assert len(chunks) >= 2 * 17 and all(s.acks[-1].accepted for s in sites.values())
    with coord.store.session() as s:
        assert s.query(TransferRow).count() == 0  # staging dropped once ingested
    assert not any((coord.store.data_dir / "transfers").glob("*/*.part"))
    coord.close()


def _open_round(tmp_path: Path, key, bus, **overrides):
    coord = coordinator(tmp_path, bus, key, **overrides)
    s = site(bus, key, "s1", 1.0, 20)  # not attached: the test sends its update by hand
    coord.enrol("s1", s.public_pem, {"num_examples": 20, "categories": ["VU"]})
    ctx = coord.rounds.open_round()
    assert ctx is not None
    raw = s.envelope(ctx.round, ctx.model_hash, s.payload({k: np.full_like(v, 1.0) for k, v in model().items()}))
    return coord, s, ctx, raw


def _receipts(bus: InMemoryTransport, site_id: str, key):
    out = []
    for topic, payload in bus.published:
        if topic == ack_topic("testfed", site_id):
            env = Envelope.from_bytes(payload)
            if env.header.kind == MessageKind.RECEIPT:
                out.append(decode_receipt(env.payload))
    return out


def test_resume_manifest_gets_a_receipt_of_exactly_the_missing_chunks(tmp_path: Path) -> None:
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    manifest, chunks = split(raw, CHUNK, kind=MessageKind.UPDATE)
    n = manifest.num_chunks
    sent: list[bytes] = []

    def lossy(t, p):  # the first pass loses every chunk whose index is not a multiple of 3
        sent.append(p)
        if not is_chunk(p) or Chunk.from_bytes(p, max_data_bytes=CHUNK).index % 3 == 0:
            bus.publish(t, p)

    send(lossy, topic, raw, private_key=s.key, chunk_size=CHUNK)
    missing = tuple(i for i in range(n) if i % 3)
    # reconnect: a resume manifest only
    send(bus.publish, topic, raw, private_key=s.key, chunk_size=CHUNK, resume=True)
    receipts = _receipts(bus, "s1", key)
    assert len(receipts) == 1 and receipts[0].transfer_id == manifest.transfer_id
    assert receipts[0].missing == missing
    # the site sends exactly those; the update is accepted once
    resent = []
    send(lambda t, p: (resent.append(p), bus.publish(t, p)), topic, raw, private_key=s.key, chunk_size=CHUNK,
         missing=receipts[0].missing)
    assert len(resent) == len(missing)
    assert len([p for p in sent if is_chunk(p)]) + len(resent) == n + len(missing)  # n sent once, the lost again
    assert "s1" in ctx.accepted and ctx.strategy.count == 1
    acks = [decode_ack(Envelope.from_bytes(p).payload) for t, p in bus.published
            if t == ack_topic("testfed", "s1") and Envelope.from_bytes(p).header.kind == MessageKind.ACK]
    assert [a.accepted for a in acks] == [True]
    # the ACK is lost; the site resumes again: the stored update is ACKed again, never aggregated twice
    send(bus.publish, topic, raw, private_key=s.key, chunk_size=CHUNK, resume=True)
    acks = [Envelope.from_bytes(p) for t, p in bus.published
            if t == ack_topic("testfed", "s1") and Envelope.from_bytes(p).header.kind == MessageKind.ACK]
    assert len(acks) == 2 and decode_ack(acks[-1].payload).accepted
    assert acks[-1].header.sequence == Envelope.from_bytes(raw).header.sequence  # bound to the upload
    assert ctx.strategy.count == 1 and coord.store.count_updates() == 1
    coord.close()


@pytest.mark.parametrize("staged", ["on_disk", "in_memory"])
def test_resume_after_a_coordinator_restart(tmp_path: Path, staged: str) -> None:
    """A transfer staged on disk (larger than ``spill_above_bytes``; here 0) has its manifest row and chunk files: a
    restarted receiver (same store) answers the resume manifest with the chunks it is still missing, not with all
    of them. A transfer staged in memory is forgotten by the restart: the receipt lists every chunk, and the chunks
    the site then sends complete it (the update is accepted once)."""
    key = generate_signing_key()
    bus = InMemoryTransport()
    spill = 0 if staged == "on_disk" else 1 << 20
    coord, s, ctx, raw = _open_round(tmp_path, key, bus, transfer={"spill_above_bytes": spill})
    topic = update_topic("testfed", "s1")
    manifest, chunks = split(raw, CHUNK, kind=MessageKind.UPDATE)
    n = manifest.num_chunks
    send(lambda t, p: bus.publish(t, p) if not is_chunk(p) or Chunk.from_bytes(p, max_data_bytes=CHUNK).index < 5
         else None, topic, raw, private_key=s.key, chunk_size=CHUNK)
    with coord.store.session() as db:
        assert db.query(TransferRow).count() == (1 if staged == "on_disk" else 0)
    assert coord.transfers.staging.memory_bytes == (0 if staged == "on_disk" else 5 * CHUNK)
    from coordinator.transfers import TransferLimits, TransferReceiver

    restarted = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                 ingestor=coord.ingestor, transport=bus, signing_key=key,
                                 limits=TransferLimits(spill_above_bytes=spill))
    restarted.handle(topic, _resume(raw, s.key))
    receipts = _receipts(bus, "s1", key)
    expect_missing = tuple(range(5, n)) if staged == "on_disk" else tuple(range(n))
    assert receipts[-1].missing == expect_missing
    send(restarted.handle, topic, raw, private_key=s.key, chunk_size=CHUNK, missing=receipts[-1].missing)
    assert "s1" in ctx.accepted and ctx.strategy.count == 1 and coord.store.count_updates() == 1
    with coord.store.session() as db:
        assert db.query(TransferRow).count() == 0
    assert not (coord.store.data_dir / "transfers" / manifest.transfer_id).exists()
    coord.close()


def test_staging_in_memory_spills_to_disk_past_its_limit(tmp_path: Path) -> None:
    """With room in memory for one upload (its announced size is reserved at its manifest), the first upload is held
    in memory (no row, no file) and the second, announced meanwhile, is staged on disk with its manifest row, so a
    restarted receiver asks only for its missing chunks. Once the first is in, its room serves the next upload."""
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s1, ctx, raw1 = _open_round(tmp_path, key, bus)
    others = {}
    for name in ("s2", "s3"):
        others[name] = site(bus, key, name, 1.0, 20)
        coord.enrol(name, others[name].public_pem, {"num_examples": 20, "categories": ["VU"]})
    ctx.selected = frozenset({"s1", "s2", "s3"})
    raws = {"s1": raw1, **{name: _update_of(s, ctx) for name, s in others.items()}}
    keys = {"s1": s1.key, **{name: s.key for name, s in others.items()}}
    out: dict[str, list[bytes]] = {}
    for name, raw in raws.items():
        out[name] = []
        send(lambda t, p, name=name: out[name].append(p), update_topic("testfed", name), raw,
             private_key=keys[name], chunk_size=CHUNK)
    manifest = {name: split(raw, CHUNK, kind="update")[0] for name, raw in raws.items()}
    assert len({m.total_length for m in manifest.values()}) == 1
    size, n = manifest["s1"].total_length, manifest["s1"].num_chunks
    receiver = coord.transfers
    receiver.staging.limits = StagingLimits(memory_limit_bytes=size + 100)  # room for one upload
    staging = receiver.staging

    def handle(name: str, messages: list[bytes]) -> list[object]:
        return [receiver.handle(update_topic("testfed", name), p) for p in messages]

    def rows() -> list[str]:
        with coord.store.session() as db:
            return sorted(r.site_id for r in db.query(TransferRow))

    def folder(name: str) -> Path:
        return coord.store.data_dir / "transfers" / manifest[name].transfer_id

    # Execute 1: s1 announces and sends 2 chunks, then s2 does the same
    assert handle("s1", out["s1"][:3]) == [None] * 3
    assert handle("s2", out["s2"][:3]) == [None] * 3
    # Assert 1: s1 in memory, s2 on disk with its row
    assert (staging.reserved_bytes, staging.memory_bytes, staging.spills) == (size, 2 * CHUNK, 1)
    assert not folder("s1").exists() and sorted(p.name for p in folder("s2").glob("*.part")) == ["0.part", "1.part"]
    assert rows() == ["s2"]
    assert sorted(p[1:] for p in receiver.pending()) == [("s1", 2, n), ("s2", 2, n)]
    # a restarted receiver: s2 resumes from its files
    from coordinator.transfers import TransferReceiver

    restarted = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                 ingestor=coord.ingestor, transport=bus, signing_key=key)
    restarted.handle(update_topic("testfed", "s2"), _resume(raws["s2"], keys["s2"]))
    assert _receipts(bus, "s2", key)[-1].missing == tuple(range(2, n))
    # Execute 2: s1 completes; then s3 announces: s1's room is free again
    handle("s1", out["s1"][3:])
    assert "s1" in ctx.accepted and (staging.reserved_bytes, staging.memory_bytes) == (0, 0)
    handle("s3", out["s3"][:1])
    assert staging.reserved_bytes == size and not staging.on_disk(manifest["s3"].transfer_id) and rows() == ["s2"]
    handle("s2", out["s2"][3:])
    handle("s3", out["s3"][1:])
    # Assert 2: every update accepted once; no row, folder or memory left
    assert sorted(ctx.accepted) == ["s1", "s2", "s3"] and coord.store.count_updates() == 3
    assert rows() == [] and not folder("s2").exists() and receiver.pending() == []
    assert (staging.reserved_bytes, staging.memory_bytes, staging.spills) == (0, 0, 1)
    coord.close()


def _update_of(s: FakeSite, ctx) -> bytes:
    return s.envelope(ctx.round, ctx.model_hash, s.payload({k: np.full_like(v, 1.0) for k, v in model().items()}))


def _resume(raw: bytes, key) -> bytes:
    out = []
    send(lambda t, p: out.append(p), "x", raw, private_key=key, chunk_size=CHUNK, resume=True)
    assert len(out) == 1
    return out[0]


def test_refusals_before_any_chunk_is_kept(tmp_path: Path) -> None:
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    # over the size limit: refused before parsing
    result = coord.transfers.handle(topic, b"\x00" * (coord.transfers.limits.max_message_bytes + 1))
    assert isinstance(result, Rejected) and result.reason is RejectReason.OVERSIZED
    # a manifest for a round that is not open: NACKed, nothing staged
    wrong = s.envelope(ctx.round + 5, ctx.model_hash, s.payload({k: np.zeros_like(v) for k, v in model().items()}))
    out: list[bytes] = []
    send(lambda t, p: out.append(p), topic, wrong, private_key=s.key, chunk_size=CHUNK)
    result = coord.transfers.handle(topic, out[0])
    assert isinstance(result, Rejected) and result.reason is RejectReason.WRONG_ROUND
    assert coord.transfers.pending() == []
    assert isinstance(coord.transfers.handle(topic, out[1]), Rejected)  # its chunks: unknown transfer
    assert coord.store.rejection_counts()["unknown_transfer"] == 1
    # a manifest announcing more than max_update_bytes
    big = Manifest("ab" * 32, MessageKind.UPDATE, coord.transfers.limits.max_update_bytes + 1, 1 << 20,
                   tuple("cd" * 32 for _ in range(257)))
    from shared.transfer import seal_manifest

    env = seal_manifest(private_key=s.key, inner=Envelope.from_bytes(raw).header, manifest=big)
    result = coord.transfers.handle(topic, env.to_bytes())
    assert isinstance(result, Rejected) and result.reason is RejectReason.OVERSIZED
    # a genuine chunk sent on another site's topic
    send(lambda t, p: out.append(p), topic, raw, private_key=s.key, chunk_size=CHUNK)
    coord.transfers.handle(topic, out[-len(split(raw, CHUNK, kind="update")[1]) - 1])  # its manifest
    other = update_topic("testfed", "s2")
    result = coord.transfers.handle(other, out[-1])
    assert isinstance(result, Rejected) and result.reason is RejectReason.TOPIC_MISMATCH
    coord.close()


def test_incomplete_transfers_expire(tmp_path: Path) -> None:
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    from coordinator.transfers import TransferLimits, TransferReceiver

    now = [1.9e9]
    receiver = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                ingestor=coord.ingestor, transport=bus, signing_key=key,
                                limits=TransferLimits(ttl_s=3600.0), clock=lambda: now[0])
    topic = update_topic("testfed", "s1")
    out: list[bytes] = []
    send(lambda t, p: out.append(p), topic, raw, private_key=s.key, chunk_size=CHUNK)
    now[0] = Envelope.from_bytes(raw).header.timestamp / 1000.0
    assert receiver.handle(topic, out[0]) is None and receiver.handle(topic, out[1]) is None
    tid = split(raw, CHUNK, kind="update")[0].transfer_id
    assert receiver.pending()[0][:3] == (tid, "s1", 1)
    now[0] += 3599.0
    assert receiver.sweep() == []
    now[0] += 2.0
    assert receiver.sweep() == [tid] and receiver.pending() == []
    assert not (coord.store.data_dir / "transfers" / tid).exists()
    result = receiver.handle(topic, out[2])
    assert isinstance(result, Rejected) and result.reason is RejectReason.UNKNOWN_TRANSFER
    coord.close()


# ---- a real gateway and a real coordinator over a lossy link -----------------------------------------------------
class LossyBridge:
    """An edge Transport on the coordinator's bus that loses chunks whose index is a multiple of 4 the first time
    they are published (both directions: the gateway's uploads through ``publish``, the coordinator's task chunks
    through the subscription callback), as a field link dropping in and out would."""

    def __init__(self, bus: InMemoryTransport) -> None:
        self.bus = bus
        self.seen: set[tuple[str, int]] = set()
        self.lost = 0
        self.listeners = []
        self.dropped = threading.Event()  # set on every loss; the test's reconnect thread waits on it

    def _lose(self, payload: bytes) -> bool:
        if not is_chunk(payload):
            return False
        c = Chunk.from_bytes(payload, max_data_bytes=1 << 20)
        k = (c.transfer_id, c.index)
        if c.index % 4 == 0 and k not in self.seen:
            self.seen.add(k)
            self.lost += 1
            self.dropped.set()  # the link drops here, and comes back once the reconnect thread sees it
            return True
        return False

    def connect(self, timeout_s: float = 10.0) -> None:
        for listener in self.listeners:
            listener()

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        if not self._lose(payload):
            self.bus.publish(topic, payload)

    def subscribe(self, topic_filter: str, callback) -> None:
        self.bus.subscribe(topic_filter, lambda t, p: None if self._lose(p) else callback(t, p))

    def add_connect_listener(self, listener) -> None:
        self.listeners.append(listener)

    def close(self) -> None:
        pass


def test_gateway_and_coordinator_fill_chunk_gaps_in_both_directions(tmp_path: Path) -> None:
    from edge_sdk.agent import EdgeAgent

    key = generate_signing_key()
    bus = InMemoryTransport()
    config = make_config(tmp_path, rounds=1, round_deadline_s=60.0, local_steps=2, expected_batch_size=2,
                         num_classes=2, ship_ort_artifacts=False, transfer={"chunk_size_bytes": CHUNK})
    coord = Coordinator(config, transport=bus, signing_key=key)
    root = tmp_path / "site"
    site_key = camera_site(root, "g1", key, chunk_size_bytes=CHUNK, resend_interval_s=0.5)
    coord.enrol("g1", public_key_to_pem(site_key.public_key()), {"num_examples": 8, "categories": ["VU", "NT"]})
    bridge = LossyBridge(bus)
    agent = EdgeAgent.from_config(root / "site.yaml", transport=bridge)
    agent.start()
    stop = threading.Event()

    def reconnects() -> None:  # after each drop the link comes back (the agent then asks for what it lacks);
        while not stop.is_set():  # driven by the losses themselves, not by a clock, so load cannot reorder it
            if bridge.dropped.wait(timeout=1.0):
                bridge.dropped.clear()
                bridge.connect()

    threading.Thread(target=reconnects, daemon=True).start()
    runner = threading.Thread(target=agent.run, kwargs={"max_rounds": 1, "idle_timeout_s": 60})
    runner.start()
    try:
        result = coord.run_round()
    finally:
        runner.join(timeout=120)
        stop.set()
    assert result.status == "closed" and result.accepted == ("g1",)
    assert bridge.lost >= 2  # chunks of the task and of the update were lost once each, and filled in
    assert agent.stats["tasks_trained"] == 1 and agent.outbox.pending() == []
    assert agent.stats["uploads_resumed"] >= 1  # the update's lost chunks came on the coordinator's receipt
    gateway_receipts = [decode_receipt(Envelope.from_bytes(p).payload) for t, p in bus.published
                        if t.endswith("/g1/update") and not is_chunk(p)
                        and Envelope.from_bytes(p).header.kind == MessageKind.RECEIPT]
    assert any(r.transfer_id != NO_TRANSFER and r.missing for r in gateway_receipts)  # the task's lost chunks
    assert coord.store.count_updates() == 1 and len(coord.ledger.events("g1", IUCNCategory.VU)) == 1
    agent.close()
    coord.close()



def test_a_gateway_offline_when_the_round_opened_gets_its_task_after_connecting(tmp_path: Path) -> None:
    """The task went out while the gateway was away (clean MQTT session: the broker kept nothing for it); after
    connecting it sends a "no transfer" receipt and the coordinator resends the open round's task."""
    from edge_sdk.agent import EdgeAgent

    key = generate_signing_key()
    bus = InMemoryTransport()
    config = make_config(tmp_path, rounds=1, round_deadline_s=60.0, local_steps=2, expected_batch_size=2,
                         num_classes=2, ship_ort_artifacts=False)
    coord = Coordinator(config, transport=bus, signing_key=key)
    root = tmp_path / "site"
    site_key = camera_site(root, "late", key)
    coord.enrol("late", public_key_to_pem(site_key.public_key()), {"num_examples": 8, "categories": ["VU", "NT"]})
    coord.start()
    ctx = coord.rounds.open_round()  # the task is published now, to nobody
    assert ctx is not None
    tasks_before = sum(1 for t, _ in bus.published if t.endswith("/late/task"))
    bridge = LossyBridge(bus)
    bridge._lose = lambda payload: False  # a clean link this time
    agent = EdgeAgent.from_config(root / "site.yaml", transport=bridge)
    runner = threading.Thread(target=agent.run, kwargs={"max_rounds": 1, "idle_timeout_s": 60})
    runner.start()
    try:
        assert coord.rounds.wait_for_quorum(ctx, timeout_s=60)
        result = coord.rounds.close_round(ctx)
    finally:
        runner.join(timeout=60)
    assert result.status == "closed" and result.accepted == ("late",)
    assert sum(1 for t, _ in bus.published if t.endswith("/late/task")) > tasks_before  # resent on its receipt
    agent.close()
    coord.close()


def test_sweep_drops_staging_left_for_a_stored_update(tmp_path: Path) -> None:
    """A process killed between storing a reassembled update and deleting its chunks leaves staging behind; the
    next sweep (run at start) removes it, and leaves an unrelated transfer alone."""
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    out: list[bytes] = []
    send(lambda t, p: out.append(p), topic, raw, private_key=s.key, chunk_size=CHUNK)
    for p in out[:3]:
        assert coord.transfers.handle(topic, p) is None  # manifest + 2 chunks staged
    assert coord.ingestor.handle(topic, raw).__class__.__name__ == "Accepted"  # the whole update stored meanwhile
    tid = split(raw, CHUNK, kind="update")[0].transfer_id
    assert [p[0] for p in coord.transfers.pending()] == [tid]
    assert coord.transfers.sweep() == [] and coord.transfers.pending() == []
    assert not (coord.store.data_dir / "transfers" / tid).exists()
    coord.close()
