"""Random sources: the secure AES-CTR source has the right moments; the seeded one warns."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.privacy.randomness import InsecureRandomnessWarning, SecureRandom, make_random_source


def test_secure_uniforms_and_normals_have_textbook_moments() -> None:
    source = SecureRandom()
    u = source.random(400_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.001  # U(0,1): mean 1/2, var 1/12
    x = source.standard_normal((300, 1001))
    assert x.shape == (300, 1001)
    assert abs(x.mean()) < 0.01 and abs(x.std() - 1) < 0.005
    assert abs(np.mean(x**4) - 3) < 0.05  # N(0,1) kurtosis 3


def test_secure_sources_differ_and_fixed_key_repeats() -> None:
    assert not np.array_equal(SecureRandom().random(8), SecureRandom().random(8))
    key = bytes(range(32))
    np.testing.assert_array_equal(SecureRandom(key).standard_normal(9), SecureRandom(key).standard_normal(9))


def test_seeded_source_warns_loudly_and_repeats() -> None:
    with pytest.warns(InsecureRandomnessWarning, match="NO differential-privacy guarantee"):
        a = make_random_source(3).standard_normal(5)
    with pytest.warns(InsecureRandomnessWarning):
        b = make_random_source(3).standard_normal(5)
    np.testing.assert_array_equal(a, b)
    assert isinstance(make_random_source(None), SecureRandom)


@pytest.mark.parametrize("n", [1, 7, 16_384, 40_001])  # one value, odd, one block exactly, three blocks
def test_secure_normals_follow_the_standard_normal_cdf(n) -> None:
    from scipy import stats

    x = SecureRandom().standard_normal(n)
    assert x.shape == (n,) and np.isfinite(x).all()
    big = SecureRandom().standard_normal(200_000)
    # Kolmogorov-Smirnov against scipy's N(0, 1) CDF: at 200,000 draws a wrong transform (e.g. a missing factor
    # of sqrt(2), or the radius of the pair used as the value) gives p ~ 0; a correct one fails once in 10^4
    assert stats.kstest(big, "norm").pvalue > 1e-4
    assert np.unique(big).size == big.size  # no value used twice (e.g. one output of a pair copied into two slots)
