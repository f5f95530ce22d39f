"""Ingest: every failure is rejected with its reason, stored, counted, never aggregated; accepted updates are
stored before they are acknowledged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.codec import encode_tensors
from shared.envelope import Envelope, MessageKind, verify
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key
from shared.privacy.events import DPSGDEvent
from shared.protocol import UpdateReport, decode_ack
from shared.topics import ack_topic, update_topic

from coordinator.inbound.context import Accepted
from coordinator.inbound.reject import Rejected, RejectReason
from tests.coordinator.helpers import EVENT, FED, FakeSite, tiny_weights


@pytest.fixture
def open_round(federation):
    coord, transport, key = federation()
    sites = {}
    for sid, n in (("s1", 10), ("s2", 30)):
        site = FakeSite(sid, transport, key.public_key(), value=1.0, num_examples=n,
                        events={IUCNCategory.LC: EVENT})
        site.transport.subscribe(ack_topic(FED, sid), site._on_ack)  # listen to ACKs, do not answer tasks
        coord.enrol(sid, site.public_pem, {"capacity": n})
        sites[sid] = site
    coord.start()
    ctx = coord.rounds.open_round()
    return coord, transport, ctx, sites


def good_delta(value: float = 1.0) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) for k, v in tiny_weights().items()}


def raw_payload(delta, report: UpdateReport) -> bytes:
    """Encode without shared.protocol's own checks (to forge wrong dtypes / NaN)."""
    return encode_tensors(delta, {"wildfed": json.dumps(report.to_json())})


def submit(coord, site: FakeSite, raw: bytes, topic_site: str | None = None):
    return coord.ingestor.handle(update_topic(FED, topic_site or site.site_id), raw)


def assert_rejected(coord, ctx, result, reason: RejectReason, count: int = 1) -> None:
    assert isinstance(result, Rejected), result
    assert result.reason is reason, result
    assert coord.store.rejection_counts().get(reason.value) == count
    assert coord.status().rejections[reason.value] == count
    assert ctx.strategy.count == 0 and not ctx.accepted and coord.store.count_updates() == 0


def test_accepted_update_is_stored_before_it_is_acknowledged(open_round):
    coord, transport, ctx, sites = open_round
    s1 = sites["s1"]
    seen_at_ack = []
    transport.subscribe(ack_topic(FED, "s1"), lambda t, raw: seen_at_ack.append(
        (coord.store.count_updates(), ctx.strategy.count)))
    result = submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta())))
    assert isinstance(result, Accepted)
    assert coord.store.get_blob(result.payload_sha256)  # durable blob
    assert seen_at_ack == [(1, 0)]  # row committed before the ACK; running sum touched only after it
    assert ctx.strategy.count == 1
    assert s1.acks[-1].accepted and s1.acks[-1].round == ctx.round


@pytest.mark.parametrize("how", ["flipped_payload_byte", "wrong_key"])
def test_bad_signature(open_round, how):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    if how == "flipped_payload_byte":
        s1.tamper = True
        raw = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta()))
    else:
        raw = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta()), key=generate_signing_key())
    assert_rejected(coord, ctx, submit(coord, s1, raw), RejectReason.BAD_SIGNATURE)
    assert s1.acks == []  # nothing is said to an unverified sender


def test_unknown_site(open_round, federation):
    coord, transport, ctx, _ = open_round
    stranger = FakeSite("stranger", transport, None, value=1.0, num_examples=5, events={IUCNCategory.LC: EVENT})
    raw = stranger.envelope(ctx.round, ctx.model_hash, stranger.payload(good_delta()))
    assert_rejected(coord, ctx, submit(coord, stranger, raw), RejectReason.UNKNOWN_SITE)


def test_wrong_round_gets_a_signed_negative_ack(open_round):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    raw = s1.envelope(ctx.round + 1, ctx.model_hash, s1.payload(good_delta()))
    assert_rejected(coord, ctx, submit(coord, s1, raw), RejectReason.WRONG_ROUND)
    assert not s1.acks[-1].accepted and "wrong_round" in s1.acks[-1].reason


