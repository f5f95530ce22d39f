"""Chunked, resumable uploads and downloads (shared.transfer, coordinator.inbound.transfers, the agent's side).

What is checked, each against values worked out independently (sizes by hand, digests with the blake3 library,
FedAvg in closed form):
* the manifest/chunk format (transfer format 2: chunks are the payload's pieces): split then assemble gives the
  envelope back; the transfer id and the leaves match a computation by hand; inconsistent manifests, oversized
  chunks, altered chunks and retired ``WFC1`` chunks are refused with their reason;
* each payload byte is hashed once on the coordinator's chunked path (the bytes through BLAKE3 counted, and no
  SHA-256 over payload-sized data); a manifest whose leaves do not derive the signed payload digest, whose inner
  signature does not verify, or whose inner header differs from its own, is refused before any chunk is kept;
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
import json
import threading
from collections import Counter
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest

import shared.envelope
from shared.codec import encode_tensors
from shared.envelope import Envelope, EnvelopeHeader, MessageKind, payload_digest_from_leaves, seal
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import decode_ack
from shared.topics import ack_topic, task_topic, update_topic
from shared.transfer import (NO_TRANSFER, CHUNK_HEADER_LENGTH, Chunk, Manifest, TransferError, assemble, check_chunk,
                             decode_manifest, decode_receipt, encode_manifest, is_chunk, piece_size_for,
                             seal_manifest, send, split)

from coordinator.inbound.reject import Rejected, RejectReason
from coordinator.service import Coordinator
from coordinator.inbound.staging import StagingLimits
from coordinator.storage import TransferRow
from coordinator.transport import InMemoryTransport
from tests.support import camera_site
from tests.coordinator.helpers import EVENT, FakeSite, make_config

CHUNK = 1024


def model() -> dict[str, np.ndarray]:
    """A float32 model of 4,098 values (16,392 bytes): big enough for 17+ chunks of 1 KiB."""
    return {"phi.w": np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64),
            "psi.b": np.array([0.5, -0.5], np.float32)}


TRANSFER_ID_CONTEXT = "WildFed 2025-06-01 12:00:00 chunked transfer id v2"  # spelled out, not imported
KEY = generate_signing_key()


def inner(payload: bytes, piece_size: int = 1024, **fields) -> Envelope:
    kw = dict(private_key=KEY, federation_id="testfed", site_id="s1", round=0, base_model_hash="",
              kind=MessageKind.UPDATE, sequence=1, payload=payload, piece_size=piece_size)
    return seal(**{**kw, **fields})


# ---- the format ------------------------------------------------------------------------------------------------
def test_split_and_assemble_round_trip_with_hand_counted_sizes() -> None:
    # Prepare: a payload of 2,561 bytes in pieces of 1 KiB -> chunks of 1,024, 1,024, 513 bytes
    data = bytes(range(256)) * 10 + b"x"
    env = inner(data)
    # Execute
    manifest, chunks = split(env.to_bytes())
    # Assert: sizes and digests worked out by hand with the blake3 library
    assert manifest.num_chunks == 3 and [len(c.data) for c in chunks] == [1024, 1024, 513]
    assert b"".join(c.data for c in chunks) == data  # the chunks are the payload's pieces, not the wire bytes
    assert manifest.transfer_id == blake3.blake3(env.header.canonical_bytes() + env.signature,
                                                 derive_key_context=TRANSFER_ID_CONTEXT).hexdigest()
    assert manifest.leaves == (blake3.blake3(data[:1024]).digest(), blake3.blake3(data[1024:2048]).digest(),
                               blake3.blake3(data[2048:]).digest())
    assert (manifest.header, manifest.signature, manifest.chunk_size, manifest.total_length) == (
        env.header, env.signature, 1024, 2561)
    wire = [Chunk.from_bytes(c.to_bytes(), max_data_bytes=1024) for c in chunks]
    assert all(is_chunk(c.to_bytes()) for c in chunks) and len(chunks[0].to_bytes()) == CHUNK_HEADER_LENGTH + 1024
    assert chunks[0].to_bytes()[:4] == b"WFC2"
    for c in wire:
        check_chunk(manifest, c)
    assert assemble(manifest, [c.data for c in wire]) == env
    assert decode_manifest(encode_manifest(manifest)) == manifest


def test_a_payload_of_exactly_whole_pieces_and_one_of_a_single_piece() -> None:
    four = split(inner(bytes(4096)))[0]
    assert four.num_chunks == 4 and four.chunk_length(3) == 1024
    one = split(inner(b"tiny"))[0]
    assert one.num_chunks == 1 and one.leaves == (blake3.blake3(b"tiny").digest(),)


def test_an_empty_payload_is_not_chunked_it_travels_whole() -> None:
    env = inner(b"")
    with pytest.raises(TransferError, match="nothing to transfer") as info:
        split(env)
    assert info.value.reason == "bad_manifest"
    out: list[bytes] = []
    assert send(lambda t, p: out.append(p), "x", env.to_bytes(), private_key=KEY, chunk_size=1024) == 1
    assert out == [env.to_bytes()]


def test_chunks_are_views_of_their_message_and_of_the_payload_never_copies_of_a_writable_buffer() -> None:
    """A parsed chunk's data is a read-only view into the MQTT message (no 256 KiB copy per chunk) and
    ``split``'s chunks view the payload; a chunk parsed from a bytearray is a copy, unchanged when it changes."""
    payload = bytes(range(256)) * 10
    manifest, chunks = split(inner(payload))
    assert all(c.data.obj is chunks[0].data.obj for c in chunks) and b"".join(c.data for c in chunks) == payload
    raw = chunks[1].to_bytes()
    parsed = Chunk.from_bytes(raw, max_data_bytes=1024)
    assert parsed.data.obj is raw and parsed.data.readonly and parsed.data == payload[1024:2048]
    check_chunk(manifest, parsed)
    mutable = bytearray(raw)
    copied = Chunk.from_bytes(mutable, max_data_bytes=1024)
    mutable[-1] ^= 0xFF
    assert copied.data == payload[1024:2048]
    check_chunk(manifest, copied)


