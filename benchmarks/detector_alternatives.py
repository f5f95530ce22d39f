"""Two more ways to run `detect`'s detector faster, measured against ONNX Runtime float32: OpenVINO's CPU runtime
on the same graph, and a low-resolution gate that runs the full 640 px detector only on photos the gate scores
above a threshold.

Run by hand (not part of the tests; OpenVINO is not a dependency of WildFed)::

    .venv/bin/pip install openvino==2026.4.1           # optional: without it only the ORT rows print
    .venv/bin/python benchmarks/detector_alternatives.py [--repeats 20]

Photos: those of ``benchmarks/photos.py`` (21 ENA24 originals + 68 camtrapR), each preprocessed as ``detect`` does
(``edge_sdk.inference.detector.preprocess``: 640 x 640, black-padded). Every runtime runs the cached detector graph
(``edge_sdk.inference.detector.detector_onnx``) on 1 thread, batch 1; times are this process's CPU time per image,
medians of ``--repeats`` interleaved calls over the first photos.

1. Runtimes: ms per image and the largest absolute difference of the raw outputs from ONNX Runtime's over all
   89 photos (equal outputs keep equal boxes).
2. The gate (OpenVINO only: it reshapes the fixed 640 x 640 graph to S x S): the 640 px input resized to
   S in {320, 416}; a photo passes when its best objectness x class score at S is at least t. A photo the full
   detector boxes (score >= 0.25, ``detect``'s threshold) but the gate rejects is a lost animal; the projected cost
   is S-pass on every photo plus the 640 pass on those that pass, against the 640 pass on every photo.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _timing import interleaved, load_average  # noqa: E402  (the script's folder)
from photos import photo_list  # noqa: E402

BOX_THRESHOLD = 0.25  # detect's confidence threshold (edge_sdk.inference.detector.CONFIDENCE_THRESHOLD)


def inputs() -> np.ndarray:
    """float32 (89, 3, 640, 640): every photo as the detector takes it."""
    from PIL import Image

    from edge_sdk.inference.detector import preprocess

    return np.stack([preprocess(Image.open(path))[0] for path, _ in photo_list()])


def best_scores(raw: np.ndarray) -> np.ndarray:
    """(n,) each image's best objectness x class score from raw head outputs (n, anchors, 6)."""
    return (raw[..., 4] * raw[..., 5]).max(axis=-1)


def ort_runner(onnx_path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def openvino_runner(onnx_path: Path, size: int = 640):
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx_path))
    model.reshape([1, 3, size, size])
    request = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1, "PERFORMANCE_HINT": "LATENCY"}) \
        .create_infer_request()
    return lambda x: request.infer({0: x})[0].copy()


def resized(x: np.ndarray, size: int) -> np.ndarray:
    """(1, 3, size, size) float32: the 640 px input (3, 640, 640) resized bicubically."""
    from PIL import Image

    image = Image.fromarray(np.clip(x.transpose(1, 2, 0), 0, 255).astype(np.uint8))
    return np.asarray(image.resize((size, size), Image.Resampling.BICUBIC), np.float32).transpose(2, 0, 1)[None].copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from edge_sdk.inference.detector import detector_onnx

    graph = detector_onnx()
    x = inputs()
    run_ort = ort_runner(graph)
    reference = np.stack([run_ort(x[i:i + 1])[0] for i in range(len(x))])
    boxed = best_scores(reference) >= BOX_THRESHOLD
    print(f"{len(x)} photos, {int(boxed.sum())} with a box at 640 px (ORT float32); {load_average()}")
    runners = {"onnxruntime 640": run_ort}
    try:
        runners["openvino 640"] = openvino_runner(graph)
        gates = {size: openvino_runner(graph, size) for size in (320, 416)}
    except ImportError:
        gates = {}
        print("openvino is not installed: ORT only (see the module docstring)")
    small = {size: [resized(x[i], size) for i in range(len(x))] for size in gates}
    steps, turn = {}, {"i": 0}
    for name, run in runners.items():
        steps[name] = lambda run=run: run(x[turn["i"] % len(x):turn["i"] % len(x) + 1])
    for size, run in gates.items():
        steps[f"openvino {size} (gate)"] = lambda run=run, size=size: run(small[size][turn["i"] % len(x)])
    times = interleaved(steps, args.repeats, clock=time.process_time)
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    print("\n| runtime, input | ms/image | largest |raw - ORT's| over all photos |\n|---|---:|---:|")
    for name, run in runners.items():
        diff = float(np.abs(np.stack([run(x[i:i + 1])[0] for i in range(len(x))]) - reference).max())
        print(f"| {name} | {ms[name]:.0f} | {diff:.2e} |")
    full = ms["onnxruntime 640"]
    print("\n| gate | threshold t | boxed photos lost | blank photos skipped | projected cost / 640 on all |"
          "\n|---|---:|---:|---:|---:|")
    for size, run in gates.items():
        scores = best_scores(np.stack([run(s)[0] for s in small[size]]))
        for t in (0.01, 0.02, 0.05, 0.1):
            passed = scores >= t
            cost = (ms[f"openvino {size} (gate)"] * len(x) + full * int(passed.sum())) / (full * len(x))
            print(f"| {size} px | {t} | {int((boxed & ~passed).sum())} of {int(boxed.sum())} | "
                  f"{int((~boxed & ~passed).sum())} of {int((~boxed).sum())} | {cost:.2f} |")
    print(load_average())


if __name__ == "__main__":
    main()
