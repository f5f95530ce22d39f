"""FedBuff's staleness weights and buffer against hand-worked numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.errors import ConfigError

from coordinator.buffered import StalenessBuffer, StalenessWeight


def test_staleness_weights_match_their_formulas():
    poly = StalenessWeight()  # FedBuff's 1/sqrt(1+t)
    assert poly(0) == 1.0
    assert poly(3) == pytest.approx(0.5)  # 1/sqrt(4)
    assert poly(8) == pytest.approx(1 / 3)  # 1/sqrt(9)
    assert StalenessWeight("polynomial", a=1.0)(4) == pytest.approx(0.2)  # 1/5
    assert StalenessWeight("constant")(50) == 1.0
    hinge = StalenessWeight("hinge", a=0.5, b=2)
    assert hinge(0) == hinge(2) == 1.0
    assert hinge(4) == pytest.approx(0.5)  # 1/(0.5*2 + 1)
    assert hinge(8) == pytest.approx(0.25)  # 1/(0.5*6 + 1)
    with pytest.raises(ValueError):
        poly(-1)


@pytest.mark.parametrize("kwargs, field", [({"kind": "cosine"}, "staleness.kind"), ({"a": -1.0}, "staleness.a"),
                                           ({"kind": "hinge", "b": math.inf}, "staleness.b")])
def test_bad_staleness_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        StalenessWeight(**kwargs)
    assert info.value.field == field


def _template():
    return {"w": np.zeros(2, np.float32), "b": np.zeros((), np.float32)}


def test_uniform_buffer_releases_fedbuffs_sum_over_k_and_empties():
    # K = 3, FedBuff's weight. Updates from versions 0, 0 and... the buffer is at version 3 (three steps made)
    buf = StalenessBuffer(_template(), size=3, max_staleness=5, version=3)
    first = buf.offer({"w": np.array([4.0, 0.0], np.float32), "b": np.array(2.0, np.float32)}, base_version=3)
    assert (first.accepted, first.staleness, first.scale, first.aggregate) == (True, 0, 1.0, None)
    second = buf.offer({"w": np.array([0.0, 8.0], np.float32), "b": np.array(4.0, np.float32)}, base_version=0)
    assert second.staleness == 3 and second.scale == pytest.approx(0.5) and len(buf) == 2
    third = buf.offer({"w": np.array([2.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=2,
                      weight=1000.0)  # the weight is ignored under "uniform"
    # s = 1, 1/2, 1/sqrt(2): w = (4 + 0 + 2/sqrt2)/3, (0 + 4 + 2/sqrt2)/3; b = (2 + 2 + 0)/3
    r = 2 / math.sqrt(2)
    np.testing.assert_allclose(third.aggregate["w"], [(4 + r) / 3, (4 + r) / 3], rtol=1e-6)
    np.testing.assert_allclose(third.aggregate["b"], 4 / 3, rtol=1e-6)
    assert third.aggregate["w"].dtype == np.float32
    assert len(buf) == 0 and buf.version == 4
    # the next update from version 3 is now one step old
    assert buf.offer({"w": np.ones(2, np.float32), "b": np.array(0.0, np.float32)}, base_version=3).staleness == 1


def test_examples_weighting_with_fresh_updates_is_fedavg():
    buf = StalenessBuffer(_template(), size=2, max_staleness=0, weighting="examples")
    buf.offer({"w": np.array([1.0, 2.0], np.float32), "b": np.array(10.0, np.float32)}, base_version=0, weight=1)
    out = buf.offer({"w": np.array([4.0, 0.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0,
                    weight=3).aggregate
    # FedAvg with N = 1, 3: w = (1 + 12)/4, (2 + 0)/4; b = 10/4
    np.testing.assert_allclose(out["w"], [3.25, 0.5], rtol=1e-6)
    np.testing.assert_allclose(out["b"], 2.5, rtol=1e-6)


def test_examples_weighting_is_not_renormalised_by_the_staleness_weights():
    # both updates 3 versions old (s = 1/2): the step halves; sum s_i n_i / sum n_i would not
    buf = StalenessBuffer(_template(), size=2, max_staleness=3, weighting="examples", version=3)
    buf.offer({"w": np.array([2.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0, weight=1)
    out = buf.offer({"w": np.array([6.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0,
                    weight=1).aggregate
    np.testing.assert_allclose(out["w"], [2.0, 1.0], rtol=1e-6)  # 0.5 * (2+6)/2, 0.5 * (2+2)/2


def test_fixed_weighting_divides_by_k_times_the_reference_weight():
    # K = 2, reference 4 examples: n = 1 and 3 fresh, then a drained partial buffer of one n = 8 update 3 versions old
    buf = StalenessBuffer(_template(), size=2, max_staleness=5, weighting="fixed", reference_weight=4.0)
    buf.offer({"w": np.array([8.0, 0.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0, weight=1)
    out = buf.offer({"w": np.array([0.0, 8.0], np.float32), "b": np.array(4.0, np.float32)}, base_version=0,
                    weight=3).aggregate
    np.testing.assert_allclose(out["w"], [1.0, 3.0])  # 1*8/8, 3*8/8
    np.testing.assert_allclose(out["b"], 1.5)  # 3*4/8
    buf.offer({"w": np.array([2.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=-2, weight=8)
    np.testing.assert_allclose(buf.flush()["w"], [2.0, 2.0])  # s(3) = 1/2: 0.5 * 8 * 2 / (1 * 4)


def test_refusals_are_returned_not_raised_and_leave_the_buffer_unchanged():
    buf = StalenessBuffer(_template(), size=2, max_staleness=2, weighting="examples", version=5)
    delta = {"w": np.ones(2, np.float32), "b": np.array(1.0, np.float32)}
    stale = buf.offer(delta, base_version=2)  # t = 3 > 2
    assert (stale.accepted, stale.reason, stale.staleness, stale.scale) == (False, "too_stale", 3, 0.0)
    assert buf.offer(delta, base_version=6).reason == "future_version"
    assert buf.offer(delta, base_version=5, weight=0).reason == "bad_weight"
    assert buf.offer(delta, base_version=3).accepted  # t = 2: the oldest accepted
    assert len(buf) == 1 and buf.version == 5


def test_flush_drains_a_partial_buffer_by_what_it_holds():
    buf = StalenessBuffer(_template(), size=4, max_staleness=9)
    assert buf.flush() is None and buf.version == 0
    buf.offer({"w": np.array([3.0, 0.0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0)
    buf.offer({"w": np.array([1.0, 2.0], np.float32), "b": np.array(6.0, np.float32)}, base_version=0)
    out = buf.flush()
    np.testing.assert_allclose(out["w"], [2.0, 1.0])
    np.testing.assert_allclose(out["b"], 3.0)
    assert buf.version == 1 and len(buf) == 0


def test_malformed_deltas_and_settings_raise():
    buf = StalenessBuffer(_template(), size=2, max_staleness=1)
    with pytest.raises(ValueError, match="names differ"):
        buf.offer({"w": np.ones(2, np.float32)}, base_version=0)
    with pytest.raises(ValueError, match="shape"):
        buf.offer({"w": np.ones(3, np.float32), "b": np.array(0.0, np.float32)}, base_version=0)
    with pytest.raises(ValueError, match="non-finite"):
        buf.offer({"w": np.array([np.nan, 0], np.float32), "b": np.array(0.0, np.float32)}, base_version=0)
    assert len(buf) == 0
    for kwargs, field in (({"size": 0, "max_staleness": 1}, "buffer.size"),
                          ({"size": 2, "max_staleness": -1}, "buffer.max_staleness"),
                          ({"size": 2, "max_staleness": 1, "weighting": "sqrt"}, "buffer.weighting"),
                          ({"size": 2, "max_staleness": 1, "weighting": "fixed"}, "buffer.reference_weight")):
        with pytest.raises(ConfigError) as info:
            StalenessBuffer(_template(), **kwargs)
        assert info.value.field == field