def test_piece_size_for_a_chunk_size_is_the_largest_power_of_two_not_above_it() -> None:
    assert [piece_size_for(n) for n in (1024, 1025, 262_144, 999_704, 1 << 20)] == [
        1024, 1024, 262_144, 524_288, 1 << 20]
    with pytest.raises(TransferError, match="chunk_size_bytes"):
        piece_size_for(1000)


def test_an_envelope_sealed_with_pieces_larger_than_the_chunk_size_is_refused_before_publishing() -> None:
    out: list[bytes] = []
    with pytest.raises(TransferError, match="piece_size") as info:
        send(lambda t, p: out.append(p), "x", inner(bytes(5000), 4096).to_bytes(), private_key=KEY, chunk_size=2048)
    assert info.value.reason == "oversized" and out == []


def test_bad_manifests_and_chunks_are_refused_with_their_reason() -> None:
    data = bytes(i * 7 % 251 for i in range(3000))  # no two pieces alike
    manifest, chunks = split(inner(data))
    with pytest.raises(TransferError, match="lists 2 piece digests") as info:
        Manifest(manifest.header, manifest.signature, manifest.leaves[:2])
    assert info.value.reason == "bad_manifest"
    with pytest.raises(TransferError, match="do not derive") as info:  # leaves of other data
        Manifest(manifest.header, manifest.signature, (manifest.leaves[0], manifest.leaves[0], manifest.leaves[2]))
    assert info.value.reason == "bad_manifest"
    with pytest.raises(TransferError) as info:  # a WFC1 chunk (transfer format 1): refused naming the fix
        Chunk.from_bytes(b"WFC1" + chunks[0].to_bytes()[4:], max_data_bytes=1024)
    assert info.value.reason == "unsupported_version" and "same WildFed release" in str(info.value)
    with pytest.raises(TransferError) as info:
        Chunk.from_bytes(chunks[0].to_bytes(), max_data_bytes=512)
    assert info.value.reason == "oversized"
    altered = Chunk(manifest.transfer_id, 1, data[1024:2047] + bytes([data[2047] ^ 1]))
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
    return FakeSite(name, bus, key.public_key(), value=value, num_examples=n, events={IUCNCategory.VU: EVENT},
                    piece_size=CHUNK)  # its updates travel in 1 KiB chunks


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
        coord.enrol(name, s.public_pem, {"capacity": n, "categories": ["VU"]})
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
    coord.enrol("s1", s.public_pem, {"capacity": 20, "categories": ["VU"]})
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
    manifest, chunks = split(raw)
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
    manifest, chunks = split(raw)
    n = manifest.num_chunks
    send(lambda t, p: bus.publish(t, p) if not is_chunk(p) or Chunk.from_bytes(p, max_data_bytes=CHUNK).index < 5
         else None, topic, raw, private_key=s.key, chunk_size=CHUNK)
    with coord.store.session() as db:
        assert db.query(TransferRow).count() == (1 if staged == "on_disk" else 0)
    assert coord.transfers.staging.memory_bytes == (0 if staged == "on_disk" else 5 * CHUNK)
    from coordinator.inbound.transfers import TransferLimits, TransferReceiver

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
        coord.enrol(name, others[name].public_pem, {"capacity": 20, "categories": ["VU"]})
    ctx.selected = frozenset({"s1", "s2", "s3"})
    raws = {"s1": raw1, **{name: _update_of(s, ctx) for name, s in others.items()}}
    keys = {"s1": s1.key, **{name: s.key for name, s in others.items()}}
    out: dict[str, list[bytes]] = {}
    for name, raw in raws.items():
        out[name] = []
        send(lambda t, p, name=name: out[name].append(p), update_topic("testfed", name), raw,
             private_key=keys[name], chunk_size=CHUNK)
    manifest = {name: split(raw)[0] for name, raw in raws.items()}
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
    assert not folder("s1").exists() and sorted(p.name for p in folder("s2").iterdir()) == ["chunks", "held"]
    s2_chunks = split(raws["s2"])[1]
    assert (folder("s2") / "held").read_bytes() == struct.pack(">II", 0, 1)  # the log: indices 0 and 1
    assert (folder("s2") / "chunks").read_bytes() == bytes(s2_chunks[0].data) + bytes(s2_chunks[1].data)
    assert rows() == ["s2"]
    assert sorted(p[1:] for p in receiver.pending()) == [("s1", 2, n), ("s2", 2, n)]
    # a restarted receiver: s2 resumes from its files
    from coordinator.inbound.transfers import TransferReceiver

    restarted = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                 ingestor=coord.ingestor, transport=bus, signing_key=key)
    assert [p[1:] for p in restarted.pending()] == [("s2", 2, n)]  # read from s2's log before it is met again
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


