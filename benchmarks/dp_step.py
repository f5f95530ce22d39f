"""CCDP step time against the non-private step and against Opacus, from one run.

Run by hand (not part of the tests)::

    .venv/bin/pip install opacus==1.6.0   # only for this benchmark
    .venv/bin/python benchmarks/dp_step.py [--batch 64] [--repeats 40] [--threads 2]

Same model (``shared.models.camera_cnn``), same real Animal-MNIST images, same thread count. Timed steps:

- ``plain torch``: the non-private baseline, a plain batched torch loop (``zero_grad``, forward, mean cross-entropy,
  ``backward``, ``torch.optim.SGD.step``) on a fixed batch of ``--batch`` images already held as tensors;
- ``backend non-private``: the same step via the torch backend (``gradient`` + ``apply_gradient``, numpy in and
  out), to check the backend adds nothing over the plain loop;
- ``CCDP (training step)``: exactly what the gateway runs per step, ``edge_sdk.training.local_step``: Poisson
  sampling with q = batch / N over N = 10 * batch records whose categories cover all six IUCN categories (all
  active), implicit per-example gradients (``backend.per_example``), ``CCDPMechanism.privatize`` (clip, one
  summed-variance Gaussian from the secure AES-CTR source, normalise by q N), SGD update. The realised batch is
  Poisson, with mean ``--batch``;
- ``CCDP (fixed batch)``: the same mechanism and update on the non-private step's fixed batch (no sampling), the
  like-for-like comparison with the baseline;
- ``Opacus 1.6``: ``PrivacyEngine.make_private`` (hooks-based per-sample gradients, flat clipping, one noise draw,
  ``secure_mode=False``) with the same noise multiplier, clipping norm and fixed batch (Poisson sampling off).

Steps are interleaved (each repeat runs every variant once, in rotating order) so that load from other processes
falls on all of them alike; the median, the 25-75% range and the minimum of ``--repeats`` repeats are printed
after warm-up, with the ratios CCDP / non-private (target <= 1.3) and CCDP / Opacus, of the medians and of the
minima (on a shared machine the minimum is the estimate least disturbed by other processes; the CCDP training
step's minimum also reflects its smallest Poisson batch, so compare its medians). On a machine with other load,
``--threads 1`` gives far steadier numbers than more threads (intra-op thread barriers wait on descheduled threads).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import numpy as np
from _timing import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from wildfed_sim.animal_mnist import fetch_animal_mnist
    from edge_sdk.backends.torch_backend import TorchBackend
    from edge_sdk.data.camtrap_dp import LocalDataset
    from edge_sdk.privacy.ccdp import CCDPMechanism
    from edge_sdk.privacy.randomness import SecureRandom
    from edge_sdk.training import local_step
    from shared.iucn import IUCNCategory
    from shared.models.camera_cnn import build_model, initial_weights, load_numpy_state

    torch.set_num_threads(args.threads)
    data = fetch_animal_mnist()
    rng = np.random.default_rng(0)
    n_records = 10 * args.batch
    pick = rng.choice(len(data.labels), size=n_records, replace=False)
    site = LocalDataset(images=np.ascontiguousarray(data.images[pick]), labels=data.labels[pick].astype(np.int64),
                        categories=(np.arange(n_records) % 6 + 1).astype(np.int8),  # CR..NE, all six
                        media_ids=tuple(str(i) for i in range(n_records)))
    x, y, cats = site.images[:args.batch], site.labels[:args.batch], site.categories[:args.batch]
    weights = initial_weights(10, seed=0)
    lr, clip, z = 0.1, 1.0, 1.0
    q = args.batch / n_records

    # Non-private: plain torch loop.
    model = build_model(10)
    load_numpy_state(model, weights)
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xt = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    yt = torch.from_numpy(y)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()

    # Non-private: the backend.
    backend_np = TorchBackend(10, threads=args.threads)
    backend_np.set_weights(weights)

    def backend_step() -> None:
        backend_np.apply_gradient(backend_np.gradient(x, y), lr)

    # CCDP: the gateway's per-step code, all six categories active, secure randomness.
    secure = SecureRandom()
    mech = CCDPMechanism(clipping_norm=clip, noise_multipliers={c: z for c in IUCNCategory},
                         expected_batch_size=q * n_records, noise=secure)
    eligible = np.ones(n_records, dtype=bool)
    backend_dp = TorchBackend(10, threads=args.threads)
    backend_dp.set_weights(weights)
    realised: list[int] = []

    def ccdp_training_step() -> None:
        realised.append(local_step(backend=backend_dp, dataset=site, eligible=eligible, sampling_rate=q,
                                   mechanism=mech, randomness=secure, learning_rate=lr))

    backend_fx = TorchBackend(10, threads=args.threads)
    backend_fx.set_weights(weights)

    def ccdp_fixed_step() -> None:
        backend_fx.apply_gradient(mech.privatize(backend_fx.per_example(x, y), cats), lr)

    steps: dict[str, Callable[[], None]] = {
        "plain torch (non-private)": plain_step,
        "backend non-private": backend_step,
        "CCDP (training step)": ccdp_training_step,
        "CCDP (fixed batch)": ccdp_fixed_step,
    }
    try:
        import warnings

        from opacus import PrivacyEngine
        warnings.filterwarnings("ignore")
        omodel = build_model(10)
        load_numpy_state(omodel, weights)
        oopt = torch.optim.SGD(omodel.parameters(), lr=lr)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt, yt), batch_size=args.batch)
        engine = PrivacyEngine(secure_mode=False)
        omodel, oopt, _ = engine.make_private(module=omodel, optimizer=oopt, data_loader=loader,
                                              noise_multiplier=z, max_grad_norm=clip, poisson_sampling=False)

        def opacus_step() -> None:
            oopt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(omodel(xt), yt).backward()
            oopt.step()

        steps["Opacus 1.6"] = opacus_step
    except ImportError:
        print("opacus not installed: `pip install opacus==1.6.0` to include it")

    times = interleaved(steps, args.repeats)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"model {backend_np.num_parameters:,} parameters, batch {args.batch} (CCDP training step: Poisson, "
          f"mean {np.mean(realised):.1f}), threads {args.threads}, {args.repeats} interleaved repeats")
    low = {name: float(np.min(t)) for name, t in times.items()}
    for name, t in times.items():
        lo, hi = np.percentile(t, [25, 75])
        print(f"{name:27s}: median {med[name] * 1e3:8.2f} ms   (25-75%: {lo * 1e3:.2f}-{hi * 1e3:.2f}, "
              f"min {low[name] * 1e3:.2f})")
    print("ratios of medians (of minima, the least disturbed by other load, in brackets):")
    base = "plain torch (non-private)"

    def ratio(a: str, b: str) -> str:
        return f"{med[a] / med[b]:5.2f}x ({low[a] / low[b]:4.2f}x)"

    print(f"backend non-private / plain torch      : {ratio('backend non-private', base)}")
    for name in ("CCDP (training step)", "CCDP (fixed batch)"):
        line = f"{name + ' / non-private':39s}: {ratio(name, base)}  target <= 1.3x"
        if "Opacus 1.6" in med:
            line += f"   / Opacus {ratio(name, 'Opacus 1.6')}"
        print(line)


if __name__ == "__main__":
    main()
