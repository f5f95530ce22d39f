"""The backbone's input size, chosen by measurement: linear-probe accuracy and embedding speed per size S.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/input_size.py [--sizes 64 96 128 160 224] [--train 2000] [--test 2000] [--threads 2]

For each S: ``--train`` training and ``--test`` held-out Animal-MNIST images (the demo's split,
``split_holdout(seed=0)``, a seeded random subset of each) are embedded exactly as the gateway and the demo's
evaluation embed them (``wildfed_sim.embeddings.embed_grayscale``: Pillow RGB, bicubic to S px, the frozen
EfficientNet-Lite0 on ONNX Runtime), into a fresh temporary cache so that every size is timed from scratch;
then a linear head is trained non-privately on the training embeddings (``wildfed_sim.evaluation.train_centralised``,
20 epochs, batch 128, lr 10, the demo's non-private step) and evaluated on the held-out ones. Printed per size:
the probe's accuracy, images embedded per second (the whole embedding call, Pillow included), and both relative to
S = 128, the product's default (``shared.models.backbone.DEFAULT_INPUT_SIZE``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128, 160, 224])
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from shared.models.backbone import DEFAULT_INPUT_SIZE
    from wildfed_sim.animal_mnist import SPECIES_TABLE, fetch_animal_mnist, split_holdout
    from wildfed_sim.embeddings import embed_grayscale
    from wildfed_sim.evaluation import evaluate, train_centralised

    train, test = split_holdout(fetch_animal_mnist(), 0.2, seed=0)
    rng = np.random.default_rng(0)
    tr = np.sort(rng.choice(len(train.labels), size=min(args.train, len(train.labels)), replace=False))
    te = np.sort(rng.choice(len(test.labels), size=min(args.test, len(test.labels)), replace=False))
    categories = [e.iucn for e in SPECIES_TABLE]
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="wildfed-size-") as cache:
            t0 = time.perf_counter()
            f_train = embed_grayscale(train.images[tr], train.source_indices[tr], cache_root=cache, input_size=size,
                                      threads=args.threads)
            f_test = embed_grayscale(test.images[te], test.source_indices[te], cache_root=cache, input_size=size,
                                     threads=args.threads)
            seconds = time.perf_counter() - t0
        weights = train_centralised(f_train, train.labels[tr].astype(np.int64), num_classes=len(SPECIES_TABLE),
                                    epochs=20, batch_size=128, learning_rate=10.0, seed=0)
        accuracy = evaluate(weights, f_test, test.labels[te], categories).by_group["overall"]
        rate = (len(tr) + len(te)) / seconds
        rows.append((size, accuracy, rate))
        print(f"S = {size:3d} px: probe {100 * accuracy:5.1f} %   {rate:6.1f} images/s", flush=True)
    ref = {s: (a, r) for s, a, r in rows}.get(DEFAULT_INPUT_SIZE)
    print(f"\n{len(tr)} training and {len(te)} held-out images, {args.threads} ORT threads, load average "
          f"{os.getloadavg()[0]:.2f}")
    print("| S (px) | linear probe | images/s | accuracy - S=128 | speed / S=128 |")
    print("|---|---|---|---|---|")
    for size, accuracy, rate in rows:
        rel = (f"{100 * (accuracy - ref[0]):+.1f} pts | {rate / ref[1]:.2f}x" if ref else "- | -")
        print(f"| {size} | {100 * accuracy:.1f} % | {rate:.0f} | {rel} |")


if __name__ == "__main__":
    main()
