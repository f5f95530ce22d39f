"""CCDP step time against the non-private step of the same trainable model (and against Opacus), from one run.

Run by hand (not part of the tests)::

    .venv/bin/pip install opacus==1.6.0   # optional, only for the Opacus row
    .venv/bin/python benchmarks/dp_step.py [--adapter-width 256] [--batch 64] [--repeats 40]
                                           [--threads 1] [--clock cpu] [--previous-noise]

It times the trainable part of the camera model, ``shared.models.head`` (phi adapter
1280 -> ``--adapter-width``, tanh, psi head; ``--adapter-width 0``: head only) on real backbone embeddings:
N Animal-MNIST images embedded once, before timing (and cached), by the frozen EfficientNet-Lite0 at 128 px (ONNX
Runtime); the backbone is public and frozen, so its cost is the same with and without privacy and is not part of
either step. Same model, same data, same thread
count in every row. Timed steps:

- ``plain torch``: the non-private baseline, a plain batched torch loop (``zero_grad``, forward, mean cross-entropy,
  ``backward``, ``torch.optim.SGD.step``) on a fixed batch of ``--batch`` examples already held as tensors;
- ``backend non-private``: the same step via the torch backend (``gradient`` + ``apply_gradient``, numpy in and
  out), to check the backend adds nothing over the plain loop;
- ``CCDP (training step)``: exactly what the gateway runs per step, ``edge_sdk.training.local_step``: Poisson
  sampling with q = batch / N over N = min(10 * batch, 10,000) records whose categories cover all six IUCN
  categories (all active), implicit per-example gradients (``backend.per_example``: one forward and one
  backward, no (B, d) matrix),
  ``CCDPMechanism.privatize`` (clip, one Gaussian draw of d values from the secure source
  ``shared.privacy.randomness.SecureRandom``, normalise by q N), SGD update. The realised batch is Poisson,
  with mean ``--batch``;
- ``non-private (training step)``: the same ``local_step`` with no mechanism (Poisson sampling from the site, the
  mean gradient, SGD update): what a non-private round runs per step, the like-for-like baseline of the CCDP
  training step;
- ``CCDP (fixed batch)``: the same mechanism and update on the non-private step's fixed batch (no sampling), the
  like-for-like comparison with the baseline;
- ``secure noise draw``: ``SecureRandom.standard_normal(d)`` alone, the part of the DP step whose cost grows with d
  and not with the batch (so the ratio DP / non-private falls towards 1 as the batch grows);
- with ``--round-steps S`` (default 20; 0: not), ``round: non-private``, ``round: CCDP`` and ``round: CCDP, noise
  ahead``: rounds of S back-to-back ``local_step`` calls, as ``train_locally`` runs them, the last with the round's
  noise drawn one step ahead on a second thread (``shared.privacy.noise_prefetch.PrefetchedNormals``, started and
  closed inside the timed round; ``train_locally`` does this only from ``PREFETCH_MIN_SIZE`` parameters). Timed
  per round, so the worker's draws fall inside the round they serve (with ``--clock cpu`` its CPU time counts);
- with ``--previous-noise``, ``CCDP (training step), polar`` and ``polar noise draw``: the same training step and
  draw on the secure source used before the cipher-speed one (``_polar_noise.PolarAes256``: AES-256-CTR from
  ``cryptography``, the polar method in numpy), for a before/after comparison within one run;
- ``Opacus 1.6``: ``PrivacyEngine.make_private`` (hooks-based per-sample gradients, flat clipping, one noise draw,
  ``secure_mode=False``) with the same noise multiplier, clipping norm and fixed batch (Poisson sampling off).

Steps are interleaved (each repeat runs every variant once, in rotating order) so that load from other processes
falls on all of them alike; the median, the 25-75% range and the minimum of ``--repeats`` repeats are printed
after warm-up, with the ratios CCDP / non-private (target <= 1.1 for the head model), the same
without the noise draw, and CCDP / Opacus, of the medians and of the minima (on a shared machine the minimum is the
estimate least disturbed by other processes; the CCDP training step's minimum also reflects its smallest Poisson
batch, so compare its medians). On a machine with other load, ``--threads 1`` gives far steadier numbers than more
threads (intra-op thread barriers wait on descheduled threads), and ``--clock cpu`` with ``--threads 1`` times each
step by this process's CPU time, leaving out the time other processes hold the CPU.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from _timing import interleaved


def load_records(model: str, n_records: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(inputs, int64 labels, description) of ``n_records`` Animal-MNIST records (at most the 10,000 there are) as
    ``model`` takes them. Embeddings go through the gateway's embedding cache (``edge_sdk.data.embedding_cache``,
    under ``<wildfed cache>/benchmark-embeddings``), so a second run does not embed again."""
    try:
        from wildfed_sim.animal_mnist import fetch_animal_mnist
    except ImportError:  # before the move of the experiments
        from coordinator.experiments.animal_mnist import fetch_animal_mnist

    data = fetch_animal_mnist()
    n_records = min(n_records, len(data.labels))
    pick = np.random.default_rng(0).choice(len(data.labels), size=n_records, replace=False)
    images, labels = np.ascontiguousarray(data.images[pick]), data.labels[pick].astype(np.int64)
    from edge_sdk.data.embedding_cache import EmbeddingCache
    from edge_sdk.inference.embedder import OnnxEmbedder
    from edge_sdk.inference.weights import cache_dir
    from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, backbone_id, preprocess_grayscale

    size = DEFAULT_INPUT_SIZE
    cache = EmbeddingCache(cache_dir() / "benchmark-embeddings", backbone_id=backbone_id(DEFAULT_BACKBONE, size),
                           input_size=size)
    embedder: list = []

    def compute(idx: np.ndarray) -> np.ndarray:
        if not embedder:
            embedder.append(OnnxEmbedder.open(size, prefer="ort", threads=1))
        return embedder[0].embed(preprocess_grayscale(images[idx], size))

    feats = cache.get_or_compute([f"animal-mnist/{i}" for i in pick], None, compute)
    return feats, labels, f"Animal-MNIST embeddings (EfficientNet-Lite0, {size} px, ORT)"


