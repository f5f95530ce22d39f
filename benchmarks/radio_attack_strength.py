"""How well the cheap template attackers locate clip-only sites against the full one, on the same seeds and uploads.

Run by hand (not part of the tests; 3-10 min per site on a shared 2-core machine, most of it the full shadows;
every site's result is written to ``--out`` as soon as it is done)::

    .venv/bin/python benchmarks/radio_attack_strength.py [--seeds 0,1,2] [--sites 2] [--first-client 0] \
        [--strides 2,3,4] [--threads 2] [--noisy-uploads 0] [--noise-multipliers 0.3] \
        [--cache runs/radio-attack-strength] [--out runs/radio-attack-strength/strength.json]

Setting: the radiomap experiment's defaults (munich tiles, COST 231, 10 epochs of public pretraining, C = 0.005,
template grid step 6 px), at round 1, where every defence shares the pretrained global model theta_0. For
``--sites`` clients of each seed from ``--first-client`` on: the client's upload (its own 50 maps, one epoch of Adam
from theta_0) without noise (``none``) and clipped (``clip-only``), and with ``--noisy-uploads`` M > 0, M releases
of the clipped upload with uniform Gaussian noise N(0, (zC)^2 I) for each z (the evidence summed over the M, as the
attacker sums it over a site's uploads; here all at theta_0); with ``--grouped`` also grouped clipping at round 1's
public profile, noise-free and (with M > 0) with its own per-group noise at each z (``--profile-only``: print that
profile's C_g / C and sigma_g / (zC) per seed against uniform's sqrt(d_g / d) and 1, and attack nothing). The shadow updates at every
candidate of its tile by
``batched`` (the full shadow: the sequential attacker's arithmetic, equal to it up to float rounding,
``tests/sim/test_radio_shadows.py``) and by ``first-order`` at each pixel stride (:mod:`wildfed_sim.radio_shadows`);
each attacker's maximum-likelihood candidate for each upload and its error in metres. Printed per site: the
candidates, each attacker's error and wall time; at the end the RMSE per attacker and defence, how often the cheap
attacker picks the full one's candidate, the median per-site time ratio (not interleaved: see
``benchmarks/radio_attack.py`` for the speed-up) and the load average.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import load_average  # noqa: E402  (the script's folder)


def group_profile(settings, data, theta: np.ndarray, seed: int) -> np.ndarray:
    """The grouped-clipping profile at round 1 as the experiment computes it: 12 public proxy sites drawn from the
    seed's proxy stream, the gateway's :meth:`RadioSiteTrainer.refresh_clipping_profile`."""
    from edge_sdk.radio import RadioSiteTrainer
    from wildfed_sim.radiomap_run import _public_site

    rng = np.random.default_rng([seed, 31])
    proxies = [_public_site(data, settings.proxy_maps, settings, rng) for _ in range(settings.proxy_sites)]
    trainer = RadioSiteTrainer(maps=proxies[0].maps, defence="grouped-clipping", clipping_norm=settings.clipping_norm,
                               noise_multiplier=settings.noise_multiplier, local_epochs=settings.local_epochs,
                               learning_rate=settings.local_lr, batch_size=settings.batch_size, width=settings.width)
    return trainer.refresh_clipping_profile(theta, proxies=[(p.maps, p.centre_px) for p in proxies], seed=1)


def main() -> None:
    """Parse the options, attack every chosen site, print and write the results."""
    import torch

    from edge_sdk.privacy.adaptive_noise import (clip_groups, clip_update, grouped_clipping_noise_std,
                                                 grouped_clipping_norms)
    from edge_sdk.radio import train_radio_maps
    from shared.models import radio_unet
    from wildfed_sim.radio_attack import profile_log_likelihood
    from wildfed_sim.radio_shadows import ShadowTraining, ShadowUpdates
    from wildfed_sim.radiomap import RadioMapSettings, prepare_data, pretrain, template_candidates

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sites", type=int, default=2, help="clients per seed")
    ap.add_argument("--first-client", type=int, default=0, help="the first client attacked in each seed")
    ap.add_argument("--noisy-uploads", type=int, default=0,
                    help="also attack this many uniform-noise releases of each clip-only upload (0: none)")
    ap.add_argument("--noise-multipliers", default="0.3", help="comma-separated z of those releases")
    ap.add_argument("--grouped", action="store_true",
                    help="also grouped clipping (the round's public clipping profile), with and without its noise")
    ap.add_argument("--profile-only", action="store_true",
                    help="print each seed's grouped-clipping norms and noise against uniform's, attack nothing")
    ap.add_argument("--strides", default="2,3,4", help="first-order pixel strides")
    ap.add_argument("--pretrain-epochs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--candidates", type=int, default=0, help="a smoke test: only every n-th candidate (0: all)")
    ap.add_argument("--cache", type=Path, default=Path("runs/radio-attack-strength"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out_path = args.out or args.cache / "strength.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    strides = [int(s) for s in args.strides.split(",")]
    settings = RadioMapSettings(pretrain_epochs=args.pretrain_epochs)
    mpp = settings.metres_per_pixel
    print(f"template attackers on round-1 uploads, seeds {args.seeds}, {args.sites} sites each, strides {strides}; "
          f"{load_average()}", flush=True)
    model = radio_unet.build_model(width=settings.width)
    layout = radio_unet.parameter_groups(model)
    kinds = ["batched"] + [f"first-order/{s}" for s in strides]
    records = []
    for seed in (int(s) for s in args.seeds.split(",")):
        data = prepare_data(settings, seed, cache_dir=args.cache / "data")
        theta = pretrain(settings, data, seed, cache_dir=args.cache / "data")
        if args.profile_only:
            norms = grouped_clipping_norms(group_profile(settings, data, theta, seed), settings.clipping_norm)
            sizes = layout.sizes.astype(float)
            std = grouped_clipping_noise_std(norms, layout, noise_multiplier=1.0)
            print(f"seed {seed}, groups {layout.names}: C_g / C {np.round(norms / settings.clipping_norm, 4)}, "
                  f"uniform's share sqrt(d_g / d) {np.round(np.sqrt(sizes / sizes.sum()), 4)}, sigma_g / (z C) "
                  f"{np.round(std / settings.clipping_norm, 4)}", flush=True)
            continue
        for k in range(args.first_client, args.first_client + args.sites):
            raw = train_radio_maps(model, theta, data.clients[k].maps, epochs=settings.local_epochs,
                                   learning_rate=settings.local_lr, batch_size=settings.batch_size,
                                   rng=np.random.default_rng([seed, 17, k]))
            uploads = {"none": raw, "clip-only": clip_update(raw, settings.clipping_norm)[0]}
            clippers = {"none": lambda u: u, "clip-only": lambda u: clip_update(u, settings.clipping_norm)[0]}
            if args.grouped:
                norms = grouped_clipping_norms(group_profile(settings, data, theta, seed), settings.clipping_norm)
                clippers["grouped-clipping"] = lambda u, norms=norms: clip_groups(u, layout, norms)[0]
                uploads["grouped-clipping"] = clippers["grouped-clipping"](raw)
            for z in (float(v) for v in args.noise_multipliers.split(",") if args.noisy_uploads):
                # benchmark noise, not a release: seeded, so that every attacker sees the same releases
                noise = np.random.default_rng([seed, 43, k]).standard_normal((args.noisy_uploads, raw.size))
                uploads[f"uniform z={z:g}"] = uploads["clip-only"][None, :] + z * settings.clipping_norm * noise
                clippers[f"uniform z={z:g}"] = clippers["clip-only"]
                if args.grouped:
                    std = grouped_clipping_noise_std(norms, layout, noise_multiplier=z)
                    grouped = uploads["grouped-clipping"][None, :] + std[layout.index] * noise
                    uploads[f"grouped-clipping z={z:g}"] = grouped
                    clippers[f"grouped-clipping z={z:g}"] = clippers["grouped-clipping"]
            cands = template_candidates(data, k, settings)
            if args.candidates:
                cands = cands[::args.candidates]
            truth = data.clients[k].centre_px
            record = {"seed": seed, "client": k, "candidates": len(cands), "errors_m": {}, "seconds": {},
                      "estimate": {}, "load": load_average()}
            for kind in kinds:
                name, _, stride = kind.partition("/")
                training = ShadowTraining(maps_per_site=settings.maps_per_client, epochs=settings.local_epochs,
                                          learning_rate=settings.local_lr, batch_size=settings.batch_size,
                                          radius_px=settings.site_radius_m / mpp, width=settings.width,
                                          pixel_stride=int(stride or 2))
                shadows = ShadowUpdates(name, training, data.source, data.tiles.clients)
                t0 = time.perf_counter()
                deltas = shadows.deltas(k, cands, theta, np.random.default_rng([seed, 37, k, 1]))
                record["seconds"][kind] = time.perf_counter() - t0
                for defence, upload in uploads.items():
                    templates = np.stack([clippers[defence](d) for d in deltas])
                    evidence = sum(profile_log_likelihood(u, templates, layout.index) for u in np.atleast_2d(upload))
                    best = cands[int(np.argmax(evidence))]
                    record["estimate"][f"{kind}|{defence}"] = best.tolist()
                    record["errors_m"][f"{kind}|{defence}"] = float(np.linalg.norm(best - truth) * mpp)
            records.append(record)
            print(json.dumps({key: record[key] for key in ("seed", "client", "candidates", "errors_m", "seconds")}),
                  flush=True)
            out_path.write_text(json.dumps({"records": records, "kinds": kinds}, indent=1))
    if not records:
        return
    print("RMSE (m) over", len(records), "sites:")
    for defence in sorted({key.split("|")[1] for key in records[0]["errors_m"]}):
        for kind in kinds:
            errs = np.array([r["errors_m"][f"{kind}|{defence}"] for r in records])
            same = np.mean([r["estimate"][f"{kind}|{defence}"] == r["estimate"][f"batched|{defence}"]
                            for r in records])
            secs = np.median([r["seconds"]["batched"] / r["seconds"][kind] for r in records])
            print(f"  {defence:9s} {kind:14s} RMSE {np.sqrt(np.mean(errs ** 2)):6.1f} m, same candidate as the full "
                  f"shadow on {same:.0%} of sites, median time ratio full / this {secs:.1f}")
    print(load_average(), flush=True)


if __name__ == "__main__":
    main()
