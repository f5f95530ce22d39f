"""The gateways' links (coordinator/link_stats.py): online fraction and offline gaps from presence changes, worked
out by hand for each timeline, what the advice says for them, and the presence changes the coordinator stores
(a retained presence heard again is no change) shown by `status`."""

from __future__ import annotations

import datetime as _dt

import pytest
from typer.testing import CliRunner

from shared.topics import status_payload, status_topic

from coordinator.cli import app
from coordinator.link_stats import LinkStats, duration_text, fleet_link_stats, link_advice, link_stats
from coordinator.tables import PresenceEventRow
from tests.coordinator.test_fleet import FED, fed  # noqa: F401 - the fixture

NOW = _dt.datetime(2026, 12, 4, 12, 0, 0)
H = 3600.0


def _at(hours_before_now: float) -> _dt.datetime:
    return NOW - _dt.timedelta(hours=hours_before_now)


def test_satellite_passes_give_one_ninth_online_and_80_minute_gaps() -> None:
    # 10 minutes online every 90 minutes for the 9 h window, offline before it: 6 passes
    events = [(_at(10), "offline")]
    for k in range(6):
        start = 9 - 1.5 * k  # hours before now
        events += [(_at(start), "online"), (_at(start - 1 / 6), "offline")]
    st = link_stats("sat", events, now=NOW, window_s=9 * H)
    assert st.online_fraction == pytest.approx(1 / 9)
    # five whole gaps of 80 minutes between passes, and the last one (80 min) still open at now
    assert st.gaps_s == pytest.approx((80 * 60.0,) * 6)
    assert st.changes == 12 and st.observed_s == pytest.approx(9 * H)


def test_an_unknown_start_counts_only_what_the_first_event_tells() -> None:
    # first heard "offline" 6 h ago (before: unknown), online 2 h ago: 4 h gap, 2 h online, observed 6 h
    st = link_stats("a", [(_at(6), "offline"), (_at(2), "online")], now=NOW, window_s=24 * H)
    assert (st.observed_s, st.online_fraction, st.gaps_s) == (6 * H, pytest.approx(1 / 3), (4 * H,))
    # first heard "online" 3 h ago: observed from then on, online throughout
    st = link_stats("b", [(_at(3), "online")], now=NOW, window_s=24 * H)
    assert (st.observed_s, st.online_fraction, st.gaps_s) == (3 * H, 1.0, ())
    assert link_stats("c", [], now=NOW).online_fraction is None


def test_repeated_states_are_one_period_and_events_after_now_are_ignored() -> None:
    events = [(_at(30), "online"), (_at(5), "online"), (_at(4), "offline"), (_at(3.5), "offline"),
              (_at(1), "online"), (NOW + _dt.timedelta(hours=1), "offline")]
    st = link_stats("d", events, now=NOW, window_s=24 * H)
    assert st.gaps_s == (3 * H,) and st.online_fraction == pytest.approx(21 / 24)


def test_the_90th_percentile_gap_is_the_nearest_rank() -> None:
    st = LinkStats("e", 1.0, 0.5, tuple(float(g) for g in range(1, 11)), 20)
    assert (st.gap_p90_s, st.longest_gap_s) == (9.0, 10.0)
    assert LinkStats("f", 1.0, 1.0, (), 0).gap_p90_s == 0.0


def test_the_advice_names_the_deadline_global_dp_and_the_satellite_case() -> None:
    sat = [LinkStats(f"s{k}", 9 * H, 1 / 9, (80 * 60.0,) * 6, 12) for k in range(4)]
    lines = link_advice(sat, privacy="ccdp", round_deadline_s=600)
    assert "4 of 4 site(s) are offline longer than round_deadline_s (10 min)" in lines[0]
    assert "(longest: s0, 1.3 h)" in lines[0] and "raise round_deadline_s above 1.3 h" in lines[0]
    assert "FedBuff" in lines[1] and len(lines) == 2
    assert link_advice(sat, privacy="ccdp", round_deadline_s=2 * H)[0].startswith("4 site(s) are online in short")
    buffered = link_advice(sat, privacy="ccdp", round_deadline_s=600, buffered=True)  # no deadline advice then
    assert len(buffered) == 1 and "buffered rounds, which this coordinator runs" in buffered[0]
    assert [duration_text(s) for s in (45, 600, 4680)] == ["45 s", "10 min", "1.3 h"]
    glob = link_advice(sat, privacy="global", round_deadline_s=2 * H, secagg_threshold=3)
    assert glob[0].startswith("Global DP needs 3 of 4 sites") and "about 0.4 are online" in glob[0]
    steady = [LinkStats(f"t{k}", 24 * H, 0.99, (60.0,), 2) for k in range(4)]
    assert link_advice(steady, privacy="global", round_deadline_s=60) == []
    assert link_advice([LinkStats("u", 0.0, None, (), 0)], privacy="ccdp", round_deadline_s=1) == []


def test_the_coordinator_stores_changes_only_and_status_shows_the_links(fed) -> None:  # noqa: F811
    coord, bus, clock, cfg_path, _ = fed
    start = clock.now
    for minutes, state in ((0, "online"), (1, "online"), (30, "offline"), (90, "online")):
        clock.now = start + _dt.timedelta(minutes=minutes)
        bus.publish(status_topic(FED, "ridge"), status_payload("ridge", state), retain=True)
    with coord.store.session() as s:
        rows = [(r.state, r.at) for r in s.query(PresenceEventRow).order_by(PresenceEventRow.id)]
    assert rows == [("online", start), ("offline", start + _dt.timedelta(minutes=30)),
                    ("online", start + _dt.timedelta(minutes=90))]  # the repeated "online" is no change
    now = start + _dt.timedelta(minutes=120)
    (ridge, river) = fleet_link_stats(coord.store, ["ridge", "river"], now=now)
    assert ridge.gaps_s == (3600.0,) and ridge.online_fraction == pytest.approx(60 / 120)
    assert river.online_fraction is None
    out = CliRunner().invoke(app, ["status", "--config", str(cfg_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "links over the last 7 days" in out.output and "ridge" in out.output


def test_status_says_so_when_the_links_need_no_change(fed) -> None:  # noqa: F811
    """Sites always online: no advice, and status says the round mode fits (rather than saying nothing)."""
    coord, bus, clock, cfg_path, _ = fed
    for site in ("ridge", "river"):
        bus.publish(status_topic(FED, site), status_payload(site, "online"), retain=True)
    clock.now = clock.now + _dt.timedelta(minutes=120)
    out = CliRunner().invoke(app, ["status", "--config", str(cfg_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "nothing to change" in " ".join(out.output.split()), out.output
