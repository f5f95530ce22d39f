"""How the gateway reads its species classifier: a soft prior from the site's own species table, a confidence
threshold below which the answer is "unknown", and a flag for a species the site does not list.

The classifier gives softmax probabilities ``p`` over the federation's K classes. The site's species table is
knowledge the gateway has anyway (it is in its configuration, never sent anywhere), so using it costs no privacy.
It enters as a prior weight: ``w_k = 1`` for a class the site lists and ``w_k = outside_prior`` (default 0.1) for
one it does not, and the posterior is ``p_k w_k / sum_j p_j w_j`` (Bayes' rule with the classifier's output read as
a likelihood under a uniform training prior; Saerens, Latinne & Decaestecker 2002, "Adjusting the outputs of a
classifier to new a priori probabilities", eq. 2.4). A species the site does not list therefore needs about ten
times the evidence to win, but it is never removed: when it still wins it is reported as ``unexpected`` ("unexpected
at this site"), because the animal that should not be there is the one rangers most need to see.

A posterior below ``threshold`` (default 0.5) is ``unknown``: no species is named, the best guess is kept for
reference. An arg-max over K classes always names something; with K = 10 a flat output still gives 0.1 to its top
class, so the threshold is what keeps a guess from being shown as an identification.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edge_sdk.config import SiteConfig

__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_OUTSIDE_PRIOR", "Prediction", "site_posterior", "read_prediction",
           "site_reader"]

#: Posterior below which a prediction is ``unknown``.
DEFAULT_THRESHOLD = 0.5
#: Prior weight of a class the site's species table does not list (1 for a class it lists).
DEFAULT_OUTSIDE_PRIOR = 0.1


@dataclass(frozen=True)
class Prediction:
    """How one probability vector reads.

    Attributes:
        index: class index of the top posterior (the best guess, also when ``status`` is ``unknown``).
        confidence: its posterior probability in [0, 1].
        status: ``confident``, ``unexpected`` (above the threshold, not in the site's table) or ``unknown``.
    """

    index: int
    confidence: float
    status: str

    @property
    def named(self) -> bool:
        """True when a species is named (``status`` is not ``unknown``)."""
        return self.status != "unknown"


def site_posterior(probabilities: np.ndarray, site_classes: Collection[int], *,
                   outside_prior: float = DEFAULT_OUTSIDE_PRIOR) -> np.ndarray:
    """The classifier's probabilities re-weighted by the site's species table (module docstring).

    Args:
        probabilities: float (K,) or (B, K) softmax probabilities (rows sum to 1).
        site_classes: the class indices the site lists; empty means no prior (returned unchanged).
        outside_prior: weight of an unlisted class, in (0, 1].

    Returns:
        float64 array of the same shape, rows summing to 1.

    Raises:
        ValueError: ``outside_prior`` outside (0, 1], a class index outside [0, K), or probabilities that are not
            finite and non-negative.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if not 0.0 < outside_prior <= 1.0:
        raise ValueError(f"outside_prior must be in (0, 1], got {outside_prior!r}")
    if p.ndim not in (1, 2) or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"probabilities must be a finite non-negative (K,) or (B, K) array, got shape {p.shape}")
    k = p.shape[-1]
    listed = sorted(set(int(c) for c in site_classes))
    if not listed:
        return p.copy()
    if listed[0] < 0 or listed[-1] >= k:
        raise ValueError(f"site classes {listed} fall outside the model's {k} classes")
    weights = np.full(k, float(outside_prior))
    weights[listed] = 1.0
    post = p * weights
    total = post.sum(axis=-1, keepdims=True)
    return np.divide(post, total, out=np.full_like(post, 1.0 / k), where=total > 0)


def read_prediction(probabilities: np.ndarray, site_classes: Collection[int], *,
                    threshold: float = DEFAULT_THRESHOLD,
                    outside_prior: float = DEFAULT_OUTSIDE_PRIOR) -> Prediction:
    """Read one probability vector: site prior, then the threshold, then the unexpected-species flag.

    Args:
        probabilities: float (K,) softmax probabilities.
        site_classes: class indices of the site's species table (empty: no prior, nothing is unexpected).
        threshold: posterior below which the answer is ``unknown``, in [0, 1].
        outside_prior: see :func:`site_posterior`.

    Returns:
        A :class:`Prediction`. Ties go to the lower class index.

    Raises:
        ValueError: a bad threshold, or the errors of :func:`site_posterior`.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"read_prediction takes one (K,) vector, got shape {p.shape}")
    post = site_posterior(p, site_classes, outside_prior=outside_prior)
    index = int(np.argmax(post))
    confidence = float(post[index])
    if confidence < threshold:
        status = "unknown"
    elif site_classes and index not in {int(c) for c in site_classes}:
        status = "unexpected"
    else:
        status = "confident"
    return Prediction(index=index, confidence=confidence, status=status)


def site_reader(config: SiteConfig) -> Callable[[np.ndarray], Prediction]:
    """:func:`read_prediction` with a site config's settings: its species table's classes as the prior,
    ``field.confidence_threshold`` and ``field.outside_prior`` (what ``detect`` and ``evaluate`` read a crop with,
    as the field loop does)."""
    return partial(read_prediction, site_classes={e.class_index for e in config.species},
                   threshold=config.field.confidence_threshold, outside_prior=config.field.outside_prior)
