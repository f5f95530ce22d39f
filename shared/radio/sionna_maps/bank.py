"""A Sionna set on disk: generating it tile by tile with its ``manifest.json`` (:func:`generate_sionna_set`), and
reading it back without Sionna (:class:`SionnaBank`); the layout is "Files" in :mod:`shared.radio.sionna_maps`."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from shared.errors import ConfigError, DatasetError
from shared.radio.dataset import RadioMapGeometry
from shared.radio.scenes import SceneTile, scene_grid
from shared.radio.sionna_maps.settings import SionnaSettings
from shared.radio.sionna_maps.tiles import TracedTile, installed_version, read_tile, tile_file, tile_key, write_tile
from shared.radio.sionna_maps.trace import trace_tile

MANIFEST_FORMAT = "wildfed.sionna-radiomaps/1"


def _read_manifest(out_dir: Path) -> dict[str, object] | None:
    path = out_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read the manifest: {exc}", source=path,
                           fix="delete the folder and generate the set again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DatasetError(f"not a {MANIFEST_FORMAT} manifest", source=path, field="format",
                           fix="point at a folder written by `wildfed radio-data sionna`")
    return manifest


def _manifest_head(settings: SionnaSettings, geometry: RadioMapGeometry,
                   coverage_window: tuple[float, float]) -> dict[str, object]:
    return {"format": MANIFEST_FORMAT, "settings": dataclasses.asdict(settings),
            "geometry": dataclasses.asdict(geometry), "tile_coverage": list(coverage_window),
            "sionna_rt": installed_version("sionna-rt")}


def generate_sionna_set(out_dir: str | os.PathLike[str], tiles: Sequence[SceneTile], settings: SionnaSettings, *,
                        geometry: RadioMapGeometry = RadioMapGeometry(),
                        coverage_window: tuple[float, float] = (0.15, 0.6),
                        trace: Callable[..., TracedTile] | None = None,
                        progress: Callable[[str, int, int, int], object] | None = None) -> list[dict[str, object]]:
    """Trace ``tiles`` into ``out_dir`` (files and manifest: "Files" in :mod:`shared.radio.sionna_maps`), skipping
    tiles whose file already holds the same key; the manifest is rewritten after every tile, so an interrupted run
    keeps its work.

    Args:
        out_dir: the set's folder (one settings per folder).
        tiles: tiles of :func:`shared.radio.scenes.scene_grid` with ``geometry`` and ``coverage_window``.
        settings: the solver's settings.
        trace: the tracer (default :func:`trace_tile`; tests pass a stand-in).
        progress: ``progress(tile_id, done, total, samples_per_tx)`` after each batch.

    Returns:
        one record per tile: ``{"tile", "file", "transmitters", "coverage_mean", "coverage_min",
        "samples_per_tx", "elapsed_s", "cached"}``.

    Raises:
        SionnaUnavailable: Sionna RT cannot run and a tile needs tracing.
        DatasetError (field ``out``): ``out_dir`` holds a set of other settings, geometry or tile coverage.
    """
    out = Path(out_dir)
    head = _manifest_head(settings, geometry, coverage_window)
    manifest = _read_manifest(out)
    if manifest is not None:
        if {k: manifest.get(k) for k in head} != json.loads(json.dumps(head)):
            raise DatasetError("this folder holds a Sionna set made with other settings", source=out, field="out",
                               fix="use another --out folder, or the settings of its manifest.json")
    else:
        manifest = {**head, "tiles": {}}
    tracer = trace_tile if trace is None else trace
    records = []
    for tile in tiles:
        if tile.size_px != geometry.size_px or tile.metres_per_pixel != float(geometry.metres_per_pixel):
            raise ConfigError(f"{tile.tile_id} is not a tile of this geometry", field="tiles",
                              fix="cut the tiles with scene_grid(scene, geometry=geometry)")
        path = tile_file(out, tile, settings)
        key = tile_key(tile, settings)
        cached = True
        try:
            traced = read_tile(path, key=key)
        except DatasetError:
            cached = False
            traced = tracer(tile, settings, progress=None if progress is None else
                            (lambda done, total, spt, t=tile.tile_id: progress(t, done, total, spt)))
            write_tile(path, traced)
        record = {"tile": tile.tile_id, "file": str(path.relative_to(out)), "transmitters": int(len(traced.transmitters)),
                  "coverage_mean": float(traced.coverage.mean()), "coverage_min": float(traced.coverage.min()),
                  "samples_per_tx": sorted({int(s) for s in traced.samples_per_tx}),
                  "elapsed_s": float(traced.elapsed_s), "cached": cached}
        records.append(record)
        manifest["tiles"][tile.tile_id] = {k: v for k, v in record.items() if k not in ("tile", "cached")}
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".manifest.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, out / "manifest.json")
    return records


class SionnaBank:
    """A Sionna set read back for the experiment (no Sionna import): transmitter positions and path gains by tile.

    Args:
        out_dir: a folder written by :func:`generate_sionna_set` (``wildfed radio-data sionna --out DIR``).
        geometry: the map geometry the reader expects.

    Raises:
        DatasetError (a ConfigError): no or a malformed manifest, or a set of another geometry.
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, geometry: RadioMapGeometry = RadioMapGeometry()) -> None:
        self.out_dir = Path(out_dir)
        manifest = _read_manifest(self.out_dir)
        if manifest is None:
            raise DatasetError("no manifest.json: not a Sionna set", source=self.out_dir, field="sionna_dir",
                               fix="generate one with `wildfed radio-data sionna --out DIR --scene NAME --tiles all`")
        if manifest.get("geometry") != dataclasses.asdict(geometry):
            raise DatasetError(f"the set's geometry {manifest.get('geometry')} is not {dataclasses.asdict(geometry)}",
                               source=self.out_dir, field="geometry", fix="generate a set with this geometry")
        try:
            self.settings = SionnaSettings(**manifest["settings"])
            self.coverage_window = tuple(float(c) for c in manifest["tile_coverage"])
            self.entries = dict(manifest["tiles"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"malformed manifest: {exc}", source=self.out_dir / "manifest.json",
                               fix="delete the folder and generate the set again") from exc
        self.geometry = geometry
        self._tiles: dict[str, TracedTile] = {}

    def tile(self, tile: SceneTile) -> TracedTile:
        """The traced maps of ``tile`` (read once, then kept in memory).

        Raises:
            DatasetError (field ``sionna_dir``): the set has no file for the tile (the fix names the command that
                traces it), or the file does not match the tile and the set's settings.
        """
        if tile.tile_id in self._tiles:
            return self._tiles[tile.tile_id]
        path = tile_file(self.out_dir, tile, self.settings)
        if tile.tile_id not in self.entries or not path.is_file():
            raise DatasetError(f"the Sionna set has no tile {tile.tile_id} (tile {tile.index} of {tile.scene})",
                               source=self.out_dir, field="sionna_dir",
                               fix=f"wildfed radio-data sionna --out {self.out_dir} --scene {tile.scene} --tiles all "
                                   "(with the settings of its manifest.json)")
        traced = read_tile(path, key=tile_key(tile, self.settings))
        self._tiles[tile.tile_id] = traced
        return traced

    def tiles_of(self, scene: str) -> tuple[SceneTile, ...]:
        """The scene's grid tiles (:func:`shared.radio.scenes.scene_grid` at the set's geometry and coverage)."""
        return scene_grid(scene, geometry=self.geometry, coverage=self.coverage_window)
