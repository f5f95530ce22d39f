"""Procedural city tiles: a street grid with rectangular buildings, as a bool raster (True inside buildings).

A tile is drawn in three steps, all from the injected ``numpy.random.Generator`` (same state, same tile):

1. **Street grid.** Along each axis the tile alternates blocks and streets: block lengths uniform in
   ``block_size_m``, street widths uniform in ``street_width_m`` (whole pixels, at least one), starting at a random
   phase so that border blocks are cut like a window onto a larger city. Streets run across the whole tile, so
   every street pixel is connected to every other (each row street meets each column street).
2. **Parcels.** A block is left open (a square or park) with probability ``park_probability``; otherwise it is
   split recursively, across its longer side at 30-70 % of its length, until no side exceeds
   ``max_building_m``; half of the cuts leave a one-pixel passage between the two parts.
3. **Buildings.** Each parcel gets a one-pixel setback from each side with probability ``setback_probability``
   (front gardens, yards), and parcels of at least ``courtyard_min_m`` on both sides get an inner courtyard (walls
   two or three pixels thick) with probability ``courtyard_probability``.

The defaults give a building coverage of about 30-45 % of the area, the range of the built-up fraction of central
European city-centre tiles (perimeter blocks with courtyards, streets of 8-20 m); a tile whose coverage falls
outside ``coverage`` is redrawn (from the same generator, so still deterministic). Courtyards are outdoor pixels
that are not connected to the streets; transmitters may be placed there too (a small cell in a courtyard).
"""

from __future__ import annotations

import math

import numpy as np

from shared.errors import ConfigError

__all__ = ["procedural_city", "outdoor_position", "building_coverage"]


def _check_range(value: object, field: str, *, low: float, fix: str) -> tuple[float, float]:
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok or not (low <= value[0] <= value[1]):
        raise ConfigError(f"must be a (min, max) pair with {low} <= min <= max, got {value!r}", field=field, fix=fix)
    return float(value[0]), float(value[1])


def _check_probability(value: object, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"must be a probability in [0, 1], got {value!r}", field=field,
                          fix="use a number between 0 and 1")
    return float(value)


