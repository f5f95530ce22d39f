"""The federation's head trained centrally on frozen embeddings, many folds and settings at once, for the backbone
comparison (``real_photo_backbones.py``): nested cross-validation and paired comparisons.

The model is ``shared.models.head`` head only (``adapter_width`` 0: ``psi``, a linear layer on the 1280-d embedding),
zero-initialised as ``shared.models.head.initial_weights`` does, trained as a gateway trains it without privacy:
full-batch gradient descent on the mean cross-entropy, with an L2 ``weight_decay`` on every parameter as
``torch.optim.SGD`` applies it. :func:`train_many` runs M such models side by side (one per training set and
setting). Zero-initialised gradient descent keeps each model's weights in the span of its training rows,
``W = A X`` (the gradient is a sum of rows of X, and weight decay only scales W), so the models are trained in that
form on the Gram matrix ``X X^T`` (N x N) instead of the 1280-d embeddings: the same iterates in exact arithmetic,
at a cost independent of the embedding width. :func:`self_check` compares it with ``ena24_loo.train_head`` (one
model, ``torch.optim.SGD`` on the embeddings) before any number is reported.

Tuning (:func:`nested_scores`): for each held-out fold, every setting of :data:`GRID` is scored by leave-one-out on
the training folds alone (one training photo held out at a time); the setting with the most inner-correct photos
wins (ties: the lower mean inner cross-entropy, then the earlier setting); it is refitted on all training folds and
names the held-out photos. The held-out fold never takes part in the choice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Setting", "GRID", "train_many", "self_check", "nested_scores", "mcnemar_exact"]


@dataclass(frozen=True)
class Setting:
    """One point of the tuning grid: learning rate, full-batch steps, weight decay."""

    lr: float
    steps: int
    weight_decay: float


#: 4 learning rates over three decades (the squared norm of an embedding is about 300 to 1,300 depending on the
#: backbone and size, so one step moves a logit by about lr x 300-1300) x 3 step counts x 2 weight decays, 24
#: settings; the same grid for every backbone.
LRS, STEPS, WEIGHT_DECAYS = (0.0003, 0.003, 0.03, 0.3), (30, 100, 300), (0.0, 0.01)
GRID: tuple[Setting, ...] = tuple(Setting(lr, st, wd) for lr, wd, st in itertools.product(LRS, WEIGHT_DECAYS, STEPS))


def train_many(gram: np.ndarray, y: np.ndarray, masks: np.ndarray, num_classes: int, lrs: np.ndarray,
               weight_decays: np.ndarray, snapshots: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Train M heads at once, model m on the rows ``masks[m]`` with ``lrs[m]`` and ``weight_decays[m]``, in the
    span form ``W = A X`` (module docstring).

    Args:
        gram: float (N, N) ``X X^T`` of the embeddings X (N, D). y: int (N,) labels in [0, num_classes).
        masks: bool (M, N), each row non-empty. lrs, weight_decays: float (M,). snapshots: step counts to keep.

    Returns:
        ``{steps: (A float64 (M, K, N), b float64 (M, K))}``: model m's weights are ``A[m] @ X`` and ``b[m]``.
    """
    import torch

    g = torch.from_numpy(np.asarray(gram, np.float64))
    onehot = torch.nn.functional.one_hot(torch.from_numpy(np.asarray(y, np.int64)), num_classes).double()
    m = torch.from_numpy(np.asarray(masks, np.float64))
    weight = m / m.sum(dim=1, keepdim=True)                                  # (M, N): the mean over own rows
    lr = torch.from_numpy(np.asarray(lrs, np.float64))[:, None]
    wd = torch.from_numpy(np.asarray(weight_decays, np.float64))[:, None]
    a = torch.zeros(len(m), num_classes, len(g), dtype=torch.float64)
    b = torch.zeros(len(m), num_classes, dtype=torch.float64)
    out = {}
    for step in range(1, max(snapshots) + 1):
        logits = (a @ g).transpose(1, 2) + b[:, None, :]                    # (M, N, K) = X W^T + b
        d = (torch.softmax(logits, dim=2) - onehot[None]) * weight[:, :, None]  # d(mean CE)/d(logits)
        # W <- W - lr (d^T X + wd W), i.e. A <- (1 - lr wd) A - lr d^T; b likewise
        a = (1 - lr * wd)[:, :, None] * a - lr[:, :, None] * d.transpose(1, 2)
        b = (1 - lr * wd) * b - lr * d.sum(dim=1)
        if step in snapshots:
            out[step] = (a.numpy().copy(), b.numpy().copy())
    return out


