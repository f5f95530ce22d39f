"""The aggregation-strategy interface (Flower's ``Strategy`` idea, reduced to what a streaming coordinator needs).

A strategy sees updates one at a time (``accumulate``) and produces one aggregate at the end of a round
(``aggregate``). It never sees the transport, the ledger or the database, and it must not keep a list of the K
full updates: aggregation is a running sum (DESIGN.md "Scale"), so partial sums from several ingest workers can
be merged (associativity; see :func:`coordinator.strategies.fedavg.merge`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

__all__ = ["Strategy", "Tensors"]

#: name -> array, e.g. ``{"phi.conv1.weight": float32 (16, 1, 3, 3), ...}``.
Tensors = Mapping[str, np.ndarray]


class Strategy(ABC):
    """Streaming aggregation of model deltas for one round at a time."""

    @abstractmethod
    def begin_round(self, template: Tensors) -> None:
        """Reset state for a new round; ``template`` gives the global model's names, shapes and dtypes."""

    @abstractmethod
    def accumulate(self, site_id: str, delta: Tensors, *, num_examples: int) -> None:
        """Fold one site's delta (local minus global, same names/shapes as ``template``) into the running state.

        Args:
            site_id: the sender (strategies that cluster sites use it; FedAvg ignores it).
            delta: name -> array, float, finite.
            num_examples: the weight N_k (>= 1).
        """

    @abstractmethod
    def aggregate(self) -> dict[str, np.ndarray]:
        """The round's aggregate delta, name -> array with the template's dtypes.

        Raises:
            ValueError: nothing was accumulated this round.
        """

    @property
    @abstractmethod
    def count(self) -> int:
        """Number of updates accumulated in the current round."""
