"""The demo's secure-aggregation threshold: ``sites - tolerated_dropouts``, which must stay a majority (Bonawitz et
al. 2017: two disjoint groups of survivors must not both be able to unmask)."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError
from wildfed_sim.demo import DemoSettings, secagg_threshold


@pytest.mark.parametrize(("sites", "threshold"), [(8, 7), (5, 4), (3, 2), (2, 2)])
def test_default_tolerates_one_dropout_where_a_majority_remains(sites, threshold):
    # hand-worked: t = n - 1 while 2(n - 1) > n, i.e. n >= 3; with 2 sites both must survive
    assert secagg_threshold(DemoSettings(sites=sites)) == threshold


@pytest.mark.parametrize(("sites", "dropouts", "threshold"), [(8, 0, 8), (8, 3, 5), (9, 4, 5)])
def test_explicit_dropouts_set_the_threshold(sites, dropouts, threshold):
    assert secagg_threshold(DemoSettings(sites=sites, tolerated_dropouts=dropouts)) == threshold


@pytest.mark.parametrize(("sites", "dropouts"), [(8, 4), (9, 5), (3, 2), (8, -1)])
def test_a_threshold_that_is_no_majority_is_refused(sites, dropouts):
    # 8 - 4 = 4 and 9 - 5 = 4 are not majorities (2t > n fails); a negative count is meaningless
    with pytest.raises(ConfigError) as err:
        DemoSettings(sites=sites, tolerated_dropouts=dropouts)
    assert err.value.field == "tolerated_dropouts"


def test_the_header_names_the_threshold():
    from wildfed_sim.demo_settings import privacy_label

    assert "threshold 7 of 8 sites" in privacy_label(DemoSettings())
    assert "threshold" not in privacy_label(DemoSettings(global_noise="trusted-server"))