def test_after_a_restart_pieces_staged_before_are_checked_again_and_a_torn_one_is_asked_for(tmp_path: Path) -> None:
    """Chunk files are not fsync-ed: a piece the running process did not check and write itself is checked against
    its leaf at assembly. Here the coordinator restarts after staging chunks 0-4, chunk 2's file is torn (as a power
    cut may leave it), and the remaining chunks reach the restarted receiver with no new manifest (as they would
    reach another worker): assembly drops chunk 2 only, the next resume asks for it alone, and the update is then
    accepted (the inner signature checked again from the stored manifest, the site's key still valid)."""
    # Prepare
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus, transfer={"spill_above_bytes": 0})  # staged on disk
    topic = update_topic("testfed", "s1")
    manifest, chunks = split(raw)
    for p in _messages(raw, s.key)[:6]:  # the manifest and chunks 0-4
        assert coord.transfers.handle(topic, p) is None
    from coordinator.inbound.transfers import TransferReceiver

    restarted = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                 ingestor=coord.ingestor, transport=bus, signing_key=key)
    folder = coord.store.data_dir / "transfers" / manifest.transfer_id
    data = bytearray((folder / "chunks").read_bytes())
    assert len(data) == 5 * CHUNK and data[2 * CHUNK:3 * CHUNK] == bytes(chunks[2].data)
    data[2 * CHUNK + 100:3 * CHUNK] = bytes(CHUNK - 100)  # chunk 2 torn: right length, wrong bytes
    (folder / "chunks").write_bytes(bytes(data))
    with open(folder / "held", "ab") as fh:  # and the log's last record torn (2 of its 4 bytes)
        fh.write(b"\x00\x00")
    # Execute 1: the other chunks reach the restarted receiver
    results = [restarted.handle(topic, c.to_bytes()) for c in chunks[5:]]
    # Assert 1: the last one completes the set, assembly finds the torn piece and drops it; nothing accepted
    assert results[:-1] == [None] * (len(chunks) - 6)
    assert isinstance(results[-1], Rejected) and results[-1].reason is RejectReason.BAD_TRANSFER
    assert "1 damaged chunk(s) dropped" in results[-1].detail
    held = (folder / "held").read_bytes()  # the log no longer lists chunk 2 (its torn record is gone too)
    assert sorted(i for (i,) in struct.iter_unpack(">I", held)) == [i for i in range(len(chunks)) if i != 2]
    assert "s1" not in ctx.accepted
    # Execute 2: the site resumes; Assert 2: only chunk 2 is asked for, and once it is in, the update is accepted
    restarted.handle(topic, _resume(raw, s.key))
    assert _receipts(bus, "s1", key)[-1].missing == (2,)
    result = restarted.handle(topic, chunks[2].to_bytes())
    assert result.__class__.__name__ == "Accepted" and "s1" in ctx.accepted and ctx.strategy.count == 1
    coord.close()


