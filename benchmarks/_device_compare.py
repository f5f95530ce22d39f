"""Parity of a TensorRT FP16 engine's outputs with ONNX Runtime's FP32 ones, for ``device_check.sh``.

Pure numpy; the thresholds are module constants so that the report prints what was checked.

Why these thresholds: the whole backbone and the whole detector run in FP16 (torch, every weight and activation in
half precision) against FP32 on the 21 ENA24 photos of ``wildfed_sim/assets/ena24`` (centre square crops at 128 px
for Lite0) give, measured on a CPU: embeddings max |diff| 0.050 (values are pooled ReLU6 activations in [0, 5.9],
mean 0.39), smallest cosine similarity 0.99994; detector boxes IoU >= 0.998 with the FP32 box, score within 0.001.
TensorRT's FP16 keeps FP32 where it chooses to, so it should do no worse; the thresholds leave a factor of about 3
(embeddings), 8 in 1 - cosine, and 20 (scores) for kernels that accumulate differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["EMBEDDING_MAX_ABS", "EMBEDDING_MIN_COSINE", "BOX_MIN_IOU", "BOX_MAX_SCORE_DIFF", "BOX_SCORE_FLOOR",
           "embedding_parity", "box_parity"]

#: Largest |TensorRT - ORT| over all embedding values allowed.
EMBEDDING_MAX_ABS = 0.15
#: Smallest cosine similarity of an image's two embeddings allowed.
EMBEDDING_MIN_COSINE = 0.9995
#: Boxes scoring at least this (in either output) must be matched: 0.1 above the detector's 0.25 threshold, so a box
#: near the threshold may appear in one output only without failing.
BOX_SCORE_FLOOR = 0.35
#: Smallest IoU of a matched pair allowed.
BOX_MIN_IOU = 0.95
#: Largest |score difference| of a matched pair allowed.
BOX_MAX_SCORE_DIFF = 0.02


def embedding_parity(reference: np.ndarray, other: np.ndarray) -> dict[str, Any]:
    """Compare two (N, D) embedding arrays of the same N images.

    Returns:
        ``{"ok", "images", "max_abs", "mean_abs", "min_cosine", "max_abs_threshold", "min_cosine_threshold"}``;
        ``ok`` is False also when the shapes differ or a value is not finite.
    """
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(other, dtype=np.float64)
    if ref.shape != got.shape or ref.ndim != 2 or ref.shape[0] == 0:
        return {"ok": False, "images": int(ref.shape[0]) if ref.ndim else 0,
                "error": f"shapes differ or are empty: {ref.shape} vs {got.shape}"}
    finite = bool(np.isfinite(got).all())
    diff = np.abs(ref - got)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1)
    cosine = np.where(norms > 0, (ref * got).sum(axis=1) / np.where(norms > 0, norms, 1.0), 1.0)
    max_abs, min_cos = float(diff.max()), float(cosine.min())
    return {"ok": finite and max_abs <= EMBEDDING_MAX_ABS and min_cos >= EMBEDDING_MIN_COSINE,
            "images": int(ref.shape[0]), "finite": finite, "max_abs": max_abs, "mean_abs": float(diff.mean()),
            "min_cosine": min_cos, "max_abs_threshold": EMBEDDING_MAX_ABS,
            "min_cosine_threshold": EMBEDDING_MIN_COSINE}


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _greedy_pairs(ref: list[tuple], got: list[tuple]) -> list[tuple[int, int, float]]:
    """Pairs (i, j, IoU) of same-class boxes, highest IoU first, each box used once, IoU > 0."""
    candidates = sorted(((_iou(r[:4], g[:4]), i, j) for i, r in enumerate(ref) for j, g in enumerate(got)
                         if r[5] == g[5]), reverse=True)
    used_r: set[int] = set()
    used_g: set[int] = set()
    pairs = []
    for iou, i, j in candidates:
        if iou <= 0 or i in used_r or j in used_g:
            continue
        used_r.add(i)
        used_g.add(j)
        pairs.append((i, j, iou))
    return pairs


def box_parity(reference: Sequence[Sequence[Any]], other: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Compare two detectors' boxes on the same images.

    Args:
        reference, other: per image, a list of boxes; a box is anything with attributes ``x1, y1, x2, y2, score,
            class_index`` (``edge_sdk.inference.detector.Box``) or a tuple in that order (original-image pixels).

    A box scoring >= :data:`BOX_SCORE_FLOOR` in either output must be paired (greedy, highest IoU first, same class)
    with a box of the other output at IoU >= :data:`BOX_MIN_IOU` and a score within :data:`BOX_MAX_SCORE_DIFF`.
    Weaker boxes are paired when they can be and counted, never failed on.

    Returns:
        ``{"ok", "images", "boxes_reference", "boxes_other", "checked", "unmatched", "min_iou", "mean_iou",
        "max_score_diff", "failures": [up to 10 descriptions], ...thresholds}``.
    """
    if len(reference) != len(other):
        return {"ok": False, "error": f"{len(reference)} images vs {len(other)}"}
    def as_tuple(b: Any) -> tuple:
        return tuple(b) if isinstance(b, (tuple, list)) else (b.x1, b.y1, b.x2, b.y2, b.score, b.class_index)

    failures: list[str] = []
    ious: list[float] = []
    score_diffs: list[float] = []
    checked = unmatched = n_ref = n_got = 0
    for image, (ref_boxes, got_boxes) in enumerate(zip(reference, other)):
        ref = [as_tuple(b) for b in ref_boxes]
        got = [as_tuple(b) for b in got_boxes]
        n_ref, n_got = n_ref + len(ref), n_got + len(got)
        pairs = _greedy_pairs(ref, got)
        paired_r = {i for i, _, _ in pairs}
        paired_g = {j for _, j, _ in pairs}
        for i, j, iou in pairs:
            if max(ref[i][4], got[j][4]) < BOX_SCORE_FLOOR:
                continue
            checked += 1
            diff = abs(ref[i][4] - got[j][4])
            ious.append(iou)
            score_diffs.append(diff)
            if iou < BOX_MIN_IOU or diff > BOX_MAX_SCORE_DIFF:
                failures.append(f"image {image}: box {i} IoU {iou:.4f}, scores {ref[i][4]:.3f} vs {got[j][4]:.3f}")
        for side, boxes, paired in (("reference", ref, paired_r), ("other", got, paired_g)):
            for k, box in enumerate(boxes):
                if k not in paired and box[4] >= BOX_SCORE_FLOOR:
                    unmatched += 1
                    failures.append(f"image {image}: {side} box {k} (score {box[4]:.3f}) has no match")
    return {"ok": not failures and checked > 0, "images": len(reference), "boxes_reference": n_ref,
            "boxes_other": n_got, "checked": checked, "unmatched": unmatched,
            "min_iou": min(ious) if ious else None, "mean_iou": float(np.mean(ious)) if ious else None,
            "max_score_diff": max(score_diffs) if score_diffs else None, "failures": failures[:10],
            "min_iou_threshold": BOX_MIN_IOU, "max_score_diff_threshold": BOX_MAX_SCORE_DIFF,
            "score_floor": BOX_SCORE_FLOOR}
