"""Ecological site design: sizes, disjointness, species lists, Jaccard range, lognormal spread, determinism."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import norm

from wildfed_sim.animal_mnist import CLASS_NAMES
from wildfed_sim.ecology import (
    BIOMES,
    SENSITIVE_CLASSES,
    SiteDesignError,
    design_sites,
    jaccard,
)
from wildfed_sim.ecology_summary import summarize_design


@pytest.fixture(scope="module")
def train_labels() -> np.ndarray:
    """Labels shaped like the demo's training split: 800 per class, shuffled."""
    return np.random.default_rng(0).permutation(np.repeat(np.arange(10, dtype=np.int64), 800))


def _pairwise_jaccard(sites) -> list[float]:
    out = []
    for a, b in itertools.combinations(sites, 2):
        sa, sb = set(a.species), set(b.species)
        out.append(len(sa & sb) / len(sa | sb))
    return out


def test_jaccard_closed_forms() -> None:
    assert jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    assert jaccard({1}, {2}) == 0.0
    assert jaccard([0, 1, 2, 3], [0, 1, 2]) == pytest.approx(0.75)
    assert jaccard([], []) == 1.0


@pytest.mark.parametrize("num_sites", [8, 12, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sites_are_disjoint_sized_and_match_their_species(train_labels, num_sites: int, seed: int) -> None:
    sites = design_sites(train_labels, num_sites, seed=seed, min_site_size=20, size_spread=120.0)

    assert [s.site_id for s in sites] == [f"site-{k:02d}" for k in range(num_sites)]
    everything = np.concatenate([s.indices for s in sites])
    assert everything.dtype == np.int64
    assert np.unique(everything).size == everything.size  # each image at most once
    assert everything.min() >= 0 and everything.max() < train_labels.size
    sizes = np.array([s.num_images for s in sites])
    assert sizes.min() == 20 and np.all(sizes >= 20)
    assert sizes.max() / sizes.min() >= 100
    for site in sites:
        present = sorted(set(train_labels[site.indices].tolist()))
        assert list(site.species) == present  # the list is exactly what the data holds
        assert set(site.species_names()) <= set(BIOMES[site.biome].pool)
        assert set(BIOMES[site.biome].core) <= set(site.species_names())
        assert 2 <= site.monitoring_months <= 96
        assert np.all(np.diff(site.indices) > 0)
    assert min(s.monitoring_months for s in sites) == 2
    assert max(s.monitoring_months for s in sites) == 96
    assert len({s.species for s in sites}) == num_sites  # no two identical species lists


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_jaccard_spans_disjoint_to_about_0_8(train_labels, seed: int) -> None:
    sites = design_sites(train_labels, 8, seed=seed)

    pair = _pairwise_jaccard(sites)
    assert min(pair) == 0.0  # some site pairs share no species
    assert 0.7 <= max(pair) <= 0.85  # the seed reports 0.78
    nonzero = [j for j in pair if j > 0]
    assert min(nonzero) <= 0.15  # 1/10 is the floor of a nonzero Jaccard with 10 classes
    summary = summarize_design(sites, num_available=train_labels.size, sensitive=())
    assert summary.jaccard_min == min(pair) and summary.jaccard_max == max(pair)
    assert summary.jaccard_min_nonzero == min(nonzero)


def test_sizes_are_lognormal_quantiles(train_labels) -> None:
    num_sites, smallest, spread = 12, 20, 120.0
    sites = design_sites(train_labels, num_sites, seed=5, min_site_size=smallest, size_spread=spread)

    log_sizes = np.log(sorted(s.num_images for s in sites))
    z = norm.ppf((np.arange(num_sites) + 0.5) / num_sites)
    expected = math.log(smallest) + math.log(spread) * (z - z[0]) / (z[-1] - z[0])
    # integer rounding moves a log-size by at most log((n + 0.5) / n) <= log(20.5 / 20)
    np.testing.assert_allclose(log_sizes, expected, atol=math.log(20.5 / 20))


@pytest.mark.parametrize("num_sites", [8, 12, 16])
def test_public_species_lists_are_distinct_and_non_empty(train_labels, num_sites: int) -> None:
    assert {CLASS_NAMES[c] for c in SENSITIVE_CLASSES} == {"elephant", "dog"}  # the CR and EN classes
    sites = design_sites(train_labels, num_sites, seed=0)

    public = [tuple(c for c in s.species if c not in SENSITIVE_CLASSES) for s in sites]
    assert all(public)
    assert len(set(public)) == num_sites


def test_more_sites_than_distinct_lists_still_partition(train_labels) -> None:
    # 19 sites put three on the Arctic coast, whose pool has two species: lists must repeat there.
    sites = design_sites(train_labels, 19, seed=0, size_spread=100.0)

    everything = np.concatenate([s.indices for s in sites])
    assert np.unique(everything).size == everything.size
    assert min(s.num_images for s in sites) == 20


def test_design_is_deterministic_for_a_seed(train_labels) -> None:
    a = design_sites(train_labels, 8, seed=7)
    b = design_sites(train_labels, 8, seed=7)
    c = design_sites(train_labels, 8, seed=8)

    for x, y in zip(a, b, strict=True):
        assert (x.site_id, x.biome, x.species, x.monitoring_months, x.latitude, x.longitude) == (
            y.site_id, y.biome, y.species, y.monitoring_months, y.latitude, y.longitude)
        np.testing.assert_array_equal(x.indices, y.indices)
    assert any(not np.array_equal(x.indices, y.indices) for x, y in zip(a, c, strict=True))


def test_summary_reports_public_lists_without_sensitive_classes(train_labels) -> None:
    sites = design_sites(train_labels, 8, seed=0)
    sensitive = (CLASS_NAMES.index("elephant"), CLASS_NAMES.index("dog"))

    summary = summarize_design(sites, num_available=train_labels.size, sensitive=sensitive)

    public = [set(s.species) - set(sensitive) for s in sites]
    pair = [len(a & b) / len(a | b) for a, b in itertools.combinations(public, 2)]
    assert summary.public_jaccard_min == min(pair) and summary.public_jaccard_max == max(pair)
    assert summary.size_spread == max(s.num_images for s in sites) / min(s.num_images for s in sites)
    assert summary.images_used == sum(s.num_images for s in sites)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_sites": 1}, "num_sites"),
        ({"num_sites": 8, "min_site_size": 0}, "min_site_size"),
        ({"num_sites": 8, "min_site_size": 2000}, "fix:"),
        ({"num_sites": 16, "size_spread": 400.0}, "fix:"),
        ({"num_sites": 8, "biome_cycle": ("tundra",)}, "unknown biome"),
    ],
)
def test_impossible_designs_raise_with_a_fix(train_labels, kwargs, match) -> None:
    with pytest.raises(SiteDesignError, match=match):
        design_sites(train_labels, seed=0, **kwargs)


def test_labels_are_validated() -> None:
    with pytest.raises(SiteDesignError, match="1-D integer"):
        design_sites(np.zeros((4, 2), dtype=np.int64), 8, seed=0)
    with pytest.raises(SiteDesignError, match="0..9"):
        design_sites(np.array([0, 11]), 8, seed=0)
