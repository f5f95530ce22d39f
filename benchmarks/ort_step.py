"""ORT training step over torch training step, same model, same batch, private and non-private, from one run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/ort_step.py [--adapter-width 256] [--batch 64]
                                            [--repeats 40] [--threads 1] [--no-loop]

Same model, same weights, same fixed batch, same thread count: the trainable camera
model ``shared.models.head`` (330,506 parameters with the 256-wide adapter) on Animal-MNIST backbone embeddings
(``dp_step.load_records``: EfficientNet-Lite0 at 128 px, cached). Timed steps (numpy in, numpy
out, as the gateway runs them):

- ``torch non-private`` / ``ORT non-private``: ``backend.gradient`` (one batched backward: torch autograd / the ORT
  training graph) + ``backend.apply_gradient``;
- ``torch CCDP`` / ``ORT CCDP``: ``CCDPMechanism.privatize(backend.per_example(x, y), categories)`` (clip, one
  summed-variance Gaussian from the secure source ``SecureRandom``, normalise) + ``apply_gradient``: the torch backend's
  per-example gradients are its ghost/windowed path, the ORT backend's the exported one-pass graph (for the head
  model its factor graph: layer inputs and output gradients, no (B, d) matrix);
- ``ORT CCDP, (B, d) rows`` (head model): the same step from the materialised per-example graph instead of the
  factor graph, to show what the factors save;
- ``ORT CCDP, batch-1 loop``: the alternative for full-model per-example gradients on ORT, one ``train_step`` of the
  training graph per example reading each ``CheckpointState`` parameter's gradient (docs/ort.md, "measured").

Steps are interleaved (each repeat runs every variant once, in rotating order) so that other load falls on all
alike; medians, 25-75 % ranges and minima are printed, with the ratios ORT / torch (target <= 1).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import numpy as np
from _timing import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter-width", type=int, default=256, help="head model: 0 = head only")
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
    from shared.models.kinds import model_spec

    from dp_step import load_records

    spec = model_spec("head", 10, adapter_width=args.adapter_width)
    x, y, source = load_records("head", args.batch)
    weights = spec.initial_weights(0, head_init="uniform")  # psi = 0 would block the adapter's gradient
    cats = (np.arange(args.batch) % 6 + 1).astype(np.int8)
    lr, clip, z = 0.1, 1.0, 1.0
    folder = ArtifactCache(tempfile.mkdtemp(prefix="wildfed-bench-")).store(
        model_hash(weights), build_artifacts(weights, model_hash=model_hash(weights)))
    secure = SecureRandom()
    mech = CCDPMechanism(clipping_norms={c: clip for c in IUCNCategory}, noise_std=z * clip,
                         expected_batch_size=float(args.batch), noise=secure)

    def make(kind: str):
        b = (TorchBackend(model=spec, threads=args.threads, microbatch_size=args.batch) if kind == "torch"
             else OrtBackend(model=spec, threads=args.threads, microbatch_size=args.batch, artifacts=folder))
        b.set_weights(weights)
        return b

    backends = {name: make(name.split()[0].lower()) for name in
                ("torch non-private", "ORT non-private", "torch CCDP", "ORT CCDP", "ORT rows", "ORT loop")}

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
    if spec.linear_only:
        rows_backend = backends["ORT rows"]

        def rows_step() -> None:
            from edge_sdk.privacy.per_example import MaterialisedGradients

            grads = MaterialisedGradients(rows_backend.per_example_gradients(x, y))
            rows_backend.apply_gradient(mech.privatize(grads, cats), lr)

        steps["ORT CCDP, (B, d) rows"] = rows_step
    if not args.no_loop:
        steps["ORT CCDP, batch-1 loop"] = loop_step
    times = interleaved(steps, args.repeats)

    print(f"{spec.kind} {spec.option_dict or ''} ({backends['ORT CCDP'].num_parameters:,} parameters), batch "
          f"{args.batch} ({source}), {args.threads} thread(s), {args.repeats} repeats, onnxruntime "
          f"{onnxruntime.__version__}, load average {os.getloadavg()[0]:.2f}")
    for name, t in times.items():
        q25, q50, q75 = np.percentile(t, [25, 50, 75]) * 1e3
        print(f"  {name:24s} median {q50:7.2f} ms  (25-75% {q25:6.2f}-{q75:6.2f})  min {t.min() * 1e3:7.2f} ms")
    med = {k: float(np.median(v)) for k, v in times.items()}
    low = {k: float(v.min()) for k, v in times.items()}
    for label, ort_name, torch_name in (("non-private", "ORT non-private", "torch non-private"),
                                        ("CCDP", "ORT CCDP", "torch CCDP")):
        print(f"  ORT / torch, {label:11s}: median {med[ort_name] / med[torch_name]:.2f}, "
              f"min {low[ort_name] / low[torch_name]:.2f}  (target <= 1)")
    if "ORT CCDP, (B, d) rows" in med:
        print(f"  (B, d) rows / factor graph (ORT CCDP): median {med['ORT CCDP, (B, d) rows'] / med['ORT CCDP']:.2f}")
    if "ORT CCDP, batch-1 loop" in med:
        print(f"  batch-1 loop / exported graph (ORT CCDP): median "
              f"{med['ORT CCDP, batch-1 loop'] / med['ORT CCDP']:.2f}")


if __name__ == "__main__":
    main()
