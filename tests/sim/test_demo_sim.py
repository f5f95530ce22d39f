"""The in-process replay of the demo used for tuning: one non-private round of full-batch steps at two sites,
against FedAvg worked by hand (McMahan et al. 2017, Alg. 1) with and without the public feature centre; one
trusted-server Global DP round against the hand-worked clipped mean and the noise std of a z calibrated here."""

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


def test_global_round_is_the_folded_clipped_mean_plus_noise_of_the_calibrated_std():
    # Trusted-server Global DP, one round, q = 1 at both sites (B >= N): the model moves by -lr * (sum of clipped
    # centred gradients + N(0, (z C)^2)) / 9, folded with the public centre. The mean is worked by hand; z is
    # calibrated here with dp-accounting directly (one unsampled Gaussian release at NE's eps 2, delta 1e-5) and the
    # residual of the 3,840 weight coordinates must have standard deviation lr z C / 9 (sampling error ~1.1 %).
    import dp_accounting

    fed = _federation(np.random.default_rng(1))
    lr, clip, eps = 0.5, 1.0, 2.0
    out = simulate(fed, SimConfig(privacy="global", budgets={Cat.NE: eps}, rounds=1, local_steps=1,
                                  expected_batch_size=100, learning_rate=lr, clipping_norm=clip, server_momentum=0.0,
                                  centre=True), seed=3)
    c = fed.public_features.astype(np.float64).mean(axis=0)
    s_w, s_b = np.zeros((3, 1280)), np.zeros(3)
    for s in fed.sites:  # zero head: every softmax is uniform
        err = np.full((len(s), 3), 1 / 3) - np.eye(3)[s.labels]
        xc = s.features.astype(np.float64) - c
        norms = np.linalg.norm(err, axis=1) * np.sqrt((xc ** 2).sum(axis=1) + 1.0)
        f = np.minimum(1.0, clip / norms)
        s_w += (f[:, None] * err).T @ xc
        s_b += (f[:, None] * err).sum(axis=0)
    w = -lr * s_w / 9
    z = dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant, lambda z_: dp_accounting.GaussianDpEvent(z_), eps, 1e-5)
    residual = out["weights"]["psi.weight"].astype(np.float64) - w
    assert abs(residual.std() / (lr * z * clip / 9) - 1) < 0.05
    assert abs(residual.mean()) < 5 * lr * z * clip / 9 / np.sqrt(residual.size)
    # the ledger's events: one round at that z per site for NE, spending the budget (dp-accounting, called here)
    for site in fed.sites:
        event = out["events"][site.site_id][Cat.NE]
        assert event.steps == 1 and event.noise_multiplier == pytest.approx(z, rel=1e-3)
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(event.sampling_rate, dp_accounting.GaussianDpEvent(
            event.noise_multiplier)))
        assert 0.99 * eps <= acc.get_epsilon(1e-5) <= eps * (1 + 1e-9)
