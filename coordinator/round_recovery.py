"""Crash recovery for the round manager: close every round a previous process left open.

:class:`RoundRecovery` is a base of :class:`coordinator.rounds.RoundManager` (module docstring of
:mod:`coordinator.rounds`, "Crash recovery"): a round left ``open`` is closed from its durably stored updates (the
running sum is rebuilt from the blobs, :mod:`coordinator.stored_updates`; ledger writes are idempotent, so a replay
never double-charges); a Global DP round left open is marked ``failed``.
"""

from __future__ import annotations

import json
import logging

from sqlalchemy import select

from shared.codec import decode_tensors

from coordinator.inbound.context import RoundContext
from coordinator.radio import expected_events
from coordinator.round_record import RoundRecord
from coordinator.round_result import RoundResult
from coordinator.stored_updates import accepted_from_stored, fold_stored_updates
from coordinator.tables import RoundRow

__all__ = ["RoundRecovery"]

log = logging.getLogger("coordinator.rounds")  # a part of the round manager: logged under its name


class RoundRecovery:
    """Closes the rounds a previous process left open. A base of :class:`coordinator.rounds.RoundManager`, whose
    store, strategy, clock and close step (``_close``) it uses."""

    def recover(self) -> list[RoundResult]:
        """Close every round a previous process left ``open``, from its durably stored updates."""
        results = []
        with self._store.session() as s:
            open_rows = list(s.scalars(select(RoundRow).where(RoundRow.status.in_(("open", "closing")))
                                       .order_by(RoundRow.round)))
        for row in open_rows:
            t0 = self._clock()
            if row.privacy == "global":
                RoundRecord.attach(row, self._store).close(
                    "failed", detail=("the coordinator stopped during secure aggregation (its state is in memory "
                                      "only); spend recorded before unmasking stays charged once; re-run as a new "
                                      "round"))
                log.warning("rounds: Global DP round %d left open by a previous run: marked failed", row.round)
                results.append(RoundResult(round=row.round, status="failed",
                                           selected=tuple(sorted(json.loads(row.selected_json))), accepted=(),
                                           model_hash=row.base_model_hash, duration_s=self._clock() - t0))
                continue
            weights, _ = decode_tensors(self._store.get_model(row.base_model_hash))
            selected = frozenset(json.loads(row.selected_json))
            self._strategy.begin_round(weights)
            ctx = RoundContext(round=row.round, model_hash=row.base_model_hash, template=weights, selected=selected,
                               halted={}, budgets=self.config.budgets(), privacy=self.config.privacy,
                               local_steps=self._local_steps(), strategy=self._strategy, bundle=weights,
                               expected_events=expected_events(self.config), **self._task_noise_parameters())
            for upd, report in fold_stored_updates(self._store, ctx, self._store.updates_for_round(row.round)):
                ctx.accepted[upd.site_id] = accepted_from_stored(row.round, upd, report)
            status, h, stale = self._close(ctx, weights, self._needed(ctx))
            log.warning("rounds: recovered round %d left open by a previous run: %s", row.round, status)
            results.append(RoundResult(round=row.round, status=status, selected=tuple(sorted(selected)),
                                       accepted=tuple(sorted(ctx.accepted)), model_hash=h,
                                       duration_s=self._clock() - t0, stale=stale))
        return results
