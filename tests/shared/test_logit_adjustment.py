"""Post-hoc logit adjustment from public registry metadata (shared.models.logit_adjustment): the prior against a
hand-worked three-site case, the offsets against Menon et al. 2021's rule computed here with numpy, and the
refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.models.logit_adjustment import adjusted_for_prediction, prediction_offsets, registry_log_prior

TABLE = {"Panthera leo": 0, "Loxodonta africana": 1, "Giraffa camelopardalis": 2, "Diceros bicornis": 3}


def test_prior_spreads_each_sites_records_over_its_listed_species_and_gives_the_unlisted_the_rarest_estimate():
    metadata = {
        "a": {"capacity": 100, "species": ["Panthera leo", "Loxodonta africana"]},
        # a name outside the table does not count in the site's list: 60 records over 2 species
        "b": {"capacity": 60, "species": ["Loxodonta africana", "Giraffa camelopardalis", "Homo sapiens"]},
        "c": {"capacity": 10, "species": []},  # lists nothing: skipped
        "d": {"species": ["Panthera leo"]},  # no record count: skipped
    }
    n = [50.0, 50.0 + 30.0, 30.0]
    n.append(30.0)  # Diceros bicornis (CR) is on no public list: as rare as the rarest listed species
    expected = [math.log(v / sum(n)) for v in n]
    np.testing.assert_allclose(registry_log_prior(metadata, TABLE, 4), expected, rtol=0, atol=1e-12)


def test_no_listed_species_and_bad_tables_are_refused():
    with pytest.raises(ValueError, match="no enrolled site lists a species"):
        registry_log_prior({"a": {"capacity": 5, "species": ["Homo sapiens"]}}, TABLE, 4)
    with pytest.raises(ValueError, match="num_classes"):
        registry_log_prior({}, TABLE, 1)
    with pytest.raises(ValueError, match="not in \\[0, 3\\)"):
        registry_log_prior({}, TABLE, 3)  # Diceros bicornis has index 3


def test_adjusted_head_predicts_argmax_of_logits_minus_tau_log_prior():
    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=4).astype(np.float32)
    x = rng.normal(size=(200, 6))
    log_prior = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    tau = 1.5
    weights = {"psi.weight": w, "psi.bias": b}
    served = adjusted_for_prediction(weights, prediction_offsets(log_prior, tau))
    assert served["psi.weight"] is w and served["psi.bias"].dtype == np.float32
    logits = x @ w.astype(np.float64).T + b
    rule = np.argmax(logits - tau * log_prior, axis=1)  # Menon et al. 2021, post-hoc: centring moves no argmax
    got = np.argmax(x @ served["psi.weight"].astype(np.float64).T + served["psi.bias"], axis=1)
    np.testing.assert_array_equal(got, rule)
    assert (rule != np.argmax(logits, axis=1)).any()  # the case is not trivial: some predictions change
    np.testing.assert_allclose(prediction_offsets(log_prior, tau).sum(), 0.0, atol=1e-12)
    np.testing.assert_array_equal(prediction_offsets(log_prior, 0.0), np.zeros(4))


@pytest.mark.parametrize("tau", [-0.5, math.inf, math.nan, True])
def test_bad_tau_is_refused(tau):
    with pytest.raises(ValueError, match="tau"):
        prediction_offsets(np.log([0.5, 0.5]), tau)


def test_offsets_that_do_not_fit_the_head_are_refused():
    weights = {"psi.weight": np.zeros((3, 2), np.float32), "psi.bias": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        adjusted_for_prediction(weights, [0.1, -0.1])
    with pytest.raises(ValueError, match="shape"):
        adjusted_for_prediction(weights, [0.1, math.nan, 0.0])
    with pytest.raises(ValueError, match="psi.bias"):
        adjusted_for_prediction({"phi.0.weight": np.zeros((2, 2))}, [0.0, 0.0])