def _messages(raw: bytes, key) -> list[bytes]:
    """What ``send`` publishes for ``raw`` in 1 KiB chunks: the manifest, then every chunk."""
    out: list[bytes] = []
    send(lambda t, p: out.append(p), "x", raw, private_key=key, chunk_size=CHUNK)
    return out


def test_each_payload_byte_is_hashed_once_on_the_chunked_path(tmp_path: Path, monkeypatch) -> None:
    """Each payload byte is hashed once: an update of 17 chunks through TransferReceiver, every byte given to BLAKE3
    on the receiver counted (``shared.envelope.hash_piece``, the one function that hashes payload bytes): the update's
    payload goes through it exactly once, piece by piece; the only other bytes hashed are the manifest's and the ACK's
    own payloads (small envelopes verified and sealed as usual); and no SHA-256 runs over payload-sized data."""
    # Prepare: the wire messages (made before counting: the sender's hashing is not the receiver's)
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, _ = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    delta = {k: (np.arange(v.size, dtype=np.float32) / v.size).reshape(v.shape) for k, v in model().items()}
    raw = s.envelope(ctx.round, ctx.model_hash, s.payload(delta))  # no two pieces alike: each can be told apart
    messages = _messages(raw, s.key)
    payload = bytes(Envelope.from_bytes(raw).payload)
    assert len(payload) > 16 * CHUNK and len(payload) % CHUNK != 0  # many chunks, the last one short
    pieces = [payload[i:i + CHUNK] for i in range(0, len(payload), CHUNK)]
    assert len(messages) == 1 + len(pieces) and len(set(pieces)) == len(pieces)
    hashed: list[bytes] = []
    real = shared.envelope.hash_piece
    monkeypatch.setattr(shared.envelope, "hash_piece", lambda piece: (hashed.append(bytes(piece)), real(piece))[1])
    sha256_sizes: list[int] = []
    real_sha256 = hashlib.sha256

    def counting_sha256(data=b"", **kw):
        sha256_sizes.append(len(data))
        return real_sha256(data, **kw)

    monkeypatch.setattr(hashlib, "sha256", counting_sha256)
    # Execute
    results = [coord.transfers.handle(topic, m) for m in messages]
    monkeypatch.undo()
    # Assert: accepted; each piece of the payload hashed exactly once, and nothing else but the two small envelopes
    assert results[-1].__class__.__name__ == "Accepted" and results[:-1] == [None] * len(pieces)
    assert "s1" in ctx.accepted
    counts = Counter(hashed)
    assert all(counts[p] == 1 for p in pieces)
    assert sum(len(h) for h in hashed if h in set(pieces)) == len(payload)
    manifest_env = Envelope.from_bytes(messages[0])
    ack_env = [Envelope.from_bytes(p) for t, p in bus.published if t == ack_topic("testfed", "s1")][-1]
    assert ack_env.header.kind == MessageKind.ACK
    assert sorted(hashed) == sorted(pieces + [bytes(manifest_env.payload), bytes(ack_env.payload)])
    assert sum(map(len, hashed)) == len(payload) + manifest_env.header.payload_length + ack_env.header.payload_length
    assert max(sha256_sizes, default=0) < CHUNK  # no SHA-256 of anything payload-sized (blob named by the digest)
    assert coord.store.get_blob(ctx.accepted["s1"].payload_sha256) == payload
    assert ctx.accepted["s1"].payload_sha256 == Envelope.from_bytes(raw).header.payload_digest
    coord.close()


