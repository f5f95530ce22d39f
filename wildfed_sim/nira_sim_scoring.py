"""How the NIRA head experiment (:mod:`wildfed_sim.nira_sim`) scores each site's model: the head model's logits
in numpy, the site's private fine-tuning of its head, and the federation's metrics (macro, site mean, rare, CR/EN)
under the plain, species-mask and fine-tune scorings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from shared.errors import ConfigError

from wildfed_sim.nira_sim_settings import METRICS


def _hidden(weights: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """float64 (N, H): the head model's input to psi (tanh adapter phi when present, else the embeddings)."""
    x = np.asarray(features, dtype=np.float64)
    if "phi.0.weight" in weights:
        return np.tanh(x @ np.asarray(weights["phi.0.weight"], np.float64).T
                       + np.asarray(weights["phi.0.bias"], np.float64))
    return x


def head_logits(weights: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """The head model's logits, float64 (N, K), from float32 (N, 1280) embeddings (``shared.models.head``:
    ``psi(tanh(phi(x)))`` with an adapter, ``psi(x)`` without); the same as the torch model up to float
    rounding (tested)."""
    h = _hidden(weights, features)
    return h @ np.asarray(weights["psi.weight"], np.float64).T + np.asarray(weights["psi.bias"], np.float64)


def fine_tune_head(weights: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray, *, steps: int
                   ) -> dict[str, np.ndarray]:
    """The site's personalised head: ``steps`` full-batch gradient-descent steps on the mean cross-entropy of its
    own records, psi only (the adapter stays the federation's), from ``weights``. Never released, so it costs no
    privacy (the personalised-model baseline of Ditto, Li et al. ICML 2021, without the proximal term).

    The inputs of psi are centred on the site's own mean (a reparametrisation: the bias absorbs it) and the step
    is 1 / L with ``L = 0.5 * max_i (||h_i - mean||^2 + 1)``, a bound of the largest Hessian eigenvalue of the
    softmax cross-entropy (Böhning 1992, "Multinomial logistic regression algorithm", the bound (I - 11^T/K) / 2),
    so the steps descend without tuning.

    Args:
        weights: the site's model. features: float32 (N, 1280). labels: int (N,). steps: >= 0.

    Returns:
        A copy of ``weights`` with the fine-tuned ``psi.weight`` (K, H) and ``psi.bias`` (K,), float32.
    """
    h = _hidden(weights, features)
    mu = h.mean(axis=0)
    hc = h - mu
    w = np.asarray(weights["psi.weight"], np.float64).copy()
    b = np.asarray(weights["psi.bias"], np.float64) + w @ mu  # the same logits on centred inputs
    y = np.asarray(labels, dtype=np.int64)
    onehot = np.eye(w.shape[0])[y]
    step = 1.0 / (0.5 * (float(np.max(np.sum(hc * hc, axis=1))) + 1.0))
    for _ in range(int(steps)):
        z = hc @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        r = (p - onehot) / len(y)
        w -= step * (r.T @ hc)
        b -= step * r.sum(axis=0)
    out = dict(weights)
    out["psi.weight"] = w.astype(np.float32)
    out["psi.bias"] = (b - w @ mu).astype(np.float32)
    return out


def _site_summary(per_class: Mapping[int, float], counts: Mapping[int, int], sensitive: set[int]) -> dict[str, float]:
    from wildfed_sim.evaluation import rare_species

    species = sorted(counts)
    vals = [per_class[c] for c in species if not math.isnan(per_class[c])]
    weighted = [(counts[c], per_class[c]) for c in species if not math.isnan(per_class[c])]
    total = sum(n for n, _ in weighted)
    rare = [per_class[c] for c in rare_species(counts) if not math.isnan(per_class[c])]
    cr_en = [per_class[c] for c in species if c in sensitive and not math.isnan(per_class[c])]
    return {"macro": statistics.fmean(vals) if vals else math.nan,
            "site_mean": sum(n * a for n, a in weighted) / total if total else math.nan,
            "rare": statistics.fmean(rare) if rare else math.nan,
            "cr_en": statistics.fmean(cr_en) if cr_en else math.nan}


def score_sites(fed: Any, site_models: Mapping[str, Mapping[str, np.ndarray]], scoring: str,
                fine_tune_steps: int = 0) -> dict[str, float]:
    """The federation's metrics (:data:`METRICS`, fractions; mean over sites, sites without a CR/EN species left
    out of ``cr_en``) for each site's model scored as ``scoring`` (``"plain"``, ``"mask"``, ``"fine-tune"``) on
    the held-out test images of the classes it holds.

    Raises:
        ConfigError: an unknown scoring.
    """
    if scoring not in ("plain", "mask", "fine-tune"):
        raise ConfigError(f"unknown scoring {scoring!r}", field="scoring", fix="use plain, mask or fine-tune")
    labels = np.asarray(fed.test_labels)
    sensitive = {k for k, c in enumerate(fed.class_categories) if c.is_sensitive}
    per_site: list[dict[str, float]] = []
    for site in fed.sites:
        weights = site_models[site.site_id]
        if scoring == "fine-tune":
            weights = fine_tune_head(weights, site.features, site.labels, steps=fine_tune_steps)
        species = list(site.species) or sorted({int(c) for c in site.labels})
        rows = np.isin(labels, species)
        logits = head_logits(weights, fed.test_features[rows])
        if scoring == "mask":
            masked = np.full_like(logits, -np.inf)
            masked[:, species] = logits[:, species]
            logits = masked
        pred = logits.argmax(axis=1)
        y = labels[rows]
        per_class = {c: float((pred[y == c] == c).mean()) if (y == c).any() else math.nan for c in species}
        counts = {c: int((site.labels == c).sum()) for c in species}
        per_site.append(_site_summary(per_class, counts, sensitive))
    out = {}
    for m in METRICS:
        vals = [s[m] for s in per_site if not math.isnan(s[m])]
        out[m] = statistics.fmean(vals) if vals else math.nan
    return out

