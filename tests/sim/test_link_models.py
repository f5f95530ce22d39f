"""The link models' duty cycles against their closed forms, and the schedule's look-ups."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.errors import ConfigError
from wildfed_sim.link_models import AlwaysOn, Cellular, SatellitePasses, Schedule, SolarNight, link_model

DAY = 24 * 60


def test_schedule_lookups():
    s = Schedule([(10.0, 20.0), (20.0, 25.0), (40.0, 50.0)])  # the first two merge
    assert s.intervals == [(10.0, 25.0), (40.0, 50.0)]
    assert not s.online(5) and s.online(10) and s.online(24.9) and not s.online(25) and s.online(49)
    assert s.next_online(0) == 10 and s.next_online(12) == 12 and s.next_online(30) == 40
    assert s.next_online(50) == math.inf
    assert s.online_minutes(45) == 20.0  # 15 + 5
    assert s.after_online_minutes(12, 10) == 22 and s.after_online_minutes(20, 10) == 45  # 5 then 5 of (40, 50)
    assert s.after_online_minutes(0, 30) == math.inf
    with pytest.raises(ValueError):
        Schedule([(10.0, 20.0), (15.0, 30.0)])


def test_always_on():
    assert AlwaysOn().schedule(0, 0, 100.0).online_minutes(100.0) == 100.0 and AlwaysOn().duty_cycle() == 1.0


def test_satellite_passes_are_exactly_window_over_period_per_whole_period():
    model = SatellitePasses()
    assert model.duty_cycle() == pytest.approx(1 / 9)
    horizon = 40 * 90.0
    phases = set()
    for g in range(20):
        sched = model.schedule(7, g, horizon)
        assert sched.online_minutes(horizon) == pytest.approx(40 * 10.0)  # periodic: exact over whole periods
        phases.add(round(sched.intervals[1][0] % 90, 6))  # the first is clipped at 0 when it straddles it
        assert all(0 < e - s <= 10 + 1e-9 for s, e in sched.intervals)
    assert len(phases) == 20  # a phase per gateway
    assert model.schedule(7, 3, horizon).intervals == model.schedule(7, 3, horizon).intervals  # seeded


def test_solar_night_duty_cycle_and_darkness():
    model = SolarNight()
    assert model.duty_cycle() == 0.5
    horizon = 10 * DAY
    fractions = [model.schedule(1, g, horizon).online_minutes(horizon) / horizon for g in range(200)]
    assert np.mean(fractions) == pytest.approx(0.5, abs=0.003)
    sched = model.schedule(1, 0, horizon)
    # the clock starts at 07:00: 02:00 the next day (19 h later) is night for every gateway, noon (5 h) is day
    assert not sched.online(19 * 60) and sched.online(5 * 60)


def test_cellular_duty_cycle_and_mean_up_time():
    model = Cellular()
    assert model.duty_cycle() == pytest.approx(0.8)
    horizon = 30 * DAY
    scheds = [model.schedule(3, g, horizon) for g in range(100)]
    assert np.mean([s.online_minutes(horizon) / horizon for s in scheds]) == pytest.approx(0.8, abs=0.01)
    ups = [e - s for sch in scheds for s, e in sch.intervals[1:-1]]  # whole up periods only
    assert np.mean(ups) == pytest.approx(240.0, rel=0.05)


def test_bad_settings_and_names():
    with pytest.raises(ConfigError):
        SatellitePasses(window=100.0, period=90.0)
    with pytest.raises(ConfigError):
        Cellular(mean_up=0.0)
    with pytest.raises(ConfigError):
        SolarNight(dawn_hour=20.0)
    with pytest.raises(ConfigError) as info:
        link_model("dial-up")
    assert info.value.field == "links"