def test_duplicate_is_rejected_counted_and_not_aggregated_twice(open_round):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    raw = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta()))
    assert isinstance(submit(coord, s1, raw), Accepted)
    again = submit(coord, s1, raw)  # QoS 1 re-delivery
    other = submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta(5.0))))
    assert isinstance(again, Rejected) and again.reason is RejectReason.DUPLICATE
    assert isinstance(other, Rejected) and other.reason is RejectReason.DUPLICATE
    assert coord.store.rejection_counts()["duplicate"] == 2
    assert ctx.strategy.count == 1 and coord.store.count_updates() == 1
    assert [a.accepted for a in s1.acks] == [True, True, False]  # same bytes re-ACKed so the outbox drains


@pytest.mark.parametrize("payload", [b"garbage", b"\x08" + b"\x00" * 7 + b"{}", b""])
def test_malformed_payload(open_round, payload):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    raw = s1.envelope(ctx.round, ctx.model_hash, payload)
    assert_rejected(coord, ctx, submit(coord, s1, raw), RejectReason.MALFORMED_PAYLOAD)


def test_malformed_envelope(open_round):
    coord, _, ctx, sites = open_round
    assert_rejected(coord, ctx, submit(coord, sites["s1"], b"WFE1\x00\x00\x00\x05junk"),
                    RejectReason.MALFORMED_ENVELOPE)


@pytest.mark.parametrize("delta", [
    {"phi.w": np.zeros((2, 3), np.float32), "psi.b": np.zeros((2,), np.float32)},   # wrong shape
    {"phi.w": np.zeros((3, 2), np.float32)},                                         # missing tensor
    {"phi.w": np.zeros((3, 2), np.float64), "psi.b": np.zeros((2,), np.float32)},   # wrong dtype
])
def test_wrong_tensors(open_round, delta):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    report = UpdateReport(num_examples=10, local_steps=5, events={IUCNCategory.LC: EVENT})
    raw = s1.envelope(ctx.round, ctx.model_hash, raw_payload(delta, report))
    assert_rejected(coord, ctx, submit(coord, s1, raw), RejectReason.WRONG_TENSORS)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite(open_round, bad):
    coord, _, ctx, sites = open_round
    s1 = sites["s1"]
    delta = good_delta()
    delta["psi.b"][1] = bad
    report = UpdateReport(num_examples=10, local_steps=5, events={IUCNCategory.LC: EVENT})
    raw = s1.envelope(ctx.round, ctx.model_hash, raw_payload(delta, report))
    assert_rejected(coord, ctx, submit(coord, s1, raw), RejectReason.NON_FINITE)


def test_topic_federation_kind_selection_and_model_checks(open_round):
    coord, transport, ctx, sites = open_round
    s1, s2 = sites["s1"], sites["s2"]
    p = s1.payload(good_delta())
    cases = [
        (submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, p), topic_site="s2"), RejectReason.TOPIC_MISMATCH),
        (submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, p, federation_id="otherfed")),
         RejectReason.WRONG_FEDERATION),
        (submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, p, kind=MessageKind.DETECTION)),
         RejectReason.WRONG_KIND),
        (submit(coord, s1, s1.envelope(ctx.round, "0" * 64, p)), RejectReason.STALE_MODEL),
        (coord.ingestor.handle("not/a/wildfed/topic", s1.envelope(ctx.round, ctx.model_hash, p)),
         RejectReason.BAD_TOPIC),
    ]
    late = FakeSite("late", transport, None, value=1.0, num_examples=5, events={IUCNCategory.LC: EVENT})
    coord.enrol("late", late.public_pem, {})
    cases.append((submit(coord, late, late.envelope(ctx.round, ctx.model_hash, late.payload(good_delta()))),
                  RejectReason.NOT_SELECTED))
    for result, reason in cases:
        assert isinstance(result, Rejected) and result.reason is reason, (result, reason)
        assert coord.store.rejection_counts()[reason.value] == 1
    assert ctx.strategy.count == 0 and coord.store.count_updates() == 0


