"""One seed's data for the radio-map experiment (:mod:`wildfed_sim.radiomap`, step 1 of its protocol): the tiles by
role, each client's site (secret centre and maps), the two validation sets and the public pretraining maps, cached
as safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.radio import RadioMapSet, cached_maps

from wildfed_sim.radio_tiles import MapSource, TilePlan, TileSet, draw_site, map_source, plan_tiles
from wildfed_sim.radiomap_settings import RadioMapSettings


# ------------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True, eq=False)
class SiteData:
    """One (real or shadow) site: its maps, its secret centre (row, col) in pixels (float64 (2,)) and the index of
    its tile in the tile set it was drawn on (its maps' ``tiles`` entries)."""

    maps: RadioMapSet
    centre_px: np.ndarray
    tile: int = 0


@dataclass(frozen=True, eq=False)
class ExperimentData:
    """One seed's data (module docstring, step 1).

    Attributes:
        tiles: the tiles by role (:class:`wildfed_sim.radio_tiles.TilePlan`); ``tiles.clients`` tile k is client k's.
        source: where the maps come from (COST 231 or a Sionna set).
        clients: client k's site on ``tiles.clients`` tile k.
        validation: maps on the held-out tiles of the same city.
        validation_other: maps on the other city's tiles.
        pretraining: public maps on ``tiles.public``.
    """

    tiles: TilePlan
    source: MapSource
    clients: list[SiteData]
    validation: RadioMapSet
    validation_other: RadioMapSet
    pretraining: RadioMapSet


def make_site(source: MapSource, tiles: TileSet, tile_index: int, n_maps: int, settings: RadioMapSettings,
              rng: np.random.Generator, *, centre: np.ndarray | None = None) -> SiteData:
    """A site on ``tiles[tile_index]`` (:func:`wildfed_sim.radio_tiles.draw_site`: a centre uniform over the tile's
    transmitter pixels, the first draw from ``rng``, unless ``centre`` is given, and ``n_maps`` maps with
    transmitters within ``site_radius_m`` of it).

    Raises:
        ConfigError: as :func:`wildfed_sim.radio_tiles.draw_site`.
    """
    maps, centre_px = draw_site(source, tiles, tile_index, n_maps,
                                radius_px=settings.site_radius_m / settings.metres_per_pixel, rng=rng, centre=centre)
    return SiteData(maps, centre_px, tile_index)


def _spread_maps(source: MapSource, tiles: TileSet, total: int, rng: np.random.Generator) -> RadioMapSet:
    """``total`` maps spread round-robin over the tiles, each transmitter uniform over its tile's positions."""
    positions = [source.positions(tiles, t) for t in range(len(tiles))]
    rows = []
    for i in range(int(total)):
        t = i % len(tiles)
        rows.append((t, *positions[t][int(rng.integers(len(positions[t])))]))
    return source.maps(tiles, np.asarray(rows, dtype=np.int64))


def prepare_data(settings: RadioMapSettings, seed: int, cache_dir: Path | None = None) -> ExperimentData:
    """The seed's tiles, clients, two validation sets and pretraining maps (module docstring, step 1); maps are
    cached as safetensors under ``cache_dir`` when given, keyed by the tiles' names and the source.

    Raises:
        ConfigError: too few tiles for the roles (:func:`wildfed_sim.radio_tiles.plan_tiles`), or a Sionna set
            without the tiles asked for (the fix names the command that traces them).
    """
    geometry = settings.geometry
    plan = plan_tiles(city=settings.city, validation_city=settings.validation_city, clients=settings.clients,
                      validation_tiles=settings.validation_tiles, public_tiles=settings.pretrain_tiles, seed=seed,
                      geometry=geometry)
    source = map_source(settings.data, model=settings.pathloss, geometry=geometry, sionna_dir=settings.sionna_dir)
    base = {"seed": seed, "city": settings.city, "source": source.key()}

    def cached(name: str, tiles: TileSet, build: Callable[[], RadioMapSet], **key: Any) -> RadioMapSet:
        if cache_dir is None:
            return build()
        return cached_maps(cache_dir / f"seed{seed}-{name}.safetensors", build,
                           key={**base, **key, "name": name, "tiles": list(tiles.ids)})

    clients = []
    radius_px = settings.site_radius_m / settings.metres_per_pixel
    for k in range(settings.clients):
        centre = draw_site_centre(source, plan.clients, k, np.random.default_rng([seed, 11, k]))
        maps = cached(f"client{k:02d}", plan.clients,
                      lambda k=k: make_site(source, plan.clients, k, settings.maps_per_client, settings,
                                            np.random.default_rng([seed, 11, k])).maps,
                      client=k, maps=settings.maps_per_client, radius_px=radius_px)
        clients.append(SiteData(maps, centre, k))
    validation = cached("validation", plan.validation,
                        lambda: _spread_maps(source, plan.validation, settings.validation_maps,
                                             np.random.default_rng([seed, 13])), maps=settings.validation_maps)
    other = cached("validation-other", plan.other_city,
                   lambda: _spread_maps(source, plan.other_city, settings.validation_maps,
                                        np.random.default_rng([seed, 14])), maps=settings.validation_maps)
    pretraining = cached("pretraining", plan.public,
                         lambda: _spread_maps(source, plan.public, len(plan.public) * settings.pretrain_maps_per_tile,
                                              np.random.default_rng([seed, 23])),
                         maps=settings.pretrain_maps_per_tile)
    return ExperimentData(plan, source, clients, validation, other, pretraining)


def draw_site_centre(source: MapSource, tiles: TileSet, index: int, rng: np.random.Generator) -> np.ndarray:
    """float64 (2,): the centre :func:`make_site` draws first from ``rng`` on ``tiles[index]`` (uniform over its
    transmitter pixels), without making the maps."""
    allowed = source.positions(tiles, index)
    return allowed[int(rng.integers(len(allowed)))].astype(np.float64)
