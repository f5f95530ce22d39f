"""Privacy ledger: spend equals a direct dp-accounting composition, survives restarts, halts before the budget."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

from coordinator.ledger import LedgerError, PrivacyLedger
from coordinator.storage import LedgerRow, Store

DELTA = 1e-5
LC, CR = IUCNCategory.LC, IUCNCategory.CR
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def direct_epsilon(params: list[tuple[float, float, int]], accountant: str = "rdp") -> float:
    """Compose (z, q, steps) triples with dp-accounting directly (no WildFed code)."""
    acc = (rdp.RdpAccountant(neighboring_relation=ADD_REMOVE) if accountant == "rdp"
           else pld.PLDAccountant(neighboring_relation=ADD_REMOVE))
    for z, q, t in params:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t))
    return acc.get_epsilon(DELTA)


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "data")
    yield s
    s.dispose()


def test_spent_equals_direct_rdp_composition_after_T_rounds(store):
    # Prepare: T rounds of events that differ per round, on two categories
    ledger = PrivacyLedger(store, target_delta=DELTA)
    lc = [(1.1, 0.02, 10), (1.3, 0.03, 12), (0.9, 0.02, 10), (1.1, 0.025, 8)]
    cr = [(2.5, 0.01, 10)] * 4
    # Execute
    for r, (a, b) in enumerate(zip(lc, cr), start=1):
        ledger.record_round("s1", r, {LC: DPSGDEvent(*a), CR: DPSGDEvent(*b)})
    # Assert: per category, not across categories (parallel composition)
    assert ledger.spent("s1", LC) == pytest.approx(direct_epsilon(lc), rel=1e-9)
    assert ledger.spent("s1", CR) == pytest.approx(direct_epsilon(cr), rel=1e-9)
    pld_events = [(1.1, 0.02, 10), (1.1, 0.02, 10)]
    for r, e in enumerate(pld_events, start=1):
        ledger.record_round("s2", r, {LC: DPSGDEvent(*e)})
    assert ledger.spent("s2", "LC", accountant="pld") == pytest.approx(direct_epsilon(pld_events, "pld"), rel=1e-3)
    assert ledger.spent("s1", IUCNCategory.EN) == 0.0
    assert ledger.spent("other", LC) == 0.0


def test_restart_reloads_the_same_spend(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    s1 = Store(url, tmp_path / "data")
    PrivacyLedger(s1, target_delta=DELTA).record_round("s1", 1, {LC: DPSGDEvent(1.0, 0.05, 20)})
    PrivacyLedger(s1, target_delta=DELTA).record_round("s1", 2, {LC: DPSGDEvent(1.0, 0.05, 20)})
    before = PrivacyLedger(s1, target_delta=DELTA).spent("s1", LC)
    s1.dispose()
    s2 = Store(url, tmp_path / "data")  # a new process on the same database
    after = PrivacyLedger(s2, target_delta=DELTA).spent("s1", LC)
    s2.dispose()
    assert after == before == pytest.approx(direct_epsilon([(1.0, 0.05, 20)] * 2))


def test_rows_are_immutable_and_replay_is_idempotent(store):
    ledger = PrivacyLedger(store, target_delta=DELTA)
    ev = DPSGDEvent(1.0, 0.05, 20)
    ledger.record_round("s1", 1, {LC: ev})
    ledger.record_round("s1", 1, {LC: ev})  # crash-replay of the same round: no double charge
    assert ledger.events("s1", LC) == [ev]
    with pytest.raises(LedgerError, match="immutable"):
        ledger.record_round("s1", 1, {LC: DPSGDEvent(2.0, 0.05, 20)})


def test_would_exceed_is_a_dry_run(store):
    ledger = PrivacyLedger(store, target_delta=DELTA)
    ev = DPSGDEvent(1.0, 0.05, 20)
    ledger.record_round("s1", 1, {LC: ev})
    one, two = direct_epsilon([(1.0, 0.05, 20)]), direct_epsilon([(1.0, 0.05, 20)] * 2)
    assert ledger.would_exceed("s1", LC, ev, budget=(one + two) / 2)
    assert not ledger.would_exceed("s1", LC, ev, budget=two * 1.001)
    assert len(ledger.events("s1", LC)) == 1


def test_category_halts_before_its_budget_would_be_passed(store):
    # Prepare: a budget that fits exactly k=3 rounds of the event and not 4 (computed directly)
    ledger = PrivacyLedger(store, target_delta=DELTA)
    p = (1.0, 0.05, 20)
    eps3, eps4 = direct_epsilon([p] * 3), direct_epsilon([p] * 4)
    budget = (eps3 + eps4) / 2
    budgets = {LC: budget, CR: 10.0}
    trained_rounds = []
    # Execute: each round, check halts first; train only non-halted categories
    for r in range(1, 8):
        halted = ledger.halt_if_needed("s1", budgets, round=r, next_events={LC: DPSGDEvent(*p)} if r == 1 else None)
        if LC not in halted:
            ledger.record_round("s1", r, {LC: DPSGDEvent(*p)})
            trained_rounds.append(r)
        # Assert: the spend never passes the budget
        assert ledger.spent("s1", LC) <= budget
    assert trained_rounds == [1, 2, 3]
    assert ledger.halted("s1") == {LC}
    assert ledger.site_halted("s1")  # LC is its only known category
    assert not ledger.site_halted("s1", known_categories=[LC, CR])


def test_an_event_the_reader_does_not_know_raises_never_skipped(store):
    ledger = PrivacyLedger(store, target_delta=DELTA)
    ledger.record_round("s1", 1, {LC: DPSGDEvent(1.0, 0.05, 20)})
    with store.session() as s:
        s.add(LedgerRow(site_id="s1", round=2, category="LC", noise_multiplier=0, sampling_rate=0, steps=1,
                        event_json=json.dumps({"type": "laplace", "scale": 1.0})))
    with pytest.raises(PayloadError, match="unknown DP event"):
        ledger.spent("s1", LC)


def test_count_releases_are_composed_and_projected_in_the_halt_check(store):
    # Prepare: each round one DP-SGD event and one count release (NIRA's noisy counts, mechanism "counts")
    ledger = PrivacyLedger(store, target_delta=DELTA)
    steps, counts = DPSGDEvent(1.5, 0.1, 10), DPSGDEvent(30.0, 1.0, 1)
    ledger.record_round("s1", 1, {LC: steps})
    ledger.record_round("s1", 1, {LC: counts}, mechanism="counts")
    # the same (site, round, category) may hold one event per mechanism; a different one is refused
    with pytest.raises(LedgerError):
        ledger.record_round("s1", 1, {LC: DPSGDEvent(40.0, 1.0, 1)}, mechanism="counts")
    one = direct_epsilon([(1.5, 0.1, 10), (30.0, 1.0, 1)])
    assert ledger.spent("s1", LC) == pytest.approx(one, rel=1e-9)
    # Execute: a budget that a second round of the steps alone would fit, but not steps + counts
    steps_only = direct_epsilon([(1.5, 0.1, 20), (30.0, 1.0, 1)])
    both = direct_epsilon([(1.5, 0.1, 20), (30.0, 1.0, 2)])
    assert steps_only < both
    # rounds left projects both releases of a round
    assert ledger.rounds_left("s1", LC, both) == 1 and ledger.rounds_left("s1", LC, steps_only) == 0
    halted = ledger.halt_if_needed("s1", {LC: (steps_only + both) / 2}, round=2)
    # Assert: the projection carries the count release too, so LC halts before round 2
    assert halted == frozenset({LC}) and "1 other release" in ledger.halts("s1")[0].reason
    assert ledger.rounds_left("s1", LC, both) == 0  # halted
