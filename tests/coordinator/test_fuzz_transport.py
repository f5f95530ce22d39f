"""Fuzzing the coordinator's upload path (docs/transport.md): every message a site, an attacker or a broken link could
put on a site's update topic goes through the real :class:`coordinator.inbound.transfers.TransferReceiver` (whole
envelopes to the real :class:`coordinator.inbound.ingest.Ingestor`, manifests and chunks staged and reassembled), over a
real :class:`coordinator.storage.Store` on SQLite in ``tmp_path``, a real :class:`coordinator.registry.SiteRegistry` and
:class:`coordinator.ledger.PrivacyLedger`, a :class:`coordinator.strategies.fedavg.FedAvg` running sum and an
:class:`coordinator.transport.InMemoryTransport` that collects the ACKs, NACKs and RECEIPTs.

The world every fuzz test starts from (:class:`Harness`): round 1 (closed, selected ``s1``; ``s1``'s update stored)
and round 2 (open, selected ``s1`` and ``s2``; ``s1``'s update stored and aggregated); ``s3`` is enrolled but never
selected; ``ghost`` and ``attacker`` keys are not enrolled. ``s2`` has sent nothing yet, so its genuine key reaches
the deepest checks (tensors, values, report). The model has 800 float32 values (a 3.4 KB update), so at a chunk size
of 1-2 KiB an update travels in 2-4 chunks.

Generated messages and their defects (each example has at least one; the expected reason set is the union of the
reason codes of its defects, because the first failing check decides):

* whole envelopes (:func:`adversarial_envelopes`): forged signature (non-enrolled key), bit flips and truncation
  after signing, trailing garbage, oversized messages, stale / wrong / past round, header site != topic site, site
  not enrolled / not selected / already stored, wrong federation, kind and topic, stale base model hash, timestamps
  far in the future or past; payloads of random bytes, a bad safetensors header length, bad JSON, truncated,
  empty, tensors of wrong names / shapes / dtypes, NaN / inf values, bad reports (zero, negative, non-integer or
  absurdly large counts, steps out of range, missing / unknown / malformed events, counts not asked for, unknown
  fields, no or non-JSON metadata);
* replays (:func:`replays`): already accepted whole updates and chunked transfers (manifest and chunks) of the open
  round and of a past round, re-sent verbatim, on other topics, re-chunked, interleaved;
* chunk streams (:func:`chunk_streams`, transfer format 2: chunks are the payload's pieces, the manifest carries the
  inner header, signature and piece digests): an inner update that is always bad (a payload defect above, a payload
  altered by a bit flip or truncation after signing and announced with its own piece digests, a forged inner
  signature, a stale model, wrong round, unselected site or bad timestamp) announced by a manifest that is genuine,
  forged, oversized (total length or chunk size), malformed (fields, inner header, signature, digests, a format-1
  inner header), for another kind, with a header that is not the inner one's, lists the digest of a tampered chunk,
  is a ``resume`` probe, or is missing; followed by chunk operations: correct, tampered data, wrong index, truncated,
  oversized, unknown transfer, another site's topic, a bad topic, duplicated, before the manifest, missing (never
  completes), resume probes in between. A defect the manifest shows (digests that do not derive the signed payload
  digest, an inner signature that does not verify) is refused at the manifest, before any chunk is kept.

Invariants asserted for EVERY generated message (:meth:`Harness.deliver`): ``handle`` never raises; the result is a
:class:`~coordinator.inbound.reject.Rejected` whose ``reason`` is a :class:`~coordinator.inbound.reject.RejectReason` in
the expected set with a non-empty detail (exactly one more rejection counted), or None only for a manifest or chunk that
was legitimately kept (a genuine key's manifest binding its chunks, a chunk matching its piece digest); nothing is
ever accepted except in the positive controls, where exactly the one genuine update is; the FedAvg running sum
(count, weight, sums), the ``updates`` and ``ledger`` tables are unchanged by every adversarial message; nothing is
published to an unauthenticated sender, every published ACK / RECEIPT is signed by the coordinator, and no positive
ACK goes out except the re-ACK of a replayed stored update. Every RECEIPT lists exactly the chunk indices not yet
held (a model of the receiver, :class:`StreamModel`, tracks which chunks it must hold).

Volume (asserted by each test): 8,750 whole envelopes (1,750 examples of 5) + 1,100 adversarial chunk streams +
300 replay scenarios + 40 genuine streams with noise = 10,190 generated envelopes and chunk streams, about 17,000
MQTT messages; :func:`test_zz_fuzz_totals` asserts the sum (>= 10,000) and the reason codes reached when the whole
module ran (48-68 s measured with ``time`` on the shared 2-core machine). SQLite runs with ``synchronous=OFF`` here: power loss is not
what is fuzzed, and an fsync per rejection would triple the time.

Found by this fuzzer and fixed: header integers beyond the SQL column ranges (a round of 2**63, even
unsigned, crashed the rejection's own INSERT), report numbers no float holds (num_examples, a noise multiplier or
a species count of 10**400), num_examples beyond an SQL INTEGER, JSON integers of more than 4,300 digits (Python's
``int()`` limit) in a payload or manifest, and a manifest total length whose float quotient overflowed (the last two
in the format-1 manifest; their format-2 counterparts, in the manifest's inner header, are fuzzed too).

atheris: ``pip install atheris`` works for this Python (3.11, atheris 3.0.0 wheel); a coverage-guided harness for
the same receiver is ``benchmarks/fuzz_atheris.py``, run by hand (it is not a project dependency).
"""

from __future__ import annotations

import hashlib
import functools
import json
import logging
import sqlite3
import struct
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, func, select

from shared.codec import encode_tensors, model_hash
from shared.envelope import Envelope, MessageKind, payload_digest_from_leaves, payload_leaves, seal, verify
from shared.errors import ConfigError, MalformedEnvelopeError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.privacy.events import DPSGDEvent
from shared.protocol import UpdateReport, decode_ack, encode_update
from shared.topics import update_topic
from shared.topics import parse_topic
from shared.transfer import (CHUNK_MAGIC, Chunk, Manifest, decode_manifest, decode_receipt, seal_manifest, send,
                             split)

from coordinator.inbound.context import Accepted, RoundContext
from coordinator.inbound.ingest import Ingestor
from coordinator.inbound.reject import Rejected, RejectReason
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import LedgerRow, RoundRow, Store, UpdateRow, dumps
from coordinator.strategies.fedavg import FedAvg
from coordinator.inbound.transfers import TransferLimits, TransferReceiver
from coordinator.transport import InMemoryTransport

FED = "testfed"
R = RejectReason
EVENT = DPSGDEvent(noise_multiplier=1.2, sampling_rate=0.05, steps=5)
LIMITS = TransferLimits(max_chunk_bytes=2048, max_update_bytes=32 * 1024, max_message_bytes=16 * 1024, ttl_s=3600.0)
LOCAL_STEPS = 5

#: Reasons a message can get before any signature verified (nothing is said to its sender).
PRE_VERIFY = frozenset({R.MALFORMED_ENVELOPE, R.BAD_TOPIC, R.WRONG_KIND, R.WRONG_FEDERATION, R.TOPIC_MISMATCH,
                        R.UNKNOWN_SITE, R.BAD_SIGNATURE, R.OVERSIZED, R.BAD_TRANSFER, R.UNKNOWN_TRANSFER})

STATS: Counter[str] = Counter()
"""Module totals: ``messages``, ``examples:<test>``, ``reason:<code>``, ``kept`` (None results)."""

FUZZ = dict(deadline=None, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large, HealthCheck.filter_too_much])


def template_weights(scale: float = 0.1) -> dict[str, np.ndarray]:
    """The fuzzed model: phi.w float32 (24, 32) and psi.b float32 (32,), 800 values."""
    return {"phi.w": (np.arange(768, dtype=np.float32).reshape(24, 32) % 7) * np.float32(scale),
            "psi.b": np.linspace(-1, 1, 32, dtype=np.float32)}


def full_delta(value: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) for k, v in template_weights().items()}


def report_json(**over: object) -> dict:
    body = {"num_examples": 10, "local_steps": LOCAL_STEPS, "events": {"LC": EVENT.to_json()}}
    body.update(over)
    return body


