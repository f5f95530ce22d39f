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


def test_logit_adjusted_evaluation_is_the_trained_model_with_the_metadata_prior_taken_off_the_logits():
    # Three classes of the demo's table at two sites; site-00 lists classes 0 and 1 (6 records), site-01 lists
    # classes 1 and 2 (3 records). Hand-worked prior: n = (3, 3 + 1.5, 1.5), offsets = tau (log pi - mean log pi).
    import dataclasses
    import math

    from wildfed_sim.animal_mnist import SPECIES_TABLE

    rng = np.random.default_rng(2)
    fed = _federation(rng)
    cats = tuple(SPECIES_TABLE[k].iucn for k in range(3))
    sites = (dataclasses.replace(fed.sites[0], species=(0, 1)), dataclasses.replace(fed.sites[1], species=(1, 2)))
    assert not any(c.is_sensitive for c in cats)  # all three are on the public lists
    fed = dataclasses.replace(fed, sites=sites, class_categories=cats)
    config = SimConfig(privacy="none", rounds=1, local_steps=2, expected_batch_size=100, learning_rate=0.002)
    plain = simulate(fed, config, seed=0)
    tau = 1.0
    served = simulate(fed, dataclasses.replace(config, prediction_tau=tau), seed=0)
    np.testing.assert_equal(served["final_unadjusted"], plain["final"])  # NaN for groups without test records
    sizes = (len(sites[0]), len(sites[1]))
    n = np.array([sizes[0] / 2, sizes[0] / 2 + sizes[1] / 2, sizes[1] / 2], np.float64)
    log_pi = np.log(n / n.sum())
    offsets = tau * (log_pi - log_pi.mean())
    w = served["weights"]
    logits = fed.test_features.astype(np.float64) @ w["psi.weight"].astype(np.float64).T + w["psi.bias"]
    expected = float(np.mean(np.argmax(logits - offsets, axis=1) == fed.test_labels))
    assert served["final"]["overall"] == pytest.approx(expected)
    assert (np.argmax(logits - offsets, axis=1) != np.argmax(logits, axis=1)).any()  # the offsets matter here
    assert math.isclose(offsets.sum(), 0.0, abs_tol=1e-12)
