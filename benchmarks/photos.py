"""Photos per second through ``wildfed-edge detect``'s pipeline, before and after each speed-up, in ONE run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/photos.py [--repeats 3] [--sweep] [--int8 DIR]

Photos: the 21 ENA24 originals (``../shared/data/ena24-small``, 1920x1080 to 2592x1944; else the committed 720 px
subset) and the 68 camtrapR photos (``../shared/data/camtrapr-sample``, 100x75), 89 in all. Every variant runs
:class:`edge_sdk.inference.records.DetectionPipeline` over all of them, detector and species classifier (backbone
EfficientNet-Lite0 at 128 px on ONNX Runtime CPU, and a head fitted here on the ENA24 top-box crops of the old path:
softmax regression, numpy, so that "same species" means something), in rotating interleaved order
(``_timing.interleaved``, one warm-up pass each), and prints the median seconds per pass, photos/s and the ratio to
``before``:

- ``before``: full decode, detector batch 8, ONNX Runtime's default threads (what ``detect`` did);
- ``draft``: the detector's decode at 1/2..1/8 in the DCT (``edge_sdk.inference.decode``), same engines;
- ``draft + 2 workers``: and two threads running batches at once, each ORT session on 1 intra-op thread.

Agreement with ``before`` per variant: photos whose box presence differs, the smallest top-box IoU, photos whose
top species differs (all must be 0, >= 0.9, 0). ``--sweep`` adds the detector engine alone at intra-op threads
1 / 2 and batch 1 / 4 / 8, and two concurrent 1-thread calls. ``--crop-draft`` measures cutting the crops from a
drafted decode too (not adopted: the embeddings would differ from the ones training computes).
``--int8-detector FILE`` adds the last variant with an int8 detector graph written by ``benchmarks/quantize.py``.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _timing import interleaved, load_average  # noqa: E402  (the script's folder)

DATA = ROOT.parent / "shared" / "data"
ENA24 = DATA / "ena24-small" if (DATA / "ena24-small" / "labels.csv").is_file() else ROOT / "wildfed_sim/assets/ena24"
CAMTRAPR = DATA / "camtrapr-sample"


def photo_list() -> list[tuple[Path, str]]:
    """``(path, name)`` of the ENA24 and camtrapR photos (see the module docstring)."""
    from edge_sdk.inference.records import find_images

    folders = [ENA24] + ([CAMTRAPR] if CAMTRAPR.is_dir() else [])
    return [item for folder in folders for item in find_images([folder])]


def fit_head(emb: np.ndarray, labels: list[str], steps: int = 300, lr: float = 1.0) -> dict[str, np.ndarray]:
    """Softmax regression ``psi`` (K, 1280) on the embeddings, full-batch gradient descent (numpy)."""
    names = sorted(set(labels))
    y = np.array([names.index(v) for v in labels])
    w, b = np.zeros((len(names), emb.shape[1]), np.float32), np.zeros(len(names), np.float32)
    onehot = np.eye(len(names), dtype=np.float32)[y]
    for _ in range(steps):
        z = emb @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(y)
        w -= lr * (g.T @ emb)
        b -= lr * g.sum(axis=0)
    return {"psi.weight": w, "psi.bias": b}


def top(record) -> tuple[tuple[float, ...] | None, int | None]:
    """The record's top box ``(x, y, w, h)`` and its species index, or ``(None, None)``."""
    if not record.detections:
        return None, None
    d = max(record.detections, key=lambda d: d.confidence)
    return tuple(d.bbox), d.species_index


def iou_xywh(a, b) -> float:
    """IoU of two normalised ``(x, y, w, h)`` boxes."""
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


def agreement(ref: list, new: list) -> tuple[int, float, int]:
    """``(presence differs, smallest top-box IoU, top species differs)`` between two runs' records."""
    presence, species, ious = 0, 0, [1.0]
    for a, b in zip(ref, new):
        (ba, sa), (bb, sb) = top(a), top(b)
        if (ba is None) != (bb is None):
            presence += 1
            continue
        if ba is not None:
            ious.append(iou_xywh(ba, bb))
            species += sa != sb
    return presence, min(ious), species


