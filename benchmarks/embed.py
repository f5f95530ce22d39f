"""Backbone embedding throughput (ONNX Runtime CPU vs torch) and the embedding cache's size per 10,000 records.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/embed.py [--input-size 128] [--batch 32] [--repeats 5] [--threads 2] [--records 10000]

What is timed, in one run, interleaved (``_timing.interleaved``: rotating order, so load from other processes on a
shared machine falls on both alike): one ``embed`` call on the same normalised float32 (B, 3, S, S) batch by

- ``ort-cpu``: ``edge_sdk.inference.embedder.OnnxEmbedder`` on ONNX Runtime's CPU provider (what an x86 gateway
  without a GPU runs);
- ``torch``: ``TorchEmbedder`` (the ``shared.models.backbone`` module, eval mode, ``torch.no_grad``).

Both are given ``--threads`` threads. The batch is real ENA24 square-ish crops (the photos' centre squares) when
``../shared/data/ena24-small`` or the committed subset is there, which only matters for realism, not for time.
Printed: the median and minimum seconds per call, embeddings per second from the median, and the ratio
ort-cpu / torch. TensorRT FP16 vs ONNX Runtime CUDA needs an accelerator (not measured here; see
``benchmarks/detector.py`` for the engine comparison on a GPU).

Then the embedding cache (``edge_sdk.data.embedding_cache.EmbeddingCache``): ``--records`` records with a crop box
each, put in chunks of 1,000 as the gateway does, bytes on disk reported (``size_bytes``: the shard files), against
the raw size n x 1280 x 4 bytes of the float32 embeddings. Also printed: the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def load() -> str:
    """The 1, 5, 15 minute load averages as text."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def batch_of_photos(size: int, n: int) -> np.ndarray:
    """float32 (n, 3, size, size): centre squares of the ENA24 photos (repeated as needed) as network input."""
    from PIL import Image

    from shared.models.backbone import preprocess_image
    from wildfed_sim.detections import demo_photos

    photos = demo_photos()[:21]
    out = []
    for i in range(n):
        with Image.open(photos[i % len(photos)]) as im:
            side = min(im.size)
            left, top = (im.width - side) // 2, (im.height - side) // 2
            out.append(preprocess_image(im.crop((left, top, left + side, top + side)), size))
    return np.stack(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-size", type=int, default=None, help="S in px (default: DEFAULT_INPUT_SIZE)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--records", type=int, default=10_000, help="records for the cache-size measurement")
    args = parser.parse_args()

    import torch

    from _timing import interleaved
    from edge_sdk.data.embedding_cache import EmbeddingCache
    from edge_sdk.inference.embedder import OnnxEmbedder, TorchEmbedder
    from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, EMBEDDING_DIM, backbone_id

    size = args.input_size or DEFAULT_INPUT_SIZE
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"torch {torch.__version__}; load average before: {load()}")
    x = batch_of_photos(size, args.batch)
    ort = OnnxEmbedder.open(size, prefer="ort", threads=args.threads, batch_size=args.batch)
    ref = TorchEmbedder(size, threads=args.threads, batch_size=args.batch)
    diff = float(np.abs(ort.embed(x) - ref.embed(x)).max())
    times = interleaved({"ort-cpu": lambda: ort.embed(x), "torch": lambda: ref.embed(x)}, args.repeats, warmup=2)
    print(f"\nembeddings, {size} px, batch {args.batch}, {args.threads} threads, {args.repeats} interleaved repeats "
          f"(max |ort - torch| = {diff:.2e})")
    print(f"{'engine':10s} {'median s':>10s} {'min s':>8s} {'emb/s':>8s}")
    rate = {}
    for name, t in times.items():
        med = statistics.median(t)
        rate[name] = args.batch / med
        print(f"{name:10s} {med:10.3f} {min(t):8.3f} {rate[name]:8.1f}")
    print(f"ratio ort-cpu / torch (embeddings per second): {rate['ort-cpu'] / rate['torch']:.2f}x")

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        cache = EmbeddingCache(tmp, backbone_id=backbone_id(DEFAULT_BACKBONE, size), input_size=size)
        t0 = time.perf_counter()
        for start in range(0, args.records, 1000):
            n = min(1000, args.records - start)
            ids = [f"media-{start + i:06d}" for i in range(n)]
            boxes = [(10.0, 20.0, 110.0, 140.0)] * n
            emb = rng.uniform(0, 6, size=(n, EMBEDDING_DIM)).astype(np.float32)
            cache.put(ids, emb, boxes)
        elapsed = time.perf_counter() - t0
        on_disk = cache.size_bytes()
    raw = args.records * EMBEDDING_DIM * 4
    per_10k = on_disk * 10_000 / args.records
    print(f"\nembedding cache: {args.records} records -> {on_disk / 2**20:.1f} MiB on disk "
          f"({per_10k / 2**20:.1f} MiB per 10,000 records; raw float32 embeddings {raw / 2**20:.1f} MiB, overhead "
          f"{100 * (on_disk / raw - 1):.1f}%); written in {elapsed:.1f} s in chunks of 1,000")
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
