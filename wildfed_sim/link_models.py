"""Link models for the laboratory: when each gateway is online, over simulated wall-clock time (minutes).

A model draws, for gateway g of a run seeded s, a sorted list of disjoint online intervals ``[start, end)`` in
``[0, horizon)``; :class:`Schedule` answers "is it online at t" and "when is it next online". Every draw comes from
``numpy.random.default_rng((seed, g))``, so a gateway's link is the same whichever mode or configuration runs on
it (paired comparisons see the same outages). The long-run fraction of time online (the duty cycle) of each model
has a closed form, given in its docstring and checked by ``tests/sim/test_link_models.py``. ``powered_offline``
says whether the gateway keeps computing while it is offline (a link outage) or not (a power loss).

* :class:`AlwaysOn`: duty 1.
* :class:`SatellitePasses`: a low-Earth-orbit store-and-forward link (e.g. Swarm/Iridium-class data services):
  usable windows of ``window`` minutes every ``period`` minutes (defaults 10 and 90, close to one LEO orbit), each
  gateway at its own uniformly random phase; duty ``window / period`` (1/9).
* :class:`SolarNight`: a solar gateway whose battery does not last the night: online from dawn to dusk, each
  day's dawn and dusk shifted per gateway by independent uniform jitter in ``[-jitter, +jitter]`` (cloud, battery
  age); the clock starts at ``start_hour``. Duty ``(dusk - dawn) / 24 h`` (0.5 with the defaults 07:00-19:00),
  the jitter having mean zero.
* :class:`Cellular`: a cellular link with random outages, an alternating renewal process with exponential up times
  (mean ``mean_up``) and down times (mean ``mean_down``), started in its stationary state; duty
  ``mean_up / (mean_up + mean_down)`` (0.8 with the defaults 240 and 60 minutes; renewal-reward theorem, e.g.
  Ross, "Introduction to Probability Models", Sec. 7.4).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

__all__ = ["Schedule", "AlwaysOn", "SatellitePasses", "SolarNight", "Cellular", "LINK_MODELS", "link_model"]

MINUTES_PER_DAY = 24 * 60


class Schedule:
    """One gateway's online intervals: sorted, disjoint ``(start, end)`` pairs in minutes, ``start < end``.

    Raises:
        ValueError: the intervals are unsorted, overlapping or empty.
    """

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        merged: list[tuple[float, float]] = []
        for s, e in intervals:
            if not e > s:
                raise ValueError(f"empty interval ({s}, {e})")
            if merged and s < merged[-1][1]:
                raise ValueError(f"interval ({s}, {e}) overlaps or precedes ({merged[-1][0]}, {merged[-1][1]})")
            if merged and s == merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((float(s), float(e)))
        self.intervals = merged
        self._starts = [s for s, _ in merged]

    def online(self, t: float) -> bool:
        """Whether the gateway is online at minute ``t``."""
        i = bisect.bisect_right(self._starts, t) - 1
        return i >= 0 and t < self.intervals[i][1]

    def next_online(self, t: float) -> float:
        """The first minute >= ``t`` at which the gateway is online (``t`` itself when online), or ``inf``."""
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= 0 and t < self.intervals[i][1]:
            return float(t)
        return self._starts[i + 1] if i + 1 < len(self._starts) else math.inf

    def after_online_minutes(self, t: float, minutes: float) -> float:
        """The time at which the gateway, counting from ``t``, has been online for ``minutes`` (work that runs only
        while it is powered: a solar gateway's training pauses at dusk), or ``inf``."""
        left = float(minutes)
        i = max(0, bisect.bisect_right(self._starts, t) - 1)
        for s, e in self.intervals[i:]:
            start = max(s, t)
            if start >= e:
                continue
            if e - start >= left:
                return start + left
            left -= e - start
        return math.inf

    def online_minutes(self, horizon: float) -> float:
        """Minutes online in ``[0, horizon)``."""
        return float(sum(max(0.0, min(e, horizon) - s) for s, e in self.intervals if s < horizon))


def _check_positive(name: str, value: float, *, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok or not math.isfinite(value):
        raise ConfigError(f"link model {name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}",
                          field=name, fix="see wildfed_sim/link_models.py for the defaults")


@dataclass(frozen=True)
class AlwaysOn:
    """Online all the time (the reference). Duty 1."""

    name = "always-on"
    powered_offline = True  # offline never happens

    def duty_cycle(self) -> float:
        """The long-run fraction of time online: 1."""
        return 1.0

    def schedule(self, seed: int, gateway: int, horizon: float) -> Schedule:
        """One interval ``[0, horizon)``."""
        return Schedule([(0.0, float(horizon))])


@dataclass(frozen=True)
class SatellitePasses:
    """Windows of ``window`` minutes every ``period`` minutes at a random phase per gateway (module docstring).

    Raises:
        ConfigError: window or period not positive, or window > period.
    """

    window: float = 10.0
    period: float = 90.0
    name = "satellite"
    powered_offline = True  # the link is down between passes, the gateway keeps running

    def __post_init__(self) -> None:
        _check_positive("window", self.window)
        _check_positive("period", self.period)
        if self.window > self.period:
            raise ConfigError(f"window {self.window} exceeds period {self.period}", field="window",
                              fix="use a window shorter than the period")

    def duty_cycle(self) -> float:
        """``window / period``."""
        return self.window / self.period

    def schedule(self, seed: int, gateway: int, horizon: float) -> Schedule:
        """Windows ``[phi + k period, phi + k period + window)`` with phi ~ U[0, period) (the one before 0 clipped)."""
        phase = float(np.random.default_rng((seed, gateway)).uniform(0.0, self.period))
        starts = np.arange(phase - self.period, horizon, self.period)
        return Schedule([(max(0.0, s), min(horizon, s + self.window)) for s in starts
                         if min(horizon, s + self.window) > max(0.0, s)])


@dataclass(frozen=True)
class SolarNight:
    """Online from dawn to dusk each day, with per-gateway, per-day jitter (module docstring).

    Raises:
        ConfigError: hours outside [0, 24], dawn not before dusk, or jitter negative or too large to keep the order.
    """

    dawn_hour: float = 7.0
    dusk_hour: float = 19.0
    jitter_min: float = 30.0
    start_hour: float = 7.0
    name = "solar-night"
    powered_offline = False  # offline = powered off: training pauses until dawn

    def __post_init__(self) -> None:
        _check_positive("jitter_min", self.jitter_min, zero=True)
        if not 0 <= self.dawn_hour < self.dusk_hour <= 24 or not 0 <= self.start_hour < 24:
            raise ConfigError(f"need 0 <= dawn ({self.dawn_hour}) < dusk ({self.dusk_hour}) <= 24 and start_hour "
                              f"({self.start_hour}) in [0, 24)", field="dawn_hour", fix="e.g. dawn 7, dusk 19")
        if 2 * self.jitter_min >= 60 * min(self.dusk_hour - self.dawn_hour, 24 - self.dusk_hour + self.dawn_hour):
            raise ConfigError("jitter_min is too large: days and nights could overlap", field="jitter_min",
                              fix="use less than half the shorter of day and night")

    def duty_cycle(self) -> float:
        """``(dusk - dawn) / 24``."""
        return (self.dusk_hour - self.dawn_hour) / 24.0

    def schedule(self, seed: int, gateway: int, horizon: float) -> Schedule:
        """Day d's interval ``[d*1440 + dawn + u1, d*1440 + dusk + u2) - start`` with u ~ U[-jitter, jitter]."""
        rng = np.random.default_rng((seed, gateway))
        days = int(math.ceil((horizon + 60 * self.start_hour) / MINUTES_PER_DAY)) + 1
        out = []
        for d in range(days):
            u1, u2 = rng.uniform(-self.jitter_min, self.jitter_min, size=2)
            s = d * MINUTES_PER_DAY + 60 * self.dawn_hour + u1 - 60 * self.start_hour
            e = d * MINUTES_PER_DAY + 60 * self.dusk_hour + u2 - 60 * self.start_hour
            s, e = max(0.0, s), min(float(horizon), e)
            if e > s:
                out.append((s, e))
        return Schedule(out)


@dataclass(frozen=True)
class Cellular:
    """Exponential up and down times with the stated means, in minutes (module docstring).

    Raises:
        ConfigError: a mean not positive.
    """

    mean_up: float = 240.0
    mean_down: float = 60.0
    name = "cellular"
    powered_offline = True  # an outage of the link, not of the gateway

    def __post_init__(self) -> None:
        _check_positive("mean_up", self.mean_up)
        _check_positive("mean_down", self.mean_down)

    def duty_cycle(self) -> float:
        """``mean_up / (mean_up + mean_down)``."""
        return self.mean_up / (self.mean_up + self.mean_down)

    def schedule(self, seed: int, gateway: int, horizon: float) -> Schedule:
        """Alternating up/down periods from a stationary start (up with probability the duty cycle; by
        memorylessness the first period is then a full exponential draw)."""
        rng = np.random.default_rng((seed, gateway))
        up = bool(rng.random() < self.duty_cycle())
        t, out = 0.0, []
        while t < horizon:
            length = float(rng.exponential(self.mean_up if up else self.mean_down))
            if up:
                out.append((t, min(float(horizon), t + length)))
            t += length
            up = not up
        return Schedule([iv for iv in out if iv[1] > iv[0]])


#: the link models by name, with their defaults
LINK_MODELS = {m.name: m for m in (AlwaysOn(), SatellitePasses(), SolarNight(), Cellular())}


def link_model(name: str) -> AlwaysOn | SatellitePasses | SolarNight | Cellular:
    """The link model called ``name`` with its defaults.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in LINK_MODELS:
        raise ConfigError(f"unknown link model {name!r}", field="links", fix=f"use {', '.join(LINK_MODELS)}")
    return LINK_MODELS[name]