def sweep(onnx_path: Path, x: np.ndarray, repeats: int) -> None:
    """Detector engine alone: ms per image at threads x batch, and two concurrent 1-thread calls."""
    from edge_sdk.inference.engines import OrtEngine

    engines = {t: OrtEngine(onnx_path, device="cpu", threads=t) for t in (1, 2)}
    pool = ThreadPoolExecutor(2)
    steps = {f"threads {t}, batch {b}": (lambda t=t, b=b: engines[t].run(x[:b])) for t in (1, 2) for b in (1, 4, 8)}
    for b in (1, 4):
        steps[f"2 calls at once, threads 1, batch {b}"] = (
            lambda b=b: list(pool.map(lambda _: engines[1].run(x[:b]), range(2))))
    images = {name: (2 * int(name.rsplit(" ", 1)[1]) if name.startswith("2 calls") else int(name.rsplit(" ", 1)[1]))
              for name in steps}
    times = interleaved(steps, repeats, warmup=1)
    print("\ndetector engine alone (ms per image, median):")
    for name, t in times.items():
        print(f"  {name:34s} {1000 * np.median(t) / images[name]:7.1f}")


def decode_table(photos: list, repeats: int) -> None:
    """Decode + the detector's resize alone, ms per full-size photo: full decode (before), reduced decode (a blank
    photo now), reduced decode + the full decode for crops (a photo with a box now)."""
    from PIL import Image

    from edge_sdk.data.crops import decode_rgb
    from edge_sdk.inference.decode import decode_for_detection
    from edge_sdk.inference.detector import preprocess

    datas = [p.read_bytes() for p, _ in photos]

    def before() -> None:
        for d in datas:
            with Image.open(io.BytesIO(d)) as im:
                preprocess(im.convert("RGB"))

    def blank() -> None:
        for d in datas:
            preprocess(decode_for_detection(d).image)

    def boxed() -> None:
        for d in datas:
            preprocess(decode_for_detection(d).image)
            decode_rgb(d)

    times = interleaved({"full decode (before)": before, "reduced decode (blank photo)": blank,
                         "reduced + full decode (photo with a box)": boxed}, repeats, warmup=2)
    print(f"\ndecode + resize to 640, {len(datas)} full-size photos, ms per photo (median of {repeats}):")
    for name, t in times.items():
        print(f"  {name:42s} {1000 * np.median(t) / len(datas):6.1f}")


def table(title: str, variants: dict, photos: list, records: dict, repeats: int) -> None:
    """Time every variant on ``photos`` (interleaved) and print its row; agreement over all the photos."""
    times = interleaved({name: (lambda p=p: list(p.run(photos))) for name, p in variants.items()}, repeats,
                        warmup=0)
    base = float(np.median(times["before"]))
    print(f"\n{title}, median of {repeats} interleaved passes after one warm-up "
          f"(agreement: all photos, {sum(1 for r in records['before'] if r.detections)} with a box in 'before'):")
    print(f"  {'variant':36s} {'s/pass':>7s} {'photos/s':>9s} {'ratio':>6s} {'2,000/day min':>13s}  "
          "presence-diff  min-IoU  species-diff")
    for name, t in times.items():
        med = float(np.median(t))
        presence, min_iou, species = agreement(records["before"], records[name])
        print(f"  {name:36s} {med:7.2f} {len(photos) / med:9.2f} {base / med:6.2f} "
              f"{2000 * med / len(photos) / 60:13.1f}  {presence:13d}  {min_iou:7.3f}  {species:12d}")


