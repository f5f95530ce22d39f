"""A link model played over the real broker: each gateway process of a run is online only inside its schedule's
windows (:mod:`wildfed_sim.link_models`), in compressed time.

Time: one simulated minute is ``minute_s`` real seconds, counted from :meth:`LinkDriver.start` (the demo starts it
just before its first round opens, once every gateway has connected, so minute 0 is round 1's start). A thread
wakes at each schedule boundary (the start or end of some gateway's window) and sets that gateway's gate.

What "offline" means (the gates):

- :class:`RelayGate`, for every link model: the gateway's connections to the broker go through its own
  :class:`~wildfed_sim.link_relay.LinkRelay`; offline cuts them and holds new ones unanswered until the next window
  (that module says exactly what is cut and held). The gateway process keeps running: it trains a task it already
  has, its update waits in its outbox, and its MQTT client reconnects when the link is back (then it re-sends its
  outbox and asks for the open round's task, as after any reconnect). This is a link outage, what the
  satellite and cellular models describe (``powered_offline`` true).
- :class:`ProcessGate`, added for models whose gateways are powered off offline (``powered_offline`` false: solar
  nights): SIGSTOP of the gateway process, SIGCONT at dawn. A stopped gateway computes nothing and answers nothing;
  its own timers (resend intervals, keep-alive) then see the night pass at once when it is continued.

What it does not simulate: the gateways' computing and transfers are not compressed (a step that takes 2 s real
takes 2 / ``minute_s`` simulated minutes, so short windows get shorter still for slow gateways); latency,
bandwidth and loss on an online link; the broker and coordinator, which are always up. The coordinator's
``round_deadline_s`` is real seconds: the caller converts it (the demo: ``wildfed_sim.demo_links``).

The driver always brings every gate back online (SIGCONT included) before its thread ends, on :meth:`stop`, on
an error inside the thread, and when the schedules' horizon is reached. Per gateway it records the fraction of
real time it really applied online (:class:`AppliedLink`), next to the fraction its schedule asked for.
"""

from __future__ import annotations

import bisect
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from wildfed_sim.link_models import Schedule
from wildfed_sim.link_relay import LinkRelay

__all__ = ["Gate", "RelayGate", "ProcessGate", "GateGroup", "AppliedLink", "LinkDriver", "next_change"]

log = logging.getLogger(__name__)


class Gate(Protocol):
    """Something that puts one gateway online or offline."""

    def set_online(self, online: bool) -> None:
        """Online (True) or offline (False); called only when the state changes, and with True at the end."""


@dataclass
class RelayGate:
    """Offline = the gateway's relay cuts and holds its connections (:class:`~wildfed_sim.link_relay.LinkRelay`)."""

    relay: LinkRelay

    def set_online(self, online: bool) -> None:
        """Bring the relay up or down."""
        self.relay.set_online(online)


@dataclass
class ProcessGate:
    """Offline = the process is stopped (SIGSTOP), online = continued (SIGCONT). A process that has exited is left
    alone.

    Args:
        process: a :class:`subprocess.Popen` (or anything with ``poll()`` and ``send_signal(sig)``).
    """

    process: Any

    def set_online(self, online: bool) -> None:
        """SIGCONT (online) or SIGSTOP (offline) the process, unless it has exited."""
        if self.process.poll() is not None:
            return
        try:
            self.process.send_signal(signal.SIGCONT if online else signal.SIGSTOP)
        except ProcessLookupError:  # exited between the poll and the signal
            pass


@dataclass
class GateGroup:
    """Several gates of one gateway, set together (online: in reverse order, so a process is continued before its
    link comes back)."""

    gates: Sequence[Gate]

    def set_online(self, online: bool) -> None:
        """Set every gate; going online, the last first."""
        for gate in (reversed(self.gates) if online else self.gates):
            gate.set_online(online)


@dataclass
class AppliedLink:
    """What the driver applied to one gateway.

    Attributes:
        gateway: its index. online_s, elapsed_s: real seconds it was online, and in all, from start to stop.
        scheduled_fraction: the fraction of the same simulated span its schedule has online.
        toggles: ``(simulated minute, online)`` of every change applied, in order.
    """

    gateway: int
    online_s: float = 0.0
    elapsed_s: float = 0.0
    scheduled_fraction: float = math.nan
    toggles: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def applied_fraction(self) -> float:
        """``online_s / elapsed_s`` (nan before any time passed)."""
        return self.online_s / self.elapsed_s if self.elapsed_s > 0 else math.nan


def next_change(schedule: Schedule, t: float) -> float:
    """The first minute after ``t`` at which ``schedule`` changes state (a window starts or ends), or ``inf``."""
    starts = [s for s, _ in schedule.intervals]
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and t < schedule.intervals[i][1]:
        return schedule.intervals[i][1]
    return starts[i + 1] if i + 1 < len(starts) else math.inf


