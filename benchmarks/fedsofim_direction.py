"""Why DP-FedSOFIM on G fails under heavy DP noise: how far its step goes along the noise-free gradient.

Run by hand (not part of the tests; about 10 s after the embeddings are cached)::

    .venv/bin/python benchmarks/fedsofim_direction.py [--rounds 40] [--rho 1.0] [--eta-over-rho 0.1]

Setting: the fedsofim experiment's (tuning seed 101's pool, the released aggregate drawn as in
:func:`wildfed_sim.fedsofim.released_aggregates`, T = 100 calibration), one DP-FedSOFIM-on-G run per case, in
float64, written out so that every quantity is visible: ``M_t = beta M + (1 - beta) G_t``,
``a_t = M_t^T G_t / (rho + |M_t|^2)``, step ``(G_t - a_t M_t) / rho`` (Sherman-Morrison). Because M_t contains
``(1 - beta) G_t`` and the noise n dominates G_t, ``M_t^T G_t ~ (1 - beta) |n|^2`` while
``|M_t|^2 ~ (1 - beta) / (1 + beta) |n|^2``: once ``|M|^2 >> rho``, ``a_t -> 1 + beta``. The signal s, which G_t
and M_t share, enters the step as ``(1 - a_t) s / rho``: for ``a_t > 1`` the step climbs the loss.

Printed per case (K, eps): ``|M|^2`` at rounds 10 and T, the median ``a_t``, the norm of the noise-free clipped
mean gradient ``s_t``, and the median over rounds >= 10 of the step's component along ``s_t / |s_t|``
(DP-FedGD's is ``|s_t|``; negative means ascent), and that component over DP-FedGD's (the ratio: 1 = as far downhill
as DP-FedGD, below 0 = uphill); then the load average. With ``--rounds`` under 10 the medians are over all rounds
and "round 10" is the last one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import load_average  # noqa: E402  (the script's folder)
from shared.privacy.accounting import calibrate_noise_multiplier  # noqa: E402
from shared.privacy.randomness import SecureRandom  # noqa: E402
from wildfed_sim import fedsofim as fs  # noqa: E402


def main() -> None:
    """Parse the options, run the cases, print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rho", type=float, default=1.0)
    ap.add_argument("--eta-over-rho", type=float, default=0.1)
    ap.add_argument("--beta", type=float, default=0.9)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    print(f"DP-FedSOFIM on G, {args.rounds} rounds, rho {args.rho:g}, eta/rho {args.eta_over_rho:g}, beta "
          f"{args.beta:g}; {load_average()}", flush=True)
    settings = fs.FedSofimSettings()
    data = fs.prepare_seed(settings, 101)
    pool = fs.Pool.of(data.pool)
    noise = SecureRandom()
    for k, eps in ((20, 0.5), (100, 0.5), (100, 2.0), (20, 10.0)):
        z = calibrate_noise_multiplier(target_epsilon=eps, target_delta=settings.target_delta, sampling_rate=1.0,
                                       steps=settings.rounds)
        theta, m = np.zeros((1, 12810)), np.zeros(12810)
        msq, coef, along, s_norm = [], [], [], []
        for _ in range(args.rounds):
            g = fs.released_aggregates(theta, pool, num_classes=10, clipping_norm=1.0,
                                       noise_std=np.sqrt(k) * z, noise=noise)[0]
            s = fs.released_aggregates(theta, pool, num_classes=10, clipping_norm=1.0, noise_std=0.0, noise=noise)[0]
            m = args.beta * m + (1 - args.beta) * g
            a = float(m @ g) / (args.rho + float(m @ m))
            step = (g - a * m) / args.rho
            theta[0] -= args.eta_over_rho * args.rho * step
            msq.append(float(m @ m))
            coef.append(a)
            along.append(float(step @ s) / np.linalg.norm(s))
            s_norm.append(float(np.linalg.norm(s)))
        r10 = min(10, args.rounds)  # rounds >= 10 once the momentum is filled; all rounds in a short run
        skip = r10 - 1 if args.rounds >= 10 else 0
        ratio = np.median(along[skip:]) / np.median(s_norm[skip:])
        print(f"K={k:3d} eps={eps:4g} (z={z:.2f}): |M|^2 round {r10} {msq[r10 - 1]:.3g}, round {args.rounds} "
              f"{msq[-1]:.3g}; median a_t {np.median(coef[skip:]):.2f}; |s| {np.median(s_norm[skip:]):.3g}; step along "
              f"s {np.median(along[skip:]):+.3g} (ratio to DP-FedGD's {ratio:+.2f})", flush=True)
    print(f"finished; {load_average()}")


if __name__ == "__main__":
    main()