def _logits(a: np.ndarray, b: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """(M, N, K) logits of every row for models in span form."""
    return np.einsum("mkn,nj->mjk", a, gram) + b[:, None, :]


def self_check(x: np.ndarray, y: np.ndarray, num_classes: int) -> float:
    """Largest |difference| between :func:`train_many` and ``ena24_loo.train_head`` (``torch.optim.SGD`` on the
    embeddings, float32) in the logits of ``x`` after 30 steps at lr 0.003 with weight decay 0.01 (two models: all
    rows, all but the first)."""
    from ena24_loo import train_head

    from edge_sdk.inference.classifier import head_logits

    x64 = np.asarray(x, np.float64)
    masks = np.ones((2, len(y)), bool)
    masks[1, 0] = False
    a, b = train_many(x64 @ x64.T, y, masks, num_classes, np.full(2, 0.003), np.full(2, 0.01), [30])[30]
    ours = _logits(a, b, x64 @ x64.T)
    worst = 0.0
    for i in range(2):
        ref = train_head(x[masks[i]].astype(np.float32), y[masks[i]], num_classes, adapter_width=0, steps=30,
                         lr=0.003, seed=0, weight_decay=0.01)
        worst = max(worst, float(np.abs(head_logits(ref, x) - ours[i]).max()))
    return worst


def _fit_grid(gram: np.ndarray, y: np.ndarray, masks: np.ndarray, num_classes: int):
    """Logits (G, F, N, K) of every setting for every training mask (F rows), all N rows scored."""
    pairs = [(lr, wd) for lr, wd in itertools.product(LRS, WEIGHT_DECAYS)]
    f = len(masks)
    big = np.repeat(masks, len(pairs), axis=0)
    lrs = np.tile([p[0] for p in pairs], f)
    wds = np.tile([p[1] for p in pairs], f)
    snaps = train_many(gram, y, big, num_classes, lrs, wds, STEPS)
    out = np.empty((len(GRID), f, len(y), num_classes))
    for gi, s in enumerate(GRID):
        pi = pairs.index((s.lr, s.weight_decay))
        a, b = snaps[s.steps]
        out[gi] = _logits(a[pi::len(pairs)], b[pi::len(pairs)], gram)
    return out


def _choose(gram: np.ndarray, y: np.ndarray, train: np.ndarray, num_classes: int) -> int:
    """Index in :data:`GRID` chosen by leave-one-out on the rows ``train`` alone (module docstring)."""
    rows = np.flatnonzero(train)
    masks = np.repeat(train[None], len(rows), axis=0)
    masks[np.arange(len(rows)), rows] = False
    logits = _fit_grid(gram, y, masks, num_classes)[:, np.arange(len(rows)), rows]  # (G, R, K): own held-out row
    correct = (logits.argmax(axis=2) == y[rows]).sum(axis=1)
    shifted = logits - logits.max(axis=2, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=2, keepdims=True))
    loss = -logp[:, np.arange(len(rows)), y[rows]].mean(axis=1)
    return min(range(len(GRID)), key=lambda g: (-correct[g], loss[g], g))


def nested_scores(x: np.ndarray, labels: Sequence[str], folds: Sequence[int]) -> tuple[np.ndarray, list[Setting]]:
    """Held-out correctness of the tuned head for every photo, fold by fold (module docstring).

    A held-out photo is scored only when its species is among the training folds' species (the head's classes
    are those); the head is trained on the training folds' photos only.

    Args:
        x: float (N, D) embeddings. labels: N species names. folds: N fold ids (held out one fold at a time).

    Returns:
        ``(correct, chosen)``: float (N,) with 1.0 / 0.0 for scored photos and NaN for unscored ones, and the setting
        chosen for each fold in sorted fold order.
    """
    x = np.asarray(x, np.float64)
    labels, folds = np.asarray(labels), np.asarray(folds)
    correct = np.full(len(labels), np.nan)
    chosen = []
    for fold in sorted(set(folds.tolist())):
        train, test = folds != fold, folds == fold
        names = sorted(set(labels[train].tolist()))
        keep = np.isin(labels, names)
        xs, ys = x[keep], np.array([names.index(v) for v in labels[keep]])
        gram = xs @ xs.T
        g = _choose(gram, ys, train[keep], len(names))
        chosen.append(GRID[g])
        logits = _fit_grid(gram, ys, train[keep][None], len(names))[g, 0]
        scored = test[keep]
        correct[np.flatnonzero(keep)[scored]] = (logits[scored].argmax(axis=1) == ys[scored]).astype(float)
    return correct, chosen


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """Paired comparison of two 0/1 correctness vectors on the same photos (NaN: unscored, left out).

    Returns:
        ``(only_a, only_b, p)``: photos only ``a`` names correctly, photos only ``b`` does, and the exact two-sided
        McNemar p-value, ``min(1, 2 P(X <= min(only_a, only_b)))`` for X ~ Binomial(only_a + only_b, 1/2)
        (McNemar 1947; the exact binomial form for small counts).
    """
    ok = ~(np.isnan(a) | np.isnan(b))
    only_a = int(((a == 1) & (b == 0) & ok).sum())
    only_b = int(((a == 0) & (b == 1) & ok).sum())
    n = only_a + only_b
    if n == 0:
        return only_a, only_b, 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n
    return only_a, only_b, min(1.0, 2 * tail)
