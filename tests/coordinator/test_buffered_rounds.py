"""Buffered rounds (coordinator.buffered_rounds, coordinator.inbound.stale, coordinator.buffered_store): a stale
update is charged once, stored once, folded into exactly one round with its staleness weight, survives a restart,
and one older than max_staleness is charged and refused. Expected models are worked by hand from the FedBuff
formula sum s(t) n delta / (K * mean capacity)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sqlalchemy import select

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key
from shared.topics import ack_topic

from coordinator.buffered_store import buffer_counts
from coordinator.config import config_from_dict
from coordinator.service import Coordinator
from coordinator.storage import BufferedUpdateRow
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights
from tests.coordinator.test_federation import rdp_eps

LC = IUCNCategory.LC
BUFFERED = {"buffer_size": 2, "max_staleness": 1}


def delta_of(value: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) for k, v in tiny_weights().items()}


def federation(tmp_path, transport=None, key=None, **buffered):
    """A coordinator with 3 enrolled sites: s1 answers every task, s2 only when the test sends for it, s3 never."""
    transport, key = transport or InMemoryTransport(), key or generate_signing_key()
    cfg = make_config(tmp_path, rounds=3, round_deadline_s=0.5, buffered={**BUFFERED, **buffered})
    coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=tiny_weights())
    online = FakeSite("s1", transport, key.public_key(), value=1.0, num_examples=10, events={LC: EVENT}).attach()
    offline = FakeSite("s2", transport, key.public_key(), value=4.0, num_examples=30, events={LC: EVENT})
    silent = FakeSite("s3", transport, key.public_key(), value=9.0, num_examples=20, events={LC: EVENT})
    for site in (online, offline, silent):
        coord.enrol(site.site_id, site.public_pem, {"capacity": site.num_examples})
    transport.subscribe(ack_topic(offline.fed, "s2"), offline._on_ack)  # no task subscription: the test sends for it
    return coord, online, offline, silent


def run_one(coord):
    ctx = coord.rounds.open_round()
    coord.rounds.wait_for_quorum(ctx)
    return ctx, coord.rounds.close_round(ctx)


def test_a_stale_update_is_folded_once_with_its_staleness_weight(tmp_path):
    coord, online, offline, silent = federation(tmp_path)
    coord.start()
    mean_capacity = (10 + 30 + 20) / 3  # the enrolled sites' declared capacities: K * 20 = 40 is the denominator
    # round 1: only s1 answers; the deadline closes it with one update: 10 * 1 / 40
    ctx1, r1 = run_one(coord)
    assert (r1.status, r1.accepted, r1.stale) == ("closed", ("s1",), ())
    # s2's round-1 update comes after the close: stale by 1 (round 2 is next), charged and stored to wait
    offline.send(1, ctx1.model_hash, delta_of(4.0))
    assert offline.acks[-1].accepted and offline.acks[-1].reason == "buffered"
    assert coord.ledger.spent("s2", LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)]), rel=1e-9)
    offline.sequence -= 1
    offline.send(1, ctx1.model_hash, delta_of(4.0))  # the same update again (QoS 1 re-delivery): re-ACKed only
    assert offline.acks[-1].accepted and coord.ingestor.counts["duplicate"] == 1
    # round 2: s1's own update and s2's stale one fill the buffer (K = 2) at once
    ctx2, r2 = run_one(coord)
    assert (r2.status, r2.accepted, r2.stale) == ("closed", ("s1",), ("s2@r1",))
    # round 3: s3 answers round 1 now, 2 rounds late > max_staleness 1: charged, refused, never stored
    silent.send(1, ctx1.model_hash, delta_of(9.0))
    assert coord.ingestor.counts["late"] == 1 and coord.ledger.spent("s3", LC) > 0
    ctx3, r3 = run_one(coord)
    assert (r3.accepted, r3.stale) == (("s1",), ())  # s2's update is not folded twice
    _, weights = coord.rounds.current_model()
    step1 = 10 * 1.0 / (2 * mean_capacity)
    step2 = (10 * 1.0 + 30 * 4.0 / math.sqrt(2)) / (2 * mean_capacity)  # s(1) = 1 / sqrt(1 + 1)
    step3 = 10 * 1.0 / (2 * mean_capacity)
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 + step1 + step2 + step3, rtol=1e-6)
    assert coord.ledger.spent("s2", LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)]), rel=1e-9)  # charged once
    assert coord.ledger.spent("s1", LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)] * 3), rel=1e-9)
    with coord.store.session() as s:
        assert [r.buffer_round for r in s.scalars(select(BufferedUpdateRow))] == [2]
    assert buffer_counts(coord.store) == (0, 1)  # what `status` prints: none waiting, one folded
    assert [r.detail for r in coord.store.rounds()] == [None, "1 stale update(s) folded", None]
    assert [t.max_staleness for t in online.tasks] == [1, 1, 1]
    coord.close()


def test_run_round_reports_the_stale_updates_it_folded(tmp_path):
    # run_round (what iter_rounds and the service call) returns the close's stale updates, as close_round does
    coord, online, offline, _ = federation(tmp_path)
    coord.start()
    ctx1, _ = run_one(coord)
    offline.send(1, ctx1.model_hash, delta_of(4.0))  # stale, waiting for round 2's close
    r2 = coord.rounds.run_round()
    assert (r2.round, r2.status, r2.accepted, r2.stale) == (2, "closed", ("s1",), ("s2@r1",))
    coord.close()


def test_examples_normalisation_divides_by_the_buffer_s_capacities(tmp_path):
    coord, *_ = federation(tmp_path, normalisation="examples")
    coord.start()
    _, r1 = run_one(coord)
    _, weights = coord.rounds.current_model()
    for name, w0 in tiny_weights().items():  # 10 * 1 / 10: s1's delta itself
        np.testing.assert_allclose(weights[name], w0 + 1.0, rtol=1e-6)
    coord.close()


def test_a_waiting_stale_update_survives_a_restart_and_is_folded_once(tmp_path):
    transport, key = InMemoryTransport(), generate_signing_key()
    coord, online, offline, _ = federation(tmp_path, transport, key)
    coord.start()
    ctx1, _ = run_one(coord)
    ctx2 = coord.rounds.open_round()  # round 2 open; s1 answered it
    offline.send(1, ctx1.model_hash, delta_of(4.0))  # stale, waiting for round 2's close
    coord.close()  # the process dies with round 2 open and s2's update waiting
    coord2 = Coordinator(coord.config, transport=InMemoryTransport(), signing_key=key)
    recovered = coord2.start()
    assert [(r.round, r.status, r.accepted, r.stale) for r in recovered] == [(2, "closed", ("s1",), ("s2@r1",))]
    coord2.close()
    coord3 = Coordinator(coord.config, transport=InMemoryTransport(), signing_key=key)
    assert coord3.start() == []
    with coord3.store.session() as s:
        assert [r.buffer_round for r in s.scalars(select(BufferedUpdateRow))] == [2]
    assert coord3.ledger.spent("s2", LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)]), rel=1e-9)
    coord3.close()


@pytest.mark.parametrize("overrides, field", [({"privacy": "global", "local_steps": 1}, "privacy"),
                                              ({"strategy": {"kind": "nira"}}, "fedavg"),
                                              ({"ingest_workers": 2}, "ingest_workers")])
def test_buffered_rounds_refuse_what_they_cannot_serve(tmp_path, overrides, field):
    data = {"federation_id": "f", "data_dir": str(tmp_path), "buffered": BUFFERED, **overrides}
    with pytest.raises(Exception, match=field):
        config_from_dict(data)


def test_more_updates_than_k_in_one_close_divide_by_their_number(tmp_path):
    # Prepare: every site answers at once (they share the round's time slot): 3 updates in a round with K = 2
    coord, online, offline, silent = federation(tmp_path)
    offline.attach()
    silent.attach()
    coord.start()
    _, r1 = run_one(coord)
    assert r1.accepted == ("s1", "s2", "s3")
    _, weights = coord.rounds.current_model()
    step = (10 * 1.0 + 30 * 4.0 + 20 * 9.0) / (3 * 20.0)  # max(K, m) = 3 updates of mean capacity 20
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 + step, rtol=1e-6)
    coord.close()


def test_a_run_ends_with_a_round_that_folds_what_came_after_its_last_round(tmp_path):
    # Prepare: a one-round run; s2 answers round 1 only after it closed, s3 never does
    coord, online, offline, silent = federation(tmp_path)
    rounds = coord.iter_rounds(1)
    r1 = next(rounds)
    assert (r1.round, r1.accepted) == (1, ("s1",))
    offline.send(1, coord.store.rounds()[0].base_model_hash, delta_of(4.0))  # stale: waits
    # Execute: the run goes on to its last round, which sends no task and waits (its deadline) for s3 too
    drained = list(rounds)
    # Assert: one more round, no site selected, s2's update folded once; nothing waits
    assert [(r.round, r.status, r.selected, r.stale) for r in drained] == [(2, "closed", (), ("s2@r1",))]
    assert buffer_counts(coord.store) == (0, 1) and online.tasks[-1].round == 1  # no task for round 2
    assert list(coord.iter_rounds(2)) == []  # nothing waits or is expected any more: no further round
    coord.close()
