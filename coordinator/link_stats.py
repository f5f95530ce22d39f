"""The gateways' links as the coordinator heard them, and which round mode fits them.

From the presence changes the coordinator stored (``presence_events``: ``online`` at each connect, the broker's last
will ``offline``; unsigned and advisory, :mod:`coordinator.inbound.health`) over a window (default the last 7 days),
:func:`link_stats` measures per site the fraction of the window it was online, its offline gaps (the longest and the
90th percentile) and how many it had. A site's state before its first event in the window is the state of its last
event before the window; with none, the site is observed from its first event on (the coordinator knows
nothing of it before). :func:`link_advice` turns them into what an operator should change, by the laboratory's measurement
(docs/results/fedbuff.md):

- **Synchronous rounds** (``ccdp``, ``none``): an update that arrives after ``round_deadline_s`` is charged and
  discarded. When the sites' gaps (90th percentile) are longer than the deadline, their budget is spent for
  nothing: raise ``round_deadline_s`` above the gaps. At a deadline covering the gaps the laboratory discarded no
  charged budget under any link model.
- **Global DP** (``privacy: global``): secure aggregation needs a synchronous cohort: at least the threshold t of
  the selected sites must stay reachable through every stage of a round (docs/secagg.md), and the noise is
  calibrated for the tolerated dropouts. With sites online a fraction p of the time, about p x n are there when a
  round opens; when that is below t, rounds fail and local DP (``ccdp``) with a long deadline fits better.
- **Buffered rounds** (FedBuff, ``buffered:`` in the coordinator config) beat synchronous rounds in the laboratory
  only under satellite passes (short windows, long gaps, spread phases); the advice names them for such links.

The presence a coordinator did not hear (it was stopped) is missing from these numbers; they describe the links as
seen from the coordinator, which is what a round sees too.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select

from coordinator.storage import Store
from coordinator.tables import PresenceEventRow

__all__ = ["LinkStats", "link_stats", "fleet_link_stats", "link_advice", "duration_text", "DEFAULT_WINDOW_S"]

#: The window the statistics cover by default (seconds): a week of a gateway's days and nights.
DEFAULT_WINDOW_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class LinkStats:
    """One site's link over a window.

    Attributes:
        site_id: the site.
        observed_s: seconds of the window with a known state (from the first known state to ``now``).
        online_fraction: the fraction of ``observed_s`` it was online (0..1), None when nothing is known.
        gaps_s: the lengths of its offline periods in the window, seconds (the last one still open counts up to now).
        changes: presence changes heard in the window.
    """

    site_id: str
    observed_s: float
    online_fraction: float | None
    gaps_s: tuple[float, ...]
    changes: int

    @property
    def longest_gap_s(self) -> float:
        """The longest offline period (0 when none)."""
        return max(self.gaps_s, default=0.0)

    @property
    def gap_p90_s(self) -> float:
        """The 90th percentile of the offline periods (nearest rank; 0 when none)."""
        if not self.gaps_s:
            return 0.0
        ordered = sorted(self.gaps_s)
        return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def link_stats(site_id: str, events: Iterable[tuple[_dt.datetime, str]], *, now: _dt.datetime,
               window_s: float = DEFAULT_WINDOW_S) -> LinkStats:
    """Measure one site's link from its presence changes (module docstring).

    Args:
        site_id: the site.
        events: ``(arrival time, state)`` pairs, naive UTC, any order; states ``online``/``offline`` (others are
            ignored). Events before the window give the state at its start.
        now: the end of the window (naive UTC).
        window_s: the window's length, seconds (> 0).

    Raises:
        ValueError: ``window_s`` is not positive.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s!r}")
    start = now - _dt.timedelta(seconds=window_s)
    ordered = sorted((t, s) for t, s in events if s in ("online", "offline") and t <= now)
    before = [s for t, s in ordered if t < start]
    inside = [(t, s) for t, s in ordered if t >= start]
    spans: list[tuple[str, float]] = []  # (state, seconds) of each known period, in order
    state: str | None = before[-1] if before else None  # the state at the window's start (None: unknown)
    since = start
    for t, s in inside:
        if state is not None and s != state:
            spans.append((state, (t - since).total_seconds()))
        if s != state:
            state, since = s, t
    if state is not None:
        spans.append((state, (now - since).total_seconds()))
    observed_s = sum(span for _, span in spans)
    online_s = sum(span for st, span in spans if st == "online")
    gaps = [span for st, span in spans if st == "offline" and span > 0]
    changes = len(inside)
    fraction = online_s / observed_s if observed_s > 0 else None
    return LinkStats(site_id=site_id, observed_s=observed_s, online_fraction=fraction, gaps_s=tuple(gaps),
                     changes=changes)


