"""The incremental ledger: its running compositions give what composing the whole history afresh
gives (to 1e-9 relative), rebuild from the store, never miss rows another writer appended, and charge each round with
a number of accountant calls that does not grow with the history.

The references here compose with dp-accounting directly (no WildFed accounting code): the test keeps its own
per-mechanism step totals (the definition of self-composition) and composes them into a fresh accountant.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp

from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent, SkellamEvent
from shared.privacy.skellam import _subsampled_gaussian_rdp

from coordinator.ledger import PrivacyLedger
from coordinator.ledger_streams import composed_epsilon
from coordinator.reports import burn_down_figure
from coordinator.storage import LedgerRow, Store, dumps
from tests.coordinator.helpers import make_config

DELTA = 1e-5
LC, VU, CR = IUCNCategory.LC, IUCNCategory.VU, IUCNCategory.CR
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REL = 1e-9

# Small pools, so that random histories repeat mechanisms (coalesced) and also mix several of them
DPSGD_POOL = [(1.1, 0.02), (1.3, 0.03), (0.9, 0.015)]
COUNTS = DPSGDEvent(8.0, 1.0, 1)  # NIRA's noisy count release: one unsampled Gaussian release
SKELLAM = SkellamEvent(variance=4.0e4, l2_sensitivity=50.0, l1_sensitivity=400.0, steps=1)


def _leaf(ev) -> dp_accounting.DpEvent:
    """One step of a DP-SGD or count release as a dp-accounting event, written out here (not ``ev.to_dp_event``)."""
    return dp_accounting.PoissonSampledDpEvent(ev.sampling_rate, dp_accounting.GaussianDpEvent(ev.noise_multiplier))


def _skellam_rdp(ev, orders):
    """Agarwal, Kairouz and Liu 2021, Thm 3.5 at integer orders, written out here; a fractional order takes the next
    integer order's value (RDP is non-decreasing in the order)."""
    a = np.ceil(orders)
    mu, d2, d1 = ev.variance, ev.l2_sensitivity, ev.l1_sensitivity
    return a * d2 * d2 / (2 * mu) + np.minimum(((2 * a - 1) * d2 * d2 + 6 * d1) / (4 * mu * mu), 3 * d1 / (2 * mu))


def _key(ev) -> tuple:
    if isinstance(ev, SkellamEvent):
        return ("skellam", ev.variance, ev.l2_sensitivity, ev.l1_sensitivity)
    return ("dpsgd", ev.noise_multiplier, ev.sampling_rate)


def direct_epsilon(events, accountant: str = "rdp") -> float:
    """dp-accounting directly: per mechanism the total steps (order of first occurrence), each composed once; the
    Skellam releases' RDP (which dp-accounting has no event for) added to the accountant's curve at its orders and
    converted by dp-accounting's ``compute_epsilon``."""
    steps: Counter = Counter()
    first: dict = {}
    for ev in events:
        if ev.steps > 0:
            steps[_key(ev)] += ev.steps
            first.setdefault(_key(ev), ev)
    if not steps:
        return 0.0
    acc = (rdp.RdpAccountant(neighboring_relation=ADD_REMOVE) if accountant == "rdp"
           else pld.PLDAccountant(neighboring_relation=ADD_REMOVE))
    skellam = []
    for k, n in steps.items():
        if isinstance(first[k], SkellamEvent):
            skellam.append((first[k], n))
        else:
            acc.compose(dp_accounting.SelfComposedDpEvent(_leaf(first[k]), n))
    if not skellam:
        return float(acc.get_epsilon(DELTA))
    assert accountant == "rdp"
    curve = acc.rdp + sum(n * _skellam_rdp(ev, acc.orders) for ev, n in skellam)
    return float(rdp.rdp_privacy_accountant.compute_epsilon(acc.orders, curve, DELTA)[0])


def times(events, k: int) -> list:
    """``k`` rounds of ``events``."""
    return [e for _ in range(k) for e in events]


