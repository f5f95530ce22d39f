"""Where a gateway's SDK versions live, which one runs, and the record of updates (standard library only: the
launcher, :mod:`edge_sdk.updates.launch`, imports it before anything else).

Under the install prefix (``wildfed-edge install-bundle``)::

    venv/                     the version the bundle installed
    sdk/<version>/venv/       each version installed by an update (``sdk/<version>/wheels/``: its files)
    current -> venv | sdk/<version>/venv     the version to run (the launcher runs its ``bin/wildfed-edge``)
    stable  -> ...            the last version that came back after its start (runs the launcher)
    sdk/install.json          how the bundle was installed (venv options, extras, wheel folders)
    sdk/state.json            versions installed, the last release acted on, failed versions and why
    sdk/trial.json            while a new version is on trial: version, previous, deadline, starts

``current`` and ``stable`` are symbolic links, replaced atomically (a new link renamed over the old one). A new
version's venv sees the previous version's packages (a ``.pth`` file listing its site folders), so an update
installs the SDK wheel alone and needs no network when its dependencies did not change.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["InstallLayout", "INSTALL_FILE", "STATE_FILE", "TRIAL_FILE"]

INSTALL_FILE = "sdk/install.json"
STATE_FILE = "sdk/state.json"
TRIAL_FILE = "sdk/trial.json"


def _write_json(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` to ``path`` atomically (a temporary file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(body, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # a torn or unreadable file counts as absent; the writers replace it whole
    return body if isinstance(body, dict) else None


@dataclass(frozen=True)
class InstallLayout:
    """The update layout under ``prefix`` (module docstring). Build it with :meth:`find` or :meth:`create`."""

    prefix: Path

    # -- finding and creating ------------------------------------------------------------------------------------
    @classmethod
    def find(cls, site_config: str | os.PathLike[str]) -> InstallLayout | None:
        """The layout of the install whose ``site.yaml`` is ``site_config``; None when that install cannot take
        updates (no ``sdk/install.json`` beside it: installed without a venv, by hand, or by an older SDK)."""
        prefix = Path(site_config).resolve().parent
        return cls(prefix) if (prefix / INSTALL_FILE).is_file() else None

    @classmethod
    def create(cls, prefix: Path, *, version: str, venv: Path, options: dict[str, Any]) -> InstallLayout:
        """Record a fresh install: ``venv`` (inside ``prefix``) runs ``version``; ``options`` (venv and pip options
        of the install) go to ``sdk/install.json``; both links point at ``venv``; earlier update records go."""
        layout = cls(Path(prefix))
        _write_json(layout.prefix / INSTALL_FILE, options)
        _write_json(layout.state_path, {"versions": {version: layout.relative(venv)}, "failed": {},
                                        "last_issued": 0, "history": [[int(time.time()), "installed", version]]})
        layout.trial_path.unlink(missing_ok=True)
        layout.point("current", venv)
        layout.point("stable", venv)
        return layout

    # -- paths -------------------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        """``sdk/state.json``."""
        return self.prefix / STATE_FILE

    @property
    def trial_path(self) -> Path:
        """``sdk/trial.json``."""
        return self.prefix / TRIAL_FILE

    def version_dir(self, version: str) -> Path:
        """``sdk/<version>``: where an update installs ``version``."""
        return self.prefix / "sdk" / version

    def relative(self, path: Path) -> str:
        """``path`` relative to the prefix (the form links and records hold)."""
        return os.path.relpath(Path(path).resolve(), self.prefix.resolve())

    def link(self, name: str) -> Path:
        """``<prefix>/current`` or ``<prefix>/stable``."""
        return self.prefix / name

    def executable(self, name: str = "current") -> Path:
        """The ``wildfed-edge`` of the version ``name`` points at."""
        return self.link(name) / "bin" / "wildfed-edge"

    def python(self, name: str = "stable") -> Path:
        """The interpreter of the version ``name`` points at."""
        return self.link(name) / "bin" / "python"

    def launcher_command(self) -> list[str]:
        """The command that starts the agent through the launcher of the stable version."""
        return [str(self.python("stable")), "-m", "edge_sdk.updates.launch", "--prefix", str(self.prefix)]

    # -- links and records ---------------------------------------------------------------------------------------
    def point(self, name: str, venv: Path) -> None:
        """Point the link ``name`` at ``venv`` atomically (a new link renamed over the old one)."""
        target = self.relative(venv)
        tmp = self.prefix / f".{name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp, target_is_directory=True)
        os.replace(tmp, self.link(name))

    def points_at(self, name: str) -> str | None:
        """The prefix-relative venv the link ``name`` points at, or None."""
        try:
            return os.path.normpath(os.readlink(self.link(name)))
        except OSError:
            return None

    def state(self) -> dict[str, Any]:
        """``sdk/state.json`` (empty records when unreadable)."""
        body = _read_json(self.state_path) or {}
        body.setdefault("versions", {})
        body.setdefault("failed", {})
        body.setdefault("last_issued", 0)
        body.setdefault("history", [])
        return body

    def save_state(self, body: dict[str, Any]) -> None:
        """Replace ``sdk/state.json`` (the history keeps its last 50 entries)."""
        body["history"] = body.get("history", [])[-50:]
        _write_json(self.state_path, body)

    def note(self, event: str, version: str, detail: str = "", **changes: Any) -> dict[str, Any]:
        """Apply ``changes`` to the state, append ``[time, event, version, detail]`` to its history and save it."""
        body = self.state()
        body.update(changes)
        body["history"].append([int(time.time()), event, version] + ([detail] if detail else []))
        self.save_state(body)
        return body

    def version_of(self, name: str) -> str | None:
        """The version the link ``name`` points at, from the state's ``versions``; None when unknown."""
        target = self.points_at(name)
        return next((v for v, path in self.state()["versions"].items() if os.path.normpath(path) == target), None)

    def venv_of(self, version: str) -> Path | None:
        """The venv of an installed ``version``, or None."""
        path = self.state()["versions"].get(version)
        return self.prefix / path if path else None

    def trial(self) -> dict[str, Any] | None:
        """``sdk/trial.json`` while a version is on trial, else None."""
        return _read_json(self.trial_path)

    def start_trial(self, *, version: str, previous: str, confirm_within_s: int) -> None:
        """Put ``version`` on trial: it must confirm within ``confirm_within_s`` seconds of now."""
        _write_json(self.trial_path, {"version": version, "previous": previous, "starts": 0,
                                      "deadline": time.time() + confirm_within_s,
                                      "confirm_within_s": confirm_within_s})

    def save_trial(self, body: dict[str, Any]) -> None:
        """Replace ``sdk/trial.json``."""
        _write_json(self.trial_path, body)
