"""Real-city footprints from sionna-rt's scene files: PLY reader, triangle rasteriser, Munich raster and tiles.

Expected values are written down by hand: the PLY files are packed here with ``struct``; the rasterised pixels are
counted from the pixel-centre rule (centre of pixel (r, c) at x = x0 + (c + 0.5) m, y = y0 - (r + 0.5) m). The
scene tests need the files of ``sionna-rt`` (``pip install --no-deps sionna-rt==2.2.0``) and are skipped without
them; sionna itself is never imported.
"""

from __future__ import annotations

import importlib.metadata
import struct

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.radio.dataset import RadioMapGeometry
from shared.radio.scenes import (
    SCENES,
    footprint_raster,
    rasterise_triangles,
    read_ply,
    scene_meshes,
    scene_grid,
    scene_path,
    scene_tiles,
)


def _sionna_scenes_installed() -> bool:
    try:
        dist = importlib.metadata.distribution("sionna-rt")
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(dist.locate_file(f"sionna/rt/scenes/{s}/{s}.xml").is_file() for s in SCENES)


needs_scenes = pytest.mark.skipif(
    not _sionna_scenes_installed(),
    reason="sionna-rt's scene files are not installed (pip install --no-deps sionna-rt==2.2.0)")


def _ply(path, vertices, faces, *, extra_vertex_props=(), count_fmt="B", index_fmt="i",
         count_type="uchar", index_type="int"):
    header = ["ply", "format binary_little_endian 1.0", "comment written by the test",
              f"element vertex {len(vertices)}", "property float x", "property float y", "property float z"]
    header += [f"property float {name}" for name in extra_vertex_props]
    header += [f"element face {len(faces)}", f"property list {count_type} {index_type} vertex_indices",
               "end_header"]
    body = b"".join(struct.pack("<" + "f" * len(v), *v) for v in vertices)
    body += b"".join(struct.pack(f"<{count_fmt}{len(f)}{index_fmt}", len(f), *f) for f in faces)
    path.write_bytes(("\n".join(header) + "\n").encode("ascii") + body)
    return path


# --- PLY reader --------------------------------------------------------------------------------------------------

def test_read_ply_unit_square_of_two_triangles(tmp_path):
    # x, y, z plus two uv floats that the reader must drop.
    vertices = [(0, 0, 0, 0.0, 0.0), (1, 0, 0, 1.0, 0.0), (1, 1, 0, 1.0, 1.0), (0, 1, 0, 0.0, 1.0)]
    path = _ply(tmp_path / "square.ply", vertices, [(0, 1, 2), (0, 2, 3)], extra_vertex_props=("s", "t"))
    v, f = read_ply(path)
    assert v.dtype == np.float64 and f.dtype == np.int64
    np.testing.assert_array_equal(v, [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]])
    np.testing.assert_array_equal(f, [[0, 1, 2], [0, 2, 3]])


def test_read_ply_quad_face_becomes_a_triangle_fan_and_uint32_indices(tmp_path):
    vertices = [(0, 0, 5), (2, 0, 5), (2, 3, 5), (0, 3, 5)]
    path = _ply(tmp_path / "quad.ply", vertices, [(0, 1, 2, 3)], index_fmt="I", index_type="uint")
    v, f = read_ply(path)
    np.testing.assert_array_equal(v[:, 2], [5, 5, 5, 5])
    np.testing.assert_array_equal(f, [[0, 1, 2], [0, 2, 3]])


def test_read_ply_rejects_truncated_ascii_and_out_of_range_files_naming_them(tmp_path):
    good = _ply(tmp_path / "t.ply", [(0, 0, 0), (1, 0, 0), (0, 1, 0)], [(0, 1, 2)]).read_bytes()
    truncated = tmp_path / "truncated.ply"
    truncated.write_bytes(good[:-5])
    with pytest.raises(ConfigError, match="truncated.ply"):
        read_ply(truncated)
    ascii_ply = tmp_path / "ascii.ply"
    ascii_ply.write_bytes(good.replace(b"binary_little_endian", b"ascii"))
    with pytest.raises(ConfigError, match="ascii.ply.*format"):
        read_ply(ascii_ply)
    out_of_range = _ply(tmp_path / "range.ply", [(0, 0, 0), (1, 0, 0), (0, 1, 0)], [(0, 1, 7)])
    with pytest.raises(ConfigError, match="range.ply.*out of range"):
        read_ply(out_of_range)


# --- rasteriser ----------------------------------------------------------------------------------------------------