def test_a_rounds_task_payload_is_hashed_once_for_all_its_sites(tmp_path: Path, monkeypatch) -> None:
    """The coordinator seals one task payload for three sites (FedAvg gives each the same model) and sends
    each in 1 KiB chunks. BLAKE3 sees the payload's bytes once in all (``seal``; besides, each site's small manifest
    envelope), not once per site nor again when chunking (``readdress`` re-signs a header; ``split`` reuses the
    leaves); and each site's chunks reassemble into an envelope addressed to it that verifies, payload digest
    included, under the coordinator's key."""
    # Prepare: three enrolled sites, tasks chunked at 1 KiB, every byte given to BLAKE3 counted
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord = coordinator(tmp_path, bus, key, transfer={"chunk_size_bytes": CHUNK, "max_chunk_bytes": CHUNK})
    for name in ("s1", "s2", "s3"):
        coord.enrol(name, site(bus, key, name, 1.0, 20).public_pem, {"capacity": 20, "categories": ["VU"]})
    hashed: list[int] = []
    real = shared.envelope.hash_piece
    monkeypatch.setattr(shared.envelope, "hash_piece", lambda piece: (hashed.append(len(piece)), real(piece))[1])
    # Execute
    ctx = coord.rounds.open_round()
    monkeypatch.undo()
    # Assert: one payload's worth of bytes hashed; each site's task complete, its own, and genuine
    assert ctx is not None and ctx.selected == {"s1", "s2", "s3"}
    payloads, manifest_bytes = set(), 0
    for name in ("s1", "s2", "s3"):
        messages = [p for t, p in bus.published if t == task_topic("testfed", name)]
        manifest_env = Envelope.from_bytes(messages[0])
        manifest_bytes += manifest_env.header.payload_length  # each site's manifest is its own small envelope
        manifest = decode_manifest(manifest_env.payload)
        chunks = [Chunk.from_bytes(m, max_data_bytes=CHUNK) for m in messages[1:]]
        assert manifest.num_chunks == len(chunks) > 16
        for c in chunks:
            check_chunk(manifest, c)
        env = assemble(manifest, [c.data for c in sorted(chunks, key=lambda c: c.index)])
        shared.envelope.verify(env, key.public_key())  # signature, then a fresh BLAKE3 of the payload (not counted)
        assert env.header.site_id == name and env.header.kind == MessageKind.TASK
        payloads.add(bytes(env.payload))
    assert len(payloads) == 1
    assert sum(hashed) == len(payloads.pop()) + manifest_bytes  # before: 2 x 3 x the payload (seal, split per site)
    coord.close()