def _check_generator(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(f"must be a numpy.random.Generator, got {type(rng).__name__}", field="rng",
                          fix="pass numpy.random.default_rng(seed)")
    return rng


def _blocks_along(rng: np.random.Generator, size: int, block_px: tuple[int, int],
                  street_px: tuple[int, int]) -> tuple[list[tuple[int, int]], int]:
    """Block intervals ``[start, stop)`` along one axis inside ``[0, size)``, and the number of street pixels."""
    position = -int(rng.integers(0, block_px[1] + 1))
    blocks: list[tuple[int, int]] = []
    street_pixels = 0
    while position < size:
        length = int(rng.integers(block_px[0], block_px[1] + 1))
        start, stop = max(position, 0), min(position + length, size)
        if stop > start:
            blocks.append((start, stop))
        position += length
        width = int(rng.integers(street_px[0], street_px[1] + 1))
        street_pixels += max(0, min(position + width, size) - max(position, 0))
        position += width
    return blocks, street_pixels


def _split(rng: np.random.Generator, rect: tuple[int, int, int, int], max_px: int,
           out: list[tuple[int, int, int, int]]) -> None:
    """Split ``(r0, r1, c0, c1)`` recursively until no side exceeds ``max_px``; leaves are appended to ``out``."""
    r0, r1, c0, c1 = rect
    height, width = r1 - r0, c1 - c0
    if max(height, width) <= max_px:
        out.append(rect)
        return
    along_rows = height >= width
    lo, length = (r0, height) if along_rows else (c0, width)
    cut = lo + int(rng.integers(math.floor(0.3 * length), math.ceil(0.7 * length) + 1))
    gap = int(rng.random() < 0.5)
    if along_rows:
        first, second = (r0, cut, c0, c1), (min(cut + gap, r1), r1, c0, c1)
    else:
        first, second = (r0, r1, c0, cut), (r0, r1, min(cut + gap, c1), c1)
    for part in (first, second):
        if part[1] > part[0] and part[3] > part[2]:
            _split(rng, part, max_px, out)


def building_coverage(buildings: np.ndarray) -> float:
    """Fraction of pixels inside buildings of a bool (H, W) or (T, H, W) raster, in ``[0, 1]``."""
    return float(np.mean(buildings))


def procedural_city(rng: np.random.Generator, *, size_px: int = 64, metres_per_pixel: float = 4.0,
                    street_width_m: tuple[float, float] = (8.0, 20.0),
                    block_size_m: tuple[float, float] = (40.0, 100.0),
                    max_building_m: float = 40.0, park_probability: float = 0.1,
                    setback_probability: float = 0.6, courtyard_probability: float = 0.6,
                    courtyard_min_m: float = 28.0, coverage: tuple[float, float] = (0.30, 0.45),
                    max_tries: int = 100) -> np.ndarray:
    """One procedural city tile (module docstring): streets, blocks, buildings with setbacks and courtyards.

    Args:
        rng: the source of all randomness; the same generator state gives the same tile.
        size_px: tile side in pixels (square tile), >= 8.
        metres_per_pixel: raster spacing in metres, > 0 (all ``*_m`` lengths are rounded to whole pixels).
        street_width_m: (min, max) street width in metres; at least one pixel is used.
        block_size_m: (min, max) block side in metres, between streets.
        max_building_m: longest building side in metres before a block is split.
        park_probability: chance that a block stays open (square, park).
        setback_probability: chance, per parcel side, of a one-pixel setback.
        courtyard_probability: chance that a parcel of at least ``courtyard_min_m`` on both sides has a courtyard.
        courtyard_min_m: smallest parcel side in metres that can hold a courtyard.
        coverage: (min, max) accepted building coverage (fraction of pixels); tiles outside are redrawn.
        max_tries: how many tiles to draw before giving up on ``coverage``.

    Returns:
        bool (size_px, size_px), True inside buildings; at least one full street row and column are outdoors.

    Raises:
        ConfigError (a ValueError): a parameter out of range (the message names it), or no tile within
            ``coverage`` after ``max_tries`` draws (field ``coverage``).
    """
    rng = _check_generator(rng)
    if not isinstance(size_px, (int, np.integer)) or isinstance(size_px, bool) or size_px < 8:
        raise ConfigError(f"must be an int >= 8, got {size_px!r}", field="size_px", fix="use e.g. 64")
    if (not isinstance(metres_per_pixel, (int, float)) or isinstance(metres_per_pixel, bool)
            or not math.isfinite(metres_per_pixel) or metres_per_pixel <= 0):
        raise ConfigError(f"must be a number > 0, got {metres_per_pixel!r}", field="metres_per_pixel",
                          fix="use the raster spacing in metres, e.g. 4.0")
    streets = _check_range(street_width_m, "street_width_m", low=0.0, fix="use e.g. (8.0, 20.0) metres")
    blocks_m = _check_range(block_size_m, "block_size_m", low=metres_per_pixel, fix="use e.g. (40.0, 100.0) metres")
    cover = _check_range(coverage, "coverage", low=0.0, fix="use e.g. (0.30, 0.45)")
    if cover[1] > 1.0:
        raise ConfigError(f"max must be <= 1, got {coverage!r}", field="coverage", fix="use e.g. (0.30, 0.45)")
    probabilities = {name: _check_probability(value, name) for name, value in (
        ("park_probability", park_probability), ("setback_probability", setback_probability),
        ("courtyard_probability", courtyard_probability))}
    for name, value in (("max_building_m", max_building_m), ("courtyard_min_m", courtyard_min_m)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= metres_per_pixel:
            raise ConfigError(f"must be at least one pixel ({metres_per_pixel} m), got {value!r}", field=name,
                              fix="give a length in metres")
    if not isinstance(max_tries, int) or max_tries < 1:
        raise ConfigError(f"must be an int >= 1, got {max_tries!r}", field="max_tries", fix="use e.g. 100")

    def px(metres: float) -> int:
        return max(1, int(round(metres / metres_per_pixel)))

    street_px = (px(streets[0]), max(px(streets[0]), px(streets[1])))
    block_px = (px(blocks_m[0]), max(px(blocks_m[0]), px(blocks_m[1])))
    for _ in range(max_tries):
        tile = _draw_tile(rng, int(size_px), block_px, street_px, px(max_building_m), px(courtyard_min_m),
                          **probabilities)
        if tile is not None and cover[0] <= building_coverage(tile) <= cover[1]:
            return tile
    raise ConfigError(f"no tile with coverage in {coverage} after {max_tries} draws", field="coverage",
                      fix="widen coverage or change the street/block/building parameters")


def _draw_tile(rng: np.random.Generator, size: int, block_px: tuple[int, int], street_px: tuple[int, int],
               max_building_px: int, courtyard_min_px: int, *, park_probability: float,
               setback_probability: float, courtyard_probability: float) -> np.ndarray | None:
    row_blocks, row_streets = _blocks_along(rng, size, block_px, street_px)
    col_blocks, col_streets = _blocks_along(rng, size, block_px, street_px)
    if row_streets == 0 or col_streets == 0:
        return None  # no full street in one direction: the street network would not be connected
    tile = np.zeros((size, size), dtype=bool)
    for r0, r1 in row_blocks:
        for c0, c1 in col_blocks:
            if rng.random() < park_probability:
                continue
            parcels: list[tuple[int, int, int, int]] = []
            _split(rng, (r0, r1, c0, c1), max_building_px, parcels)
            for p0, p1, q0, q1 in parcels:
                set_back = rng.random(4) < setback_probability
                p0, p1 = p0 + int(set_back[0]), p1 - int(set_back[1])
                q0, q1 = q0 + int(set_back[2]), q1 - int(set_back[3])
                if p1 <= p0 or q1 <= q0:
                    continue
                tile[p0:p1, q0:q1] = True
                if (min(p1 - p0, q1 - q0) >= courtyard_min_px and rng.random() < courtyard_probability):
                    wall = int(rng.integers(2, 4))
                    tile[p0 + wall:p1 - wall, q0 + wall:q1 - wall] = False
    return tile


def outdoor_position(buildings: np.ndarray, rng: np.random.Generator, *,
                     centre: tuple[float, float] | None = None, radius_px: float | None = None) -> tuple[int, int]:
    """A uniformly random outdoor pixel, optionally within a disk.

    Args:
        buildings: bool (H, W), True inside buildings.
        rng: the source of randomness.
        centre: disk centre ``(row, col)`` in pixels; defaults to the raster centre when ``radius_px`` is given.
        radius_px: disk radius in pixels (pixel centres at distance <= radius count), or ``None`` for the whole
            raster.

    Returns:
        ``(row, col)`` as Python ints, with ``buildings[row, col]`` False.

    Raises:
        ConfigError (a ValueError): ``buildings`` not 2-D bool (field ``buildings``), ``centre`` without
            ``radius_px`` or a negative radius (field ``radius_px``), or no outdoor pixel in the region.
    """
    if not isinstance(buildings, np.ndarray) or buildings.dtype != np.bool_ or buildings.ndim != 2:
        raise ConfigError("must be a 2-D bool numpy array (True inside buildings)", field="buildings",
                          fix="pass mask.astype(bool) of shape (H, W)")
    rng = _check_generator(rng)
    candidates = ~buildings
    if radius_px is None:
        if centre is not None:
            raise ConfigError("a centre was given without a radius", field="radius_px",
                              fix="give radius_px with centre, or neither")
    else:
        if not isinstance(radius_px, (int, float)) or isinstance(radius_px, bool) or not radius_px >= 0:
            raise ConfigError(f"must be a number >= 0, got {radius_px!r}", field="radius_px",
                              fix="give the disk radius in pixels")
        height, width = buildings.shape
        c_row, c_col = ((height - 1) / 2.0, (width - 1) / 2.0) if centre is None else map(float, centre)
        rows = np.arange(height)[:, None] - c_row
        cols = np.arange(width)[None, :] - c_col
        candidates &= rows * rows + cols * cols <= float(radius_px) ** 2
    flat = np.flatnonzero(candidates)
    if flat.size == 0:
        raise ConfigError("no outdoor pixel in the requested region", field="buildings",
                          fix="use a larger radius, another centre, or a tile with outdoor space")
    row, col = divmod(int(flat[rng.integers(flat.size)]), buildings.shape[1])
    return row, col
