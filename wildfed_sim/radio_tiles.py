"""The radio-map experiment's tiles and map sources (docs/radiomap-data.md): who sits on which 256 m tile, and where the
maps come from (COST 231 multi-wall or Sionna RT).

**Tiles per seed** (:func:`plan_tiles`). Every tile is a 64 x 64 px, 4 m/px crop of a city's building raster, and the
four roles never share a tile:

- ``clients``: client k's site lies on tile k (its own tile; building data is public, like OpenStreetMap);
- ``validation``: held-out tiles of the same city;
- ``other_city``: tiles of another city (a second validation number: how far the federated model carries);
- ``public``: tiles of the remaining cities, for public pretraining, the gateways' allocator proxy sites and the
  ridge attacker's shadow sites.

For a sionna-rt scene the tiles are :func:`shared.radio.scenes.scene_grid`'s disjoint grid (munich 19 tiles,
florence 9, san_francisco 12, etoile 4 at the defaults); the seed permutes the city's tiles before the first
``clients`` go to the clients, and the rest (or the first ``validation_tiles`` of the rest) to validation. With
``city = munich`` the other city is florence and the public tiles are san_francisco's and etoile's (16). For
``procedural`` every role draws its own tiles from its own generator stream, and the "other city" is a procedural
old town (narrow streets, small blocks, coverage 0.45-0.6: :data:`OLD_TOWN`).

**Map sources.** A map is a (tile, transmitter pixel) pair; a source says which pixels may hold a transmitter and
computes the normalised gain maps (:class:`shared.radio.RadioMapSet`):

- :class:`Cost231Source`: any outdoor pixel; free space + COST 231 multi-wall (:func:`shared.radio.generate_maps`).
- :class:`SionnaSource`: the pixels a Sionna set traced (:func:`shared.radio.sionna_maps.bank_positions`, every
  outdoor pixel of a 2 px grid by default), read from ``wildfed radio-data sionna``'s folder and normalised with the
  same window (:func:`shared.radio.normalise_gain`; pixels no ray reached are 0, as below the window).

**Sites** (:func:`draw_site`): a centre drawn uniformly from the tile's transmitter pixels (or given: an attacker's
candidate), and maps whose transmitters are drawn uniformly, with replacement, from the transmitter pixels within the
site radius of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from shared.errors import ConfigError
from shared.radio import (
    SCENES,
    PathLossModel,
    RadioMapGeometry,
    RadioMapSet,
    city_tiles,
    generate_maps,
    model_inputs,
    normalise_gain,
)
from shared.radio.scenes import SceneTile, scene_grid

__all__ = ["OLD_TOWN", "PROCEDURAL", "TileSet", "TilePlan", "default_validation_city", "plan_tiles", "MapSource",
           "Cost231Source", "SionnaSource", "draw_site", "map_source"]

PROCEDURAL = "procedural"
#: The procedural "other city": an old town of narrow streets and small, dense blocks (shared.radio.procedural_city).
#: Building coverage of its tiles: median 0.52 (5-95 %: 0.47-0.57) at 64 px and 4 m/px, against 0.38 for the default
#: procedural city (measured over 30 seeds).
OLD_TOWN = {"street_width_m": (4.0, 8.0), "block_size_m": (30.0, 60.0), "max_building_m": 25.0,
            "courtyard_probability": 0.3, "setback_probability": 0.2, "park_probability": 0.05,
            "coverage": (0.3, 0.6)}
_OTHER_PROCEDURAL = "procedural-old-town"


@dataclass(frozen=True, eq=False)
class TileSet:
    """Named building tiles.

    Attributes:
        name: the city (a scene name, ``procedural`` or ``procedural-old-town``).
        buildings: bool (n, H, W), True inside buildings.
        ids: n stable names (``"munich/r006c018"``; ``"procedural/<stream>/<i>"``).
        scene_tiles: the :class:`shared.radio.scenes.SceneTile` of each, or None for procedural tiles.
    """

    name: str
    buildings: np.ndarray
    ids: tuple[str, ...]
    scene_tiles: tuple[SceneTile, ...] | None = None

    def __len__(self) -> int:
        """Number of tiles n."""
        return int(self.buildings.shape[0])

    @classmethod
    def from_scene(cls, name: str, tiles: Sequence[SceneTile]) -> TileSet:
        """A set of scene tiles (keeps their order)."""
        return cls(name, np.stack([t.buildings for t in tiles]).astype(bool), tuple(t.tile_id for t in tiles),
                   tuple(tiles))


@dataclass(frozen=True, eq=False)
class TilePlan:
    """One seed's tiles by role (module docstring)."""

    clients: TileSet
    validation: TileSet
    other_city: TileSet
    public: TileSet

    def roles(self) -> dict[str, TileSet]:
        """``{"clients", "validation", "other_city", "public"}`` -> tile set."""
        return {"clients": self.clients, "validation": self.validation, "other_city": self.other_city,
                "public": self.public}


