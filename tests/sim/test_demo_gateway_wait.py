"""The demo waits for a gateway as long as its log keeps moving, and fails after ``timeout_s`` of silence (a fake
clock: each poll of the wait advances it by the poll interval, so nothing here depends on real time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import WildFedError
from wildfed_sim import gateway_processes
from wildfed_sim.gateway_processes import GatewayProcesses


class _Alive:
    returncode = None

    def poll(self):
        return None


class _Console:
    def log(self, *args):
        pass


def _gateways(tmp_path: Path) -> GatewayProcesses:
    (tmp_path / "site-00").mkdir()
    gw = GatewayProcesses([tmp_path / "site-00" / "gateway.yaml"], tmp_path, tmp_path)
    gw.procs.append(_Alive())
    (tmp_path / "site-00.log").write_text("")
    return gw


def _fake_time(monkeypatch, on_tick):
    clock = {"t": 0.0, "ticks": 0}
    monkeypatch.setattr(gateway_processes.time, "monotonic", lambda: clock["t"])

    def sleep(seconds):
        clock["t"] += seconds
        clock["ticks"] += 1
        on_tick(clock["ticks"])

    monkeypatch.setattr(gateway_processes.time, "sleep", sleep)
    return clock


def test_a_gateway_that_logs_progress_is_waited_for_past_the_timeout(tmp_path, monkeypatch):
    gw = _gateways(tmp_path)
    log = tmp_path / "site-00.log"

    def tick(n):  # a line every 5 s of fake time (50 polls of 0.1 s) for 100 s, then ready
        if n % 50 == 0:
            with log.open("a") as fh:
                fh.write(f"embeddings: {n} computed so far\n")
        if n == 1000:
            (tmp_path / "site-00.ready").write_text("")

    clock = _fake_time(monkeypatch, tick)
    gw.wait_ready(_Console(), timeout_s=10.0)  # 100 s in all, 10 s allowed per silence
    assert clock["t"] == pytest.approx(100.0)


def test_a_silent_gateway_fails_after_the_timeout(tmp_path, monkeypatch):
    gw = _gateways(tmp_path)
    clock = _fake_time(monkeypatch, lambda n: None)
    with pytest.raises(WildFedError, match="logged nothing for 10 s"):
        gw.wait_ready(_Console(), timeout_s=10.0)
    assert 10.0 < clock["t"] < 10.3
