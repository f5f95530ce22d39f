"""One traced tile of a Sionna set: its transmitter pixels, the key it depends on, its file name, and the npz it is
stored in (:class:`TracedTile`, :func:`write_tile`, :func:`read_tile`; "Files" in :mod:`shared.radio.sionna_maps`)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ConfigError, DatasetError
from shared.radio.scenes import SceneTile
from shared.radio.sionna_maps.settings import SionnaSettings


def bank_positions(tile: SceneTile, settings: SionnaSettings) -> np.ndarray:
    """Transmitter pixels of a tile: outdoor pixels on the grid of step ``s = tx_step_px``, offset ``s // 2``.

    With ``tx_per_tile = k`` set and more than k grid positions, k of them, drawn without replacement from
    ``numpy.random.default_rng([seed, tile.row, tile.col])``, in row-major order.

    Args:
        tile: a :class:`shared.radio.scenes.SceneTile`.
        settings: gives ``tx_step_px``, ``tx_per_tile`` and ``seed``.

    Returns:
        int64 (n, 2) ``(row, col)`` tile pixels, row-major, all outdoors; n >= 1.

    Raises:
        ConfigError (field ``tx_step_px``): no outdoor pixel lies on the grid.
    """
    step = int(settings.tx_step_px)
    size = tile.buildings.shape[0]
    rows, cols = np.meshgrid(np.arange(step // 2, size, step), np.arange(step // 2, size, step), indexing="ij")
    pts = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.int64)
    pts = pts[~tile.buildings[pts[:, 0], pts[:, 1]]]
    if len(pts) == 0:
        raise ConfigError(f"no outdoor pixel of {tile.tile_id} lies on a grid of step {step}", field="tx_step_px",
                          fix="use a smaller tx_step_px")
    if settings.tx_per_tile is not None and settings.tx_per_tile < len(pts):
        rng = np.random.default_rng([settings.seed, tile.row, tile.col])
        pts = pts[np.sort(rng.choice(len(pts), size=settings.tx_per_tile, replace=False))]
    return pts


def installed_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (e.g. ``"sionna-rt"``); None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tile_key(tile: SceneTile, settings: SionnaSettings) -> dict[str, object]:
    """Everything a traced tile depends on: the tile (scene, grid position, size, spacing, a SHA-256 of its
    buildings), every :class:`SionnaSettings` field and the sionna-rt version. JSON-able ``dict``."""
    return {"scene": tile.scene, "row": tile.row, "col": tile.col, "size_px": tile.size_px,
            "metres_per_pixel": tile.metres_per_pixel,
            "buildings_sha256": hashlib.sha256(np.packbits(tile.buildings).tobytes()).hexdigest(),
            "settings": dataclasses.asdict(settings), "sionna_rt": installed_version("sionna-rt")}


def _canonical(key: dict[str, object]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)


def tile_file(out_dir: str | os.PathLike[str], tile: SceneTile, settings: SionnaSettings) -> Path:
    """``<out_dir>/<scene>/<scene>-r<row>c<col>-<first 12 hex digits of SHA-256(canonical key)>.npz``."""
    digest = hashlib.sha256(_canonical(tile_key(tile, settings)).encode()).hexdigest()[:12]
    return Path(out_dir) / tile.scene / f"{tile.scene}-r{tile.row:03d}c{tile.col:03d}-{digest}.npz"


@dataclass(frozen=True, eq=False)
class TracedTile:
    """One tile's ray-traced maps (:mod:`shared.radio.sionna_maps`, "Files").

    Attributes:
        key: :func:`tile_key` of the tile and settings.
        buildings: bool (H, W), True inside buildings.
        transmitters: int64 (n, 2) transmitter pixels ``(row, col)``.
        path_gain: float32 (n, H, W), linear path gain (unitless, 0 where no ray arrived), row 0 north.
        samples_per_tx: int64 (n,), the rays per transmitter of the trace that was kept.
        coverage: float64 (n,), fraction of the outdoor pixels with a value.
        elapsed_s: seconds the tile took to trace (all tries).
    """

    key: dict[str, object]
    buildings: np.ndarray
    transmitters: np.ndarray
    path_gain: np.ndarray
    samples_per_tx: np.ndarray
    coverage: np.ndarray
    elapsed_s: float

    @property
    def tile_id(self) -> str:
        """``"<scene>/r<row>c<col>"``, as :attr:`shared.radio.scenes.SceneTile.tile_id`."""
        return f"{self.key['scene']}/r{int(self.key['row']):03d}c{int(self.key['col']):03d}"

    def gain_db(self) -> np.ndarray:
        """float32 (n, H, W) path gain in dB, ``10 log10(path_gain)``; -inf where no ray arrived."""
        with np.errstate(divide="ignore"):
            return (10.0 * np.log10(self.path_gain.astype(np.float64))).astype(np.float32)


def write_tile(path: str | os.PathLike[str], traced: TracedTile) -> None:
    """Write ``traced`` as npz (no pickles) to ``path``, atomically (a temporary file beside it, then
    ``os.replace``); parent folders are created.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(tmp, key=np.array(_canonical(traced.key)), buildings=traced.buildings,
                            transmitters=traced.transmitters.astype(np.int64),
                            path_gain=traced.path_gain.astype(np.float32),
                            samples_per_tx=traced.samples_per_tx.astype(np.int64),
                            coverage=traced.coverage.astype(np.float64), elapsed_s=np.float64(traced.elapsed_s))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_tile(path: str | os.PathLike[str], *, key: dict[str, object] | None = None) -> TracedTile:
    """Read a file of :func:`write_tile`; with ``key``, check that the file was traced with exactly it.

    Raises:
        DatasetError (a ConfigError, source = the file): missing, unreadable or malformed file (wrong arrays,
            dtypes or shapes, a gain that is negative or not finite), or a stored key other than ``key``.
    """
    path = Path(path)
    fix = "delete the file and run `wildfed radio-data sionna` again"
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # missing, truncated or not an npz
        raise DatasetError(f"cannot read a traced tile: {exc}", source=path, fix=fix) from exc
    names = ("key", "buildings", "transmitters", "path_gain", "samples_per_tx", "coverage", "elapsed_s")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DatasetError(f"missing arrays {missing}", source=path, field="arrays", fix=fix)
    try:
        stored = json.loads(str(arrays["key"]))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"key is not JSON: {exc}", source=path, field="key", fix=fix) from exc
    if key is not None and stored != json.loads(_canonical(key)):
        raise DatasetError("was traced with other settings or another tile than asked for", source=path,
                           field="key", fix=fix)
    buildings, tx, gain = arrays["buildings"], arrays["transmitters"], arrays["path_gain"]
    n = tx.shape[0] if tx.ndim == 2 else -1
    if (buildings.dtype != np.bool_ or buildings.ndim != 2 or tx.dtype != np.int64 or tx.ndim != 2
            or tx.shape[1] != 2 or gain.dtype != np.float32 or gain.shape != (n, *buildings.shape)
            or arrays["samples_per_tx"].shape != (n,) or arrays["coverage"].shape != (n,)):
        raise DatasetError("arrays have the wrong dtypes or shapes", source=path, field="arrays", fix=fix)
    if not np.all(np.isfinite(gain)) or float(gain.min(initial=0.0)) < 0:
        raise DatasetError("path_gain must be finite and >= 0", source=path, field="path_gain", fix=fix)
    if n and ((tx < 0).any() or (tx >= buildings.shape[0]).any() or buildings[tx[:, 0], tx[:, 1]].any()):
        raise DatasetError("a transmitter lies outside the tile or in a building", source=path,
                           field="transmitters", fix=fix)
    return TracedTile(stored, buildings, tx, gain, arrays["samples_per_tx"].astype(np.int64),
                      arrays["coverage"].astype(np.float64), float(arrays["elapsed_s"]))
