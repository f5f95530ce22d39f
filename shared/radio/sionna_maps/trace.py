"""Tracing one tile with Sionna RT (steps 1-5 of :mod:`shared.radio.sionna_maps`): the scene, the ground heights,
the measurement surface, and the solver run in batches until the coverage is reached. Imports Sionna only here."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from shared.radio.scenes import SceneTile, scene_meshes
from shared.radio.sionna_maps.availability import check_sionna
from shared.radio.sionna_maps.settings import SionnaSettings
from shared.radio.sionna_maps.tiles import TracedTile, bank_positions, tile_key

_SCENE_CACHE: dict[str, object] = {}


def _sionna_scene(scene_name: str, settings: SionnaSettings):  # pragma: no cover - needs Sionna RT
    import sionna.rt as rt

    scene = _SCENE_CACHE.get(scene_name)
    if scene is None:
        _SCENE_CACHE.clear()  # one city at a time: the scenes are tens of MB each
        scene = rt.load_scene(getattr(rt.scene, scene_name))
        _SCENE_CACHE[scene_name] = scene
    scene.frequency = float(settings.frequency_hz)
    array = rt.PlanarArray(num_rows=1, num_cols=1, vertical_spacing=0.5, horizontal_spacing=0.5, pattern="iso",
                           polarization="V")
    scene.tx_array = array
    scene.rx_array = array
    for name in list(scene.transmitters):
        scene.remove(name)
    return scene


def _ground_heights(scene_name: str, xy: np.ndarray) -> np.ndarray:  # pragma: no cover - needs Mitsuba
    """float64 (n,) ground z in metres under the points xy, float (n, 2): a ray cast down onto the ground meshes."""
    import mitsuba as mi
    import sionna.rt  # noqa: F401 - sets Mitsuba's variant (llvm_ad_mono_polarized on a CPU)

    ground = {f"g{i}": {"type": "ply", "filename": str(m.path)}
              for i, m in enumerate(scene_meshes(scene_name)) if m.is_ground}
    if not ground:
        return np.zeros(len(xy))
    scene = mi.load_dict({"type": "scene", **ground})
    n = len(xy)
    origin = mi.Point3f(mi.Float(xy[:, 0].astype(np.float32)), mi.Float(xy[:, 1].astype(np.float32)),
                        mi.Float(np.full(n, 10_000.0, np.float32)))
    ray = mi.Ray3f(origin, mi.Vector3f(0.0, 0.0, -1.0))
    si = scene.ray_intersect(ray)
    z = np.asarray(si.p.z, dtype=np.float64)
    return np.where(np.asarray(si.is_valid(), dtype=bool), z, 0.0)


def _measurement_mesh(tile: SceneTile, rx_height_m: float):  # pragma: no cover - needs Mitsuba
    """A Mitsuba mesh, two triangles per pixel (pixel (r, c) owns faces 2 (r W + c) and 2 (r W + c) + 1), its
    vertices at the pixel corners, ``rx_height_m`` above the ground."""
    import mitsuba as mi

    size, m = tile.size_px, tile.metres_per_pixel
    vr, vc = np.meshgrid(np.arange(size + 1), np.arange(size + 1), indexing="ij")
    xy = np.stack([tile.origin_xy_m[0] + vc.ravel() * m, tile.origin_xy_m[1] - vr.ravel() * m], axis=1)
    z = _ground_heights(tile.scene, xy) + rx_height_m
    vertices = np.concatenate([xy, z[:, None]], axis=1).astype(np.float32)
    r, c = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    a = (r * (size + 1) + c).ravel()
    b, d, e = a + 1, a + size + 1, a + size + 2   # north-east, south-west, south-east corners
    faces = np.stack([np.stack([a, d, b], 1), np.stack([b, d, e], 1)], axis=1).reshape(-1, 3).astype(np.uint32)
    mesh = mi.Mesh("wildfed-measurement", vertex_count=len(vertices), face_count=len(faces),
                   has_vertex_normals=False, has_vertex_texcoords=False)
    params = mi.traverse(mesh)
    params["vertex_positions"] = mi.Float(vertices.ravel())
    params["faces"] = mi.UInt(faces.ravel())
    params.update()
    return mesh


def trace_tile(tile: SceneTile, settings: SionnaSettings, *,
               progress: Callable[[int, int, int], object] | None = None) -> TracedTile:  # pragma: no cover
    """Ray-trace the maps of every :func:`bank_positions` transmitter of ``tile`` (:mod:`shared.radio.sionna_maps`,
    steps 1-5).

    Args:
        tile: a tile of :func:`shared.radio.scenes.scene_grid`.
        settings: the solver's settings.
        progress: called as ``progress(done, total, samples_per_tx)`` after each batch.

    Returns:
        the :class:`TracedTile` (path gain float32 (n, H, W), linear, row 0 north).

    Raises:
        SionnaUnavailable: :func:`check_sionna` fails.

    Source: Sionna RT 2.2 ``RadioMapSolver`` on a mesh measurement surface (NVIDIA, sionna-rt documentation).
    """
    check_sionna()
    import sionna.rt as rt

    started = time.monotonic()
    scene = _sionna_scene(tile.scene, settings)
    mesh = _measurement_mesh(tile, settings.rx_height_m)
    solver = rt.RadioMapSolver()
    positions = bank_positions(tile, settings)
    xy = tile.pixel_centres_xy_m(positions)
    tx_z = _ground_heights(tile.scene, xy) + settings.tx_height_m
    size = tile.size_px
    outdoor = ~tile.buildings
    gains = np.zeros((len(positions), size, size), dtype=np.float32)
    samples = np.zeros(len(positions), dtype=np.int64)
    coverage = np.zeros(len(positions), dtype=np.float64)
    for start in range(0, len(positions), settings.batch):
        stop = min(start + settings.batch, len(positions))
        names = [f"tx{i}" for i in range(start, stop)]
        for name, (x, y), z in zip(names, xy[start:stop], tx_z[start:stop]):
            scene.add(rt.Transmitter(name=name, position=[float(x), float(y), float(z)]))
        spt = settings.samples_per_tx
        while True:
            radio_map = solver(scene, measurement_surface=mesh, samples_per_tx=int(spt),
                               max_depth=settings.max_depth, los=True,
                               specular_reflection=settings.specular_reflection,
                               diffuse_reflection=settings.diffuse_reflection, refraction=settings.refraction,
                               diffraction=settings.diffraction, seed=settings.seed)
            batch = np.asarray(radio_map.path_gain.numpy(), dtype=np.float64).reshape(stop - start, size, size, 2)
            batch = batch.mean(axis=-1)
            cover = (batch[:, outdoor] > 0).mean(axis=1)
            if cover.mean() >= settings.min_coverage or spt * 2 > settings.max_samples_per_tx:
                break
            spt *= 2
        gains[start:stop] = batch.astype(np.float32)
        samples[start:stop] = spt
        coverage[start:stop] = cover
        for name in names:
            scene.remove(name)
        if progress is not None:
            progress(stop, len(positions), int(spt))
    return TracedTile(tile_key(tile, settings), tile.buildings.copy(), positions, gains, samples, coverage,
                      time.monotonic() - started)
