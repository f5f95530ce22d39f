"""Server Adam, FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", ICLR, Alg. 2 with ServerOpt Adam).

With the round's aggregate delta ``Delta_t = avg_delta_t`` (the negated pseudo-gradient, ``G_t = -Delta_t``), per
coordinate::

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
    theta_{t+1} = theta_t + eta m_t / (sqrt(v_t) + tau)

i.e. ``theta - eta m'/(sqrt(v) + tau)`` with ``m' = -m`` the momentum of G. As in Alg. 2 there is no bias
correction; ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's initialisation ``v_{-1} >= tau^2``, at its smallest).
tau is the adaptivity: ``tau >> |Delta|`` makes it server momentum SGD with step ``eta / tau``.

Privacy: reads only the released aggregate, post-processing, no privacy cost (as every server optimizer).

State: ``fedadam/m/<name>`` and ``fedadam/v/<name>`` (float64, the tensor's shape), stored with every model
version like the other optimizers' state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from shared.errors import ConfigError

from coordinator.optimizers.base import ServerOptimizer
from coordinator.strategies.base import Tensors

__all__ = ["ServerAdam"]

_M, _V = "fedadam/m/", "fedadam/v/"


class ServerAdam(ServerOptimizer):
    """FedAdam's server step (module docstring; Reddi et al. 2021, Alg. 2).

    Args:
        learning_rate: eta > 0. beta1: first-moment decay in [0, 1). beta2: second-moment decay in [0, 1).
        tau: adaptivity > 0 (same units as the delta: parameter units per round).

    Raises:
        ConfigError: a value out of range (names the field and the fix).
    """

    def __init__(self, *, learning_rate: float = 0.01, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3) -> None:
        checks = (("learning_rate", learning_rate, 0 < learning_rate < math.inf, "e.g. 0.01"),
                  ("beta1", beta1, 0 <= beta1 < 1, "e.g. 0.9"),
                  ("beta2", beta2, 0 <= beta2 < 1, "e.g. 0.99"),
                  ("tau", tau, 0 < tau < math.inf, "e.g. 1e-3 (Reddi et al. tune it in 1e-9..1)"))
        for name, value, ok, fix in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ConfigError(f"{name} = {value!r} is out of range", field=f"server_optimizer.{name}", fix=fix)
        self.learning_rate, self.beta1, self.beta2, self.tau = (float(learning_rate), float(beta1), float(beta2),
                                                                float(tau))
        self._m: dict[str, np.ndarray] = {}
        self._v: dict[str, np.ndarray] = {}

    def step(self, weights: Tensors, avg_delta: Tensors) -> dict[str, np.ndarray]:
        """One FedAdam step per tensor, in float64, cast back to each weight's dtype.

        Args:
            weights: ``{name: array}``. avg_delta: the same names and shapes (the aggregate delta, ``-G``).

        Returns:
            New weights, same names, shapes and dtypes.

        Raises:
            ValueError: names or shapes of ``avg_delta`` differ from ``weights``.
        """
        if set(weights) != set(avg_delta):
            raise ValueError(f"delta names differ from the model: {sorted(set(weights) ^ set(avg_delta))}")
        out: dict[str, np.ndarray] = {}
        new_m, new_v = {}, {}
        for name, w in weights.items():
            w = np.asarray(w)
            d = np.asarray(avg_delta[name], dtype=np.float64)
            if d.shape != w.shape:
                raise ValueError(f"delta {name!r} has shape {d.shape}, model has {w.shape}")
            m = self._m.get(name)
            v = self._v.get(name)
            if m is None or m.shape != d.shape:
                m, v = np.zeros_like(d), np.full_like(d, self.tau ** 2)
            m = self.beta1 * m + (1 - self.beta1) * d
            v = self.beta2 * v + (1 - self.beta2) * d * d
            out[name] = (w.astype(np.float64) + self.learning_rate * m / (np.sqrt(v) + self.tau)).astype(w.dtype)
            new_m[name], new_v[name] = m, v
        self._m, self._v = new_m, new_v
        return out

    def state_tensors(self) -> dict[str, np.ndarray]:
        """``{"fedadam/m/<name>": float64, "fedadam/v/<name>": float64}`` (each the tensor's shape)."""
        out = {_M + k: v.copy() for k, v in self._m.items()}
        out.update({_V + k: v.copy() for k, v in self._v.items()})
        return out

    def load_state_tensors(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_tensors`' output (replacing the current state).

        Raises:
            ValueError: a first moment without its second, or the other way round.
        """
        m = {k[len(_M):]: np.asarray(v, dtype=np.float64).copy() for k, v in state.items() if k.startswith(_M)}
        v = {k[len(_V):]: np.asarray(x, dtype=np.float64).copy() for k, x in state.items() if k.startswith(_V)}
        if set(m) != set(v):
            raise ValueError(f"FedAdam state disagrees: first moments {sorted(m)}, second moments {sorted(v)}")
        self._m, self._v = m, v