def direct_rounds_left(history, per_round, budget: float, pending: int) -> int:
    """The largest k with direct_epsilon(history + (pending + k) rounds) <= budget (0 if k = 1 passes)."""
    def fits(k: int) -> bool:
        return direct_epsilon([*history, *times(per_round, pending + k)]) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def assert_decision_matches(ledger_decides, reference_eps: float) -> None:
    """A dry run's decision at budgets 1e-9 (relative) either side of the reference epsilon: the ledger's epsilon
    lies within 1e-9 of it."""
    assert ledger_decides(reference_eps * (1 - REL)) is True
    assert ledger_decides(reference_eps * (1 + REL)) is False


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "data")
    yield s
    s.dispose()


def random_round(rng: random.Random) -> dict[str, object]:
    """One round's events of one category: DP-SGD from the pool, sometimes a count release or a Skellam release."""
    z, q = rng.choice(DPSGD_POOL)
    out: dict[str, object] = {"dpsgd": DPSGDEvent(z, q, rng.choice([0, 5, 10, 20]))}
    if rng.random() < 0.4:
        out["counts"] = COUNTS
    elif rng.random() < 0.3:
        out["counts"] = SKELLAM  # (a Global DP round's secure-aggregation release, under the same mechanism tag)
    return out


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_random_histories_match_direct_composition(store, seed):
    # Prepare
    rng = random.Random(seed)
    ledger = PrivacyLedger(store, target_delta=DELTA)
    history: dict[IUCNCategory, list] = {LC: [], CR: []}
    rounds = rng.randint(6, 12)
    for r in range(1, rounds + 1):
        for cat in (LC, CR):
            if cat is CR and rng.random() < 0.3:
                continue  # a round without that category
            evs = random_round(rng)
            # a dry run first (the halt or ingest check): of exactly these events (then adopted by the charge) or not
            candidate = list(evs.values()) if rng.random() < 0.5 else list(random_round(rng).values())
            ledger.would_exceed("s1", cat, candidate, 1e6)
            for mech, ev in evs.items():
                ledger.record_round("s1", r, {cat: ev}, mechanism=mech)
            history[cat] += list(evs.values())
        # Execute + Assert: mid-history, so that the running composition grows between reads
        if r % 3 == 0:
            for cat in (LC, CR):
                assert ledger.spent("s1", cat) == pytest.approx(direct_epsilon(history[cat]), rel=REL, abs=0)
    for cat in (LC, CR):
        spent = direct_epsilon(history[cat])
        assert ledger.spent("s1", cat) == pytest.approx(spent, rel=REL, abs=0)
        nxt = [DPSGDEvent(1.1, 0.02, 10), COUNTS]
        # would_exceed: a dry run, nothing written
        ref = direct_epsilon([*history[cat], *nxt])
        assert_decision_matches(lambda b: ledger.would_exceed("s1", cat, nxt, b), ref)
        assert ledger.spent("s1", cat) == pytest.approx(spent, rel=REL, abs=0)
        # round_would_exceed, for the last round (already charged: replaced, never counted twice) and a new one
        for pending in (0, 2):
            ref_new = direct_epsilon([*history[cat], *times(nxt, pending + 1)])
            assert_decision_matches(
                lambda b: ledger.round_would_exceed("s1", cat, rounds + 1, nxt, b, pending=pending), ref_new)
        # rounds_left: the halt check's dry run repeated
        budget = spent + (ref - spent) * rng.uniform(1.5, 4.0)
        pending = 0 if cat is LC else 1
        assert ledger.rounds_left("s1", cat, budget, next_event=nxt, pending=pending) == \
            direct_rounds_left(history[cat], nxt, budget, pending)
    # round_would_exceed at close for a round already charged at ingest (its rows are the events checked)
    cat_rows = ledger.round_events("s1", LC)
    last_round = cat_rows[-1][0]
    mine = [e for r, e in cat_rows if r == last_round]
    others = [e for r, e in cat_rows if r != last_round]
    for pending in (0, 3):
        ref = direct_epsilon([*others, *times(mine, pending + 1)])
        assert_decision_matches(
            lambda b: ledger.round_would_exceed("s1", LC, last_round, mine, b, pending=pending), ref)
    # ... and a replay whose stored rows differ from the events checked (the fallback composes the others afresh)
    other_events = [DPSGDEvent(1.3, 0.03, 7)]
    ref = direct_epsilon([*others, *times(other_events, 2)])
    assert_decision_matches(
        lambda b: ledger.round_would_exceed("s1", LC, last_round, other_events, b, pending=1), ref)


