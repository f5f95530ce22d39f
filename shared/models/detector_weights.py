"""The detector's weights, and where the files made from them live (the WildFed cache).

Both sides use it: a gateway exports the detector's ONNX graph from the checkpoint where it has torch, and the
coordinator exports it once at provisioning and ships it in the gateway's bundle (``shared.models.gateway_graphs``).

The YOLOX-tiny checkpoint ships inside the ``zamba==2.7.2`` wheel (MIT licence) as
``zamba/object_detection/yolox/assets/yolox_tiny_640_20220528.pth``. On first use :func:`detector_checkpoint`
downloads that wheel with ``python -m pip download --no-deps zamba==2.7.2`` (about 41 MB, one time; the wheel's
``Requires-Python >= 3.11`` is ignored, as nothing of it is installed), takes the one
file out of the zip and checks its SHA-256 against :data:`CHECKPOINT_SHA256`; nothing of zamba is installed or
imported. The weights are never committed to the repository.

Cache layout (``$WILDFED_CACHE``, default ``~/.cache/wildfed``)::

    wheels/zamba-2.7.2-py3-none-any.whl     the downloaded wheel (kept so a re-extract needs no network)
    detector/yolox_tiny_640_20220528.pth    the checkpoint (SHA-256 checked)
    detector/yolox_tiny-<sha12>-opset17.onnx the exported detector, named by the checkpoint hash
    backbone/<variant>-<sha12>-p1-<S>px-opset17.onnx   the exported backbone embedder (shared.models.gateway_graphs)
    classifier/camera_cnn-<sha12>.onnx      classifier graphs, named by the model hash
    engines/<name>.engine (+ .json)         TensorRT engines and their cache keys (edge_sdk.inference.engines)

An offline machine can be given the checkpoint directly with ``$WILDFED_YOLOX_WEIGHTS`` (still hash-checked). A
provisioned gateway needs neither: its bundle carries the exported graphs (docs/gateways.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["ZAMBA_REQUIREMENT", "ZAMBA_WHEEL", "CHECKPOINT_MEMBER", "CHECKPOINT_SHA256", "cache_dir",
           "sha256_file", "detector_checkpoint", "WeightsUnavailableError"]

log = logging.getLogger(__name__)

ZAMBA_REQUIREMENT = "zamba==2.7.2"
ZAMBA_WHEEL = "zamba-2.7.2-py3-none-any.whl"
CHECKPOINT_MEMBER = "zamba/object_detection/yolox/assets/yolox_tiny_640_20220528.pth"
#: SHA-256 of the checkpoint as shipped in the zamba 2.7.2 wheel (checked after every extraction).
CHECKPOINT_SHA256 = "31f8690fc62f9d0756f1e8c09b0b02e5ade106173ed0a30743d47c004f88f4e0"


class WeightsUnavailableError(ConfigError):
    """The detector checkpoint could not be downloaded, extracted or verified."""


def cache_dir() -> Path:
    """``$WILDFED_CACHE`` or ``~/.cache/wildfed`` (created if absent)."""
    root = Path(os.environ.get("WILDFED_CACHE") or Path.home() / ".cache" / "wildfed").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(wheels: Path, timeout_s: float) -> Path:
    wheel = wheels / ZAMBA_WHEEL
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    log.info("detector weights: downloading %s (about 41 MB, once) into %s", ZAMBA_REQUIREMENT, wheels)
    # --ignore-requires-python: zamba 2.7.2 declares Python >= 3.11, and a gateway may run 3.10 (JetPack 6); only a
    # data file is read from the wheel, nothing of it is installed or imported
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python",
           ZAMBA_REQUIREMENT, "-d", str(wheels)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WeightsUnavailableError(f"could not run pip to download {ZAMBA_REQUIREMENT}: {exc}",
                                      field="detector weights",
                                      fix="download the wheel elsewhere and copy it to "
                                          f"{wheel}, or set WILDFED_YOLOX_WEIGHTS") from exc
    if proc.returncode != 0 or not wheel.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise WeightsUnavailableError(f"pip download {ZAMBA_REQUIREMENT} failed: {' | '.join(tail)}",
                                      field="detector weights",
                                      fix=f"check the network or copy {ZAMBA_WHEEL} to {wheels}, or set "
                                          "WILDFED_YOLOX_WEIGHTS to the .pth file")
    return wheel


def _verify(path: Path) -> Path:
    digest = sha256_file(path)
    if digest != CHECKPOINT_SHA256:
        raise WeightsUnavailableError(f"{path} has SHA-256 {digest}, expected {CHECKPOINT_SHA256}",
                                      field="detector weights",
                                      fix="delete the file so it is fetched again from the zamba 2.7.2 wheel")
    return path


def detector_checkpoint(*, download: bool = True, timeout_s: float = 600.0) -> Path:
    """Path of the verified YOLOX-tiny checkpoint, fetching it on first use (see the module docstring).

    Args:
        download: allow the one-time ``pip download``; when False and nothing is cached, raise.
        timeout_s: limit of the download.

    Raises:
        WeightsUnavailableError: download failed, the wheel lacks the file, or the hash differs.
    """
    override = os.environ.get("WILDFED_YOLOX_WEIGHTS")
    if override:
        return _verify(Path(override).expanduser())
    root = cache_dir()
    target = root / "detector" / Path(CHECKPOINT_MEMBER).name
    if target.is_file():
        return _verify(target)
    wheel = root / "wheels" / ZAMBA_WHEEL
    if not wheel.is_file():
        if not download:
            raise WeightsUnavailableError(f"no detector checkpoint in {target.parent} and downloads are off",
                                          field="detector weights",
                                          fix="run once with network access, or set WILDFED_YOLOX_WEIGHTS")
        wheel = _download_wheel(root / "wheels", timeout_s)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(CHECKPOINT_MEMBER) as src, \
                tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as dst:
            shutil.copyfileobj(src, dst)
            tmp = Path(dst.name)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise WeightsUnavailableError(f"{wheel} does not hold {CHECKPOINT_MEMBER}: {exc}", field="detector weights",
                                      fix=f"delete {wheel} so it is downloaded again") from exc
    try:
        _verify(tmp)
    except WeightsUnavailableError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    log.info("detector weights: %s (sha256 %s)", target, CHECKPOINT_SHA256[:12])
    return target
