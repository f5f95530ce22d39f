"""DP-FedSOFIM server step against plain server SGD: time and peak memory at d = 1e5, 1e6, 1e7, from one run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/fedsofim.py [--sizes 100000,1000000,10000000] [--repeats 7]

For each d, one float32 model tensor and one float32 aggregate delta of d values. Two steps are timed,
interleaved in rotating order (benchmarks/_timing.py): ``ServerSGD.step`` (the DP-FedGD server step) and
``DPFedSOFIM.step`` (momentum update, Sherman-Morrison solve, step). Both are the coordinator's own code. Peak
memory is the largest numpy allocation during one step, measured by ``tracemalloc`` (numpy reports its buffers
to it), excluding the inputs and the optimizer state held between steps.

Printed: median and minimum seconds per step, the ratio DP-FedSOFIM / SGD (target: <= 2 at d = 1e7), the
peak extra memory of each in bytes and per parameter, and the growth of time and memory from one d to the next
(linear growth: a 10x larger d costs about 10x).
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import interleaved, load_average  # noqa: E402  (the script folder; Opacus has a package "benchmarks")
from coordinator.optimizers.fedsofim import DPFedSOFIM  # noqa: E402
from coordinator.optimizers.server_sgd import ServerSGD  # noqa: E402


def peak_bytes(fn) -> int:
    """Largest traced allocation above the baseline while ``fn`` runs."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"DP-FedSOFIM vs server SGD, {args.repeats} interleaved repeats; {load_average()}")
    rng = np.random.default_rng(0)
    rows = []
    for d in (int(x) for x in args.sizes.split(",")):
        weights = {"w": rng.standard_normal(d).astype(np.float32)}
        delta = {"w": (0.01 * rng.standard_normal(d)).astype(np.float32)}
        sgd, sofim = ServerSGD(1.0), DPFedSOFIM(learning_rate=1.0, beta=0.9, rho=1.0)
        sofim.step(weights, delta)  # fill the momentum: later steps take the Sherman-Morrison path
        times = interleaved({"sgd": lambda: sgd.step(weights, delta), "fedsofim": lambda: sofim.step(weights, delta)},
                            repeats=args.repeats, warmup=1)
        mem = {"sgd": peak_bytes(lambda: sgd.step(weights, delta)),
               "fedsofim": peak_bytes(lambda: sofim.step(weights, delta))}
        rows.append((d, times, mem))
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"d = {d:>10,}: SGD {med['sgd'] * 1e3:9.2f} ms (min {times['sgd'].min() * 1e3:.2f}), "
              f"DP-FedSOFIM {med['fedsofim'] * 1e3:9.2f} ms (min {times['fedsofim'].min() * 1e3:.2f}); "
              f"ratio {med['fedsofim'] / med['sgd']:.2f} (min-based {times['fedsofim'].min() / times['sgd'].min():.2f}); "
              f"peak extra memory SGD {mem['sgd'] / d:.1f} B/param, DP-FedSOFIM {mem['fedsofim'] / d:.1f} B/param")
    for (d0, t0, m0), (d1, t1, m1) in zip(rows, rows[1:]):
        print(f"d x{d1 / d0:.0f} ({d0:,} -> {d1:,}): DP-FedSOFIM time x{np.median(t1['fedsofim']) / np.median(t0['fedsofim']):.1f}, "
              f"memory x{m1['fedsofim'] / max(m0['fedsofim'], 1):.1f}")
    print(f"finished; {load_average()}")


if __name__ == "__main__":
    main()
