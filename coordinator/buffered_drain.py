"""The round manager's buffered-round steps that are not a round of its own schedule: the context of a past round
(for the stale updates it still receives), the last round that drains the buffer, and the round a stale update
joins now.

:class:`BufferedDrain` is a base of :class:`coordinator.rounds.RoundManager` (buffered rounds:
:mod:`coordinator.buffered_rounds`); its methods use the manager's store, ledger, ingestor, strategy, clock and
round steps (``current_model``, ``next_round``, ``close_round``...).
"""

from __future__ import annotations

import dataclasses
import json
import logging

from shared.codec import decode_tensors

from coordinator.inbound.context import RoundContext
from coordinator.radio import expected_events
from coordinator.round_record import RoundRecord
from coordinator.round_result import RoundResult
from coordinator.tables import RoundRow

__all__ = ["BufferedDrain"]

log = logging.getLogger("coordinator.rounds")  # a part of the round manager: logged under its name


class BufferedDrain:
    """Past rounds' contexts and the final draining round of buffered rounds. A base of
    :class:`coordinator.rounds.RoundManager`, whose parts and round steps these methods use."""

    def past_context(self, round: int) -> RoundContext:
        """A :class:`RoundContext` of past round ``round`` for its stale updates (:mod:`coordinator.inbound.stale`):
        its model hash and template, the tasks' privacy parameters, no halts.

        Raises:
            LookupError: ``round`` has no round row.
        """
        with self._store.session() as s:
            row = s.get(RoundRow, round)
            if row is None:
                raise LookupError(f"no round {round}")
            base, selected = row.base_model_hash, frozenset(json.loads(row.selected_json))
        if base not in self._templates:
            self._templates = {base: decode_tensors(self._store.get_model(base))[0]}  # the newest past model only
        return RoundContext(round=round, model_hash=base, template=self._templates[base], selected=selected, halted={},
                            budgets=self.config.budgets(), privacy=self.config.privacy,
                            local_steps=self._local_steps(), strategy=self._strategy,
                            count_noise_multiplier=self._count_noise(), num_classes=self.config.num_classes,
                            expected_events=expected_events(self.config), **self._task_noise_parameters())

    def drain_buffer(self) -> RoundResult | None:
        """Buffered rounds, at the end of a run: a last round that sends no task and folds what is still coming.
        The updates that wait, and up to two per site whose rounds are still pending within ``max_staleness``
        (:meth:`coordinator.ledger.PrivacyLedger.pending_rounds`: the update a gateway has in flight, and the one
        it trains from the newest task it holds once that is acknowledged), are awaited until
        ``round_deadline_s``; the round then closes with whatever came (``failed`` when nothing did), so that an
        update charged after the last planned round still reaches the final model.

        Returns:
            the round's result, or None when nothing is waiting or expected (no round is recorded then).
        """
        if self.buffered is None:
            return None
        r = self.next_round()
        window = r - self.buffered.config.max_staleness
        pending = self._ledger.pending_rounds(before_round=r, capped=False).values()
        expected = sum(min(2, sum(1 for x in rounds if x >= window)) for rounds in pending)
        waiting = self.buffered.waiting()
        if expected + waiting == 0:
            return None
        t0 = self._clock()
        base_hash, weights = self.current_model()
        RoundRecord.open(self._store, round=r, base_model_hash=base_hash, selected=[], privacy=self.config.privacy)
        self._strategy.begin_round(weights)
        ctx = RoundContext(round=r, model_hash=base_hash, template=weights, selected=frozenset(), halted={},
                           budgets=self.config.budgets(), privacy=self.config.privacy, local_steps=self._local_steps(),
                           strategy=self._strategy, bundle=weights, count_noise_multiplier=self._count_noise(),
                           num_classes=self.config.num_classes, **self._task_noise_parameters())
        self._ingestor.open_round(ctx)
        log.info("rounds: round %d sends no task: it folds %d waiting update(s) and waits for %d in flight", r,
                 waiting, expected)
        with self._ingestor.changed:
            deadline = self._clock() + self.config.round_deadline_s
            while self._in_buffer(ctx) < expected + waiting and self._clock() < deadline:
                self._ingestor.changed.wait(timeout=min(0.5, max(0.0, deadline - self._clock())))
        result = self.close_round(ctx)
        return dataclasses.replace(result, duration_s=self._clock() - t0)

    def round_joined_now(self) -> int:
        """The round a stale update arriving now would join: the open one, else the next to open."""
        ctx = self._ingestor.context
        return ctx.round if ctx is not None else self.next_round()
