"""Per-example gradients as the CCDP mechanism consumes them: their norms and weighted sums.

Clipping and per-category summing need only two things from B per-example gradients g_i in R^d:

- the norms ``||g_i||_2`` (to get the clip factors), and
- weighted sums ``sum_i W[k, i] g_i`` for a (K, B) weight matrix (clip factor times category indicator).

A backend can hand over the gradients themselves (:class:`MaterialisedGradients`: a (B, d) array), or compute
both quantities without ever building the (B, d) array (ghost clipping: Goodfellow 2015, "Efficient per-example
gradient computations"; Li et al. 2022, "Large language models can be strong differentially private learners",
sec. 4). Both feed the same mechanism code, so the mechanism is written once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

__all__ = ["PerExampleGradients", "MaterialisedGradients", "FLOAT32_UNIT_ROUNDOFF", "summation_error_bound"]

#: u = 2^-24, the unit roundoff of IEEE 754 binary32 (round to nearest)
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def summation_error_bound(n: int, unit_roundoff: float = FLOAT32_UNIT_ROUNDOFF) -> float:
    """``gamma_n = n u / (1 - n u)``: a float32 sum of the squares of ``n`` float32 numbers, in any order of
    pairwise additions, is within a factor ``1 + gamma_n`` of the exact sum of squares (each square rounds once,
    then ``n - 1`` additions of non-negative terms; Higham 2002, "Accuracy and Stability of Numerical Algorithms",
    2nd ed., Lemma 3.1 and eq. (4.4)). Backends multiply float32 squared row norms by ``1 + gamma_n`` to get an
    upper bound of the exact squared norm, which is all clipping needs (a clipped gradient's norm can then not
    exceed C), at a fraction of the cost of float64 accumulation.

    Raises:
        ValueError: ``n < 0`` or ``n u >= 1``.
    """
    if n < 0 or n * unit_roundoff >= 1:
        raise ValueError(f"no summation bound for n={n} at unit roundoff {unit_roundoff}")
    return n * unit_roundoff / (1 - n * unit_roundoff)


class PerExampleGradients(ABC):
    """B per-example gradients in R^d, given implicitly.

    Attributes:
        norms: float64 (B,), the L2 norm of each example's gradient (not clipped).
    """

    norms: np.ndarray

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.norms.shape[0])

    @abstractmethod
    def weighted_sum(self, weights: np.ndarray, *, dtype: type = np.float32) -> np.ndarray:
        """``weights @ G``: (K, B) weights -> (K, d) sums of ``dtype``, in the backend's parameter order.

        float32 (the default: the local DP-SGD step, whose noise is added in float64 afterwards) rounds the weights
        to float32 and accumulates in float32. float64 (a Global DP site's clipped sum, quantised for secure
        aggregation: ``shared.privacy.sum_rounding``) takes float32 weights exactly, forms each product of a weight
        and a float32 factor exactly, and accumulates in float64."""


class MaterialisedGradients(PerExampleGradients):
    """Per-example gradients held as an explicit float32 (B, d) array."""

    def __init__(self, grads: np.ndarray) -> None:
        grads = np.asarray(grads, dtype=np.float32)
        if grads.ndim != 2:
            raise ValueError(f"per-example gradients must be (B, d), got shape {grads.shape}")
        self.grads = grads
        # float64 sums of squares raised by the float64 summation bound: upper bounds, as the ghost paths' are
        bound = 1.0 + summation_error_bound(int(grads.shape[1]), 2.0 ** -53)
        self.norms = np.sqrt(np.einsum("ij,ij->i", grads, grads, dtype=np.float64) * bound)

    def weighted_sum(self, weights: np.ndarray, *, dtype: type = np.float32) -> np.ndarray:
        """(K, d) of ``dtype`` = weights (K, B) @ grads (B, d), accumulated in ``dtype``."""
        w = np.asarray(weights, dtype=np.float32).astype(dtype)
        return w @ (self.grads if dtype == np.float32 else self.grads.astype(dtype))
