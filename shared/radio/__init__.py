"""Procedural radio-map data for RadioUNet: city tiles, COST 231 multi-wall path loss, map sets and their cache.

No measured radio-map set is reachable offline, so WildFed generates its own (docs/radiomap-data.md): procedural
city blocks as building rasters (:mod:`shared.radio.city`), free-space + multi-wall path loss along the direct ray
on the raster (:mod:`shared.radio.pathloss`), and RadioMapSeer-style normalised gain maps with RadioUNet inputs,
stored as safetensors (:mod:`shared.radio.dataset`). Real city footprints come from sionna-rt's scene files
(:mod:`shared.radio.scenes`, cut into disjoint 256 m tiles by :func:`scene_grid`), and a ray-traced alternative to
the COST 231 maps from Sionna RT (:mod:`shared.radio.sionna_maps`, imported on its own: it needs Mitsuba and Dr.Jit
only to trace).

Example::

    rng = np.random.default_rng(0)
    tiles = city_tiles(rng, 14)                          # bool (14, 64, 64)
    specs = transmitter_specs(tiles, 50, rng)            # int64 (700, 3): (tile, row, col)
    maps = generate_maps(tiles, specs, model=PathLossModel())
"""

from shared.radio.city import building_coverage, outdoor_position, procedural_city
from shared.radio.dataset import (
    BUILDING_CHANNEL,
    TRANSMITTER_CHANNEL,
    RadioMapGeometry,
    RadioMapSet,
    cached_maps,
    city_tiles,
    generate_maps,
    model_inputs,
    site_maps,
    transmitter_specs,
)
from shared.radio.scenes import (
    SCENES,
    SceneTile,
    footprint_raster,
    read_ply,
    scene_grid,
    scene_meshes,
    scene_path,
    scene_tiles,
)
from shared.radio.pathloss import (
    PathLossModel,
    count_wall_crossings,
    denormalise_gain,
    free_space_path_loss_db,
    normalise_gain,
    path_loss_db,
)

__all__ = [
    "PathLossModel",
    "free_space_path_loss_db",
    "count_wall_crossings",
    "path_loss_db",
    "normalise_gain",
    "denormalise_gain",
    "procedural_city",
    "outdoor_position",
    "building_coverage",
    "RadioMapGeometry",
    "RadioMapSet",
    "BUILDING_CHANNEL",
    "TRANSMITTER_CHANNEL",
    "model_inputs",
    "city_tiles",
    "transmitter_specs",
    "generate_maps",
    "cached_maps",
    "site_maps",
    "SCENES",
    "scene_path",
    "read_ply",
    "scene_meshes",
    "footprint_raster",
    "scene_tiles",
    "SceneTile",
    "scene_grid",
]
