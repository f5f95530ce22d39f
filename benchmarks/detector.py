"""Detector throughput (images/s) on ONNX Runtime CPU, and TensorRT FP16 over ORT CUDA where a GPU exists.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/detector.py [--batch 8] [--repeats 10] [--threads 2] [--images DIR]

What is timed, per engine, on the same batches of real camera-trap photos (``../shared/data/camtrapr-sample`` by
default; synthetic noise images when that folder is absent):

- ``engine``: the engine call alone on a preprocessed (B, 3, 640, 640) batch (the number the TensorRT / ORT ratio
  is about);
- ``end to end``: :meth:`YoloxDetector.detect` on PIL images: preprocessing (pad/resize to 640) + engine + numpy
  decode and NMS, i.e. what ``wildfed-edge detect`` sustains apart from JPEG decoding.

Each is the median over ``--repeats`` passes after two warm-up passes, reported as images per second. Engines:
``ort-cpu`` always; ``ort-cuda`` when the installed ONNX Runtime has the CUDA provider; ``tensorrt-fp16`` when a GPU
and TensorRT are present (the engine is built or taken from the cache first; build time is printed, not timed).
What is not available is printed as skipped, with the reason. Target on a GPU: TensorRT FP16 >= 3x ORT CUDA.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _timing import load_average  # noqa: E402  (the script's folder)
from edge_sdk.inference.detector import YoloxDetector, detector_onnx, preprocess  # noqa: E402
from edge_sdk.inference.engines import (EngineCache, EngineError, InferenceEngine, OrtEngine,  # noqa: E402
                                        TensorRTBuilder, ort_providers, probe_gpu)

SAMPLE = ROOT.parent / "shared" / "data" / "camtrapr-sample"


def _images(folder: Path | None, count: int) -> list[Image.Image]:
    if folder is not None and folder.is_dir():
        paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        images = [Image.open(p).convert("RGB") for p in paths]
        if images:
            return (images * (count // len(images) + 1))[:count]
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)) for _ in range(count)]


def _median_rate(fn, n_images: int, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n_images / statistics.median(times)


def bench(engine: InferenceEngine, images: list[Image.Image], batch: int, repeats: int) -> tuple[float, float]:
    """(engine-only images/s, end-to-end images/s)."""
    x = np.stack([preprocess(im)[0] for im in images[:batch]])
    engine_rate = _median_rate(lambda: engine.run(x), len(x), repeats)
    detector = YoloxDetector(engine, batch_size=batch)
    e2e_rate = _median_rate(lambda: detector.detect(images), len(images), max(1, repeats // 2))
    return engine_rate, e2e_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--images", type=Path, default=SAMPLE)
    parser.add_argument("--count", type=int, default=32, help="images per end-to-end pass")
    args = parser.parse_args()
    if args.images != SAMPLE and not args.images.is_dir():
        parser.error(f"--images {args.images}: no such folder (leave it out for the default sample, or synthetic "
                     "noise images when that is absent too)")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    onnx_path = detector_onnx()
    images = _images(args.images, args.count)
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"threads={args.threads}; images: {len(images)} of {images[0].size} from "
          f"{args.images if args.images and args.images.is_dir() else 'synthetic noise'}; batch {args.batch}; "
          f"{load_average()}")
    results: dict[str, tuple[float, float]] = {}

    results["ort-cpu"] = bench(OrtEngine(onnx_path, device="cpu", threads=args.threads), images, args.batch,
                               args.repeats)
    if ort_providers("cuda")[0] == "CUDAExecutionProvider":
        results["ort-cuda"] = bench(OrtEngine(onnx_path, device="cuda"), images, args.batch, args.repeats)
    else:
        print("ort-cuda: skipped (this ONNX Runtime has no CUDA execution provider)")
    gpu = probe_gpu()
    if gpu is None:
        print("tensorrt-fp16: skipped (no GPU found)")
    else:
        try:
            builder = TensorRTBuilder()
            t0 = time.perf_counter()
            path, rebuilt = EngineCache(builder).ensure("yolox_tiny", onnx_path, gpu, max_batch=args.batch)
            print(f"tensorrt-fp16: engine {'built' if rebuilt else 'from cache'} in {time.perf_counter() - t0:.1f} s "
                  f"(TensorRT {builder.version}, {gpu.name}, sm {gpu.compute_capability})")
            results["tensorrt-fp16"] = bench(builder.load(path, max_batch=args.batch), images, args.batch,
                                             args.repeats)
        except EngineError as exc:
            print(f"tensorrt-fp16: skipped ({exc})")

    print(f"\n{'engine':<15}{'engine img/s':>14}{'end-to-end img/s':>19}")
    for name, (engine_rate, e2e) in results.items():
        print(f"{name:<15}{engine_rate:>14.1f}{e2e:>19.1f}")
    if "tensorrt-fp16" in results and "ort-cuda" in results:
        ratio = results["tensorrt-fp16"][0] / results["ort-cuda"][0]
        print(f"\nTensorRT FP16 / ORT CUDA (engine): {ratio:.2f}x (target >= 3x)")
    else:
        print("\nTensorRT FP16 / ORT CUDA: skipped (needs a GPU with TensorRT and ORT's CUDA provider)")
    print(f"finished; {load_average()}")


if __name__ == "__main__":
    main()
