"""DP-FedSOFIM: server-side Fisher preconditioning in O(d) (docs/fedsofim.md).

The server treats the negated aggregate delta as the round's pseudo-gradient ``G_t = -avg_delta_t`` (Reddi et al.
2021, Alg. 1) and keeps, per parameter group, a momentum that doubles as a rank-one Fisher proxy::

    M_t = beta M_{t-1} + (1 - beta) G_t
    F_t = M_t M_t^T + rho I                                   (never formed: d x d)
    theta_{t+1} = theta_t - eta F_t^{-1} G_t               (precondition = "gradient", the seed's step)
    theta_{t+1} = theta_t - eta F_t^{-1} M_t               (precondition = "momentum")

The second variant preconditions the momentum instead of the fresh aggregate. By Sherman-Morrison
``F_t^{-1} M_t = M_t / (rho + |M_t|^2)``: server momentum SGD whose step shrinks as the momentum grows (step
``eta / rho`` while ``|M|^2 << rho``, step length ``eta / |M|`` once ``|M|^2 >> rho``). It avoids the seed step's
damping of the one direction the aggregates agree on (the empirical-Fisher pathology, Kunstner et al. 2019,
"Limitations of the Empirical Fisher Approximation", §3).

By Sherman-Morrison (Sherman & Morrison 1950; Golub & Van Loan, "Matrix Computations", §2.1.4):

    (rho I + m m^T)^{-1} g = (g - m (m^T g) / (rho + m^T m)) / rho

which takes two dot products and two axpys: O(d) time, and O(d) memory for M. As rho grows, the step tends to
plain SGD with step eta / rho.

Groups. The preconditioner couples the coordinates of one group only. By default the whole model is one group.
Under NIRA (``coordinator/strategies/nira.py``) each cluster head ``nira/<cluster>/...`` is its own group with its
own M and step count. The shared tensors form group ``shared``. A head whose cluster did not
train this round has ``G = 0`` there; its M still decays by beta (it is a momentum of what the head received).

Warm-up. For the first ``warmup_rounds`` steps of a group, M is updated but the step uses ``F = rho I``
(SGD with step eta / rho). M then has some history before it bends the step.

Privacy. The optimizer reads only the aggregate that the privacy mechanism already released (noised at the
gateways in CCDP mode, or by the coordinator in Global DP mode). It is post-processing of DP outputs and costs no
privacy: the ledger charges nothing for it.

State. :meth:`DPFedSOFIM.state_tensors` / :meth:`load_state_tensors` carry M per group and the step counts as
float32 / int64 arrays. The round manager stores them with every model version, so a restarted coordinator takes
bit-identical next steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from shared.errors import ConfigError

from coordinator.optimizers.base import ServerOptimizer
from coordinator.strategies.base import Tensors

__all__ = ["DPFedSOFIM", "sherman_morrison_solve", "nira_groups", "single_group", "PRECONDITION"]

PRECONDITION = ("gradient", "momentum")
"""What :class:`DPFedSOFIM` preconditions: the round's aggregate G_t (the seed) or the momentum M_t."""

_STEP_PREFIX = "fedsofim/step/"
_MOMENTUM_PREFIX = "fedsofim/momentum/"


