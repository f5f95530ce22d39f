"""Radio-map sets for RadioUNet: model inputs, normalised gain targets, safetensors files and a keyed cache.

A map is one (building tile, transmitter pixel) pair. Its input has two channels, as RadioUNet's
(Levie et al. 2021, Sec. III: building map and transmitter location): channel :data:`BUILDING_CHANNEL` is 1 inside
buildings, channel :data:`TRANSMITTER_CHANNEL` is 1 at the transmitter pixel. Its target is the normalised gain of
:func:`shared.radio.pathloss.normalise_gain`.

File format (``RadioMapSet.save``): safetensors (never pickle) with tensors ``inputs`` float32 (N, 2, H, W),
``targets`` float32 (N, 1, H, W), ``transmitters`` int64 (N, 2), ``tiles`` int64 (N,), and metadata
``format = "wildfed.radiomap/1"``, ``metres_per_pixel`` (a decimal string); :func:`cached_maps` adds
``cache_key`` (canonical JSON). Readers reject other formats; new metadata keys may be added, existing ones keep
their meaning.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from shared.errors import ConfigError, DatasetError
from shared.radio.city import outdoor_position, procedural_city
from shared.radio.pathloss import PathLossModel, normalise_gain, path_loss_db

__all__ = [
    "site_maps",
    "BUILDING_CHANNEL",
    "TRANSMITTER_CHANNEL",
    "FILE_FORMAT",
    "RadioMapGeometry",
    "RadioMapSet",
    "model_inputs",
    "city_tiles",
    "transmitter_specs",
    "generate_maps",
    "cached_maps",
]

BUILDING_CHANNEL = 0
TRANSMITTER_CHANNEL = 1
FILE_FORMAT = "wildfed.radiomap/1"
_TENSORS = ("inputs", "targets", "transmitters", "tiles")


@dataclass(frozen=True)
class RadioMapGeometry:
    """Raster of every map: ``size_px`` x ``size_px`` pixels at ``metres_per_pixel``.

    The default, 64 x 64 px at 4 m/px = 256 m x 256 m, is the area of a RadioMapSeer tile (256 x 256 px at 1 m,
    Levie et al. 2021) at a quarter of its resolution, chosen so that 700 training maps train a RadioUNet on two
    CPU cores.

    Raises:
        ConfigError (a ValueError): ``size_px`` not an int >= 8, or ``metres_per_pixel`` not > 0.
    """

    size_px: int = 64
    metres_per_pixel: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.size_px, (int, np.integer)) or isinstance(self.size_px, bool) or self.size_px < 8:
            raise ConfigError(f"must be an int >= 8, got {self.size_px!r}", field="size_px", fix="use e.g. 64")
        if (not isinstance(self.metres_per_pixel, (int, float)) or isinstance(self.metres_per_pixel, bool)
                or not math.isfinite(self.metres_per_pixel) or self.metres_per_pixel <= 0):
            raise ConfigError(f"must be a number > 0, got {self.metres_per_pixel!r}", field="metres_per_pixel",
                              fix="use the raster spacing in metres, e.g. 4.0")

    @property
    def side_m(self) -> float:
        """Tile side in metres (256.0 for the default)."""
        return self.size_px * float(self.metres_per_pixel)


def model_inputs(buildings: np.ndarray, tx: tuple[int, int]) -> np.ndarray:
    """RadioUNet input of one map: float32 (2, H, W), building mask and transmitter one-hot.

    Args:
        buildings: bool (H, W), True inside buildings.
        tx: transmitter pixel ``(row, col)`` inside the raster.

    Returns:
        float32 (2, H, W): channel :data:`BUILDING_CHANNEL` 1.0 inside buildings, else 0.0; channel
        :data:`TRANSMITTER_CHANNEL` 1.0 at ``tx``, else 0.0.

    Raises:
        ConfigError (a ValueError): ``buildings`` not 2-D bool (field ``buildings``) or ``tx`` not a pixel of it
            (field ``tx``).
    """
    if not isinstance(buildings, np.ndarray) or buildings.dtype != np.bool_ or buildings.ndim != 2:
        raise ConfigError("must be a 2-D bool numpy array (True inside buildings)", field="buildings",
                          fix="pass mask.astype(bool) of shape (H, W)")
    height, width = buildings.shape
    if (not isinstance(tx, (tuple, list, np.ndarray)) or len(tx) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in tx)
            or not (0 <= tx[0] < height and 0 <= tx[1] < width)):
        raise ConfigError(f"must be (row, col) integers inside the {height} x {width} raster, got {tx!r}",
                          field="tx", fix="give the transmitter pixel as (row, col)")
    out = np.zeros((2, height, width), dtype=np.float32)
    out[BUILDING_CHANNEL] = buildings
    out[TRANSMITTER_CHANNEL, int(tx[0]), int(tx[1])] = 1.0
    return out


@dataclass(frozen=True, eq=False)
class RadioMapSet:
    """N radio maps: inputs, normalised gain targets, transmitter pixels and tile indices.

    Attributes:
        inputs: float32 (N, 2, H, W), see :func:`model_inputs`.
        targets: float32 (N, 1, H, W), normalised gain in [0, 1] (:func:`~shared.radio.pathloss.normalise_gain`).
        transmitters: int64 (N, 2), transmitter ``(row, col)`` of each map.
        tiles: int64 (N,), index of each map's building tile (maps with equal index share buildings).
        metres_per_pixel: raster spacing in metres.

    Raises:
        ConfigError (a ValueError): a wrong dtype, shape, length or value; the message names the field.
    """

    inputs: np.ndarray
    targets: np.ndarray
    transmitters: np.ndarray
    tiles: np.ndarray
    metres_per_pixel: float

    def __post_init__(self) -> None:
        expect = {"inputs": (np.float32, 4), "targets": (np.float32, 4), "transmitters": (np.int64, 2),
                  "tiles": (np.int64, 1)}
        for name, (dtype, ndim) in expect.items():
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim:
                got = (f"{value.dtype} with {value.ndim} dims" if isinstance(value, np.ndarray)
                       else type(value).__name__)
                raise ConfigError(f"must be a {np.dtype(dtype).name} array with {ndim} dims, got {got}",
                                  field=name, fix=f"convert with .astype(numpy.{np.dtype(dtype).name})")
        n, channels, height, width = self.inputs.shape
        if channels != 2:
            raise ConfigError(f"must have 2 channels (buildings, transmitter), got {channels}", field="inputs",
                              fix="build inputs with model_inputs")
        for name, shape in (("targets", (n, 1, height, width)), ("transmitters", (n, 2)), ("tiles", (n,))):
            if getattr(self, name).shape != shape:
                raise ConfigError(f"must have shape {shape} to match inputs, got {getattr(self, name).shape}",
                                  field=name, fix="give one entry per map")
        if not np.all(np.isfinite(self.inputs)) or not np.all(np.isfinite(self.targets)):
            raise ConfigError("must be finite", field="inputs/targets", fix="regenerate the maps")
        if (not isinstance(self.metres_per_pixel, (int, float)) or isinstance(self.metres_per_pixel, bool)
                or not math.isfinite(self.metres_per_pixel) or self.metres_per_pixel <= 0):
            raise ConfigError(f"must be a number > 0, got {self.metres_per_pixel!r}", field="metres_per_pixel",
                              fix="use the raster spacing in metres, e.g. 4.0")

    def __len__(self) -> int:
        """Number of maps N."""
        return int(self.inputs.shape[0])

    def subset(self, indices: Sequence[int] | np.ndarray) -> RadioMapSet:
        """The maps at ``indices`` (int array or sequence, in that order; copies), same ``metres_per_pixel``.

        Raises:
            ConfigError (a ValueError): ``indices`` not a 1-D integer array of indices in ``[-N, N)``.
        """
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ConfigError("must be a 1-D sequence of integers", field="indices", fix="pass e.g. numpy.arange(k)")
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise ConfigError(f"out of range for {len(self)} maps", field="indices", fix="use 0 <= i < len(set)")
        return RadioMapSet(inputs=self.inputs[idx], targets=self.targets[idx],
                           transmitters=self.transmitters[idx], tiles=self.tiles[idx],
                           metres_per_pixel=self.metres_per_pixel)

    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None) -> None:
        """Write the set to ``path`` as safetensors (format in the module docstring); overwrites ``path``.

        Args:
            path: file to write.
            metadata: extra str -> str header entries (must not use ``format`` or ``metres_per_pixel``).

        Raises:
            ConfigError (a ValueError): ``metadata`` not str -> str or using a reserved key.
            OSError: the file cannot be written.
        """
        extra = dict(metadata or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise ConfigError("must map str to str", field="metadata", fix="convert keys and values to str")
        reserved = {"format", "metres_per_pixel"} & extra.keys()
        if reserved:
            raise ConfigError(f"uses reserved keys {sorted(reserved)}", field="metadata", fix="rename them")
        header = {**extra, "format": FILE_FORMAT, "metres_per_pixel": repr(float(self.metres_per_pixel))}
        tensors = {name: np.ascontiguousarray(getattr(self, name)) for name in _TENSORS}
        save_file(tensors, os.fspath(path), metadata=header)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RadioMapSet:
        """Read a set written by :meth:`save`.

        Raises:
            DatasetError (a ConfigError, hence ValueError): the file is missing, truncated or not safetensors, is
                not a ``wildfed.radiomap/1`` file, or holds tensors of the wrong names, dtypes or shapes; the
                message names the file.
        """
        tensors, header = _read(path)
        missing = [name for name in _TENSORS if name not in tensors]
        if missing:
            raise DatasetError(f"missing tensors {missing}", source=path, field="tensors",
                               fix="write the file with RadioMapSet.save")
        try:
            metres = float(header["metres_per_pixel"])
            return cls(**{name: tensors[name] for name in _TENSORS}, metres_per_pixel=metres)
        except (KeyError, ValueError) as exc:
            raise DatasetError(f"not a valid radio-map set: {exc}", source=path,
                               fix="regenerate the file with RadioMapSet.save") from exc


def _read_header(path: str | os.PathLike[str]) -> dict[str, str]:
    """Metadata of a radio-map file, without loading tensors. Raises DatasetError (unreadable or wrong format)."""
    try:
        with safe_open(os.fspath(path), framework="numpy") as handle:
            header = dict(handle.metadata() or {})
    except (OSError, SafetensorError, ValueError) as exc:
        raise DatasetError(f"cannot read a safetensors file: {exc}", source=path,
                           fix="check the path, or delete the file and regenerate it") from exc
    if header.get("format") != FILE_FORMAT:
        raise DatasetError(f"format is {header.get('format')!r}, expected {FILE_FORMAT!r}", source=path,
                           field="format", fix="pass a file written by RadioMapSet.save")
    return header


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    header = _read_header(path)
    try:
        tensors = load_file(os.fspath(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise DatasetError(f"cannot read tensors: {exc}", source=path,
                           fix="delete the file and regenerate it") from exc
    return tensors, header


def city_tiles(rng: np.random.Generator, count: int, *, geometry: RadioMapGeometry = RadioMapGeometry(),
               **city_options: object) -> np.ndarray:
    """``count`` procedural city tiles (:func:`shared.radio.city.procedural_city`) drawn in turn from ``rng``.

    Args:
        rng: the source of randomness (same state, same tiles).
        count: number of tiles, >= 1.
        geometry: tile size and spacing.
        **city_options: passed to :func:`~shared.radio.city.procedural_city` (e.g. ``coverage``).

    Returns:
        bool (count, size_px, size_px), True inside buildings.

    Raises:
        ConfigError (a ValueError): ``count`` not an int >= 1, or a bad city option.
    """
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"must be an int >= 1, got {count!r}", field="count", fix="ask for at least one tile")
    return np.stack([procedural_city(rng, size_px=geometry.size_px, metres_per_pixel=geometry.metres_per_pixel,
                                     **city_options) for _ in range(int(count))])


def transmitter_specs(tiles: np.ndarray, maps_per_tile: int, rng: np.random.Generator) -> np.ndarray:
    """Map specs with ``maps_per_tile`` uniformly random outdoor transmitters on every tile.

    Args:
        tiles: bool (T, H, W), True inside buildings.
        maps_per_tile: transmitters per tile, >= 1 (drawn independently; repeats are possible).
        rng: the source of randomness.

    Returns:
        int64 (T * maps_per_tile, 3) rows ``(tile, row, col)``, grouped by tile.

    Raises:
        ConfigError (a ValueError): ``tiles`` not 3-D bool, ``maps_per_tile`` < 1, or a tile without outdoor pixels.
    """
    _check_tiles(tiles)
    if not isinstance(maps_per_tile, (int, np.integer)) or isinstance(maps_per_tile, bool) or maps_per_tile < 1:
        raise ConfigError(f"must be an int >= 1, got {maps_per_tile!r}", field="maps_per_tile",
                          fix="ask for at least one map per tile")
    specs = np.empty((tiles.shape[0] * int(maps_per_tile), 3), dtype=np.int64)
    width = tiles.shape[2]
    for index, tile in enumerate(tiles):
        outdoor = np.flatnonzero(~tile)
        if outdoor.size == 0:
            raise ConfigError(f"tile {index} has no outdoor pixel", field="tiles", fix="use another tile")
        chosen = outdoor[rng.integers(outdoor.size, size=int(maps_per_tile))]
        block = specs[index * maps_per_tile:(index + 1) * maps_per_tile]
        block[:, 0] = index
        block[:, 1], block[:, 2] = np.divmod(chosen, width)
    return specs


def site_maps(tiles: np.ndarray, tile_index: int, n_maps: int, *, radius_m: float, rng: np.random.Generator,
              model: PathLossModel, geometry: RadioMapGeometry = RadioMapGeometry(),
              centre: np.ndarray | None = None) -> tuple[RadioMapSet, np.ndarray]:
    """One base-station site on ``tiles[tile_index]``: a uniformly random outdoor centre (the first draw from
    ``rng``; or ``centre``, (row, col) pixels of an outdoor pixel, when given: an attacker's candidate) and
    ``n_maps`` maps whose transmitters are uniformly random outdoor pixels within ``radius_m`` of it
    (the site's antennas and small cells; docs/radiomap.md).

    Returns:
        (the maps, the centre as float64 (2,) (row, col) in pixels).

    Raises:
        ConfigError: as :func:`shared.radio.city.outdoor_position` and :func:`generate_maps`.
    """
    tile = np.asarray(tiles)[tile_index]
    centre = np.asarray(outdoor_position(tile, rng) if centre is None else centre, dtype=np.float64)
    radius_px = radius_m / geometry.metres_per_pixel
    specs = np.asarray([(tile_index, *outdoor_position(tile, rng, centre=(centre[0], centre[1]),
                                                       radius_px=radius_px)) for _ in range(n_maps)], dtype=np.int64)
    return generate_maps(tiles, specs, model=model, geometry=geometry), centre


def _check_tiles(tiles: object) -> np.ndarray:
    if not isinstance(tiles, np.ndarray) or tiles.dtype != np.bool_ or tiles.ndim != 3 or tiles.shape[0] < 1:
        raise ConfigError("must be a non-empty 3-D bool numpy array (T, H, W), True inside buildings",
                          field="tiles", fix="stack procedural_city tiles, e.g. city_tiles(...)")
    return tiles


def generate_maps(tiles: np.ndarray, specs: np.ndarray, *, model: PathLossModel,
                  geometry: RadioMapGeometry = RadioMapGeometry(),
                  progress: Callable[[int, int], object] | None = None) -> RadioMapSet:
    """Compute the radio maps of ``specs`` on ``tiles`` (free space + COST 231 multi-wall, normalised gain).

    Args:
        tiles: bool (T, H, W) building tiles with ``H == W == geometry.size_px``.
        specs: integer (N, 3) rows ``(tile, row, col)``: tile index and outdoor transmitter pixel.
        model: the path loss model and normalisation window.
        geometry: raster size and metres per pixel.
        progress: optional ``progress(done, total)`` called after each map.

    Returns:
        a :class:`RadioMapSet` of N maps, in the order of ``specs``.

    Raises:
        ConfigError (a ValueError): ``tiles`` not 3-D bool of the geometry's size (field ``tiles``), ``specs`` not an
            integer (N, 3) array with N >= 1 (field ``specs``), a tile index out of range (field ``specs``), or a
            transmitter outside the raster or inside a building (field ``tx``, the message gives the map index).
    """
    _check_tiles(tiles)
    if not isinstance(geometry, RadioMapGeometry):
        raise ConfigError(f"must be a RadioMapGeometry, got {type(geometry).__name__}", field="geometry",
                          fix="pass geometry=RadioMapGeometry()")
    if tiles.shape[1:] != (geometry.size_px, geometry.size_px):
        raise ConfigError(f"tiles are {tiles.shape[1]} x {tiles.shape[2]}, geometry says {geometry.size_px}",
                          field="tiles", fix="make the tiles with the same geometry")
    specs = np.asarray(specs)
    if specs.ndim != 2 or specs.shape[1] != 3 or specs.shape[0] < 1 or not np.issubdtype(specs.dtype, np.integer):
        raise ConfigError(f"must be an integer (N, 3) array of (tile, row, col), got {specs.dtype} {specs.shape}",
                          field="specs", fix="build it with transmitter_specs(...)")
    specs = specs.astype(np.int64)
    if specs[:, 0].min() < 0 or specs[:, 0].max() >= tiles.shape[0]:
        raise ConfigError(f"tile index out of range for {tiles.shape[0]} tiles", field="specs",
                          fix="use 0 <= tile < len(tiles)")
    n, side = specs.shape[0], geometry.size_px
    inputs = np.empty((n, 2, side, side), dtype=np.float32)
    targets = np.empty((n, 1, side, side), dtype=np.float32)
    for i, (tile_index, row, col) in enumerate(specs.tolist()):
        buildings = tiles[tile_index]
        try:
            loss = path_loss_db(buildings, (row, col), model=model, metres_per_pixel=geometry.metres_per_pixel)
        except ConfigError as exc:
            raise ConfigError(f"map {i}: {exc.message}", field=exc.field, fix=exc.fix) from exc
        targets[i, 0] = normalise_gain(loss, buildings, model)
        inputs[i] = model_inputs(buildings, (row, col))
        if progress is not None:
            progress(i + 1, n)
    return RadioMapSet(inputs=inputs, targets=targets, transmitters=specs[:, 1:].copy(), tiles=specs[:, 0].copy(),
                       metres_per_pixel=float(geometry.metres_per_pixel))


def _canonical_key(key: object) -> str:
    if not isinstance(key, Mapping):
        raise ConfigError(f"must be a dict, got {type(key).__name__}", field="key",
                          fix="describe the data (seed, counts, model fields) in a JSON-able dict")
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"is not JSON-serialisable: {exc}", field="key",
                          fix="use str, int, float, bool, None, lists and dicts only") from exc


def cached_maps(cache_file: str | os.PathLike[str], build: Callable[[], RadioMapSet], *,
                key: Mapping[str, object]) -> RadioMapSet:
    """Load ``cache_file`` if its stored key equals ``key``; otherwise ``build()`` and write it atomically.

    The key is stored as canonical JSON (sorted keys) in the file's ``cache_key`` metadata and compared after a
    JSON round trip, so tuples and lists compare equal. A missing, unreadable or foreign file, or one with another
    key, is rebuilt and replaced: the set is written to a temporary file beside ``cache_file`` and moved over it
    with ``os.replace``, so readers never see a half-written cache. Parent directories are created.

    Args:
        cache_file: path of the cache (safetensors, :meth:`RadioMapSet.save` format).
        build: makes the set when the cache cannot be used.
        key: JSON-serialisable dict of everything the maps depend on (seeds, counts, geometry, model).

    Returns:
        the cached or freshly built :class:`RadioMapSet`.

    Raises:
        ConfigError (a ValueError): ``key`` not a JSON-serialisable dict (field ``key``), or ``build`` returned
            something other than a :class:`RadioMapSet` (field ``build``).
        OSError: the cache cannot be written.
    """
    path = Path(cache_file)
    wanted = _canonical_key(key)
    if path.is_file():
        try:
            stored = _read_header(path).get("cache_key")
            if stored is not None and json.loads(stored) == json.loads(wanted):
                return RadioMapSet.load(path)
        except (DatasetError, json.JSONDecodeError):
            pass  # unreadable or foreign: rebuild below
    maps = build()
    if not isinstance(maps, RadioMapSet):
        raise ConfigError(f"returned {type(maps).__name__}, expected RadioMapSet", field="build",
                          fix="make build() return generate_maps(...)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        maps.save(tmp, metadata={"cache_key": wanted})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return maps
