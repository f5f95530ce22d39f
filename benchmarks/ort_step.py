"""ORT training step over torch training step, same model, same batch, private and non-private, from one run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/ort_step.py [--batch 64] [--repeats 40] [--threads 1]

Same camera CNN (``shared.models.camera_cnn``, 33,194 parameters), same weights, same fixed batch (Animal-MNIST
images when they are cached, else random pixels), same thread count. Timed steps (numpy in, numpy out, as the
gateway runs them):

- ``torch non-private`` / ``ORT non-private``: ``backend.gradient`` (one batched backward: torch autograd / the ORT
  training graph) + ``backend.apply_gradient``;
- ``torch CCDP`` / ``ORT CCDP``: ``CCDPMechanism.privatize(backend.per_example(x, y), categories)`` (clip, one
  summed-variance Gaussian from the secure AES-CTR source, normalise) + ``apply_gradient``: the torch backend's
  per-example gradients are its ghost/windowed path, the ORT backend's the exported one-pass graph;
- ``ORT CCDP, batch-1 loop``: the alternative for full-model per-example gradients on ORT, one ``train_step`` of the
  training graph per example reading each ``CheckpointState`` parameter's gradient (docs/ort.md, "measured").

Steps are interleaved (each repeat runs every variant once, in rotating order) so that other load falls on all
alike; medians, 25-75 % ranges and minima are printed, with the ratios ORT / torch (target <= 1).
"""

from __future__ import annotations

import argparse
import tempfile
import numpy as np
from _timing import interleaved


def _images(batch: int) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from wildfed_sim.animal_mnist import fetch_animal_mnist

        data = fetch_animal_mnist()
        pick = np.random.default_rng(0).choice(len(data.labels), size=batch, replace=False)
        return np.ascontiguousarray(data.images[pick]), data.labels[pick].astype(np.int64), "Animal-MNIST"
    except Exception:  # noqa: BLE001 - offline without the cached data set: random pixels time the same
        rng = np.random.default_rng(0)
        return (rng.integers(0, 256, (batch, 28, 28), dtype=np.uint8), rng.integers(0, 10, batch).astype(np.int64),
                "random pixels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-loop", action="store_true", help="skip the batch-1 loop variant")
    args = parser.parse_args()

    import onnxruntime

    from coordinator.artifacts import build_artifacts
    from edge_sdk.backends.ort_backend import ArtifactCache, OrtBackend
    from edge_sdk.backends.torch_backend import TorchBackend
    from edge_sdk.privacy.ccdp import CCDPMechanism
    from edge_sdk.privacy.randomness import SecureRandom
    from shared.codec import model_hash
    from shared.iucn import IUCNCategory
    from shared.models.camera_cnn import initial_weights

    x, y, source = _images(args.batch)
    cats = (np.arange(args.batch) % 6 + 1).astype(np.int8)
    weights = initial_weights(10, seed=0)
    lr, clip, z = 0.1, 1.0, 1.0
    folder = ArtifactCache(tempfile.mkdtemp(prefix="wildfed-bench-")).store(
        model_hash(weights), build_artifacts(weights, 10, model_hash=model_hash(weights)))
    secure = SecureRandom()
    mech = CCDPMechanism(clipping_norm=clip, noise_multipliers={c: z for c in IUCNCategory},
                         expected_batch_size=float(args.batch), noise=secure)

    def make(kind: str):
        b = (TorchBackend(10, threads=args.threads, microbatch_size=args.batch) if kind == "torch"
             else OrtBackend(10, threads=args.threads, microbatch_size=args.batch, artifacts=folder))
        b.set_weights(weights)
        return b

    backends = {name: make(name.split()[0].lower()) for name in
                ("torch non-private", "ORT non-private", "torch CCDP", "ORT CCDP", "ORT loop")}

    def plain(b):
        return lambda: b.apply_gradient(b.gradient(x, y), lr)

    def private(b):
        return lambda: b.apply_gradient(mech.privatize(b.per_example(x, y), cats), lr)

    loop_backend = backends["ORT loop"]

    def loop_step() -> None:
        from edge_sdk.privacy.per_example import MaterialisedGradients

        b = loop_backend
        b._sync_module()
        b._module.train()
        images = b._inputs(x)
        rows = np.empty((args.batch, b.num_parameters), np.float32)
        for i in range(args.batch):
            b._module.lazy_reset_grad()
            b._module(images[i:i + 1], y[i:i + 1])
            rows[i] = np.concatenate([b._state.parameters[s.name].grad.reshape(-1) for s in b.parameter_layout])
        b.apply_gradient(mech.privatize(MaterialisedGradients(rows), cats), lr)

    steps = {"torch non-private": plain(backends["torch non-private"]),
             "ORT non-private": plain(backends["ORT non-private"]),
             "torch CCDP": private(backends["torch CCDP"]),
             "ORT CCDP": private(backends["ORT CCDP"])}
    if not args.no_loop:
        steps["ORT CCDP, batch-1 loop"] = loop_step
    times = interleaved(steps, args.repeats)

    print(f"camera CNN, batch {args.batch} ({source}), {args.threads} thread(s), {args.repeats} repeats, "
          f"onnxruntime {onnxruntime.__version__}")
    for name, t in times.items():
        q25, q50, q75 = np.percentile(t, [25, 50, 75]) * 1e3
        print(f"  {name:24s} median {q50:7.2f} ms  (25-75% {q25:6.2f}-{q75:6.2f})  min {t.min() * 1e3:7.2f} ms")
    med = {k: float(np.median(v)) for k, v in times.items()}
    low = {k: float(v.min()) for k, v in times.items()}
    for label, ort_name, torch_name in (("non-private", "ORT non-private", "torch non-private"),
                                        ("CCDP", "ORT CCDP", "torch CCDP")):
        print(f"  ORT / torch, {label:11s}: median {med[ort_name] / med[torch_name]:.2f}, "
              f"min {low[ort_name] / low[torch_name]:.2f}  (target <= 1)")
    if "ORT CCDP, batch-1 loop" in med:
        print(f"  batch-1 loop / exported graph (ORT CCDP): median "
              f"{med['ORT CCDP, batch-1 loop'] / med['ORT CCDP']:.2f}")


if __name__ == "__main__":
    main()
