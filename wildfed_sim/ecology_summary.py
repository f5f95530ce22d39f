"""Heterogeneity statistics of a site design (:func:`wildfed_sim.ecology.design_sites`): pairwise Jaccard similarity
of the sites' species lists, full and public (the CR/EN classes removed), site sizes and monitoring periods, as a
:class:`DesignSummary` (docs/demo-data.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.strategies.ecological_clustering import pairwise_values
from wildfed_sim.ecology import SENSITIVE_CLASSES, SiteDesignError, SiteSpec, jaccard_matrix

__all__ = ["DesignSummary", "summarize_design"]


@dataclass(frozen=True, slots=True)
class DesignSummary:
    """Heterogeneity statistics of a design.

    Attributes:
        num_sites: K.
        jaccard_min, jaccard_max: extreme pairwise Jaccard similarity of the full species lists.
        jaccard_min_nonzero: smallest Jaccard above 0 (``nan`` if none).
        public_jaccard_min, public_jaccard_max: the same over the *public* lists (``sensitive`` classes removed,
            as docs/privacy.md requires for clustering metadata); ``nan`` when not computed or a public list is empty.
        size_min, size_max: smallest and largest N_k (images).
        size_spread: ``size_max / size_min``.
        images_used, images_available: images assigned to sites, and the training set size.
        months_min, months_max: shortest and longest monitoring period (months).
    """

    num_sites: int
    jaccard_min: float
    jaccard_max: float
    jaccard_min_nonzero: float
    public_jaccard_min: float
    public_jaccard_max: float
    size_min: int
    size_max: int
    size_spread: float
    images_used: int
    images_available: int
    months_min: int
    months_max: int


def summarize_design(sites: Sequence[SiteSpec], *, num_available: int,
                     sensitive: Sequence[int] | None = None) -> DesignSummary:
    """Heterogeneity statistics of a design.

    Args:
        sites: the output of :func:`design_sites` (K >= 2).
        num_available: size of the training set the sites were cut from.
        sensitive: class indices left out of the public species lists (default :data:`SENSITIVE_CLASSES`,
            the CR/EN classes; pass ``()`` to skip the public statistics).

    Returns:
        A :class:`DesignSummary`.

    Raises:
        SiteDesignError: fewer than two sites.
    """
    if len(sites) < 2:
        raise SiteDesignError("a design summary needs at least two sites")
    pair = pairwise_values(jaccard_matrix([s.species for s in sites]))
    nonzero = pair[pair > 0]
    if sensitive is None:
        sensitive = SENSITIVE_CLASSES
    public_lists = [tuple(c for c in s.species if c not in set(sensitive)) for s in sites]
    if sensitive and all(public_lists):
        public = pairwise_values(jaccard_matrix(public_lists))
        pub_min, pub_max = float(public.min()), float(public.max())
    else:
        pub_min = pub_max = float("nan")
    sizes = np.array([s.num_images for s in sites])
    months = [s.monitoring_months for s in sites]
    return DesignSummary(
        num_sites=len(sites),
        jaccard_min=float(pair.min()),
        jaccard_max=float(pair.max()),
        jaccard_min_nonzero=float(nonzero.min()) if nonzero.size else float("nan"),
        public_jaccard_min=pub_min,
        public_jaccard_max=pub_max,
        size_min=int(sizes.min()),
        size_max=int(sizes.max()),
        size_spread=float(sizes.max() / sizes.min()),
        images_used=int(sizes.sum()),
        images_available=int(num_available),
        months_min=int(min(months)),
        months_max=int(max(months)),
    )