def test_report_sanity_halted_categories_and_budget(open_round):
    coord, _, ctx, sites = open_round
    s1, s2 = sites["s1"], sites["s2"]
    no_events = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta(), events={}))
    too_many_steps = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta(), local_steps=99))
    assert submit(coord, s1, no_events).reason is RejectReason.BAD_REPORT
    assert submit(coord, s1, too_many_steps).reason is RejectReason.BAD_REPORT
    # a record count in place of the declared capacity (10): refused, naming the capacity
    a_count = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta(), num_examples=7))
    refused = submit(coord, s1, a_count)
    assert refused.reason is RejectReason.BAD_REPORT and "declared capacity is 10" in refused.detail
    assert coord.ledger.spent("s1", IUCNCategory.LC) == 0.0  # insane reports are not charged
    # an event so weak it passes the LC budget (5/3) in one round: refused, but charged (the site ran it)
    greedy_event = DPSGDEvent(0.3, 1.0, 5)
    greedy = s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta(), events={IUCNCategory.LC: greedy_event}))
    assert submit(coord, s1, greedy).reason is RejectReason.OVER_BUDGET
    assert coord.ledger.events("s1", IUCNCategory.LC) == [greedy_event]
    assert coord.ledger.spent("s1", IUCNCategory.LC) > ctx.budgets[IUCNCategory.LC]
    # a site that trained a category the ledger halted: refused and charged
    ctx.halted = {"s2": frozenset({IUCNCategory.LC})}
    halted = s2.envelope(ctx.round, ctx.model_hash, s2.payload(good_delta()))
    assert submit(coord, s2, halted).reason is RejectReason.HALTED_CATEGORY
    assert coord.ledger.events("s2", IUCNCategory.LC) == [EVENT]
    counts = coord.store.rejection_counts()
    assert counts == {"bad_report": 3, "over_budget": 1, "halted_category": 1}
    assert ctx.strategy.count == 0 and coord.store.count_updates() == 0


def test_late_update_is_charged_not_aggregated(open_round):
    # Prepare: round 1 closes with s1 only (quorum 1 of 2 would not suffice, so it fails; either way s2 is late)
    coord, _, ctx, sites = open_round
    s1, s2 = sites["s1"], sites["s2"]
    assert isinstance(submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta()))), Accepted)
    coord.rounds.close_round(ctx)
    # Execute: s2's update for round 1 arrives after the close, twice
    raw = s2.envelope(ctx.round, ctx.model_hash, s2.payload(good_delta()))
    first, second = submit(coord, s2, raw), submit(coord, s2, raw)
    late_s1 = submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta())))
    # Assert: late, charged once, never stored or aggregated; s1's second one is a duplicate
    assert first.reason is RejectReason.LATE and second.reason is RejectReason.LATE
    assert late_s1.reason is RejectReason.DUPLICATE
    assert coord.ledger.events("s2", IUCNCategory.LC) == [EVENT]
    assert coord.store.count_updates() == 1 and ctx.strategy.count == 1
    assert not s2.acks[-1].accepted and "late" in s2.acks[-1].reason


def test_ack_is_signed_by_the_coordinator(open_round):
    coord, transport, ctx, sites = open_round
    s1 = sites["s1"]
    submit(coord, s1, s1.envelope(ctx.round, ctx.model_hash, s1.payload(good_delta())))
    topic, raw = [(t, r) for t, r in transport.published if t == ack_topic(FED, "s1")][-1]
    env = Envelope.from_bytes(raw)
    verify(env, coord._key.public_key())  # the key the coordinator was built with
    assert env.header.kind is MessageKind.ACK and env.header.site_id == "s1"
    assert decode_ack(env.payload).accepted
