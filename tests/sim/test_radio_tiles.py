"""The radio-map experiment's tiles and map sources (docs/radiomap-data.md): every role on its own tiles, sites drawn
from the source's transmitter pixels, and Sionna maps normalised like the COST 231 maps.

Expected values are worked out here by hand or recomputed independently: disjointness on occupancy rasters of the
scenes, the transmitter pixels within a radius listed by hand, normalised gains from the window's formula. The scene
tests need sionna-rt's files (``pip install --no-deps sionna-rt==2.2.0``, as .ci/run does) and are skipped without
them; nothing here imports Sionna, Mitsuba or Dr.Jit.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from shared.errors import ConfigError, DatasetError
from shared.radio import SCENES, PathLossModel, RadioMapGeometry
from shared.radio.scenes import SceneTile, footprint_raster, scene_grid
from shared.radio.sionna_maps import SionnaSettings, TracedTile, tile_file, tile_key, write_tile

from wildfed_sim.radio_tiles import (
    OLD_TOWN,
    Cost231Source,
    SionnaSource,
    TileSet,
    draw_site,
    map_source,
    plan_tiles,
)


def _scenes_installed() -> bool:
    try:
        dist = importlib.metadata.distribution("sionna-rt")
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(dist.locate_file(f"sionna/rt/scenes/{s}/{s}.xml").is_file() for s in SCENES)


needs_scenes = pytest.mark.skipif(not _scenes_installed(),
                                  reason="sionna-rt's scene files are not installed (pip install --no-deps "
                                         "sionna-rt==2.2.0)")


@needs_scenes
def test_munich_plan_gives_every_role_its_own_disjoint_tiles():
    plan = plan_tiles(city="munich", validation_city=None, clients=14, validation_tiles=None, public_tiles=16, seed=0)
    assert (len(plan.clients), len(plan.validation), len(plan.other_city), len(plan.public)) == (14, 5, 9, 16)
    assert plan.clients.name == plan.validation.name == "munich" and plan.other_city.name == "florence"
    assert {t.scene for t in plan.public.scene_tiles} == {"san_francisco", "etoile"}
    # Clients plus held-out tiles are exactly munich's 19 grid tiles, each once.
    ids = plan.clients.ids + plan.validation.ids
    assert sorted(ids) == sorted(t.tile_id for t in scene_grid("munich")) and len(set(ids)) == 19
    # No pixel of any scene belongs to two tiles of the plan (occupancy rasters, counted per scene).
    occupancy = {s: np.zeros(footprint_raster(s)[0].shape, dtype=np.int64) for s in SCENES}
    for tiles in plan.roles().values():
        for t in tiles.scene_tiles:
            occupancy[t.scene][t.row:t.row + 64, t.col:t.col + 64] += 1
            np.testing.assert_array_equal(tiles.buildings[tiles.ids.index(t.tile_id)], t.buildings)
    assert max(int(o.max()) for o in occupancy.values()) == 1
    # The seed permutes which tiles the clients get; the same seed gives the same plan.
    same = plan_tiles(city="munich", validation_city=None, clients=14, validation_tiles=None, public_tiles=16, seed=0)
    other = plan_tiles(city="munich", validation_city=None, clients=14, validation_tiles=None, public_tiles=16, seed=1)
    assert same.clients.ids == plan.clients.ids and other.clients.ids != plan.clients.ids


@needs_scenes
def test_plan_errors_name_the_field_and_the_counts():
    with pytest.raises(ConfigError) as info:
        plan_tiles(city="munich", validation_city=None, clients=19, validation_tiles=None, public_tiles=16, seed=0)
    assert info.value.field == "clients" and "19 disjoint tiles" in str(info.value) and "18" in info.value.fix
    with pytest.raises(ConfigError) as info:
        plan_tiles(city="munich", validation_city="munich", clients=3, validation_tiles=None, public_tiles=2, seed=0)
    assert info.value.field == "validation_city"
    with pytest.raises(ConfigError) as info:
        plan_tiles(city="munich", validation_city=None, clients=3, validation_tiles=None, public_tiles=17, seed=0)
    assert info.value.field == "pretrain_tiles" and "16" in str(info.value)
    with pytest.raises(ConfigError) as info:
        plan_tiles(city="atlantis", validation_city=None, clients=3, validation_tiles=None, public_tiles=2, seed=0)
    assert info.value.field == "city"


def test_procedural_plan_draws_each_role_from_its_own_stream_and_the_old_town_is_denser():
    geometry = RadioMapGeometry()
    plan = plan_tiles(city="procedural", validation_city=None, clients=3, validation_tiles=10, public_tiles=2,
                      seed=4, geometry=geometry)
    assert (len(plan.clients), len(plan.validation), len(plan.other_city), len(plan.public)) == (3, 10, 10, 2)
    assert plan.other_city.name == "procedural-old-town"
    every_id = [i for tiles in plan.roles().values() for i in tiles.ids]
    assert len(set(every_id)) == len(every_id)
    # Streams: the client tiles do not repeat among the validation tiles.
    for tile in plan.clients.buildings:
        assert not any(np.array_equal(tile, v) for v in plan.validation.buildings)
    # OLD_TOWN's median coverage is about 0.52 against the default city's 0.38 (measured over 30 seeds).
    assert plan.other_city.buildings.mean() > plan.validation.buildings.mean() + 0.05
    assert OLD_TOWN["street_width_m"] == (4.0, 8.0)
    with pytest.raises(ConfigError) as info:
        plan_tiles(city="procedural", validation_city="munich", clients=3, validation_tiles=2, public_tiles=2, seed=0)
    assert info.value.field == "validation_city"


def _hand_tile() -> TileSet:
    # 8 x 8 tile, buildings everywhere except a plus-shaped street through (3, 3) (row 3 and column 3, up to index 6)
    # and the lone pixel (0, 0).
    b = np.ones((1, 8, 8), dtype=bool)
    b[0, 3, :7] = False
    b[0, :7, 3] = False
    b[0, 0, 0] = False
    return TileSet("hand", b, ("hand/0",))


def test_draw_site_takes_transmitters_only_from_allowed_pixels_within_the_radius():
    tiles = _hand_tile()
    source = Cost231Source(PathLossModel(), RadioMapGeometry(size_px=8, metres_per_pixel=4.0))
    assert len(source.positions(tiles, 0)) == 14  # the 13 street pixels and (0, 0)
    # Centre (3, 3), radius 1.5 px: the outdoor pixels within it are (3, 3) and its four street neighbours.
    within = {(3, 3), (2, 3), (4, 3), (3, 2), (3, 4)}
    rng = np.random.default_rng(0)
    maps, centre = draw_site(source, tiles, 0, 40, radius_px=1.5, rng=rng, centre=np.array([3.0, 3.0]))
    assert centre.tolist() == [3.0, 3.0]
    assert {tuple(t) for t in maps.transmitters.tolist()} == within  # 40 draws from 5 pixels: all of them appear
    assert np.all(maps.tiles == 0) and len(maps) == 40
    padded = tiles
    with pytest.raises(ConfigError) as info:  # (0, 0) is outdoors but 3 px from every other outdoor pixel
        draw_site(source, padded, 0, 2, radius_px=1.0, rng=rng, centre=np.array([1.0, 1.0]))
    assert info.value.field == "centre"
    for kwargs, field in (({"index": 1}, "tile_index"), ({"n_maps": 0}, "n_maps"), ({"radius_px": -1.0}, "radius_px")):
        args = {"index": 0, "n_maps": 2, "radius_px": 1.5, **kwargs}
        with pytest.raises(ConfigError) as info:
            draw_site(source, padded, args["index"], args["n_maps"], radius_px=args["radius_px"], rng=rng)
        assert info.value.field == field
    # Without a centre, the first draw picks one of the allowed pixels.
    _, drawn = draw_site(source, padded, 0, 1, radius_px=1.5, rng=np.random.default_rng(5))
    assert tuple(int(v) for v in drawn) in {tuple(p) for p in source.positions(padded, 0).tolist()}


def _scene_tile(buildings: np.ndarray) -> SceneTile:
    size = buildings.shape[0]
    return SceneTile("munich", 0, 0, 0, size, 4.0, (0.0, 0.0), buildings)


def test_sionna_source_normalises_traced_gain_like_cost231_and_only_at_traced_pixels(tmp_path, monkeypatch):
    geometry = RadioMapGeometry(size_px=8, metres_per_pixel=4.0)
    buildings = np.zeros((8, 8), dtype=bool)
    buildings[5:, 5:] = True
    tile = _scene_tile(buildings)
    settings = SionnaSettings(tx_step_px=4)
    gain = np.zeros((2, 8, 8), dtype=np.float32)
    gain[0, 0, 0] = 1e-10      # -100 dB -> (-100 + 147) / 100 = 0.47
    gain[0, 0, 1] = 1e-3       # -30 dB, above the window's top (-47 dB): 1
    gain[0, 6, 6] = 1e-8       # in a building: 0
    gain[1, 2, 2] = 1e-16      # -160 dB, below the window: 0
    traced = TracedTile(tile_key(tile, settings), buildings, np.array([[2, 2], [2, 6]], dtype=np.int64), gain,
                        np.array([10**6, 10**6]), np.array([0.5, 0.5]), 1.0)
    write_tile(tile_file(tmp_path, tile, settings), traced)
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "wildfed.sionna-radiomaps/1", "settings": settings.__dict__,
        "geometry": {"size_px": 8, "metres_per_pixel": 4.0}, "tile_coverage": [0.15, 0.6], "sionna_rt": None,
        "tiles": {tile.tile_id: {"file": "x"}}}))
    source = map_source("sionna", model=PathLossModel(), geometry=geometry, sionna_dir=tmp_path)
    assert isinstance(source, SionnaSource)
    tiles = TileSet("munich", buildings[None], (tile.tile_id,), (tile,))
    np.testing.assert_array_equal(source.positions(tiles, 0), [[2, 2], [2, 6]])
    maps = source.maps(tiles, np.array([[0, 2, 2], [0, 2, 6]]))
    assert maps.targets[0, 0, 0, 0] == pytest.approx(0.47, abs=1e-6)
    assert maps.targets[0, 0, 0, 1] == 1.0 and maps.targets[0, 0, 6, 6] == 0.0
    assert maps.targets[0, 0, 4, 4] == 0.0                     # no ray arrived: 0, as below the window
    assert maps.targets[1, 0].max() == 0.0                     # -160 dB clips to 0
    assert maps.inputs[0, 1, 2, 2] == 1.0 and maps.inputs[0, 1].sum() == 1.0
    np.testing.assert_array_equal(maps.inputs[1, 0], buildings.astype(np.float32))
    with pytest.raises(ConfigError) as info:   # a pixel the set did not trace
        source.maps(tiles, np.array([[0, 3, 3]]))
    assert info.value.field == "specs"
    # A tile the set lacks: the error names the command that traces it.
    other = SceneTile("munich", 1, 8, 8, 8, 4.0, (32.0, -32.0), buildings)
    with pytest.raises(DatasetError) as info:
        source.positions(TileSet("munich", buildings[None], (other.tile_id,), (other,)), 0)
    assert info.value.field == "sionna_dir" and "wildfed radio-data sionna" in info.value.fix
    # Procedural tiles cannot be ray-traced.
    with pytest.raises(ConfigError) as info:
        source.positions(TileSet("procedural", buildings[None], ("p/0",)), 0)
    assert info.value.field == "data"


def test_map_source_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        map_source("winprop", model=PathLossModel(), geometry=RadioMapGeometry())
    assert info.value.field == "data"
    with pytest.raises(ConfigError) as info:
        map_source("sionna", model=PathLossModel(), geometry=RadioMapGeometry())
    assert info.value.field == "sionna_dir"
    with pytest.raises(DatasetError) as info:
        map_source("sionna", model=PathLossModel(), geometry=RadioMapGeometry(), sionna_dir=tmp_path)
    assert info.value.field == "sionna_dir" and "wildfed radio-data sionna" in info.value.fix


def test_experiment_settings_check_the_data_fields():
    from wildfed_sim.radiomap import RadioMapSettings

    with pytest.raises(ConfigError) as info:
        RadioMapSettings(data="winprop")
    assert info.value.field == "data"
    with pytest.raises(ConfigError) as info:
        RadioMapSettings(data="sionna")
    assert info.value.field == "sionna_dir"
    with pytest.raises(ConfigError) as info:
        RadioMapSettings(validation_tiles=0)
    assert info.value.field == "validation_tiles"
