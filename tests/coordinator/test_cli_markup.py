"""Text with square brackets (paths, cluster labels, pins) survives the coordinator's rich
output; rich would take ``[north]`` for markup and drop it. Through the real CLI (typer's runner)."""

from __future__ import annotations

from typer.testing import CliRunner

from coordinator.cli import app

from .test_cli_clusters import nira_federation

runner = CliRunner()


def _bare(text: str) -> str:
    return "".join(text.split())  # rich wraps (and folds long paths) at the terminal width


def test_init_prints_a_folder_with_brackets(tmp_path) -> None:
    folder = tmp_path / "fed[north]"
    result = runner.invoke(app, ["init", str(folder), "--federation-id", "fed"])
    assert result.exit_code == 0, result.output
    assert _bare(f"{folder}") in _bare(result.output)
    assert _bare(f"config {folder}/coordinator.yaml") in _bare(result.output)


def test_cluster_labels_and_pins_with_brackets_are_shown(tmp_path) -> None:
    cfg = nira_federation(tmp_path, {"a": ["A", "B"], "b": ["A", "B"], "c": ["C"]})
    pinned = runner.invoke(app, ["clusters", "pin", "c", "c[north]", "--config", str(cfg)])
    assert pinned.exit_code == 0, pinned.output
    assert "c pinned to c[north]" in " ".join(pinned.output.split())

    shown = runner.invoke(app, ["clusters", "show", "--config", str(cfg)])
    assert shown.exit_code == 0, shown.output
    out = _bare(shown.output)
    assert "c[north]" in out and "[pinned:c]" in out  # before the fix: both vanished

    again = runner.invoke(app, ["clusters", "recluster", "--config", str(cfg)])
    assert again.exit_code == 0 and "c[north]: c" in " ".join(again.output.split())


def test_output_to_a_pipe_is_not_cut_at_80_columns() -> None:
    """Printed to a pipe (a log file, ``| tee``) the consoles are 160 columns wide unless ``$COLUMNS`` says
    otherwise, so a 120-character line arrives whole; a fresh interpreter, as a user's shell would start it."""
    import os
    import subprocess
    import sys

    line = "x" * 119 + "|"
    code = ("from coordinator.cli.common import console, err_console; "
            f"console.print({line!r}); print(console.width, err_console.width)")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines() == [line, "160 160"]
    narrow = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "COLUMNS": "100"}, check=True).stdout
    assert narrow.splitlines()[-1] == "100 100" and line not in narrow.splitlines()  # $COLUMNS is honoured
