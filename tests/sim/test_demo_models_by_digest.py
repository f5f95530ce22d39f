"""``wildfed demo --no-models-by-digest``: the coordinator config the demo builds then has
``transfer.models_by_digest`` false (every task carries its model), for brokers that do not deliver retained messages
on wildcard filters (RabbitMQ 3.10, docs/brokers.md); without the flag it stays true, the coordinator's default.

The command line is run with ``run_demo`` replaced by a recorder, so nothing is started; the recorded settings go
through the demo's own ``coordinator_config`` (:mod:`wildfed_sim.demo_prep`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from wildfed_sim import demo, demo_prep
from wildfed_sim.cli import app


@pytest.mark.parametrize(("flags", "expected"), [([], True), (["--models-by-digest"], True),
                                                  (["--no-models-by-digest"], False)])
def test_the_flag_reaches_the_coordinator_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags, expected):
    seen: list[demo.DemoSettings] = []
    monkeypatch.setattr(demo, "run_demo", lambda settings, console=None: seen.append(settings))
    result = CliRunner().invoke(app, ["demo", "--broker", "mqtt://127.0.0.1:1", "--rounds", "3", *flags])
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert settings.models_by_digest is expected
    config = demo_prep.coordinator_config(settings, tmp_path, tmp_path / "coordinator", "wildfed-demo-test",
                                          "mqtt://127.0.0.1:1", tmp_path / "coordinator" / "keys" / "coordinator.pub",
                                          None, demo_prep.demo_budget(settings), {})
    assert config.transfer.models_by_digest is expected
    assert config.broker_url == "mqtt://127.0.0.1:1" and config.rounds == 3
    assert (tmp_path / "coordinator" / "coordinator.yaml").exists()