def default_validation_city(city: str) -> str:
    """The other city of a federation city: florence for every scene but florence (munich for it), and the
    procedural old town for ``procedural``."""
    if city == PROCEDURAL:
        return _OTHER_PROCEDURAL
    return "florence" if city != "florence" else "munich"


def plan_tiles(*, city: str, validation_city: str | None, clients: int, validation_tiles: int | None,
               public_tiles: int, seed: int, geometry: RadioMapGeometry = RadioMapGeometry()) -> TilePlan:
    """The tiles of every role for one seed (module docstring).

    Args:
        city: the federation's city, a scene of :data:`shared.radio.SCENES` or ``procedural``.
        validation_city: the other city (None: :func:`default_validation_city`); a scene other than ``city``, or
            ``procedural-old-town`` with ``city = procedural``.
        clients: number of clients (one tile each).
        validation_tiles: held-out tiles of each validation set (None: every remaining tile of the city and every
            tile of the other city; 5 each for procedural).
        public_tiles: public tiles (pretraining, proxies, shadows); for scenes at most the remaining cities' tiles.
        seed: permutes the scene tiles; seeds the procedural streams ``default_rng([seed, 7, role])``.
        geometry: tile size and spacing.

    Returns:
        the :class:`TilePlan`.

    Raises:
        ConfigError (a ValueError): an unknown city or validation city (field ``city`` / ``validation_city``), too
            few tiles for the clients plus one validation tile (field ``clients``), or more public tiles than the
            public cities hold (field ``pretrain_tiles``), naming the counts.
    """
    other = default_validation_city(city) if validation_city is None else validation_city
    if city == PROCEDURAL:
        if other != _OTHER_PROCEDURAL:
            raise ConfigError(f"with city procedural the other city is {_OTHER_PROCEDURAL}, got {other!r}",
                              field="validation_city", fix=f"leave it out or use {_OTHER_PROCEDURAL}")
        n_val = 5 if validation_tiles is None else validation_tiles

        def draw(role: int, count: int, name: str, **options: object) -> TileSet:
            tiles = city_tiles(np.random.default_rng([seed, 7, role]), count, geometry=geometry, **options)
            return TileSet(name, tiles, tuple(f"{name}/seed{seed}-{role}/{i}" for i in range(count)))

        return TilePlan(draw(1, clients, PROCEDURAL), draw(2, n_val, PROCEDURAL),
                        draw(3, n_val, _OTHER_PROCEDURAL, **OLD_TOWN), draw(4, public_tiles, PROCEDURAL))
    if city not in SCENES:
        raise ConfigError(f"unknown city {city!r}", field="city", fix=f"use {PROCEDURAL} or one of {', '.join(SCENES)}")
    if other not in SCENES or other == city:
        raise ConfigError(f"the other city must be a scene other than {city!r}, got {other!r}",
                          field="validation_city", fix=f"use one of {', '.join(s for s in SCENES if s != city)}")
    grid = scene_grid(city, geometry=geometry)
    if len(grid) < clients + 1:
        raise ConfigError(f"{city} has {len(grid)} disjoint tiles, too few for {clients} clients and one held-out "
                          "validation tile", field="clients", fix=f"use at most {len(grid) - 1} clients")
    order = np.random.default_rng([seed, 7]).permutation(len(grid))
    rest = order[clients:] if validation_tiles is None else order[clients:clients + validation_tiles]
    if len(rest) == 0:
        raise ConfigError("no held-out validation tile", field="validation_tiles", fix="use at least 1")
    others = scene_grid(other, geometry=geometry)
    others = others if validation_tiles is None else others[:validation_tiles]
    pool = [t for s in SCENES if s not in (city, other) for t in scene_grid(s, geometry=geometry)]
    if public_tiles > len(pool):
        raise ConfigError(f"the public cities ({', '.join(s for s in SCENES if s not in (city, other))}) hold "
                          f"{len(pool)} tiles, {public_tiles} asked for", field="pretrain_tiles",
                          fix=f"use at most {len(pool)}")
    public_order = np.random.default_rng([seed, 8]).permutation(len(pool))[:public_tiles]
    return TilePlan(TileSet.from_scene(city, [grid[i] for i in order[:clients]]),
                    TileSet.from_scene(city, [grid[i] for i in rest]),
                    TileSet.from_scene(other, list(others)),
                    TileSet.from_scene("public", [pool[i] for i in public_order]))