def raw_update(delta: dict[str, np.ndarray], body: object) -> bytes:
    """An UPDATE payload written without shared.protocol's checks (forged dtypes, NaN, bad reports)."""
    meta = body if isinstance(body, str) else json.dumps(body)
    return encode_tensors(delta, {"wildfed": meta})


@functools.lru_cache(maxsize=256)
def good_payload(value: float = 0.5, num_examples: int = 10) -> bytes:
    return encode_update(UpdateReport(num_examples=num_examples, local_steps=LOCAL_STEPS,
                                      events={IUCNCategory.LC: EVENT}), full_delta(value))


def flip_bits(raw: bytes, positions: Iterable[int]) -> bytes:
    out = bytearray(raw)
    for p in positions:
        p %= len(out) * 8
        out[p // 8] ^= 1 << (p % 8)
    return bytes(out)


def now_ms() -> int:
    return int(time.time() * 1000)


# ---- the world ----------------------------------------------------------------------------------------------------
@dataclass
class Harness:
    """Real coordinator objects around an open round 2 (see the module docstring)."""

    root: Path
    store: Store = field(init=False)
    transport: InMemoryTransport = field(init=False)
    keys: dict = field(init=False)
    seq: int = 0
    allow_positive_ack: bool = False

    def __post_init__(self) -> None:
        self.store = Store(f"sqlite:///{self.root / 'coordinator.db'}", self.root / "data")

        @event.listens_for(self.store.engine, "connect")
        def _no_fsync(dbapi_connection, _record) -> None:  # noqa: ANN001 - speed: power loss is not fuzzed here
            dbapi_connection.execute("PRAGMA synchronous=OFF")
            dbapi_connection.execute("PRAGMA journal_mode=MEMORY")

        self.store.engine.dispose()
        self._reader = sqlite3.connect(self.root / "coordinator.db", check_same_thread=False)
        self.registry = SiteRegistry(self.store)
        self.ledger = PrivacyLedger(self.store, target_delta=1e-5)
        self.transport = InMemoryTransport()
        self.coord_key = generate_signing_key()
        self.ingestor = Ingestor(federation_id=FED, store=self.store, registry=self.registry, ledger=self.ledger,
                                 transport=self.transport, signing_key=self.coord_key)
        self.receiver = TransferReceiver(federation_id=FED, store=self.store, registry=self.registry,
                                         ingestor=self.ingestor, transport=self.transport,
                                         signing_key=self.coord_key, limits=LIMITS)
        self.keys = {sid: generate_signing_key() for sid in ("s1", "s2", "s3", "ghost", "attacker")}
        for sid in ("s1", "s2", "s3"):
            self.registry.enrol(sid, public_key_to_pem(self.keys[sid].public_key()), {})  # no declared capacity: the generated reports vary N_k freely
        # round 1: closed, selected s1 only; s1's update stored (the past round a replay can target)
        self.w1 = template_weights(0.1)
        self.hash1 = model_hash(self.w1)
        self.s1_round1 = self.seal("s1", round=1, base=self.hash1, payload=good_payload(0.25, 17))
        self._open(1, self.hash1, self.w1, ["s1"])
        assert isinstance(self.deliver_genuine("s1", self.s1_round1), Accepted)
        self.ingestor.close_round()
        with self.store.session() as s:
            s.get(RoundRow, 1).status = "closed"
        # round 2: open, selected s1 and s2; s1's update stored and aggregated
        self.w2 = template_weights(0.2)
        self.hash2 = model_hash(self.w2)
        self.ctx = self._open(2, self.hash2, self.w2, ["s1", "s2"])
        self.s1_round2 = self.seal("s1", payload=good_payload(0.75, 17))
        assert isinstance(self.deliver_genuine("s1", self.s1_round2), Accepted)
        self.snapshot()

    def _open(self, r: int, h: str, weights: dict, selected: list[str]) -> RoundContext:
        with self.store.session() as s:
            s.add(RoundRow(round=r, status="open", base_model_hash=h, selected_json=dumps(selected), privacy="ccdp"))
        strategy = FedAvg()
        strategy.begin_round(weights)
        ctx = RoundContext(round=r, model_hash=h, template=weights, selected=frozenset(selected), halted={},
                           budgets={IUCNCategory.LC: 50.0}, privacy="ccdp", local_steps=LOCAL_STEPS,
                           strategy=strategy)
        self.ingestor.open_round(ctx)
        return ctx

    # ---- building messages ---------------------------------------------------------------------------------------
    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def seal_env(self, site: str, *, round: int = 2, base: str | None = None, payload: bytes,
                 key: str | None = None, kind: MessageKind = MessageKind.UPDATE, fed: str = FED,
                 timestamp: int | None = None, sequence: int | None = None, piece_size: int = 1024) -> Envelope:
        """A sealed envelope; in pieces of 1 KiB unless told (so that a whole update can be re-sent chunked)."""
        return seal(private_key=self.keys[key or site], federation_id=fed, site_id=site, round=round,
                    base_model_hash=self.hash2 if base is None else base, kind=kind,
                    sequence=self.next_seq() if sequence is None else sequence, payload=payload,
                    timestamp=now_ms() if timestamp is None else timestamp, piece_size=piece_size)

    def seal(self, site: str, **kw: object) -> bytes:
        return self.seal_env(site, **kw).to_bytes()

    @staticmethod
    def topic(site: str, fed: str = FED) -> str:
        return update_topic(fed, site)

    # ---- invariants ----------------------------------------------------------------------------------------------
    def table_count(self, row: type) -> int:
        with self.store.session() as s:
            return int(s.scalar(select(func.count()).select_from(row)) or 0)

    def table_counts(self) -> tuple[int, int]:
        """(rows of ``updates``, rows of ``ledger``), read by a connection of our own (committed rows only)."""
        return self._reader.execute(f"SELECT (SELECT count(*) FROM {UpdateRow.__tablename__}), "
                                    f"(SELECT count(*) FROM {LedgerRow.__tablename__})").fetchone()

    def snapshot(self) -> None:
        """Remember the aggregate and the tables that no adversarial message may change."""
        acc = self.ctx.strategy.running_sum
        self.base_count = acc.count
        self.base_weight = acc.total_weight
        self.base_sums = {k: v.copy() for k, v in acc.sums.items()}
        self.base_accepted = dict(self.ctx.accepted)
        self.base_updates = self.table_count(UpdateRow)
        self.base_ledger = self.table_count(LedgerRow)

    def assert_unchanged(self, where: str) -> None:
        acc = self.ctx.strategy.running_sum
        assert acc.count == self.base_count and acc.total_weight == self.base_weight, where
        assert all(np.array_equal(acc.sums[k], v) for k, v in self.base_sums.items()), where
        assert self.ctx.accepted == self.base_accepted, where
        assert self.table_counts() == (self.base_updates, self.base_ledger), where

    def rejections(self) -> int:
        return sum(n for k, n in self.ingestor.counts.items() if k in R._value2member_map_)

    def deliver_genuine(self, site: str, raw: bytes, topic: str | None = None) -> object:
        return self.receiver.handle(topic or self.topic(site), raw)

    def deliver(self, topic: str, raw: bytes, *, reasons: frozenset = frozenset(), may_keep: bool = False,
                authenticated: bool = True, what: str = "", accept: tuple[str, int, float] | None = None) -> object:
        """Hand one message to the receiver and assert the per-message invariants (module docstring).

        Args:
            reasons: the reason codes the message may be refused with. may_keep: None is a legitimate answer.
            authenticated: False when the sender is not who it claims (then nothing may be published).
            accept: ``(site, num_examples, value)`` of the one genuine update this message must be accepted as
                (positive controls); the aggregate must then grow by exactly ``num_examples * value``.
        """
        published = len(self.transport.published)
        rejected = self.rejections()
        try:
            result = self.receiver.handle(topic, raw)
        except Exception as exc:  # noqa: BLE001 - the invariant under test
            raise AssertionError(f"handle raised {exc!r} for {what}") from exc
        STATS["messages"] += 1
        if accept is not None:
            self.assert_accepted(result, *accept, what=what)
            return result
        if result is None:
            assert may_keep, f"{what}: kept (None) but it must be refused with one of {sorted(reasons)}"
            assert self.rejections() == rejected, what
            STATS["kept"] += 1
        else:
            assert isinstance(result, Rejected), f"{what}: {result!r} (only the genuine update may be accepted)"
            assert isinstance(result.reason, RejectReason), what
            assert isinstance(result.detail, str) and result.detail.strip(), what
            assert result.reason in reasons, f"{what}: got {result.reason.value} ({result.detail}), expected one " \
                                             f"of {sorted(r.value for r in reasons)}"
            assert self.rejections() == rejected + 1, what
            STATS[f"reason:{result.reason.value}"] += 1
        new = self.transport.published[published:]
        if not authenticated:
            assert not new, f"{what}: published {len(new)} message(s) to an unauthenticated sender"
        for out_topic, out in new:
            env = Envelope.from_bytes(out)
            verify(env, self.coord_key.public_key())
            assert out_topic.endswith("/ack") and env.header.kind in (MessageKind.ACK, MessageKind.RECEIPT), what
            if env.header.kind is MessageKind.ACK:
                ack = decode_ack(env.payload)
                assert not ack.accepted or (self.allow_positive_ack and ack.reason.startswith("duplicate")), \
                    f"{what}: positive ACK {ack}"
        self.assert_unchanged(what)
        return result

    def assert_accepted(self, result: object, site: str, n: int, value: float, *, what: str = "") -> None:
        """``result`` accepts ``site``'s update of ``n`` examples and delta ``value``: stored, ACKed, aggregated
        exactly once; then the new state becomes the baseline."""
        assert isinstance(result, Accepted), f"{what}: the genuine update was not accepted: {result!r}"
        assert result.site_id == site and result.num_examples == n, what
        acc = self.ctx.strategy.running_sum
        assert acc.count == self.base_count + 1 and acc.total_weight == self.base_weight + n, what
        for k, v in self.base_sums.items():
            np.testing.assert_allclose(acc.sums[k], v + n * np.float64(np.float32(value)), rtol=1e-6, atol=1e-6)
        assert self.ctx.accepted[site] == result
        assert self.table_counts() == (self.base_updates + 1, self.base_ledger), what
        env = Envelope.from_bytes(self.transport.published[-1][1])
        assert env.header.kind is MessageKind.ACK and env.header.site_id == site, what
        assert decode_ack(env.payload).accepted, what
        STATS["accepted"] += 1
        self.snapshot()

    def receipts(self, since: int) -> list:
        out = []
        for topic, raw in self.transport.published[since:]:
            env = Envelope.from_bytes(raw)
            if env.header.kind is MessageKind.RECEIPT:
                out.append(decode_receipt(env.payload))
        return out


@pytest.fixture(autouse=True, scope="module")
def _quiet_rejections() -> None:
    """Each rejection is logged as a warning; tens of thousands of them would only slow the run down."""
    logger = logging.getLogger("coordinator")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    h = Harness(tmp_path)
    yield h
    h._reader.close()
    h.store.dispose()


# ---- whole envelopes ------------------------------------------------------------------------------------------------
VALUES = st.sampled_from([k / 8 for k in range(-8, 9)])  # exact in float32
FUTURE = st.integers(min_value=10 * 60 * 1000, max_value=10 ** 6 * 86400 * 1000)
PAST = st.integers(min_value=8 * 86400 * 1000, max_value=40 * 365 * 86400 * 1000)
HEX64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
BAD_TOPICS = st.sampled_from([
    "", "wildfed", "not/a/wildfed/topic", f"wildfed/v1/{FED}/site/s2/update/extra", f"wildfed/v2/{FED}/site/s2/update",
    f"wildfed/v1/{FED}/sites/s2/update", f"wildfed/v1/{FED}/site/s 2/update", f"wildfed/v1/{FED}/site/+/update",
    f"wildfed/v1/{FED}/site/#", f"wildfed/v1/{FED}/site/s2/bogus", "wildfed/v1//site/s2/update",
    f"wildfed/v1/{FED}/site/" + "x" * 80 + "/update"])
WRONG_CHANNEL_TOPICS = st.sampled_from([f"wildfed/v1/{FED}/site/s2/{c}" for c in
                                        ("task", "ack", "detection", "secagg", "status")])


@st.composite
def bad_payloads(draw: st.DrawFn) -> tuple[bytes, frozenset, str]:
    """A payload that is wrong in exactly one way, with the reasons it may be refused with."""
    kind = draw(st.sampled_from(["random_bytes", "header_length", "bad_json", "truncated", "empty", "wrong_tensors",
                                 "non_finite", "bad_report", "huge_json_integer"]))
    good = good_payload(draw(VALUES))
    if kind == "random_bytes":
        return draw(st.binary(max_size=3000)), frozenset({R.MALFORMED_PAYLOAD, R.WRONG_TENSORS}), kind
    if kind == "header_length":
        (n,) = struct.unpack("<Q", good[:8])
        bad = draw(st.integers(0, 2 ** 64 - 1).filter(lambda x: x != n))
        return struct.pack("<Q", bad) + good[8:], frozenset({R.MALFORMED_PAYLOAD}), kind
    if kind == "bad_json":
        (n,) = struct.unpack("<Q", good[:8])
        start = draw(st.integers(0, n - 1))
        junk = draw(st.binary(min_size=1, max_size=n - start))
        body = good[8:8 + start] + junk + good[8 + start + len(junk):8 + n]
        try:  # junk that still parses (a digit for a digit, a space) may be a genuine update: make it not JSON
            json.loads(body)
            body = b"}" + body[1:]
        except (UnicodeDecodeError, ValueError):
            pass
        return good[:8] + body + good[8 + n:], frozenset({R.MALFORMED_PAYLOAD, R.WRONG_TENSORS}), kind
    if kind == "truncated":
        return good[:draw(st.integers(0, len(good) - 1))], frozenset({R.MALFORMED_PAYLOAD}), kind
    if kind == "empty":
        return b"", frozenset({R.MALFORMED_PAYLOAD}), kind
    if kind == "huge_json_integer":  # more than the 4,300 digits Python's int() accepts, in the safetensors header
        digits = "1" + "0" * draw(st.integers(4300, 6000))
        field_ = draw(st.sampled_from(["shape", "offset"]))
        spec = ({"dtype": "F32", "shape": ["@"], "data_offsets": [0, 4]} if field_ == "shape"
                else {"dtype": "F32", "shape": [1], "data_offsets": [0, "@"]})
        header = json.dumps({"__metadata__": {"wildfed": "{}"}, "phi.w": spec}).replace('"@"', digits).encode()
        return struct.pack("<Q", len(header)) + header + bytes(4), frozenset({R.MALFORMED_PAYLOAD}), kind
    if kind == "wrong_tensors":
        return draw(wrong_tensors()), frozenset({R.WRONG_TENSORS}), kind
    if kind == "non_finite":
        delta = full_delta(draw(VALUES))
        for _ in range(draw(st.integers(1, 4))):
            name = draw(st.sampled_from(sorted(delta)))
            flat = delta[name].reshape(-1)
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        return raw_update(delta, report_json()), frozenset({R.NON_FINITE}), kind
    payload, reasons = draw(bad_reports())
    return payload, reasons, kind


@st.composite
def wrong_tensors(draw: st.DrawFn) -> bytes:
    delta = full_delta(0.5)
    how = draw(st.sampled_from(["missing", "extra", "renamed", "shape", "dtype", "empty"]))
    name = draw(st.sampled_from(sorted(delta)))
    if how == "missing":
        del delta[name]
    elif how == "extra":
        extra = draw(st.text("abcdefghijklmnopqrstuvwxyz._/0123456789", min_size=1, max_size=20)
                     .filter(lambda n: n not in delta and n != "__metadata__"))
        delta[extra] = np.zeros(draw(st.integers(0, 8)), np.float32)
    elif how == "renamed":
        delta[name.upper() + draw(st.sampled_from(["", " ", "_", ".0"]))] = delta.pop(name)
    elif how == "shape":
        shape = draw(st.lists(st.integers(0, 40), max_size=2).filter(lambda s: tuple(s) != delta[name].shape))
        delta[name] = np.zeros(shape, np.float32)
    elif how == "dtype":
        dtype = draw(st.sampled_from([np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.bool_]))
        delta[name] = delta[name].astype(dtype)
    else:
        delta = {}
    return raw_update(delta, report_json())


@st.composite
def bad_reports(draw: st.DrawFn) -> tuple[bytes, frozenset]:
    bad_report, malformed = frozenset({R.BAD_REPORT}), frozenset({R.MALFORMED_PAYLOAD})
    ev = EVENT.to_json()
    variants = [
        (lambda: report_json(num_examples=0), bad_report),
        (lambda: report_json(num_examples=draw(st.integers(max_value=-1))), malformed),
        (lambda: report_json(num_examples=draw(st.sampled_from([10.5, "10", True, None, [10], {"n": 1}]))),
         malformed),
        (lambda: report_json(num_examples=draw(st.integers(2 ** 31, 2 ** 63))), bad_report),
        (lambda: report_json(num_examples=draw(st.integers(2 ** 63, 10 ** 300))), bad_report | malformed),
        (lambda: report_json(num_examples=draw(st.integers(10 ** 309, 10 ** 400))), malformed),
        (lambda: json.dumps(report_json()).replace('"num_examples": 10', '"num_examples": 1' + "0" * 4400),
         malformed),
        (lambda: report_json(events={"LC": {**ev, "noise_multiplier": draw(st.integers(10 ** 309, 10 ** 400))}}),
         malformed),
        (lambda: report_json(species_counts={"0": draw(st.integers(10 ** 309, 10 ** 400))}), malformed),
        (lambda: report_json(local_steps=0), bad_report),
        (lambda: report_json(local_steps=draw(st.integers(LOCAL_STEPS + 1, 10 ** 30))), bad_report),
        (lambda: report_json(local_steps=draw(st.integers(max_value=-1))), malformed),
        (lambda: report_json(events={}), bad_report),
        (lambda: report_json(events={"LC": {**ev, "steps": draw(st.integers(LOCAL_STEPS + 1, 10 ** 30))}}),
         bad_report),
        (lambda: report_json(events={draw(st.sampled_from(["ZZ", "lc", "", "1"])): ev}), malformed),
        (lambda: report_json(events={"LC": draw(st.sampled_from([
            {**ev, "type": "laplace"}, {**ev, "noise_multiplier": -1.0}, {**ev, "sampling_rate": 1.5},
            {**ev, "steps": -1}, {**ev, "steps": 2.5}, {**ev, "extra": 1}, {"type": "dpsgd"}, [], "x",
            {**ev, "noise_multiplier": "1.2"}]))}), malformed),
        (lambda: report_json(events=draw(st.sampled_from([[], "LC", 5, None]))), malformed),
        (lambda: report_json(species_counts={"0": 3.0}), bad_report),
        (lambda: report_json(**{draw(st.sampled_from(["extra", "round", "site_id"])): 1}), malformed),
        (lambda: draw(st.sampled_from(["not json", "[1, 2]", "null", "7", "{", '"s"'])), malformed),
    ]
    make, reasons = variants[draw(st.integers(0, len(variants) - 1))]
    return raw_update(full_delta(draw(VALUES)), make()), reasons


HEADER_DEFECTS = ["forged_key", "wrong_round", "stale_round", "stale_model", "topic_other_site", "identity",
                  "wrong_federation", "wrong_kind", "bad_topic", "wrong_channel", "future_timestamp",
                  "past_timestamp", "huge_integer"]
OTHER_KEYS = {s: st.sampled_from([k for k in ("attacker", "ghost", "s1", "s3") if k != s])
              for s in ("s1", "s2", "s3", "ghost")}
OTHER_TOPIC_SITES = {s: st.sampled_from([k for k in ("s1", "s2", "s3", "ghost", "nobody") if k != s])
                     for s in ("s1", "s2", "s3", "ghost")}
HUGE = st.one_of(st.integers(2 ** 63, 2 ** 64), st.integers(2 ** 64, 10 ** 300))
WIRE_DEFECTS = ["bit_flip", "truncated", "trailing_garbage", "oversized", "oversized_signed"]


@dataclass
class Message:
    topic: str
    raw: bytes
    reasons: frozenset
    authenticated: bool
    what: str


@st.composite
def adversarial_envelopes(draw: st.DrawFn, h: Harness) -> Message:
    """A whole envelope from (or claiming to be from) a site, with 1-4 defects (see the module docstring)."""
    mode = draw(st.sampled_from(["payload", "payload", "header", "header+payload", "wire"]))
    header = draw(st.lists(st.sampled_from(HEADER_DEFECTS), min_size=1, max_size=3, unique=True)) \
        if mode.startswith("header") or (mode == "wire" and draw(st.booleans())) else []
    payload_defect = mode != "header" and (mode != "wire" or draw(st.booleans()))
    wire = [draw(st.sampled_from(WIRE_DEFECTS))] if mode == "wire" else []
    site, key, round_, base, kind, fed, topic_fed, ts = "s2", None, 2, h.hash2, MessageKind.UPDATE, FED, FED, None
    topic_site, topic = None, None
    reasons: set = set()
    authenticated = True
    if "identity" in header:
        site = draw(st.sampled_from(["s1", "s3", "ghost"]))
        reasons.add({"s1": R.DUPLICATE, "s3": R.NOT_SELECTED, "ghost": R.UNKNOWN_SITE}[site])
        authenticated = site != "ghost"
    if "forged_key" in header:
        key = draw(OTHER_KEYS[site])
        reasons.add(R.BAD_SIGNATURE)
        authenticated = False
    if "wrong_round" in header:
        round_ = draw(st.sampled_from([3, 4, 1000, 2 ** 31 - 1]))
        reasons.add(R.WRONG_ROUND)
    if "stale_round" in header:
        round_ = draw(st.sampled_from([0, 1] if site != "s1" else [0]))
        reasons.add(R.WRONG_ROUND)
    if "stale_model" in header:
        base = draw(st.one_of(st.just(h.hash1), st.just(""), HEX64.filter(lambda x: x != h.hash2)))
        reasons.add(R.STALE_MODEL)
    if "topic_other_site" in header:
        topic_site = draw(OTHER_TOPIC_SITES[site])
        reasons.add(R.TOPIC_MISMATCH)
        authenticated = False
    if "wrong_federation" in header:
        fed, topic_fed = draw(st.sampled_from([("otherfed", FED), ("otherfed", "otherfed"), (FED, "otherfed")]))
        reasons.add(R.WRONG_FEDERATION)
        authenticated = False
    if "wrong_kind" in header:
        kind = draw(st.sampled_from([MessageKind.TASK, MessageKind.ACK, MessageKind.DETECTION, MessageKind.SECAGG,
                                     MessageKind.MANIFEST]))
        reasons.update({R.WRONG_KIND, R.BAD_TRANSFER})
        # A site-signed MANIFEST whose payload is not a manifest verifies, and is NACKed (bad_transfer); any other
        # kind on an update topic is refused before its signature is looked at, with no answer.
        authenticated = authenticated and kind == MessageKind.MANIFEST
    if "bad_topic" in header:
        topic = draw(BAD_TOPICS)
        reasons.add(R.BAD_TOPIC)
        authenticated = False
    elif "wrong_channel" in header:
        topic = draw(WRONG_CHANNEL_TOPICS)
        reasons.add(R.WRONG_KIND)
        authenticated = False
    if "future_timestamp" in header:
        ts = now_ms() + draw(FUTURE)
        reasons.add(R.BAD_TIMESTAMP)
    elif "past_timestamp" in header:
        ts = max(0, now_ms() - draw(PAST))
        reasons.add(R.BAD_TIMESTAMP)
    sequence = None
    if "huge_integer" in header:  # the format allows any non-negative integer; the database does not
        which = draw(st.sampled_from(["round", "sequence", "timestamp"]))
        if which == "round":
            round_ = draw(st.one_of(st.integers(2 ** 31, 2 ** 63), HUGE))
        elif which == "sequence":
            sequence = draw(HUGE)
        else:
            ts = draw(HUGE)
        reasons.add(R.MALFORMED_ENVELOPE)
        authenticated = False
    if payload_defect:
        payload, p_reasons, p_kind = draw(bad_payloads())
        reasons.update(p_reasons)
        header.append(p_kind)
    else:
        payload = good_payload(draw(VALUES))
    if "oversized_signed" in wire:
        payload += bytes(LIMITS.max_message_bytes)
    raw = h.seal(site, round=round_, base=base, payload=payload, key=key, kind=kind, fed=fed, timestamp=ts,
                 sequence=sequence)
    if "bit_flip" in wire:
        raw = flip_bits(raw, draw(st.lists(st.integers(0, 2 ** 20), min_size=1, max_size=8, unique=True)))
        reasons.update(PRE_VERIFY)
        authenticated = False
    elif "truncated" in wire:
        raw = raw[:draw(st.integers(0, 2 ** 20)) % len(raw)]
        reasons.update({R.MALFORMED_ENVELOPE, R.BAD_SIGNATURE})
        authenticated = False
    elif "trailing_garbage" in wire:
        raw += draw(st.binary(min_size=1, max_size=256))
        reasons.add(R.BAD_SIGNATURE)
        authenticated = False
    elif "oversized" in wire:
        raw += draw(st.binary(min_size=1, max_size=64)) * (LIMITS.max_message_bytes // 8)
        raw += bytes(max(0, LIMITS.max_message_bytes + 1 - len(raw)))
    if len(raw) > LIMITS.max_message_bytes:
        reasons = {R.OVERSIZED}
        authenticated = False
    if topic is None:
        topic = Harness.topic(topic_site or site, topic_fed)
    return Message(topic, raw, frozenset(reasons), authenticated, f"envelope {sorted(header)} {wire}")


WHOLE_EXAMPLES, WHOLE_BATCH = 1750, 5


@pytest.mark.slow  # about 40 s on 2 cores
def test_adversarial_whole_envelopes_are_refused(harness: Harness) -> None:
    """8,750 whole envelopes (1,750 examples of 5), each with 1-4 defects: refused with a reason of a defect."""
    seen = Counter()

    @settings(max_examples=WHOLE_EXAMPLES, **FUZZ)
    @given(batch=st.lists(adversarial_envelopes(harness), min_size=WHOLE_BATCH, max_size=WHOLE_BATCH))
    def run(batch: list[Message]) -> None:
        for msg in batch:
            seen["envelopes"] += 1
            harness.deliver(msg.topic, msg.raw, reasons=msg.reasons, authenticated=msg.authenticated, what=msg.what)

    run()
    STATS["generated:whole envelopes"] += seen["envelopes"]
    assert seen["envelopes"] >= WHOLE_EXAMPLES * WHOLE_BATCH


# ---- chunk streams ------------------------------------------------------------------------------------------------
@dataclass
class Transfer:
    """What the receiver must hold of one kept transfer (the model's side)."""

    manifest: Manifest
    site: str
    inner_reasons: frozenset
    held: set = field(default_factory=set)


@dataclass
class Outcome:
    reasons: frozenset
    may_keep: bool
    authenticated: bool


class StreamModel:
    """A model of :class:`TransferReceiver` for chunk streams: which manifests are kept, which chunks held, what
    the receiver must answer next (reasons, None, a RECEIPT listing exactly the missing chunks)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.kept: dict[str, Transfer] = {}

    def manifest(self, t: Transfer, *, resume: bool, refused: frozenset | None) -> Outcome:
        if refused is not None:
            return Outcome(refused, False, True)
        tid = t.manifest.transfer_id
        held = self.kept.setdefault(tid, t)
        if not resume:
            return Outcome(frozenset(), True, True)
        if len(held.held) == held.manifest.num_chunks:
            return self._complete(held)
        return Outcome(frozenset(), True, True)

    def chunk(self, topic: str, raw: bytes) -> Outcome:
        if len(raw) > LIMITS.max_chunk_bytes + 40:
            return Outcome(frozenset({R.OVERSIZED}), False, False)
        if not raw.startswith(CHUNK_MAGIC):
            return Outcome(frozenset({R.MALFORMED_ENVELOPE}), False, False)
        if len(raw) <= 40:
            return Outcome(frozenset({R.BAD_TRANSFER}), False, False)
        try:
            _, topic_site, channel = parse_topic(topic)
        except (MalformedEnvelopeError, ConfigError):
            return Outcome(frozenset({R.BAD_TOPIC}), False, False)
        tid, (index,), data = raw[4:36].hex(), struct.unpack(">I", raw[36:40]), raw[40:]
        t = self.kept.get(tid)
        if t is None or channel != "update":
            return Outcome(frozenset({R.UNKNOWN_TRANSFER}), False, False)
        if topic_site != t.site:
            return Outcome(frozenset({R.TOPIC_MISMATCH}), False, False)
        m = t.manifest
        if not (index < m.num_chunks and len(data) == m.chunk_length(index)
                and blake3.blake3(data).digest() == m.leaves[index]):
            return Outcome(frozenset({R.BAD_TRANSFER}), False, False)
        t.held.add(index)
        if len(t.held) < m.num_chunks:
            return Outcome(frozenset(), True, False)
        return self._complete(t)

    def _complete(self, t: Transfer) -> Outcome:
        """Every chunk matched its leaf: the inner envelope is verified (a kept manifest binds its leaves to the
        signed payload digest), and ingest decides on its header and payload."""
        del self.kept[t.manifest.transfer_id]
        return Outcome(t.inner_reasons, False, True)


INNER_DEFECTS = ["payload", "payload", "payload", "flip", "truncate", "forged", "future_timestamp", "stale_model",
                 "wrong_round", "not_selected"]
MANIFEST_VARIANTS = ["genuine", "genuine", "genuine", "resume", "forged", "bad_body", "oversized_total",
                     "oversized_chunk", "task_kind", "header_mismatch", "tampered_digests", "none"]
CHUNK_OPS = ["all", "send", "send", "send", "flip", "reindex", "truncate", "oversize", "unknown", "other_topic",
             "bad_topic", "resume", "manifest_again"]
CHUNK_SIZES = st.sampled_from([1024, 2048])  # piece sizes are powers of two (shared.envelope)
BITS = st.integers(0, 2 ** 20)
#: What a manifest variant is refused with at the manifest, before any chunk is kept (coordinator.inbound.transfers).
VARIANT_REFUSALS = {"forged": frozenset({R.BAD_SIGNATURE}), "bad_body": frozenset({R.BAD_TRANSFER}),
                    "task_kind": frozenset({R.BAD_TRANSFER}), "oversized_total": frozenset({R.OVERSIZED}),
                    "oversized_chunk": frozenset({R.OVERSIZED}), "header_mismatch": frozenset({R.BAD_TRANSFER}),
                    "tampered_digests": frozenset({R.BAD_TRANSFER})}


@dataclass
class Stream:
    messages: list  # (label, topic, raw, callable -> Outcome)
    what: str


def _header_json(fields: dict) -> str:
    """An inner header as the manifest carries it (canonical JSON), from fields that need not be valid."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _zero_leaves(fields: dict, total: int, piece: int) -> list[str]:
    """Set ``fields`` to announce ``total`` bytes in pieces of ``piece`` under all-zero leaves, consistently (the
    payload digest derived from them), and return those leaves (hex)."""
    leaves = [bytes(32)] * -(-total // piece)
    fields.update(payload_length=total, piece_size=piece, payload_digest=payload_digest_from_leaves(leaves, piece))
    return [x.hex() for x in leaves]


def _manifest_payload(draw: st.DrawFn, body: dict, variant: str) -> bytes:
    """The MANIFEST payload of ``body`` (the genuine fields: header, signature, leaves, resume), made wrong as
    ``variant`` says."""
    body = dict(body)
    fields = json.loads(body["header"])
    if variant == "oversized_total":
        body["leaves"] = _zero_leaves(fields, draw(st.integers(LIMITS.max_update_bytes + 1,
                                                               LIMITS.max_update_bytes * 4)), 2048)
        body["header"] = _header_json(fields)
    elif variant == "oversized_chunk":
        body["leaves"] = _zero_leaves(fields, fields["payload_length"], 1 << draw(st.integers(12, 20)))
        body["header"] = _header_json(fields)
    elif variant == "task_kind":
        fields["kind"] = draw(st.sampled_from(["task", "ack", "manifest", "receipt"]))
        body["header"] = _header_json(fields)
    elif variant == "bad_body":
        how = draw(st.sampled_from(["missing", "extra", "header_garbage", "header_type", "signature", "count",
                                    "leaves", "resume", "piece_size", "retired", "huge_length", "digits",
                                    "not_json", "tensors"]))
        if how == "missing":
            del body[draw(st.sampled_from(sorted(body)))]
        elif how == "extra":
            body["extra"] = 1
        elif how == "header_garbage":
            body["header"] = draw(st.sampled_from(["", "{}", "x", "[]", body["header"].replace(",", ", ", 1),
                                                   _header_json({**fields, "extra": 1})]))
        elif how == "header_type":
            body["header"] = draw(st.sampled_from([7, None, {}, [body["header"]]]))
        elif how == "signature":
            body["signature"] = draw(st.sampled_from(["", "zz" * 64, body["signature"][:-2],
                                                      body["signature"].upper(), 5]))
        elif how == "count":
            body["leaves"] = body["leaves"] + [body["leaves"][0]]
        elif how == "leaves":
            body["leaves"] = draw(st.sampled_from([["xyz"], "ab" * 32, [x.upper() for x in body["leaves"]], [7],
                                                   None, body["leaves"][1:]]))
        elif how == "resume":
            body["resume"] = draw(st.sampled_from([1, "yes", None]))
        elif how == "piece_size":
            body["header"] = _header_json({**fields, "piece_size": draw(st.sampled_from([0, 1000, 1536, 512, 3.5,
                                                                                        "1024", None]))})
        elif how == "retired":  # an inner header of envelope format 1
            retired = {k: v for k, v in fields.items() if k not in ("payload_digest", "piece_size")}
            body["header"] = _header_json({**retired, "format_version": 1, "payload_sha256": "ab" * 32})
        elif how == "huge_length":  # once crashed Manifest.num_chunks (float division overflow) in format 1
            body["header"] = _header_json({**fields, "payload_length": draw(st.integers(10 ** 309, 10 ** 400))})
        elif how == "digits":  # more digits than Python's int() accepts: once crashed decode_manifest
            body["header"] = body["header"].replace(f'"payload_length":{fields["payload_length"]}',
                                                    '"payload_length":1' + "0" * 4400)
        elif how == "not_json":
            return encode_tensors({}, {"wildfed": draw(st.sampled_from(["{", "[]", "null", "x"]))})
        else:
            return encode_tensors({"t": np.zeros(2, np.float32)}, {"wildfed": json.dumps(body)})
    return encode_tensors({}, {"wildfed": json.dumps(body)})


@st.composite
def chunk_streams(draw: st.DrawFn, h: Harness, model: StreamModel) -> Stream:
    """One always-bad upload as a manifest (or none) and a list of chunk operations (see the module docstring)."""
    defect = draw(st.sampled_from(INNER_DEFECTS))
    site, round_, base, key, ts = "s2", 2, h.hash2, None, None
    precheck: frozenset | None = None  # refused at the manifest by the round checks (Ingestor.precheck)
    shown: frozenset | None = None  # refused at the manifest because the manifest shows the defect
    if defect == "payload":  # an empty payload travels whole, never chunked
        payload, inner_reasons, label = draw(bad_payloads().filter(lambda b: len(b[0]) > 0))
        defect = f"payload:{label}"
    else:
        payload, inner_reasons = good_payload(draw(VALUES)), frozenset()
    if defect == "forged":  # the inner envelope signed by another key: its signature is checked at the manifest
        key, shown = "attacker", frozenset({R.BAD_SIGNATURE})
    elif defect == "future_timestamp":
        ts, inner_reasons = now_ms() + draw(FUTURE), frozenset({R.BAD_TIMESTAMP})
    elif defect == "stale_model":
        base, precheck = h.hash1, frozenset({R.STALE_MODEL})
    elif defect == "wrong_round":
        round_, precheck = draw(st.sampled_from([0, 1, 3, 99])), frozenset({R.WRONG_ROUND})
    elif defect == "not_selected":
        site, precheck = "s3", frozenset({R.NOT_SELECTED})
    size = draw(CHUNK_SIZES)
    env = h.seal_env(site, round=round_, base=base, payload=payload, key=key, timestamp=ts, piece_size=size)
    assert env.header.payload_length <= LIMITS.max_update_bytes
    manifest, chunks = split(env)
    body = {"header": env.header.canonical_bytes().decode(), "signature": env.signature.hex(),
            "leaves": [x.hex() for x in manifest.leaves], "resume": False}
    if defect in ("flip", "truncate"):  # the payload altered after signing: its own leaves cannot derive the digest
        altered = (flip_bits(payload, draw(st.lists(BITS, min_size=1, max_size=4, unique=True))) if defect == "flip"
                   else payload[:max(1, draw(BITS) % len(payload))])
        body["leaves"] = [x.hex() for x in payload_leaves(altered, size)]
        chunks = [Chunk(manifest.transfer_id, i, altered[i * size:(i + 1) * size])
                  for i in range(-(-len(altered) // size))]
        shown = frozenset({R.BAD_TRANSFER})
    variant = draw(st.sampled_from(MANIFEST_VARIANTS))
    signer = h.keys[site]
    if variant == "forged":
        signer = h.keys[draw(st.sampled_from(["attacker", "ghost"]))]
    elif variant == "tampered_digests":  # a chunk altered, and its digest with it
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = Chunk(manifest.transfer_id, i, flip_bits(chunks[i].data, [draw(BITS)]))
        body["leaves"] = body["leaves"][:i] + [blake3.blake3(chunks[i].data).hexdigest()] + body["leaves"][i + 1:]
    refused = VARIANT_REFUSALS.get(variant, shown if shown is not None else precheck)
    topic = Harness.topic(site)
    transfer = Transfer(manifest, site, inner_reasons)

    def manifest_message(resume: bool) -> tuple:
        if variant in ("genuine", "resume", "forged") and defect not in ("flip", "truncate"):  # genuine leaves
            raw = seal_manifest(private_key=signer, manifest=manifest, resume=resume).to_bytes()
        else:
            sequence = env.header.sequence + (draw(st.integers(1, 100)) if variant == "header_mismatch" else 0)
            raw = seal(private_key=signer, federation_id=FED, site_id=site, round=round_, base_model_hash=base,
                       kind=MessageKind.MANIFEST, sequence=sequence,
                       payload=_manifest_payload(draw, {**body, "resume": resume}, variant)).to_bytes()
        t = Transfer(transfer.manifest, transfer.site, transfer.inner_reasons)
        return (f"manifest({variant}, resume={resume})", topic, raw,
                lambda: model.manifest(t, resume=resume, refused=refused), resume)

    messages = []
    for op in draw(st.lists(st.sampled_from(CHUNK_OPS), max_size=5)):
        i = draw(st.integers(0, len(chunks) - 1))
        c = chunks[i]
        if op == "all":
            messages += [(f"chunk {c.index}", topic, c.to_bytes()) for c in chunks]
        elif op == "send":
            messages.append((f"chunk {i}", topic, c.to_bytes()))
        elif op == "flip":
            messages.append((f"flipped chunk {i}", topic, CHUNK_MAGIC + flip_bits(c.to_bytes()[4:], [draw(BITS)])))
        elif op == "reindex":
            j = draw(st.one_of(st.integers(0, len(chunks) + 2), st.integers(0, 2 ** 32 - 1)))
            messages.append((f"chunk {i} as {j}", topic, Chunk(c.transfer_id, j, c.data).to_bytes()))
        elif op == "truncate":
            raw = c.to_bytes()
            messages.append((f"truncated chunk {i}", topic, raw[:draw(BITS) % len(raw)]))
        elif op == "oversize":
            messages.append((f"oversized chunk {i}", topic,
                             Chunk(c.transfer_id, i, bytes(c.data) + bytes(LIMITS.max_chunk_bytes)).to_bytes()))
        elif op == "unknown":
            tid = hashlib.sha256(b"unknown" + env.to_bytes() + bytes([i])).hexdigest()
            messages.append((f"chunk {i} of an unknown transfer", topic, Chunk(tid, i, c.data).to_bytes()))
        elif op == "other_topic":
            other = draw(st.sampled_from(["s1", "s3", "ghost"] if site == "s2" else ["s1", "s2", "ghost"]))
            messages.append((f"chunk {i} on {other}'s topic", Harness.topic(other), c.to_bytes()))
        elif op == "bad_topic":
            messages.append((f"chunk {i} on a bad topic", draw(st.one_of(BAD_TOPICS, WRONG_CHANNEL_TOPICS)),
                             c.to_bytes()))
        elif op in ("resume", "manifest_again") and variant != "none":
            messages.append(manifest_message(op == "resume"))
    if variant != "none":
        messages.insert(draw(st.integers(0, len(messages))), manifest_message(variant == "resume"))
    return Stream(messages, f"stream inner={defect} manifest={variant}")


STREAM_EXAMPLES = 1100


@pytest.mark.slow  # about 14 s
def test_adversarial_chunk_streams_never_complete_into_an_accepted_update(harness: Harness) -> None:
    """1,100 chunk streams: every manifest and chunk is refused or legitimately kept, receipts list exactly the
    missing chunks, and nothing is ever accepted."""
    model = StreamModel(harness)
    seen = Counter()

    @settings(max_examples=STREAM_EXAMPLES, **FUZZ)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        stream = data.draw(chunk_streams(harness, model))
        seen["streams"] += 1
        for entry in stream.messages:
            label, topic, raw = entry[:3]
            outcome = entry[3]() if len(entry) > 3 else model.chunk(topic, raw)
            since = len(harness.transport.published)
            harness.deliver(topic, raw, reasons=outcome.reasons, may_keep=outcome.may_keep,
                            authenticated=outcome.authenticated, what=f"{stream.what}: {label}")
            if len(entry) > 3 and entry[4] and outcome.may_keep:  # a kept resume probe: the receipt is exact
                t = model.kept[decode_manifest(Envelope.from_bytes(raw).payload).transfer_id]
                missing = tuple(i for i in range(t.manifest.num_chunks) if i not in t.held)
                assert [(r.transfer_id, r.missing) for r in harness.receipts(since)] == [
                    (t.manifest.transfer_id, missing)], stream.what
                STATS["receipts checked"] += 1

    run()
    STATS["generated:chunk streams"] += seen["streams"]
    assert seen["streams"] >= STREAM_EXAMPLES


# ---- replays --------------------------------------------------------------------------------------------------------
def genuine_chunked(h: Harness, site: str, *, value: float, n: int, chunk_size: int = 1024,
                    round: int = 2) -> tuple[Envelope, list[tuple[str, bytes]]]:
    """A genuine update of ``site`` as shared.transfer.send publishes it: ``[(topic, manifest), (topic, chunk)...]``."""
    env = h.seal_env(site, round=round, payload=good_payload(value, n), piece_size=chunk_size)
    out: list[tuple[str, bytes]] = []
    sent = send(lambda t, raw: out.append((t, raw)), Harness.topic(site), env.to_bytes(),
                private_key=h.keys[site], chunk_size=chunk_size)
    assert sent == len(out) >= 4  # a manifest and at least three chunks
    return env, out


@pytest.fixture
def replay_harness(tmp_path: Path) -> Harness:
    """The harness plus ``s2``'s round-2 update, accepted through a resumed chunked transfer (captured)."""
    h = Harness(tmp_path)
    env, out = genuine_chunked(h, "s2", value=-0.5, n=23)
    (topic, manifest), chunks = out[0], out[1:]
    assert h.deliver(topic, manifest, may_keep=True) is None
    assert h.deliver(*chunks[0], may_keep=True) is None
    resume = seal_manifest(private_key=h.keys["s2"], manifest=split(env)[0], resume=True).to_bytes()
    assert h.deliver(topic, resume, may_keep=True) is None
    for c in chunks[1:-1]:
        assert h.deliver(*c, may_keep=True) is None
    h.deliver(*chunks[-1], accept=("s2", 23, -0.5))
    h.captured = {"s1 round 2 (whole)": [(h.topic("s1"), h.s1_round2)],
                  "s1 round 1 (whole, past round)": [(h.topic("s1"), h.s1_round1)],
                  "s2 round 2 (chunked)": [(topic, manifest), *chunks],
                  "s2 round 2 (resume manifest)": [(topic, resume)]}
    h.inner = {"s1 round 2 (whole)": h.s1_round2, "s1 round 1 (whole, past round)": h.s1_round1,
               "s2 round 2 (chunked)": env.to_bytes(), "s2 round 2 (resume manifest)": env.to_bytes()}
    h.allow_positive_ack = True  # a replay of a stored update is re-ACKed so the gateway's outbox drains
    yield h
    h._reader.close()
    h.store.dispose()


REPLAY_EXAMPLES = 300
REPLAY_SOURCES = ["s1 round 2 (whole)", "s1 round 1 (whole, past round)", "s2 round 2 (chunked)",
                  "s2 round 2 (resume manifest)"]


def _replay_reasons(raw: bytes, topic: str) -> frozenset:
    if raw.startswith(CHUNK_MAGIC):
        return frozenset({R.UNKNOWN_TRANSFER})  # the transfer was completed and dropped
    site = Envelope.from_bytes(raw).header.site_id
    return frozenset({R.DUPLICATE} if topic == Harness.topic(site) else {R.TOPIC_MISMATCH})


@pytest.mark.slow  # with the other generators: the totals below need all four
def test_replays_are_never_accepted_twice(replay_harness: Harness) -> None:
    """300 replay scenarios (about 1,500 messages): captured accepted updates, whole and chunked, of the open and a
    past round, re-sent verbatim, on other topics, re-announced by their genuine sender, re-chunked by an attacker."""
    h = replay_harness
    seen = Counter()

    @settings(max_examples=REPLAY_EXAMPLES, **FUZZ)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        seen["scenarios"] += 1
        for _ in range(data.draw(st.integers(1, 3))):
            source = data.draw(st.sampled_from(REPLAY_SOURCES))
            captured = h.captured[source]
            how = data.draw(st.sampled_from(["verbatim", "verbatim", "shuffled", "other_topic", "re_announced",
                                             "re_chunked"]))
            if how in ("verbatim", "shuffled"):
                msgs = data.draw(st.permutations(captured)) if how == "shuffled" else captured
                for topic, raw in msgs:
                    h.deliver(topic, raw, reasons=_replay_reasons(raw, topic), what=f"{how} replay of {source}")
            elif how == "other_topic":
                topic_site = data.draw(st.sampled_from(["s1", "s2", "s3", "ghost"]))
                for own_topic, raw in captured:
                    t = Harness.topic(topic_site)
                    h.deliver(t, raw, reasons=_replay_reasons(raw, t), authenticated=t == own_topic,
                              what=f"replay of {source} on {topic_site}'s topic")
            else:
                inner_raw = h.inner[source]
                env = Envelope.from_bytes(inner_raw)
                site = env.header.site_id
                manifest, chunks = split(inner_raw)  # in its pieces of 1 KiB (Harness.seal_env)
                if how == "re_announced":  # the genuine site announces its stored update again, as chunks
                    signer, reasons, auth = h.keys[site], frozenset({R.DUPLICATE}), True
                else:  # an attacker re-chunks a captured update under its own manifest
                    signer, reasons, auth = h.keys["attacker"], frozenset({R.BAD_SIGNATURE}), False
                raw = seal_manifest(private_key=signer, manifest=manifest).to_bytes()
                h.deliver(Harness.topic(site), raw, reasons=reasons, authenticated=auth, what=f"{how} {source}")
                for c in data.draw(st.permutations(chunks)):
                    h.deliver(Harness.topic(site), c.to_bytes(), reasons=frozenset({R.UNKNOWN_TRANSFER}),
                              authenticated=False, what=f"{how} {source}: chunk {c.index}")
            seen["replays"] += 1

    run()
    STATS["generated:replay scenarios"] += seen["scenarios"]
    assert seen["scenarios"] >= REPLAY_EXAMPLES
    # the two stored updates of round 2 and the one of round 1 are still the only ones; nothing was charged
    assert h.table_counts() == (3, 0) and h.ctx.strategy.count == 2


# ---- positive controls ----------------------------------------------------------------------------------------------
def test_positive_control_whole_update_is_accepted_exactly_once(harness: Harness) -> None:
    h = harness
    raw = h.seal("s2", payload=good_payload(0.5, 31))
    h.deliver(h.topic("s2"), raw, accept=("s2", 31, 0.5))
    h.allow_positive_ack = True
    for _ in range(3):
        h.deliver(h.topic("s2"), raw, reasons=frozenset({R.DUPLICATE}), what="QoS 1 re-delivery")
    assert h.table_counts() == (3, 0) and h.ctx.strategy.count == 2
    mean = h.ctx.strategy.aggregate()
    np.testing.assert_allclose(mean["psi.b"], (17 * 0.75 + 31 * 0.5) / 48, rtol=1e-6)


def test_positive_control_chunked_update_is_accepted_exactly_once(harness: Harness) -> None:
    h = harness
    env, out = genuine_chunked(h, "s2", value=0.125, n=9)
    for topic, raw in out[:-1]:
        assert h.deliver(topic, raw, may_keep=True) is None
    h.deliver(*out[-1], accept=("s2", 9, 0.125))
    assert h.receiver.pending() == [] and not (h.receiver.staging_dir / out[1][1][4:36].hex()).exists()
    h.allow_positive_ack = True
    for topic, raw in out:  # the whole transfer again: the manifest is re-ACKed, the chunks have no transfer
        h.deliver(topic, raw, reasons=_replay_reasons(raw, topic), what="replayed transfer")
    assert h.table_counts() == (3, 0) and h.ctx.strategy.count == 2


def test_positive_control_resume_lists_exactly_the_missing_chunks(harness: Harness) -> None:
    h = harness
    env, out = genuine_chunked(h, "s2", value=0.375, n=5)
    (topic, manifest_raw), chunks = out[0], out[1:]
    assert h.deliver(topic, manifest_raw, may_keep=True) is None
    held = [0, 2]
    for i in held:
        assert h.deliver(*chunks[i], may_keep=True) is None
    # the gateway reconnects and probes with a resume manifest
    since = len(h.transport.published)
    probe: list[tuple[str, bytes]] = []
    send(lambda t, raw: probe.append((t, raw)), topic, env.to_bytes(), private_key=h.keys["s2"], chunk_size=1024,
         resume=True)
    assert len(probe) == 1
    assert h.deliver(*probe[0], may_keep=True) is None
    receipts = h.receipts(since)
    missing = tuple(i for i in range(len(chunks)) if i not in held)
    transfer_id = blake3.blake3(env.header.canonical_bytes() + env.signature,  # by hand: the context spelled out
                                derive_key_context="WildFed 2025-06-01 12:00:00 chunked transfer id v2").hexdigest()
    assert [(r.transfer_id, r.missing) for r in receipts] == [(transfer_id, missing)]
    ack_topic_ = h.transport.published[-1][0]
    assert ack_topic_ == f"wildfed/v1/{FED}/site/s2/ack"
    # the gateway answers the receipt with exactly those chunks
    rest: list[tuple[str, bytes]] = []
    send(lambda t, raw: rest.append((t, raw)), topic, env.to_bytes(), private_key=h.keys["s2"], chunk_size=1024,
         missing=receipts[0].missing)
    assert len(rest) == len(missing)
    for t, raw in rest[:-1]:
        assert h.deliver(t, raw, may_keep=True) is None
    h.deliver(*rest[-1], accept=("s2", 5, 0.375))


NOISY_EXAMPLES = 40


@pytest.mark.slow  # with the other generators: the totals below need all four
def test_genuine_chunk_streams_with_noise_are_accepted_exactly_once(harness: Harness) -> None:
    """40 genuine chunked updates (a new selected site each), chunks shuffled and duplicated, with adversarial chunks
    and manifests interleaved: each is accepted exactly once, when its last missing chunk arrives."""
    h = harness
    model = StreamModel(h)
    seen = Counter()

    @settings(max_examples=NOISY_EXAMPLES, **FUZZ)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        seen["streams"] += 1
        site = f"p{seen['streams']}"
        h.keys[site] = generate_signing_key()
        h.registry.enrol(site, public_key_to_pem(h.keys[site].public_key()), {})
        h.ctx.selected = h.ctx.selected | {site}
        value, n = data.draw(VALUES), data.draw(st.integers(1, 1000))
        env = h.seal_env(site, payload=good_payload(value, n), piece_size=data.draw(CHUNK_SIZES))
        manifest, chunks = split(env)
        order = data.draw(st.lists(st.sampled_from(chunks), min_size=len(chunks), max_size=3 * len(chunks)))
        order += data.draw(st.permutations(chunks))  # every chunk arrives at least once after the manifest
        man = seal_manifest(private_key=h.keys[site], manifest=manifest).to_bytes()
        forged = seal_manifest(private_key=h.keys["attacker"], manifest=manifest).to_bytes()
        topic = Harness.topic(site)
        h.deliver(topic, forged, reasons=frozenset({R.BAD_SIGNATURE}), authenticated=False, what="forged manifest")
        for c in chunks[:data.draw(st.integers(0, len(chunks)))]:  # chunks before their manifest
            h.deliver(topic, c.to_bytes(), reasons=frozenset({R.UNKNOWN_TRANSFER}), authenticated=False,
                      what="chunk before its manifest")
        assert h.deliver(topic, man, may_keep=True) is None
        model.kept[manifest.transfer_id] = Transfer(manifest, site, frozenset())
        accepted = 0

        def chunk(t: str, raw: bytes, what: str) -> None:
            nonlocal accepted
            pending = manifest.transfer_id in model.kept
            outcome = model.chunk(t, raw)
            if pending and manifest.transfer_id not in model.kept:  # this one completes the transfer
                h.deliver(t, raw, accept=(site, n, value), what=what)
                accepted += 1
            else:
                h.deliver(t, raw, **_expect(outcome), what=what)

        for c in order:
            noise = data.draw(st.sampled_from([None, None, "flip", "other_topic", "unknown"]))
            if noise == "flip":  # may hit the index and land on an identical chunk: then it is a good chunk
                chunk(topic, CHUNK_MAGIC + flip_bits(c.to_bytes()[4:], [data.draw(BITS)]), "flipped chunk")
            elif noise == "other_topic":
                chunk(Harness.topic("s1"), c.to_bytes(), "chunk on another site's topic")
            elif noise == "unknown":
                chunk(topic, Chunk(hashlib.sha256(b"x" + c.data).hexdigest(), c.index, c.data).to_bytes(), "unknown")
            chunk(topic, c.to_bytes(), f"chunk {c.index}")
        assert accepted == 1

    run()
    STATS["generated:genuine streams with noise"] += seen["streams"]
    assert seen["streams"] >= NOISY_EXAMPLES


def _expect(outcome: Outcome) -> dict:
    return {"reasons": outcome.reasons, "may_keep": outcome.may_keep, "authenticated": outcome.authenticated}


# ---- totals ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # runs with the four generators (-m slow)
def test_zz_fuzz_totals() -> None:
    """The sum over the four fuzz generators above (all marked slow, like this test: ``pytest -m slow`` runs them
    together): at least 10,000 generated envelopes and chunk streams."""
    generated = {k: v for k, v in STATS.items() if k.startswith("generated:")}
    if len(generated) < 4:
        pytest.skip("run the four generators with it to check the totals: pytest -m slow "
                    "tests/coordinator/test_fuzz_transport.py")
    total = sum(generated.values())
    reasons = {k[len("reason:"):]: v for k, v in sorted(STATS.items()) if k.startswith("reason:")}
    print(f"\nfuzz totals: {generated}, total {total}; {STATS['messages']} messages, {STATS['kept']} kept, "
          f"{STATS['accepted']} accepted (positive controls), {STATS['receipts checked']} receipts checked; "
          f"reasons: {reasons}")
    assert total >= 10_000
    # every reason code the upload path can give without charging the ledger (late, halted_category and
    # over_budget charge it on purpose: test_ingest.py; no_valid_key: test_key_rotation.py; replayed is for
    # download receipts, secagg_protocol for another topic)
    assert set(reasons) >= {r.value for r in R} - {"late", "halted_category", "over_budget", "no_valid_key",
                                                  "replayed", "secagg_protocol"}, sorted(reasons)