def test_rasterise_right_triangle_marks_the_lower_triangle_with_its_diagonal():
    # Triangle (0,0), (10,0), (0,10) m; raster 10 x 10 at 1 m with its north-west corner at (0, 10).
    # Centre of (r, c): x = c + 0.5, y = 9.5 - r; inside iff x + y <= 10 iff c <= r: 10 * 11 / 2 = 55 pixels.
    tri = np.array([[[0, 0], [10, 0], [0, 10]]], dtype=float)
    mask = rasterise_triangles(tri, (0.0, 10.0), (10, 10), metres_per_pixel=1.0)
    assert mask.dtype == np.bool_ and mask.shape == (10, 10)
    assert mask.sum() == 55
    np.testing.assert_array_equal(mask, np.tril(np.ones((10, 10), dtype=bool)))


def test_rasterise_square_of_two_triangles_either_winding_and_walls_mark_nothing():
    # Square x, y in [1, 3] m on a 4 x 4 raster at 1 m, corner (0, 4): centres x = c + .5, y = 3.5 - r
    # lie inside for c in {1, 2} and r in {1, 2}.
    square = np.array([[[1, 1], [3, 1], [3, 3]], [[1, 1], [1, 3], [3, 3]]], dtype=float)  # ccw, then cw
    wall = np.array([[[0.5, 0.5], [3.5, 3.5], [0.5, 0.5]]], dtype=float)  # a vertical wall: zero area in xy
    mask = rasterise_triangles(np.concatenate([square, wall]), (0.0, 4.0), (4, 4), metres_per_pixel=1.0)
    expected = np.zeros((4, 4), dtype=bool)
    expected[1:3, 1:3] = True
    np.testing.assert_array_equal(mask, expected)


def test_rasterise_matches_brute_force_barycentric_test_clips_and_chunks():
    # Small random triangles, some hanging over the raster edge (origin (0, 100), 25 x 25 px at 4 m).
    rng = np.random.default_rng(3)
    tri = rng.uniform(-10, 110, size=(60, 1, 2)) + rng.uniform(-12, 12, size=(60, 3, 2))
    whole = rasterise_triangles(tri, (0.0, 100.0), (25, 25), metres_per_pixel=4.0)
    chunked = rasterise_triangles(tri, (0.0, 100.0), (25, 25), metres_per_pixel=4.0, chunk=7)
    np.testing.assert_array_equal(whole, chunked)
    # Reference: barycentric coordinates of every pixel centre in every triangle (all >= 0 inside).
    cx, cy = np.meshgrid((np.arange(25) + 0.5) * 4.0, 100.0 - (np.arange(25) + 0.5) * 4.0)
    expected = np.zeros((25, 25), dtype=bool)
    for (ax, ay), (bx, by), (qx, qy) in tri:
        det = (by - qy) * (ax - qx) + (qx - bx) * (ay - qy)
        l1 = ((by - qy) * (cx - qx) + (qx - bx) * (cy - qy)) / det
        l2 = ((qy - ay) * (cx - qx) + (ax - qx) * (cy - qy)) / det
        expected |= (l1 >= 0) & (l2 >= 0) & (1 - l1 - l2 >= 0)
    np.testing.assert_array_equal(whole, expected)
    assert 0 < whole.sum() < whole.size


# --- scene lookup errors (no sionna-rt needed) --------------------------------------------------------------------

def test_unknown_scene_raises_config_error_naming_city():
    with pytest.raises(ConfigError) as info:
        scene_path("atlantis")
    assert info.value.field == "city" and "atlantis" in str(info.value)
    with pytest.raises(ConfigError, match="city"):
        scene_tiles("atlantis", 1, np.random.default_rng(0))


def test_missing_distribution_raises_config_error_with_install_fix(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError) as info:
        scene_path("munich")
    assert info.value.field == "city"
    assert info.value.fix == "pip install --no-deps sionna-rt==2.2.0"


# --- Munich (needs sionna-rt's files) -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def munich():
    meshes = scene_meshes("munich")
    raster, origin = footprint_raster("munich")
    return meshes, raster, origin


@needs_scenes
def test_munich_ground_is_the_single_flat_ground_sheet_and_roofs_are_kept(munich):
    meshes, _, _ = munich
    ground = [m for m in meshes if m.is_ground]
    assert [m.shape_id for m in ground] == ["mesh-ground"]
    assert ground[0].height_m == 0.0
    # Flat roofs at height (metal meshes with zero z extent) are buildings, not ground.
    flat_roofs = [m for m in meshes if not m.is_ground and m.height_m == 0.0]
    assert len(flat_roofs) > 100 and min(float(m.vertices[:, 2].min()) for m in flat_roofs) > 1.0