@pytest.mark.parametrize("seed", [3, 4])
def test_halt_decisions_match_direct_composition(store, seed):
    # Prepare: a history per category, then budgets just either side of the next round's composed spend
    rng = random.Random(seed)
    ledger = PrivacyLedger(store, target_delta=DELTA)
    history: dict[IUCNCategory, list] = {LC: [], VU: [], CR: []}
    for r in range(1, rng.randint(4, 9) + 1):
        for cat in history:
            ev = DPSGDEvent(*rng.choice(DPSGD_POOL), rng.choice([5, 10]))
            ledger.record_round("s1", r, {cat: ev})
            history[cat].append(ev)
    ledger.halt_if_needed("s1", {c: 1e6 for c in history}, round=90)  # builds the running compositions
    last = {c: history[c][-1] for c in history}
    pending = rng.randint(0, 2)
    after = {c: direct_epsilon([*history[c], *times([last[c]], pending + 1)]) for c in history}
    budgets = {LC: after[LC] * (1 - REL), VU: after[VU] * (1 + REL), CR: after[CR] * (1 - REL)}
    # Execute
    halted = ledger.halt_if_needed("s1", budgets, round=100, pending=pending)
    # Assert
    assert halted == {LC, CR}
    assert ledger.rounds_left("s1", VU, budgets[VU], pending=pending) == 1
    reason = {h.category: h.reason for h in ledger.halts("s1")}[LC]
    assert f"would make it {after[LC]:.4f}" in reason and f"spent eps={direct_epsilon(history[LC]):.4f}" in reason


def test_pld_spend_and_dry_runs_match_todays_composition(store):
    # PLD composes the coalesced history (module docstring of shared.privacy.running): what composing it afresh gives
    ledger = PrivacyLedger(store, target_delta=DELTA, accountant="pld")
    history = [DPSGDEvent(1.1, 0.02, 10), DPSGDEvent(1.1, 0.02, 10), COUNTS, DPSGDEvent(1.3, 0.03, 5)]
    for r, ev in enumerate(history, start=1):
        ledger.record_round("s1", r, {LC: ev})
        if r == 2:
            assert ledger.spent("s1", LC) == pytest.approx(direct_epsilon(history[:2], "pld"), rel=REL, abs=0)
    assert ledger.spent("s1", LC) == pytest.approx(direct_epsilon(history, "pld"), rel=REL, abs=0)
    nxt = [DPSGDEvent(1.1, 0.02, 10)]
    assert_decision_matches(lambda b: ledger.would_exceed("s1", LC, nxt, b),
                            direct_epsilon([*history, *nxt], "pld"))
    # Skellam's bound is an RDP curve: the PLD path raises when the row is composed, never skips it
    ledger.record_round("s1", 9, {LC: SKELLAM}, mechanism="counts")
    for _ in range(2):
        with pytest.raises(dp_accounting.UnsupportedEventError):
            ledger.spent("s1", LC)
    assert ledger.spent("s1", LC, accountant="rdp") == pytest.approx(
        direct_epsilon([*history, SKELLAM]), rel=REL, abs=0)


