"""Record-level budgets: a site runs 30 rounds while its records arrive in batches; every record's own epsilon,
composed independently with dp-accounting over the rounds it was sampled in, stays within its category's budget."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.envelope import Envelope
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import decode_task

from coordinator.cohorts import cohort_states
from coordinator.reports import budget_report, burn_down_points
from coordinator.storage import RoundRow
from edge_sdk.rounds.cohorts import CohortRegistry
from tests.coordinator.helpers import FakeSite

LC, CR = IUCNCategory.LC, IUCNCategory.CR
LC_EVENT, CR_EVENT = DPSGDEvent(1.2, 0.05, 5), DPSGDEvent(1.3, 0.05, 5)
ARRIVALS = {1: 6, 8: 4, 15: 5, 22: 3}  # round -> records that appear before it (half LC, half CR)


def direct_epsilon(events: list[DPSGDEvent], delta: float = 1e-5) -> float:
    """dp-accounting's RDP epsilon of ``events`` composed (equal events grouped into one self-composition)."""
    return _composed(tuple(sorted(Counter(events).items(), key=repr)), delta)


@functools.lru_cache(maxsize=None)
def _composed(groups: tuple[tuple[DPSGDEvent, int], ...], delta: float) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for e, n in groups:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            e.sampling_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier)), e.steps * n))
    return acc.get_epsilon(delta)


@dataclass
class StreamingSite(FakeSite):
    """A site whose records arrive over time; it samples, per task, exactly the records the gateway's cohort
    registry lets train, and keeps each record's history of the events it went through."""

    registry: CohortRegistry | None = None
    records: list[tuple[str, IUCNCategory]] = field(default_factory=list)
    history: dict[str, list[DPSGDEvent]] = field(default_factory=dict)
    joined: dict[str, int] = field(default_factory=dict)

    def _on_task(self, topic: str, raw: bytes) -> None:
        task, _ = decode_task(Envelope.from_bytes(raw).payload)
        for i in range(ARRIVALS.get(task.round, 0)):
            mid = f"r{task.round}-{i}"
            self.records.append((mid, LC if i % 2 == 0 else CR))
            self.joined[mid] = task.round
        ids = tuple(m for m, _ in self.records)
        ranks = np.asarray([c.rank for _, c in self.records], dtype=np.int8)
        mask = self.registry.mask(ids, ranks, task)
        for (mid, cat), trains in zip(self.records, mask):
            if trains:
                self.history.setdefault(mid, []).append(self.events[cat])
        super()._on_task(topic, raw)


def test_thirty_rounds_with_arriving_records_keep_every_record_within_its_budget(federation, tmp_path):
    # Prepare: a uniform budget that fits 3 rounds of LC's event and 6 of CR's stronger-noise event
    # (dp-accounting directly)
    budget = (direct_epsilon([LC_EVENT] * 3) + direct_epsilon([LC_EVENT] * 4)) / 2
    k = {LC: max(n for n in range(1, 12) if direct_epsilon([LC_EVENT] * n) <= budget),
         CR: max(n for n in range(1, 12) if direct_epsilon([CR_EVENT] * n) <= budget)}
    assert (k[LC], k[CR]) == (3, 6)
    coord, transport, key = federation(rounds=30, budget={"kind": "from_max", "eps_max": budget, "gamma": 0.0})
    site = StreamingSite("s1", transport, key.public_key(), value=1.0, num_examples=20,
                         events={LC: LC_EVENT, CR: CR_EVENT}, registry=CohortRegistry(tmp_path / "cohorts.sqlite"))
    site.attach()
    coord.enrol("s1", site.public_pem, {"capacity": 20, "categories": ["LC", "CR"]})

    # Execute
    results = coord.run()

    # Assert: the federation never halts: every round closes with the site in it
    assert [r.status for r in results] == ["closed"] * 30
    assert all(r.selected == ("s1",) for r in results)
    # every record trained exactly the rounds its category's budget allows from the round it joined on
    assert len(site.records) == sum(ARRIVALS.values())
    for mid, cat in site.records:
        j = site.joined[mid]
        assert len(site.history.get(mid, [])) == min(k[cat], 31 - j), mid
        eps = direct_epsilon(site.history[mid])
        assert eps <= budget * (1 + 1e-12)
        # the ledger's epsilon of the record's cohort is the record's own epsilon
        assert coord.ledger.spent(f"s1@c{j}", cat) == pytest.approx(eps, rel=1e-9)
    # old cohorts retire once every category is spent; the newest ones train
    states = {c.cohort: c for c in cohort_states(coord.ledger, "s1")}
    assert set(states) == set(range(1, 31))
    assert site.tasks[-1].cohorts is not None and 30 in site.tasks[-1].cohorts
    assert all(states[c].retired_round == c + k[CR] for c in range(1, 31 - k[CR]))
    assert all(states[c].retired_round is None for c in range(31 - k[CR], 31))
    # the burn-down: after round r the largest spend of any record, the oldest cohort's min(r, k) rounds
    points = burn_down_points(coord.ledger, "s1", CR, 1e-5, "rdp")
    assert list(points) == list(range(1, 31))
    for r, eps in points.items():
        assert eps == pytest.approx(direct_epsilon([CR_EVENT] * min(r, k[CR])), rel=1e-9)
    # the budget table: CR's row is the oldest cohort still training it, with the cohorts training and retired
    (row,) = [x for x in budget_report(coord.config, coord.registry, coord.ledger, "rdp") if x.category == CR]
    assert (row.cohort, row.cohorts_active, row.cohorts_retired) == (31 - k[CR], k[CR], 30 - k[CR])
    assert row.spent == pytest.approx(direct_epsilon([CR_EVENT] * k[CR]), rel=1e-9) and not row.halted


