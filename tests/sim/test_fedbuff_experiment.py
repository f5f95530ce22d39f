"""The measurement's read-outs of one run, on a hand-made result (planned 2 updates per site, 2 sites)."""

from __future__ import annotations

import pytest

from wildfed_sim.fedbuff_experiment import CURVE_HOURS, GRIDS, summarise


def _point(minutes, accuracy, sent, version):
    return {"minutes": minutes, "accuracy": accuracy, "sent": sent, "version": version, "epsilon": {"VU": sum(sent)},
            "by_group": {"overall": accuracy}}


def test_summary_reads_accuracy_at_equal_time_and_equal_budget():
    points = [_point(0.0, 0.1, [0, 0], 0), _point(300.0, 0.1, [1, 0], 0), _point(300.0, 0.4, [1, 1], 1),
              _point(400.0, 0.4, [2, 1], 1), _point(2000.0, 0.7, [2, 2], 2)]
    out = {"points": points, "charged": 4, "discarded": 1, "dropped_unsent": 0, "pending": 0,
           "budget_spent_minutes": 2000.0, "versions": 2}
    s = summarise(out, planned=2)
    assert s["acc_6h"] == 0.4  # the last model at or before 360 min
    assert s["acc_24h"] == 0.4  # 2000 min is after 24 h (1440)
    assert s["acc_half"] == 0.4 and s["eps_half"] == {"VU": 2}  # the last point with every site at <= 1 of 2 sent
    assert s["acc_budget"] == 0.7 and s["hours_to_budget"] == pytest.approx(2000 / 60)
    assert s["discarded_fraction"] == 0.25
    assert len(s["curve"]) == len(CURVE_HOURS) and s["curve"][0] == 0.1 and s["curve"][-1] == 0.7  # 48 h


def test_every_arm_gets_as_many_configurations():
    for grid in GRIDS.values():
        assert len(grid["sync"]) == len(grid["fedbuff"])
