"""Installing a published SDK version beside the running one, and checking it before anything switches.

:func:`stage_release` (the agent calls it while idle, :mod:`edge_sdk.updates.receiver`):

1. writes the release's wheels (each already checked against its signed SHA-256) to ``sdk/<version>/wheels/``;
2. creates ``sdk/<version>/venv`` with the interpreter that runs now; the venv sees the running version's site
   folders (a ``.pth`` file), so the dependencies already installed (ONNX Runtime, torch from JetPack, ...) serve
   the new version too;
3. installs the SDK wheel (``--no-deps --no-index``), then its extras as the bundle's install did
   (``sdk/install.json``: extras, wheel folders; the release's own wheels folder first, offline, when the release
   carries dependency wheels): pip installs only what the new version needs and the old one lacks;
4. runs the new version's own ``wildfed-edge check-config <prefix>/site.yaml`` (the checks ``run`` makes before
   its first round, ``edge_sdk.preflight``), which must exit 0.

Any failure raises :class:`StageError` and removes ``sdk/<version>``: the running version goes on untouched. Nothing
here switches; :mod:`edge_sdk.updates.trial` does, after the agent stopped.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError, WildFedError
from shared.keys import write_file_atomic
from shared.software import SoftwareRelease

from edge_sdk.bundle import make_venv, pip_install, venv_python
from edge_sdk.updates.layout import INSTALL_FILE, InstallLayout

__all__ = ["StagedVersion", "StageError", "stage_release", "CHECK_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: Seconds the new version's check-config may take (it reads the site's package).
CHECK_TIMEOUT_S = 900


class StageError(WildFedError):
    """A new version could not be installed or failed its check; the message says which step and why."""


@dataclass(frozen=True)
class StagedVersion:
    """A version installed and checked beside the running one, ready to switch to.

    Attributes:
        version: the new version; previous: the running one.
        venv: its venv (absolute); venv_relative: the same, relative to the prefix.
        issued, confirm_within_s: from the release (:class:`shared.software.SoftwareRelease`).
    """

    version: str
    previous: str
    venv: Path
    venv_relative: str
    issued: int
    confirm_within_s: int


def _site_folders() -> tuple[str, ...]:
    """The site folders of the running interpreter (its venv's, and those it sees through ``.pth`` files)."""
    return tuple(p for p in sys.path if p and Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir())


def _options(layout: InstallLayout) -> dict:
    try:
        return json.loads((layout.prefix / INSTALL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StageError(f"{layout.prefix / INSTALL_FILE} is unreadable ({exc}); reinstall the site's bundle "
                         "(wildfed-edge install-bundle --force)") from None


def _check(venv: Path, site_config: Path, version: str) -> None:
    cmd = [str(venv / "bin" / "wildfed-edge"), "check-config", str(site_config)]
    log.info("software: checking version %s: %s", version, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StageError(f"check-config of version {version} did not run: {exc}") from None
    if proc.returncode != 0:
        tail = " ".join((proc.stdout + proc.stderr).split())[-400:]
        raise StageError(f"version {version} failed its check-config (exit {proc.returncode}): {tail}")


def stage_release(layout: InstallLayout, release: SoftwareRelease, files: dict[str, bytes], *, site_config: Path,
                  running_version: str) -> StagedVersion:
    """Install and check ``release`` beside the running version (module docstring).

    Args:
        layout: the install's layout.
        release, files: the verified release and its files (``shared.software.decode_software``).
        site_config: the site's ``site.yaml`` (what check-config checks).
        running_version: the version running now (the one to come back to).

    Raises:
        StageError: a step failed (``sdk/<version>`` is removed again).
    """
    options = _options(layout)
    folder = layout.version_dir(release.version)
    shutil.rmtree(folder, ignore_errors=True)  # a leftover of an interrupted try
    wheels_dir, venv = folder / "wheels", folder / "venv"
    try:
        for name, data in files.items():
            write_file_atomic(wheels_dir / name, data, 0o644)
        make_venv(venv, system_site_packages=False, python=sys.executable, inherit=_site_folders())
        links = ((wheels_dir,) if len(files) > 1 else ()) + tuple(Path(p) for p in options.get("find_links", []))
        pip_install(venv, wheels_dir / release.sdk_wheel.name, extras=tuple(options.get("extras", ())),
                    find_links=links, no_deps=bool(options.get("no_deps", False)))
        if not venv_python(venv).exists():
            raise StageError(f"version {release.version}: the venv has no interpreter at {venv_python(venv)}")
        _check(venv, site_config, release.version)
    except (ConfigError, OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise StageError(f"version {release.version} could not be installed: {exc}") from None
    except StageError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return StagedVersion(version=release.version, previous=running_version, venv=venv,
                         venv_relative=layout.relative(venv), issued=release.issued,
                         confirm_within_s=release.confirm_within_s)
