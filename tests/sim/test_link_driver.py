"""The link driver and relay (wildfed_sim/link_driver.py, link_relay.py) without a federation: the toggles a driver
applies against known schedules under an injected clock, its clean stop (every gateway back online, also after a
gate fails), SIGSTOP/SIGCONT of a real process, a real loopback relay that cuts and holds connections, and the demo
settings that configure them (wildfed_sim/demo_links.py)."""

from __future__ import annotations

import math
import socket
import socketserver
import subprocess
import threading
import time
from pathlib import Path

import pytest

from shared.errors import ConfigError
from wildfed_sim.demo import DemoSettings
from wildfed_sim.demo_links import COVERING_MINUTES, TRAINING_MINUTES, DemoLinks
from wildfed_sim.link_driver import LinkDriver, ProcessGate, next_change
from wildfed_sim.link_models import SatellitePasses, Schedule
from wildfed_sim.link_relay import LinkRelay

MINUTE_S = 0.5


class FakeClock:
    """Monotonic seconds that move only when the driver waits; ``wait`` returns True (stop) past ``end_s``."""

    def __init__(self, end_s: float) -> None:
        self.t, self.end_s = 100.0, 100.0 + end_s  # an arbitrary origin: the driver counts from its start

    def __call__(self) -> float:
        return self.t

    def wait(self, seconds: float) -> bool:
        self.t += seconds
        return self.t >= self.end_s


class FakeGate:
    """Records ``(simulated minute, online)`` of every call, read from the shared clock."""

    def __init__(self, clock: FakeClock, fail_on: bool | None = None) -> None:
        self.clock, self.calls, self.fail_on = clock, [], fail_on

    def set_online(self, online: bool) -> None:
        if online is self.fail_on:
            raise OSError("gate broke")
        self.calls.append(((self.clock.t - 100.0) / MINUTE_S, online))


def expected_toggles(schedule: Schedule, end_min: float) -> list[tuple[float, bool]]:
    """The changes a gate starting online must see in [0, end_min): off at 0 unless a window covers 0, then on at
    every window's start and off at its end."""
    out = [] if schedule.online(0.0) else [(0.0, False)]
    for s, e in schedule.intervals:
        if 0.0 < s < end_min:
            out.append((s, True))
        if e < end_min:
            out.append((e, False))
    return out


def test_the_driver_toggles_each_gate_at_its_schedules_boundaries():
    end_min = 400.0
    schedules = [SatellitePasses().schedule(3, g, 2000.0) for g in range(3)]
    schedules.append(Schedule([(0.0, 30.0), (100.0, 100.5), (250.0, 2000.0)]))  # online at 0, a short window
    clock = FakeClock(end_min * MINUTE_S)
    gates = [FakeGate(clock) for _ in schedules]
    driver = LinkDriver(gates, schedules, minute_s=MINUTE_S, horizon_min=2000.0, clock=clock, wait=clock.wait)
    driver.run()

    stopped_at = (clock.t - 100.0) / MINUTE_S
    for gate, schedule, applied in zip(gates, schedules, driver.applied):
        want = expected_toggles(schedule, end_min)
        for calls in (gate.calls, applied.toggles):  # what the gate saw, when (its clock), and what was recorded
            got = [(t, up) for t, up in calls if t < end_min]
            assert [up for _, up in got] == [up for _, up in want]
            assert [t for t, _ in got] == pytest.approx([t for t, _ in want], abs=1e-6)
        # every gate ends online: offline at the stop, it is set online then
        if not schedule.online(stopped_at):
            assert gate.calls[-1] == (pytest.approx(stopped_at), True)
        span = applied.elapsed_s / MINUTE_S
        assert applied.scheduled_fraction == pytest.approx(schedule.online_minutes(span) / span)
        assert applied.applied_fraction == pytest.approx(applied.scheduled_fraction, abs=1e-9)
    assert 0.05 < driver.applied[0].applied_fraction < 0.2  # 10 minutes every 90 over ~4.5 periods
    assert driver.error is None


def test_next_change_is_the_next_window_edge():
    s = Schedule([(10.0, 20.0), (40.0, 50.0)])
    assert [next_change(s, t) for t in (0.0, 10.0, 15.0, 20.0, 45.0, 50.0)] == [10.0, 20.0, 20.0, 40.0, 50.0,
                                                                               math.inf]


