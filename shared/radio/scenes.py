"""Real city footprints: building rasters cut from the OpenStreetMap city scenes that ``sionna-rt`` ships.

``sionna-rt`` (NVIDIA, Apache-2.0 code) bundles four city scenes under ``sionna/rt/scenes/``: ``munich``,
``florence``, ``san_francisco`` and ``etoile`` (Paris). Each is a Mitsuba 3 XML file whose ``<shape type="ply">``
elements reference binary little-endian PLY meshes, one per building part and ITU radio material. The scene data
were made from OpenStreetMap with Blender-OSM and are licensed under the ODbL (attribution: "© OpenStreetMap
contributors"), as stated in ``sionna/rt/scene.py`` of the wheel.

This module only *reads those data files*; it never imports ``sionna`` (whose ``__init__`` imports Mitsuba and
Dr.Jit). Install the files alone with ``pip install --no-deps sionna-rt==2.2.0`` (pure-Python wheel, 8.5 MB).

Rules (checked on the four scenes of sionna-rt 2.2.0):

- **Up axis: z.** Wall meshes have z extents of metres to about 100 m (median 11-18 m per scene) and start at
  ``z = 0`` (san_francisco: on its hilly terrain, up to z = 104 m); x and y span 0.75-1.5 km (units are metres).
- **Ground.** Each scene has one ground mesh: ``mesh-ground`` (munich, florence; a flat 2-triangle sheet at
  z = 0), ``mesh-Plane`` (etoile, likewise) and ``mesh-Terrain`` (san_francisco, 192,000 triangles, z 0-104 m,
  BSDF ``mat-terrain``). A mesh is ground, and skipped, if its id, file name or BSDF id contains ``ground``,
  ``plane`` or ``terrain`` (case-insensitive), or if it lies entirely below :data:`GROUND_MAX_HEIGHT_M` (1 m)
  with a z extent under 1 m (an unnamed flat sheet on z = 0). A z-extent rule alone would be wrong: roofs are
  separate *flat* meshes (``*-roof``, ``*-itu_metal``) at the building's height, and they carry the footprint.
- **Rasterisation.** Every triangle of every building mesh is projected onto the xy plane; a pixel is building
  if its centre lies inside (or on the edge of) a projected triangle. Walls project to zero-area triangles and
  are dropped; roofs (and floors) fill the footprint.
- **Raster frame.** Row 0 is north (largest y), column 0 is west (smallest x); pixel ``(r, c)`` has its centre at
  ``x = x0 + (c + 0.5) * m``, ``y = y0 - (r + 0.5) * m`` where ``(x0, y0)`` is the returned ``origin_xy_m`` (the
  north-west corner of the raster) and ``m`` the spacing. The raster covers the buildings' xy bounding box.
- **Two ways to cut tiles.** :func:`scene_tiles` draws random crops (they may overlap). :func:`scene_grid` cuts the
  raster into a fixed grid of *disjoint* tiles (no pixel in two tiles), the same every time, so that data splits
  (clients, held-out validation, public tiles) can be disjoint and a ray-traced tile can be cached under its name.

Where the code is: the scene files in :mod:`shared.radio.scene_files` (XML, meshes, ground) and
:mod:`shared.radio.ply` (PLY reader), rasterisation in :mod:`shared.radio.rasterise`; this module makes the
footprint raster and cuts it into tiles, and exports all of them as before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError
from shared.radio.city import _check_generator
from shared.radio.dataset import RadioMapGeometry
from shared.radio.ply import read_ply
from shared.radio.rasterise import rasterise_triangles
from shared.radio.scene_files import _INSTALL_FIX, GROUND_MAX_HEIGHT_M, SCENES, SceneMesh, scene_meshes, scene_path

__all__ = [
    "SCENES",
    "GROUND_MAX_HEIGHT_M",
    "SceneMesh",
    "scene_path",
    "read_ply",
    "scene_meshes",
    "rasterise_triangles",
    "footprint_raster",
    "scene_tiles",
    "SceneTile",
    "scene_grid",
]


@functools.lru_cache(maxsize=8)
def _footprint(scene: str, metres_per_pixel: float) -> tuple[np.ndarray, tuple[float, float]]:
    buildings = [mesh for mesh in scene_meshes(scene) if not mesh.is_ground and len(mesh.faces)]
    if not buildings:
        raise ConfigError(f"scene {scene!r} has no building meshes", field="city", fix=_INSTALL_FIX)
    triangles = np.concatenate([mesh.vertices[mesh.faces][:, :, :2] for mesh in buildings])
    x_min, y_min = triangles.reshape(-1, 2).min(axis=0)
    x_max, y_max = triangles.reshape(-1, 2).max(axis=0)
    cols = max(1, int(math.ceil((x_max - x_min) / metres_per_pixel)))
    rows = max(1, int(math.ceil((y_max - y_min) / metres_per_pixel)))
    origin = (float(x_min), float(y_max))
    raster = rasterise_triangles(triangles, origin, (rows, cols), metres_per_pixel=metres_per_pixel)
    raster.setflags(write=False)
    return raster, origin


def footprint_raster(scene: str, *, metres_per_pixel: float = 4.0) -> tuple[np.ndarray, tuple[float, float]]:
    """Building footprint of a whole sionna-rt city scene as a bool raster.

    Every triangle of every non-ground mesh (:func:`scene_meshes`) is projected onto the xy plane and rasterised
    by :func:`rasterise_triangles` (a pixel is building if its centre is inside a projected triangle).

    Args:
        scene: one of :data:`SCENES`.
        metres_per_pixel: raster spacing in metres, > 0.

    Returns:
        ``(raster, origin_xy_m)``: bool (rows, cols), True inside buildings, row 0 north and column 0 west,
        covering the buildings' xy bounding box; and ``(x0, y0)``, the raster's north-west corner in scene
        metres. The raster is a fresh, writable copy (an in-memory cache of up to 8 rasters backs it; nothing is
        written to disk).

    Raises:
        ConfigError (a ValueError): unknown or missing scene (field ``city``), malformed scene files, or
            ``metres_per_pixel`` not > 0 (field ``metres_per_pixel``).

    Source: meshes of sionna-rt 2.2.0 (OpenStreetMap data, ODbL, via Blender-OSM).
    """
    if (not isinstance(metres_per_pixel, (int, float)) or isinstance(metres_per_pixel, bool)
            or not math.isfinite(metres_per_pixel) or metres_per_pixel <= 0):
        raise ConfigError(f"must be a number > 0, got {metres_per_pixel!r}", field="metres_per_pixel",
                          fix="use the raster spacing in metres, e.g. 4.0")
    raster, origin = _footprint(scene_path(scene).parent.name, float(metres_per_pixel))
    return raster.copy(), origin


def scene_tiles(scene: str, count: int, rng: np.random.Generator, *,
                geometry: RadioMapGeometry = RadioMapGeometry(),
                coverage: tuple[float, float] = (0.15, 0.6), max_tries: int | None = None) -> np.ndarray:
    """``count`` random building tiles (geometry.side_m square crops) of a real city's footprint raster.

    Each try draws a top-left pixel uniformly from the positions where a full tile fits in the scene's
    :func:`footprint_raster` (at ``geometry.metres_per_pixel``), two integers from ``rng``; the crop is kept if
    its building coverage lies in ``coverage`` (inclusive) and it has at least one outdoor pixel. Tiles may
    overlap (the scenes are about 0.5-2 km across, room for a handful of disjoint 256 m tiles): keep tiles of
    one scene within one data split, or split by scene.

    Args:
        scene: one of :data:`SCENES`.
        count: number of tiles, >= 1.
        rng: the only source of randomness (same generator state, same tiles).
        geometry: tile size in pixels and spacing in metres (default 64 px at 4 m = 256 m).
        coverage: (min, max) accepted building fraction, 0 <= min <= max <= 1.
        max_tries: crops to draw before giving up; default ``200 * count``.

    Returns:
        bool (count, geometry.size_px, geometry.size_px), True inside buildings, row 0 north.

    Raises:
        ConfigError (a ValueError): unknown or missing scene (field ``city``), bad ``count``/``coverage``/``rng``,
            the scene smaller than one tile, or fewer than ``count`` acceptable crops in ``max_tries`` draws
            (field ``coverage``).

    Source: :func:`footprint_raster` of the sionna-rt scenes (OpenStreetMap data, ODbL).
    """
    rng = _check_generator(rng)
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"must be an int >= 1, got {count!r}", field="count", fix="ask for at least one tile")
    if (not isinstance(coverage, (tuple, list)) or len(coverage) != 2
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coverage)
            or not 0.0 <= coverage[0] <= coverage[1] <= 1.0):
        raise ConfigError(f"must be a (min, max) pair with 0 <= min <= max <= 1, got {coverage!r}",
                          field="coverage", fix="use e.g. (0.15, 0.6)")
    tries = 200 * int(count) if max_tries is None else max_tries
    if not isinstance(tries, int) or isinstance(tries, bool) or tries < 1:
        raise ConfigError(f"must be an int >= 1, got {max_tries!r}", field="max_tries", fix="use e.g. 1000")
    name = scene_path(scene).parent.name
    raster, _ = _footprint(name, float(geometry.metres_per_pixel))
    size = int(geometry.size_px)
    rows, cols = raster.shape
    table = _summed_area(raster, size, scene)  # coverage of every possible crop, exact integer counts
    total = size * size
    tiles = np.empty((int(count), size, size), dtype=bool)
    found = 0
    for _ in range(tries):
        r = int(rng.integers(0, rows - size + 1))
        c = int(rng.integers(0, cols - size + 1))
        built = int(table[r + size, c + size] - table[r, c + size] - table[r + size, c] + table[r, c])
        if built < total and coverage[0] <= built / total <= coverage[1]:
            tiles[found] = raster[r:r + size, c:c + size]
            found += 1
            if found == count:
                return tiles
    raise ConfigError(f"only {found} of {count} crops of {scene!r} had coverage in {tuple(coverage)} after "
                      f"{tries} draws", field="coverage", fix="ask for fewer tiles, widen coverage or use another scene")


@dataclass(frozen=True, eq=False)
class SceneTile:
    """One tile of :func:`scene_grid`: a ``size_px`` square crop of a scene's footprint raster.

    Attributes:
        scene: one of :data:`SCENES`.
        index: position in ``scene_grid(scene, ...)`` (row-major over the grid).
        row, col: top-left pixel of the crop in :func:`footprint_raster` ``(scene)`` (row 0 north).
        size_px: tile side in pixels.
        metres_per_pixel: raster spacing in metres.
        origin_xy_m: ``(x, y)`` of the tile's north-west corner in scene metres; pixel ``(r, c)`` of the tile has
            its centre at ``x + (c + 0.5) m``, ``y - (r + 0.5) m`` (m = ``metres_per_pixel``).
        buildings: bool (size_px, size_px), True inside buildings (read-only).
    """

    scene: str
    index: int
    row: int
    col: int
    size_px: int
    metres_per_pixel: float
    origin_xy_m: tuple[float, float]
    buildings: np.ndarray

    @property
    def tile_id(self) -> str:
        """A stable name, ``"<scene>/r<row>c<col>"`` with three-digit pixel offsets, e.g. ``"munich/r008c016"``
        (pixel offsets at the tile's own spacing; file names of cached ray-traced tiles use it)."""
        return f"{self.scene}/r{self.row:03d}c{self.col:03d}"

    @property
    def coverage(self) -> float:
        """Building fraction of the tile, in [0, 1]."""
        return float(self.buildings.mean())

    def pixel_centres_xy_m(self, pixels: np.ndarray) -> np.ndarray:
        """float64 (n, 2) scene ``(x, y)`` in metres of the centres of tile pixels ``pixels``, int (n, 2) (row, col)."""
        px = np.asarray(pixels, dtype=np.float64).reshape(-1, 2)
        m = float(self.metres_per_pixel)
        return np.stack([self.origin_xy_m[0] + (px[:, 1] + 0.5) * m, self.origin_xy_m[1] - (px[:, 0] + 0.5) * m],
                        axis=1)


def _summed_area(raster: np.ndarray, size: int, scene: str) -> np.ndarray:
    """int64 (rows + 1, cols + 1) summed-area table of a bool (rows, cols) footprint raster (Crow 1984): the built
    pixels of the crop with top-left (r, c) and side ``size`` are ``T[r+s, c+s] - T[r, c+s] - T[r+s, c] + T[r, c]``.

    Raises:
        ConfigError: the raster is smaller than one ``size`` px tile (field ``city``).
    """
    rows, cols = raster.shape
    if rows < size or cols < size:
        raise ConfigError(f"scene {scene!r} is {rows} x {cols} px, smaller than one {size} px tile", field="city",
                          fix="use a smaller tile or another scene")
    table = np.zeros((rows + 1, cols + 1), dtype=np.int64)
    table[1:, 1:] = raster.cumsum(axis=0).cumsum(axis=1)
    return table


@functools.lru_cache(maxsize=16)
def _grid(scene: str, size: int, metres_per_pixel: float, low: float, high: float) -> tuple[SceneTile, ...]:
    raster, origin = _footprint(scene, metres_per_pixel)
    table = _summed_area(raster, size, scene)
    total = size * size

    # ok[r, c]: the crop with top-left pixel (r, c) is acceptable (coverage from the summed-area table).
    built = table[size:, size:] - table[:-size, size:] - table[size:, :-size] + table[:-size, :-size]
    ok = (built < total) & (built >= low * total) & (built <= high * total)
    best_count, best_offset = -1, (0, 0)
    for dr in range(size):  # first offset (row-major) with the most accepted tiles
        for dc in range(size):
            count = int(ok[dr::size, dc::size].sum())
            if count > best_count:
                best_count, best_offset = count, (dr, dc)
    dr, dc = best_offset
    rr, cc = np.nonzero(ok[dr::size, dc::size])
    best = [(int(dr + a * size), int(dc + b * size)) for a, b in zip(rr, cc)]
    if not best:
        raise ConfigError(f"no {size} px tile of {scene!r} has building coverage in [{low}, {high}]",
                          field="coverage", fix="widen coverage or use another scene")
    m = float(metres_per_pixel)
    out = []
    for index, (r, c) in enumerate(best):
        buildings = raster[r:r + size, c:c + size].copy()
        buildings.setflags(write=False)
        out.append(SceneTile(scene, index, r, c, size, m, (origin[0] + c * m, origin[1] - r * m), buildings))
    return tuple(out)


def scene_grid(scene: str, *, geometry: RadioMapGeometry = RadioMapGeometry(),
               coverage: tuple[float, float] = (0.15, 0.6)) -> tuple[SceneTile, ...]:
    """The scene's footprint raster cut into a grid of disjoint ``geometry.size_px`` tiles (256 m by default).

    The grid's tiles sit at rows ``dr + k * size_px`` and columns ``dc + l * size_px`` of :func:`footprint_raster`
    (every tile wholly inside the raster), so no pixel lies in two tiles. A tile is kept if its building coverage
    lies in ``coverage`` (inclusive) and it has an outdoor pixel. The offset ``(dr, dc)`` in
    ``[0, size_px)^2`` is the first, in row-major order, that keeps the most tiles: a fixed function of the scene
    files, so the same tiles come back in every process (sionna-rt 2.2.0, 4 m/px, default coverage: munich 19
    tiles, florence 9, san_francisco 12, etoile 4).

    Args:
        scene: one of :data:`SCENES`.
        geometry: tile size in pixels and spacing in metres.
        coverage: (min, max) accepted building fraction, 0 <= min <= max <= 1.

    Returns:
        the tiles, row-major over the grid (``tiles[i].index == i``); their ``buildings`` are read-only.

    Raises:
        ConfigError (a ValueError): unknown or missing scene (field ``city``), a bad ``coverage`` (field
            ``coverage``), the scene smaller than one tile (field ``city``) or no tile within ``coverage``.

    Source: :func:`footprint_raster` of the sionna-rt scenes (OpenStreetMap data, ODbL).
    """
    if (not isinstance(coverage, (tuple, list)) or len(coverage) != 2
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coverage)
            or not 0.0 <= coverage[0] <= coverage[1] <= 1.0):
        raise ConfigError(f"must be a (min, max) pair with 0 <= min <= max <= 1, got {coverage!r}",
                          field="coverage", fix="use e.g. (0.15, 0.6)")
    if not isinstance(geometry, RadioMapGeometry):
        raise ConfigError(f"must be a RadioMapGeometry, got {type(geometry).__name__}", field="geometry",
                          fix="pass geometry=RadioMapGeometry()")
    name = scene_path(scene).parent.name
    return _grid(name, int(geometry.size_px), float(geometry.metres_per_pixel), float(coverage[0]),
                 float(coverage[1]))
