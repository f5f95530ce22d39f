"""Server SGD (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 1 with plain SGD as ServerOpt):

    theta_{t+1} = theta_t + server_lr * avg_delta_t

where ``avg_delta_t`` is the aggregate of the clients' (local minus global) deltas. ``server_lr = 1`` is exactly
FedAvg (McMahan et al. 2017). With server momentum mu (FedAvgM, Hsu et al. 2019, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", §3):

    v_t = mu v_{t-1} + avg_delta_t,    theta_{t+1} = theta_t + server_lr * v_t

This is the DP-FedGD baseline (with or without momentum; DP-FedAvgM with it), docs/fedsofim.md. It is post-processing of
the released aggregate: no privacy cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

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
    """Server SGD with learning rate ``server_lr`` (> 0; 1.0 = FedAvg) and optional momentum ``momentum`` in [0, 1)
    (0 = stateless).

    Raises:
        ConfigError: ``server_lr`` not positive and finite, or ``momentum`` outside [0, 1).
    """

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.0) -> None:
        if not (isinstance(server_lr, (int, float)) and 0 < server_lr < math.inf):
            raise ConfigError(f"server_lr must be positive and finite, got {server_lr!r}", field="server_learning_rate",
                              fix="use 1.0 for plain FedAvg")
        if isinstance(momentum, bool) or not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ConfigError(f"momentum must be in [0, 1), got {momentum!r}", field="server_optimizer.momentum",
                              fix="use 0 (plain server SGD) or e.g. 0.9")
        self.server_lr = float(server_lr)
        self.momentum = float(momentum)
        self._velocity: dict[str, np.ndarray] = {}

    def step(self, weights: Tensors, avg_delta: Tensors) -> dict[str, np.ndarray]:
        """theta + server_lr * avg_delta (see :func:`sgd_step`), or with momentum theta + server_lr * v_t."""
        if self.momentum == 0:
            return sgd_step(weights, avg_delta, self.server_lr)
        velocity = {}
        for name, d in avg_delta.items():
            prev = self._velocity.get(name)
            d64 = np.asarray(d, dtype=np.float64)
            velocity[name] = d64 if prev is None or prev.shape != d64.shape else self.momentum * prev + d64
        out = sgd_step(weights, velocity, self.server_lr)
        self._velocity = velocity
        return out

    def state_tensors(self) -> dict[str, np.ndarray]:
        """``{"sgd/velocity/<name>": float64 array}`` (empty without momentum)."""
        return {f"sgd/velocity/{k}": v.copy() for k, v in self._velocity.items()}

    def load_state_tensors(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore the velocity of :meth:`state_tensors`."""
        prefix = "sgd/velocity/"
        self._velocity = {k[len(prefix):]: np.asarray(v, dtype=np.float64).copy() for k, v in state.items()
                          if k.startswith(prefix)}
