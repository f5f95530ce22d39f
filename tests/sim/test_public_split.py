"""The demo's public split (the images no site holds, or a class-balanced one held out before the sites are
designed): disjoint from every site and from the held-out test split, deterministic in the seed."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ConfigError

from wildfed_sim.animal_mnist import AnimalMNIST, split_holdout
from wildfed_sim.common.demo_data import balanced_public_split, design_sites_with_public_split, public_split_indices
from wildfed_sim.demo import DemoSettings, load_weights, save_weights
from wildfed_sim.ecology import design_sites


def test_public_split_is_what_no_site_holds(tmp_path):
    class Spec:
        def __init__(self, indices):
            self.indices = np.asarray(indices)

    public = public_split_indices(10, [Spec([0, 3]), Spec([4, 5, 9])])
    assert public.tolist() == [1, 2, 6, 7, 8]
    weights = {"phi.w": np.arange(6, dtype=np.float32).reshape(2, 3), "psi.b": np.ones(2, dtype=np.float32)}
    back = load_weights(save_weights(weights, tmp_path / "w.safetensors"))
    assert set(back) == set(weights) and all(np.array_equal(back[k], weights[k]) for k in weights)


def _synthetic_split(seed):
    """A 10,000-image stand-in for Animal-MNIST (1,000 per class, shuffled) and its 80/20 held-out split."""
    labels = np.random.default_rng(123).permutation(np.repeat(np.arange(10, dtype=np.int64), 1000))
    data = AnimalMNIST(images=np.zeros((labels.size, 28, 28), dtype=np.uint8), labels=labels,
                       source_indices=np.arange(labels.size, dtype=np.int64))
    return split_holdout(data, 0.2, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_class", [1, 100])
def test_balanced_public_split_is_disjoint_from_sites_and_test(seed, per_class):
    train, test = _synthetic_split(seed)
    specs, public = design_sites_with_public_split(train.labels, 8, seed=seed, public_per_class=per_class)

    # exactly per_class images of every class, each once
    assert public.size == 10 * per_class and np.unique(public).size == public.size
    for c in range(10):
        assert int((train.labels[public] == c).sum()) == per_class
    # no site holds a public image; sites stay disjoint and hold exactly their listed species
    held = np.concatenate([s.indices for s in specs])
    assert np.unique(held).size == held.size
    assert not set(public.tolist()) & set(held.tolist())
    for spec in specs:
        assert sorted(set(train.labels[spec.indices].tolist())) == list(spec.species)
    # disjoint from the held-out test split, checked on the images' positions in the whole data set
    assert not set(train.source_indices[public].tolist()) & set(test.source_indices.tolist())
    assert not set(train.source_indices[held].tolist()) & set(test.source_indices.tolist())
    # the same sizes as the default design (only which images go where changes), deterministic in the seed
    default = design_sites(train.labels, 8, seed=seed)
    assert sorted(s.num_images for s in specs) == sorted(s.num_images for s in default)
    specs2, public2 = design_sites_with_public_split(train.labels, 8, seed=seed, public_per_class=per_class)
    assert np.array_equal(public, public2)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(specs, specs2))


def test_public_split_default_is_what_no_site_holds_and_bad_sizes_are_refused():
    train, _ = _synthetic_split(0)
    specs, public = design_sites_with_public_split(train.labels, 8, seed=0, public_per_class=0)
    default = design_sites(train.labels, 8, seed=0)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(specs, default))
    held = set(np.concatenate([s.indices for s in specs]).tolist())
    assert public.tolist() == [i for i in range(len(train.labels)) if i not in held]
    with pytest.raises(ConfigError):
        balanced_public_split(train.labels, 801, seed=0)  # the training split has 800 per class
    with pytest.raises(ConfigError):
        balanced_public_split(train.labels, 0, seed=0)
    with pytest.raises(ConfigError):
        DemoSettings(public_per_class=-1)
