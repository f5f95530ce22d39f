"""``wildfed``, the laboratory's command line, apart from the operator's ``wildfed-coordinator``.

The command sets are written out here by hand (README and docs/interfaces.md name them): the lab commands moved to
``wildfed`` with their names and options; ``wildfed-coordinator`` keeps what an operator runs against a real
federation, and none of the lab's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from coordinator.cli import app as coordinator_app
from wildfed_sim.cli import app as wildfed_app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

LAB = {"demo", "experiment", "audit", "observers", "plan-budgets", "clusters", "radio-data"}
EXPERIMENTS = {"privacy-utility", "nira", "nira-head", "fedsofim", "radiomap", "real-photos", "fedbuff"}
OPERATOR = {"init", "enrol", "rotate-key", "revoke-key", "keys", "broker-config", "status", "budget", "run", "service",
            "ingest-worker", "provision", "serve", "import-deployments", "import-detections", "export-camtrap-dp",
            "user", "places", "clusters", "fleet", "publish-update"}


def _commands(app: typer.Typer, *path: str) -> set[str]:
    group = typer.main.get_command(app)
    for name in path:
        group = group.commands[name]  # type: ignore[attr-defined]
    return set(group.commands)  # type: ignore[attr-defined]


def test_the_lab_commands_are_wildfeds_and_the_operators_keep_theirs():
    assert _commands(wildfed_app) == LAB
    assert _commands(wildfed_app, "experiment") == EXPERIMENTS
    assert _commands(wildfed_app, "clusters") == {"check-metadata"}
    assert _commands(wildfed_app, "radio-data") == {"tiles", "sionna"}
    assert _commands(coordinator_app) == OPERATOR
    assert _commands(coordinator_app, "clusters") == {"show", "recluster", "pin"}
    assert _commands(coordinator_app, "user") == {"add", "list", "set-role", "set-password", "disable", "enable"}
    assert _commands(coordinator_app, "places") == {"list", "lift"}


def test_demo_rejects_bad_settings_with_a_clear_error(tmp_path):
    r = runner.invoke(wildfed_app, ["demo", "--sites", "1", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "sites must be >= 2" in r.output
    r = runner.invoke(wildfed_app, ["demo", "--privacy", "laplace", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "privacy" in r.output
    assert not (tmp_path / "run").exists()  # nothing written for a rejected configuration


def test_check_metadata_without_the_data_says_so_and_exits_2(tmp_path):
    r = runner.invoke(wildfed_app, ["clusters", "check-metadata", "--data", str(tmp_path)],
                      env={"COLUMNS": "400"})
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert "wildlife_insights: skipped" in flat and "serengeti: skipped" in flat


@pytest.mark.parametrize(("argv", "expected"), [
    (["wildfed", "--help"], ["demo", "experiment", "audit"]),
    (["wildfed-coordinator", "--help"], ["init", "serve", "ingest-worker"]),
])
def test_the_installed_entry_points_run(argv, expected):
    exe = Path(sys.executable).parent / argv[0]
    if not exe.is_file():
        pytest.skip(f"{exe} is not installed (pip install -e . writes it)")
    out = subprocess.run([str(exe), *argv[1:]], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert all(f" {name} " in out.stdout for name in expected), out.stdout