def sherman_morrison_solve(m: np.ndarray, g: np.ndarray, rho: float) -> np.ndarray:
    """``(m m^T + rho I)^{-1} g`` in O(d) (Sherman-Morrison), without forming any d x d matrix.

    Args:
        m: float (d,), the rank-one factor (here the momentum M_t). g: float (d,). rho: > 0.

    Returns:
        float64 (d,).

    Raises:
        ValueError: shapes differ, or rho is not positive and finite.
    """
    if not (rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be positive and finite, got {rho!r}")
    m64, g64 = np.asarray(m, dtype=np.float64), np.asarray(g, dtype=np.float64)
    if m64.shape != g64.shape or m64.ndim != 1:
        raise ValueError(f"m and g must be 1-D of the same length, got {m64.shape} and {g64.shape}")
    mm = float(m64 @ m64)
    if mm == 0.0:
        return g64 / rho
    # The same formula split along m (numerically stabler when |m|^2 >> rho): with a = m^T g / m^T m and
    # g_perp = g - a m (orthogonal to m), (rho I + m m^T)^-1 g = g_perp / rho + a m / (rho + m^T m).
    a = float(m64 @ g64) / mm
    out = g64 - a * m64
    out /= rho
    out += (a / (rho + mm)) * m64
    return out


def single_group(name: str) -> str:
    """Every tensor in one group (FedAvg's single model)."""
    return "all"


def nira_groups(name: str) -> str:
    """NIRA's groups: ``nira/<cluster>/...`` -> ``<cluster>``; everything else (phi) -> ``shared``."""
    if name.startswith("nira/"):
        return name.split("/", 2)[1]
    return "shared"


def _flat(arrays: list, dtype: np.dtype) -> np.ndarray:
    """A new contiguous 1-D copy of ``arrays`` concatenated, in ``dtype``."""
    if len(arrays) == 1:
        return np.array(arrays[0], dtype=dtype, copy=True).reshape(-1)
    return np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])


