"""Buffered rounds (FedBuff, Nguyen et al., AISTATS 2022, Alg. 1) on the coordinator's rounds: what changes when
``buffered:`` is set in the coordinator config (docs/transport.md "Buffered rounds").

A buffered round is opened and published like a synchronous one (every site with budget left gets the task of the
current model version), and its own updates are ingested as usual. What differs:

- **Close**: once K = ``buffer_size`` updates are in, its own and the stale ones waiting
  (:func:`coordinator.buffered_store.count_waiting`), or at ``round_deadline_s`` with at least one.
- **Stale updates** (trained for an earlier round, at most ``max_staleness`` rounds old when they arrived) were
  charged and stored at ingest (:mod:`coordinator.inbound.stale`); at the close they are claimed by this round
  (:func:`coordinator.buffered_store.claim_waiting`) and folded into FedAvg's running sum with the weight
  s(t) n_i, t = this round - their round, n_i their declared capacity (:meth:`BufferedRounds.fold`).
- **Aggregate** (:meth:`BufferedRounds.aggregate`): ``sum_i s(t_i) n_i delta_i / D``, where the round's own updates
  have t = 0 (s = 1) and D is ``max(K, m) * mean declared capacity`` for m updates folded (``normalisation:
  fixed``, the fixed-denominator estimator, McMahan et al., ICLR 2018, Sec. 2) or ``sum_i n_i`` (``examples``).
  A round usually folds exactly K; more come in when several updates arrive together (sites share a round's time
  slot) or between the quorum and the close, and max(K, m) keeps them from enlarging the step. The staleness
  weights are not renormalised away (``coordinator.buffered``, "Normalisation"). The server optimizer then steps as
  in any round.

The staleness functions are :class:`coordinator.buffered.StalenessWeight`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from shared.protocol import decode_update

from coordinator.buffered import StalenessWeight
from coordinator.buffered_store import claim_waiting, count_waiting
from coordinator.config_learning import BufferedConfig
from coordinator.inbound.context import RoundContext
from coordinator.registry import SiteRegistry
from coordinator.storage import Store
from coordinator.strategies.fedavg import RunningWeightedSum, add_weighted

__all__ = ["FoldedStale", "BufferedRounds"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoldedStale:
    """One stale update folded into a round: its site, the round it was trained for, its staleness t (rounds),
    s(t), and its declared capacity n (the FedAvg weight before s)."""

    site_id: str
    round: int
    staleness: int
    scale: float
    num_examples: int


class BufferedRounds:
    """The buffered-round rules of the module docstring for one coordinator.

    Args:
        config: the ``buffered:`` section. store: the coordinator's store. registry: the sites (their declared
            capacities make the fixed denominator).
    """

    def __init__(self, config: BufferedConfig, store: Store, registry: SiteRegistry) -> None:
        self.config = config
        self._store = store
        self._registry = registry
        self.weight = StalenessWeight(kind=config.staleness, a=float(config.exponent), b=float(config.knee))

    @property
    def buffer_size(self) -> int:
        """K: updates that close a round."""
        return int(self.config.buffer_size)

    def waiting(self) -> int:
        """Stale updates stored and not yet claimed by a round."""
        return count_waiting(self._store)

    def fold(self, ctx: RoundContext) -> list[FoldedStale]:
        """Claim the waiting stale updates for ``ctx.round`` and add ``s(t) n delta`` of each to the round's FedAvg
        running sum (``ctx.strategy.running_sum``, already holding the round's own updates).

        Returns:
            the folded updates, oldest stored first.

        Raises:
            FileNotFoundError: a claimed update's blob is missing. PayloadError: it does not decode.
        """
        acc = _running_sum(ctx)
        folded = []
        for row in claim_waiting(self._store, ctx.round):
            report, delta = decode_update(self._store.get_blob(row.payload_sha256))
            t = ctx.round - int(row.round)
            scale = self.weight(t)
            add_weighted(acc, delta, scale * float(report.num_examples))
            acc.contributors.append(row.site_id)
            folded.append(FoldedStale(row.site_id, int(row.round), t, scale, int(report.num_examples)))
            log.info("rounds: round %d folds %s's round %d update (staleness %d, weight %.3f)", ctx.round,
                     row.site_id, row.round, t, scale)
        return folded

    def aggregate(self, ctx: RoundContext, stale: list[FoldedStale]) -> dict[str, np.ndarray]:
        """The round's aggregate delta (module docstring), in the template's dtypes.

        Raises:
            ValueError: nothing was folded (no update of the round and no stale one).
        """
        acc = _running_sum(ctx)
        if acc.count == 0:
            raise ValueError("no update was accumulated: nothing to aggregate")
        examples = sum(a.num_examples for a in ctx.accepted.values()) + sum(f.num_examples for f in stale)
        denominator = float(examples)
        if self.config.normalisation == "fixed":  # max(K, m): updates that came together beyond K do not enlarge it
            denominator = max(self.buffer_size, acc.count) * self.reference_weight(examples / acc.count)
        return {k: (v / denominator).astype(acc.dtypes[k]) for k, v in acc.sums.items()}

    def reference_weight(self, fallback: float) -> float:
        """The fixed denominator's weight per update: the enrolled sites' mean declared capacity (public), or
        ``fallback`` (the buffer's mean) when no site declared one."""
        capacities = [site.capacity for site in self._registry.list() if site.capacity]
        return float(np.mean(capacities)) if capacities else float(fallback)


def _running_sum(ctx: RoundContext) -> RunningWeightedSum:
    acc = getattr(ctx.strategy, "running_sum", None)
    if acc is None:
        raise ValueError("buffered rounds need FedAvg's running sum (strategy {kind: fedavg}), begun for the round")
    return acc
