"""The pooled, batched simulation of the DP-FedSOFIM experiment (:mod:`wildfed_sim.fedsofim`).

Every client's records in one :class:`Pool`; the server's released aggregate drawn for many heads at once as one
clipped sum over the pool plus one Gaussian of std ``sqrt(K) z C`` (:func:`released_aggregates`, the same
distribution as K clients' separate releases); and P federations run in lockstep (:func:`run_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wildfed_sim.fedsofim_head import HeadData, flatten_head, unflatten_head


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
