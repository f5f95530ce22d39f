"""The long-lived coordinator (coordinator.daemon) without a broker: the schedule's slots, a round that cannot run
is logged and waited out instead of ending the service, a stop request ends it cleanly, and the systemd unit
printed by ``service --print-unit`` is the one docs/service.md shows."""

from __future__ import annotations

import datetime as _dt
import logging
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.keys import generate_signing_key

from coordinator.cli import app
from coordinator.config import config_from_dict
from coordinator.daemon import SERVICE_UNIT_TEMPLATE, CoordinatorService, next_round_at, render_service_unit
from coordinator.service import Coordinator
from coordinator.storage import RoundRow, Store
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import make_config, tiny_weights
from tests.support import poll_until

ROOT = Path(__file__).resolve().parents[2]
T0 = _dt.datetime(2026, 3, 1, 12, 0, 0)


def test_schedule_defaults_to_a_round_a_day_and_refuses_nonsense() -> None:
    cfg = config_from_dict({"federation_id": "f"})
    assert (cfg.schedule.round_interval_s, cfg.schedule.max_rounds) == (86_400.0, None)
    for bad in ({"round_interval_s": 0}, {"round_interval_s": float("inf")}, {"max_rounds": 0}):
        with pytest.raises(ConfigError, match="schedule"):
            config_from_dict({"federation_id": "f", "schedule": bad})


def test_the_next_slot_follows_the_last_round_or_the_last_attempt(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, schedule={"round_interval_s": 3600.0, "max_rounds": 2})
    store = Store(cfg.database_url or "", cfg.data_dir)
    before = _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None)
    assert before <= next_round_at(store, cfg) <= before + _dt.timedelta(seconds=60)  # no round yet: now
    with store.session() as s:
        s.add(RoundRow(round=1, status="closed", base_model_hash="0" * 64, opened_at=T0))
    assert next_round_at(store, cfg) == T0 + _dt.timedelta(hours=1)
    later = T0 + _dt.timedelta(hours=5)  # a slot in which no round could run (nothing recorded)
    assert next_round_at(store, cfg, last_attempt=later) == later + _dt.timedelta(hours=1)
    with store.session() as s:
        s.add(RoundRow(round=2, status="failed", base_model_hash="0" * 64, opened_at=T0))
    assert next_round_at(store, cfg) is None  # max_rounds rounds exist
    store.dispose()


def test_a_round_that_cannot_run_is_logged_and_the_service_waits(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.daemon")
    cfg = make_config(tmp_path, schedule={"round_interval_s": 3600.0})
    coord = Coordinator(cfg, transport=InMemoryTransport(), signing_key=generate_signing_key(),
                        initial_weights=tiny_weights())
    svc = CoordinatorService(cfg, coordinator=coord, web=False)
    worker = threading.Thread(target=svc.run)
    worker.start()
    try:
        assert poll_until(lambda: svc.rounds_run, 30.0)
        assert poll_until(lambda: any("round 1 due at" in r.getMessage() for r in caplog.records), 30.0)
        assert worker.is_alive()  # waiting for the next slot, not exited
    finally:
        svc.request_stop()
        worker.join(timeout=30)
    assert not worker.is_alive()
    assert [r.status for r in svc.rounds_run] == ["skipped"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "round 1 could not run: no site is enrolled; next attempt in 60 min" in text
    assert "service: stopped" in text


def test_the_printed_unit_is_the_documented_one_filled_in(tmp_path: Path) -> None:
    assert SERVICE_UNIT_TEMPLATE in (ROOT / "docs" / "service.md").read_text(encoding="utf-8")
    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "fed"), "--federation-id", "reserve"]).exit_code == 0
    config = tmp_path / "fed" / "coordinator.yaml"
    res = runner.invoke(app, ["service", "--config", str(config), "--print-unit", "--user", "wildfed"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for line in ("Restart=on-failure", "RestartPreventExitStatus=2", "User=wildfed", "KillSignal=SIGTERM",
                 f"WorkingDirectory={config.resolve().parent}", f"ReadWritePaths={(tmp_path / 'fed' / 'data').resolve()}",
                 "Description=WildFed coordinator (federation reserve): ingest, rounds on a schedule, web view"):
        assert line in lines, (line, res.output)
    exec_line = next(x for x in lines if x.startswith("ExecStart="))
    assert exec_line.endswith(f" service --config {config.resolve()}")
    assert "@" not in res.output  # every placeholder filled
    cfg = config_from_dict({"federation_id": "reserve", "data_dir": str(tmp_path / "fed" / "data")})
    assert render_service_unit(cfg, str(config), executable=exec_line[len("ExecStart="):].split(" service")[0],
                               user="wildfed") == res.output
