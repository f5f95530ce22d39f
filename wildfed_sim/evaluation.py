"""Held-out evaluation of a global model and the centralised (pooled-data) reference.

Both run on the coordinator's machine in the demo, on the held-out test split that never went to any site; they
touch no site data, so they spend no privacy budget. torch is imported lazily (the coordinator's aggregation path
does not need it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shared.iucn import IUCNCategory

__all__ = ["Accuracy", "evaluate", "accuracy_from_predictions", "train_centralised", "GROUPS", "SiteAccuracy",
           "rare_species", "evaluate_sites", "summarise_sites", "worst_decile"]

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


def _predict(weights: Mapping[str, np.ndarray], features: np.ndarray, num_classes: int,
             batch_size: int = 4096) -> np.ndarray:
    """Argmax class of the head model (the spec of ``weights``, ``shared.models.kinds.spec_from_weights``) on
    backbone embeddings float32 (N, 1280)."""
    import torch

    from shared.models.kinds import spec_from_weights

    spec = spec_from_weights(weights)
    if spec.num_classes != num_classes:
        raise ValueError(f"the weights have {spec.num_classes} classes, the species table {num_classes}")
    model = spec.build()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in weights.items()})
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(features), batch_size):
            out.append(model(torch.as_tensor(spec.prepare_input(features[start:start + batch_size])))
                       .argmax(dim=1).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def evaluate(weights: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray,
             class_categories: Sequence[IUCNCategory]) -> Accuracy:
    """Accuracy of the head model with ``weights`` on a labelled set of backbone embeddings.

    Args:
        weights: float32 arrays of ``shared.models.head`` (``phi.*``, ``psi.*``; the architecture is read from
            their shapes).
        features: float32 (N, 1280) backbone embeddings (:func:`wildfed_sim.embeddings.embed_grayscale`).
        labels: int64 (N,) class indices.
        class_categories: IUCN category of each class index (length = number of classes).

    Returns:
        :class:`Accuracy`; a group with no records reports ``nan``.
    """
    return accuracy_from_predictions(_predict(weights, features, len(class_categories)), labels, class_categories)


def accuracy_from_predictions(predictions: np.ndarray, labels: np.ndarray,
                              class_categories: Sequence[IUCNCategory]) -> Accuracy:
    """:class:`Accuracy` of given predicted class indices against ``labels`` (what :func:`evaluate` reports)."""
    labels = np.asarray(labels)
    correct = np.asarray(predictions) == labels
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


# ------------------------------------------------------------------------------------------ per-site evaluation
@dataclass(frozen=True)
class SiteAccuracy:
    """One site's model evaluated on the held-out test images of the species the site holds.

    Attributes:
        site_id: the site. species: its class indices (its full species table, sensitive ones included).
        rare_species: its rare species (:func:`rare_species`).
        per_class: accuracy of the site's model on the test images of each of its classes (``nan``: no image).
        test_counts: test images per class. site_counts: the site's training records per class.
        accuracy: per-class accuracy weighted by the site's own class frequencies
            (``sum_c n_kc acc_c / sum_c n_kc``): the accuracy the site would see on its own camera traffic.
        macro: unweighted mean of ``per_class`` over the site's classes (balanced accuracy on its species).
        rare: unweighted mean of ``per_class`` over ``rare_species``.
        novel: the site's model on the test images of the classes the site does *not* hold (unweighted mean over
            those classes; ``nan`` if it holds them all): whether it recognises a species it has never recorded
            (what NIRA's species-embedding merging is for; not part of the site's own accuracy).
    """

    site_id: str
    species: tuple[int, ...]
    rare_species: tuple[int, ...]
    per_class: Mapping[int, float]
    test_counts: Mapping[int, int]
    site_counts: Mapping[int, int]
    accuracy: float
    macro: float
    rare: float
    novel: float = float("nan")

    def to_json(self) -> dict[str, object]:
        """JSON-ready dict (class indices as string keys)."""
        return {"site_id": self.site_id, "species": list(self.species), "rare_species": list(self.rare_species),
                "per_class": {str(c): v for c, v in self.per_class.items()},
                "test_counts": {str(c): v for c, v in self.test_counts.items()},
                "site_counts": {str(c): v for c, v in self.site_counts.items()},
                "accuracy": self.accuracy, "macro": self.macro, "rare": self.rare, "novel": self.novel}


def rare_species(site_counts: Mapping[int, int]) -> tuple[int, ...]:
    """A site's rare species: the species with the fewest training records at that site (all of them on a tie).

    ``site_counts``: records per class index, every class of the site's list (>= 1 each). A site with one species
    has that species as its rare one. Returns sorted class indices.
    """
    if not site_counts:
        return ()
    low = min(site_counts.values())
    return tuple(sorted(int(c) for c, n in site_counts.items() if n == low))


def _nanmean(values: Sequence[float]) -> float:
    vals = [float(v) for v in values if not np.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def evaluate_sites(site_models: Mapping[str, Mapping[str, np.ndarray]], site_counts: Mapping[str, Mapping[int, int]],
                   images: np.ndarray, labels: np.ndarray, num_classes: int, *,
                   predict: Callable[[Mapping[str, np.ndarray], np.ndarray], np.ndarray] | None = None
                   ) -> dict[str, tuple[SiteAccuracy, np.ndarray]]:
    """Each site's model on the held-out test images of the classes that site holds.

    Args:
        site_models: ``{site_id: weights}`` -- the model each site would receive (FedAvg: the global model; NIRA:
            shared phi + its cluster's head). Sites given the very same arrays are predicted once.
        site_counts: ``{site_id: {class index: training records at the site}}`` (the site's full species table).
        images, labels: the held-out test split. num_classes: classes of the model.
        predict: ``predict(weights, images) -> class indices``; default: the head model's argmax on embeddings.

    Returns:
        ``{site_id: (SiteAccuracy, predictions)}``, ``predictions`` being the site model's class index for every
        test record (so the caller can pool them); sites in ``site_models`` order.
    """
    labels = np.asarray(labels)
    predict = predict or (lambda w, x: _predict(w, x, num_classes))
    cache: dict[tuple[tuple[str, int], ...], np.ndarray] = {}
    out: dict[str, tuple[SiteAccuracy, np.ndarray]] = {}
    for site_id, weights in site_models.items():
        key = tuple(sorted((name, id(arr)) for name, arr in weights.items()))
        if key not in cache:
            cache[key] = np.asarray(predict(weights, images))
        predictions = cache[key]
        counts = {int(c): int(n) for c, n in site_counts[site_id].items()}
        species = tuple(sorted(counts))
        per_class, test_counts = {}, {}
        for c in species:
            mask = labels == c
            test_counts[c] = int(mask.sum())
            per_class[c] = float((predictions[mask] == c).mean()) if mask.any() else float("nan")
        weighted = [(counts[c], per_class[c]) for c in species if not np.isnan(per_class[c])]
        total = sum(n for n, _ in weighted)
        accuracy = sum(n * a for n, a in weighted) / total if total > 0 else float("nan")
        rare = rare_species(counts)
        novel = [float((predictions[labels == c] == c).mean()) for c in range(num_classes)
                 if c not in counts and (labels == c).any()]
        site = SiteAccuracy(site_id=site_id, species=species, rare_species=rare, per_class=per_class,
                            test_counts=test_counts, site_counts=counts, accuracy=float(accuracy),
                            macro=_nanmean([per_class[c] for c in species]),
                            rare=_nanmean([per_class[c] for c in rare]), novel=_nanmean(novel))
        out[site_id] = (site, predictions)
    return out


def worst_decile(values: Sequence[float]) -> float:
    """Mean of the lowest ``ceil(n / 10)`` values (the worst 10 % of sites, at least one); ``nan`` if empty."""
    vals = sorted(float(v) for v in values if not np.isnan(v))
    if not vals:
        return float("nan")
    k = max(1, int(np.ceil(len(vals) / 10)))
    return float(np.mean(vals[:k]))


def summarise_sites(sites: Sequence[SiteAccuracy]) -> dict[str, float]:
    """The experiment's per-run numbers from the per-site evaluation.

    ``macro``: mean over sites of each site's macro accuracy. ``site_mean`` / ``site_worst_decile``: mean and
    worst decile (:func:`worst_decile`) of the sites' frequency-weighted accuracy. ``rare``: mean over sites of
    the accuracy on each site's rare species. ``novel``: mean over sites of the accuracy on the species a site
    does not hold.
    """
    return {"macro": _nanmean([s.macro for s in sites]), "site_mean": _nanmean([s.accuracy for s in sites]),
            "site_worst_decile": worst_decile([s.accuracy for s in sites]),
            "rare": _nanmean([s.rare for s in sites]), "novel": _nanmean([s.novel for s in sites])}


def train_centralised(features: np.ndarray, labels: np.ndarray, *, num_classes: int, epochs: int, batch_size: int,
                      learning_rate: float, seed: int, initial: Mapping[str, np.ndarray] | None = None,
                      adapter_width: int = 0) -> dict[str, np.ndarray]:
    """Non-private SGD on the pooled training set: the reference a federation is compared with.

    Args:
        features: float32 (N, 1280) backbone embeddings; labels: int64 (N,).
        epochs: passes over the data; batch_size: examples per step; learning_rate: SGD step size.
        seed: shuffling and initialisation seed. initial: starting weights (their architecture is trained;
            default: ``model_spec("head", num_classes, adapter_width=adapter_width).initial_weights(seed)``).

    Returns:
        The trained weights (float32 arrays).
    """
    import torch

    from shared.models.kinds import model_spec, spec_from_weights

    if initial is None:
        initial = model_spec("head", num_classes, adapter_width=adapter_width).initial_weights(seed)
    spec = spec_from_weights(initial)
    model = spec.build()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in initial.items()})
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    rng = np.random.default_rng(seed)
    x_all = torch.as_tensor(spec.prepare_input(features))
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(labels)))
        for start in range(0, len(labels), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            opt.step()
    return {k: v.detach().numpy().astype(np.float32).copy() for k, v in model.state_dict().items()}
