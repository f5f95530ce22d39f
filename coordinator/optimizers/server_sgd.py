"""Server SGD (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 1 with plain SGD as ServerOpt):

    theta_{t+1} = theta_t + server_lr * avg_delta_t

where ``avg_delta_t`` is the aggregate of the clients' (local minus global) deltas. ``server_lr = 1`` is exactly
FedAvg (McMahan et al. 2017).
"""

from __future__ import annotations

import math

import numpy as np

from shared.errors import ConfigError

from coordinator.optimizers.base import ServerOptimizer
from coordinator.strategies.base import Tensors

__all__ = ["sgd_step", "ServerSGD"]


def sgd_step(weights: Tensors, avg_delta: Tensors, server_lr: float) -> dict[str, np.ndarray]:
    """``weights + server_lr * avg_delta`` per tensor, computed in float64 and cast to each weight's dtype.

    Raises:
        ValueError: names or shapes of ``avg_delta`` differ from ``weights``.
    """
    if set(weights) != set(avg_delta):
        raise ValueError(f"delta names differ from the model: {sorted(set(weights) ^ set(avg_delta))}")
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        w = np.asarray(w)
        d = np.asarray(avg_delta[name])
        if d.shape != w.shape:
            raise ValueError(f"delta {name!r} has shape {d.shape}, model has {w.shape}")
        out[name] = (w.astype(np.float64) + server_lr * d.astype(np.float64)).astype(w.dtype)
    return out


class ServerSGD(ServerOptimizer):
    """Stateless server SGD with learning rate ``server_lr`` (> 0; 1.0 = FedAvg).

    Raises:
        ConfigError: ``server_lr`` not positive and finite.
    """

    def __init__(self, server_lr: float = 1.0) -> None:
        if not (isinstance(server_lr, (int, float)) and 0 < server_lr < math.inf):
            raise ConfigError(f"server_lr must be positive and finite, got {server_lr!r}", field="server_learning_rate",
                              fix="use 1.0 for plain FedAvg")
        self.server_lr = float(server_lr)

    def step(self, weights: Tensors, avg_delta: Tensors) -> dict[str, np.ndarray]:
        """theta + server_lr * avg_delta (see :func:`sgd_step`)."""
        return sgd_step(weights, avg_delta, self.server_lr)
