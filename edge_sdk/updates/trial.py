"""A new SDK version on trial: it confirms once it reached the broker, or it is rolled back (standard library only).

A version is on trial from the moment the running one switched ``current`` to it (:func:`begin`) until it confirms
(:func:`confirm`, called by ``wildfed-edge run`` once its agent connected to the broker and subscribed) or is rolled
back (:func:`roll_back`: ``current`` back to the previous version, the version recorded as failed with the reason;
the launcher does it, :mod:`edge_sdk.updates.launch`). A failed version is never tried again: the operator publishes
a new release (a new ``issued``) to try again. The previous version, started after a rollback, reports it
(:func:`take_rollback_notice`: one ERROR line, which its next health record carries as ``last_error``).
"""

from __future__ import annotations

import time

from edge_sdk.updates.layout import InstallLayout

__all__ = ["begin", "confirm", "roll_back", "take_rollback_notice"]


def begin(layout: InstallLayout, *, version: str, venv_relative: str, previous: str, issued: int,
          confirm_within_s: int) -> None:
    """Record ``version`` (installed in ``venv_relative``) as installed, put it on trial and point ``current`` at
    it. The caller then starts the launcher, which supervises the trial."""
    body = layout.state()
    body["versions"][version] = venv_relative
    body["last_issued"] = max(int(body.get("last_issued", 0)), issued)
    layout.save_state(body)
    layout.start_trial(version=version, previous=previous, confirm_within_s=confirm_within_s)
    layout.point("current", layout.prefix / venv_relative)
    layout.note("switched", version, f"from {previous}")


def confirm(layout: InstallLayout, running_version: str) -> bool:
    """Confirm the trial of ``running_version`` (it came back): ``stable`` points at it and the trial ends.
    Returns True when a trial was confirmed (False: no trial, or a trial of another version)."""
    trial = layout.trial()
    if trial is None or trial.get("version") != running_version:
        return False
    venv = layout.venv_of(running_version)
    if venv is None:
        return False
    layout.point("stable", venv)
    layout.trial_path.unlink(missing_ok=True)
    taken = time.time() - (float(trial.get("deadline", time.time())) - float(trial.get("confirm_within_s", 0)))
    layout.note("confirmed", running_version, f"came back in {taken:.0f} s")
    return True


def roll_back(layout: InstallLayout, reason: str) -> str | None:
    """End the trial by going back: ``current`` to the previous version, the trial's version recorded as failed
    with ``reason`` (and a notice for the previous version to report). Returns the version gone back to, or None
    when no trial was running."""
    trial = layout.trial()
    if trial is None:
        return None
    failed, previous = str(trial.get("version")), str(trial.get("previous"))
    venv = layout.venv_of(previous)
    if venv is None:  # the record lost the previous version: the stable one is known good
        previous = layout.version_of("stable") or previous
        venv = layout.prefix / (layout.points_at("stable") or "venv")
    layout.point("current", venv)
    body = layout.state()
    body["failed"][failed] = reason
    body["rollback_notice"] = {"version": failed, "reason": reason, "back_to": previous}
    layout.save_state(body)
    layout.trial_path.unlink(missing_ok=True)
    layout.note("rolled back", failed, reason)
    return previous


def take_rollback_notice(layout: InstallLayout) -> dict[str, str] | None:
    """The notice of a rollback not yet reported (``version``, ``reason``, ``back_to``), removed from the state."""
    body = layout.state()
    notice = body.pop("rollback_notice", None)
    if notice is not None:
        layout.save_state(body)
    return notice if isinstance(notice, dict) else None