def fleet_link_stats(store: Store, site_ids: Sequence[str], *, now: _dt.datetime,
                     window_s: float = DEFAULT_WINDOW_S) -> list[LinkStats]:
    """:func:`link_stats` of every site in ``site_ids`` from the ``presence_events`` table (sites in that order)."""
    with store.session() as s:
        rows = s.execute(select(PresenceEventRow.site_id, PresenceEventRow.at, PresenceEventRow.state)
                         .where(PresenceEventRow.site_id.in_(list(site_ids)))).all()
    by_site: dict[str, list[tuple[_dt.datetime, str]]] = {site: [] for site in site_ids}
    for site, at, state in rows:
        by_site[site].append((at, state))
    return [link_stats(site, by_site[site], now=now, window_s=window_s) for site in site_ids]


def duration_text(seconds: float) -> str:
    """A gap or deadline for people: ``1.3 h``, ``12 min`` or ``45 s``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def link_advice(stats: Sequence[LinkStats], *, privacy: str, round_deadline_s: float,
                secagg_threshold: int | None = None, buffered: bool = False) -> list[str]:
    """What to change for these links (module docstring): one line per finding, empty when nothing is known.

    Args:
        stats: the sites' link statistics.
        privacy: the coordinator's privacy mode (``ccdp``, ``none``, ``global``).
        round_deadline_s: the configured deadline of a synchronous round, seconds.
        secagg_threshold: Global DP's threshold t (None: a majority of the sites).
        buffered: the coordinator runs buffered rounds (a late update counts in a later round: no deadline advice,
            and FedBuff is not suggested again).
    """
    known = [s for s in stats if s.online_fraction is not None]
    if not known:
        return []
    lines = []
    slow = sorted((s for s in known if s.gap_p90_s > round_deadline_s), key=lambda s: -s.gap_p90_s)
    if privacy in ("ccdp", "none") and slow and not buffered:
        worst = slow[0]
        lines.append(f"{len(slow)} of {len(known)} site(s) are offline longer than round_deadline_s "
                     f"({duration_text(round_deadline_s)}) at their 90th-percentile gap (longest: {worst.site_id}, "
                     f"{duration_text(worst.gap_p90_s)}): their updates arrive after the deadline and their budget is spent "
                     f"for nothing; raise round_deadline_s above {duration_text(worst.gap_p90_s)} (docs/results/fedbuff.md)")
    if privacy == "global":
        n = len(known)
        t = secagg_threshold if secagg_threshold is not None else n // 2 + 1
        expected = sum(s.online_fraction or 0.0 for s in known)
        if expected < t:
            lines.append(f"Global DP needs {t} of {n} sites reachable through a whole round, but about "
                         f"{expected:.1f} are online at a time (mean online fraction {expected / n:.0%}): rounds "
                         "will fail; local DP (privacy: ccdp) with a deadline covering the gaps fits these links "
                         "(docs/transport.md, \"Stragglers\")")
    satellite_like = [s for s in known if (s.online_fraction or 0) < 0.25 and s.changes >= 8]
    if satellite_like and len(satellite_like) * 2 >= len(known) and buffered:
        lines.append(f"{len(satellite_like)} site(s) are online in short windows: buffered rounds, which this "
                     "coordinator runs, are the mode the laboratory measured best for such links "
                     "(docs/results/fedbuff.md)")
    elif satellite_like and len(satellite_like) * 2 >= len(known):
        lines.append(f"{len(satellite_like)} site(s) are online in short windows (under 25 % of the time, 8 or more "
                     "changes): the links under which buffered rounds (FedBuff) beat synchronous rounds in the "
                     "laboratory (docs/results/fedbuff.md); set buffered: {buffer_size: 2} in the coordinator config "
                     "(docs/transport.md, \"Buffered rounds\")")
    return lines
