"""The WildFed SDK wheel a provisioning bundle ships, built from the project source this code runs from.

The SDK wheel is built with ``python -m pip wheel --no-deps --no-build-isolation`` from a copy of the installed
project source (an editable/checkout install), cached by a hash of that source, or taken from ``--wheel``.
:mod:`coordinator.provisioning` ships it in each bundle; an SDK update published to the gateways
(:mod:`coordinator.cli.fleet`) builds it here too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["build_sdk_wheel", "project_source_root"]

log = logging.getLogger("coordinator.provisioning")  # a step of provisioning: logged under its name

_SOURCE_ITEMS = ("pyproject.toml", "README.md", "shared", "edge_sdk", "coordinator", "wildfed_sim")


def project_source_root() -> Path | None:
    """The project checkout this code runs from (``pyproject.toml`` beside the packages), or ``None`` for a wheel
    install."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "edge_sdk").is_dir() else None


def _source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for item in _SOURCE_ITEMS:
        top = root / item
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()
                                                    and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for f in files:
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def build_sdk_wheel(cache_dir: Path, *, source_root: Path | None = None) -> Path:
    """Build (or reuse) the WildFed wheel from the project source.

    The source (``pyproject.toml``, ``README.md``, ``shared/``, ``edge_sdk/``, ``coordinator/``, ``wildfed_sim/``:
    the four Python packages, so that every entry point of the wheel imports) is copied to a temporary
    folder so the checkout is not touched, and built with ``pip wheel --no-deps --no-build-isolation``
    (no network: the build backend, setuptools, must be installed). The result is cached under
    ``cache_dir/<source hash>/``.

    Raises:
        ConfigError: no project source (a wheel install: pass ``--wheel``), or the build failed.
    """
    root = source_root or project_source_root()
    if root is None:
        raise ConfigError("the WildFed source is not available to build the SDK wheel", field="wheel",
                          fix="pass --wheel FILE (a wildfed-*.whl), or run the coordinator from a checkout")
    key = _source_digest(root)[:24]
    target = Path(cache_dir) / key
    cached = sorted(target.glob("wildfed-*.whl")) if target.is_dir() else []
    if cached:
        return cached[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wildfed-wheel-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        src.mkdir()
        for item in _SOURCE_ITEMS:
            path = root / item
            if path.is_dir():
                shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif path.is_file():
                shutil.copy2(path, src / item)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               str(src), "-w", str(out)]
        log.info("building the SDK wheel: %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(out.glob("wildfed-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ConfigError(f"building the SDK wheel failed (pip exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-800:]}", field="wheel",
                              fix="install setuptools in this environment, or pass --wheel FILE")
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        shutil.copy2(wheels[0], staging / wheels[0].name)
        try:
            os.replace(staging, target)
        except OSError:  # another process cached the same build first
            shutil.rmtree(staging, ignore_errors=True)
    return sorted(target.glob("wildfed-*.whl"))[0]
