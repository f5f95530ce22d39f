"""int8 (ONNX Runtime quantization) against float32 for the detector and the backbone: speed and agreement.

Run by hand (not part of the tests; needs torch for the leave-one-out heads, like ``ena24_loo.py``)::

    .venv/bin/python benchmarks/quantize.py [--repeats 15] [--out /tmp/wildfed-int8]

Graphs are written to ``--out`` (never into the cache or a bundle). Photos: those of ``benchmarks/photos.py``
(21 ENA24 originals + 68 camtrapR), decoded as ``detect`` now decodes them for the detector
(``edge_sdk.inference.decode``). The static detector graphs are calibrated on other photos (``--calibration``: the
10 camtrap-dp-example photos, 2048x1440, none of them measured); the static backbone graph on the 21 ENA24 top-box
crops it is measured on (in sample: a best case for int8).

Detector (YOLOX-tiny), each on 1 intra-op thread, ms per image (median, interleaved), and against float32 on every
photo at the 0.25 threshold: photos whose box presence differs and the smallest top-box IoU. Variants: dynamic
(``quantize_dynamic``, weights uint8), static QDQ (per-channel int8 weights, uint8 activations, MinMax
calibration), static with the detection head kept float32, static with the neck (PAFPN) and head kept float32.

Backbone (EfficientNet-Lite0 at 128 px): ms per crop (batch 1), smallest cosine of the embeddings against float32,
and the leave-one-out count of ``ena24_loo.py`` (head only, 100 SGD steps at lr 0.1) on each graph's embeddings.
"""

from __future__ import annotations

import argparse
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _timing import interleaved, load_average  # noqa: E402  (the script's folder)
from photos import DATA, ENA24, photo_list  # noqa: E402

CALIBRATION = DATA / "camtrap-dp-example" / "media"


def _reader(feeds: list[dict[str, np.ndarray]]):
    from onnxruntime.quantization import CalibrationDataReader

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

    return Feeds()


