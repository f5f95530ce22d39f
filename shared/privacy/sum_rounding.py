"""The floating-point steps between a site's clipped gradients and its quantised sum, and the margin that keeps the
quantised sum's sensitivity at the value the accounting charges.

The allowance. Global DP rounds charge a record of category c for moving its site's quantised sum by at most
``D2 = C_c s + sqrt(d)`` in L2 (``shared.privacy.distributed``; the trusted-server mode's ``C_eff = C + sqrt(d)/s``
of ``coordinator.global_dp`` is the same bound divided by s), with s the secure-aggregation ``scale`` and d the
vector length: ``rint`` moves each coordinate of each of two neighbouring sums by at most 1/2, so one unit per
coordinate. That holds for the exact sum. The gateway computes the sum in floating point, and every rounding of it
before ``rint`` comes on top of the allowance.

Float32 does not fit. Summed in float32 (u = 2^-24) and cast to float32, coordinate i of a sum of B clipped
gradients v_r (each ||v_r|| <= C) is off by up to ``gamma_B sum_r |v_ri|`` (``gamma_n = n u / (1 - n u)``, Higham
2002, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. (3.5)), so by up to ``s gamma_B B C`` grid
units in L2, per sum. With the demo's Global DP settings (C = 1, B = 1024 records, box ``C B``, eight sites, so
s = 2^17; d = 12,810) that is up to 2 x 8,200 grid units for two neighbouring sums, against a CR allowance of
``C_CR s + sqrt(d)``, about 26,000 + 113 at C_CR = 0.2: the charged epsilon would not be the mechanism's. Even the
final cast alone (one rounding of the exact sum, ``2^-24 |S_i|``) can pass the one-unit rounding allowance
(``tests/shared/test_sum_rounding.py`` builds a case with exact integers).

Float64, and the margin. The gateway sums in float64 (``PerExampleGradients.weighted_sum(..., dtype=float64)``),
keeps the sum in float64 until it is quantised (``canonical_flatten(..., dtype=float64)``, ``shared.secagg.quantise``
multiplies by s in float64) and clips every record at ``C_c - m`` (:func:`secagg_clipping_norms`) with

    ``m = (2 (N+1) gamma_{N+1} (1 + 16u) + 16u) C + 2 sqrt(d) (u B_box + 2^-1075 / s)``,  u = 2^-53  (:func:`margin`)

where N is the site's public record count (N_site; a batch has at most N records, a neighbouring dataset N+1).

Formal guarantee. Let D and D' = D + {r*} be neighbouring datasets of a site, r* of category c. Assume (A1) each
record's clipped gradient as an exact real vector, ``v_r = w_r g_r`` (``w_r`` the float32 clip factor, ``g_r`` the
gradient its float32 factors or rows define), has ``||v_r||_2 <= C_r (1 + 16u)`` with C_r the norm it was clipped at:
the norm upper bounds of ``edge_sdk.privacy.per_example`` (float32 sums raised by Higham's bound, float64 sums raised
likewise) are upper bounds up to the float64 roundings of their products, sums and square root (fewer than 16 per
record for WildFed's head models) and ``edge_sdk.privacy.ccdp.clip_factors_from_norms`` shrinks an active factor by
1e-5. Then the quantised sums q = rint(fl(s clip(S~))) satisfy ``||q(D') - q(D)||_2 <= C_c s + sqrt(d)``.

Proof. (1) Each coordinate of a float64 weighted sum is an inner product of B <= N + 1 terms whose factors ``w_r
delta_r`` are exact in float64 (two float32 numbers: 48 significant bits), so ``|S~_i - S_i| <= gamma_{N+1} sum_r
|v_ri|`` (Higham eq. (3.5), any summation order, fused or not), and by the triangle inequality in L2,
``||S~ - S||_2 <= gamma_{N+1} sum_r ||v_r||_2 <= gamma_{N+1} (N+1) C (1 + 16u)``, for D and D' alike.
(2) clip to the box is 1-Lipschitz per coordinate and exact; ``fl(s y)`` is off by at most ``u s |y| + 2^-1075``
(IEEE 754 round to nearest with gradual underflow; zero when s is a power of two >= 1, as
``max_power_of_two_scale`` makes it) with ``|y| <= B_box``. (3) ``|rint(a) - rint(b)| <= |a - b| + 1``. So per
coordinate ``|q_i(D') - q_i(D)| <= s (|v_r*i| + |e_i| + |e'_i|) + |eta_i| + |eta'_i| + 1`` and, by Minkowski over
the d coordinates, ``||q(D') - q(D)||_2 <= s ||v_r*|| + s (||e|| + ||e'||) + 2 sqrt(d) (u s B_box + 2^-1075) +
sqrt(d)``. With r* clipped at ``C_c - m``, (A1) gives ``s ||v_r*|| <= s (C_c - m) + 16u s C``, and m is the sum of the
other terms divided by s, so the total is at most ``s C_c + sqrt(d)``. Every other record's norm enters only through
(1), where ``C_r - m <= C``.

Numbers. The demo's settings above with N = 5,000 records: m = 5.6e-9 C (the clipping norm loses 6 parts in 10^9;
0.0007 grid units at s = 2^17); N = 10^6 records: m = 2.2e-4 C. :func:`secagg_clipping_norms` refuses a site whose
margin reaches a clipping norm (about 10^8 records at C_c = C).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

from shared.errors import ConfigError

__all__ = ["FLOAT64_UNIT_ROUNDOFF", "NORM_ROUNDINGS", "margin", "secagg_clipping_norms"]

#: u = 2^-53, the unit roundoff of IEEE 754 binary64 (round to nearest)
FLOAT64_UNIT_ROUNDOFF = 2.0 ** -53
#: float64 roundings allowed in one record's norm bound (assumption A1 of the module docstring)
NORM_ROUNDINGS = 16

K = TypeVar("K")


def margin(*, num_records: int, clipping_norm: float, vector_length: int, scale: float,
           max_abs_value: float) -> float:
    """``m`` of the module docstring: how much below its clipping norm a site clips each record so that its
    float64 sum, quantised, moves by at most ``C_c scale + sqrt(d)`` when one record is added or removed.

    Args:
        num_records: N, the site's public record count (>= 0). clipping_norm: C, the task's (largest) norm.
        vector_length: d. scale: the secure-aggregation grid's s (> 0). max_abs_value: its box B_box (> 0).

    Returns:
        m in the units of C (>= 0).

    Raises:
        ConfigError: a value out of range, or N so large that ``(N+1) u >= 1``.
    """
    u = FLOAT64_UNIT_ROUNDOFF
    n = int(num_records) + 1
    if num_records < 0 or n * u >= 1 or not (clipping_norm > 0 and scale > 0 and max_abs_value > 0) \
            or vector_length < 1:
        raise ConfigError(f"no float64 rounding margin for N={num_records}, C={clipping_norm}, d={vector_length}, "
                          f"scale={scale}, box={max_abs_value}", field="secagg",
                          fix="N >= 0, C > 0, d >= 1, scale > 0 and max_abs_value > 0")
    gamma = n * u / (1 - n * u)
    return ((2 * n * gamma * (1 + NORM_ROUNDINGS * u) + NORM_ROUNDINGS * u) * float(clipping_norm)
            + 2 * math.sqrt(vector_length) * (u * float(max_abs_value) + 2.0 ** -1075 / float(scale)))


def secagg_clipping_norms(norms: Mapping[K, float], *, num_records: int, clipping_norm: float, vector_length: int,
                          scale: float, max_abs_value: float) -> dict[K, float]:
    """Each category's clipping norm ``C_c`` less :func:`margin`: the norms a Global DP site clips at, so that the
    accounting's ``D2 = C_c scale + sqrt(d)`` holds for its float64 sum (module docstring).

    Raises:
        ConfigError (field ``secagg``): the margin reaches a category's norm (about 10^8 records at C_c = C).
    """
    m = margin(num_records=num_records, clipping_norm=clipping_norm, vector_length=vector_length, scale=scale,
               max_abs_value=max_abs_value)
    out = {c: float(v) - m for c, v in norms.items()}
    small = [c for c, v in out.items() if not v > 0]
    if small:
        raise ConfigError(f"the float64 rounding margin {m:.3g} of a sum over {num_records} records reaches the "
                          f"clipping norm of {small}", field="secagg",
                          fix="split the site's records over several sites, or raise the clipping norm")
    return out