# ------------------------------------------------------------------------------------------------ sources
class MapSource(Protocol):
    """Where the maps come from (module docstring)."""

    name: str

    def positions(self, tiles: TileSet, index: int) -> np.ndarray:
        """int64 (n, 2): the pixels of ``tiles[index]`` that may hold a transmitter (n >= 1)."""

    def maps(self, tiles: TileSet, specs: np.ndarray) -> RadioMapSet:
        """The maps of ``specs``, int (N, 3) rows (tile index, row, col), in order."""

    def key(self) -> dict[str, object]:
        """What the maps depend on besides the tiles, for cache keys (JSON-able)."""


@dataclass(frozen=True)
class Cost231Source:
    """Free space + COST 231 multi-wall maps on any outdoor pixel (:func:`shared.radio.generate_maps`; COST 231
    Final Report, 1999, ch. 4; docs/radiomap-data.md).

    Attributes:
        model: the path-loss model and normalisation window.
        geometry: the tiles' size (px) and spacing (m/px).
    """

    model: PathLossModel
    geometry: RadioMapGeometry = RadioMapGeometry()
    name: str = "cost231"

    def positions(self, tiles: TileSet, index: int) -> np.ndarray:
        """int64 (n, 2): every outdoor pixel of ``tiles[index]``, row-major."""
        return np.argwhere(~tiles.buildings[index]).astype(np.int64)

    def maps(self, tiles: TileSet, specs: np.ndarray) -> RadioMapSet:
        """:func:`shared.radio.generate_maps` on ``tiles.buildings``: inputs float32 (N, 2, H, W), targets float32
        (N, 1, H, W) in [0, 1].

        Raises:
            ConfigError: as :func:`shared.radio.generate_maps` (a bad spec, a transmitter in a building).
        """
        return generate_maps(tiles.buildings, np.asarray(specs, dtype=np.int64), model=self.model,
                             geometry=self.geometry)

    def key(self) -> dict[str, object]:
        """``{"data": "cost231", "pathloss": ..., "geometry": ...}``."""
        return {"data": self.name, "pathloss": dataclasses.asdict(self.model),
                "geometry": dataclasses.asdict(self.geometry)}


class SionnaSource:
    """Ray-traced maps of a Sionna set (``wildfed radio-data sionna``), normalised like the COST 231 maps.

    Args:
        sionna_dir: the set's folder.
        model: gives the normalisation window (``gain_min_db``, ``gain_max_db``).
        geometry: the maps' geometry (must be the set's).

    Raises:
        DatasetError (a ConfigError): not a Sionna set, or one of another geometry.
    """

    name = "sionna"

    def __init__(self, sionna_dir: str | Path, *, model: PathLossModel,
                 geometry: RadioMapGeometry = RadioMapGeometry()) -> None:
        from shared.radio.sionna_maps import SionnaBank

        self.bank = SionnaBank(sionna_dir, geometry=geometry)
        self.model = model
        self.geometry = geometry

    def _scene_tile(self, tiles: TileSet, index: int) -> SceneTile:
        if tiles.scene_tiles is None:
            raise ConfigError(f"tile {tiles.ids[index]} is procedural: Sionna traces the sionna-rt scenes only",
                              field="data", fix="use --data cost231 with --city procedural, or a scene city")
        return tiles.scene_tiles[index]

    def positions(self, tiles: TileSet, index: int) -> np.ndarray:
        """int64 (n, 2): the transmitter pixels the set traced on ``tiles[index]``.

        Raises:
            DatasetError: the set lacks the tile (the fix names the command to run).
        """
        return self.bank.tile(self._scene_tile(tiles, index)).transmitters.copy()

    def maps(self, tiles: TileSet, specs: np.ndarray) -> RadioMapSet:
        """The traced maps of ``specs``, int (N, 3) rows (tile index, row, col): path gain ``10 log10(g)`` dB mapped
        to [0, 1] by :func:`shared.radio.normalise_gain` (no ray: 0; buildings: 0), inputs float32 (N, 2, H, W) from
        :func:`shared.radio.model_inputs`, targets float32 (N, 1, H, W).

        Raises:
            ConfigError (field ``specs``): not an (N, 3) array with N >= 1 and tile indices of ``tiles``, or a
                transmitter the set did not trace on that tile.
        """
        specs = np.asarray(specs)
        if (specs.ndim != 2 or specs.shape[1] != 3 or len(specs) < 1 or not np.issubdtype(specs.dtype, np.integer)
                or specs[:, 0].min() < 0 or specs[:, 0].max() >= len(tiles)):
            raise ConfigError(f"must be an integer (N, 3) array of (tile, row, col) with tiles in [0, {len(tiles)})",
                              field="specs", fix="build it from SionnaSource.positions")
        specs = specs.astype(np.int64)
        n, side = len(specs), self.geometry.size_px
        inputs = np.empty((n, 2, side, side), dtype=np.float32)
        targets = np.empty((n, 1, side, side), dtype=np.float32)
        for i, (t, row, col) in enumerate(specs.tolist()):
            traced = self.bank.tile(self._scene_tile(tiles, t))
            hit = np.flatnonzero((traced.transmitters[:, 0] == row) & (traced.transmitters[:, 1] == col))
            if hit.size == 0:
                raise ConfigError(f"map {i}: {tiles.ids[t]} has no traced transmitter at ({row}, {col})",
                                  field="specs", fix="draw transmitters from SionnaSource.positions")
            with np.errstate(divide="ignore"):
                gain_db = 10.0 * np.log10(traced.path_gain[hit[0]].astype(np.float64))
            targets[i, 0] = normalise_gain(-gain_db, traced.buildings, self.model)
            inputs[i] = model_inputs(traced.buildings, (row, col))
        return RadioMapSet(inputs=inputs, targets=targets, transmitters=specs[:, 1:].copy(),
                           tiles=specs[:, 0].copy(), metres_per_pixel=float(self.geometry.metres_per_pixel))

    def key(self) -> dict[str, object]:
        """``{"data": "sionna", "sionna": <the set's settings>, "window": [min, max] dB, "geometry": ...}``."""
        return {"data": self.name, "sionna": dataclasses.asdict(self.bank.settings),
                "window": [self.model.gain_min_db, self.model.gain_max_db],
                "geometry": dataclasses.asdict(self.geometry)}


