"""The gateway's launcher: starts the agent's current SDK version, and supervises a version on trial.

The systemd unit (and ``wildfed-edge install-bundle``'s printed command) runs::

    <prefix>/stable/bin/python -m edge_sdk.updates.launch --prefix <prefix> run --config <prefix>/site.yaml

It runs from the **stable** version (the last one that came back after its start), imports the standard library
only, and:

- no trial (:mod:`edge_sdk.updates.trial`): replaces itself (``exec``) with ``<prefix>/current/bin/wildfed-edge``
  and the arguments after ``--prefix``: nothing stays in between;
- a trial started by the previous version (which switched ``current`` and exec'd this launcher): runs the new version
  as its child, forwards SIGTERM/SIGINT to it, and waits. The child confirms (``wildfed-edge run`` ends the trial
  once its agent reached the broker): from then on the launcher only waits and exits with the child's status. The
  child exits first, or the deadline (the release's ``confirm_within_s``) passes (the child is stopped: SIGTERM,
  30 s, SIGKILL): the launcher rolls back and replaces itself with the previous version;
- a trial that was already started once (the launcher or the gateway died during it) or whose deadline passed:
  rolls back at once, then runs the previous version.

A stop signal during a trial rolls the trial back too (the version did not show that it works). When a version that
a launcher supervises switches again, it does not start another launcher under this one: it begins the next
trial and exits with :data:`RELAUNCH_STATUS`, and this launcher supervises the next version itself, so however many
updates come, one launcher at most stays between systemd and the agent. Exit status: the agent's (128 + signal
number when a signal ended it); 1 when no version can be started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from edge_sdk.updates.layout import InstallLayout
from edge_sdk.updates.trial import roll_back

__all__ = ["main", "LAUNCHER_ENV", "RELAUNCH_STATUS"]

#: Seconds between looks at the child and the trial file while a version is on trial.
POLL_S = 0.5
#: Seconds a child on trial has to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 30.0
#: The environment variable naming the supervising launcher's pid, set for its child.
LAUNCHER_ENV = "WILDFED_LAUNCHER_PID"
#: The exit status with which an agent that a launcher supervises hands it the next version's trial (EX_TEMPFAIL).
RELAUNCH_STATUS = 75


def _say(message: str) -> None:
    print(f"wildfed-launch: {message}", file=sys.stderr, flush=True)


def _exec(layout: InstallLayout, args: list[str]) -> NoReturn:
    exe = layout.executable("current")
    try:
        os.execv(str(exe), [str(exe), *args])
    except OSError as exc:
        _say(f"cannot start {exe}: {exc}; fix: reinstall the site's bundle (wildfed-edge install-bundle --force)")
        raise SystemExit(1) from None


def _status(code: int) -> int:
    return code if code >= 0 else 128 - code  # Popen: -N when signal N ended the child


def _confirmed(layout: InstallLayout, version: str) -> bool:
    trial = layout.trial()
    return trial is None or trial.get("version") != version


def _stop(child: subprocess.Popen[bytes]) -> None:
    child.terminate()
    try:
        child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _supervise(layout: InstallLayout, args: list[str], trial: dict[str, Any]) -> int | None:
    """Run the version on trial as a child (module docstring); its exit status once it confirmed, or None after a
    rollback (the caller then runs the previous version)."""
    version, deadline = str(trial["version"]), float(trial["deadline"])
    env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}  # the child hands the next switch back here
    child = subprocess.Popen([str(layout.executable("current")), *args], env=env)
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _say(f"version {version} on trial: it has {max(0.0, deadline - time.time()):.0f} s to reach the broker")
    while True:
        try:
            code: int | None = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        if _confirmed(layout, version):
            return _status(child.wait() if code is None else code)
        if code is not None:
            reason = ("stopped during its trial" if stopped
                      else f"exited with status {_status(code)} before it reached the broker")
            roll_back(layout, reason)
            _say(f"version {version} rolled back: {reason}")
            return _status(code) if stopped else None
        if time.time() >= deadline:
            _stop(child)
            reason = f"did not reach the broker within {trial.get('confirm_within_s', '?')} s"
            roll_back(layout, reason)
            _say(f"version {version} rolled back: {reason}")
            return None


def main(argv: list[str] | None = None) -> int:
    """The launcher's entry point (module docstring); returns the exit status (or does not return: exec)."""
    parser = argparse.ArgumentParser(prog="python -m edge_sdk.updates.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", required=True, type=Path, help="the install prefix (holds current, stable)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="wildfed-edge's arguments (e.g. run --config ...)")
    ns = parser.parse_args(argv)
    layout = InstallLayout(ns.prefix.resolve())
    while (trial := layout.trial()) is not None:
        if int(trial.get("starts", 0)) >= 1 or time.time() >= float(trial.get("deadline", 0)):
            reason = ("its deadline passed" if time.time() >= float(trial.get("deadline", 0))
                      else "it was started once already (it, or the gateway, stopped during its trial)")
            roll_back(layout, reason)
            _say(f"version {trial.get('version')} rolled back: {reason}")
            break
        layout.save_trial({**trial, "starts": 1})
        code = _supervise(layout, list(ns.args), trial)
        if code is None:  # rolled back: the previous version runs in this process's place
            break
        if code != RELAUNCH_STATUS:
            return code
        # the confirmed version began the next version's trial and handed it back: supervise that one
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _exec(layout, list(ns.args))


if __name__ == "__main__":
    raise SystemExit(main())
