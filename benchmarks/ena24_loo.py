"""ENA24 acceptance measurement: leave-one-out species naming on real camera-trap photos.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/ena24_loo.py [--input-size 128] [--photos DIR] [--threads 2]

What is measured. The 21 ENA24 photos (7 species x 3; ``../shared/data/ena24-small`` when present, else the
downscaled subset committed in ``wildfed_sim/assets/ena24``) go through the project's own pipeline: the YOLOX-tiny
detector (``edge_sdk.inference.detector``, ONNX Runtime) gives the top-scoring box of each photo (the whole photo
when it finds none; counted and printed), ``edge_sdk.inference.classifier.crop`` makes the backbone's square crop,
and the frozen EfficientNet-Lite0 embeds it (``OnnxEmbedder``, ONNX Runtime) at ``--input-size``. Then, for each
photo i, a classifier is fitted on the other 20 crops and asked to name crop i (leave-one-out, non-private).
Printed: the number of the 21 crops named correctly (chance: 3) by

- ``head (federated)``: the head model of ``shared.models.head`` head only (``adapter_width`` 0: psi on the
  embedding), zero-initialised, trained as a gateway trains it without privacy: full-batch SGD on the mean
  cross-entropy, ``--steps`` steps at ``--lr`` (this is the figure that counts for the acceptance criterion);
- ``head + adapter``: the same with the 256-wide tanh adapter phi (PyTorch default initialisation, seeded);
- ``nearest centroid``: the class whose mean embedding of the 20 others is closest (Euclidean), a reference.

Needs torch (the backbone's one-time ONNX export and the head's training) and the detector weights (zamba wheel).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared" / "data" / "ena24-small"
COMMITTED = ROOT / "wildfed_sim" / "assets" / "ena24"


def photos_folder(given: str | None) -> Path:
    """``given``, else ``../shared/data/ena24-small`` when present, else the committed subset."""
    if given:
        return Path(given)
    return SHARED if (SHARED / "labels.csv").is_file() else COMMITTED


def top_box_crop(detector, path: Path, draft: bool = False) -> tuple[object, bool]:
    """``(the crop the gateway classifies, whether the detector found a box)`` for one photo: the square crop
    (``edge_sdk.inference.classifier.crop``) of the detector's top-scoring box, or the whole photo without one.
    ``draft``: the detector sees the reduced decode ``detect`` now uses (``edge_sdk.inference.decode``); the crop
    is cut from the full decode either way."""
    from PIL import Image

    from edge_sdk.inference.classifier import crop
    from edge_sdk.inference.decode import decode_for_detection

    with Image.open(path) as im:
        image = im.convert("RGB")
    seen = decode_for_detection(path.read_bytes(), draft=draft)
    boxes = detector.detect([seen.image], [seen.size])[0]
    if not boxes:
        return image, False
    b = max(boxes, key=lambda b: b.score)
    return crop(image, (b.x1, b.y1, b.x2, b.y2)), True


def crops_and_labels(folder: Path, threads: int | None, draft: bool = False) -> tuple[list, list[str], int]:
    """``(square crops, labels, photos without a detection)`` from the project's detector (top box per photo)."""
    from edge_sdk.inference.detector import YoloxDetector

    with (folder / "labels.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    detector = YoloxDetector.open(prefer="ort", threads=threads, batch_size=1)
    crops, labels, missed = [], [], 0
    for row in rows:
        image, found = top_box_crop(detector, folder / row["filepath"], draft)
        crops.append(image)
        missed += not found
        labels.append(row["label"])
    return crops, labels, missed


def train_head(x: np.ndarray, y: np.ndarray, num_classes: int, *, adapter_width: int, steps: int, lr: float,
               seed: int, weight_decay: float = 0.0) -> dict[str, np.ndarray]:
    """The head model trained without privacy, full-batch SGD on the mean cross-entropy (module docstring), with
    ``torch.optim.SGD``'s ``weight_decay`` (L2 on every parameter; 0 by default)."""
    import torch

    from shared.models.head import HeadConfig, build_model, initial_weights
    from shared.models.state import load_numpy_state

    config = HeadConfig(num_classes, adapter_width=adapter_width)
    model = build_model(config)
    load_numpy_state(model, initial_weights(config, seed))
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def leave_one_out(emb: np.ndarray, y: np.ndarray, num_classes: int, args) -> dict[str, int]:
    """Correct leave-one-out namings per method."""
    from edge_sdk.inference.classifier import head_logits

    correct = {"head (federated)": 0, "head + adapter": 0, "nearest centroid": 0}
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        xtr, ytr = emb[keep], y[keep]
        for name, width in (("head (federated)", 0), ("head + adapter", 256)):
            w = train_head(xtr, ytr, num_classes, adapter_width=width, steps=args.steps, lr=args.lr, seed=args.seed)
            correct[name] += int(np.argmax(head_logits(w, emb[i:i + 1])[0]) == y[i])
        centroids = np.stack([xtr[ytr == k].mean(axis=0) for k in range(num_classes)])
        correct["nearest centroid"] += int(np.argmin(((centroids - emb[i]) ** 2).sum(axis=1)) == y[i])
    return correct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", help="folder with labels.csv (default: ../shared/data/ena24-small, else the "
                                         "committed subset)")
    parser.add_argument("--input-size", type=int, nargs="+", default=[128], help="backbone input size(s), px")
    parser.add_argument("--steps", type=int, default=100, help="SGD steps of the head")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of the head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime / torch threads")
    parser.add_argument("--draft", action="store_true", help="the detector sees the reduced JPEG decode detect "
                                                             "uses (edge_sdk.inference.decode); default: full decode")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from edge_sdk.inference.embedder import OnnxEmbedder

    folder = photos_folder(args.photos)
    if not (folder / "labels.csv").is_file():
        parser.error(f"--photos {folder}: no labels.csv there (expected photos and a labels.csv of filepath,label; "
                     "leave --photos out for ../shared/data/ena24-small or the committed subset)")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"photos: {folder}")
    t0 = time.perf_counter()
    crops, labels, missed = crops_and_labels(folder, args.threads, args.draft)
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    print(f"{len(crops)} photos, {len(names)} species; detector found no animal in {missed} (whole photo used)")
    for size in args.input_size:
        emb = OnnxEmbedder.open(size, prefer="ort", threads=args.threads).embed_images(crops)
        correct = leave_one_out(emb.astype(np.float64), y, len(names), args)
        for name, n in correct.items():
            print(f"{size:4d} px  {name:18s} {n:2d}/{len(y)} correct (leave-one-out; chance {len(y) // len(names)})")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"({time.perf_counter() - t0:.0f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