def map_source(data: str, *, model: PathLossModel, geometry: RadioMapGeometry,
               sionna_dir: str | Path | None = None) -> MapSource:
    """The source named ``data`` (``cost231`` or ``sionna``, the latter reading ``sionna_dir``).

    Raises:
        ConfigError: an unknown ``data`` (field ``data``), ``sionna`` without ``sionna_dir`` (field
            ``sionna_dir``), or a folder that is not a Sionna set of this geometry.
    """
    if data == "cost231":
        return Cost231Source(model, geometry)
    if data == "sionna":
        if sionna_dir is None:
            raise ConfigError("--data sionna needs the set's folder", field="sionna_dir",
                              fix="add --sionna-dir DIR (made by `wildfed radio-data sionna --out DIR ...`)")
        return SionnaSource(sionna_dir, model=model, geometry=geometry)
    raise ConfigError(f"unknown data source {data!r}", field="data", fix="use cost231 or sionna")


def draw_site(source: MapSource, tiles: TileSet, index: int, n_maps: int, *, radius_px: float,
              rng: np.random.Generator, centre: np.ndarray | None = None) -> tuple[RadioMapSet, np.ndarray]:
    """One base-station site on ``tiles[index]`` (module docstring, "Sites").

    Args:
        source: the map source (its ``positions`` are the allowed transmitter pixels).
        tiles, index: the site's tile.
        n_maps: maps of the site, >= 1.
        radius_px: transmitters lie within this distance of the centre, in pixels.
        rng: the only randomness: the centre (unless given) is the first draw, then the transmitters.
        centre: float (2,) ``(row, col)`` in pixels, an attacker's candidate; None: drawn.

    Returns:
        (the maps, tile index ``index`` on every map; the centre, float64 (2,) (row, col) in pixels).

    Raises:
        ConfigError: ``index`` not a tile of ``tiles`` (field ``tile_index``), ``n_maps`` not an int >= 1 (field
            ``n_maps``), ``radius_px`` not a number >= 0 (field ``radius_px``), or no allowed transmitter pixel within
            ``radius_px`` of ``centre`` (field ``centre``).
    """
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(tiles):
        raise ConfigError(f"must be a tile index in [0, {len(tiles)}), got {index!r}", field="tile_index",
                          fix="pick one of the set's tiles")
    if isinstance(n_maps, bool) or not isinstance(n_maps, (int, np.integer)) or n_maps < 1:
        raise ConfigError(f"must be an int >= 1, got {n_maps!r}", field="n_maps", fix="ask for at least one map")
    if isinstance(radius_px, bool) or not isinstance(radius_px, (int, float)) or not radius_px >= 0:
        raise ConfigError(f"must be a number >= 0, got {radius_px!r}", field="radius_px",
                          fix="give the site radius in pixels (metres / metres_per_pixel)")
    allowed = source.positions(tiles, index)
    if centre is None:
        centre = allowed[int(rng.integers(len(allowed)))].astype(np.float64)
    centre = np.asarray(centre, dtype=np.float64)
    near = allowed[np.linalg.norm(allowed - centre, axis=1) <= radius_px + 1e-9]
    if len(near) == 0:
        raise ConfigError(f"no transmitter pixel of {tiles.ids[index]} within {radius_px} px of {centre.tolist()}",
                          field="centre", fix="pick a centre near the source's positions")
    chosen = near[rng.integers(len(near), size=int(n_maps))]
    specs = np.concatenate([np.full((int(n_maps), 1), index, dtype=np.int64), chosen], axis=1)
    return source.maps(tiles, specs), centre