def test_a_new_ledger_over_the_store_rebuilds_the_same_spend(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    s1 = Store(url, tmp_path / "data")
    first = PrivacyLedger(s1, target_delta=DELTA)
    history = []
    for r in range(1, 9):
        ev = DPSGDEvent(*DPSGD_POOL[r % 3], 10)
        first.record_round("s1", r, {LC: ev})
        history.append(ev)
        first.spent("s1", LC)  # incremental, read every round
    running = first.spent("s1", LC)
    s1.dispose()
    s2 = Store(url, tmp_path / "data")  # a restarted coordinator
    rebuilt = PrivacyLedger(s2, target_delta=DELTA).spent("s1", LC)
    s2.dispose()
    assert rebuilt == pytest.approx(running, rel=REL, abs=0)
    assert rebuilt == pytest.approx(direct_epsilon(history), rel=REL, abs=0)


def test_rows_from_another_writer_are_never_missed(store):
    # Prepare: two ledgers on one database (two coordinator workers); the reader has composed what it has seen
    reader = PrivacyLedger(store, target_delta=DELTA)
    writer = PrivacyLedger(store, target_delta=DELTA)
    ev = [DPSGDEvent(1.1, 0.02, 10), DPSGDEvent(1.3, 0.03, 10), DPSGDEvent(0.9, 0.015, 10), COUNTS]
    reader.record_round("s1", 1, {LC: ev[0]})
    assert reader.spent("s1", LC) == pytest.approx(direct_epsilon(ev[:1]), rel=REL, abs=0)
    # Execute: the other writer appends; then a row with a smaller id than one already read commits late (ids are
    # handed out at insert, so on PostgreSQL a slow transaction can commit an id below one another committed)
    writer.record_round("s1", 2, {LC: ev[1]})
    with store.session() as s:
        s.add(LedgerRow(id=50, site_id="s1", round=4, category=LC.value, noise_multiplier=8.0, sampling_rate=1.0,
                        steps=1, event_json=dumps(COUNTS.to_json()), mechanism="counts"))
    assert reader.spent("s1", LC) == pytest.approx(direct_epsilon([ev[0], ev[1], ev[3]]), rel=REL, abs=0)
    with store.session() as s:
        s.add(LedgerRow(id=20, site_id="s1", round=3, category=LC.value, noise_multiplier=0.9, sampling_rate=0.015,
                        steps=10, event_json=dumps(ev[2].to_json()), mechanism="dpsgd"))
    # Assert: the late row is found by the count, composed once; the dry runs see it too
    assert reader.spent("s1", LC) == pytest.approx(direct_epsilon(ev), rel=REL, abs=0)
    assert reader.spent("s1", LC) == pytest.approx(direct_epsilon(ev), rel=REL, abs=0)
    nxt = [DPSGDEvent(1.1, 0.02, 10)]
    assert_decision_matches(lambda b: reader.would_exceed("s1", LC, nxt, b), direct_epsilon([*ev, *nxt]))


def test_one_read_of_a_sites_rows_serves_every_category_and_misses_no_late_row(store):
    """``spent_by_category`` and ``halt_if_needed`` read a site's rows once for all its categories (not two queries
    per category for the demo's halt checks and budget table): the values equal dp-accounting composing
    each category's history directly, including rows another writer committed late with a smaller id, and the
    number of SQL reads does not grow with the number of categories."""
    from sqlalchemy import event

    # Prepare: three categories with different histories (rows written by hand with chosen ids, as two writers
    # would), read once; then a row for VU above every id read and one for CR below all of them, committed late
    reader = PrivacyLedger(store, target_delta=DELTA)
    writer = PrivacyLedger(store, target_delta=DELTA)

    def row(row_id: int, rnd: int, cat: IUCNCategory, ev: DPSGDEvent, mechanism: str = "dpsgd") -> None:
        with store.session() as s:
            s.add(LedgerRow(id=row_id, site_id="s1", round=rnd, category=cat.value,
                            noise_multiplier=ev.noise_multiplier, sampling_rate=ev.sampling_rate, steps=ev.steps,
                            event_json=dumps(ev.to_json()), mechanism=mechanism))

    hist = {LC: [DPSGDEvent(1.1, 0.02, 10), DPSGDEvent(1.3, 0.03, 10)],
            VU: [DPSGDEvent(1.3, 0.03, 20), DPSGDEvent(1.1, 0.02, 10)], CR: [DPSGDEvent(0.9, 0.015, 5)]}
    row(10, 1, LC, hist[LC][0]), row(11, 1, VU, hist[VU][0]), row(12, 1, CR, hist[CR][0])
    row(20, 2, LC, hist[LC][1]), row(21, 2, VU, hist[VU][1])
    assert reader.spent_by_category("s1", hist) == pytest.approx({c: direct_epsilon(e) for c, e in hist.items()},
                                                                  rel=REL, abs=0)
    row(60, 4, VU, COUNTS, "counts")
    row(5, 3, CR, DPSGDEvent(0.9, 0.015, 5))  # an id below every id the reader has composed
    hist[VU].append(COUNTS)
    hist[CR].append(DPSGDEvent(0.9, 0.015, 5))
    # two more sites for the halt check: every category of each in its last round; three categories and one
    one_round = {LC: DPSGDEvent(1.1, 0.02, 10), VU: DPSGDEvent(1.3, 0.03, 20), CR: DPSGDEvent(0.9, 0.015, 5)}
    for r in (1, 2):
        writer.record_round("three", r, one_round)
        writer.record_round("one", r, {LC: one_round[LC]})
    statements: list[str] = []

    def reads() -> int:
        n = len([q for q in statements if q.lstrip().upper().startswith("SELECT")])
        statements.clear()
        return n

    listener = lambda conn, cursor, sql, *a: statements.append(sql)  # noqa: E731
    event.listen(store.engine, "before_cursor_execute", listener)
    try:
        # Execute
        spent = reader.spent_by_category("s1", [LC, VU, CR])
        spent_reads = reads()
        budgets = {c: direct_epsilon([ev] * 3) * (1 + 1e-6) for c, ev in one_round.items()}  # round 3 fits, 4 not
        halted = {site: reader.halt_if_needed(site, budgets, round=3, pending=0) for site in ("three", "one")}
        halted_reads = reads()  # both sites
        reader.halt_if_needed("one", budgets, round=3, pending=0)
        one_reads = reads()
        reader.halt_if_needed("three", budgets, round=3, pending=0)
        three_reads = reads()
        after = reader.halt_if_needed("three", budgets, round=3, pending=1)  # one round in flight: 4 rounds, halt
    finally:
        event.remove(store.engine, "before_cursor_execute", listener)
    # Assert: every category equals its direct composition, in five reads (the site's ledger streams, then new rows,
    # counts, the ids of the category whose count shows a late row below every id read, and that row); EN (no rows)
    # 0; the halt checks decide as dp-accounting does, reading the store as often for a site of three categories as
    # for a site of one
    assert spent == pytest.approx({c: direct_epsilon(e) for c, e in hist.items()}, rel=REL, abs=0)
    assert spent_reads == 5
    assert reader.spent_by_category("s1", [IUCNCategory.EN, LC])[IUCNCategory.EN] == 0.0
    assert halted == {"three": frozenset(), "one": frozenset()} and halted_reads > 0
    assert three_reads == one_reads
    assert after == frozenset(one_round)


class _Counting:
    """Counts calls of dp-accounting's RdpAccountant.compose and of its RDP evaluation of a subsampled Gaussian."""

    def __init__(self, monkeypatch):
        self.composes = 0
        self.evaluations = 0
        compose = rdp.RdpAccountant.compose
        module = rdp.rdp_privacy_accountant
        evaluate = module._compute_rdp_poisson_subsampled_gaussian

        def counted_compose(acc, *args, **kwargs):
            self.composes += 1
            return compose(acc, *args, **kwargs)

        def counted_evaluate(*args, **kwargs):
            self.evaluations += 1
            return evaluate(*args, **kwargs)

        monkeypatch.setattr(rdp.RdpAccountant, "compose", counted_compose)
        monkeypatch.setattr(module, "_compute_rdp_poisson_subsampled_gaussian", counted_evaluate)

    def snapshot(self) -> tuple[int, int]:
        return self.composes, self.evaluations


def test_accountant_work_per_charge_does_not_grow_with_the_history(store, monkeypatch):
    # Prepare: a site whose sampling rate changes every round (its data grows), so no two rounds coalesce
    counter = _Counting(monkeypatch)
    _subsampled_gaussian_rdp.cache_clear()
    ledger = PrivacyLedger(store, target_delta=DELTA)
    budgets = {LC: 1e6}
    per_round: list[tuple[int, int]] = []
    history = []
    # Execute: per round the charge (record_round), then the next round's halt check, as the coordinator does
    for r in range(1, 26):
        ev = DPSGDEvent(1.1, 0.02 + 1e-4 * r, 10)
        before = counter.snapshot()
        ledger.record_round("s1", r, {LC: ev})
        ledger.halt_if_needed("s1", budgets, round=r + 1, pending=0)
        after = counter.snapshot()
        per_round.append((after[0] - before[0], after[1] - before[1]))
        history.append(ev)
    # Assert: the same accountant work at round 5 as at round 25 (the new row, then the dry run; the new event's RDP
    # curve is evaluated once and the dry run's composition reuses it)
    assert per_round[4] == per_round[-1] == (2, 1)
    assert len(set(per_round[1:])) == 1
    assert ledger.spent("s1", LC) == pytest.approx(direct_epsilon(history), rel=REL, abs=0)
    # Control: the counter does see the growth of composing the history afresh (one evaluation per distinct event)
    _subsampled_gaussian_rdp.cache_clear()
    before = counter.snapshot()
    composed_epsilon((*history, DPSGDEvent(1.1, 0.5, 1)), DELTA, "rdp")
    assert counter.snapshot()[1] - before[1] == len(history) + 1


def test_a_repeated_schedule_costs_no_new_evaluation_per_round(store, monkeypatch):
    # The dry run of the halt check is the next charge: its composition is adopted, not computed again, and the
    # event's RDP curve, evaluated once, is reused every round
    counter = _Counting(monkeypatch)
    _subsampled_gaussian_rdp.cache_clear()
    ledger = PrivacyLedger(store, target_delta=DELTA)
    ev = DPSGDEvent(1.1, 0.02, 10)
    per_round = []
    for r in range(1, 21):
        before = counter.snapshot()
        ledger.record_round("s1", r, {LC: ev})
        ledger.halt_if_needed("s1", {LC: 1e6}, round=r + 1, pending=0)
        per_round.append(counter.snapshot()[1] - before[1])
    assert per_round[0] == 1 and per_round[2:] == [0] * 18
    assert ledger.spent("s1", LC) == pytest.approx(direct_epsilon([ev] * 20), rel=REL, abs=0)


def test_burn_down_points_equal_each_prefix_composed_afresh(tmp_path, store):
    # Prepare
    cfg = make_config(tmp_path)
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    history = [DPSGDEvent(*DPSGD_POOL[r % 3], 5 + r) for r in range(6)]
    for r, ev in enumerate(history, start=1):
        ledger.record_round("s1", r, {LC: ev})
    # Execute
    fig = burn_down_figure(cfg, ledger, "rdp")
    # Assert: the LC panel's line for s1, one point per round, each the prefix's epsilon
    import matplotlib.pyplot as plt

    ax = [a for a in fig.axes if a.get_title() == LC.value][0]
    line = [ln for ln in ax.lines if ln.get_label() == "s1"][0]
    expected = []
    for i in range(len(history)):
        acc = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
        for ev in history[:i + 1]:
            acc.compose(dp_accounting.SelfComposedDpEvent(_leaf(ev), ev.steps))
        expected.append(acc.get_epsilon(cfg.target_delta))
    plt.close(fig)
    assert list(line.get_xdata()) == list(range(1, len(history) + 1))
    assert all(math.isclose(a, b, rel_tol=REL) for a, b in zip(line.get_ydata(), expected))