def quantize(src: Path, out: Path, feeds: list[dict[str, np.ndarray]], kind: str, exclude: list[str]) -> Path:
    """Write ``out``: ``dynamic`` or ``static`` (QDQ) int8 of ``src``, nodes ``exclude`` left float32."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out.with_suffix(".pre.onnx")
    quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    if kind == "dynamic":
        quantize_dynamic(str(pre), str(out), weight_type=QuantType.QUInt8)
    else:
        quantize_static(str(pre), str(out), _reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
    return out


def main() -> int:
    """Print both tables (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("/tmp/wildfed-int8"))
    parser.add_argument("--calibration", type=Path, default=CALIBRATION,
                        help="photos calibrating the static detector graphs (default: the camtrap-dp-example photos, "
                             "none of which is measured; a missing folder: the measured photos, in-sample)")
    parser.add_argument("--detector-only", action="store_true")
    args = parser.parse_args()
    import csv

    import onnx

    from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb
    from edge_sdk.inference.decode import decode_for_detection
    from edge_sdk.inference.detector import YoloxDetector, detector_onnx, preprocess
    from edge_sdk.inference.embedder import OnnxEmbedder, embedder_onnx
    from edge_sdk.inference.engines import OrtEngine
    from ena24_loo import leave_one_out
    from photos import fit_head, iou_xywh

    print(load_average())
    args.out.mkdir(parents=True, exist_ok=True)
    photos = photo_list()
    decoded = [decode_for_detection(p.read_bytes()) for p, _ in photos]
    x = [preprocess(d.image)[0][None] for d in decoded]
    det_src = detector_onnx(download=False)
    nodes = [n.name for n in onnx.load(str(det_src)).graph.node]
    head = [n for n in nodes if n.startswith("/head/")]
    neck = [n for n in nodes if n.startswith("/backbone/") and not n.startswith("/backbone/backbone/")]
    calib = sorted(p for p in args.calibration.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg")) \
        if args.calibration.is_dir() else []
    if calib:
        print(f"detector calibration: {len(calib)} photos of {args.calibration} (out of sample)")
        feeds = [{"images": preprocess(decode_for_detection(p.read_bytes()).image)[0][None]} for p in calib]
    else:
        print("detector calibration: the measured photos (in sample)")
        feeds = [{"images": v} for v in x[:21] + x[21::6]]
    graphs = {"float32": det_src,
              "int8 dynamic": quantize(det_src, args.out / "det-dynamic.onnx", feeds, "dynamic", []),
              "int8 static": quantize(det_src, args.out / "det-static.onnx", feeds, "static", []),
              "int8 static, head fp32": quantize(det_src, args.out / "det-static-head.onnx", feeds, "static", head),
              "int8 static, neck+head fp32": quantize(det_src, args.out / "det-static-neck.onnx", feeds, "static",
                                                      head + neck)}
    detectors = {name: YoloxDetector(OrtEngine(path, device="cpu", threads=1), batch_size=1)
                 for name, path in graphs.items()}
    boxes = {name: det.detect([d.image for d in decoded], [d.size for d in decoded]) for name, det in detectors.items()}
    times = interleaved({name: (lambda det=det: det.engine.run(x[0])) for name, det in detectors.items()},
                        args.repeats, warmup=2)
    base = float(np.median(times["float32"]))
    print(f"\ndetector, {len(photos)} photos, 1 thread, batch 1 (median of {args.repeats}):")
    print(f"  {'graph':30s} {'ms/img':>7s} {'speed-up':>8s}  presence-diff  min top-box IoU")
    for name, t in times.items():
        presence, ious = 0, [1.0]
        for (d, a, b) in zip(decoded, boxes["float32"], boxes[name]):
            if bool(a) != bool(b):
                presence += 1
            elif a:
                ious.append(iou_xywh(a[0].normalised_xywh(*d.size), b[0].normalised_xywh(*d.size)))
        print(f"  {name:30s} {1000 * np.median(t):7.1f} {base / np.median(t):8.2f}  {presence:13d}  {min(ious):.3f}")

    if args.detector_only:
        return 0
    # backbone: the top-box crops of the ENA24 photos (whole photo without a box)
    with (ENA24 / "labels.csv").open(newline="") as fh:
        labels = {row["filepath"]: row["label"] for row in csv.DictReader(fh)}
    crops, names = [], []
    for (path, _), d, found in zip(photos, decoded, boxes["float32"]):
        if path.name in labels and path.parent == ENA24.resolve():
            image = decode_rgb(path.read_bytes())
            bbox = found[0].normalised_xywh(*d.size) if found else (0.0, 0.0, 1.0, 1.0)
            crops.append(crop_square(image, bbox_square(bbox, image.width, image.height)))
            names.append(labels[path.name])
    emb_src = embedder_onnx(128)
    fp32 = OnnxEmbedder(OrtEngine(emb_src, device="cpu", threads=1), 128)
    cfeeds = [{"images": v[None]} for v in
              np.stack([__import__("shared.models.backbone", fromlist=["x"]).preprocess_image(c, 128) for c in crops])]
    embs = {"float32": fp32,
            "int8 dynamic": OnnxEmbedder(OrtEngine(quantize(emb_src, args.out / "bb-dynamic.onnx", cfeeds, "dynamic",
                                                            []), device="cpu", threads=1), 128),
            "int8 static": OnnxEmbedder(OrtEngine(quantize(emb_src, args.out / "bb-static.onnx", cfeeds, "static",
                                                           []), device="cpu", threads=1), 128)}
    vectors = {name: e.embed_images(crops).astype(np.float64) for name, e in embs.items()}
    one = np.stack([cfeeds[0]["images"][0]])
    times = interleaved({name: (lambda e=e: e.embed(one)) for name, e in embs.items()}, args.repeats, warmup=2)
    y_names = sorted(set(names))
    y = np.array([y_names.index(v) for v in names])
    head = fit_head(vectors["float32"].astype(np.float32), names)
    loo_args = Namespace(steps=100, lr=0.1, seed=0)
    base = float(np.median(times["float32"]))
    print(f"\nbackbone Lite0 128 px, {len(crops)} ENA24 top-box crops, 1 thread, batch 1:")
    print(f"  {'graph':14s} {'ms/crop':>7s} {'speed-up':>8s}  min cosine  species-diff  leave-one-out (head only)")
    for name, t in times.items():
        a, b = vectors["float32"], vectors[name]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        za, zb = a @ head["psi.weight"].T, b @ head["psi.weight"].T
        loo = leave_one_out(b, y, len(y_names), loo_args)["head (federated)"]
        print(f"  {name:14s} {1000 * np.median(t):7.1f} {base / np.median(t):8.2f}  {cos.min():10.4f}  "
              f"{int((za.argmax(1) != zb.argmax(1)).sum()):12d}  {loo}/{len(y)}")
    print(load_average())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
