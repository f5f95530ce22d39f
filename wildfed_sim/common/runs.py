"""Runs of the laboratory: the run folder, SIGTERM as Ctrl-C, the resumable run log."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

__all__ = ["new_run_dir", "sigterm_unwinds", "read_runs"]


def new_run_dir(out_dir: str | os.PathLike[str] | None, prefix: str) -> Path:
    """The absolute run folder: ``out_dir``, or ``runs/<prefix>-<UTC time>``; created empty.

    Raises:
        ConfigError: the folder exists and is not empty (nothing of an earlier run is overwritten).
    """
    run_dir = Path(out_dir or Path("runs") / f"{prefix}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"folder {run_dir} is not empty", field="out", fix="choose a new --out folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM (``timeout``, a CI cancel, ``kill``) into KeyboardInterrupt while the block runs, so the
    broker and gateway processes are stopped by the same clean-up as Ctrl-C instead of being orphaned. Off the main
    thread (where signals cannot be handled) it does nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The rows of a resumable run log (one JSON object per line; blank lines skipped; [] when absent)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