def test_a_site_charged_before_cohorts_keeps_its_spend_in_cohort_zero(federation, tmp_path):
    # Prepare: two rounds charged to the site's own stream, as a coordinator without cohorts did, with LC halted
    budget = (direct_epsilon([LC_EVENT] * 3) + direct_epsilon([LC_EVENT] * 4)) / 2
    coord, transport, key = federation(rounds=4, budget={"kind": "from_max", "eps_max": budget, "gamma": 0.0})
    site = StreamingSite("s1", transport, key.public_key(), value=1.0, num_examples=20,
                         events={LC: LC_EVENT, CR: CR_EVENT}, registry=CohortRegistry(tmp_path / "cohorts.sqlite"))
    site.attach()
    coord.enrol("s1", site.public_pem, {"capacity": 20, "categories": ["LC", "CR"]})
    for r in (1, 2):
        coord.ledger.record_round("s1", r, {LC: LC_EVENT, CR: CR_EVENT})
    coord.start()
    h = coord.rounds.current_model()[0]
    with coord.store.session() as s:  # the two rounds exist, as they would after an upgrade
        for r in (1, 2):
            s.add(RoundRow(round=r, status="closed", base_model_hash=h, new_model_hash=h, selected_json='["s1"]',
                           privacy="ccdp"))
    # Execute: rounds 3 and 4 with cohorts; the records held at round 3 (ARRIVALS has none for it: add them)
    site.records = [("old-lc", LC), ("old-cr", CR)]
    results = coord.run()
    # Assert: the old records trained in cohort 0, whose stream is the site's own: LC stops after its third round,
    # and their whole history, before cohorts and after, is within the budget
    assert [r.status for r in results] == ["closed", "closed"]
    assert site.tasks[0].cohorts == {0: (), 3: ()} and site.tasks[1].cohorts == {0: (LC,), 3: (), 4: ()}
    assert site.registry.assignments() == {"old-lc": (0, LC.rank), "old-cr": (0, CR.rank)}
    assert [r for r, _ in coord.ledger.round_events("s1", LC)] == [1, 2, 3]
    assert [r for r, _ in coord.ledger.round_events("s1", CR)] == [1, 2, 3, 4]
    assert len(site.history["old-lc"]) == 1 and len(site.history["old-cr"]) == 2  # rounds 3 (and 4) here
    assert direct_epsilon([LC_EVENT] * 2 + site.history["old-lc"]) <= budget
    # the budget table: LC's row is the oldest cohort still training LC (round 3's, 2 rounds of LC); cohort 0's
    # records, halted on LC, spent 3 rounds of it: the row names that as the most any record spent
    (row,) = [x for x in budget_report(coord.config, coord.registry, coord.ledger, "rdp") if x.category == LC]
    assert row.cohort == 3 and row.spent == pytest.approx(direct_epsilon([LC_EVENT] * 2), rel=1e-9)
    assert row.most_spent == pytest.approx(direct_epsilon([LC_EVENT] * 3), rel=1e-9)
    (cr,) = [x for x in budget_report(coord.config, coord.registry, coord.ledger, "rdp") if x.category == CR]
    assert cr.cohort == 0 and cr.most_spent == cr.spent  # the oldest cohort still training CR spent the most