@needs_scenes
def test_munich_is_z_up_with_building_heights_of_metres_to_tens_of_metres(munich):
    meshes, _, _ = munich
    heights = np.array([m.height_m for m in meshes if not m.is_ground])
    assert 3.0 <= heights.max() <= 300.0          # tallest mesh: the Frauenkirche towers are about 99 m
    assert 3.0 <= float(np.median(heights[heights > 1.0])) <= 50.0
    xy_span = np.ptp(np.concatenate([m.vertices for m in meshes if not m.is_ground])[:, :2], axis=0)
    assert (xy_span > 500.0).all()                # the scene is a kilometre or so across in x and y


@needs_scenes
def test_munich_footprint_coverage_is_plausible(munich):
    _, raster, origin = munich
    assert raster.dtype == np.bool_ and raster.ndim == 2
    assert raster.shape[0] >= 64 and raster.shape[1] >= 64
    assert 0.15 <= raster.mean() <= 0.6
    assert all(np.isfinite(origin))


@needs_scenes
def test_scene_tiles_shape_dtype_coverage_and_determinism(munich):
    geometry = RadioMapGeometry()
    a = scene_tiles("munich", 5, np.random.default_rng(7), geometry=geometry)
    b = scene_tiles("munich", 5, np.random.default_rng(7), geometry=geometry)
    c = scene_tiles("munich", 5, np.random.default_rng(8), geometry=geometry)
    assert a.shape == (5, 64, 64) and a.dtype == np.bool_
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    coverage = a.mean(axis=(1, 2))
    assert ((coverage >= 0.15) & (coverage <= 0.6)).all()
    # Every tile is a crop of the scene raster.
    _, raster, _ = munich
    windows = np.lib.stride_tricks.sliding_window_view(raster, (64, 64))
    for tile in a:
        assert (windows == tile).all(axis=(2, 3)).any()


@needs_scenes
def test_scene_tiles_raises_when_coverage_cannot_be_met():
    with pytest.raises(ConfigError) as info:
        scene_tiles("munich", 2, np.random.default_rng(0), coverage=(0.99, 1.0), max_tries=50)
    assert info.value.field == "coverage"


@needs_scenes
def test_scene_grid_tiles_are_disjoint_crops_on_one_grid_and_every_acceptable_grid_cell_is_kept(munich):
    _, raster, (x0, y0) = munich
    tiles = scene_grid("munich")
    assert len(tiles) == 19  # the count docs/radiomap-data.md gives (sionna-rt 2.2.0, 4 m/px, coverage 0.15-0.6)
    assert [t.index for t in tiles] == list(range(19))
    # Disjoint: every raster pixel is covered by at most one tile (counted on an occupancy raster).
    occupancy = np.zeros(raster.shape, dtype=np.int64)
    for t in tiles:
        occupancy[t.row:t.row + 64, t.col:t.col + 64] += 1
        np.testing.assert_array_equal(t.buildings, raster[t.row:t.row + 64, t.col:t.col + 64])
        assert 0.15 <= t.coverage <= 0.6
        assert t.origin_xy_m == pytest.approx((x0 + 4.0 * t.col, y0 - 4.0 * t.row))
        assert t.tile_id == f"munich/r{t.row:03d}c{t.col:03d}"
    assert occupancy.max() == 1
    # One grid: every tile's offset is the same modulo 64, and every grid cell at that offset that fits and has
    # acceptable coverage (checked here with a plain loop) is a tile.
    dr, dc = tiles[0].row % 64, tiles[0].col % 64
    assert all((t.row % 64, t.col % 64) == (dr, dc) for t in tiles)
    expected = [(r, c) for r in range(dr, raster.shape[0] - 63, 64) for c in range(dc, raster.shape[1] - 63, 64)
                if 0.15 <= raster[r:r + 64, c:c + 64].mean() <= 0.6]
    assert [(t.row, t.col) for t in tiles] == expected
    # Pixel centres in scene metres: pixel (0, 0) of a tile is half a pixel in from its north-west corner.
    centre = tiles[3].pixel_centres_xy_m(np.array([[0, 0], [10, 20]]))
    ox, oy = tiles[3].origin_xy_m
    np.testing.assert_allclose(centre, [[ox + 2.0, oy - 2.0], [ox + 82.0, oy - 42.0]])
    assert scene_grid("munich") is tiles or scene_grid("munich") == tiles  # fixed: the same tiles every call
    with pytest.raises(ConfigError) as info:
        scene_grid("munich", coverage=(0.7, 0.2))
    assert info.value.field == "coverage"
