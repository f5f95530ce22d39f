"""A whole federation in one process: 2 fake sites, 2 rounds, over the in-memory transport."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key
from shared.privacy.events import DPSGDEvent

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights

LC, CR = IUCNCategory.LC, IUCNCategory.CR


def rdp_eps(triples, delta=1e-5):
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for z, q, t in triples:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t))
    return acc.get_epsilon(delta)


def add_sites(coord, transport, key, specs):
    sites = []
    for sid, value, n, events, meta in specs:
        site = FakeSite(sid, transport, key.public_key(), value=value, num_examples=n, events=events).attach()
        coord.enrol(sid, site.public_pem, {"capacity": n, **meta})
        sites.append(site)
    return sites


def test_two_sites_two_rounds(federation):
    # Prepare: s1 sends +1 with N=10, s2 sends +4 with N=30; a third enrolled site tampers with everything
    coord, transport, key = federation(quorum_fraction=0.6)
    s1, s2, evil = add_sites(coord, transport, key, [("s1", 1.0, 10, {LC: EVENT}, {}),
                                                     ("s2", 4.0, 30, {LC: EVENT}, {}),
                                                     ("evil", 100.0, 1000, {LC: EVENT}, {})])
    evil.tamper = True
    # Execute
    results = coord.run()
    # Assert: FedAvg delta per round = (10*1 + 30*4) / 40 = 3.25, two rounds of server SGD with lr 1
    assert [r.status for r in results] == ["closed", "closed"]
    assert all(r.accepted == ("s1", "s2") for r in results)
    _, weights = coord.rounds.current_model()
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 + 6.5, rtol=1e-6)
    # every task was signed, addressed, and carried the model of its round
    assert [t.round for t in s1.tasks] == [1, 2] and s1.tasks[1].model_hash == results[0].model_hash
    assert s1.tasks[0].budgets[LC] == pytest.approx(5 / 3) and s1.tasks[0].privacy == "ccdp"
    # ledger: two rounds of EVENT per site, composed directly
    for sid in ("s1", "s2"):
        assert coord.ledger.spent(sid, LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)] * 2), rel=1e-9)
    assert coord.ledger.spent("evil", LC) == 0.0
    status = coord.status()
    assert status.rejections == {"bad_signature": 2} and status.accepted == 4
    assert [r[1] for r in status.rounds] == ["closed", "closed"]
    assert all(a.accepted for a in s1.acks) and len(s1.acks) == 2


def test_categories_retire_per_cohort_and_the_federation_never_halts(federation):
    # Prepare: a uniform budget B that fits one round of EVENT (LC) but not two, and three rounds of the
    # stronger-noise CR event (z=1.3) but not four (all computed directly with dp-accounting)
    one, two = rdp_eps([(1.2, 0.05, 5)]), rdp_eps([(1.2, 0.05, 5)] * 2)
    budget = (one + two) / 2
    cr_event = DPSGDEvent(1.3, 0.05, 5)
    k_cr = max(k for k in range(1, 10) if rdp_eps([(1.3, 0.05, 5)] * k) <= budget)
    assert k_cr == 3
    coord, transport, key = federation(rounds=6, budget={"kind": "from_max", "eps_max": budget, "gamma": 0.0})
    s1, s2 = add_sites(coord, transport, key, [("s1", 1.0, 10, {LC: EVENT}, {}),
                                                ("s2", 1.0, 10, {LC: EVENT, CR: cr_event},
                                                 {"categories": ["LC", "CR"]})])
    # Execute
    results = coord.run()
    # Assert: every round trains both sites: a cohort's LC halts after its first round and its CR after its
    # third, and the cohort then retires, while each round opens a new cohort that has spent nothing
    assert [r.status for r in results] == ["closed"] * 6
    assert all(r.selected == ("s1", "s2") for r in results)
    for r, task in enumerate(s2.tasks, start=1):
        expected = {c: (() if c == r else (LC,) if r - c < 3 else None) for c in range(max(1, r - 2), r + 1)}
        assert task.cohorts == expected and task.halted == ()
    assert [t.cohorts for t in s1.tasks] == [{r: ()} for r in range(1, 7)]  # LC only: a cohort trains one round
    for c in range(1, 7):
        assert [r for r, _ in coord.ledger.round_events(f"s2@c{c}", LC)] == [c]
        assert [r for r, _ in coord.ledger.round_events(f"s2@c{c}", CR)] == list(range(c, min(c + 3, 7)))
    for sid, cat in (("s1", LC), ("s2", LC), ("s2", CR)):
        assert coord.ledger.spent(sid, cat) <= budget
    assert coord.ledger.spent("s2", CR) == pytest.approx(rdp_eps([(1.3, 0.05, 5)] * 3), rel=1e-9)
    assert coord.ledger.spent("s2", LC) == pytest.approx(one, rel=1e-9)
    assert coord.ledger.halted("s2") == frozenset() and not coord.ledger.site_halted("s1")


def test_restart_recovers_an_open_round_and_reloads_spend(tmp_path):
    # Prepare: a round is opened and one update stored, then the process "crashes"
    transport, key = InMemoryTransport(), generate_signing_key()
    cfg = make_config(tmp_path, quorum_fraction=0.5)
    coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=tiny_weights())
    s1 = FakeSite("s1", transport, key.public_key(), value=2.0, num_examples=10, events={LC: EVENT})
    coord.enrol("s1", s1.public_pem, {"capacity": 10})
    coord.enrol("s2", FakeSite("s2", transport, None, 1.0, 1, {}).public_pem, {"capacity": 10})
    coord.start()
    ctx = coord.rounds.open_round()
    s1.send(ctx.round, ctx.model_hash, {k: np.full_like(v, 2.0) for k, v in tiny_weights().items()})
    assert coord.store.count_updates() == 1
    coord.close()
    # Execute: a new coordinator on the same database and data dir
    coord2 = Coordinator(cfg, transport=InMemoryTransport(), signing_key=key)
    recovered = coord2.start()
    # Assert: the round closes from the stored blob; spend charged exactly once; next round is 2
    assert [(r.round, r.status, r.accepted) for r in recovered] == [(1, "closed", ("s1",))]
    _, weights = coord2.rounds.current_model()
    np.testing.assert_allclose(weights["psi.b"], tiny_weights()["psi.b"] + 2.0)
    assert coord2.ledger.spent("s1", LC) == pytest.approx(rdp_eps([(1.2, 0.05, 5)]), rel=1e-9)
    assert coord2.rounds.next_round() == 2
    assert coord2.start() == []  # idempotent
    coord2.close()
    coord3 = Coordinator(cfg, transport=InMemoryTransport(), signing_key=key)
    assert coord3.start() == [] and coord3.ledger.spent("s1", LC) == coord2.ledger.spent("s1", LC)
    coord3.close()


def test_deadline_without_quorum_fails_the_round_but_charges_the_ledger(federation):
    coord, transport, key = federation(rounds=1, round_deadline_s=0.2)
    s1, s2 = add_sites(coord, transport, key, [("s1", 1.0, 10, {LC: EVENT}, {}), ("s2", 1.0, 10, {LC: EVENT}, {})])
    s2.tamper = True
    (result,) = coord.run()
    assert result.status == "failed" and result.accepted == ("s1",)
    assert result.model_hash == coord.store.latest_model_hash()  # model unchanged
    assert coord.ledger.spent("s1", LC) > 0  # the coordinator saw it: charged, conservatively


def test_site_sampling_is_seeded_and_tasks_carry_no_noise_seed_by_default(federation):
    coord, transport, key = federation(rounds=3, sites_per_round=2, quorum_fraction=1.0)
    sites = add_sites(coord, transport, key, [(f"s{i}", 1.0, 10, {LC: EVENT}, {}) for i in range(4)])
    results = coord.run()
    assert [len(r.selected) for r in results] == [2, 2, 2] and all(r.status == "closed" for r in results)
    assert all(t.seed is None for s in sites for t in s.tasks)
    # the same seed selects the same sites in a fresh federation
    coord2, transport2, key2 = federation(rounds=3, sites_per_round=2, data_dir="data2")
    add_sites(coord2, transport2, key2, [(f"s{i}", 1.0, 10, {LC: EVENT}, {}) for i in range(4)])
    assert [r.selected for r in coord2.run()] == [r.selected for r in results]
