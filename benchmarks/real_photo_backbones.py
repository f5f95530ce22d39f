"""Which frozen backbone (and input size) for real camera-trap crops: accuracy of the federation's head and
embedding time on a CPU gateway, for EfficientNet-Lite0 at 128 and 224 px, Lite1 at 240 and Lite2 at 260.

Run by hand (not part of the tests; 3-8 minutes on 2 shared cores, the longer when the four ONNX files are
first exported)::

    .venv/bin/python benchmarks/real_photo_backbones.py [--threads 2] [--repeats 5] [--no-write]

Data (``../shared/data``; each set is skipped with a message when absent):

- ENA24 (``ena24-small``): 21 photos, 7 species x 3 (``labels.csv``). Sites: the three photos of each species,
  sorted by file name, go to sites 1, 2 and 3, so each site holds one photo of every species and a held-out site's
  species are all held by the other two.
- camtrapR (``camtrapr-sample``): 68 photos of 100x75 px in ``Station{A,B,C}/<species code>/``; ``UNID``
  (unidentified) is left out of training and scoring. Sites: the three stations.

Crops: what the gateway classifies, the square crop (``edge_sdk.inference.classifier.crop``) of the top-scoring box
of the project's detector (``YoloxDetector``, ONNX Runtime, default threshold 0.25) in each photo, or the whole
photo where it finds none (counted and printed).

Accuracy (``_linear_probe``): the head only (``shared.models.head``, ``adapter_width`` 0), trained centrally
without privacy, tuned per held-out fold on the same grid for every backbone by an inner leave-one-out on the
training folds only. Schemes: leave-one-site-out on ENA24 and on camtrapR (a held-out photo is scored only when its
species is in the training sites), and leave-one-photo-out on ENA24. Per species and overall, as counts. Paired
comparison of each configuration with Lite0 at 128 px: photos one names correctly and the other does not, and the
exact McNemar p-value. Also printed as references: nearest class centroid (no tuning at all), and always naming
the training folds' most frequent species (what a head that learnt nothing from the pixels would score).

Time: ``OnnxEmbedder.embed_images`` of one crop at a time (resize, normalise, ONNX Runtime CPU with ``--threads``
intra-op threads) over the ENA24 crops, the configurations interleaved in rotating order (``_timing.interleaved``),
``--repeats`` repeats; the median per crop and its ratio to Lite0 at 128 px in the same run. The detector's time per
photo is measured the same way for the day's budget (2,000 photos).

Writes ``docs/results/real-photo-backbones.md`` (unless ``--no-write``): the command, date, machine and the
tables; a ``## Decision`` section already in the file is kept as it is.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "docs" / "results" / "real-photo-backbones.md"
CONFIGS = (("efficientnet-lite0", 128), ("efficientnet-lite0", 224), ("efficientnet-lite1", 240),
           ("efficientnet-lite2", 260))
DAY = 2000


def label(config: tuple[str, int]) -> str:
    """``Lite0@128`` for ``("efficientnet-lite0", 128)``."""
    return f"{config[0].replace('efficientnet-l', 'L')}@{config[1]}"


def ena24_photos(folder: Path) -> list[tuple[Path, str, int]]:
    """``(path, species, site)`` of the ENA24 photos: site 1-3 by file-name order within each species."""
    import csv

    with (folder / "labels.csv").open(newline="") as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: (r["label"], r["filepath"]))
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r["label"]] = seen.get(r["label"], 0) + 1
        out.append((folder / r["filepath"], r["label"], seen[r["label"]]))
    return out


def camtrapr_photos(folder: Path) -> tuple[list[tuple[Path, str, int]], int]:
    """``(path, species code, station 1-3)`` of the camtrapR photos without ``UNID``, and the UNID count."""
    paths = sorted(p for p in folder.glob("Station*/*/*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    kept = [(p, p.parent.name, "ABC".index(p.parent.parent.name[-1]) + 1) for p in paths if p.parent.name != "UNID"]
    return kept, len(paths) - len(kept)


def detector_crops(detector, photos) -> tuple[list, int]:
    """The crops the gateway classifies (``ena24_loo.top_box_crop``) and the number of photos without a box."""
    from ena24_loo import top_box_crop

    crops, missed = [], 0
    for path, _, _ in photos:
        image, found = top_box_crop(detector, path)
        crops.append(image)
        missed += not found
    return crops, missed


def centroid_correct(x: np.ndarray, labels: np.ndarray, folds: np.ndarray) -> np.ndarray:
    """Nearest class centroid (Euclidean) per held-out fold, scored as ``_linear_probe.nested_scores``."""
    out = np.full(len(labels), np.nan)
    for fold in sorted(set(folds.tolist())):
        train, test = folds != fold, folds == fold
        names = sorted(set(labels[train].tolist()))
        centroids = np.stack([x[train & (labels == n)].mean(axis=0) for n in names])
        for i in np.flatnonzero(test & np.isin(labels, names)):
            out[i] = float(names[int(np.argmin(((centroids - x[i]) ** 2).sum(axis=1)))] == labels[i])
    return out


def majority_correct(labels: np.ndarray, folds: np.ndarray) -> np.ndarray:
    """Always the most frequent species of the training folds (ties: the first by name), scored likewise."""
    out = np.full(len(labels), np.nan)
    for fold in sorted(set(folds.tolist())):
        train, test = folds != fold, folds == fold
        names, counts = np.unique(labels[train], return_counts=True)
        guess = names[int(np.argmax(counts))]
        for i in np.flatnonzero(test & np.isin(labels, names)):
            out[i] = float(labels[i] == guess)
    return out


def count(v: np.ndarray) -> str:
    """``"13/21"``: correct of scored (NaN = unscored)."""
    ok = ~np.isnan(v)
    return f"{int(v[ok].sum())}/{int(ok.sum())}"


def accuracy_tables(name: str, labels: np.ndarray, folds: np.ndarray, emb: dict, lines: list[str]) -> None:
    """Nested-CV head and nearest-centroid counts per species and overall, and paired comparisons, as markdown."""
    from _linear_probe import mcnemar_exact, nested_scores

    head, chosen, cent = {}, {}, {}
    for config, x in emb.items():
        head[config], chosen[config] = nested_scores(x, labels, folds)
        cent[config] = centroid_correct(x, labels, folds)
    species = sorted(set(labels.tolist()))
    lines += [f"\n### {name}\n", "| species | " + " | ".join(label(c) for c in emb) + " |",
              "|---|" + "---:|" * len(emb)]
    for s in species:
        rows = labels == s
        cells = [count(head[c][rows]) for c in emb]
        if all(c.endswith("/0") for c in cells):
            cells = ["not scored"] * len(emb)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("| **head, all** | " + " | ".join(f"**{count(head[c])}**" for c in emb) + " |")
    lines.append("| nearest centroid, all | " + " | ".join(count(cent[c]) for c in emb) + " |")
    lines.append("| (most frequent training species, all) | "
                 + " | ".join([count(majority_correct(labels, folds))] * len(emb)) + " |")
    base = CONFIGS[0]
    lines += ["", f"Paired with {label(base)} (head): photos only this one names correctly / only {label(base)} "
              "does, exact McNemar p:", ""]
    for c in list(emb)[1:]:
        a, b, p = mcnemar_exact(head[c], head[base])
        lines.append(f"- {label(c)}: {a} / {b}, p = {p:.2f}")
    settings = {label(c): sorted({f"lr {s.lr}, {s.steps} steps, wd {s.weight_decay}" for s in chosen[c]})
                for c in emb}
    lines += ["", "Settings chosen by the inner leave-one-out: "
              + "; ".join(f"{k}: {' / '.join(v)}" for k, v in settings.items()) + "."]


def timing(crops: list, photos: list, embedders: dict, detector, repeats: int, lines: list[str]) -> None:
    """Median seconds per crop of each embedder (interleaved) and per photo of the detector, as markdown."""
    from PIL import Image

    from _timing import interleaved

    steps = {c: (lambda e=e: [e.embed_images([im]) for im in crops]) for c, e in embedders.items()}
    times = interleaved(steps, repeats, warmup=1)
    per = {c: float(np.median(t)) / len(crops) for c, t in times.items()}
    images = []
    for path, _, _ in photos:
        with Image.open(path) as im:
            images.append(im.convert("RGB"))
    det = interleaved({"detector": lambda: [detector.detect([im]) for im in images]}, max(1, repeats // 2), 1)
    det_per = float(np.median(det["detector"])) / len(images)
    base = per[CONFIGS[0]]
    lines += ["| backbone | ms per crop (median) | ratio to Lite0@128 | 2,000 crops |", "|---|---:|---:|---:|"]
    for c, t in per.items():
        lines.append(f"| {label(c)} | {1000 * t:.1f} | {t / base:.2f} | {DAY * t / 60:.1f} min |")
    lines.append(f"| (detector, per photo) | {1000 * det_per:.1f} | | {DAY * det_per / 60:.1f} min |")


def write_results(text: str) -> None:
    """Write :data:`RESULTS`, keeping its ``## Decision`` section when there is one."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = RESULTS.read_text() if RESULTS.is_file() else ""
    keep = old[old.index("\n## Decision"):] if "\n## Decision" in old else ""
    RESULTS.write_text(text.rstrip() + "\n" + keep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (the gateway's cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (interleaved)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/results alone")
    args = parser.parse_args()
    import torch

    from _linear_probe import self_check
    from _timing import load_average
    from edge_sdk.inference.detector import YoloxDetector
    from edge_sdk.inference.embedder import OnnxEmbedder

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    command = "python benchmarks/real_photo_backbones.py " + " ".join(sys.argv[1:])
    lines = ["# Real camera-trap photos: which frozen backbone", "",
             f"Measured by `{command.strip()}` on {dt.date.today().isoformat()}: {platform.machine()}, "
             f"{os.cpu_count()} CPUs ({load_average()} at the start), ONNX Runtime CPU, {args.threads} threads. "
             "Method: the script's docstring."]
    ena_dir, cam_dir = DATA / "ena24-small", DATA / "camtrapr-sample"
    sets = {}
    if (ena_dir / "labels.csv").is_file():
        sets["ENA24"] = ena24_photos(ena_dir)
    else:
        print(f"ENA24 skipped: {ena_dir}/labels.csv not found")
    if cam_dir.is_dir():
        sets["camtrapR"], unid = camtrapr_photos(cam_dir)
    else:
        print(f"camtrapR skipped: {cam_dir} not found")
    if not sets:
        parser.error(f"no photos: neither {ena_dir} nor {cam_dir} is there (../shared/data)")
    detector = YoloxDetector.open(prefer="ort", threads=args.threads, batch_size=1)
    crops = {}
    lines += ["", "## Crops", ""]
    for name, photos in sets.items():
        crops[name], missed = detector_crops(detector, photos)
        extra = f"; {unid} UNID photo(s) left out" if name == "camtrapR" else ""
        lines.append(f"- {name}: {len(photos)} photos, {len(set(p[1] for p in photos))} species; the detector found "
                     f"no box in {missed} (the whole photo is used){extra}.")
    embedders = {c: OnnxEmbedder.open(c[1], backbone=c[0], prefer="ort", threads=args.threads) for c in CONFIGS}
    emb = {name: {c: e.embed_images(crops[name]).astype(np.float64) for c, e in embedders.items()} for name in sets}
    first = next(iter(sets))
    y0 = np.unique([p[1] for p in sets[first]], return_inverse=True)[1]
    lines.append(f"- Check: the batched head training equals `torch.optim.SGD` (ena24_loo.train_head) within "
                 f"{self_check(emb[first][CONFIGS[0]], y0, int(y0.max()) + 1):.1e} in the logits.")
    lines += ["", "## Accuracy of the head (counts: correct / scored)"]
    for name, photos in sets.items():
        labels = np.array([p[1] for p in photos])
        sites = np.array([p[2] for p in photos])
        accuracy_tables(f"{name}, leave-one-site-out", labels, sites, emb[name], lines)
        if name == "ENA24":
            accuracy_tables("ENA24, leave-one-photo-out", labels, np.arange(len(labels)), emb[name], lines)
    if "ENA24" in sets:
        lines += ["", f"## Embedding time per crop (ENA24 crops, one at a time, {args.repeats} interleaved repeats)",
                  ""]
        timing(crops["ENA24"], sets["ENA24"], embedders, detector, args.repeats, lines)
    lines += ["", f"({time.perf_counter() - t0:.0f} s in all; {load_average()} at the end.)"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_results(text)
        print(f"\nwritten: {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
