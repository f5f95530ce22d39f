"""The template attacker's cost per candidate: sequential shadows (the first measurements' attacker) against batched
and first-order shadows, timed in the same run.

Run by hand (not part of the tests; about 5 min with the defaults on a shared 2-core machine)::

    .venv/bin/python benchmarks/radio_attack.py [--seed 0] [--client 0] [--candidates 6] [--repeats 3] \
        [--threads 2] [--strides 2,3,4] [--cache runs/radio-attack-bench]

Setting: the radiomap experiment's defaults (munich tiles, COST 231, 50 maps per site, one epoch of Adam at batch
16, site radius 20 m, template grid step 6 px), client ``--client``'s tile of seed ``--seed``, the seed's untrained
round-0 weights (the cost does not depend on them). Timed, each call from a fresh :class:`ShadowUpdates` (no cache),
in rotating order (``_timing.interleaved``, one warm-up):

- ``sequential``, ``batched`` and ``first-order/<stride>`` on the same ``--candidates`` candidates (every n-th of
  the tile's grid);
- ``first-order/<stride>, tile``: every candidate of the tile at once, the way the attacker calls it, divided by
  the number of candidates (sub-grid pixels are shared by neighbouring candidates' discs, so the cost per candidate
  falls with the candidates' density);
- ``first-order/<stride>, tile, warm``: the same with the tile's sub-grid maps already made, as at every attack
  round after a client's first (the maps depend on the tile only and are kept).

Printed: seconds per candidate (median over repeats) and, pair by pair within each rotation, the sequential time
per candidate over the other's (median, min, max); the load average before and after.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import interleaved, load_average  # noqa: E402  (the script's folder)


def main() -> None:
    """Parse the options, time every way of computing shadows, print the table."""
    import torch

    from shared.models import radio_unet
    from wildfed_sim.radio_shadows import ShadowTraining, ShadowUpdates
    from wildfed_sim.radiomap import RadioMapSettings, prepare_data, template_candidates

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--strides", default="2,3,4")
    ap.add_argument("--cache", type=Path, default=Path("runs/radio-attack-bench"))
    args = ap.parse_args()
    if args.candidates < 1 or args.repeats < 1:
        ap.error("--candidates and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    settings = RadioMapSettings(pretrain_epochs=0)
    print(f"shadow updates, seed {args.seed}, client {args.client}, {args.threads} torch threads; {load_average()}",
          flush=True)
    data = prepare_data(settings, args.seed, cache_dir=args.cache / "data")
    theta = np.concatenate([v.reshape(-1) for _, v in sorted(radio_unet.initial_weights(
        width=settings.width, seed=args.seed).items())]).astype(np.float64)
    every = template_candidates(data, args.client, settings)
    some = every[:: max(1, len(every) // args.candidates)][:args.candidates]
    print(f"{len(every)} candidates on the tile; timing {len(some)} of them", flush=True)

    def shadows(kind: str, stride: int = 2) -> ShadowUpdates:
        training = ShadowTraining(maps_per_site=settings.maps_per_client, epochs=settings.local_epochs,
                                  learning_rate=settings.local_lr, batch_size=settings.batch_size,
                                  radius_px=settings.site_radius_m / settings.metres_per_pixel, width=settings.width,
                                  pixel_stride=stride)
        return ShadowUpdates(kind, training, data.source, data.tiles.clients)

    def call(kind: str, cands: np.ndarray, stride: int = 2):
        return lambda: shadows(kind, stride).deltas(args.client, cands, theta, np.random.default_rng(0))

    steps = {"sequential": call("sequential", some), "batched": call("batched", some)}
    counts = {"sequential": len(some), "batched": len(some)}
    for stride in (int(s) for s in args.strides.split(",")):
        steps[f"first-order/{stride}"] = call("first-order", some, stride)
        steps[f"first-order/{stride}, tile"] = call("first-order", every, stride)
        warm = shadows("first-order", stride)
        warm.deltas(args.client, every, theta, np.random.default_rng(0))   # makes and keeps the tile's maps

        def warm_call(warm: ShadowUpdates = warm) -> None:
            warm.forget_deltas()
            warm.deltas(args.client, every, theta, np.random.default_rng(0))

        steps[f"first-order/{stride}, tile, warm"] = warm_call
        counts[f"first-order/{stride}"], counts[f"first-order/{stride}, tile"] = len(some), len(every)
        counts[f"first-order/{stride}, tile, warm"] = len(every)
    times = interleaved(steps, repeats=args.repeats, warmup=1)
    per = {name: t / counts[name] for name, t in times.items()}
    print(f"{'shadows':24s} {'s per candidate':>16s} {'sequential / this (median, min-max)':>38s}")
    for name, t in per.items():
        ratio = per["sequential"] / t
        print(f"{name:24s} {np.median(t):16.3f} {np.median(ratio):20.1f} ({ratio.min():.1f}-{ratio.max():.1f})")
    print(load_average(), flush=True)


if __name__ == "__main__":
    main()