def test_a_failing_gate_stops_the_driver_and_every_other_gate_comes_back_online():
    clock = FakeClock(1000.0)
    schedules = [Schedule([(5.0, 10.0)]), Schedule([(5.0, 10.0)]), Schedule([(0.0, 10.0)])]
    gates = [FakeGate(clock), FakeGate(clock), FakeGate(clock, fail_on=False)]  # gate 2 fails going offline
    # minute 0: gates 0 and 1 offline; 5: online; 10: gates 0 and 1 offline, then gate 2 raises. The driver ends
    # there with the error kept, and gates 0 and 1 are back online at once.
    driver = LinkDriver(gates, schedules, minute_s=MINUTE_S, horizon_min=100.0, clock=clock, wait=clock.wait)
    driver.run()
    for gate in gates[:2]:
        assert gate.calls == [(0.0, False), (5.0, True), (10.0, False), (10.0, True)]
    assert isinstance(driver.error, OSError) and gates[2].calls == []
    assert driver.applied[0].applied_fraction == pytest.approx(0.5)  # online 5 of the 10 minutes it ran


def test_the_horizon_ends_the_schedules_with_every_gateway_online():
    clock = FakeClock(1000.0)
    gate = FakeGate(clock)
    driver = LinkDriver([gate], [Schedule([(5.0, 8.0)])], minute_s=MINUTE_S, horizon_min=12.0, clock=clock,
                        wait=clock.wait)
    driver.run()
    assert gate.calls == [(0.0, False), (5.0, True), (8.0, False), (12.0, True)] and driver.error is None


def test_stop_brings_a_gateway_back_online_mid_gap():
    clock = FakeClock(10_000.0)
    gate = FakeGate(clock)
    driver = LinkDriver([gate], [Schedule([(50.0, 60.0)])], minute_s=MINUTE_S, horizon_min=1000.0, clock=clock,
                        wait=lambda s: True)  # stop after the first pass: at minute 0, offline
    driver.run()
    assert [up for _, up in gate.calls] == [False, True]
    assert driver.applied[0].online_s == 0.0


def test_the_driver_checks_its_arguments():
    with pytest.raises(ValueError, match="one of each"):
        LinkDriver([], [Schedule([(0.0, 1.0)])], minute_s=1.0, horizon_min=10.0)
    with pytest.raises(ValueError, match="positive"):
        LinkDriver([], [], minute_s=0.0, horizon_min=10.0)


