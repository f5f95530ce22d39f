"""Switching the running agent to a staged SDK version: begin its trial, then hand the process to the launcher.

``wildfed-edge run`` calls :func:`switch_to` after the agent stopped and closed (its outbox, transport and field
loop): the trial is recorded and ``current`` points at the new version (:func:`edge_sdk.updates.trial.begin`), then
the process replaces itself (``exec``) with the launcher of the stable version (:mod:`edge_sdk.updates.launch`)
and the same ``wildfed-edge`` arguments; or, when a launcher already supervises this process, exits with
:data:`~edge_sdk.updates.launch.RELAUNCH_STATUS` and that launcher supervises the next version. Under systemd the unit's main process stays the same; started by hand, the
terminal keeps it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from edge_sdk.updates.receiver import SoftwareUpdates
from edge_sdk.updates.stage import StagedVersion
from edge_sdk.updates.launch import LAUNCHER_ENV, RELAUNCH_STATUS
from edge_sdk.updates.trial import begin

__all__ = ["switch_to"]

log = logging.getLogger(__name__)


def switch_to(updates: SoftwareUpdates, staged: StagedVersion, args: list[str]) -> NoReturn:
    """Begin ``staged``'s trial and exec the launcher with ``args`` (``wildfed-edge``'s arguments, e.g.
    ``["run", "--config", "/opt/wildfed/site.yaml"]``). Does not return.

    Raises:
        RuntimeError: the agent has no update layout (it could not have staged a version).
    """
    layout = updates.layout
    if layout is None:
        raise RuntimeError("no update layout: nothing to switch")
    begin(layout, version=staged.version, venv_relative=staged.venv_relative, previous=staged.previous,
          issued=staged.issued, confirm_within_s=staged.confirm_within_s)
    supervised = os.environ.get(LAUNCHER_ENV) == str(os.getppid())
    command = layout.launcher_command() + list(args)
    log.info("switching to SDK version %s (from %s): %s", staged.version, staged.previous,
             "handed to the launcher that runs this version" if supervised else " ".join(command))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if supervised:  # a launcher waits on this process: it supervises the next version itself
        os._exit(RELAUNCH_STATUS)
    os.execv(command[0], command)
