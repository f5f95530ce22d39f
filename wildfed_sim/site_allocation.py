"""Dividing a training set's images among sites: integer images per (site, class) with each site's size, no class
used beyond the images it has, every class a site lists present, and the shares close to the sites' class weights
(:func:`allocate_images`: capped iterative proportional fitting, then an integral linear programme). Used by
:func:`wildfed_sim.ecology.design_sites`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["capped_ipf", "allocate_images"]


def capped_ipf(sizes: np.ndarray, weights: np.ndarray, available: np.ndarray,
                iterations: int = 2000) -> np.ndarray:
    """Fractional (K, C) allocation: rows sum to ``sizes``, columns at most ``available``, shaped like ``weights``.

    Alternately rescales rows to their sizes and over-full columns down to their capacity (iterative
    proportional fitting with inequality column margins); the fixed point is the relative-entropy projection of
    ``weights`` onto those constraints when they are feasible. Returns the last iterate either way (the integer
    stage checks feasibility).
    """
    x = weights.astype(np.float64).copy()
    for _ in range(iterations):
        rows = x.sum(1)
        x *= (sizes / np.where(rows > 0, rows, 1.0))[:, None]
        cols = x.sum(0)
        over = cols > available * (1 + 1e-9)
        if not over.any():
            break
        x[:, over] *= available[over] / cols[over]
    return x


def allocate_images(sizes: np.ndarray, weights: np.ndarray, available: np.ndarray) -> np.ndarray | None:
    """Integer images per (site, class): row sums ``sizes``, column sums <= ``available``, close to the weights.

    ``weights`` (K, C) is > 0 exactly where a site lists a class. Two stages:

    1. capped iterative proportional fitting (:func:`capped_ipf`): the fractional allocation closest in
       relative entropy to the weights with row sums ``sizes`` and column sums <= ``available``;
    2. a linear programme (HiGHS through ``scipy.optimize.linprog``) makes it integral: every listed cell gets
       >= 1 image, unlisted cells 0, and the L1 distance to the row-wise rounded stage-1 allocation is minimised.
       The constraint matrix (a transportation problem plus identity columns) is totally unimodular and the
       right-hand sides are integers, so the optimal vertex is integral; it is rounded and checked.

    Returns:
        int64 array (K, C), or ``None`` when no allocation exists.
    """
    from scipy.optimize import linprog  # coordinator dependency; imported where it is needed

    k_sites, n_classes = weights.shape
    listed = weights > 0
    fractional = capped_ipf(sizes.astype(np.float64), weights, available.astype(np.float64))
    cells = [(k, c) for k in range(k_sites) for c in range(n_classes) if listed[k, c]]
    n = len(cells)
    targets = np.zeros(n)
    for k in range(k_sites):  # largest-remainder rounding of each site's fractional allocation
        ids = [i for i, (kk, _) in enumerate(cells) if kk == k]
        share = fractional[k, [cells[i][1] for i in ids]]
        exact = sizes[k] * share / share.sum()
        base = np.floor(exact)
        for j in np.argsort(-(exact - base), kind="stable")[: int(sizes[k] - base.sum())]:
            base[j] += 1
        targets[ids] = base
    # variables: x (n), p (n), m (n) with x - p + m = targets; minimise sum(p + m)
    cost = np.concatenate([np.zeros(n), np.ones(2 * n)])
    a_eq = np.zeros((k_sites + n, 3 * n))
    for i, (k, _) in enumerate(cells):
        a_eq[k, i] = 1.0
        a_eq[k_sites + i, [i, n + i, 2 * n + i]] = (1.0, -1.0, 1.0)
    b_eq = np.concatenate([sizes.astype(np.float64), targets])
    a_ub = np.zeros((n_classes, 3 * n))
    for i, (_, c) in enumerate(cells):
        a_ub[c, i] = 1.0
    bounds = [(1, None)] * n + [(0, None)] * (2 * n)
    res = linprog(cost, A_ub=a_ub, b_ub=available.astype(np.float64), A_eq=a_eq, b_eq=b_eq,
                  bounds=bounds, method="highs")
    if res.status != 0:
        return None
    x = np.rint(res.x[:n]).astype(np.int64)
    out = np.zeros((k_sites, n_classes), dtype=np.int64)
    for i, (k, c) in enumerate(cells):
        out[k, c] = x[i]
    if (np.any(out.sum(1) != sizes) or np.any(out.sum(0) > available)
            or np.any(out[listed] < 1)):  # pragma: no cover - would mean a non-integral vertex
        return None
    return out