class DPFedSOFIM(ServerOptimizer):
    """The DP-FedSOFIM server step (see the module docstring).

    Args:
        learning_rate: eta > 0. beta: momentum in [0, 1). rho: ridge > 0 of the Fisher proxy.
        warmup_rounds: steps per group taken with ``F = rho I`` while M accumulates (>= 0): SGD with step
            eta / rho on G (``precondition="gradient"``) or on M (``"momentum"``).
        precondition: the vector the preconditioner is applied to: ``"gradient"`` (G_t, the seed's step) or
            ``"momentum"`` (M_t). The state (M and step counts) has the same format for both.
        group_of: maps a tensor name to its group; default :func:`nira_groups`, which makes one group of a plain
            model and separates NIRA's heads.

    Raises:
        ConfigError: a value out of range (names the field and the fix).
    """

    def __init__(self, *, learning_rate: float = 1.0, beta: float = 0.9, rho: float = 1.0, warmup_rounds: int = 0,
                 group_of: Callable[[str], str] = nira_groups, precondition: str = "gradient") -> None:
        checks = (("learning_rate", learning_rate, 0 < learning_rate < math.inf, "e.g. 1.0"),
                  ("beta", beta, 0 <= beta < 1, "e.g. 0.9"),
                  ("rho", rho, 0 < rho < math.inf, "e.g. 1.0; large rho tends to SGD with step eta/rho"),
                  ("warmup_rounds", warmup_rounds, isinstance(warmup_rounds, int) and warmup_rounds >= 0, "e.g. 0"))
        for name, value, ok, fix in checks:
            if isinstance(value, bool) or not ok:
                raise ConfigError(f"{name} = {value!r} is out of range", field=f"server_optimizer.{name}", fix=fix)
        if precondition not in PRECONDITION:
            raise ConfigError(f"precondition = {precondition!r} is not one of {PRECONDITION}",
                              field="server_optimizer.precondition",
                              fix="use 'gradient' (the seed's step on G) or 'momentum' (the step on M)")
        self.precondition = precondition
        self.learning_rate, self.beta, self.rho = float(learning_rate), float(beta), float(rho)
        self.warmup_rounds = warmup_rounds
        self._group_of = group_of
        self._momentum: dict[str, np.ndarray] = {}  # group -> float32 (d_group,)
        self._steps: dict[str, int] = {}

    def _layout(self, weights: Tensors) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for name in sorted(weights):
            groups.setdefault(self._group_of(name), []).append(name)
        return groups

    def step(self, weights: Tensors, avg_delta: Tensors) -> dict[str, np.ndarray]:
        """One DP-FedSOFIM step per group: update M, precondition ``X`` (``G = -avg_delta`` or M, per
        ``precondition``) by Sherman-Morrison, step.

        Computed in the parameters' float32 with float64 dot products, in the combined form
        ``theta - eta (X / rho + c M)`` with ``c = -(M^T X) / (rho (rho + M^T M))``, which is
        :func:`sherman_morrison_solve` rearranged so that no term cancels: three model-sized float32 buffers per
        step (the flat parameters, G, one scratch), and M updated in place. For ``X = M`` the two terms are
        combined first, ``theta - eta M / (rho + M^T M)``, so nothing cancels there either.

        Args:
            weights: ``{name: float32 array}`` (the strategy's bundle). avg_delta: same names and shapes.

        Returns:
            New weights, same names, shapes and dtypes.

        Raises:
            ValueError: names or shapes of ``avg_delta`` differ from ``weights``.
        """
        if set(weights) != set(avg_delta):
            raise ValueError(f"delta names differ from the model: {sorted(set(weights) ^ set(avg_delta))[:5]}")
        out: dict[str, np.ndarray] = {}
        for group, names in self._layout(weights).items():
            shapes = [np.shape(weights[n]) for n in names]
            for n, shape in zip(names, shapes):
                if np.shape(avg_delta[n]) != shape:
                    raise ValueError(f"delta {n!r} has shape {np.shape(avg_delta[n])}, model has {shape}")
            dtype = np.result_type(*(np.asarray(weights[n]).dtype for n in names), np.float32)
            g = _flat([avg_delta[n] for n in names], dtype)
            np.negative(g, out=g)  # G = -avg_delta
            m = self._momentum.get(group)
            if m is None or m.shape != g.shape or m.dtype != dtype:
                m = np.zeros_like(g)
            # M <- beta M + (1 - beta) G, in place: beta (M - G) + G
            m -= g
            m *= self.beta
            m += g
            t = self._steps.get(group, 0) + 1
            theta = _flat([weights[n] for n in names], dtype)
            if self.precondition == "momentum":
                mm = float(np.einsum("i,i->", m, m, dtype=np.float64)) if t > self.warmup_rounds else 0.0
                theta -= np.multiply(m, self.learning_rate / (self.rho + mm))
            else:
                scratch = np.multiply(g, self.learning_rate / self.rho)
                theta -= scratch
            if self.precondition == "gradient" and t > self.warmup_rounds:
                mm = float(np.einsum("i,i->", m, m, dtype=np.float64))
                mg = float(np.einsum("i,i->", m, g, dtype=np.float64))
                c = -mg / (self.rho * (self.rho + mm))
                np.multiply(m, self.learning_rate * c, out=scratch)
                theta -= scratch
            self._momentum[group] = m
            self._steps[group] = t
            offset = 0
            for n, shape in zip(names, shapes):
                size = int(np.prod(shape))
                out[n] = theta[offset:offset + size].reshape(shape).astype(np.asarray(weights[n]).dtype, copy=False)
                offset += size
        return out

    # ---- state -------------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, np.ndarray]:
        """``{"fedsofim/momentum/<group>": float32 (d_group,), "fedsofim/step/<group>": int64 (1,)}``."""
        out: dict[str, np.ndarray] = {}
        for group, m in self._momentum.items():
            out[_MOMENTUM_PREFIX + group] = m.copy()
            out[_STEP_PREFIX + group] = np.array([self._steps[group]], dtype=np.int64)
        return out

    def load_state_tensors(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_tensors` returned (replacing the current state).

        Raises:
            ValueError: a momentum without its step count, or the other way round.
        """
        momentum = {k[len(_MOMENTUM_PREFIX):]: np.asarray(v, dtype=np.float32).reshape(-1)
                    for k, v in state.items() if k.startswith(_MOMENTUM_PREFIX)}
        steps = {k[len(_STEP_PREFIX):]: int(np.asarray(v).reshape(-1)[0])
                 for k, v in state.items() if k.startswith(_STEP_PREFIX)}
        if set(momentum) != set(steps):
            raise ValueError(f"optimizer state groups disagree: momentum {sorted(momentum)}, steps {sorted(steps)}")
        self._momentum = {g: m.copy() for g, m in momentum.items()}
        self._steps = dict(steps)
