"""The radio-map generator: Friis and COST 231 multi-wall golden numbers, normalisation, city tiles, files, cache.

Expected values are computed here by hand from the closed forms (Friis with the textbook -147.55 dB constant,
wall counts read off the geometry), not taken from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.errors import ConfigError, DatasetError
from shared.radio import (
    BUILDING_CHANNEL,
    TRANSMITTER_CHANNEL,
    PathLossModel,
    RadioMapGeometry,
    RadioMapSet,
    cached_maps,
    city_tiles,
    count_wall_crossings,
    denormalise_gain,
    free_space_path_loss_db,
    generate_maps,
    model_inputs,
    normalise_gain,
    outdoor_position,
    path_loss_db,
    procedural_city,
    transmitter_specs,
)

F = 3.5e9


def friis_by_hand(distance_m: float, frequency_hz: float = F) -> float:
    return 20 * math.log10(distance_m) + 20 * math.log10(frequency_hz) - 147.55


# ---------------------------------------------------------------- free space


def test_friis_at_100_m_and_3_5_ghz_is_83_3_db() -> None:
    # 20 log10(100) = 40; 20 log10(3.5e9) = 190.881; 40 + 190.881 - 147.55 = 83.331
    assert free_space_path_loss_db(100.0, F) == pytest.approx(83.33, abs=0.01)
    out = free_space_path_loss_db(np.array([[1.0, 10.0]]), F)
    assert out.dtype == np.float64 and out.shape == (1, 2)
    assert out[0, 1] - out[0, 0] == pytest.approx(20.0)  # 20 dB per decade of distance


@pytest.mark.parametrize("tx, rx, mpp", [
    ((4, 4), (16, 20), 5.0),    # offset (12, 16): 20 px = 100 m
    ((4, 4), (7, 8), 4.0),      # offset (3, 4): 5 px = 20 m
    ((20, 25), (14, 17), 4.0),  # offset (-6, -8): 10 px = 40 m
    ((4, 4), (4, 30), 2.5),     # 26 px on a row = 65 m
])
def test_free_space_map_matches_friis_at_pixel_distances(tx, rx, mpp) -> None:
    buildings = np.zeros((32, 32), dtype=bool)
    loss = path_loss_db(buildings, tx, model=PathLossModel(), metres_per_pixel=mpp)
    distance_m = math.hypot(rx[0] - tx[0], rx[1] - tx[1]) * mpp
    assert loss.dtype == np.float32 and loss.shape == (32, 32)
    assert float(loss[rx]) == pytest.approx(friis_by_hand(distance_m), abs=0.01)


def test_free_space_100_m_map_pixel_is_83_3_db() -> None:
    loss = path_loss_db(np.zeros((32, 32), dtype=bool), (4, 4), model=PathLossModel(), metres_per_pixel=5.0)
    assert float(loss[16, 20]) == pytest.approx(83.33, abs=0.01)


def test_transmitter_pixel_uses_the_distance_floor() -> None:
    model = PathLossModel(min_distance_m=2.0)
    loss = path_loss_db(np.zeros((8, 8), dtype=bool), (3, 3), model=model, metres_per_pixel=4.0)
    assert float(loss[3, 3]) == pytest.approx(friis_by_hand(2.0), abs=0.01)  # 49.35 dB


# ---------------------------------------------------------------- walls


def _slab(columns: slice, shape: tuple[int, int] = (9, 20)) -> np.ndarray:
    buildings = np.zeros(shape, dtype=bool)
    buildings[:, columns] = True
    return buildings


@pytest.mark.parametrize("columns", [slice(8, 9), slice(8, 11)])  # one pixel thick, three pixels thick
def test_single_slab_costs_two_walls_behind_and_one_inside(columns) -> None:
    model = PathLossModel(wall_loss_db=12.0)
    mpp = 4.0
    buildings = _slab(columns)
    tx = (4, 1)
    loss = path_loss_db(buildings, tx, model=model, metres_per_pixel=mpp)
    behind, inside, front = (4, 15), (4, 8), (4, 5)
    assert float(loss[behind]) == pytest.approx(friis_by_hand(14 * mpp) + 2 * 12.0, abs=0.01)
    assert float(loss[inside]) == pytest.approx(friis_by_hand(7 * mpp) + 1 * 12.0, abs=0.01)
    assert float(loss[front]) == pytest.approx(friis_by_hand(4 * mpp), abs=0.01)


def test_oblique_ray_through_a_full_height_slab_crosses_twice() -> None:
    buildings = _slab(slice(8, 11), shape=(16, 20))
    walls = count_wall_crossings(buildings, (15, 1))
    assert walls.dtype == np.int64 and walls.shape == (16, 20)
    assert walls[0, 19] == 2 and walls[3, 14] == 2  # any receiver right of the slab
    assert walls[5, 9] == 1  # inside: the entry crossing only
    assert np.all(walls[:, :8] == 0)  # left of the slab: line of sight


def test_two_slabs_four_walls_and_the_cap() -> None:
    buildings = np.zeros((5, 30), dtype=bool)
    buildings[:, 5:7] = True
    buildings[:, 12:14] = True
    assert count_wall_crossings(buildings, (2, 0))[2, 20] == 4
    capped = PathLossModel(wall_loss_db=10.0, max_walls=3)
    loss = path_loss_db(buildings, (2, 0), model=capped, metres_per_pixel=4.0)
    assert float(loss[2, 20]) == pytest.approx(friis_by_hand(80.0) + 3 * 10.0, abs=0.01)


# ---------------------------------------------------------------- normalisation


def test_normalisation_is_linear_clipped_and_zero_on_buildings() -> None:
    model = PathLossModel(gain_min_db=-147.0, gain_max_db=-47.0)
    loss = np.array([[97.0, 40.0, 200.0, 147.0, 72.0]], dtype=np.float32)
    buildings = np.array([[False, False, False, False, True]])
    gain = normalise_gain(loss, buildings, model)
    assert gain.dtype == np.float32
    # -97 dB is half-way in [-147, -47]; -40 clips to 1; -200 clips to 0; -147 is 0; building -> 0
    np.testing.assert_allclose(gain, [[0.5, 1.0, 0.0, 0.0, 0.0]], atol=1e-6)


def test_denormalise_inverts_in_range_values() -> None:
    model = PathLossModel(gain_min_db=-150.0, gain_max_db=-50.0)
    loss = np.array([[60.0, 75.5, 149.0], [100.0, 51.0, 120.25]], dtype=np.float32)
    gain = normalise_gain(loss, np.zeros((2, 3), dtype=bool), model)
    np.testing.assert_allclose(denormalise_gain(gain, model), -loss, atol=1e-4)
    assert denormalise_gain(np.float32(0.25), model) == pytest.approx(-125.0)


# ---------------------------------------------------------------- city tiles


def test_procedural_city_is_deterministic_per_seed() -> None:
    a = procedural_city(np.random.default_rng(7))
    b = procedural_city(np.random.default_rng(7))
    c = procedural_city(np.random.default_rng(8))
    assert a.dtype == np.bool_ and a.shape == (64, 64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_procedural_city_coverage_and_streets_over_seeds() -> None:
    for seed in range(20):
        tile = procedural_city(np.random.default_rng(seed), size_px=64, metres_per_pixel=4.0)
        assert 0.30 <= tile.mean() <= 0.45
        assert (~tile).all(axis=1).any() and (~tile).all(axis=0).any()  # a full street each way


def test_outdoor_position_is_outdoors_and_in_the_disk() -> None:
    rng = np.random.default_rng(3)
    tile = procedural_city(rng)
    for _ in range(200):
        row, col = outdoor_position(tile, rng, centre=(20.0, 30.0), radius_px=10.0)
        assert isinstance(row, int) and isinstance(col, int)
        assert not tile[row, col]
        assert (row - 20) ** 2 + (col - 30) ** 2 <= 100
    with pytest.raises(ConfigError):
        outdoor_position(np.ones((8, 8), dtype=bool), rng)


# ---------------------------------------------------------------- map sets


@pytest.fixture(scope="module")
def small_set() -> RadioMapSet:
    rng = np.random.default_rng(11)
    geometry = RadioMapGeometry(size_px=32, metres_per_pixel=8.0)
    tiles = city_tiles(rng, 2, geometry=geometry)
    specs = transmitter_specs(tiles, 3, rng)
    return generate_maps(tiles, specs, model=PathLossModel(), geometry=geometry)


def test_generate_maps_matches_the_single_map_functions() -> None:
    rng = np.random.default_rng(5)
    geometry = RadioMapGeometry(size_px=32, metres_per_pixel=8.0)
    tiles = city_tiles(rng, 2, geometry=geometry)
    specs = transmitter_specs(tiles, 2, rng)
    calls = []
    maps = generate_maps(tiles, specs, model=PathLossModel(), geometry=geometry,
                         progress=lambda done, total: calls.append((done, total)))
    assert len(maps) == 4 and calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    tile, row, col = (int(v) for v in specs[3])
    expected = normalise_gain(path_loss_db(tiles[tile], (row, col), model=PathLossModel(), metres_per_pixel=8.0),
                              tiles[tile], PathLossModel())
    np.testing.assert_array_equal(maps.targets[3, 0], expected)
    assert maps.inputs[3, TRANSMITTER_CHANNEL].sum() == 1 and maps.inputs[3, TRANSMITTER_CHANNEL, row, col] == 1
    np.testing.assert_array_equal(maps.inputs[3, BUILDING_CHANNEL], tiles[tile].astype(np.float32))
    assert maps.tiles.tolist() == [0, 0, 1, 1] and maps.transmitters.dtype == np.int64
    assert np.all((maps.targets >= 0) & (maps.targets <= 1))


def test_save_load_round_trip_is_exact(tmp_path, small_set) -> None:
    path = tmp_path / "maps.safetensors"
    small_set.save(path)
    loaded = RadioMapSet.load(path)
    for name in ("inputs", "targets", "transmitters", "tiles"):
        a, b = getattr(small_set, name), getattr(loaded, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert loaded.metres_per_pixel == 8.0
    sub = loaded.subset([4, 0])
    assert len(sub) == 2 and np.array_equal(sub.targets[0], small_set.targets[4])


def test_truncated_or_foreign_file_raises_dataset_error(tmp_path, small_set) -> None:
    path = tmp_path / "maps.safetensors"
    small_set.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="maps.safetensors"):
        RadioMapSet.load(path)
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(DatasetError):
        RadioMapSet.load(path)
    with pytest.raises(DatasetError):
        RadioMapSet.load(tmp_path / "missing.safetensors")


def test_cached_maps_reuses_on_equal_key_and_rebuilds_otherwise(tmp_path, small_set) -> None:
    path = tmp_path / "cache" / "maps.safetensors"
    builds = []

    def build() -> RadioMapSet:
        builds.append(1)
        return small_set

    first = cached_maps(path, build, key={"seed": 11, "sizes": (32, 8.0)})
    again = cached_maps(path, build, key={"sizes": [32, 8.0], "seed": 11})  # same key, other order / list
    assert len(builds) == 1 and np.array_equal(first.targets, again.targets)
    cached_maps(path, build, key={"seed": 12, "sizes": [32, 8.0]})
    assert len(builds) == 2
    path.write_bytes(b"garbage")  # an unreadable cache is rebuilt
    cached_maps(path, build, key={"seed": 12, "sizes": [32, 8.0]})
    assert len(builds) == 3 and [p.name for p in path.parent.iterdir()] == ["maps.safetensors"]


# ---------------------------------------------------------------- bad inputs


def _field(excinfo) -> str:
    return excinfo.value.field


def test_bad_inputs_name_the_field() -> None:
    model = PathLossModel()
    free = np.zeros((8, 8), dtype=bool)
    with pytest.raises(ValueError) as e:
        free_space_path_loss_db(10.0, 0.0)
    assert _field(e) == "frequency_hz"
    with pytest.raises(ValueError) as e:
        path_loss_db(free.astype(np.uint8), (1, 1), model=model, metres_per_pixel=4.0)
    assert _field(e) == "buildings"
    with pytest.raises(ValueError) as e:
        path_loss_db(free, (8, 1), model=model, metres_per_pixel=4.0)
    assert _field(e) == "tx" and "outside" in str(e.value)
    walled = free.copy()
    walled[2, 2] = True
    with pytest.raises(ValueError) as e:
        path_loss_db(walled, (2, 2), model=model, metres_per_pixel=4.0)
    assert _field(e) == "tx" and "inside a building" in str(e.value)
    with pytest.raises(ValueError) as e:
        path_loss_db(free, (1, 1), model=model, metres_per_pixel=0.0)
    assert _field(e) == "metres_per_pixel"
    with pytest.raises(ValueError) as e:
        PathLossModel(gain_min_db=-40.0, gain_max_db=-50.0)
    assert _field(e) == "gain_min_db"
    with pytest.raises(ValueError) as e:
        PathLossModel(wall_loss_db=-1.0)
    assert _field(e) == "wall_loss_db"
    with pytest.raises(ValueError) as e:
        model_inputs(free, (1, 9))
    assert _field(e) == "tx"
    with pytest.raises(ValueError) as e:
        generate_maps(free[None], np.array([[1, 0, 0]]), model=model, geometry=RadioMapGeometry(size_px=8))
    assert _field(e) == "specs"
    with pytest.raises(ValueError) as e:
        RadioMapSet(inputs=np.zeros((1, 2, 4, 4), np.float32), targets=np.zeros((1, 1, 4, 4), np.float64),
                    transmitters=np.zeros((1, 2), np.int64), tiles=np.zeros(1, np.int64), metres_per_pixel=4.0)
    assert _field(e) == "targets"
    with pytest.raises(ValueError) as e:
        procedural_city(np.random.default_rng(0), coverage=(0.5, 0.4))
    assert _field(e) == "coverage"
    with pytest.raises(ValueError) as e:
        cached_maps("unused.safetensors", lambda: None, key={"bad": object()})
    assert _field(e) == "key"
