"""Held-out evaluation of a global model and the centralised (pooled-data) reference.

Both run on the coordinator's machine in the demo, on the held-out test split that never went to any site; they
touch no site data, so they spend no privacy budget. torch is imported lazily (the coordinator's aggregation path
does not need it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shared.iucn import IUCNCategory

__all__ = ["Accuracy", "evaluate", "train_centralised", "GROUPS"]

GROUPS: dict[str, tuple[IUCNCategory, ...]] = {
    "overall": tuple(IUCNCategory),
    "CR/EN": (IUCNCategory.CR, IUCNCategory.EN),
    "VU/NT": (IUCNCategory.VU, IUCNCategory.NT),
    "LC": (IUCNCategory.LC,),
    "NE": (IUCNCategory.NE,),
}
"""Accuracy groups reported by the demo: all records, the sensitive categories, and the least protected."""


@dataclass(frozen=True)
class Accuracy:
    """Top-1 accuracy (fraction in [0, 1]) per group of :data:`GROUPS` and per IUCN category, with counts."""

    by_group: Mapping[str, float]
    by_category: Mapping[IUCNCategory, float]
    counts: Mapping[str, int]

    def to_json(self) -> dict[str, object]:
        """JSON-ready dict."""
        return {"by_group": dict(self.by_group), "by_category": {c.value: v for c, v in self.by_category.items()},
                "counts": dict(self.counts)}


def _predict(weights: Mapping[str, np.ndarray], images: np.ndarray, num_classes: int,
             batch_size: int = 1000) -> np.ndarray:
    import torch

    from shared.models.camera_cnn import build_model, load_numpy_state, preprocess

    model = build_model(num_classes)
    load_numpy_state(model, weights)
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            out.append(model(preprocess(images[start:start + batch_size])).argmax(dim=1).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def evaluate(weights: Mapping[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             class_categories: Sequence[IUCNCategory]) -> Accuracy:
    """Accuracy of the camera CNN with ``weights`` on a labelled set.

    Args:
        weights: float32 arrays of ``shared.models.camera_cnn`` (``phi.*``, ``psi.*``).
        images: uint8 (N, 28, 28). labels: int64 (N,) class indices.
        class_categories: IUCN category of each class index (length = number of classes).

    Returns:
        :class:`Accuracy`; a group with no records reports ``nan``.
    """
    labels = np.asarray(labels)
    predictions = _predict(weights, images, len(class_categories))
    correct = predictions == labels
    record_cats = np.asarray([class_categories[int(y)].rank for y in labels])
    by_cat, by_group, counts = {}, {}, {}
    for cat in IUCNCategory:
        mask = record_cats == cat.rank
        by_cat[cat] = float(correct[mask].mean()) if mask.any() else float("nan")
    for name, cats in GROUPS.items():
        mask = np.isin(record_cats, [c.rank for c in cats])
        counts[name] = int(mask.sum())
        by_group[name] = float(correct[mask].mean()) if mask.any() else float("nan")
    return Accuracy(by_group=by_group, by_category=by_cat, counts=counts)


def train_centralised(images: np.ndarray, labels: np.ndarray, *, num_classes: int, epochs: int, batch_size: int,
                      learning_rate: float, seed: int, initial: Mapping[str, np.ndarray] | None = None
                      ) -> dict[str, np.ndarray]:
    """Non-private SGD on the pooled training set: the reference a federation is compared with.

    Args:
        images: uint8 (N, 28, 28); labels: int64 (N,).
        epochs: passes over the data; batch_size: examples per step; learning_rate: SGD step size.
        seed: shuffling seed. initial: starting weights (default: ``initial_weights(num_classes, seed)``).

    Returns:
        The trained weights (float32 arrays).
    """
    import torch

    from shared.models.camera_cnn import build_model, initial_weights, load_numpy_state, preprocess, to_numpy_state

    model = build_model(num_classes)
    load_numpy_state(model, initial if initial is not None else initial_weights(num_classes, seed))
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    rng = np.random.default_rng(seed)
    x_all, y_all = preprocess(images), torch.from_numpy(np.asarray(labels, dtype=np.int64))
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(labels)))
        for start in range(0, len(labels), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            opt.step()
    return to_numpy_state(model)
