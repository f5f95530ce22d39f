"""The statistics of the one-run privacy audit (:mod:`wildfed_sim.audit`; Steinke, Nasr & Jagielski 2023,
Theorem 3.1): the p-value of a number of correct membership guesses under (epsilon, delta)-DP, the empirical
epsilon lower bound it gives, and the guesses themselves. Needs neither torch nor ``edge_sdk``.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats


# ------------------------------------------------------------------------------------------------ statistics
def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    for name, value in (("num_canaries", num_canaries), ("num_guesses", num_guesses), ("num_correct", num_correct)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise ValueError(f"need 0 <= num_correct ({num_correct}) <= num_guesses ({num_guesses}) "
                         f"<= num_canaries ({num_canaries})")


def one_run_p_value(*, num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float) -> float:
    """Upper bound on ``P[W >= v]`` for an (epsilon, delta)-DP mechanism (Steinke et al. 2023, Theorem 3.1).

    ``W`` is the number of correct guesses out of ``r`` non-abstaining guesses on ``m`` canaries, each included
    independently with probability 1/2. The bound is ``f(v) + 2 m delta max_{1<=i<=m} (f(v-i) - f(v)) / i`` with
    ``f(v) = P[Binomial(r, p) >= v]``, ``p = e^eps / (1 + e^eps)``, capped at 1. For ``i > v``, ``f(v-i) = 1``
    and the ratio is smaller than at ``i = v``, so the maximum is taken over ``1 <= i <= v``. Tails come from
    ``scipy.stats.binom.sf``; ``p`` from ``scipy.special.expit``.

    Args:
        num_canaries: m >= 0.
        num_guesses: r, 0 <= r <= m.
        num_correct: v, 0 <= v <= r.
        epsilon: eps >= 0 of the null hypothesis.
        delta: delta in [0, 1] of the null hypothesis.

    Returns:
        float in [0, 1], the p-value of observing ``v`` or more correct guesses.

    Raises:
        ValueError: counts not integers or not ordered as above; eps < 0 or not finite; delta outside [0, 1].
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    m, r, v = int(num_canaries), int(num_guesses), int(num_correct)
    p = float(scipy.special.expit(epsilon))
    f_v = float(scipy.stats.binom.sf(v - 1, r, p))  # P[Bin(r, p) >= v]
    if delta == 0 or v == 0:
        return min(1.0, f_v)
    i = np.arange(1, v + 1)
    f_v_minus_i = scipy.stats.binom.sf(v - i - 1, r, p)  # P[Bin(r, p) >= v - i]
    alpha = float(np.max((f_v_minus_i - f_v) / i))
    return min(1.0, f_v + 2.0 * m * delta * alpha)


def epsilon_lower_bound(*, num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                        beta: float = 0.05, xtol: float = 1e-9) -> float:
    """Empirical epsilon lower bound at confidence ``1 - beta`` (Steinke et al. 2023, Theorem 3.1).

    The largest eps >= 0 with :func:`one_run_p_value` ``(eps) <= beta``: every (eps', delta)-DP claim with
    eps' below it is rejected at level beta. The p-value is increasing in eps, so the root is found by bracketing
    and ``scipy.optimize.brentq``. Returns 0.0 when even eps = 0 is not rejected.

    Args:
        num_canaries: m.
        num_guesses: r (guesses that did not abstain).
        num_correct: v (correct guesses among them).
        delta: the claim's delta, in [0, 1).
        beta: significance in (0, 1); 0.05 gives a 95 % lower bound.
        xtol: absolute tolerance on eps (the result is the lower end of the final bracket, so never above the
            exact root).

    Returns:
        float >= 0, epsilon (dimensionless, natural log).

    Raises:
        ValueError: as :func:`one_run_p_value`; beta outside (0, 1); delta outside [0, 1).
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta!r}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")

    def excess(eps: float) -> float:  # < 0 while the claim eps is rejected
        return one_run_p_value(num_canaries=num_canaries, num_guesses=num_guesses, num_correct=num_correct,
                               epsilon=eps, delta=delta) - beta

    if excess(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) < 0:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # unreachable for r >= 1: p(eps) -> >= P[Bin(r,1) >= v] = 1 > beta
            raise ValueError("no upper bracket for the epsilon lower bound")
    root = scipy.optimize.brentq(excess, lo, hi, xtol=xtol)
    # brentq may land a hair past the root; step back so the returned eps is still rejected.
    while root > 0 and excess(root) >= 0:
        root = max(0.0, root - xtol)
    return float(root)


def guess_sizes(num_canaries: int, guess_fraction: float) -> tuple[int, int]:
    """``(k_plus, k_minus)``, both ``floor(guess_fraction * m / 2)``: guess "in" for the k_plus highest scores and
    "out" for the k_minus lowest, fixed before training (no search, so no multiple-testing correction).

    Raises:
        ValueError: m < 0 or guess_fraction outside (0, 1].
    """
    if num_canaries < 0:
        raise ValueError(f"num_canaries must be >= 0, got {num_canaries}")
    if not 0 < guess_fraction <= 1:
        raise ValueError(f"guess_fraction must be in (0, 1], got {guess_fraction}")
    k = int(math.floor(guess_fraction * num_canaries / 2))
    return k, k


def membership_guesses(scores: np.ndarray, *, k_plus: int, k_minus: int) -> np.ndarray:
    """Guesses for canaries from their scores (higher score = more likely "in").

    Args:
        scores: float (m,).
        k_plus: number of "in" guesses (+1), given to the highest scores.
        k_minus: number of "out" guesses (-1), given to the lowest scores.

    Returns:
        int8 (m,) in {-1, 0, +1} (0 = abstain). Ties are broken by canary index (stable sort).

    Raises:
        ValueError: scores not 1-D or not finite, k's negative, or k_plus + k_minus > m.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError("scores must be a finite 1-D array")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.shape[0]:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m, got {k_plus}, {k_minus}, "
                         f"m={scores.shape[0]}")
    order = np.argsort(scores, kind="stable")  # ascending
    guesses = np.zeros(scores.shape[0], dtype=np.int8)
    guesses[order[:k_minus]] = -1
    if k_plus:
        guesses[order[-k_plus:]] = 1
    return guesses
