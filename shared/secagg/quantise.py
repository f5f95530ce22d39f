"""Secure aggregation's quantiser ``Q``: floats to ``Z_{2^k}`` and a sum back, with its error bound."""

from __future__ import annotations

import numpy as np

from shared.secagg.errors import SecAggError
from shared.secagg.params import SecAggParams


def modulus_mask(params: SecAggParams) -> np.unsignedinteger:
    """``2^k - 1`` as a ``params.dtype`` scalar: ``a & modulus_mask(params)`` reduces ``a`` mod ``2^k``."""
    return params.dtype.type((1 << params.modulus_bits) - 1)


def quantise(values: np.ndarray, params: SecAggParams) -> np.ndarray:
    """``Q(x) = rint(clip(x, -B, B) * scale) mod 2^k`` per coordinate.

    Args:
        values: float array of shape ``(vector_length,)`` (float32 in WildFed; computed in float64).

    Returns:
        ``params.dtype`` array of shape ``(vector_length,)``; negative integers in two's complement mod ``2^k``.

    Raises:
        SecAggError: wrong shape or a non-finite value (clip first; NaN must never be aggregated).
    """
    x = np.asarray(values)
    if x.shape != (params.vector_length,) or not np.issubdtype(x.dtype, np.floating):
        raise SecAggError(f"update must be a float vector of shape ({params.vector_length},), got {x.dtype} "
                          f"{x.shape}; flatten the tensors in a fixed order first")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("update has non-finite values; they cannot be quantised")
    bound = float(params.max_abs_value)
    q = np.rint(np.clip(x, -bound, bound) * float(params.scale)).astype(np.int64)
    return (q.view(np.uint64) & np.uint64(params.modulus - 1)).astype(params.dtype)


def dequantise_sum(total: np.ndarray, params: SecAggParams) -> np.ndarray:
    """Map a sum of quantised updates in ``Z_{2^k}`` back to real numbers: centre into ``[-2^(k-1), 2^(k-1))``
    (exact, by the no-wrap bound of :class:`SecAggParams`) and divide by ``scale``.

    Returns:
        float64 array of shape ``(vector_length,)``. The integer is exact; the float is the nearest float64 (exact
        for |integer| <= 2^53 with a power-of-two scale).
    """
    s = np.asarray(total, dtype=params.dtype).astype(np.uint64)
    half = np.uint64(1 << (params.modulus_bits - 1))
    if params.modulus_bits == 64:
        centred = s.view(np.int64)
    else:
        centred = s.astype(np.int64) - np.where(s >= half, np.int64(params.modulus), np.int64(0))
    return centred.astype(np.float64) / float(params.scale)


def quantisation_error_bound(params: SecAggParams, num_summands: int) -> float:
    """Per-coordinate bound on ``|dequantise_sum(sum Q(x_u)) - sum clip(x_u)|`` (the right side summed exactly):
    ``num_summands / (2 scale)`` (each rounding moves a value by at most half a step) plus
    ``num_summands * max_abs_value * 2^-52`` (the float64 rounding of the result, which matters only when the
    integer sum passes 2^53, i.e. with ``modulus_bits > 54``). It bounds the error against the plain sum when no
    coordinate exceeds ``max_abs_value``."""
    return num_summands * 0.5 / float(params.scale) + num_summands * float(params.max_abs_value) * 2.0 ** -52
