"""``wildfed radio-data``: the radio-map experiment's tiles, and the Sionna RT data set (docs/radiomap-data.md).

- ``wildfed radio-data tiles``: each sionna-rt scene's disjoint 256 m tiles (:func:`shared.radio.scenes.scene_grid`)
  with their building coverage and how many transmitter positions a Sionna set traces on each.
- ``wildfed radio-data sionna --out DIR --scene munich --tiles all`` (or ``--tile 4 --tile 7``): ray-traces the tiles with Sionna RT
  (:mod:`shared.radio.sionna_maps`), one npz per tile under ``DIR/<scene>/`` and ``DIR/manifest.json``; tiles already
  traced with the same settings are kept. ``wildfed experiment radiomap --data sionna --sionna-dir DIR`` reads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.radio import SCENES, RadioMapGeometry
from shared.radio.scenes import SceneTile, scene_grid
from shared.radio.sionna_maps import SionnaSettings, bank_positions, check_sionna, generate_sionna_set

__all__ = ["select_tiles", "tiles_report", "run_sionna"]


def select_tiles(scene: str, tiles: str = "all", *, indices: Sequence[int] | None = None,
                 geometry: RadioMapGeometry = RadioMapGeometry()) -> list[SceneTile]:
    """The tiles of ``scene`` (:func:`shared.radio.scenes.scene_grid`): those at ``indices`` if given, else
    ``tiles``: ``all`` or a count ``N`` (the first N of the grid).

    Raises:
        ConfigError (field ``tiles``): not ``all`` or a count in range, or an index outside the grid (the message
            gives its size); (field ``city``) an unknown scene or sionna-rt's files missing.
    """
    grid = scene_grid(scene, geometry=geometry)
    fix = (f"use --tiles all or a count 1-{len(grid)}, or --tile I for indices 0-{len(grid) - 1} "
           "(wildfed radio-data tiles lists them)")
    if indices:
        bad = [i for i in indices if not 0 <= int(i) < len(grid)]
        if bad:
            raise ConfigError(f"tile indices {bad} are outside {scene}'s {len(grid)} tiles", field="tiles", fix=fix)
        return [grid[int(i)] for i in indices]
    if tiles.strip() == "all":
        return list(grid)
    try:
        count = int(tiles)
    except ValueError:
        raise ConfigError(f"--tiles {tiles!r} is neither all nor a count", field="tiles", fix=fix) from None
    if not 1 <= count <= len(grid):
        raise ConfigError(f"{scene} has {len(grid)} tiles, {count} asked for", field="tiles", fix=fix)
    return list(grid[:count])


def tiles_report(scenes: list[str], settings: SionnaSettings) -> list[dict[str, Any]]:
    """One row per grid tile of each scene: ``{"scene", "index", "tile", "coverage", "transmitters"}`` (the number
    of :func:`shared.radio.sionna_maps.bank_positions` under ``settings``)."""
    rows = []
    for scene in scenes:
        for tile in scene_grid(scene):
            rows.append({"scene": scene, "index": tile.index, "tile": tile.tile_id, "coverage": tile.coverage,
                         "transmitters": int(len(bank_positions(tile, settings)))})
    return rows


def run_sionna(out: Path, scenes: list[str], tiles: str, settings: SionnaSettings, *,
               indices: Sequence[int] | None = None, console: Any = None) -> dict[str, Any]:
    """Trace the chosen tiles (:func:`select_tiles`) of every scene into ``out`` (:func:`shared.radio.sionna_maps.generate_sionna_set`)
    and write ``out/report-<UTC time>.json``.

    Returns:
        ``{"tiles": [per-tile records], "elapsed_s", "maps", "traced_maps", "coverage_mean", "seconds_per_map"}``
        (coverage: outdoor pixels with a value, mean over every map; seconds per map over the tiles traced now).

    Raises:
        SionnaUnavailable: Sionna RT cannot run (checked before anything is traced); ConfigError: an unknown scene
            or bad ``tiles``; DatasetError: ``out`` holds a set of other settings.
    """
    unknown = [s for s in scenes if s not in SCENES]
    if unknown or not scenes:
        raise ConfigError(f"unknown scenes {unknown}", field="scene", fix=f"use one or more of {', '.join(SCENES)}")
    chosen = [t for s in scenes for t in select_tiles(s, tiles, indices=indices)]
    check_sionna()  # fail before any work, with the install steps
    started = time.monotonic()
    progress = None
    if console is not None:
        def progress(tile_id: str, done: int, total: int, spt: int) -> None:
            console.log(f"{tile_id}: {done}/{total} transmitters traced ({spt:,} rays per transmitter, "
                        f"{time.monotonic() - started:.0f} s)")
    records = generate_sionna_set(out, chosen, settings, progress=progress)
    elapsed = time.monotonic() - started
    maps = sum(r["transmitters"] for r in records)
    traced = [r for r in records if not r["cached"]]
    traced_maps = sum(r["transmitters"] for r in traced)
    report = {"tiles": records, "elapsed_s": elapsed, "maps": maps, "traced_maps": traced_maps,
              "coverage_mean": (sum(r["coverage_mean"] * r["transmitters"] for r in records) / maps) if maps else None,
              "seconds_per_map": (sum(r["elapsed_s"] for r in traced) / traced_maps) if traced_maps else None,
              "settings": settings.__dict__}
    out.mkdir(parents=True, exist_ok=True)
    (out / time.strftime("report-%Y%m%dT%H%M%SZ.json", time.gmtime())).write_text(json.dumps(report, indent=1))
    return report
