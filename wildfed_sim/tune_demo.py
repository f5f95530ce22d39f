"""The sweep that picked the demo's training defaults (``wildfed_sim.demo.DP_DEFAULTS`` and
``NON_PRIVATE_DEFAULTS``), on tuning seeds that are never the reported one (the demo reports seed 0).

Every privacy mode gets the same grid and the same seeds, run by the in-process replay of the demo's federation
(:mod:`wildfed_sim.demo_sim`: the gateways' own ``train_locally``, FedAvg, server SGD). The DP defaults are shared
by uniform DP and CCDP (the demo has one set for both), so they are picked by the mean of the two modes' final
accuracy; the non-private ones by its own accuracy. Run::

    .venv/bin/python -m wildfed_sim.tune_demo --seeds 101 103 --out tuning.json

(about 10 minutes on 2 cores after the embeddings are cached; seed 102 was left out of the second grid: its
site design holds no CR record, so it says nothing about the threatened categories). docs/demo-data.md, "Tuning",
has the result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import warnings
from multiprocessing import Pool
from typing import Any

import numpy as np

from wildfed_sim.common.federation import FederationCache

__all__ = ["DP_GRID", "DP_GRID_3", "DP_GRID_4", "DP_GRID_5", "DP_GRID_6", "NON_PRIVATE_GRID", "main"]

#: (local_steps, expected_batch_size, learning_rate, server_momentum) for the DP modes
DP_GRID = list(itertools.product((3, 5), (512, 1024), (0.25, 0.5), (0.5, 0.8)))
#: grid 3: the best of grid 2 sat at its edge (3 steps), so fewer steps and larger steps
DP_GRID_3 = list(itertools.product((1, 2, 3), (1024,), (0.5, 1.0), (0.5, 0.8)))
#: grid 4: grid 3's leaders sat within one noise draw of each other and at its edge (1 step, lr 1): its best five
#: and lr 2, each with 4 noise draws per seed
DP_GRID_4 = [(1, 1024, 1.0, 0.8), (1, 1024, 1.0, 0.5), (2, 1024, 1.0, 0.5), (1, 1024, 2.0, 0.8), (1, 1024, 2.0, 0.5),
             (3, 1024, 0.5, 0.5)]
#: grid 5: grid 4's best (1 step, lr 2) sat at its edge again: larger steps, less momentum, a larger batch
DP_GRID_5 = [(1, 1024, 2.0, 0.5), (1, 1024, 3.0, 0.5), (1, 1024, 4.0, 0.5), (1, 1024, 3.0, 0.3), (1, 2048, 3.0, 0.5)]
#: grid 6 (CCDP as individualized DP-SGD, whose one noise draw is that of the largest budget, not the sum
#: over categories): grid 5's best and larger steps, for uniform eps 2 and both CCDP variants, 4 noise draws each
DP_GRID_6 = [(1, 1024, 2.0, 0.5), (1, 1024, 4.0, 0.5), (1, 1024, 8.0, 0.5), (2, 1024, 4.0, 0.5), (1, 2048, 4.0, 0.5)]
#: the same axes without privacy (no clipping: the mean gradient's norm is ~20, hence larger steps)
NON_PRIVATE_GRID = list(itertools.product((30, 60), (128,), (3.0, 10.0), (0.5, 0.8)))

_FEDERATIONS = FederationCache(keep_one=False)  # a worker keeps every seed it has embedded


def _run(job: tuple[str, int, tuple[int, int, float, float]] | tuple[str, int, tuple, int]) -> dict[str, Any]:
    from shared.iucn import CCDPBudget
    from wildfed_sim.demo_sim import SimConfig, load_federation, simulate

    mode, seed, (steps, batch, lr, momentum) = job[:3]
    draw = job[3] if len(job) > 3 else 0
    warnings.simplefilter("ignore")
    fed = _FEDERATIONS.get(seed, lambda: load_federation(seed))
    common = {"local_steps": steps, "expected_batch_size": batch, "learning_rate": lr, "server_momentum": momentum}
    if mode == "none":
        config = SimConfig(privacy="none", **common)
    elif mode == "uniform-eps2":
        config = SimConfig(budgets=CCDPBudget.uniform(2.0).table(), **common)
    else:  # "ccdp" (the "sample" variant) or "ccdp-scale"
        config = SimConfig(budgets=CCDPBudget.from_anchor("VU", 1.0, 1.0).table(),
                           ccdp_variant="scale" if mode == "ccdp-scale" else "sample", **common)
    out = simulate(fed, config, seed=seed, noise_seed=seed + 7919 * draw if draw else None)
    return {"mode": mode, "seed": seed, "draw": draw, "local_steps": steps, "expected_batch_size": batch,
            "learning_rate": lr,
            "server_momentum": momentum, "overall": out["final"]["overall"],
            "by_category": out["final_by_category"], "round0": out["round0"]["overall"]}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, write every run to ``--out`` (JSON) and print the best configuration per mode."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 103])
    parser.add_argument("--out", default="demo-tuning.json")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--grid", type=int, choices=(2, 3, 4, 5, 6), default=6, help="which grid (module constants)")
    args = parser.parse_args(argv)
    if 0 in args.seeds:
        parser.error("seed 0 is the reported seed; tune on others")
    dp_grid = {2: DP_GRID, 3: DP_GRID_3, 4: DP_GRID_4, 5: DP_GRID_5, 6: DP_GRID_6}[args.grid]
    draws = 4 if args.grid >= 4 else 1
    dp_modes = ("uniform-eps2", "ccdp", "ccdp-scale") if args.grid >= 6 else ("uniform-eps2", "ccdp")
    jobs = [(m, s, g, d) for s in args.seeds for m in dp_modes for g in dp_grid for d in range(draws)]
    if args.grid == 2:
        jobs += [("none", s, g) for s in args.seeds for g in NON_PRIVATE_GRID]
    runs = []
    with Pool(args.processes) as pool, open(args.out + "l", "w") as log:  # JSON lines as they finish
        for k, run in enumerate(pool.imap_unordered(_run, jobs)):
            runs.append(run)
            log.write(json.dumps(run) + "\n")
            log.flush()
            if k % 10 == 0:
                print(f"{k + 1}/{len(jobs)} runs", flush=True)
    with open(args.out, "w") as fh:
        json.dump(runs, fh, indent=1)

    def mean_of(rows: list[dict[str, Any]]) -> float:
        return float(np.mean([r["overall"] for r in rows]))

    keys = ("local_steps", "expected_batch_size", "learning_rate", "server_momentum")
    for label, modes, grid in (("DP (uniform eps 2 and CCDP)", dp_modes, dp_grid),
                               ("non-private", ("none",), NON_PRIVATE_GRID if args.grid == 2 else [])):
        if not grid:
            continue
        scored = []
        for g in grid:
            rows = [r for r in runs if r["mode"] in modes and tuple(r[k] for k in keys) == g]
            per_mode = {m: mean_of([r for r in rows if r["mode"] == m]) for m in modes}
            scored.append((float(np.mean(list(per_mode.values()))), g, per_mode))
        scored.sort(key=lambda t: -t[0])
        print(f"\n{label}: best of {len(grid)} configurations on seeds {args.seeds}")
        for score, g, per_mode in scored[:5]:
            print(f"  {dict(zip(keys, g))}: {100 * score:.1f} % "
                  f"({', '.join(f'{m} {100 * v:.1f}' for m, v in per_mode.items())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
