"""The in-process replay of the demo used for tuning: one non-private round of full-batch steps at two sites,
against FedAvg worked by hand (McMahan et al. 2017, Alg. 1) with and without the public feature centre."""

from __future__ import annotations

import numpy as np
import pytest

from shared.iucn import IUCNCategory as Cat

from wildfed_sim.demo_sim import SimConfig, SimFederation, SimSite, simulate


def _federation(rng: np.random.Generator) -> SimFederation:
    def site(name, n, classes):
        labels = np.asarray([classes[i % len(classes)] for i in range(n)], np.int64)
        return SimSite(name, rng.uniform(0, 6, (n, 1280)).astype(np.float32), labels,
                       np.full(n, Cat.NE.rank, np.int8), (Cat.NE,))

    return SimFederation(sites=(site("site-00", 6, [0, 1]), site("site-01", 3, [2])),
                         test_features=rng.uniform(0, 6, (9, 1280)).astype(np.float32),
                         test_labels=np.arange(9) % 3, public_features=rng.uniform(0, 6, (5, 1280)).astype(np.float32),
                         class_categories=(Cat.NE, Cat.NE, Cat.NE))


@pytest.mark.parametrize("centre", [False, True])
def test_one_round_is_the_size_weighted_mean_of_one_full_batch_step(centre):
    fed = _federation(np.random.default_rng(0))
    lr = 0.3
    out = simulate(fed, SimConfig(privacy="none", rounds=1, local_steps=1, expected_batch_size=100,
                                  learning_rate=lr, centre=centre), seed=0)
    c = fed.public_features.astype(np.float64).mean(axis=0) if centre else np.zeros(1280)
    w, b, total = np.zeros((3, 1280)), np.zeros(3), 9.0
    for s in fed.sites:  # the round-0 head is zero, so every record's softmax is uniform
        err = np.full((len(s), 3), 1 / 3) - np.eye(3)[s.labels]
        w_k = -lr * err.T @ (s.features.astype(np.float64) - c) / len(s)
        b_k = -lr * err.mean(axis=0) - w_k @ c  # folded back to the plain form
        w += len(s) / total * w_k
        b += len(s) / total * b_k
    np.testing.assert_allclose(out["weights"]["psi.weight"], w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["weights"]["psi.bias"], b, rtol=1e-4, atol=1e-5)
    assert out["round0"]["overall"] == pytest.approx(1 / 3)  # argmax of a zero head is class 0: 3 of 9
    assert out["noise_multipliers"] == {"site-00": {}, "site-01": {}}
