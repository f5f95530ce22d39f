"""The Sionna RT data set (shared.radio.sionna_maps, ``wildfed radio-data sionna``; docs/radiomap-data.md).

Most tests need neither Sionna nor Mitsuba nor Dr.Jit: settings, transmitter grids worked out by hand, the npz files
and their keys, the set's manifest with a stand-in tracer, and the install checks (LLVM library, missing modules),
which must name the fix. The last test ray-traces one transmitter on one Munich tile through the command, in a
subprocess (a crashing LLVM must not take pytest down); it is skipped cleanly unless sionna-rt, mitsuba, drjit and
Debian's libllvm19 are all installed, which the default install is not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.errors import ConfigError, DatasetError
from shared.radio.scenes import SceneTile, scene_grid
from shared.radio.sionna_maps import availability
from shared.radio.sionna_maps import (
    INSTALL_STEPS,
    SionnaSettings,
    SionnaUnavailable,
    TracedTile,
    bank_positions,
    check_sionna,
    generate_sionna_set,
    llvm_library,
    read_tile,
    tile_file,
    tile_key,
    write_tile,
)

ROOT = Path(__file__).resolve().parents[2]


def _tile(buildings: np.ndarray, *, row: int = 0, col: int = 0, scene: str = "munich") -> SceneTile:
    return SceneTile(scene, 0, row, col, buildings.shape[0], 4.0, (100.0, 200.0), buildings)


def _traced(tile: SceneTile, settings: SionnaSettings, gain_value: float = 1e-9) -> TracedTile:
    tx = bank_positions(tile, settings)
    gain = np.full((len(tx), *tile.buildings.shape), gain_value, dtype=np.float32)
    return TracedTile(tile_key(tile, settings), tile.buildings.copy(), tx, gain, np.full(len(tx), 1000),
                      np.full(len(tx), 0.95), 2.5)


def test_settings_reject_a_transmitter_on_the_measurement_surface_and_bad_ranges():
    with pytest.raises(ConfigError) as info:
        SionnaSettings(tx_height_m=1.5, rx_height_m=1.5)
    assert info.value.field == "tx_height_m" and "direct rays" in info.value.fix
    for field, value in (("min_coverage", 0.0), ("max_depth", 0), ("samples_per_tx", 10), ("tx_step_px", 0),
                         ("tx_per_tile", 0), ("frequency_hz", -1.0), ("diffraction", "yes")):
        with pytest.raises(ConfigError) as info:
            SionnaSettings(**{field: value})
        assert info.value.field == field
    with pytest.raises(ConfigError) as info:
        SionnaSettings(samples_per_tx=2000, max_samples_per_tx=1000)
    assert info.value.field == "max_samples_per_tx"


def test_bank_positions_are_the_outdoor_pixels_of_the_grid():
    buildings = np.zeros((8, 8), dtype=bool)
    buildings[1, 1] = True   # on the grid: left out
    buildings[2, 2] = True   # off the grid: irrelevant
    tile = _tile(buildings)
    # step 2, offset 1: rows and columns 1, 3, 5, 7 -> 16 points, minus (1, 1)
    expected = [[r, c] for r in (1, 3, 5, 7) for c in (1, 3, 5, 7) if (r, c) != (1, 1)]
    np.testing.assert_array_equal(bank_positions(tile, SionnaSettings(tx_step_px=2)), expected)
    # step 3, offset 1: rows and columns 1, 4, 7 -> 9 points, minus (1, 1)
    assert len(bank_positions(tile, SionnaSettings(tx_step_px=3))) == 8
    # A subset: 4 distinct grid points in row-major order, the same every time, another for another tile position.
    sub = bank_positions(tile, SionnaSettings(tx_step_px=2, tx_per_tile=4))
    assert len(sub) == 4 and {tuple(p) for p in sub.tolist()} <= {tuple(p) for p in expected}
    assert sub.tolist() == sorted(sub.tolist())
    np.testing.assert_array_equal(sub, bank_positions(tile, SionnaSettings(tx_step_px=2, tx_per_tile=4)))
    with pytest.raises(ConfigError) as info:
        bank_positions(_tile(np.ones((8, 8), dtype=bool)), SionnaSettings())
    assert info.value.field == "tx_step_px"


def test_tile_file_names_the_tile_and_hashes_the_settings(tmp_path):
    tile = _tile(np.zeros((8, 8), dtype=bool), row=6, col=18)
    a = tile_file(tmp_path, tile, SionnaSettings())
    b = tile_file(tmp_path, tile, SionnaSettings(max_depth=12))
    assert a.parent == tmp_path / "munich" and a.name.startswith("munich-r006c018-") and a.suffix == ".npz"
    assert a != b and len(a.stem.split("-")[-1]) == 12
    assert tile.tile_id == "munich/r006c018"


def test_traced_tile_round_trip_and_rejections(tmp_path):
    settings = SionnaSettings(tx_step_px=4)
    tile = _tile(np.zeros((8, 8), dtype=bool))
    traced = _traced(tile, settings)
    path = tile_file(tmp_path, tile, settings)
    write_tile(path, traced)
    back = read_tile(path, key=tile_key(tile, settings))
    np.testing.assert_array_equal(back.path_gain, traced.path_gain)
    np.testing.assert_array_equal(back.transmitters, traced.transmitters)
    assert back.elapsed_s == 2.5 and back.tile_id == "munich/r000c000"
    assert back.gain_db()[0, 0, 0] == pytest.approx(-90.0)           # 10 log10(1e-9)
    assert not list(tmp_path.rglob("*.tmp*"))                       # written atomically, nothing left over
    with pytest.raises(DatasetError) as info:                        # traced with other settings
        read_tile(path, key=tile_key(tile, SionnaSettings(tx_step_px=4, max_depth=3)))
    assert info.value.field == "key"
    broken = tmp_path / "broken.npz"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DatasetError):
        read_tile(broken)
    bad = dataclasses.replace(traced, path_gain=-traced.path_gain)
    write_tile(tmp_path / "negative.npz", bad)
    with pytest.raises(DatasetError) as info:
        read_tile(tmp_path / "negative.npz")
    assert info.value.field == "path_gain"


def test_generate_keeps_traced_tiles_and_refuses_a_folder_of_other_settings(tmp_path):
    from shared.radio import RadioMapGeometry

    geometry = RadioMapGeometry(size_px=8, metres_per_pixel=4.0)
    settings = SionnaSettings(tx_step_px=4)
    tiles = [_tile(np.zeros((8, 8), dtype=bool), row=0, col=0), _tile(np.eye(8, dtype=bool), row=0, col=8)]
    calls = []

    def fake_trace(tile, s, progress=None):
        calls.append(tile.tile_id)
        return _traced(tile, s)

    records = generate_sionna_set(tmp_path, tiles, settings, geometry=geometry, trace=fake_trace)
    assert calls == ["munich/r000c000", "munich/r000c008"] and not any(r["cached"] for r in records)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format"] == "wildfed.sionna-radiomaps/1" and set(manifest["tiles"]) == set(calls)
    assert manifest["settings"] == dataclasses.asdict(settings)
    again = generate_sionna_set(tmp_path, tiles, settings, geometry=geometry, trace=fake_trace)
    assert len(calls) == 2 and all(r["cached"] for r in again)        # nothing traced twice
    assert [r["coverage_mean"] for r in again] == [0.95, 0.95]
    with pytest.raises(DatasetError) as info:
        generate_sionna_set(tmp_path, tiles, SionnaSettings(tx_step_px=2), geometry=geometry, trace=fake_trace)
    assert info.value.field == "out"
    with pytest.raises(ConfigError) as info:                            # a tile of another geometry
        generate_sionna_set(tmp_path / "b", [_tile(np.zeros((16, 16), dtype=bool))], settings, geometry=geometry,
                            trace=fake_trace)
    assert info.value.field == "tiles"


def test_llvm_library_names_the_fix_for_a_missing_or_crashing_llvm(tmp_path, monkeypatch):
    with pytest.raises(SionnaUnavailable) as info:
        llvm_library(environ={"DRJIT_LIBLLVM_PATH": str(tmp_path / "nope.so")})
    assert info.value.field == "DRJIT_LIBLLVM_PATH" and "libllvm19" in info.value.fix
    old = tmp_path / "libLLVM-15.so"
    old.write_bytes(b"")
    with pytest.raises(SionnaUnavailable) as info:
        llvm_library(environ={"DRJIT_LIBLLVM_PATH": str(old)})
    assert "LLVM 15" in str(info.value) and "crashes" in str(info.value)
    good = tmp_path / "libLLVM-19.so"
    good.write_bytes(b"")
    assert llvm_library(environ={"DRJIT_LIBLLVM_PATH": str(good)}) == good
    # Unset: a libLLVM-19 at a standard place is found and put in the environment given; none found is an error.
    monkeypatch.setattr(availability, "_LLVM_CANDIDATES", (str(tmp_path / "libLLVM-1[9].so"),))
    env: dict[str, str] = {}
    assert llvm_library(environ=env) == good and env["DRJIT_LIBLLVM_PATH"] == str(good)
    monkeypatch.setattr(availability, "_LLVM_CANDIDATES", (str(tmp_path / "absent-*.so"),))
    with pytest.raises(SionnaUnavailable) as info:
        llvm_library(environ={})
    assert "apt-get install -y libllvm19" in info.value.fix


def test_check_sionna_names_missing_packages(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("mitsuba", "drjit")
                        else real(name, *a))
    with pytest.raises(SionnaUnavailable) as info:
        check_sionna(environ={})
    assert "drjit, mitsuba" in str(info.value) and info.value.fix == INSTALL_STEPS


def _scene_files() -> bool:
    try:
        scene_grid("etoile")
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _scene_files(), reason="sionna-rt's scene files are not installed (pip install --no-deps "
                    "sionna-rt==2.2.0)")
def test_the_command_without_sionna_fails_with_the_install_steps(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from wildfed_sim.cli import app

    monkeypatch.setattr(availability, "_LLVM_CANDIDATES", (str(tmp_path / "absent-*.so"),))
    monkeypatch.delenv("DRJIT_LIBLLVM_PATH", raising=False)
    result = CliRunner().invoke(app, ["radio-data", "sionna", "--out", str(tmp_path / "set"), "--scene", "etoile",
                                      "--tile", "0"], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert "DRJIT_LIBLLVM_PATH" in result.output and "apt-get install -y libllvm19" in result.output
    assert not (tmp_path / "set").exists()  # nothing written
    result = CliRunner().invoke(app, ["radio-data", "sionna", "--out", str(tmp_path / "set"), "--scene", "etoile",
                                      "--tile", "9"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "outside etoile's 4 tiles" in result.output


def _sionna_runs_here() -> bool:
    try:
        check_sionna(environ=dict(os.environ))  # a copy: the skip check changes nothing
    except SionnaUnavailable:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _sionna_runs_here(), reason="Sionna RT is not installed (sionna-rt with mitsuba and drjit, "
                    "Debian's libllvm19; docs/radiomap-data.md); the default install does not need it")
def test_the_command_ray_traces_a_munich_tile_with_line_of_sight_at_friis_or_above(tmp_path):
    from shared.radio.pathloss import count_wall_crossings
    from shared.radio.scenes import scene_grid

    out = tmp_path / "set"
    # Munich tile 4: its one --tx-per-tile transmitter, (25, 57), sees 1,657 pixels with no wall on the direct ray.
    cmd = [sys.executable, "-m", "wildfed_sim.cli", "radio-data", "sionna", "--out", str(out), "--scene", "munich",
           "--tile", "4", "--tx-per-tile", "1", "--samples-per-tx", "300000", "--max-samples-per-tx", "300000",
           "--max-depth", "3", "--min-coverage", "0.01"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "outdoor pixels with a value" in run.stdout
    tile = scene_grid("munich")[4]
    settings = SionnaSettings(tx_per_tile=1, samples_per_tx=300000, max_samples_per_tx=300000, max_depth=3,
                              min_coverage=0.01)
    traced = read_tile(tile_file(out, tile, settings), key=tile_key(tile, settings))
    tx = tuple(int(v) for v in traced.transmitters[0])
    assert tx == (25, 57) and not tile.buildings[tx]
    gain_db = traced.gain_db()[0]
    assert np.unravel_index(np.argmax(gain_db), gain_db.shape) == tx          # strongest at the transmitter
    # Line of sight (no wall on the raster's direct ray), 12-80 m away: Sionna sums the powers of the direct ray
    # (Friis at the 3-D distance, transmitter 6 m and receiver 1.5 m above the flat ground) and of reflections,
    # so it lies at Friis or a few dB above, never well below.
    rows, cols = np.indices(gain_db.shape)
    ground_m = 4.0 * np.hypot(rows - tx[0], cols - tx[1])
    distance = np.sqrt(ground_m ** 2 + 4.5 ** 2)
    friis_db = -(20 * np.log10(distance) + 20 * np.log10(3.5e9) - 147.55)
    los = (count_wall_crossings(tile.buildings, tx) == 0) & (ground_m >= 12) & (ground_m <= 80) & np.isfinite(gain_db)
    assert los.sum() > 300
    excess = gain_db[los] - friis_db[los]
    assert -1.0 <= float(np.median(excess)) <= 3.0
    assert float(np.percentile(excess, 5)) >= -1.5
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tiles"][tile.tile_id]["transmitters"] == 1
    assert 0 < manifest["tiles"][tile.tile_id]["coverage_mean"] <= 1