def test_manifests_that_do_not_bind_their_chunks_are_refused_before_any_chunk_is_kept(tmp_path: Path) -> None:
    """Leaves that do not derive the signed payload digest, an inner envelope signed by another key, and an inner
    header that differs from the manifest envelope's: each refused (and NACKed: the manifest envelope verified) at
    the manifest, nothing staged, and a genuine chunk of that transfer is then an unknown transfer's."""
    # Prepare
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    genuine, chunks = split(raw)
    body = {"header": genuine.header.canonical_bytes().decode(), "signature": genuine.signature.hex(),
            "leaves": [x.hex() for x in genuine.leaves], "resume": False}  # the manifest's fields, written out
    wrong_leaf = dict(body, leaves=[body["leaves"][1]] + body["leaves"][1:])  # leaf 0 replaced by leaf 1
    other = generate_signing_key()
    other_signed = Envelope.from_bytes(s.envelope(ctx.round, ctx.model_hash, bytes(Envelope.from_bytes(raw).payload),
                                                  key=other))
    other_manifest = split(other_signed)[0]

    def manifest_envelope(payload_body: dict, *, sequence: int) -> bytes:
        return seal(private_key=s.key, federation_id="testfed", site_id="s1", round=ctx.round,
                    base_model_hash=ctx.model_hash, kind=MessageKind.MANIFEST, sequence=sequence,
                    payload=encode_tensors({}, {"wildfed": json.dumps(payload_body)})).to_bytes()

    cases = {
        "leaves": (manifest_envelope(wrong_leaf, sequence=genuine.header.sequence), RejectReason.BAD_TRANSFER,
                   "do not derive"),
        "inner signature": (seal_manifest(private_key=s.key, manifest=other_manifest).to_bytes(),
                            RejectReason.BAD_SIGNATURE, "does not verify"),
        "header": (manifest_envelope(body, sequence=genuine.header.sequence + 40), RejectReason.BAD_TRANSFER,
                   "sequence"),
    }
    for name, (message, reason, detail) in cases.items():
        # Execute
        result = coord.transfers.handle(topic, message)
        # Assert
        assert isinstance(result, Rejected) and result.reason is reason and detail in result.detail, name
        assert coord.transfers.pending() == [] and not (coord.store.data_dir / "transfers").exists(), name
        nack = decode_ack(Envelope.from_bytes(bus.published[-1][1]).payload)
        assert not nack.accepted and reason.value in nack.reason, name
    result = coord.transfers.handle(topic, chunks[0].to_bytes())
    assert isinstance(result, Rejected) and result.reason is RejectReason.UNKNOWN_TRANSFER
    assert "s1" not in ctx.accepted
    coord.close()


def test_a_key_revoked_between_the_manifest_and_the_last_chunk_refuses_the_update(tmp_path: Path) -> None:
    """The chunked path does not verify the signature again at assembly, but it checks that the key that verified
    the manifest's inner envelope is still valid: a key revoked meanwhile refuses the update (``no_valid_key``)."""
    # Prepare: the manifest and every chunk but the last are in; then the operator revokes the site's key
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    messages = _messages(raw, s.key)
    for m in messages[:-1]:
        assert coord.transfers.handle(topic, m) is None
    assert coord.registry.revoke_key("s1")
    # Execute
    result = coord.transfers.handle(topic, messages[-1])
    # Assert
    assert isinstance(result, Rejected) and result.reason is RejectReason.NO_VALID_KEY
    assert "s1" not in ctx.accepted and coord.store.count_updates() == 0 and coord.transfers.pending() == []
    coord.close()


