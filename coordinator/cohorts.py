"""Record-level budgets for data that keeps arriving: a site's records train in cohorts, each with its own spend.

A *cohort* of a site is the set of its records that joined training in the same round: the gateway assigns every
training record it has not assigned before to the round of the first task it trains after the record appeared
(:mod:`edge_sdk.rounds.cohorts`). The coordinator never learns which records, or how many, a cohort holds: it opens
a cohort for every round in which it sends the site a task, empty or not.

Every record of cohort ``c`` and category ``k`` takes part in exactly the rounds ``c, c+1, ...`` in which ``k`` is
not halted in ``c``, under the round's mechanism for ``k`` (the same for every cohort: the sampling rate and noise
come from public values only, docs/privacy.md "No uncharged counts"). So its privacy loss is the composition of the
events of those rounds, which the ledger keeps as the cohort's own stream (:func:`coordinator.ledger_streams.stream_id`):
:meth:`coordinator.ledger.PrivacyLedger.record_round` writes a site's round events once to each cohort the round
named, for the categories active in it. Before each round, :func:`plan_round` runs the halt check on each active
cohort's stream (its recorded events, the rounds whose charges can still arrive, and one more round) and halts a
category in a cohort whose next round would pass the category's budget; a cohort with every category halted
retires (its records stay for inference and the web view, and never train again). Halting depends only on the
recorded events, which are public functions of the configuration: a privacy filter in the sense of Feldman and
Zrnic, "Individual Privacy Accounting via a Rényi Filter" (NeurIPS 2021), Thm 3.3, with each record's loss bounded
by its category's budget (docs/privacy.md "Record-level budgets" states the theorem and its proof sketch).

A site is therefore never halted for good: the newest cohort has spent nothing, and the records that arrive next
train in it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import select

from shared.iucn import IUCNCategory

from coordinator.ledger import PrivacyLedger
from coordinator.ledger_streams import stream_id
from coordinator.storage import CohortRoundRow, CohortRow, Store, dumps

__all__ = ["plan_round", "CohortState", "cohort_states"]

log = logging.getLogger(__name__)


def plan_round(store: Store, ledger: PrivacyLedger, site_id: str, round: int,
               budgets: Mapping[IUCNCategory, float], *, categories: Iterable[IUCNCategory],
               pending_rounds: Sequence[int] = ()) -> dict[int, frozenset[IUCNCategory]]:
    """The cohorts of ``site_id`` that train in ``round`` and the categories halted in each, written durably before
    the round's task is sent (idempotent: a round planned before, e.g. by a coordinator that stopped before sending
    its tasks, returns what was planned then).

    Opens cohort ``round``; for each cohort still active, halts (in its stream) every category whose next round
    would pass its budget, counting the site's ``pending_rounds`` from the cohort's first round on as spent
    (:meth:`coordinator.ledger.PrivacyLedger.halt_if_needed`); retires a cohort whose every category is halted.

    Args:
        store: the coordinator's store.
        ledger: the privacy ledger.
        site_id: the site about to be sent a task.
        round: the round about to open.
        budgets: epsilon per IUCN category.
        categories: the categories the site holds (its declared ones, :func:`coordinator.selection.known_categories`);
            a cohort retires when all of them are halted in it.
        pending_rounds: the site's earlier rounds whose charges can still arrive
            (:meth:`coordinator.ledger.PrivacyLedger.pending_rounds`).

    Returns:
        ``{cohort: halted categories}`` for every cohort that trains in ``round`` (empty when none can: one round
        would pass a budget even for a new cohort).
    """
    with store.session() as s:
        done = s.scalars(select(CohortRoundRow).where(CohortRoundRow.site_id == site_id,
                                                      CohortRoundRow.round == int(round))).first()
        if done is not None:
            return {int(c): frozenset(IUCNCategory(x) for x in cats)
                    for c, cats in json.loads(done.active_json).items()}
        first = s.scalars(select(CohortRow).where(CohortRow.site_id == site_id)).first() is None
        if first and ledger.events_recorded(site_id):
            # charged before it had cohorts: every record it holds may have trained then, so they form cohort 0,
            # whose stream is the site's own (its spend and halts carry on); the gateway puts the records it holds
            # at its first task with cohorts there (edge_sdk.rounds.cohorts)
            s.add(CohortRow(site_id=site_id, cohort=0))
        if s.scalars(select(CohortRow).where(CohortRow.site_id == site_id, CohortRow.cohort == int(round))
                     ).first() is None:
            s.add(CohortRow(site_id=site_id, cohort=int(round)))
        active = sorted(int(c) for c in s.scalars(select(CohortRow.cohort).where(
            CohortRow.site_id == site_id, CohortRow.retired_round.is_(None))).all())
    _, predicted = ledger.last_round_event_sets(site_id)  # one more round's events, as the last round's
    known = set(categories) | set(predicted)
    plan: dict[int, frozenset[IUCNCategory]] = {}
    retired: list[int] = []
    for cohort in active:
        stream = stream_id(site_id, cohort)
        pending = sum(1 for p in pending_rounds if cohort <= p < round)
        halted = ledger.halt_if_needed(stream, budgets, round=round, next_events=predicted or None, pending=pending)
        if known and known <= halted:
            retired.append(cohort)
        else:
            plan[cohort] = halted
    with store.session() as s:
        for row in s.scalars(select(CohortRow).where(CohortRow.site_id == site_id,
                                                     CohortRow.cohort.in_(retired))).all():
            row.retired_round = int(round)
        s.add(CohortRoundRow(site_id=site_id, round=int(round), active_json=dumps(
            {str(c): sorted(x.value for x in h) for c, h in plan.items()})))
    for cohort in retired:
        log.info("cohorts: site %s: the records of cohort %d have spent their budgets; they retire from training "
                 "from round %d (they stay for inference and the web view)", site_id, cohort, round)
    if not plan:
        log.warning("cohorts: site %s: even a new cohort's first round would pass a budget; the site does not train "
                    "in round %d (raise the budgets or lower the local steps)", site_id, round)
    return plan


@dataclass(frozen=True)
class CohortState:
    """One cohort of a site, for reports: ``cohort`` (its first round), ``retired_round`` (None while active),
    ``halted`` (categories halted in it as of its latest planned round), ``stream`` (its ledger stream id)."""

    cohort: int
    retired_round: int | None
    halted: frozenset[IUCNCategory]
    stream: str


def cohort_states(ledger: PrivacyLedger, site_id: str) -> list[CohortState]:
    """Every cohort of ``site_id`` in order of its first round (empty for a site that never trained in cohorts)."""
    with ledger.store.session() as s:
        rows = [(int(r.cohort), r.retired_round) for r in s.scalars(
            select(CohortRow).where(CohortRow.site_id == site_id).order_by(CohortRow.cohort)).all()]
    out = []
    for cohort, retired in rows:
        stream = stream_id(site_id, cohort)
        halted = frozenset(IUCNCategory) if retired is not None else ledger.stream_halted(stream)
        out.append(CohortState(cohort=cohort, retired_round=None if retired is None else int(retired),
                               halted=halted, stream=stream))
    return out
