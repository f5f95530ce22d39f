"""Triangles onto a north-up pixel grid (:func:`rasterise_triangles`): the building footprint of a city scene is
its roofs (and floors) projected onto the xy plane (:mod:`shared.radio.scenes`, "Rasterisation", "Raster frame")."""

from __future__ import annotations

import math

import numpy as np

from shared.errors import ConfigError

__all__ = ["rasterise_triangles"]


def rasterise_triangles(triangles_xy: np.ndarray, origin_xy_m: tuple[float, float], shape: tuple[int, int], *,
                        metres_per_pixel: float = 4.0, chunk: int = 4_000_000) -> np.ndarray:
    """Mark the pixels whose centres lie inside (or on the edge of) any of the given 2-D triangles.

    Args:
        triangles_xy: float (T, 3, 2), the x, y corners of each triangle in metres (either orientation).
        origin_xy_m: ``(x0, y0)``, the north-west corner of the raster in metres (:mod:`shared.radio.scenes`).
        shape: ``(rows, cols)`` of the raster.
        metres_per_pixel: raster spacing in metres, > 0.
        chunk: at most this many candidate (triangle, pixel) pairs are tested at once (memory bound).

    Returns:
        bool (rows, cols): pixel ``(r, c)`` (centre ``x0 + (c + 0.5) m``, ``y0 - (r + 0.5) m``) is True if its
        centre is inside a triangle. Triangles of projected area below 1e-6 m² (walls) mark nothing.

    Raises:
        ConfigError (a ValueError): ``triangles_xy`` not of shape (T, 3, 2) or ``metres_per_pixel`` not > 0.
    """
    tri = np.asarray(triangles_xy, dtype=np.float64)
    if tri.ndim != 3 or tri.shape[1:] != (3, 2):
        raise ConfigError(f"must have shape (T, 3, 2), got {tri.shape}", field="triangles_xy",
                          fix="pass the x, y corners of each triangle")
    if not (isinstance(metres_per_pixel, (int, float)) and math.isfinite(metres_per_pixel) and metres_per_pixel > 0):
        raise ConfigError(f"must be a number > 0, got {metres_per_pixel!r}", field="metres_per_pixel",
                          fix="use the raster spacing in metres, e.g. 4.0")
    rows, cols = int(shape[0]), int(shape[1])
    out = np.zeros((rows, cols), dtype=bool)
    m = float(metres_per_pixel)
    # Pixel coordinates: u = column coordinate, v = row coordinate (pixel centres at integer + 0.5).
    u = (tri[:, :, 0] - origin_xy_m[0]) / m
    v = (origin_xy_m[1] - tri[:, :, 1]) / m
    area2 = (u[:, 1] - u[:, 0]) * (v[:, 2] - v[:, 0]) - (u[:, 2] - u[:, 0]) * (v[:, 1] - v[:, 0])
    keep = np.abs(area2) * m * m >= 2e-6
    u, v, area2 = u[keep], v[keep], area2[keep]
    # Orient every triangle counter-clockwise in (u, v) so that "inside" is all edge functions >= 0.
    flip = area2 < 0
    u[flip] = u[flip][:, ::-1]
    v[flip] = v[flip][:, ::-1]
    c0 = np.clip(np.ceil(u.min(axis=1) - 0.5), 0, cols).astype(np.int64)
    c1 = np.clip(np.floor(u.max(axis=1) - 0.5), -1, cols - 1).astype(np.int64)
    r0 = np.clip(np.ceil(v.min(axis=1) - 0.5), 0, rows).astype(np.int64)
    r1 = np.clip(np.floor(v.max(axis=1) - 0.5), -1, rows - 1).astype(np.int64)
    width, height = np.maximum(c1 - c0 + 1, 0), np.maximum(r1 - r0 + 1, 0)
    counts = width * height
    nonempty = np.flatnonzero(counts)
    eps = 1e-9
    cumulative = np.cumsum(counts[nonempty])
    start = 0
    while start < nonempty.size:
        done = int(cumulative[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(cumulative, done + chunk, side="right")))
        idx = nonempty[start:stop]
        n = counts[idx]
        owner = np.repeat(np.arange(idx.size), n)
        local = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        w = width[idx][owner]
        pc = c0[idx][owner] + local % w
        pr = r0[idx][owner] + local // w
        px, py = pc + 0.5, pr + 0.5
        tu, tv = u[idx][owner], v[idx][owner]
        inside = np.ones(owner.size, dtype=bool)
        for a, b in ((0, 1), (1, 2), (2, 0)):
            edge = (tu[:, b] - tu[:, a]) * (py - tv[:, a]) - (tv[:, b] - tv[:, a]) * (px - tu[:, a])
            inside &= edge >= -eps
        out[pr[inside], pc[inside]] = True
        start = stop
    return out