def test_a_format_1_envelope_and_a_wfc1_chunk_are_refused_naming_the_version_and_the_fix(tmp_path: Path) -> None:
    # Prepare: a format-1 update as the previous release sealed it (header with payload_sha256, domain v1)
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    topic = update_topic("testfed", "s1")
    payload = bytes(Envelope.from_bytes(raw).payload)
    header = json.dumps({"base_model_hash": ctx.model_hash, "federation_id": "testfed", "format_version": 1,
                         "kind": "update", "payload_length": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest(), "round": ctx.round, "sequence": 1,
                         "site_id": "s1", "timestamp": Envelope.from_bytes(raw).header.timestamp},
                        sort_keys=True, separators=(",", ":")).encode()
    signature = s.key.sign(b"wildfed-envelope-v1\x00" + header)
    v1 = b"WFE1" + len(header).to_bytes(4, "big") + header + signature + payload
    wfc1 = b"WFC1" + bytes(32) + (0).to_bytes(4, "big") + payload[:CHUNK]
    # Execute
    refused_envelope = coord.transfers.handle(topic, v1)
    refused_chunk = coord.transfers.handle(topic, wfc1)
    # Assert
    assert refused_envelope.reason is RejectReason.MALFORMED_ENVELOPE
    assert "format_version 1 is retired" in refused_envelope.detail
    assert "both sides must run the same WildFed release" in refused_envelope.detail
    assert refused_chunk.reason is RejectReason.BAD_TRANSFER and "WFC2" in refused_chunk.detail
    assert "transfer format 1" in refused_chunk.detail and "same WildFed release" in refused_chunk.detail
    assert "s1" not in ctx.accepted and coord.transfers.pending() == []
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
    leaves = tuple(bytes([i % 256]) * 32 for i in range(257))
    h = Envelope.from_bytes(raw).header
    big = Manifest(EnvelopeHeader(**{**h.__dict__, "payload_length": coord.transfers.limits.max_update_bytes + 1,
                                     "piece_size": 1 << 20,
                                     "payload_digest": payload_digest_from_leaves(leaves, 1 << 20)}),
                   bytes(64), leaves)
    env = seal_manifest(private_key=s.key, manifest=big)
    result = coord.transfers.handle(topic, env.to_bytes())
    assert isinstance(result, Rejected) and result.reason is RejectReason.OVERSIZED
    # a genuine chunk sent on another site's topic
    send(lambda t, p: out.append(p), topic, raw, private_key=s.key, chunk_size=CHUNK)
    coord.transfers.handle(topic, out[-len(split(raw)[1]) - 1])  # its manifest
    other = update_topic("testfed", "s2")
    result = coord.transfers.handle(other, out[-1])
    assert isinstance(result, Rejected) and result.reason is RejectReason.TOPIC_MISMATCH
    coord.close()


def test_incomplete_transfers_expire(tmp_path: Path) -> None:
    key = generate_signing_key()
    bus = InMemoryTransport()
    coord, s, ctx, raw = _open_round(tmp_path, key, bus)
    from coordinator.inbound.transfers import TransferLimits, TransferReceiver

    now = [1.9e9]
    receiver = TransferReceiver(federation_id="testfed", store=coord.store, registry=coord.registry,
                                ingestor=coord.ingestor, transport=bus, signing_key=key,
                                limits=TransferLimits(ttl_s=3600.0), clock=lambda: now[0])
    topic = update_topic("testfed", "s1")
    out: list[bytes] = []
    send(lambda t, p: out.append(p), topic, raw, private_key=s.key, chunk_size=CHUNK)
    now[0] = Envelope.from_bytes(raw).header.timestamp / 1000.0
    assert receiver.handle(topic, out[0]) is None and receiver.handle(topic, out[1]) is None
    tid = split(raw)[0].transfer_id
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
    coord.enrol("g1", public_key_to_pem(site_key.public_key()), {"capacity": 8, "categories": ["VU", "NT"]})
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
    coord.enrol("late", public_key_to_pem(site_key.public_key()), {"capacity": 8, "categories": ["VU", "NT"]})
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
    tid = split(raw)[0].transfer_id
    assert [p[0] for p in coord.transfers.pending()] == [tid]
    assert coord.transfers.sweep() == [] and coord.transfers.pending() == []
    assert not (coord.store.data_dir / "transfers" / tid).exists()
    coord.close()
