"""Reading the species head: site prior (Bayes' rule with a prior weight), threshold, unexpected species.

Expected values are worked by hand from the formula in edge_sdk/field/predictions.py:
posterior_k = p_k w_k / sum_j p_j w_j, w_k = 1 for listed classes, outside_prior otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.field.predictions import read_prediction, site_posterior


def test_posterior_by_hand() -> None:
    # p = (0.5, 0.3, 0.2), site lists classes 1 and 2, outside prior 0.1:
    # (0.05, 0.3, 0.2) / 0.55 = (0.0909..., 0.5454..., 0.3636...)
    post = site_posterior(np.array([0.5, 0.3, 0.2]), {1, 2}, outside_prior=0.1)
    np.testing.assert_allclose(post, [0.05 / 0.55, 0.3 / 0.55, 0.2 / 0.55], rtol=1e-12)
    pred = read_prediction(np.array([0.5, 0.3, 0.2]), {1, 2}, threshold=0.5, outside_prior=0.1)
    assert (pred.index, pred.status) == (1, "confident") and pred.confidence == pytest.approx(0.3 / 0.55)


def test_an_unlisted_species_needs_more_evidence_and_is_flagged_not_suppressed() -> None:
    # 0.9 for an unlisted class: 0.09 / (0.09 + 0.1) = 0.4737 < 0.5 -> unknown, best guess kept
    weak = read_prediction(np.array([0.9, 0.05, 0.05]), {1, 2}, threshold=0.5, outside_prior=0.1)
    assert (weak.index, weak.status, weak.named) == (0, "unknown", False)
    assert weak.confidence == pytest.approx(0.09 / 0.19)
    # 0.97: 0.097 / (0.097 + 0.03) = 0.7638 -> named, but unexpected at this site
    strong = read_prediction(np.array([0.97, 0.02, 0.01]), {1, 2}, threshold=0.5, outside_prior=0.1)
    assert (strong.index, strong.status, strong.named) == (0, "unexpected", True)
    assert strong.confidence == pytest.approx(0.097 / 0.127)


def test_below_the_threshold_is_unknown_not_the_arg_max() -> None:
    flat = np.full(10, 0.1)
    pred = read_prediction(flat, set(), threshold=0.5)
    assert pred.status == "unknown" and pred.index == 0 and pred.confidence == pytest.approx(0.1)
    assert read_prediction(flat, set(), threshold=0.05).status == "confident"  # no table: nothing is unexpected


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="outside_prior"):
        site_posterior(np.array([0.5, 0.5]), {0}, outside_prior=0.0)
    with pytest.raises(ValueError, match="outside the model"):
        site_posterior(np.array([0.5, 0.5]), {2})
    with pytest.raises(ValueError, match="threshold"):
        read_prediction(np.array([0.5, 0.5]), {0}, threshold=1.5)
    with pytest.raises(ValueError, match="finite"):
        site_posterior(np.array([np.nan, 1.0]), {0})