def _state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat (T: stopped, S/R: running)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _poll(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_process_gate_stops_and_continues_a_real_process_and_the_driver_always_continues_it():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        gate = ProcessGate(proc)
        gate.set_online(False)
        assert _poll(lambda: _state(proc.pid) == "T")
        gate.set_online(True)
        assert _poll(lambda: _state(proc.pid) != "T")
        # a driver stopped while the process is offline continues it
        driver = LinkDriver([gate], [Schedule([(1000.0, 1001.0)])], minute_s=10.0, horizon_min=2000.0)
        driver.start()
        assert _poll(lambda: _state(proc.pid) == "T")
        driver.stop()
        assert _poll(lambda: _state(proc.pid) != "T") and driver.applied[0].toggles[-1][1] is True
    finally:
        proc.kill()
        proc.wait()
    ProcessGate(proc).set_online(False)  # an exited process is left alone


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


def test_the_relay_forwards_online_cuts_going_offline_and_holds_new_connections_until_online():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = LinkRelay(f"mqtt://127.0.0.1:{server.server_address[1]}")
    try:
        port = int(relay.url.rsplit(":", 1)[1])
        live = socket.create_connection(("127.0.0.1", port), timeout=5)
        live.sendall(b"hello")
        assert live.recv(5) == b"hello"
        relay.set_online(False)
        assert live.recv(5) == b""  # cut: the gateway sees its connection end
        held = socket.create_connection(("127.0.0.1", port), timeout=5)  # accepted while offline
        held.sendall(b"connect")
        held.settimeout(0.3)
        with pytest.raises(socket.timeout):
            held.recv(7)  # held: nothing reaches the broker, nothing comes back
        held.settimeout(5)
        relay.set_online(True)
        assert held.recv(7) == b"connect"  # what it sent while held was delivered once the link came up
        assert relay.cuts == 1 and relay.held == 1 and relay.online
    finally:
        relay.close()
        server.shutdown()
        server.server_close()


def test_demo_link_settings_defaults_and_checks():
    plain = DemoSettings()
    assert (plain.round_deadline_s, plain.round_duration_s, plain.links, plain.buffered) == (300.0, 0.0,
                                                                                              "always-on", 0)
    sat = DemoSettings(links="satellite", link_minute_s=0.25)
    assert sat.round_deadline_s == pytest.approx(COVERING_MINUTES["satellite"] * 0.25)
    assert sat.round_duration_s == pytest.approx(TRAINING_MINUTES * 0.25)
    assert DemoSettings(links="satellite", round_deadline_s=20.0).round_deadline_s == 20.0
    buffered = DemoSettings(buffered=4)
    assert buffered.privacy == "ccdp"  # buffered rounds need the sites' own updates
    links = DemoLinks(buffered, "mqtt://127.0.0.1:1883", 2)
    # 10 rounds of K = 4 updates from 2 sites would be 20 each, but a site trains a round at most once: 10
    assert links.coordinator_section() == {"buffered": {"buffer_size": 4, "max_staleness": 10,
                                                        "updates_per_site": 10}}
    assert DemoLinks(DemoSettings(buffered=2), "m", 8).coordinator_section()["buffered"]["updates_per_site"] == 2
    assert links.relays == [] and links.site_url(1) == "mqtt://127.0.0.1:1883"  # always-on: no relay
    with DemoLinks(sat, "mqtt://127.0.0.1:1883", 2) as relayed:  # one relay per gateway, each its own port
        urls = {relayed.site_url(0), relayed.site_url(1)}
        assert len(urls) == 2 and "mqtt://127.0.0.1:1883" not in urls and relayed.coordinator_section() == {}
    for kwargs, name in [({"links": "dial-up"}, "links"), ({"link_minute_s": 0.0}, "link_minute_s"),
                         ({"buffered": -1}, "buffered"), ({"buffered": 4, "privacy": "global"}, "buffered"),
                         ({"buffered": 2, "max_staleness": -1}, "max_staleness"),
                         ({"links": "satellite", "round_deadline_s": 4.0}, "round_duration_s")]:
        with pytest.raises(ConfigError) as err:
            DemoSettings(**kwargs)
        assert err.value.field == name


def test_update_accounting_follows_every_charged_update(tmp_path):
    # hand-made database: s1's round-1 update in closed round 1; s2's round-1 update stale, folded by closed round 2;
    # s3's round-2 update stale and waiting; s4's round-1 update charged and refused as late; s5's round-3 update in
    # failed round 3 (charged, stored, not aggregated). s1 is charged on two ledger streams (a cohort's and its own).
    from coordinator.storage import Store
    from coordinator.tables import BufferedUpdateRow, LedgerRow, RejectionRow, RoundRow, SiteRow, UpdateRow
    from tests.coordinator.helpers import make_config
    from wildfed_sim.demo_links import update_accounting

    cfg = make_config(tmp_path)
    store = Store(cfg.database_url, cfg.data_dir)
    with store.session() as s:
        s.add_all([SiteRow(site_id=f"s{i}", public_key_pem="-") for i in range(1, 6)])
        s.add_all([RoundRow(round=1, status="closed", base_model_hash="a"),
                   RoundRow(round=2, status="closed", base_model_hash="b"),
                   RoundRow(round=3, status="failed", base_model_hash="c")])
        for site, r in [("s1", 1), ("s1@c1", 1), ("s2", 1), ("s3", 2), ("s4", 1), ("s5", 3)]:
            s.add(LedgerRow(site_id=site, round=r, category="VU", noise_multiplier=1.0, sampling_rate=0.1, steps=1,
                            event_json="{}"))
        rows = {(site, r): UpdateRow(round=r, site_id=site, sequence=r, num_examples=3, payload_sha256="0" * 64)
                for site, r in [("s1", 1), ("s2", 1), ("s3", 2), ("s5", 3)]}
        s.add_all(rows.values())
        s.flush()
        s.add_all([BufferedUpdateRow(update_id=rows[("s2", 1)].id, buffer_round=2),
                   BufferedUpdateRow(update_id=rows[("s3", 2)].id, buffer_round=None),
                   RejectionRow(round=1, site_id="s4", reason="late", error_kind="Reject")])
    assert update_accounting(store) == {"charged": 5, "aggregated": 2, "stale_folded": 1, "waiting": 1,
                                        "discarded": 2, "late": 1}
    store.dispose()
