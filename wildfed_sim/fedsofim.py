"""DP-FedSOFIM against DP-FedGD, DP-FedAvgM and DP-FedAdam on real images (docs/fedsofim.md).

The seed's setting: a frozen feature extractor, only the last linear layer federated, full-batch DP gradient descent
on every client in every round.

Protocol (per seed; the seed fixes the data splits only, privacy noise is never seeded):

1. Animal-MNIST (10,000 images) -> stratified train (80 %) / held-out test (20 %) split
   (:func:`wildfed_sim.animal_mnist.split_holdout`).
2. Public split: :func:`wildfed_sim.common.demo_data.balanced_public_split` takes ``public_per_class`` training
   images of every class (default 100). No client holds them. The frozen backbone is the public ImageNet
   EfficientNet-Lite0 (:mod:`shared.models.backbone`); a linear head trained on the public split's embeddings,
   non-privately, is reported as the public-data reference (``public_model_test_accuracy``); the federation does not start from it.
3. Validation split: ``val_per_class`` further training images per class (default 70), for tuning only; no client
   holds them, and the test split is never used for tuning.
4. Clients: the remaining training images (the pool), cut into K near-equal IID shards.
5. The backbone maps every image to its 1280-d embedding once (cached). The federated model is the head ``psi``
   (weight (10, 1280), bias (10,): d = 12,810), started at zero (round 0 = the zero head).
6. Round t, client k (N_k records): per-example cross-entropy gradients of the head, clipped to L2 norm C, summed,
   Gaussian noise N(0, (z C)^2 I_d), divided by N_k (the project's :class:`edge_sdk.privacy.ccdp.CCDPMechanism`
   with one category; q = 1, one step per round). z is calibrated for T rounds with
   :func:`shared.privacy.accounting.calibrate_noise_multiplier` (RDP).
7. Server: ``G_t = sum_k N_k g~_k / N`` with ``N = sum_k N_k``, ``avg_delta = -G_t``, then one of the server
   optimizers (:data:`OPTIMIZERS`), all post-processing (no privacy cost).

The pooled simulation (:func:`released_aggregates`, :func:`run_batch`). Because every client releases
``sum_{i in k} clip(g_i) + n_k`` with independent ``n_k ~ N(0, (zC)^2 I)`` and the server weights by N_k,
``G_t = (sum_i clip(g_i) + sum_k n_k) / N`` and ``sum_k n_k ~ N(0, K (zC)^2 I)``: the released aggregate has exactly
the same distribution as one clipped sum over the whole pool plus one Gaussian of std ``sqrt(K) z C``. The
experiment draws it that way (the same clipping, :func:`edge_sdk.privacy.ccdp.clip_factors_from_norms`, and
:class:`~shared.privacy.randomness.SecureRandom` noise), for many configurations at once in float32 matrix
products; ``tests/sim/test_fedsofim_experiment.py`` checks it against the per-client path (:func:`run_federation`).
K enters only through the noise. Each client's privacy is still that of its own release, ``DPSGDEvent(z, 1, 1)``
per round; the ledger records those events (every client, every round) for one reported run per (K, eps): they are
the same for every run of that cell.

Tuning (:func:`tune_grids`): every optimizer separately in every (K, eps) cell on the tuning seeds (never a reported
seed), by validation accuracy (mean of the last 10 rounds, then over tuning seeds), over the grids of
:data:`GRIDS`; a grid whose best point lies on an edge of a widenable axis (the step sizes, rho, tau) is extended by
one decade beyond that edge, up to ``max_widenings`` times per edge; every widening is recorded.

Metrics (reported seeds): test accuracy after round T ("final"), the mean of the last 10 rounds ("last-10"), the
first round that reaches DP-FedGD's final accuracy of the same seed, and paired differences against DP-FedAvgM with
95 % Student-t intervals (:func:`wildfed_sim.common.stats.paired_interval`). For DP-FedSOFIM, ``|M_t|^2`` per
round (to compare with rho). The non-private ceiling is the same head trained by FedGD without noise, tuned the
same way (the clipping stays; K does not matter without noise).

Deviation from the product's transport: the clients are simulated in one process (no MQTT, no gateway processes).

Output (``out_dir``): ``fedsofim.json`` (settings, every tuning score and widening, every reported run's curves,
summary), ``fedsofim.md`` (the tables), ``fedsofim.png`` (test accuracy per round, one panel per (K, eps)),
``ledger.db`` (the ledger); all rewritten after every cell.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.per_example import PerExampleGradients

from wildfed_sim.common.demo_data import balanced_public_split
from wildfed_sim.common.options import opt, parse_list
from wildfed_sim.common.runs import new_run_dir
from wildfed_sim.common.stats import mean_std, paired_interval

__all__ = [
    "LinearHeadGradients", "HeadData", "head_residuals", "per_example_head_gradients", "flatten_head",
    "unflatten_head", "accuracy", "client_private_gradient", "server_pseudo_gradient", "make_optimizer",
    "run_federation", "Pool", "released_aggregates", "run_batch", "Axis", "grid_points", "tune_grids",
    "rounds_to_reach", "summarise_cell", "markdown_tables", "FedSofimSettings", "FedSofimResult",
    "SeedData", "prepare_seed", "run_fedsofim_experiment", "fedsofim_command", "OPTIMIZERS", "GRIDS", "BASELINE",
    "CEILING", "UNIFORM_CATEGORY",
]

UNIFORM_CATEGORY = IUCNCategory.LC
"""The one category every record is in (uniform budget): only the ledger key, it changes nothing else."""
OPTIMIZERS = ("dp-fedgd", "dp-fedavgm", "dp-fedadam", "dp-fedsofim", "dp-fedsofim-m")
"""The compared server optimizers: server SGD, server momentum (FedAvgM), FedAdam, DP-FedSOFIM preconditioning G
(the seed's step) and DP-FedSOFIM preconditioning M."""
BASELINE = "dp-fedavgm"
"""The baseline every paired difference is taken against (the strongest fair baseline, docs/fedsofim.md)."""
CEILING = "fedgd-nonprivate"
"""FedGD without noise (the clipping stays): the non-private ceiling of this head."""
LABELS = {"dp-fedgd": "DP-FedGD", "dp-fedavgm": "DP-FedAvgM", "dp-fedadam": "DP-FedAdam",
          "dp-fedsofim": "DP-FedSOFIM (G)", "dp-fedsofim-m": "DP-FedSOFIM (M)", CEILING: "non-private FedGD"}
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


# ------------------------------------------------------------------------------------------------ metrics

# --------------------------------------------------------------------------- the pooled, batched simulation
@dataclass(frozen=True, eq=False)
class Pool:
    """Every client's records together, with what every round reuses.

    features: float32 (N, F), C-contiguous; labels: int64 (N,); sq_norms: float64 (N,), ``||x_i||^2``.
    """

    features: np.ndarray
    labels: np.ndarray
    sq_norms: np.ndarray

    @classmethod
    def of(cls, data: HeadData) -> "Pool":
        """The pool of ``data`` (features cast to float32 once)."""
        x = np.ascontiguousarray(data.features, dtype=np.float32)
        return cls(x, np.asarray(data.labels, np.int64), np.einsum("ij,ij->i", x, x, dtype=np.float64))

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def released_aggregates(flat: np.ndarray, pool: Pool, *, num_classes: int, clipping_norm: float,
                        noise_std: float, noise: Any) -> np.ndarray:
    """The server's aggregate G for each of P heads: ``(sum_i clip_C(g_i(theta_p)) + N(0, noise_std^2 I_d)) / N``.

    With ``noise_std = sqrt(K) z C`` this has the distribution of ``sum_k N_k g~_k / N`` over K clients that each
    release ``(sum_{i in k} clip_C(g_i) + N(0, (zC)^2 I)) / N_k`` (module docstring). The per-example gradient of
    example i is ``r_i (x) [x_i, 1]`` with ``r_i = softmax - onehot`` (:class:`LinearHeadGradients`), of norm
    ``||r_i|| sqrt(||x_i||^2 + 1)``; the clip factors are the mechanism's own
    (:func:`edge_sdk.privacy.ccdp.clip_factors_from_norms`, with its float32 margin). Matrix products in float32.

    Args:
        flat: float (P, d), each row a head in :func:`flatten_head` order (d = C F + C).
        pool: the records. num_classes: C. clipping_norm: C > 0 (L2). noise_std: >= 0 (0: no noise drawn).
        noise: the noise source (``standard_normal(shape)``), a SecureRandom in every run.

    Returns:
        float64 (P, d).

    Raises:
        ValueError: ``flat``'s width is not ``C F + C``.
    """
    from edge_sdk.privacy.ccdp import clip_factors_from_norms

    flat = np.asarray(flat)
    n, feat = pool.features.shape
    p, c = flat.shape[0], num_classes
    if flat.ndim != 2 or flat.shape[1] != c * feat + c:
        raise ValueError(f"expected heads (P, {c * feat + c}), got {flat.shape}")
    w = flat[:, :c * feat].reshape(p * c, feat).astype(np.float32)
    b = flat[:, c * feat:].reshape(p * c).astype(np.float32)
    r = (pool.features @ w.T).reshape(n, p, c)
    r += b.reshape(1, p, c)
    r -= r.max(axis=2, keepdims=True)
    np.exp(r, out=r)
    r /= r.sum(axis=2, keepdims=True)
    r[np.arange(n), :, pool.labels] -= 1.0                           # softmax - onehot, (N, P, C)
    norms = np.sqrt(np.einsum("npc,npc->np", r, r, dtype=np.float64)) * np.sqrt(pool.sq_norms + 1.0)[:, None]
    r *= clip_factors_from_norms(norms.ravel(), clipping_norm).reshape(n, p, 1)
    gw = r.reshape(n, p * c).T @ pool.features                       # (P C, F)
    out = np.concatenate([gw.reshape(p, c * feat).astype(np.float64), r.sum(axis=0, dtype=np.float64)], axis=1)
    if noise_std > 0:
        out += noise_std * np.asarray(noise.standard_normal((p, out.shape[1])), dtype=np.float64)
    out /= n
    return out


def _accuracies(flat: np.ndarray, data: HeadData, num_classes: int) -> np.ndarray:
    """float64 (P,): top-1 accuracy of each head row on ``data``."""
    n, feat = data.features.shape
    p = flat.shape[0]
    w = flat[:, :num_classes * feat].reshape(p * num_classes, feat).astype(np.float32)
    logits = (np.asarray(data.features, np.float32) @ w.T).reshape(n, p, num_classes)
    logits += flat[:, num_classes * feat:].astype(np.float32).reshape(1, p, num_classes)
    return np.mean(np.argmax(logits, axis=2) == data.labels[:, None], axis=0)


def _momentum_sq(optimizer: Any) -> float | None:
    """``|M|^2`` summed over groups for a DPFedSOFIM, None for any other optimizer."""
    from coordinator.optimizers.fedsofim import DPFedSOFIM

    if not isinstance(optimizer, DPFedSOFIM):
        return None
    return float(sum(float(np.dot(v.astype(np.float64), v.astype(np.float64)))
                     for k, v in optimizer.state_tensors().items() if k.startswith("fedsofim/momentum/")))


def run_batch(optimizers: Sequence[Any], pool: Pool, evaluate_on: Mapping[str, HeadData], *, rounds: int,
              clipping_norm: float, noise_multiplier: float, num_clients: int, noise: Any, num_classes: int,
              before_step: Callable[[int], None] | None = None,
              on_round: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """P independent federations of the zero head, one per optimizer, in lockstep (their gradients share the
    matrix products; each draws its own noise).

    Args:
        optimizers: server optimizers (``step(weights, avg_delta)``), one per federation; P >= 1.
        pool: every client's records. evaluate_on: ``{name: data}``, evaluated at round 0 and after every round.
        noise_multiplier: z of each client's release (0: no noise). num_clients: K (the noise std is sqrt(K) z C).
        before_step: called with t after round t's aggregates are drawn, before any optimizer uses them (the
            ledger records the round there). on_round: called with P after every round (progress).

    Returns:
        Per optimizer ``{"curves": {name: [accuracy after rounds 0..T]}, "momentum_sq": [|M_t|^2, t = 1..T] or
        None, "diverged_round": first round with a non-finite parameter or None}``; a diverged federation's
        accuracies are NaN from that round on.
    """
    p = len(optimizers)
    feat = pool.features.shape[1]
    d = num_classes * feat + num_classes
    flat = np.zeros((p, d), np.float64)
    noise_std = math.sqrt(num_clients) * noise_multiplier * clipping_norm
    out = [{"curves": {k: [] for k in evaluate_on}, "momentum_sq": [] if _momentum_sq(o) is not None else None,
            "diverged_round": None} for o in optimizers]
    alive = np.ones(p, bool)

    def evaluate() -> None:
        for name, data in evaluate_on.items():
            acc = _accuracies(flat, data, num_classes)
            for i in range(p):
                out[i]["curves"][name].append(float(acc[i]) if alive[i] else math.nan)

    evaluate()
    for t in range(1, rounds + 1):
        g = released_aggregates(np.where(alive[:, None], flat, 0.0), pool, num_classes=num_classes,
                                clipping_norm=clipping_norm, noise_std=noise_std, noise=noise)
        if before_step is not None:
            before_step(t)
        for i, opt in enumerate(optimizers):
            if not alive[i]:
                continue
            new = opt.step(unflatten_head(flat[i], num_classes, np.float32), unflatten_head(-g[i], num_classes))
            flat[i] = flatten_head(new)
            if not np.all(np.isfinite(flat[i])):
                alive[i], out[i]["diverged_round"] = False, t
            if out[i]["momentum_sq"] is not None:
                out[i]["momentum_sq"].append(_momentum_sq(opt))
        evaluate()
        if on_round is not None:
            on_round(p)
    return out


# --------------------------------------------------------------------------------------------------- tuning
@dataclass(frozen=True)
class Axis:
    """One hyper-parameter axis of a tuning grid.

    Args:
        name: the hyper-parameter (a key of the grid point). values: the first grid, ascending.
        factor: the ratio between neighbouring values when the axis is widened (> 1); None: never widened.
        per_widening: values added beyond an edge per widening; ``factor ** per_widening`` is one decade.
    """

    name: str
    values: tuple[float, ...]
    factor: float | None = None
    per_widening: int = 1

    def widened(self, edge: str) -> tuple["Axis", list[float]]:
        """This axis with ``per_widening`` more values beyond ``edge`` (``"low"`` or ``"high"``), and those."""
        if self.factor is None:
            raise ValueError(f"axis {self.name} is not widenable")
        sign = -1 if edge == "low" else 1
        at = self.values[0] if edge == "low" else self.values[-1]
        added = [float(f"{at * self.factor ** (sign * j):.6g}") for j in range(1, self.per_widening + 1)]
        return replace(self, values=tuple(sorted(set(self.values) | set(added)))), added


def _log_axis(name: str, lo: int, hi: int, per_decade: int, widen: bool = True) -> Axis:
    """Axis ``10^lo .. 10^hi`` with ``per_decade`` points per decade (rounded to 6 significant digits)."""
    vals = tuple(float(f"{v:.6g}") for v in np.logspace(lo, hi, (hi - lo) * per_decade + 1))
    return Axis(name, vals, 10 ** (1 / per_decade) if widen else None, per_decade)


def grid_points(axes: Sequence[Axis]) -> list[dict[str, float]]:
    """The Cartesian product of the axes' values, as ``{name: value}`` dicts (first axis slowest)."""
    return [dict(zip((a.name for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def _key(point: Mapping[str, float]) -> tuple:
    return tuple(sorted(point.items()))


def tune_grids(score: Callable[[list[tuple[str, dict[str, float]]]], list[float]],
               grids: Mapping[str, Sequence[Axis]], *, max_widenings: int = 2) -> dict[str, dict[str, Any]]:
    """Maximise ``score`` over each method's grid separately, widening a grid while its best point lies on an edge.

    Each pass scores every (method, point) not scored yet in one call of ``score`` (so a caller can batch them),
    then, for every method, each widenable axis on whose lowest or highest value the method's best point lies is
    extended by one decade beyond that edge (:meth:`Axis.widened`), at most ``max_widenings`` times per edge.
    It stops when no grid grows. NaN scores rank lowest; ties go to the point met first.

    Args:
        score: ``[(method, point), ...] -> [score, ...]`` (higher is better).
        grids: ``{method: axes}``. max_widenings: >= 0.

    Returns:
        ``{method: {"best": point, "best_score", "tried": [{**point, "score"}], "widened": [{"axis", "edge",
        "added"}], "on_edge": [axes whose edge the best point still lies on, widenable or not], "axes":
        {name: final values}}}``.
    """
    axes = {m: list(a) for m, a in grids.items()}
    scores: dict[str, dict[tuple, float]] = {m: {} for m in grids}
    points: dict[str, dict[tuple, dict[str, float]]] = {m: {} for m in grids}
    widened: dict[str, list[dict[str, Any]]] = {m: [] for m in grids}
    count: dict[tuple[str, str, str], int] = {}
    best: dict[str, dict[str, float]] = {}
    pending = list(grids)
    while pending:
        todo = [(m, pt) for m in pending for pt in grid_points(axes[m]) if _key(pt) not in scores[m]]
        if todo:
            for (m, pt), s in zip(todo, score(todo)):
                scores[m][_key(pt)], points[m][_key(pt)] = float(s), pt
        grown = []
        for m in pending:
            current = [_key(pt) for pt in grid_points(axes[m])]
            k = max(current, key=lambda key: -math.inf if math.isnan(scores[m][key]) else scores[m][key])
            best[m] = points[m][k]
            for i, ax in enumerate(axes[m]):
                if ax.factor is None or len(ax.values) < 2:
                    continue
                for edge, at in (("low", ax.values[0]), ("high", ax.values[-1])):
                    if best[m][ax.name] == at and count.get((m, ax.name, edge), 0) < max_widenings:
                        axes[m][i], added = axes[m][i].widened(edge)
                        count[(m, ax.name, edge)] = count.get((m, ax.name, edge), 0) + 1
                        widened[m].append({"axis": ax.name, "edge": edge, "added": added})
                        grown.append(m)
        pending = sorted(set(grown), key=list(grids).index)
    result = {}
    for m in grids:
        b = best[m]
        on_edge = [a.name for a in axes[m] if len(a.values) > 1 and b[a.name] in (a.values[0], a.values[-1])]
        result[m] = {"best": b, "best_score": scores[m][_key(b)],
                     "tried": [{**points[m][k], "score": s} for k, s in scores[m].items()],
                     "widened": widened[m], "on_edge": on_edge, "axes": {a.name: list(a.values) for a in axes[m]}}
    return result


GRIDS: dict[str, tuple[Axis, ...]] = {
    "dp-fedgd": (_log_axis("eta", -1, 1, 4),),
    "dp-fedavgm": (_log_axis("eta_eff", -1, 1, 2), Axis("momentum", (0.5, 0.7, 0.8, 0.9, 0.95))),
    "dp-fedadam": (_log_axis("eta", -3, -1, 2), _log_axis("tau", -5, -1, 1), Axis("beta1", (0.9,)),
                   Axis("beta2", (0.99,))),
    "dp-fedsofim": (_log_axis("eta_over_rho", -1, 1, 2), _log_axis("rho", -4, 0, 1), Axis("beta", (0.9,))),
    "dp-fedsofim-m": (_log_axis("eta_over_rho", -1, 1, 2), _log_axis("rho", -4, 0, 1), Axis("beta", (0.9,))),
    CEILING: (_log_axis("eta", -1, 1, 4),),
}
"""The first grids (25 points for each method with two axes; DP-FedGD and the ceiling have one axis, eta over two
decades at quarter-decade spacing, 9 points). Step sizes, rho and tau widen by one decade per edge hit; the server
momentum of DP-FedAvgM and the betas stay fixed lists (beta = 0.9 for DP-FedSOFIM, as the seed; Reddi et al.'s
beta1 = 0.9, beta2 = 0.99 for FedAdam)."""


# ------------------------------------------------------------------------------------------------ metrics
def rounds_to_reach(curve: Sequence[float], target: float) -> int | None:
    """The first round r (index into ``curve``, round 0 = initial model) with ``curve[r] >= target``; None if
    never."""
    for r, v in enumerate(curve):
        if v >= target:
            return r
    return None


def _last10(curve: Sequence[float]) -> float:
    return float(np.mean(curve[-10:]))


def summarise_cell(runs: Sequence[Mapping[str, Any]], tuning: Mapping[str, Any], methods: Sequence[str],
                   baseline: str = BASELINE) -> dict[str, Any]:
    """One (K, eps) cell's summary over its reported seeds.

    Args:
        runs: rows ``{"seed", "optimizer", "test": curve, "momentum_sq": [...] or None, ...}`` of one cell.
        tuning: :func:`tune_grids`' result for the cell (``{method: {"best", "tried", ...}}``).
        methods: the optimizers, in table order. baseline: the method paired differences are taken against.

    Returns:
        ``{method: {"final", "last10" (mean_std), "rounds_to_gd_final" (mean_std of the reached ones),
        "not_reached", "hp", "eta", "grid_spread", "seed_std_last10", "momentum_sq" (median over rounds and
        seeds, and at round T), "paired_final", "paired_last10" (paired_interval vs baseline; None for the
        baseline itself)}, "round0": mean test accuracy of the zero head}``.
    """
    by = {(r["optimizer"], r["seed"]): r for r in runs}
    seeds = sorted({s for _, s in by})
    out: dict[str, Any] = {"round0": mean_std([by[(methods[0], s)]["test"][0] for s in seeds
                                               if (methods[0], s) in by])}
    for m in methods:
        curves = {s: by[(m, s)]["test"] for s in seeds if (m, s) in by}
        entry: dict[str, Any] = {"final": mean_std([c[-1] for c in curves.values()]),
                                 "last10": mean_std([_last10(c) for c in curves.values()])}
        if "dp-fedgd" in methods:
            reached = [rounds_to_reach(c, by[("dp-fedgd", s)]["test"][-1]) for s, c in curves.items()
                       if ("dp-fedgd", s) in by]
            entry["rounds_to_gd_final"] = mean_std(reached)
            entry["not_reached"] = sum(r is None for r in reached)
        t = tuning.get(m, {})
        if t:
            entry["hp"] = t["best"]
            entry["eta"] = step_size(m, t["best"])
            finite = [x["score"] for x in t["tried"] if not math.isnan(x["score"])]
            entry["grid_spread"] = max(finite) - min(finite) if finite else None
            entry["widened"] = t["widened"]
            entry["on_edge"] = t["on_edge"]
            entry["points"] = len(t["tried"])
        entry["seed_std_last10"] = entry["last10"]["std"]
        msq = [by[(m, s)].get("momentum_sq") for s in curves]
        if msq and all(x for x in msq):
            entry["momentum_sq"] = {"median": float(np.median(np.concatenate(msq))),
                                    "final": float(np.mean([x[-1] for x in msq]))}
        if m != baseline and all((baseline, s) in by for s in curves) and len(curves) >= 1:
            base = {s: by[(baseline, s)]["test"] for s in curves}
            entry["paired_final"] = paired_interval([c[-1] for c in curves.values()],
                                                    [base[s][-1] for s in curves])
            entry["paired_last10"] = paired_interval([_last10(c) for c in curves.values()],
                                                     [_last10(base[s]) for s in curves])
        out[m] = entry
    return out


def _pct(stat: Mapping[str, Any] | None) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    return f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}"


def _ci(iv: Mapping[str, Any] | None) -> str:
    if not iv:
        return "-"
    if not math.isfinite(iv["low"]):
        return f"{100 * iv['mean']:+.1f} (one seed)"
    return f"{100 * iv['mean']:+.1f} [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}]"


def _hp(m: str, e: Mapping[str, Any]) -> str:
    hp = e.get("hp")
    if not hp:
        return "-"
    eta = f"eta {e['eta']:.3g}"
    extra = {"dp-fedavgm": f", mu {hp.get('momentum', 0):g}", "dp-fedadam": f", tau {hp.get('tau', 0):g}",
             "dp-fedsofim": f", rho {hp.get('rho', 0):g}", "dp-fedsofim-m": f", rho {hp.get('rho', 0):g}"}
    notes = []
    if e.get("widened"):
        notes.append("widened " + ", ".join(f"{w['axis']} {w['edge']}" for w in e["widened"]))
    if e.get("on_edge"):
        notes.append("edge: " + ", ".join(e["on_edge"]))
    return eta + extra.get(m, "") + (f" ({'; '.join(notes)})" if notes else "")


def markdown_tables(cells: Sequence[Mapping[str, Any]], methods: Sequence[str],
                    ceiling: Mapping[str, Any] | None) -> str:
    """The experiment's tables (GitHub Markdown): accuracy, paired differences vs the baseline, hyper-parameters,
    rounds to reach DP-FedGD's final accuracy, and ``|M|^2`` vs rho with the grid's spread vs the seed spread.

    Args:
        cells: ``{"clients", "epsilon", "noise_multiplier", "spent_epsilon", "summary": summarise_cell(...)}``.
        methods: the optimizers in column order. ceiling: the non-private ceiling's summary entry (or None).
    """
    ceil = _pct(ceiling["last10"]) if ceiling else "-"
    lab = [LABELS[m] for m in methods]
    out = ["**Accuracy** (test, %, mean ± sample std over the reported seeds; each cell: last-10-round mean / "
           "final round)\n", "| K | eps (target / ledger) | z | round 0 | " + " | ".join(lab)
           + " | non-private (last-10) |", "|" + "---|" * (5 + len(methods))]
    for c in cells:
        s = c["summary"]
        spent = f"{c['spent_epsilon']:.3f}" if c.get("spent_epsilon") is not None else "-"
        out.append(f"| {c['clients']} | {c['epsilon']:g} / {spent} | {c['noise_multiplier']:.2f} | "
                   f"{_pct(s['round0'])} | " + " | ".join(f"{_pct(s[m]['last10'])} / {_pct(s[m]['final'])}"
                                                          for m in methods) + f" | {ceil} |")
    others = [m for m in methods if m != BASELINE]
    out += ["", f"**Paired difference against {LABELS[BASELINE]}** (points, mean [95 % t-interval] over the "
            "reported seeds; last-10-round mean, then final round)\n",
            "| K | eps | " + " | ".join(f"{LABELS[m]} last-10" for m in others) + " | "
            + " | ".join(f"{LABELS[m]} final" for m in others) + " |", "|" + "---|" * (2 + 2 * len(others))]
    for c in cells:
        s = c["summary"]
        out.append(f"| {c['clients']} | {c['epsilon']:g} | "
                   + " | ".join(_ci(s[m].get("paired_last10")) for m in others) + " | "
                   + " | ".join(_ci(s[m].get("paired_final")) for m in others) + " |")
    out += ["", "**Chosen hyper-parameters** (tuning seeds, validation last-10 mean; eta = the optimizer's own "
            "step size; widenings and points still on an edge in brackets)\n",
            "| K | eps | " + " | ".join(lab) + " |", "|" + "---|" * (2 + len(methods))]
    for c in cells:
        s = c["summary"]
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(_hp(m, s[m]) for m in methods) + " |")
    out += ["", "**Rounds to reach DP-FedGD's final accuracy** (same seed; mean ± std over the seeds that reach it, "
            "and how many never do)\n", "| K | eps | " + " | ".join(lab) + " |", "|" + "---|" * (2 + len(methods))]
    for c in cells:
        s = c["summary"]
        row = []
        for m in methods:
            r = s[m].get("rounds_to_gd_final")
            txt = "-" if not r or r["mean"] is None else f"{r['mean']:.1f} ± {r['std']:.1f}"
            row.append(txt + (f" ({s[m]['not_reached']} never)" if s[m].get("not_reached") else ""))
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(row) + " |")
    sofims = [m for m in methods if m.startswith("dp-fedsofim")]
    out += ["", "**Does the preconditioner act? Does the protocol discriminate?** |M|^2: median over rounds and "
            "seeds / at round T, at the chosen point, against its rho; spread: best minus worst grid point on "
            "validation (points) against the seed-to-seed std of the reported last-10 accuracy (points)\n",
            "| K | eps | " + " | ".join(f"{LABELS[m]} |M|^2 (rho)" for m in sofims) + " | "
            + " | ".join(f"{LABELS[m]} spread / seed std" for m in methods) + " |",
            "|" + "---|" * (2 + len(sofims) + len(methods))]
    for c in cells:
        s = c["summary"]
        msq = []
        for m in sofims:
            q = s[m].get("momentum_sq")
            msq.append("-" if not q else f"{q['median']:.2g} / {q['final']:.2g} ({s[m]['hp']['rho']:g})")
        spread = []
        for m in methods:
            g, sd = s[m].get("grid_spread"), s[m].get("seed_std_last10")
            spread.append("-" if g is None or sd is None else f"{100 * g:.1f} / {100 * sd:.1f}")
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(msq + spread) + " |")
    return "\n".join(out) + "\n"


def _plot(cells: Sequence[Mapping[str, Any]], methods: Sequence[str], ceiling: Mapping[str, Any] | None,
          path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({c["clients"] for c in cells})
    epss = sorted({c["epsilon"] for c in cells})
    fig, axes = plt.subplots(len(ks), len(epss), figsize=(3.2 * len(epss), 2.9 * len(ks)), squeeze=False,
                             sharey=True)
    colours = dict(zip(OPTIMIZERS, ("tab:blue", "tab:green", "tab:purple", "tab:red", "tab:orange")))
    for c in cells:
        ax = axes[ks.index(c["clients"])][epss.index(c["epsilon"])]
        for m in methods:
            m_curve = np.asarray(c["mean_curves"][m])
            if m_curve.size:
                ax.plot(np.arange(m_curve.size), 100 * m_curve, color=colours.get(m, "k"), lw=1.1, label=LABELS[m])
        if ceiling:
            ax.axhline(100 * ceiling["last10"]["mean"], color="k", ls="--", lw=0.8, label="non-private (last-10)")
        ax.set_title(f"K={c['clients']}, eps={c['epsilon']:g}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("test accuracy %", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- the experiment
@dataclass
class FedSofimSettings:
    """The experiment's settings (module docstring).

    ``seeds``: reported seeds (the protocol asks for at least 5); ``tuning_seeds``: the seeds the grids are run on
    (disjoint from ``seeds``); ``optimizers``: a subset of :data:`OPTIMIZERS`; ``max_widenings``: grid widenings
    per edge of an axis; ``ledger``: record one reported run per cell in ``ledger.db``.

    Raises:
        ConfigError: a value out of range (names the field and the fix).
    """

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    tuning_seeds: tuple[int, ...] = (101, 103)
    clients: tuple[int, ...] = (20, 100)
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0)
    optimizers: tuple[str, ...] = OPTIMIZERS
    rounds: int = 100
    max_widenings: int = 2
    target_delta: float = 1e-5
    clipping_norm: float = 1.0
    public_per_class: int = 100
    val_per_class: int = 70
    test_fraction: float = 0.2
    pretrain_epochs: int = 30
    pretrain_batch_size: int = 64
    pretrain_learning_rate: float = 0.1
    ledger: bool = True
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        checks = [("seeds", bool(self.seeds), "e.g. --seeds 0,1,2,3,4"),
                  ("tuning_seeds", bool(self.tuning_seeds) and not set(self.seeds) & set(self.tuning_seeds),
                   "seeds to tune on that are not reported, e.g. --tuning-seeds 101,103"),
                  ("clients", bool(self.clients) and all(isinstance(k, int) and k >= 1 for k in self.clients),
                   "positive integers, e.g. --clients 20,100"),
                  ("epsilons", bool(self.epsilons) and all(0 < e < math.inf for e in self.epsilons),
                   "positive numbers, e.g. --epsilons 0.5,1,2,5,10"),
                  ("optimizers", bool(self.optimizers) and set(self.optimizers) <= set(OPTIMIZERS),
                   f"some of {','.join(OPTIMIZERS)}"),
                  ("rounds", isinstance(self.rounds, int) and self.rounds >= 1, "e.g. --rounds 100"),
                  ("max_widenings", isinstance(self.max_widenings, int) and self.max_widenings >= 0, "e.g. 2"),
                  ("target_delta", 0 < self.target_delta < 1, "e.g. 1e-5"),
                  ("clipping_norm", self.clipping_norm > 0, "e.g. 1.0"),
                  ("public_per_class", self.public_per_class >= 1, "e.g. 100"),
                  ("val_per_class", self.val_per_class >= 1, "e.g. 70"),
                  ("pretrain_epochs", self.pretrain_epochs >= 1, "e.g. 30")]
        for name, ok, fix in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is out of range", field=name, fix=fix)
        self.optimizers = tuple(m for m in OPTIMIZERS if m in self.optimizers)


@dataclass
class FedSofimResult:
    """What :func:`run_fedsofim_experiment` produced (``cells`` as :func:`markdown_tables` takes them)."""

    out_dir: Path
    cells: list[dict[str, Any]] = field(default_factory=list)
    ceiling: dict[str, Any] = field(default_factory=dict)
    seeds_info: dict[int, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass(frozen=True, eq=False)
class SeedData:
    """One seed's frozen features: the client pool, the validation and the test split, and facts about them."""

    pool: HeadData
    val: HeadData
    test: HeadData
    info: dict[str, Any]

    def clients(self, k: int, seed: int) -> list[HeadData]:
        """The pool shuffled (``default_rng([seed, k, 0x434C49])``) and cut into ``k`` near-equal IID shards."""
        if k > len(self.pool):
            raise ConfigError(f"{k} clients for {len(self.pool)} records", field="clients",
                              fix="use fewer clients")
        order = np.random.default_rng([seed, k, 0x434C49]).permutation(len(self.pool))
        return [HeadData(self.pool.features[i], self.pool.labels[i]) for i in np.array_split(order, k)]


def prepare_seed(settings: FedSofimSettings, seed: int) -> SeedData:
    """Steps 1-5 of the protocol for one seed: splits, the public-split reference head, backbone embeddings."""
    from wildfed_sim.animal_mnist import NUM_CLASSES, fetch_animal_mnist, split_holdout
    from wildfed_sim.evaluation import train_centralised

    t0 = time.monotonic()
    train, test = split_holdout(fetch_animal_mnist(), settings.test_fraction, seed=seed)
    public = balanced_public_split(train.labels, settings.public_per_class, seed=seed)
    rest = np.setdiff1d(np.arange(len(train)), public)
    rng = np.random.default_rng([seed, 0x56414C])
    val = np.sort(np.concatenate([rng.choice(rest[train.labels[rest] == c], settings.val_per_class, replace=False)
                                  for c in range(NUM_CLASSES)]))
    pool = np.setdiff1d(rest, val)
    from wildfed_sim.embeddings import embed_grayscale

    features = embed_grayscale(train.images, train.source_indices)  # the frozen public backbone, cached
    weights = train_centralised(features[public], train.labels[public], num_classes=NUM_CLASSES,
                                epochs=settings.pretrain_epochs, batch_size=settings.pretrain_batch_size,
                                learning_rate=settings.pretrain_learning_rate, seed=seed)

    def data(images: np.ndarray, labels: np.ndarray, sources: np.ndarray) -> HeadData:
        return HeadData(embed_grayscale(images, sources), np.asarray(labels, np.int64))

    test_data = data(test.images, test.labels, test.source_indices)
    info = {"train": len(train), "test": len(test), "public": int(len(public)), "val": int(len(val)),
            "client_pool": int(len(pool)),
            "public_model_test_accuracy": accuracy({WEIGHT: weights["psi.weight"], BIAS: weights["psi.bias"]},
                                                   test_data),
            "prepare_s": time.monotonic() - t0}
    return SeedData(pool=HeadData(features[pool], np.asarray(train.labels[pool], np.int64)),
                    val=HeadData(features[val], np.asarray(train.labels[val], np.int64)), test=test_data, info=info)



def _caption(settings: FedSofimSettings, result: FedSofimResult) -> str:
    info = next(iter(result.seeds_info.values()), {})
    pub = statistics.fmean(v["public_model_test_accuracy"] for v in result.seeds_info.values()) \
        if result.seeds_info else math.nan
    return (f"Frozen public EfficientNet-Lite0 embeddings; linear head (d = 12,810) federated from zero over "
            f"{info.get('client_pool', '?')} records in IID shards; {settings.rounds} rounds of full-batch DP "
            f"gradient descent per client (q = 1, clip C = {settings.clipping_norm:g}, z calibrated by RDP for "
            f"{settings.rounds} rounds, delta = {settings.target_delta:g}). Every optimizer tuned separately in "
            f"every cell on tuning seeds {list(settings.tuning_seeds)} by validation accuracy (last-10 mean); "
            f"reported on seeds {list(settings.seeds)} on the held-out test split ({info.get('test', '?')} "
            f"images). Round 0 = the zero head. Non-private = FedGD without noise, tuned the same way. The "
            f"public-data reference head (trained on the {info.get('public', '?')} public images, not a "
            f"federation) scores {100 * pub:.1f} % on the test split. eps ledger = the RDP spend the ledger "
            f"holds for one reported run of the cell (max over its clients).")


def _write(settings: FedSofimSettings, result: FedSofimResult) -> None:
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (result.out_dir / "fedsofim.json").write_text(json.dumps(
        {"settings": settings_json, "grids": {m: [asdict(a) for a in GRIDS[m]] for m in GRIDS},
         "seeds": {str(k): v for k, v in result.seeds_info.items()}, "ceiling": result.ceiling,
         "cells": result.cells, "elapsed_s": result.elapsed_s}, indent=1))
    ceiling = result.ceiling.get("summary", {}).get(CEILING)
    (result.out_dir / "fedsofim.md").write_text(
        "# DP-FedSOFIM (on G and on M) vs DP-FedGD, DP-FedAvgM, DP-FedAdam on Animal-MNIST (frozen public "
        f"backbone, linear head)\n\n{_caption(settings, result)}\n\n"
        + markdown_tables(result.cells, settings.optimizers, ceiling)
        + f"\nWall time: {result.elapsed_s:.0f} s.\n")
    if result.cells:
        _plot(result.cells, settings.optimizers, ceiling, result.out_dir / "fedsofim.png",
              f"Animal-MNIST linear head, test accuracy per round (mean over {len(settings.seeds)} seeds)")


def _ledger_recorder(ledger: Any, prefix: str, k: int, z: float) -> Callable[[int], None]:
    """A ``before_step`` that records every client's ``DPSGDEvent(z, 1, 1)`` of round t (site ids
    ``f"{prefix}client{i:03d}"``) before the server uses the round's aggregate."""
    event = DPSGDEvent(float(z), 1.0, 1)

    def record(t: int) -> None:
        for i in range(k):
            ledger.record_round(f"{prefix}client{i:03d}", t, {UNIFORM_CATEGORY: event})

    return record


def run_fedsofim_experiment(settings: FedSofimSettings, console: Any = None) -> FedSofimResult:
    """The whole protocol: the non-private ceiling, then per (K, eps) cell: tune every optimizer on the tuning
    seeds (:func:`tune_grids`), run the chosen points on the reported seeds, summarise; fedsofim.json/.md/.png
    are rewritten after every cell."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store
    from shared.privacy.accounting import calibrate_noise_multiplier
    from shared.privacy.randomness import SecureRandom

    console = console or Console()
    t0 = time.monotonic()
    out_dir = new_run_dir(settings.out_dir, "fedsofim")
    result = FedSofimResult(out_dir=out_dir)
    store = Store(f"sqlite:///{out_dir / 'ledger.db'}", out_dir / "data") if settings.ledger else None
    ledger = PrivacyLedger(store, target_delta=settings.target_delta) if store is not None else None
    z_of = {eps: calibrate_noise_multiplier(target_epsilon=eps, target_delta=settings.target_delta,
                                            sampling_rate=1.0, steps=settings.rounds) for eps in settings.epsilons}
    console.log("noise multipliers (RDP, q = 1, T = %d): %s" % (settings.rounds,
                                                              {e: round(z, 3) for e, z in z_of.items()}))
    data: dict[int, tuple[SeedData, Pool]] = {}
    for seed in settings.tuning_seeds + settings.seeds:
        sd = prepare_seed(settings, seed)
        data[seed] = (sd, Pool.of(sd.pool))
        result.seeds_info[seed] = sd.info
    console.log(f"prepared seeds {list(data)} ({time.monotonic() - t0:.0f} s)")
    methods = settings.optimizers
    n_tune, n_rep, rounds = len(settings.tuning_seeds), len(settings.seeds), settings.rounds
    first_pass = sum(len(grid_points(GRIDS[m])) for m in methods)
    total = rounds * ((len(grid_points(GRIDS[CEILING])) * n_tune + n_rep)
                      + len(settings.clients) * len(settings.epsilons) * (first_pass * n_tune + len(methods) * n_rep))

    def run(opts: list[Any], seed: int, z: float, k: int, evaluate: tuple[str, ...], **kw: Any) -> list[dict]:
        sd, pool = data[seed]
        return run_batch(opts, pool, {name: getattr(sd, name) for name in evaluate}, rounds=rounds,
                         clipping_norm=settings.clipping_norm, noise_multiplier=z, num_clients=k,
                         noise=SecureRandom(), num_classes=10, on_round=lambda p: progress.advance(task, p), **kw)

    def tune(grids: Mapping[str, Sequence[Axis]], z: float, k: int) -> dict[str, Any]:
        calls = [0]

        def score(todo: list[tuple[str, dict[str, float]]]) -> list[float]:
            if calls[0]:
                progress.update(task, total=progress.tasks[0].total + len(todo) * n_tune * rounds)
            calls[0] += 1
            per_seed = []
            for seed in settings.tuning_seeds:
                res = run([make_optimizer(m, pt) for m, pt in todo], seed, z, k, ("val",))
                per_seed.append([_last10(r["curves"]["val"]) for r in res])
            return [float(np.mean(col)) for col in zip(*per_seed)]

        return tune_grids(score, grids, max_widenings=settings.max_widenings)

    def report(chosen: Mapping[str, dict[str, float]], z: float, k: int, prefix: str | None) -> list[dict]:
        rows = []
        for seed in settings.seeds:
            before = None
            if ledger is not None and prefix is not None and seed == settings.seeds[0]:
                before = _ledger_recorder(ledger, f"{prefix}seed{seed}/{list(chosen)[0]}/", k, z)
            res = run([make_optimizer(m, hp) for m, hp in chosen.items()], seed, z, k, ("test", "val"),
                      before_step=before)
            for (m, hp), r in zip(chosen.items(), res):
                rows.append({"seed": seed, "optimizer": m, "hyper_parameters": hp, "eta": step_size(m, hp),
                             "test": r["curves"]["test"], "val": r["curves"]["val"],
                             "momentum_sq": r["momentum_sq"], "diverged_round": r["diverged_round"]})
        return rows

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("configuration-rounds", total=total)
        tuning = tune({CEILING: GRIDS[CEILING]}, 0.0, 1)
        runs = report({CEILING: tuning[CEILING]["best"]}, 0.0, 1, None)
        result.ceiling = {"tuning": tuning, "runs": runs, "summary": summarise_cell(runs, tuning, (CEILING,))}
        console.log(f"non-private ceiling: eta {tuning[CEILING]['best']['eta']:g}, test last-10 "
                    f"{_pct(result.ceiling['summary'][CEILING]['last10'])} %")
        for k in settings.clients:
            for eps in settings.epsilons:
                cell_t0 = time.monotonic()
                z = z_of[eps]
                tuning = tune({m: GRIDS[m] for m in methods}, z, k)
                prefix = f"K{k}/eps{eps:g}/"
                runs = report({m: tuning[m]["best"] for m in methods}, z, k, prefix)
                spent = None
                if ledger is not None:
                    spent = max(ledger.spent(f"{prefix}seed{settings.seeds[0]}/{methods[0]}/client{i:03d}",
                                             UNIFORM_CATEGORY) for i in range(k))
                summary = summarise_cell(runs, tuning, methods)
                mean_curves = {m: np.nanmean([r["test"] for r in runs if r["optimizer"] == m], axis=0).tolist()
                               for m in methods}
                result.cells.append({"clients": k, "epsilon": eps, "noise_multiplier": z, "spent_epsilon": spent,
                                     "tuning": tuning, "runs": runs, "summary": summary,
                                     "mean_curves": mean_curves, "elapsed_s": time.monotonic() - cell_t0})
                result.elapsed_s = time.monotonic() - t0
                _write(settings, result)
                best = {m: f"{_pct(summary[m]['last10'])}" for m in methods}
                console.log(f"K={k} eps={eps:g}: test last-10 {best} ({time.monotonic() - cell_t0:.0f} s)")
    if store is not None:
        store.dispose()
    result.elapsed_s = time.monotonic() - t0
    _write(settings, result)
    console.log(f"written {out_dir / 'fedsofim.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result


# --------------------------------------------------------------------------------------------------- the CLI
def fedsofim_command(
    seeds: str = opt("0,1,2,3,4", "comma-separated reported seeds (data splits; noise is never seeded)"),
    tuning_seeds: str = opt("101,103", "comma-separated tuning seeds (grids run here only; not reported)"),
    clients: str = opt("20,100", "comma-separated client counts K"),
    epsilons: str = opt("0.5,1,2,5,10", "comma-separated target epsilons (each client's records, delta below)"),
    optimizers: str = opt(",".join(OPTIMIZERS), "comma-separated server optimizers to compare"),
    rounds: int = opt(100, "federated rounds T (one full-batch DP step per client per round)"),
    max_widenings: int = opt(2, "times a grid is widened by a decade beyond an edge its best point lies on"),
    out: Path | None = opt(None, "output folder (default runs/fedsofim-<UTC time>)"),
    target_delta: float = opt(1e-5, "delta of every guarantee"),
    clipping_norm: float = opt(1.0, "L2 clipping norm C of per-example head gradients"),
    public_per_class: int = opt(100, "public images per class (held by no client; the reference head)"),
    val_per_class: int = opt(70, "validation images per class (tuning only; held by no client)"),
    pretrain_epochs: int = opt(30, "epochs of the non-private reference head on the public split's embeddings"),
    ledger: bool = opt(True, "record one reported run per cell (every client, every round) in ledger.db",
                       "--ledger/--no-ledger"),
) -> None:
    """DP-FedSOFIM (preconditioning G or M) vs DP-FedGD, DP-FedAvgM and DP-FedAdam: frozen public
    EfficientNet-Lite0 backbone, linear head federated with full-batch DP gradient descent per client; every
    optimizer tuned per (K, eps) on tuning seeds, reported on other seeds with paired intervals against DP-FedAvgM.
    Writes fedsofim.json, .md, .png (docs/fedsofim.md gives the measured wall time)."""
    from rich.console import Console

    settings = FedSofimSettings(
        seeds=parse_list(seeds, int, "seeds", "0,1,2,3,4"),
        tuning_seeds=parse_list(tuning_seeds, int, "tuning-seeds", "101,103"),
        clients=parse_list(clients, int, "clients", "20,100"),
        epsilons=parse_list(epsilons, float, "epsilons", "0.5,1,2,5,10"),
        optimizers=parse_list(optimizers, str, "optimizers", ",".join(OPTIMIZERS)), rounds=rounds,
        max_widenings=max_widenings, target_delta=target_delta, clipping_norm=clipping_norm,
        public_per_class=public_per_class, val_per_class=val_per_class, pretrain_epochs=pretrain_epochs,
        ledger=ledger, out_dir=out)
    run_fedsofim_experiment(settings, console=Console())
