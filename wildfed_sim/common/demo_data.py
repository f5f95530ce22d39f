"""The demo's data: the Animal-MNIST split, the sites designed on it and the public split, as ``wildfed demo`` builds
them and as the in-process simulations (wildfed_sim.demo_sim) and the experiments rebuild them for a seed.

Nothing here draws from a shared random stream: the site design uses its seed (:func:`wildfed_sim.ecology
.design_sites`), the balanced public split its own generator, so the demo's draws do not depend on who calls first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from shared.errors import ConfigError

__all__ = ["public_split_indices", "without_site_duplicates", "balanced_public_split", "design_sites_with_public_split",
           "demo_sites", "public_images"]


def public_split_indices(num_train: int, specs: Any, images: np.ndarray | None = None) -> np.ndarray:
    """Indices (into the training split) of the images that no site holds: the public pretraining split.

    The held-out test split is separate and never part of it; the sites' images are disjoint from it, so
    pretraining on it spends no site's privacy budget. With ``images`` (uint8 (num_train, H, W)), an image whose
    bytes equal an image a site holds is left out too (:func:`without_site_duplicates`): the demo drops a site's
    duplicate images, so a dropped duplicate is not "held" by index, but its pixels are the site's.
    """
    used = np.zeros(num_train, dtype=bool)
    for spec in specs:
        used[np.asarray(spec.indices, dtype=np.int64)] = True
    public = np.flatnonzero(~used)
    return public if images is None else without_site_duplicates(public, images, specs)


def without_site_duplicates(public: np.ndarray, images: np.ndarray, specs: Any) -> np.ndarray:
    """``public`` (int64 indices into ``images``, uint8 (N, H, W)) less every image byte-identical (SHA-256 of
    the array's bytes, as :func:`wildfed_sim.camtrap_writer.distinct_images`) to an image some site holds."""
    from wildfed_sim.camtrap_writer import image_digest

    held = {image_digest(images[int(i)]) for spec in specs for i in np.asarray(spec.indices, dtype=np.int64)}
    return np.asarray([i for i in np.asarray(public, dtype=np.int64) if image_digest(images[int(i)]) not in held],
                      dtype=np.int64)


def balanced_public_split(labels: np.ndarray, per_class: int, *, seed: int) -> np.ndarray:
    """Sorted indices (into the training split ``labels``) of ``per_class`` images of every class, drawn
    uniformly at random without replacement by its own generator (``default_rng([seed, 0x5055424C])``, so it
    does not shift the site design's random stream): the class-balanced public split.

    :func:`design_sites_with_public_split` keeps these images away from every site; they come from the training
    split only, so they are disjoint from the held-out test split too.

    Raises:
        ConfigError: ``per_class`` < 1, or more than a class has.
    """
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    labels = np.asarray(labels)
    if per_class < 1:
        raise ConfigError(f"public_per_class must be >= 1, got {per_class}", field="public_per_class",
                          fix="use e.g. 100, or 0 for the images no site holds")
    rng = np.random.default_rng([seed, 0x5055424C])
    parts = []
    for c in range(len(SPECIES_TABLE)):
        members = np.flatnonzero(labels == c)
        if members.size < per_class:
            raise ConfigError(f"class {c} has {members.size} training images, fewer than public_per_class="
                              f"{per_class}", field="public_per_class", fix="use a smaller public_per_class")
        parts.append(rng.choice(members, size=per_class, replace=False))
    return np.sort(np.concatenate(parts)).astype(np.int64)


def design_sites_with_public_split(labels: np.ndarray, num_sites: int, *, seed: int,
                                   public_per_class: int = 0) -> tuple[list[Any], np.ndarray]:
    """The demo's sites and its public split, from the training split's ``labels``.

    ``public_per_class == 0``: :func:`~wildfed_sim.ecology.design_sites` on every training image
    (the demo's default design), and the public split is whatever no site holds (:func:`public_split_indices`;
    not class-balanced). ``public_per_class > 0``: first :func:`balanced_public_split` reserves that many images
    of every class, then the sites are designed on the remaining training images only (indices mapped back into
    the training split), so no site holds a public image.

    Returns:
        (site specs with indices into the training split, sorted public indices into the training split).
    """
    from wildfed_sim.ecology import design_sites

    labels = np.asarray(labels)
    if public_per_class <= 0:
        specs = design_sites(labels, num_sites, seed=seed)
        return specs, public_split_indices(len(labels), specs)
    public = balanced_public_split(labels, public_per_class, seed=seed)
    rest = np.setdiff1d(np.arange(len(labels)), public)
    specs = [dataclasses.replace(s, indices=rest[s.indices])
             for s in design_sites(labels[rest], num_sites, seed=seed)]
    return specs, public


def demo_sites(seed: int, num_sites: int, *, public_per_class: int = 0) -> tuple[Any, Any, list[Any], Any]:
    """The demo's data for ``seed``: Animal-MNIST split 80/20 (:func:`~wildfed_sim.animal_mnist.split_holdout`),
    the sites designed on the training split (:func:`design_sites_with_public_split`), and each site's byte-identical
    repeats dropped (a site holds each image once: :func:`~wildfed_sim.camtrap_writer.distinct_images`).

    Returns:
        (train split, held-out test split, site specs with indices into the training split, design summary of the
        sites as designed, before the repeats were dropped).
    """
    from wildfed_sim.animal_mnist import fetch_animal_mnist, split_holdout
    from wildfed_sim.camtrap_writer import distinct_images
    from wildfed_sim.ecology_summary import summarize_design

    train, test = split_holdout(fetch_animal_mnist(), 0.2, seed=seed)
    specs, _ = design_sites_with_public_split(train.labels, num_sites, seed=seed, public_per_class=public_per_class)
    summary = summarize_design(specs, num_available=len(train))
    specs = [dataclasses.replace(s, indices=s.indices[distinct_images(train.images[s.indices])]) for s in specs]
    return train, test, specs, summary


def public_images(train: Any, specs: Any, *, public_per_class: int, seed: int) -> np.ndarray:
    """Indices (into the training split) of the demo's public images: :func:`balanced_public_split` when
    ``public_per_class > 0`` (the sites must come from :func:`design_sites_with_public_split` with the same value),
    else :func:`public_split_indices`; in both cases less every byte-copy of an image a site holds.

    Raises:
        ConfigError: a site holds an image of the balanced split.
    """
    if public_per_class <= 0:
        return public_split_indices(len(train.labels), specs, train.images)
    public = balanced_public_split(train.labels, public_per_class, seed=seed)
    held = np.concatenate([np.asarray(s.indices, dtype=np.int64) for s in specs])
    if np.isin(public, held).any():
        raise ConfigError("a site holds images of the balanced public split", field="public_per_class",
                          fix="design the sites with design_sites_with_public_split(public_per_class=...)")
    return without_site_duplicates(public, train.images, specs)
