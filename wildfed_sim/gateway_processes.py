"""Gateway processes for the laboratory: one ``wildfed-edge run`` per site config, started, waited for (each
writes its ready file once subscribed), and stopped; used by the demos and the experiments that run a real
federation over MQTT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.errors import WildFedError

__all__ = ["GatewayProcesses", "spawned_gateways", "running_gateways"]


class GatewayProcesses:
    """The gateway processes of a run (:func:`spawned_gateways`): started, then waited for, then stopped."""

    def __init__(self, config_paths: list[Path], log_dir: Path, ready_dir: Path) -> None:
        self.config_paths, self.log_dir, self.ready_dir = config_paths, log_dir, ready_dir
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    def start(self) -> None:
        """One ``wildfed-edge run`` process per site (returns at once: each imports, loads and embeds its data and
        connects on its own)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for path in self.config_paths:
            site = path.parent.name
            log = open(self.log_dir / f"{site}.log", "ab")
            self._logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "edge_sdk.cli", "run", "--config", str(path),
                 "--ready-file", str(self.ready_dir / f"{site}.ready")],
                stdout=log, stderr=subprocess.STDOUT, env=env))

    def wait_ready(self, console: Any, timeout_s: float = 120.0) -> None:
        """Wait until every gateway has subscribed (its ready file exists). A gateway fails when ``timeout_s`` pass
        with no new line in its log: one that is still making progress (a first run embeds its images for minutes
        on a loaded machine, logging each chunk) is waited for.

        Raises:
            WildFedError: a gateway exited, or its log stood still for ``timeout_s`` (the message quotes its log).
        """
        for path, proc in zip(self.config_paths, self.procs):
            site = path.parent.name
            log_path = self.log_dir / f"{site}.log"
            size, deadline = -1, time.monotonic() + timeout_s
            while not (self.ready_dir / f"{site}.ready").exists():
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise WildFedError(f"gateway {site} exited with code {proc.returncode} before it was ready; "
                                       f"its log ({log_path}) ends:\n{tail}")
                grown = log_path.stat().st_size if log_path.exists() else 0
                if grown != size:  # progress: the silence is counted from the latest line
                    size, deadline = grown, time.monotonic() + timeout_s
                if time.monotonic() > deadline:
                    raise WildFedError(f"gateway {site} was not ready and logged nothing for {timeout_s:.0f} s; "
                                       f"see {log_path}")
                time.sleep(0.1)
        console.log(f"{len(self.procs)} gateway agents connected")

    def stop(self) -> None:
        """SIGTERM every gateway still running, wait (then kill after 15 s); idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()


@contextmanager
def spawned_gateways(config_paths: list[Path], log_dir: Path, ready_dir: Path) -> Iterator[GatewayProcesses]:
    """Start one ``wildfed-edge run`` process per site and yield at once (:meth:`GatewayProcesses.wait_ready` before the
    first round); stop them on exit."""
    gateways = GatewayProcesses(config_paths, log_dir, ready_dir)
    try:
        gateways.start()
        yield gateways
    finally:
        gateways.stop()


@contextmanager
def running_gateways(config_paths: list[Path], log_dir: Path, ready_dir: Path, console: Any,
              timeout_s: float = 120.0) -> Iterator[list[subprocess.Popen]]:
    """Start one ``wildfed-edge run`` process per site; wait until each has subscribed; stop them on exit."""
    with spawned_gateways(config_paths, log_dir, ready_dir) as gateways:
        gateways.wait_ready(console, timeout_s)
        yield gateways.procs