def main() -> int:
    """Print the table (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--crop-draft", action="store_true")
    parser.add_argument("--int8-detector", type=Path, default=None,
                        help="an int8 detector graph (benchmarks/quantize.py) to add as a fourth variant")
    args = parser.parse_args()

    from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb
    from edge_sdk.inference.classifier import SpeciesClassifier
    from edge_sdk.inference.detector import YoloxDetector, detector_onnx, preprocess
    from edge_sdk.inference.embedder import OnnxEmbedder, embedder_onnx
    from edge_sdk.inference.engines import OrtEngine
    from edge_sdk.inference.records import DetectionPipeline

    print(load_average())
    photos = photo_list()
    det_path, emb_path = detector_onnx(download=False), embedder_onnx(128)

    def detector(threads: int | None, batch: int, path: Path = det_path) -> YoloxDetector:
        return YoloxDetector(OrtEngine(path, device="cpu", threads=threads), batch_size=batch)

    def embedder(threads: int | None, path: Path = emb_path) -> OnnxEmbedder:
        return OnnxEmbedder(OrtEngine(path, device="cpu", threads=threads), 128)

    # the head: fitted on the old path's top-box crops of the ENA24 photos
    with (ENA24 / "labels.csv").open(newline="") as fh:
        labels = {row["filepath"]: row["label"] for row in csv.DictReader(fh)}
    old_det, old_emb = detector(None, 8), embedder(None)
    probe = DetectionPipeline(old_det, None, deployment_id="bench", draft=False)
    ena = [(p, n) for p, n in photos if p.parent == ENA24.resolve() and p.name in labels]
    crops, crop_labels = [], []
    for rec, (p, _) in zip(probe.run(ena), ena):
        image = decode_rgb(p.read_bytes())
        bbox = top(rec)[0] or (0.0, 0.0, 1.0, 1.0)
        crops.append(crop_square(image, bbox_square(bbox, image.width, image.height)))
        crop_labels.append(labels[p.name])
    head = fit_head(old_emb.embed_images(crops), crop_labels)

    def pipeline(det, emb, *, draft: bool, workers: int) -> DetectionPipeline:
        return DetectionPipeline(det, SpeciesClassifier(emb, head), deployment_id="bench", draft=draft,
                                 workers=workers)

    variants = {
        "before": pipeline(old_det, old_emb, draft=False, workers=1),
        "draft": pipeline(old_det, old_emb, draft=True, workers=1),
        "draft + 2 workers": pipeline(detector(1, 8), embedder(1), draft=True, workers=2),
    }
    if args.int8_detector is not None:
        variants["draft + 2 workers + int8 detector"] = pipeline(detector(1, 8, args.int8_detector), embedder(1),
                                                                 draft=True, workers=2)
    records = {name: list(p.run(photos)) for name, p in variants.items()}
    full_size = [(p, n) for p, n in photos if p.parent == ENA24.resolve()]
    decode_table(full_size, 5 * args.repeats)
    for title, subset in ((f"all {len(photos)} photos", photos), (f"the {len(full_size)} full-size ENA24 photos only",
                                                                  full_size)):
        table(title, variants, subset, records, args.repeats)
    if args.sweep:
        x = np.stack([preprocess(decode_rgb(p.read_bytes()))[0] for p, _ in photos[:8]])
        sweep(det_path, x, args.repeats * 3)
    if args.crop_draft:
        crop_draft(photos, records["before"], embedder(None), head)
    print(load_average())
    return 0


def crop_draft(photos, records, emb, head) -> None:
    """Crops cut from a decode drafted to the crop's need (the square's side / k >= 128) against the full decode:
    cosine of the embeddings and top species."""
    from PIL import Image

    from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb
    from edge_sdk.inference.classifier import head_logits
    from edge_sdk.inference.decode import DRAFT_FACTORS

    cosines, differ, n, t_full, t_draft = [], 0, 0, 0.0, 0.0
    for (path, _), rec in zip(photos, records):
        if not rec.detections:
            continue
        data = path.read_bytes()
        t0 = time.perf_counter()
        full = decode_rgb(data)
        t_full += time.perf_counter() - t0
        for d in rec.detections:
            sq = bbox_square(d.bbox, full.width, full.height)
            side = sq[2] - sq[0]
            k = next((k for k in DRAFT_FACTORS if side // k >= emb.input_size), 1)
            t0 = time.perf_counter()
            with Image.open(io.BytesIO(data)) as im:
                im.draft("RGB", (im.width // k, im.height // k))
                small = im.convert("RGB")
            sx, sy = full.width / small.width, full.height / small.height
            cut = small.crop((round(sq[0] / sx), round(sq[1] / sy), round(sq[2] / sx), round(sq[3] / sy)))
            t_draft += time.perf_counter() - t0
            a, b = emb.embed_images([crop_square(full, sq), cut])
            cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
            differ += int(np.argmax(head_logits(head, a[None])) != np.argmax(head_logits(head, b[None])))
            n += 1
    print(f"\ncrop from a drafted decode vs the full decode, {n} boxes: smallest cosine {min(cosines):.4f}, "
          f"median {np.median(cosines):.4f}; top species differs for {differ}; decode time full {t_full:.2f} s, "
          f"drafted {t_draft:.2f} s")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
