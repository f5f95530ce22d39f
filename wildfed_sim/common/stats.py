"""The experiments' statistics: mean and sample standard deviation over the values present, and the paired
Student-t interval (Student 1908). Means and deviations are :func:`statistics.fmean` and :func:`statistics.stdev`
(correctly rounded), so every table computes them alike."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["mean_sd", "mean_std", "mean_and_sd", "paired_interval"]


def mean_sd(values: Sequence[float | None], *, skip_nan: bool = True) -> tuple[float, float, int] | None:
    """``(mean, sample sd, n)`` over the values that are not None (nor nan, with ``skip_nan``); sd 0 for one value;
    None when no value is left."""
    vals = [float(v) for v in values if v is not None and not (skip_nan and math.isnan(float(v)))]
    if not vals:
        return None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def mean_std(values: Sequence[float | None], *, skip_nan: bool = False) -> dict[str, Any]:
    """``{"mean", "std" (sample; 0 for one value), "n"}`` over the values that are not None (nor nan, with
    ``skip_nan``); ``{"mean": None, "std": None, "n": 0}`` when none is left. Without ``skip_nan`` a nan value makes
    the mean nan (it is reported, not hidden)."""
    stat = mean_sd(values, skip_nan=skip_nan)
    if stat is None:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": stat[0], "std": stat[1], "n": stat[2]}


def mean_and_sd(values: Sequence[float | None]) -> tuple[float, float]:
    """(mean, sample sd) of the values that are not None or nan; (nan, nan) when none is left, sd 0 for one."""
    stat = mean_sd(values)
    return (math.nan, math.nan) if stat is None else (stat[0], stat[1])


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean of the paired differences ``a_i - b_i`` and its two-sided Student-t interval (n - 1 degrees of
    freedom; Student 1908): ``mean +- t_{(1+confidence)/2, n-1} * sd / sqrt(n)``.

    Returns ``{"n", "mean", "sd", "low", "high"}`` (fractions, like the inputs); for n = 1 the interval is
    infinite.

    Raises:
        ValueError: different lengths or no pair.
    """
    from scipy import stats

    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples need equal, non-zero lengths, got {len(a)} and {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": math.nan, "low": -math.inf, "high": math.inf}
    sd = statistics.stdev(diffs)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}
