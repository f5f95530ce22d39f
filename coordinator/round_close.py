"""What closing a FedAvg/NIRA round does before its model step: settle which updates count.

:meth:`coordinator.rounds.RoundManager.close_round` stops ingest, then settles the round's accepted set with these
functions, charges the ledger and only then aggregates (docs/architecture.md, "A round", step 5):

- :func:`absorb_stored`: an update stored by another process is counted here once (normally there is none);
- :func:`finalise_from_workers`: under scale-out ingest (``coordinator.inbound.workers``) the merged partial sums and the
  stored updates' reports are the round's aggregate and accepted set;
- :func:`over_budget_at_close` and :func:`drop_refused`: the budget check repeated against what the ledger holds
  at close; a refused update is charged (the coordinator has seen it) but not aggregated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from sqlalchemy import select

from coordinator.inbound.context import RoundContext
from coordinator.ledger import PrivacyLedger
from coordinator.inbound.partial_sums import collect_round
from coordinator.storage import Store
from coordinator.stored_updates import accepted_from_stored, fold_stored_updates
from coordinator.tables import RoundRow

__all__ = ["absorb_stored", "finalise_from_workers", "over_budget_at_close", "drop_refused"]

log = logging.getLogger("coordinator.rounds")  # these are steps of the round manager: logged under its name


def absorb_stored(store: Store, ctx: RoundContext) -> None:
    """Make every stored update of ``ctx.round`` count once: one stored by another process (e.g. a misconfigured
    ingest worker beside this coordinator) is aggregated into ``ctx.strategy`` and added to ``ctx.accepted`` like
    the ones this process accepted, and so charged, never lost from the ledger."""
    others = [upd for upd in store.updates_for_round(ctx.round) if upd.site_id not in ctx.accepted]
    for upd, report in fold_stored_updates(store, ctx, others):
        ctx.accepted[upd.site_id] = accepted_from_stored(ctx.round, upd, report)
        log.warning("rounds: round %d: %s's update was stored by another process; counted here once", ctx.round,
                    upd.site_id)


def finalise_from_workers(store: Store, ctx: RoundContext, weights: Mapping[str, np.ndarray]) -> None:
    """Scale-out close (``coordinator.inbound.workers``): mark the round ``closing`` under the round row's lock (from then on
    a worker charges an update as late instead of storing it), then take the merged partial sums
    (:func:`coordinator.inbound.partial_sums.collect_round`) and the stored updates' reports as the round's aggregate
    (``ctx.strategy``, restarted from ``weights``) and accepted set."""
    with store.session() as s:
        row = s.scalars(select(RoundRow).where(RoundRow.round == ctx.round).with_for_update()).first()
        assert row is not None
        row.status = "closing"
    merged, accepted = collect_round(store, ctx.round, weights)
    ctx.strategy.begin_round(weights)
    ctx.strategy.absorb(merged)  # type: ignore[attr-defined] - FedAvg (the config refuses other strategies)
    ctx.accepted.clear()
    ctx.accepted.update(accepted)


def over_budget_at_close(ledger: PrivacyLedger, ctx: RoundContext) -> dict[str, str]:
    """The over-budget check repeated at close, against what the ledger holds NOW (late updates of earlier rounds
    may have been charged since an update was admitted): per accepted update and category, its round's events
    (every mechanism) after every other round's recorded events and the site's other pending rounds
    (:meth:`coordinator.ledger.PrivacyLedger.cohort_round_would_exceed`).

    Returns:
        ``{site: reason}`` of the updates that must not be aggregated (empty when every one fits, and always under
        ``privacy: none``).
    """
    if ctx.privacy == "none":
        return {}
    budgets = ctx.budgets
    pending = ledger.pending_rounds(before_round=ctx.round)
    refused: dict[str, str] = {}
    for site_id, acc in sorted(ctx.accepted.items()):
        others = len(pending.get(site_id, ()))  # per cohort: those from its first round on (the ledger counts)
        for cat in sorted({*acc.events, *acc.count_events}, key=lambda c: c.rank):
            budget = budgets.get(cat)
            events = tuple(e for e in (acc.events.get(cat), acc.count_events.get(cat)) if e is not None)
            if budget is None or not events:
                continue
            if ledger.cohort_round_would_exceed(site_id, cat, ctx.round, events, budget,
                                                pending_rounds=pending.get(site_id, ())):
                refused[site_id] = (f"at close, round {ctx.round}'s events for {cat.value} would take site "
                                    f"{site_id!r} past its budget eps={budget:.4f} (after {others} other "
                                    "round(s) whose charges can still arrive); charged, not aggregated")
                break
    return refused


def drop_refused(store: Store, ctx: RoundContext, weights: Mapping[str, np.ndarray], refused: Mapping[str, str]
                 ) -> None:
    """Drop the ``refused`` sites (``{site: reason}``) from ``ctx.accepted``, recording each as an ``over_budget``
    rejection, and rebuild the running sum from ``weights`` and the stored blobs of the others."""
    for site_id, reason in refused.items():
        ctx.accepted.pop(site_id)
        log.error("rounds: round %d: %s", ctx.round, reason)
        store.add_rejection(round=ctx.round, site_id=site_id, topic="", reason="over_budget",
                            error_kind="close_check", detail=reason)
    ctx.strategy.begin_round(weights)
    fold_stored_updates(store, ctx, list(ctx.accepted.values()))