class _Records:
    """The benchmark's records in the shape ``edge_sdk.training.TrainingInputs`` reads."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, categories: np.ndarray) -> None:
        self.images, self.labels, self.categories = images, labels, categories

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter-width", type=int, default=256, help="head model: 0 = head only")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or this process's CPU time (with --threads 1: other load left out)")
    parser.add_argument("--round-steps", type=int, default=20,
                        help="also time rounds of this many back-to-back local steps (0: not)")
    parser.add_argument("--previous-noise", action="store_true",
                        help="also time the CCDP step and the draw on the previous (polar, AES-256-CTR) source")
    args = parser.parse_args()

    import torch

    from edge_sdk.backends.torch_backend import TorchBackend
    from edge_sdk.privacy.ccdp import CCDPMechanism
    from edge_sdk.privacy.randomness import SecureRandom
    from edge_sdk.training import TrainingInputs, local_step
    from shared.privacy.noise_prefetch import PrefetchedNormals
    from shared.iucn import IUCNCategory
    from shared.models.kinds import model_spec
    from shared.models.state import load_numpy_state

    torch.set_num_threads(args.threads)
    spec = model_spec("head", 10, adapter_width=args.adapter_width)
    inputs, labels, source = load_records("head", 10 * args.batch)
    n_records = len(labels)
    categories = (np.arange(n_records) % 6 + 1).astype(np.int8)  # CR..NE, all six

    # what the gateway's local_step reads: the site's records prepared once (edge_sdk.training.TrainingInputs:
    # each record's squared input norm measured once, not at every step)
    site = TrainingInputs(_Records(inputs, labels, categories))

    x, y, cats = inputs[:args.batch], labels[:args.batch], categories[:args.batch]
    # the head at zero (the default round-0 model) would block the adapter's gradient: time a trained-like state
    weights = spec.initial_weights(0, head_init="uniform")
    lr, clip, z = 0.1, 1.0, 1.0
    q = args.batch / n_records

    # Non-private: plain torch loop.
    model = spec.build()
    load_numpy_state(model, weights)
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xt = torch.from_numpy(spec.prepare_input(x))
    yt = torch.from_numpy(y)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()

    def backend() -> TorchBackend:
        b = TorchBackend(model=spec, threads=args.threads, microbatch_size=max(256, args.batch))
        b.set_weights(weights)
        return b

    backend_np = backend()

    def backend_step() -> None:
        backend_np.apply_gradient(backend_np.gradient(x, y), lr)

    # CCDP: the gateway's per-step code, all six categories active, secure randomness.
    secure = SecureRandom()
    mech = CCDPMechanism(clipping_norms={c: clip for c in IUCNCategory}, noise_std=z * clip,
                         expected_batch_size=q * n_records, noise=secure)
    rates = np.full(n_records, q)  # every record at the base rate (what "scale" and the anchor category run)
    backend_dp = backend()
    realised: list[int] = []

    def ccdp_training_step() -> None:
        realised.append(local_step(backend=backend_dp, dataset=site, inclusion_rates=rates,
                                   mechanism=mech, randomness=secure, learning_rate=lr))

    backend_nt = backend()

    def non_private_training_step() -> None:  # the same local_step, mechanism None: Poisson batch, mean gradient
        local_step(backend=backend_nt, dataset=site, inclusion_rates=rates, mechanism=None,
                   randomness=secure, learning_rate=lr)

    backend_fx = backend()

    def ccdp_fixed_step() -> None:
        backend_fx.apply_gradient(mech.privatize(backend_fx.per_example(x, y), cats), lr)

    d = backend_np.num_parameters
    backend_r = backend()

    def round_of_steps(mechanism: CCDPMechanism | None, ahead: bool) -> Callable[[], None]:
        """``--round-steps`` back-to-back local steps, as ``train_locally`` runs them (the noise drawn ahead on a
        second thread when ``ahead``: ``PrefetchedNormals``, started and closed inside the timed round)."""
        def run() -> None:
            prefetch = PrefetchedNormals(secure, size=d, count=args.round_steps) if ahead else None
            mech_r = replace(mechanism, noise=prefetch) if ahead else mechanism
            try:
                for _ in range(args.round_steps):
                    local_step(backend=backend_r, dataset=site, inclusion_rates=rates, mechanism=mech_r,
                               randomness=secure, learning_rate=lr)
            finally:
                if prefetch is not None:
                    prefetch.close()
        return run

    def noise_draw() -> None:
        secure.standard_normal(d)

    steps: dict[str, Callable[[], None]] = {
        "plain torch (non-private)": plain_step,
        "backend non-private": backend_step,
        "non-private (training step)": non_private_training_step,
        "CCDP (training step)": ccdp_training_step,
        "CCDP (fixed batch)": ccdp_fixed_step,
        "secure noise draw": noise_draw,
    }
    if args.round_steps:
        steps["round: non-private"] = round_of_steps(None, False)
        steps["round: CCDP"] = round_of_steps(mech, False)
        steps["round: CCDP, noise ahead"] = round_of_steps(mech, True)
    if args.previous_noise:
        from _polar_noise import PolarAes256

        polar = PolarAes256()
        mech_polar = CCDPMechanism(clipping_norms={c: clip for c in IUCNCategory}, noise_std=z * clip,
                                   expected_batch_size=q * n_records, noise=polar)
        backend_polar = backend()

        def ccdp_polar_step() -> None:
            local_step(backend=backend_polar, dataset=site, inclusion_rates=rates, mechanism=mech_polar,
                       randomness=polar, learning_rate=lr)

        steps["CCDP (training step), polar"] = ccdp_polar_step
        steps["polar noise draw"] = lambda: polar.standard_normal(d)
    try:
        import warnings

        from opacus import PrivacyEngine
        warnings.filterwarnings("ignore")
        omodel = spec.build()
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

    import time

    times = interleaved(steps, args.repeats, clock=time.process_time if args.clock == "cpu" else time.perf_counter)
    med = {name: float(np.median(t)) for name, t in times.items()}
    low = {name: float(np.min(t)) for name, t in times.items()}
    print(f"model {spec.kind} {spec.option_dict or ''}: {d:,} trainable parameters; {source}; batch {args.batch} "
          f"(CCDP training step: Poisson, mean {np.mean(realised):.1f}); threads {args.threads}; clock {args.clock}; "
          f"{args.repeats} interleaved repeats; load average {os.getloadavg()[0]:.2f}")
    for name, t in times.items():
        lo, hi = np.percentile(t, [25, 75])
        print(f"{name:27s}: median {med[name] * 1e3:8.2f} ms   (25-75%: {lo * 1e3:.2f}-{hi * 1e3:.2f}, "
              f"min {low[name] * 1e3:.2f})")
    print("ratios of medians (of minima, the least disturbed by other load, in brackets):")
    base = "plain torch (non-private)"
    target = 1.1

    def ratio(a: str, b: str) -> str:
        return f"{med[a] / med[b]:5.2f}x ({low[a] / low[b]:4.2f}x)"

    print(f"backend non-private / plain torch      : {ratio('backend non-private', base)}")
    for name in ("CCDP (training step)", "CCDP (fixed batch)"):
        line = f"{name + ' / non-private':39s}: {ratio(name, base)}  target <= {target}x"
        if "Opacus 1.6" in med:
            line += f"   / Opacus {ratio(name, 'Opacus 1.6')}"
        print(line)
    print(f"{'CCDP (training step) / same, non-private':39s}: "
          f"{ratio('CCDP (training step)', 'non-private (training step)')}  target <= {target}x  (both sample a "
          "Poisson batch from the site, as local_step does)")
    noise = "secure noise draw"
    fixed = "CCDP (fixed batch)"
    print(f"{'CCDP (fixed batch) - noise / non-private':39s}: {(med[fixed] - med[noise]) / med[base]:5.2f}x "
          f"({(low[fixed] - low[noise]) / low[base]:4.2f}x)  the per-example part alone")
    print(f"{'noise draw / non-private':39s}: {ratio(noise, base)}  (d = {d:,} Gaussians per step)")
    if args.round_steps:
        rounds = ("round: CCDP", "round: CCDP, noise ahead")
        print(f"rounds of {args.round_steps} back-to-back steps, per step: non-private "
              f"{med['round: non-private'] / args.round_steps * 1e3:.3f} ms; " + "; ".join(
                  f"{name[7:]} {med[name] / args.round_steps * 1e3:.3f} ms" for name in rounds))
        for name in rounds:
            print(f"{name + ' / non-private':39s}: {ratio(name, 'round: non-private')}  target <= 1.3x")
    if args.previous_noise:
        print(f"{'CCDP (training step), polar / non-priv.':39s}: {ratio('CCDP (training step), polar', base)}   "
              f"/ same, non-private {ratio('CCDP (training step), polar', 'non-private (training step)')}")
        print(f"{'polar noise draw / non-private':39s}: {ratio('polar noise draw', base)}")
        print(f"{'polar noise draw / secure noise draw':39s}: {ratio('polar noise draw', noise)}  (the speed-up)")


if __name__ == "__main__":
    main()
