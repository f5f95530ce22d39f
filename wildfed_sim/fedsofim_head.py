"""The linear head of the DP-FedSOFIM experiment (:mod:`wildfed_sim.fedsofim`) and its per-client federation.

A linear head's per-example cross-entropy gradients (never materialised), one client's clipped and noised release
(:func:`client_private_gradient`), the server's weighted average, the server optimizers the experiment compares
(:func:`make_optimizer`, :data:`OPTIMIZERS`) and the reference federation with one mechanism per client
(:func:`run_federation`), which the pooled simulation (:mod:`wildfed_sim.fedsofim_pool`) is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.per_example import PerExampleGradients

UNIFORM_CATEGORY = IUCNCategory.LC
"""The one category every record is in (uniform budget): only the ledger key, it changes nothing else."""
OPTIMIZERS = ("dp-fedgd", "dp-fedavgm", "dp-fedadam", "dp-fedsofim", "dp-fedsofim-m")
"""The compared server optimizers: server SGD, server momentum (FedAvgM), FedAdam, DP-FedSOFIM preconditioning G
(the seed's step) and DP-FedSOFIM preconditioning M."""
CEILING = "fedgd-nonprivate"
"""FedGD without noise (the clipping stays): the non-private ceiling of this head."""
WEIGHT, BIAS = "psi.weight", "psi.bias"


# ------------------------------------------------------------------------------------------- the linear head
@dataclass(frozen=True, eq=False)
class HeadData:
    """Frozen features and labels. features: float32 (N, F); labels: int64 (N,) in 0..C-1."""

    features: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def head_residuals(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``softmax(x_i W^T + b) - onehot(y_i)``: the gradient of the cross-entropy w.r.t. the logits.

    Args:
        weight: (C, F); bias: (C,); features: (B, F); labels: int (B,).

    Returns:
        float64 (B, C).
    """
    logits = np.asarray(features, np.float64) @ np.asarray(weight, np.float64).T + np.asarray(bias, np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(labels)), np.asarray(labels, np.int64)] -= 1.0
    return p


class LinearHeadGradients(PerExampleGradients):
    """The per-example gradients of a linear head under cross-entropy, never materialised.

    For example i with residual r_i = softmax - onehot (C,) and feature x_i (F,), the gradient is ``r_i x_i^T``
    w.r.t. the weight (C, F) and ``r_i`` w.r.t. the bias, i.e. the outer product ``r_i (x) [x_i, 1]``, flattened
    as ``[weight.ravel(), bias]`` (d = C F + C). Its L2 norm is ``||r_i|| * sqrt(||x_i||^2 + 1)`` (the Frobenius
    norm of an outer product), and ``sum_i w_i g_i = [(w * R)^T X, sum_i w_i r_i]`` (ghost clipping for one
    linear layer, Goodfellow 2015).

    Args:
        residuals: (B, C); features: (B, F).
    """

    def __init__(self, residuals: np.ndarray, features: np.ndarray) -> None:
        self.residuals = np.asarray(residuals, dtype=np.float64)
        self.features = np.asarray(features, dtype=np.float64)
        if self.residuals.ndim != 2 or self.features.ndim != 2 or len(self.residuals) != len(self.features):
            raise ValueError(f"residuals (B, C) and features (B, F) must share B, got {self.residuals.shape} and "
                             f"{self.features.shape}")
        self.norms = (np.linalg.norm(self.residuals, axis=1)
                      * np.sqrt(np.einsum("ij,ij->i", self.features, self.features) + 1.0))

    def weighted_sum(self, weights: np.ndarray) -> np.ndarray:
        """float32 (K, C F + C) = weights (K, B) @ G (B, C F + C)."""
        weights = np.asarray(weights, dtype=np.float64)
        out = []
        for w in weights:
            wr = self.residuals * w[:, None]                       # (B, C)
            out.append(np.concatenate([(wr.T @ self.features).ravel(), wr.sum(axis=0)]))
        return np.asarray(out, dtype=np.float32).reshape(len(weights), -1)


def per_example_head_gradients(weight: np.ndarray, bias: np.ndarray, features: np.ndarray,
                               labels: np.ndarray) -> np.ndarray:
    """The materialised per-example gradients, float64 (B, C F + C) in ``[weight.ravel(), bias]`` order
    (the reference :class:`LinearHeadGradients` is tested against)."""
    r = head_residuals(weight, bias, features, labels)
    x = np.asarray(features, np.float64)
    return np.concatenate([(r[:, :, None] * x[:, None, :]).reshape(len(r), -1), r], axis=1)


def flatten_head(weights: dict[str, np.ndarray]) -> np.ndarray:
    """``{psi.weight (C, F), psi.bias (C,)}`` -> (C F + C,) in ``[weight.ravel(), bias]`` order."""
    return np.concatenate([np.asarray(weights[WEIGHT]).ravel(), np.asarray(weights[BIAS]).ravel()])


def unflatten_head(flat: np.ndarray, num_classes: int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten_head`."""
    flat = np.asarray(flat)
    cf = flat.shape[0] - num_classes
    return {WEIGHT: flat[:cf].reshape(num_classes, cf // num_classes).astype(dtype),
            BIAS: flat[cf:].astype(dtype)}


def accuracy(weights: dict[str, np.ndarray], data: HeadData) -> float:
    """Top-1 accuracy of the head on ``data`` (fraction in [0, 1])."""
    logits = data.features @ np.asarray(weights[WEIGHT]).T + np.asarray(weights[BIAS])
    return float(np.mean(np.argmax(logits, axis=1) == data.labels))


def client_private_gradient(mechanism: Any, weights: dict[str, np.ndarray], data: HeadData) -> np.ndarray:
    """One client's released gradient: ``(sum_i clip_C(g_i) + N(0, (z C)^2 I)) / N_k``, float32 (C F + C,).

    ``mechanism`` is a :class:`~edge_sdk.privacy.ccdp.CCDPMechanism` with the one category
    :data:`UNIFORM_CATEGORY` and ``expected_batch_size = N_k`` (q = 1).
    """
    r = head_residuals(weights[WEIGHT], weights[BIAS], data.features, data.labels)
    cats = np.full(len(data), UNIFORM_CATEGORY.rank, dtype=np.int64)
    return mechanism.privatize(LinearHeadGradients(r, data.features), cats)


def server_pseudo_gradient(grads: Sequence[np.ndarray], sizes: Sequence[int]) -> np.ndarray:
    """``G = sum_k N_k g_k / sum_k N_k`` (float64): the server's average of the released client gradients."""
    sizes_arr = np.asarray(sizes, dtype=np.float64)
    return (sizes_arr[:, None] * np.asarray(grads, dtype=np.float64)).sum(axis=0) / sizes_arr.sum()


def make_optimizer(name: str, hp: Mapping[str, float]) -> Any:
    """The server optimizer ``name`` at the grid point ``hp`` (keys as in :data:`GRIDS`).

    ``dp-fedgd`` / ``fedgd-nonprivate``: ServerSGD(eta). ``dp-fedavgm``: ServerSGD(eta_eff (1 - mu), mu), so that
    ``eta_eff`` is the steady-state step on a constant aggregate, comparable with DP-FedGD's eta. ``dp-fedadam``:
    ServerAdam(eta, beta1, beta2, tau). ``dp-fedsofim`` / ``-m``: DPFedSOFIM(eta = eta_over_rho * rho, beta, rho)
    preconditioning G or M; ``eta_over_rho`` is the step orthogonal to M (on G) or while ``|M|^2 << rho`` (on M).

    Raises:
        ConfigError: an unknown optimizer, or a value out of range (from the optimizer).
    """
    from coordinator.optimizers.fedadam import ServerAdam
    from coordinator.optimizers.fedsofim import DPFedSOFIM
    from coordinator.optimizers.server_sgd import ServerSGD

    if name in ("dp-fedgd", CEILING):
        return ServerSGD(server_lr=hp["eta"])
    if name == "dp-fedavgm":
        return ServerSGD(server_lr=hp["eta_eff"] * (1 - hp["momentum"]), momentum=hp["momentum"])
    if name == "dp-fedadam":
        return ServerAdam(learning_rate=hp["eta"], beta1=hp["beta1"], beta2=hp["beta2"], tau=hp["tau"])
    if name in ("dp-fedsofim", "dp-fedsofim-m"):
        return DPFedSOFIM(learning_rate=hp["eta_over_rho"] * hp["rho"], beta=hp["beta"], rho=hp["rho"],
                          precondition="momentum" if name.endswith("-m") else "gradient")
    raise ConfigError(f"unknown optimizer {name!r}", field="optimizers", fix=f"use some of {OPTIMIZERS}")


def step_size(name: str, hp: Mapping[str, float]) -> float:
    """The optimizer's own learning rate eta at ``hp`` (what coordinator.yaml's ``server_learning_rate`` takes)."""
    if name == "dp-fedavgm":
        return hp["eta_eff"] * (1 - hp["momentum"])
    if name in ("dp-fedsofim", "dp-fedsofim-m"):
        return hp["eta_over_rho"] * hp["rho"]
    return hp["eta"]


def run_federation(*, optimizer: Any, clients: Sequence[HeadData], evaluate_on: dict[str, HeadData], rounds: int,
                   clipping_norm: float, noise_multiplier: float, noise: Any, num_classes: int,
                   ledger: Any = None, site_prefix: str = "", on_round: Callable[[], None] | None = None
                   ) -> dict[str, list[float]]:
    """Federate the zero-initialised head for ``rounds`` full-batch DP rounds (module docstring, steps 6-7).

    Args:
        optimizer: a server optimizer (``.step(weights, avg_delta)``).
        clients: each client's features and labels.
        evaluate_on: ``{name: data}`` evaluated after every round (and at round 0).
        noise: the noise source (:class:`~shared.privacy.randomness.SecureRandom` in every reported run).
        ledger: a :class:`~coordinator.ledger.PrivacyLedger`; each client's ``DPSGDEvent(z, 1.0, 1)`` of a round is
            recorded (committed) before the server step uses it. ``None`` only for tuning runs (not reported).
        site_prefix: the ledger's site ids are ``f"{site_prefix}client{k:03d}"``.

    Returns:
        ``{name: [accuracy after round 0..rounds]}`` (rounds + 1 values each).
    """
    from edge_sdk.privacy.ccdp import CCDPMechanism

    feat_dim = clients[0].features.shape[1]
    weights = {WEIGHT: np.zeros((num_classes, feat_dim), np.float32), BIAS: np.zeros(num_classes, np.float32)}
    mechanisms = [CCDPMechanism(clipping_norms={UNIFORM_CATEGORY: clipping_norm},
                                noise_std=float(noise_multiplier) * clipping_norm,
                                expected_batch_size=float(len(c)), noise=noise) for c in clients]
    sizes = [len(c) for c in clients]
    event = DPSGDEvent(float(noise_multiplier), 1.0, 1)
    curves: dict[str, list[float]] = {name: [accuracy(weights, d)] for name, d in evaluate_on.items()}
    for t in range(1, rounds + 1):
        grads = [client_private_gradient(m, weights, c) for m, c in zip(mechanisms, clients)]
        if ledger is not None:
            for k in range(len(clients)):
                ledger.record_round(f"{site_prefix}client{k:03d}", t, {UNIFORM_CATEGORY: event})
        g = server_pseudo_gradient(grads, sizes)
        avg_delta = unflatten_head(-g, num_classes)
        weights = optimizer.step(weights, avg_delta)
        for name, d in evaluate_on.items():
            curves[name].append(accuracy(weights, d))
        if on_round is not None:
            on_round()
    return curves