class LinkDriver:
    """Sets each gateway's gate from its schedule in compressed time (module docstring).

    Args:
        gates: one gate per gateway. schedules: one :class:`Schedule` per gateway, in minutes from the start.
        minute_s: real seconds per simulated minute (> 0).
        horizon_min: where the schedules end: at this minute every gate goes online and the thread ends.
        clock: monotonic seconds (tests inject one). wait: ``wait(seconds) -> bool``, True when the driver should
            stop (default: the stop event's wait; tests inject one that advances their clock).

    Attributes:
        applied: one :class:`AppliedLink` per gateway. error: the exception that ended the thread, or None.

    Raises:
        ValueError: gates and schedules differ in number, or ``minute_s`` / ``horizon_min`` is not positive.
    """

    def __init__(self, gates: Sequence[Gate], schedules: Sequence[Schedule], *, minute_s: float,
                 horizon_min: float, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], bool] | None = None) -> None:
        if len(gates) != len(schedules):
            raise ValueError(f"{len(gates)} gates for {len(schedules)} schedules: give one of each per gateway")
        if not (minute_s > 0 and math.isfinite(minute_s)) or not horizon_min > 0:
            raise ValueError(f"minute_s ({minute_s}) and horizon_min ({horizon_min}) must be positive")
        self.gates, self.schedules = list(gates), list(schedules)
        self.minute_s, self.horizon_min = float(minute_s), float(horizon_min)
        self._clock = clock
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._online = [True] * len(gates)  # every gate starts online (the gateways connected through it)
        self._since = [0.0] * len(gates)
        self._t0: float | None = None
        self._thread: threading.Thread | None = None
        self.applied = [AppliedLink(g) for g in range(len(gates))]
        self.error: BaseException | None = None

    def minute(self) -> float:
        """The simulated minute now (0 before :meth:`start`)."""
        return 0.0 if self._t0 is None else (self._clock() - self._t0) / self.minute_s

    def start(self) -> None:
        """Start the clock (minute 0 is now) and the thread that follows the schedules."""
        if self._thread is not None:
            raise RuntimeError("the link driver was started already")
        self._t0 = self._clock()
        self._since = [self._t0] * len(self.gates)
        self._thread = threading.Thread(target=self.run, name="wildfed-link-driver", daemon=True)
        self._thread.start()

    def stop(self) -> list[AppliedLink]:
        """Stop the thread and bring every gateway online (SIGCONT included); idempotent. Returns :attr:`applied`."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._all_online()
        return self.applied

    def run(self) -> None:
        """Follow the schedules until stopped or past the horizon, then bring every gate online (the thread's body;
        tests call it directly with an injected clock and wait). An exception is kept in :attr:`error`."""
        if self._t0 is None:
            self._t0 = self._clock()
            self._since = [self._t0] * len(self.gates)
        target = 0.0  # the boundary the last wait was for: a wake-up a hair early (clock granularity) counts as it
        try:
            while not self._stop.is_set():
                t = max(self.minute(), target)
                if t >= self.horizon_min:
                    log.warning("link driver: the schedules end at minute %.0f; every gateway stays online",
                                self.horizon_min)
                    break
                for g, schedule in enumerate(self.schedules):
                    self._set(g, schedule.online(t), t)
                target = min([next_change(s, t) for s in self.schedules] + [self.horizon_min])
                if self._wait(max(0.0, (target - self.minute()) * self.minute_s)):
                    break
        except BaseException as exc:  # noqa: BLE001 - kept for the caller; the gates come back online below
            self.error = exc
            log.error("link driver stopped on an error: %r; every gateway goes back online", exc)
        finally:
            self._all_online()

    def _set(self, g: int, online: bool, t: float) -> None:
        if self._online[g] == online:
            return
        self.gates[g].set_online(online)
        now = self._clock()
        if self._online[g]:
            self.applied[g].online_s += now - self._since[g]
        self._online[g], self._since[g] = online, now
        self.applied[g].toggles.append((t, online))

    def _all_online(self) -> None:
        """Every gate online (each tried even if another fails); the records closed at this moment."""
        first_error: BaseException | None = None
        now = self._clock()
        for g, gate in enumerate(self.gates):
            rec = self.applied[g]
            if self._t0 is not None and rec.elapsed_s == 0.0:
                rec.elapsed_s = now - self._t0
                span = rec.elapsed_s / self.minute_s
                rec.scheduled_fraction = (self.schedules[g].online_minutes(span) / span if span > 0 else math.nan)
                if self._online[g]:
                    rec.online_s += now - self._since[g]
            if self._online[g]:
                continue
            try:
                gate.set_online(True)
                self._online[g] = True
                rec.toggles.append((self.minute(), True))
            except BaseException as exc:  # noqa: BLE001 - the other gateways still come back online
                first_error = first_error or exc
                log.error("link driver: gateway %d could not be brought back online: %r", g, exc)
        if first_error is not None and self.error is None:
            self.error = first_error

    def __enter__(self) -> "LinkDriver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
