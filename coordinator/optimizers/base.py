"""The server-optimizer interface (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 1: the server
treats the negated aggregate delta as a pseudo-gradient)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from coordinator.strategies.base import Tensors

__all__ = ["ServerOptimizer"]


class ServerOptimizer(ABC):
    """Maps (theta_t, aggregate delta) to theta_{t+1}. Pure post-processing of DP outputs: no privacy cost."""

    @abstractmethod
    def step(self, weights: Tensors, avg_delta: Tensors) -> dict[str, np.ndarray]:
        """Return the new global weights (same names, shapes and dtypes as ``weights``)."""

    def state_tensors(self) -> dict[str, np.ndarray]:
        """The optimizer's state as named arrays (stored with each model version); default: stateless, ``{}``."""
        return {}

    def load_state_tensors(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_tensors`' output (after a restart); default: nothing to restore."""
