"""Timing shared by the benchmarks: steps measured in rotating, interleaved order so that a burst of load on a
shared machine hits every variant alike (ratios from one run stay meaningful)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

__all__ = ["interleaved", "load_average"]


def load_average() -> str:
    """The 1/5/15-minute load averages (``os.getloadavg``) and the CPU count, for a benchmark's printed header and
    footer: ratios from one run stay comparable only between runs under similar load."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, np.ndarray]:
    """Run each step ``warmup`` times, then ``repeats`` times in rotating order; seconds per call by name.

    ``clock``: wall time by default; ``time.process_time`` (this process's CPU time, all its threads) leaves out the
    time other processes hold the CPU, for single-threaded steps on a loaded machine."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
    return {name: np.asarray(t) for name, t in times.items()}
