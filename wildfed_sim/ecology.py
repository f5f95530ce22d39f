"""Partition training images into camera-trap sites by an ecological design (deliberately non-IID).

The NIRA seed characterises real camera-trap federations: species lists with pairwise Jaccard similarity from
0.02 to 0.78, a 250x spread in data per site, and monitoring from 2 months to 8 years. This module builds sites
with the same kind of skew from the 10 Animal-MNIST classes:

1. **Biomes.** Each site belongs to a biome (:data:`BIOMES`) with a species pool: savanna, Central African
   rainforest, East African rangeland (pastoral ranch), European farmland, Highland moorland, Arctic coast.
   Sites are given biomes in the fixed order of :data:`BIOME_CYCLE`, so K=8 always holds two savanna, two
   farmland sites, and one each of Arctic, rainforest, rangeland and moorland.
2. **Species lists.** A site keeps its biome's core species and each other pool species with probability 1/2.
   ``num_candidates`` such draws of all K lists are made from ``numpy.random.default_rng(seed)``; the one whose
   (min, max) pairwise Jaccard is closest (L1) to ``target_jaccard`` = (0.02, 0.78) is kept, preferring designs whose public lists (CR/EN classes removed, as
   docs/privacy.md requires of clustering metadata) are non-empty and distinct, and that no two sites share a list
   (possible up to K = 18 with the default biome cycle; beyond that the Arctic, whose pool has two species, has
   more sites than distinct lists).
3. **Sizes.** Site sizes are lognormal quantiles ``min_site_size * size_spread ** ((z_k - z_1) / (z_K - z_1))``
   with ``z_k`` the standard normal quantile at ``(k - 0.5) / K``: the smallest site has exactly
   ``min_site_size`` images, the largest ``size_spread`` times more. Sizes go to sites in order of their species
   capacity (the largest size to the site whose species have the most training images), ties broken by the seed.
4. **Species mix inside a site.** Camera-trap counts are dominated by a few species, so each listed species gets
   a lognormal(0, 1) abundance weight; the site's size is shared out in proportion to the weights, scaled down
   for classes that would run out of images (capped iterative proportional fitting), then made integral by a
   small linear programme. Every listed species gets at least one image, so a site's species list is exactly
   what its data contains.
5. **Images.** Each class's training indices are shuffled once and handed out in consecutive blocks: every image
   is used by at most one site; the rest stay unused (a federation never sees all the data there is).
6. **Monitoring months** are log-spaced from 2 to 96 (8 years), shuffled over sites by the seed.

What 10 classes allow: a nonzero Jaccard is at least ``1 / |A u B| >= 1/10``, so the seed's 0.02 (one shared
species out of ~50) cannot be met; the design reaches 0 (disjoint lists: e.g. an Arctic site and a farmland site)
and then 0.1 as the smallest nonzero value. Measured numbers are in ``docs/demo-data.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from shared.errors import WildFedError
from shared.iucn import IUCNCategory

from coordinator.strategies.ecological_clustering import pairwise_values

from .animal_mnist import CLASS_NAMES, SPECIES_TABLE
from .site_allocation import allocate_images

__all__ = [
    "BIOMES",
    "BIOME_CYCLE",
    "SENSITIVE_CLASSES",
    "Biome",
    "SiteDesignError",
    "SiteSpec",
    "design_sites",
    "jaccard",
    "jaccard_matrix",
    "lognormal_quantile_sizes",
]


class SiteDesignError(WildFedError, ValueError):
    """The requested site design cannot be built from the given labels (too many or too large sites)."""


@dataclass(frozen=True, slots=True)
class Biome:
    """A biome and the species a camera trap there can record.

    Attributes:
        name: short identifier (``"savanna"``).
        description: one line, written into Camtrap DP ``deployments.habitat``.
        pool: class names that live there (subset of :data:`~wildfed_sim.animal_mnist.CLASS_NAMES`).
        core: class names every site of this biome records (subset of ``pool``).
        latitude, longitude: WGS84 decimal degrees of a fictional but plausible reference point; sites are
            placed within about 0.5 degrees of it.
    """

    name: str
    description: str
    pool: tuple[str, ...]
    core: tuple[str, ...]
    latitude: float
    longitude: float


BIOMES: dict[str, Biome] = {
    b.name: b
    for b in (
        Biome("savanna", "East African savanna woodland, protected area",
              ("elephant", "giraffe", "zebra", "dog", "bird", "cow"), ("giraffe", "zebra"), -2.33, 34.83),
        Biome("farmland", "European mixed farmland with hedgerows",
              ("cow", "horse", "sheep", "cat", "dog", "bird"), ("cow", "sheep"), 51.05, 4.40),
        Biome("arctic", "Arctic coast and sea-ice edge",
              ("bear", "bird"), ("bear",), 78.22, 15.65),
        Biome("rainforest", "Central African lowland rainforest and forest clearings (bais)",
              ("elephant", "bird", "cat"), ("elephant", "bird"), -0.20, 11.60),
        Biome("rangeland", "East African pastoral rangeland shared by livestock and wildlife",
              ("cow", "sheep", "dog", "zebra", "giraffe", "bird", "horse"), ("cow", "zebra"), 0.29, 36.90),
        Biome("moorland", "Highland moorland and upland pasture",
              ("sheep", "horse", "cat", "bird", "cow"), ("sheep", "cat"), 57.08, -3.67),
    )
}
"""The demo's biomes. Domestic dogs do not exist in the class table (``dog`` is the African wild dog), so farmland
and rangeland ``dog`` records are wild dogs passing through: plausible in Laikipia-like rangeland, a stretch in
European farmland that the demo accepts."""

BIOME_CYCLE: tuple[str, ...] = (
    "savanna", "farmland", "arctic", "rainforest", "savanna", "farmland", "rangeland", "moorland",
    "savanna", "rangeland", "farmland", "arctic", "moorland", "rainforest", "savanna", "farmland",
)
"""Biome of site k is ``BIOME_CYCLE[k % len(BIOME_CYCLE)]``."""

MIN_MONTHS, MAX_MONTHS = 2, 96

SENSITIVE_CLASSES: tuple[int, ...] = tuple(
    e.class_index for e in SPECIES_TABLE if e.iucn in (IUCNCategory.CR, IUCNCategory.EN)
)
"""Classes whose species are CR or EN (elephant, dog): kept out of public species lists (docs/privacy.md)."""


@dataclass(frozen=True, slots=True, eq=False)
class SiteSpec:
    """One camera-trap site of the demo federation.

    Attributes:
        site_id: ``"site-00"``, ``"site-01"``, ... (stable for a design).
        biome: key of :data:`BIOMES`.
        species: sorted class indices (0-9) present at the site; every one has at least one image.
        indices: int64 array, shape (N_k,), sorted positions into the training set given to
            :func:`design_sites`.
        monitoring_months: length of the deployment in months (2-96).
        latitude, longitude: WGS84 decimal degrees of the (fictional) camera location.
        habitat: free-text habitat, from the biome.
    """

    site_id: str
    biome: str
    species: tuple[int, ...]
    indices: np.ndarray
    monitoring_months: int
    latitude: float
    longitude: float
    habitat: str

    @property
    def num_images(self) -> int:
        """N_k, the number of images at the site."""
        return int(self.indices.shape[0])

    def species_names(self, class_names: Sequence[str] = CLASS_NAMES) -> tuple[str, ...]:
        """Class names of :attr:`species`."""
        return tuple(class_names[c] for c in self.species)


def jaccard(a: Sequence[int] | set[int], b: Sequence[int] | set[int]) -> float:
    """Jaccard similarity ``|a n b| / |a u b|`` of two species lists (1.0 when both are empty)."""
    sa, sb = set(a), set(b)
    union = sa | sb
    return 1.0 if not union else len(sa & sb) / len(union)


def jaccard_matrix(species_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """float64 array, shape (K, K): pairwise Jaccard similarity, ones on the diagonal."""
    k = len(species_lists)
    out = np.ones((k, k), dtype=np.float64)
    for i, j in itertools.combinations(range(k), 2):
        out[i, j] = out[j, i] = jaccard(species_lists[i], species_lists[j])
    return out


def lognormal_quantile_sizes(num_sites: int, *, min_size: int, spread: float) -> np.ndarray:
    """Site sizes at evenly spaced quantiles of a lognormal, smallest ``min_size``, largest ``min_size*spread``.

    Size k (k = 1..K, ascending) is ``round(min_size * spread ** ((z_k - z_1) / (z_K - z_1)))`` with
    ``z_k = Phi^-1((k - 0.5) / K)``: log-sizes are normal quantiles rescaled to span ``log(spread)``.

    Returns:
        int64 array, shape (K,), ascending.

    Raises:
        SiteDesignError: ``num_sites < 2``, ``min_size < 1`` or ``spread < 1``.
    """
    if num_sites < 2 or min_size < 1 or spread < 1:
        raise SiteDesignError(f"need num_sites >= 2, min_size >= 1, spread >= 1; got {num_sites}, {min_size}, {spread}")
    z = np.array([NormalDist().inv_cdf((k + 0.5) / num_sites) for k in range(num_sites)])
    u = (z - z[0]) / (z[-1] - z[0])
    return np.rint(min_size * np.power(spread, u)).astype(np.int64)


def _draw_species_lists(biomes: Sequence[Biome], rng: np.random.Generator, num_candidates: int,
                        target: tuple[float, float], sensitive: frozenset[int]) -> list[tuple[int, ...]]:
    """Pick the candidate set of species lists whose (min, max) Jaccard is closest to ``target``.

    Candidates with two identical lists get a penalty of 2, candidates whose *public* lists (``sensitive``
    classes removed) repeat or are empty a penalty of 1, so they are taken only when nothing else is found
    (e.g. more than two Arctic sites, whose pool has two species).
    """
    best: list[tuple[int, ...]] = []
    best_score = math.inf
    for _ in range(num_candidates):
        lists: list[tuple[int, ...]] = []
        for biome in biomes:
            keep = [s for s in biome.pool if s in biome.core or rng.random() < 0.5]
            lists.append(tuple(sorted(CLASS_NAMES.index(s) for s in keep)))
        pair = pairwise_values(jaccard_matrix(lists))
        score = abs(pair.min() - target[0]) + abs(pair.max() - target[1])
        if len(set(lists)) < len(lists):
            score += 2.0  # two identical lists: only when the biomes leave no choice (many sites per biome)
        public = [tuple(c for c in lst if c not in sensitive) for lst in lists]
        if len(set(public)) < len(public) or not all(public):
            score += 1.0
        if score < best_score:
            best, best_score = lists, score
    return best


def design_sites(labels: np.ndarray, num_sites: int, *, seed: int, min_site_size: int = 20,
                 size_spread: float = 120.0, target_jaccard: tuple[float, float] = (0.02, 0.78),
                 num_candidates: int = 512, num_size_assignments: int = 64,
                 biome_cycle: Sequence[str] = BIOME_CYCLE,
                 sensitive: Sequence[int] | None = None) -> list[SiteSpec]:
    """Partition a training set into ``num_sites`` camera-trap sites (see the module docstring for the design).

    Args:
        labels: int array, shape (N,), class of each training image (0-9).
        num_sites: K >= 2.
        seed: seeds every random choice; the same arguments give the same sites.
        min_site_size: images at the smallest site (every site has at least this many).
        size_spread: largest / smallest site size (>= 1; the NIRA seed reports 250x; 120 fits 8-16 sites in
            the 8,000 Animal-MNIST training images).
        target_jaccard: (low, high) pairwise Jaccard the species lists should span.
        num_candidates: species-list draws searched for the target.
        num_size_assignments: assignments of sizes to sites tried until one fits the images available
            (the first puts the largest sizes on the sites with the most images per species, the rest are
            seeded permutations).
        biome_cycle: biome of site k is ``biome_cycle[k % len(biome_cycle)]``.
        sensitive: classes left out of the public species lists used for clustering (default
            :data:`SENSITIVE_CLASSES`, the CR and EN classes); designs whose public lists repeat or are empty
            are avoided when the search finds another.

    Returns:
        K :class:`SiteSpec`, ``site-00`` ... in order; disjoint ``indices``; sizes spanning
        ``[min_site_size, ~min_site_size * size_spread]``.

    Raises:
        SiteDesignError: bad arguments, an unknown biome, or sites too large for the images available.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise SiteDesignError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CLASS_NAMES)):
        raise SiteDesignError(f"labels must lie in 0..{len(CLASS_NAMES) - 1}")
    if num_sites < 2:
        raise SiteDesignError(f"num_sites must be >= 2, got {num_sites}")
    if min_site_size < 1:
        raise SiteDesignError(f"min_site_size must be >= 1, got {min_site_size}")
    unknown = sorted(set(biome_cycle) - set(BIOMES))
    if unknown:
        raise SiteDesignError(f"unknown biome(s) {unknown}; known: {sorted(BIOMES)}")
    rng = np.random.default_rng(seed)
    biomes = [BIOMES[biome_cycle[k % len(biome_cycle)]] for k in range(num_sites)]
    if sensitive is None:
        sensitive = SENSITIVE_CLASSES
    species_lists = _draw_species_lists(biomes, rng, num_candidates, target_jaccard, frozenset(sensitive))

    num_classes = len(CLASS_NAMES)
    available = np.bincount(labels, minlength=num_classes).astype(np.int64)
    sizes_sorted = lognormal_quantile_sizes(num_sites, min_size=min_site_size, spread=size_spread)
    if sizes_sorted.sum() > available.sum():
        raise SiteDesignError(
            f"{num_sites} sites need {int(sizes_sorted.sum())} images, only {int(available.sum())} available; "
            "fix: lower size_spread or min_site_size, or use fewer sites"
        )
    weights = np.zeros((num_sites, num_classes), dtype=np.float64)
    for k, species in enumerate(species_lists):
        weights[k, list(species)] = rng.lognormal(0.0, 1.0, size=len(species))
    # Largest sizes to the sites whose species are shared by the fewest other sites (most images each).
    listing = np.maximum((weights > 0).sum(0), 1)
    capacity = np.array([(available[list(s)] / listing[list(s)]).sum() for s in species_lists])
    counts = None
    for attempt in range(num_size_assignments):
        tiebreak = rng.permutation(num_sites)
        order = np.lexsort((tiebreak, capacity)) if attempt == 0 else tiebreak
        sizes = np.empty(num_sites, dtype=np.int64)
        sizes[order] = sizes_sorted
        counts = allocate_images(sizes, weights, available)
        if counts is not None:
            break
    if counts is None:
        raise SiteDesignError(
            f"no assignment of the sizes {sizes_sorted.tolist()} to the {num_sites} sites fits the images of "
            f"their species ({available.tolist()} per class) in {num_size_assignments} tries; "
            "fix: lower size_spread or min_site_size, or use fewer sites"
        )

    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    cursor = np.zeros(num_classes, dtype=np.int64)
    months = np.rint(np.geomspace(MIN_MONTHS, MAX_MONTHS, num_sites)).astype(np.int64)
    months = months[rng.permutation(num_sites)]
    sites: list[SiteSpec] = []
    for k, biome in enumerate(biomes):
        parts = []
        for c in range(num_classes):
            n = int(counts[k, c])
            parts.append(pools[c][cursor[c]:cursor[c] + n])
            cursor[c] += n
        lat, lon = biome.latitude + rng.uniform(-0.5, 0.5), biome.longitude + rng.uniform(-0.5, 0.5)
        sites.append(SiteSpec(
            site_id=f"site-{k:02d}",
            biome=biome.name,
            species=tuple(int(c) for c in np.flatnonzero(counts[k] > 0)),
            indices=np.sort(np.concatenate(parts)).astype(np.int64),
            monitoring_months=int(months[k]),
            latitude=round(float(lat), 3),
            longitude=round(float(lon), 3),
            habitat=biome.description,
        ))
    return sites
