"""Federated RadioUNet radio maps with adaptive grouped noise: the seed's evaluation (docs/radiomap.md),
on per-client tiles with two validation sets.

Protocol (per seed; the seed fixes the tiles' roles, the transmitter positions, the initial model and the client
schedule; privacy noise is never seeded: it comes from :class:`shared.privacy.randomness.SecureRandom`):

1. Data (:mod:`wildfed_sim.radio_tiles`, cached under ``<out>/data``): 64 x 64 px maps at 4 m/px (256 m x 256 m
   tiles), RadioMapSeer-style normalised gain, from COST 231 multi-wall path loss (``data = cost231``) or from a
   Sionna RT set (``data = sionna``, ``wildfed radio-data sionna``). The tiles (:func:`wildfed_sim.radio_tiles.plan_tiles`):
   with a sionna-rt scene as the city (default munich), its disjoint grid of tiles (munich: 19) is permuted by the
   seed; each of the 14 clients (base-station sites) gets its own tile, and the remaining tiles are held out for
   validation. A second validation set lies on another city (default florence: 9 tiles), and the public tiles
   (pretraining, the gateways' allocator proxies, the ridge attacker's shadows) on the remaining cities
   (san_francisco and etoile: 16 tiles), so no tile has two roles. Client k has a secret site centre c_k (uniform
   over its tile's transmitter pixels: every outdoor pixel for COST 231) and 50 maps whose transmitters are drawn
   from the transmitter pixels within ``site_radius_m`` (20 m) of c_k (the site's antennas and small cells): 700
   maps. Validation: ``validation_maps`` (100) maps spread evenly over the held-out tiles, and as many over the
   other city's tiles, transmitters anywhere. Building data is public (OpenStreetMap); transmitter sites are not.
   ``city = procedural`` draws every role's tiles from its own generator stream, the other city being a procedural
   old town (:data:`wildfed_sim.radio_tiles.OLD_TOWN`).
2. Federation: FedAvg over the clients, 6 of 14 active per round (drawn uniformly without replacement), 50 rounds;
   each active client runs ``local_epochs`` of Adam (lr ``local_lr``, batch 16, the radio base-station profile's
   micro-batch) on mse(stage 1) + mse(stage 2) from the global model, and uploads its delta through the defence
   (:class:`edge_sdk.privacy.adaptive_noise.AdaptiveGroupedNoise`: none, clip-only, uniform, steered-uniform,
   adaptive, grouped-clipping, all at noise multiplier z and one clipping norm C). The server adds ``server_lr`` x
   the mean of the released deltas. Each upload's DP event (uniform, adaptive, grouped-clipping) is recorded in a
   real :class:`coordinator.ledger.PrivacyLedger` before the server uses it.
3. Adaptive defence and grouped clipping: every ``allocator_every`` rounds the allocator (or the clipping profile)
   is computed from public proxy sites on the public tiles at the current global model. Its inputs are public, so
   every gateway of the round would compute the same; the simulation computes it once per round and hands it to all.
4. Attackers, at round 1 and every ``attack_every``-th round (``attacker``: ridge, template or both):
   - ridge (:func:`fit_attacker`): ``shadow_sites`` shadow sites on random public tiles (the same number of maps,
     the same local training from the same global model, the same defence), kernel ridge regression from the
     released update to the site centre in tile pixels, applied to each active client's real upload;
   - template (:mod:`wildfed_sim.radio_attack`): the attacker knows each client's tile (public building data) and
     computes the update of a shadow site at every candidate of a grid on that tile, without noise, through the
     defence's clipping (``template_shadow``: :mod:`wildfed_sim.radio_shadows`, first-order by default, the
     gateways' own training with ``sequential``); each upload's profile log-likelihood is summed over the site's
     uploads.
   Privacy RMSE = root mean squared Euclidean error in metres. The ridge attacker's naive baseline predicts the
   shadow centres' mean.
5. Utility: validation MSE of stage 2's normalised map, in dB (10 log10 MSE, as the seed reports it), every round,
   on the held-out tiles of the same city (``val_mse_db``) and on the other city (``val_other_mse_db``).

Deviation from the product's transport: the clients run in one process (the same mechanism, allocator and ledger
code as a base-station gateway, no MQTT), so the grid of defences x seeds fits 2 cores.

Output (``out_dir``): ``radiomap.json`` (settings, every run's curves, summary), ``radiomap.md`` (the table),
``radiomap.png`` (validation MSE per round and attacker RMSE per attack round, per defence), ``ledger.db``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.protocol import RADIO_CATEGORY
from shared.models import radio_unet
from shared.radio import PathLossModel, RadioMapGeometry, RadioMapSet, SCENES, cached_maps

from edge_sdk.privacy.adaptive_noise import DEFENCES, grouped_clipping_norms
from edge_sdk.privacy.noise_allocator import AllocatorTraining, NoiseAllocator
from edge_sdk.privacy.randomness import SecureRandom
from edge_sdk.radio import RadioSiteTrainer, flat_weights, set_flat_weights, train_radio_maps

from wildfed_sim.common.options import opt, parse_list
from wildfed_sim.common.stats import mean_std
from wildfed_sim.radio_shadows import SHADOWS, ShadowTraining, ShadowUpdates
from wildfed_sim.radio_tiles import PROCEDURAL, MapSource, TilePlan, TileSet, draw_site, map_source, plan_tiles

__all__ = ["RadioMapSettings", "SiteData", "ExperimentData", "prepare_data", "pretrain", "make_site", "local_update", "fit_attacker",
           "run_federation", "summarise", "markdown_table", "run_radiomap_experiment", "radiomap_command",
           "RADIO_CATEGORY"]



@dataclass(frozen=True)
class RadioMapSettings:
    """The experiment's settings (module docstring); defaults are the seed's protocol.

    Raises:
        ConfigError: a count or rate out of range, naming the field.
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    defences: tuple[str, ...] = DEFENCES
    clients: int = 14
    active: int = 6
    rounds: int = 50
    maps_per_client: int = 50
    validation_maps: int = 100
    validation_tiles: int | None = None
    pretrain_tiles: int = 16
    pretrain_maps_per_tile: int = 38
    pretrain_epochs: int = 10
    shadow_sites: int = 24
    proxy_sites: int = 12
    proxy_maps: int = 8
    site_radius_m: float = 20.0
    noise_multiplier: float = 3.0
    clipping_norm: float = 0.005
    floor_fraction: float = 0.5
    local_epochs: int = 1
    batch_size: int = 16
    local_lr: float = 5e-4
    pretrain_lr: float = 2e-3
    server_lr: float = 1.0
    width: int = 8
    attack_every: int = 10
    attacker: str = "ridge"
    template_step_px: int = 6
    template_shadow: str = "first-order"
    template_pixel_stride: int = 3
    allocator_every: int = 5
    allocator: AllocatorTraining = AllocatorTraining()
    target_delta: float = 1e-5
    size_px: int = 64
    metres_per_pixel: float = 4.0
    max_walls: int | None = 4
    city: str = "munich"
    validation_city: str | None = None
    data: str = "cost231"
    sionna_dir: Path | None = None
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        for name in ("clients", "active", "rounds", "maps_per_client", "validation_maps", "pretrain_tiles",
                     "pretrain_maps_per_tile", "shadow_sites", "proxy_sites", "proxy_maps", "local_epochs",
                     "batch_size", "width", "attack_every", "allocator_every", "size_px"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        if type(self.pretrain_epochs) is not int or self.pretrain_epochs < 0:
            raise ConfigError(f"pretrain_epochs must be a non-negative integer, got {self.pretrain_epochs!r}",
                              field="pretrain_epochs")
        if self.active > self.clients:
            raise ConfigError(f"active ({self.active}) exceeds clients ({self.clients})", field="active",
                              fix="pick at most as many active clients per round as there are clients")
        if self.shadow_sites < 4 or self.proxy_sites < 3:
            raise ConfigError("the attacker needs >= 4 shadow sites and the allocator >= 3 proxy sites",
                              field="shadow_sites")
        bad = [d for d in self.defences if d not in DEFENCES]
        if bad or not self.defences:
            raise ConfigError(f"unknown defences {bad}", field="defences", fix=f"pick from {', '.join(DEFENCES)}")
        if not self.seeds:
            raise ConfigError("no seeds", field="seeds", fix="e.g. --seeds 0,1,2")
        for name in ("noise_multiplier", "clipping_norm", "local_lr", "pretrain_lr", "server_lr", "site_radius_m",
                     "metres_per_pixel"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}", field=name)
        if self.city != PROCEDURAL and self.city not in SCENES:
            raise ConfigError(f"unknown city {self.city!r}", field="city",
                              fix=f"use procedural or one of {', '.join(SCENES)}")
        if self.validation_tiles is not None and (type(self.validation_tiles) is not int or self.validation_tiles < 1):
            raise ConfigError(f"validation_tiles must be None or a positive integer, got {self.validation_tiles!r}",
                              field="validation_tiles", fix="leave it out to use every held-out tile")
        if self.data not in ("cost231", "sionna"):
            raise ConfigError(f"data must be cost231 or sionna, got {self.data!r}", field="data",
                              fix="use cost231 (generated here) or sionna (a set of `wildfed radio-data sionna`)")
        if self.data == "sionna" and (self.sionna_dir is None or self.city == PROCEDURAL):
            raise ConfigError("--data sionna needs --sionna-dir and a sionna-rt scene as the city", field="sionna_dir",
                              fix="add --sionna-dir DIR (made by `wildfed radio-data sionna --out DIR`) and keep "
                                  "--city a scene")
        if self.attacker not in ("ridge", "template", "both"):
            raise ConfigError(f"attacker must be ridge, template or both, got {self.attacker!r}", field="attacker",
                              fix="use template (wildfed_sim.radio_attack) or ridge (fit_attacker)")
        for name in ("template_step_px", "template_pixel_stride"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}", field=name)
        if self.template_shadow not in SHADOWS:
            raise ConfigError(f"unknown template shadow {self.template_shadow!r}", field="template_shadow",
                              fix=f"use one of {', '.join(SHADOWS)} (wildfed_sim.radio_shadows)")
        if not 0 < self.floor_fraction <= 1:
            raise ConfigError(f"floor_fraction must be in (0, 1], got {self.floor_fraction}", field="floor_fraction")

    @property
    def geometry(self) -> RadioMapGeometry:
        """Map size and resolution."""
        return RadioMapGeometry(size_px=self.size_px, metres_per_pixel=self.metres_per_pixel)

    @property
    def pathloss(self) -> PathLossModel:
        """The path-loss model of the generated maps."""
        return PathLossModel(max_walls=self.max_walls)


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


def pretrain(settings: RadioMapSettings, data: ExperimentData, seed: int, cache_dir: Path | None = None,
             console: Any = None, on_epoch: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 (d,): the round-0 global model, ``initial_weights(seed)`` trained centrally (Adam, lr ``pretrain_lr``,
    batch ``batch_size``) for ``pretrain_epochs`` on the public pretraining maps (other tiles than the
    federation's city); cached under ``cache_dir``. With a rich ``console``, a progress bar per epoch (about 4 s
    each on 2 idle cores)."""
    from safetensors.numpy import load_file, save_file

    model = radio_unet.build_model(width=settings.width)
    radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=settings.width, seed=seed))
    theta = flat_weights(model)
    if settings.pretrain_epochs == 0:
        return theta
    key = json.dumps({"seed": seed, "city": settings.city, "width": settings.width, "epochs": settings.pretrain_epochs,
                      "tiles": list(data.tiles.public.ids), "maps": settings.pretrain_maps_per_tile,
                      "lr": settings.pretrain_lr, "source": data.source.key()}, sort_keys=True)
    path = cache_dir / f"seed{seed}-pretrained.safetensors" if cache_dir else None
    if path is not None and path.exists():
        try:
            stored = load_file(str(path))
            if bytes(stored["key"]).decode() == key:
                return stored["theta"].astype(np.float64)
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt, never trusted
            pass
    pretraining = settings_for_pretraining(settings)
    if console is None:
        theta = theta + local_update(model, theta, data.pretraining, pretraining, np.random.default_rng([seed, 29]),
                                     on_epoch=on_epoch)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("public pretraining, epoch"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("pretraining", total=settings.pretrain_epochs)
            theta = theta + local_update(model, theta, data.pretraining, pretraining,
                                         np.random.default_rng([seed, 29]),
                                         on_epoch=lambda _: progress.advance(bar))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"theta": theta.astype(np.float64), "key": np.frombuffer(key.encode(), dtype=np.uint8)},
                  str(tmp))
        tmp.replace(path)
    return theta


def settings_for_pretraining(settings: RadioMapSettings) -> RadioMapSettings:
    """The same local trainer, run for ``pretrain_epochs`` epochs."""
    from dataclasses import replace

    return replace(settings, local_epochs=settings.pretrain_epochs, local_lr=settings.pretrain_lr)


# ------------------------------------------------------------------------------------------- local training
def local_update(model: Any, global_flat: np.ndarray, maps: RadioMapSet, settings: RadioMapSettings,
                 rng: np.random.Generator, on_epoch: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 (d,): the gateway's local training (:func:`edge_sdk.radio.train_radio_maps`) with the
    experiment's epochs, learning rate and batch size."""
    return train_radio_maps(model, global_flat, maps, epochs=settings.local_epochs, learning_rate=settings.local_lr,
                            batch_size=settings.batch_size, rng=rng, on_epoch=on_epoch)


def validation_mse_db(model: Any, flat: np.ndarray, maps: RadioMapSet) -> float:
    """10 log10 of stage 2's mean squared error on ``maps`` (normalised gain units), in dB."""
    import torch

    set_flat_weights(model, flat)
    with torch.no_grad():
        errors = []
        for start in range(0, len(maps), 50):
            _, fine = model(torch.from_numpy(maps.inputs[start:start + 50]))
            errors.append(((fine.numpy() - maps.targets[start:start + 50]) ** 2).reshape(-1))
    return float(10.0 * math.log10(float(np.concatenate(errors).mean())))


# ------------------------------------------------------------------------------------------------ attacker
def fit_attacker(features: np.ndarray, centres: np.ndarray, sensitive: np.ndarray
                 ) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, Any]]:
    """Kernel ridge regression from released updates to site centres, trained on shadow sites.

    Args:
        features: float (n, d), the shadow sites' released updates.
        centres: float (n, 2), their centres (any unit; predictions come back in it).
        sensitive: bool (d,), the transmitter-sensitive coordinates.

    Kernel: k(x, x') = <x / s, x' / s> + mean diag, with s the per-coordinate root mean square over the shadows (a
    linear kernel on scaled features plus a constant, i.e. a linear model with an intercept; features are not
    centred, because centring on all n shadows makes each left-out update a combination of the others and leaks
    its target into the leave-one-out estimate). The feature set (all coordinates or the sensitive ones) and the
    ridge strength lambda (a grid of fractions of mean diag K) are chosen by leave-one-out squared error in closed
    form (e_i = r_i / (1 - H_ii), H = K (K + lambda I)^-1; Hastie et al. 2009, Eq. 7.52, exact for this smoother).

    Returns:
        (predict: float (m, d) -> float (m, 2), {"features", "ridge", "loo_rmse"} of the chosen fit).
    """
    x = np.asarray(features, dtype=np.float64)
    t = np.asarray(centres, dtype=np.float64)
    best: tuple[float, str, float, np.ndarray, np.ndarray, float, np.ndarray] | None = None
    for name, cols in (("all", np.ones(x.shape[1], dtype=bool)), ("sensitive", np.asarray(sensitive, bool))):
        sub = x[:, cols]
        rms = np.sqrt(np.mean(sub ** 2, axis=0))
        # floor: a coordinate that (almost) never moves in the shadows (a dead unit) must not blow up a new update
        rms = np.maximum(rms, 0.1 * float(np.median(rms)) or 1.0)
        z = sub / rms
        linear = z @ z.T
        offset = float(np.mean(np.diag(linear))) or 1.0
        k = linear + offset
        for ridge in (1e-3, 1e-2, 1e-1, 1.0, 10.0):
            inv = np.linalg.inv(k + ridge * offset * np.eye(len(k)))
            hat = k @ inv
            resid = (t - hat @ t) / (1.0 - np.diag(hat))[:, None]
            loo = float(np.mean((resid ** 2).sum(axis=1)))
            if best is None or loo < best[0]:
                best = (loo, name, ridge, cols, rms, offset, inv @ t)
    assert best is not None
    loo, name, ridge, cols, rms, offset, alpha = best
    train_z = x[:, cols] / rms

    def predict(new: np.ndarray) -> np.ndarray:
        z = np.asarray(new, dtype=np.float64)[:, cols] / rms
        return (z @ train_z.T + offset) @ alpha

    return predict, {"features": name, "ridge": ridge, "loo_rmse": math.sqrt(loo)}


# ---------------------------------------------------------------------------------------------- one run
def _trainer(settings: RadioMapSettings, defence: str, maps: RadioMapSet, allocator: NoiseAllocator | None,
             noise: Any, profile: np.ndarray | None = None) -> RadioSiteTrainer:
    """The gateway's trainer (edge_sdk.radio) with the experiment's settings (and, for grouped-clipping, the
    round's public clipping profile)."""
    import dataclasses

    trainer = RadioSiteTrainer(maps=maps, defence=defence, clipping_norm=settings.clipping_norm,
                               noise_multiplier=settings.noise_multiplier, floor_fraction=settings.floor_fraction,
                               local_epochs=settings.local_epochs, learning_rate=settings.local_lr,
                               batch_size=settings.batch_size, width=settings.width, allocator=allocator, noise=noise)
    if profile is not None:
        trainer.mechanism = dataclasses.replace(trainer.mechanism, clipping_profile=profile)
    return trainer


def _public_site(data: ExperimentData, n_maps: int, settings: RadioMapSettings, rng: np.random.Generator
                 ) -> SiteData:
    """A shadow (or proxy) site on a public tile drawn uniformly from ``rng``, at a centre the attacker (or the
    gateway) draws next."""
    tile = int(rng.integers(len(data.tiles.public)))
    return make_site(data.source, data.tiles.public, tile, n_maps, settings, rng)


def template_candidates(data: ExperimentData, client: int, settings: RadioMapSettings) -> np.ndarray:
    """float64 (n, 2): the template attacker's candidate centres on client ``client``'s tile: the outdoor pixels of
    a grid of step ``template_step_px`` (:func:`wildfed_sim.radio_attack.candidate_grid`) that have a transmitter
    pixel of the source within ``site_radius_m`` (all of them for COST 231, whose transmitters may be any outdoor
    pixel).

    Raises:
        ConfigError (field ``template_step_px``): no candidate is left (a sparse Sionna set; use a smaller step).
    """
    from wildfed_sim.radio_attack import candidate_grid

    grid = candidate_grid(data.tiles.clients.buildings[client], settings.template_step_px)
    allowed = data.source.positions(data.tiles.clients, client).astype(np.float64)
    radius_px = settings.site_radius_m / settings.metres_per_pixel
    near = (np.linalg.norm(grid[:, None, :] - allowed[None, :, :], axis=2) <= radius_px + 1e-9).any(axis=1)
    if not near.any():
        raise ConfigError(f"no template candidate on client {client}'s tile has a transmitter pixel of the "
                          f"{data.source.name} maps within {settings.site_radius_m} m", field="template_step_px",
                          fix="use a smaller --template-step-px, or a Sionna set with more transmitters per tile")
    return grid[near]


def shadow_updates(settings: RadioMapSettings, data: ExperimentData) -> ShadowUpdates:
    """The template attacker's shadow updates on the clients' tiles (``template_shadow``, replaying the gateways'
    local training with the experiment's settings); share one between the defences of a seed so that those with the
    same global model (all of them at round 1) reuse its cache."""
    training = ShadowTraining(maps_per_site=settings.maps_per_client, epochs=settings.local_epochs,
                              learning_rate=settings.local_lr, batch_size=settings.batch_size,
                              radius_px=settings.site_radius_m / settings.metres_per_pixel, width=settings.width,
                              pixel_stride=settings.template_pixel_stride)
    return ShadowUpdates(settings.template_shadow, training, data.source, data.tiles.clients)


def run_federation(settings: RadioMapSettings, data: ExperimentData, defence: str, seed: int, *,
                   initial: np.ndarray | None = None, ledger: Any = None, site_prefix: str = "", noise: Any = None,
                   on_round: Callable[[int], None] | None = None,
                   shadows: ShadowUpdates | None = None) -> dict[str, Any]:
    """One federated run of ``defence`` (module docstring, steps 2-5); ``shadows``: the template attacker's
    shadow updates (:func:`shadow_updates`; a fresh one when None).

    Returns:
        ``{"val_mse_db": [round 0..R] (held-out tiles of the city), "val_other_mse_db": [round 0..R] (the other
        city), "attack": [{"round", "rmse_m", "naive_rmse_m", "errors_m", ...}] (ridge), "template_attack":
        [{"round", "rmse_m", "errors_m", "uploads", "candidates"}] (per observed client), "allocator": [...],
        "shares": [...], ...}``.
    """
    import torch

    torch.manual_seed(seed)
    noise = noise if noise is not None else SecureRandom()
    allocator = NoiseAllocator(seed=seed) if defence == "adaptive" else None
    clients = [_trainer(settings, defence, site.maps, allocator, noise) for site in data.clients]
    model, layout = clients[0].model, clients[0].layout
    if initial is None:
        radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=settings.width, seed=seed))
        initial = flat_weights(model)
    theta = np.asarray(initial, dtype=np.float64).copy()
    sensitive = np.isin(layout.index, [g for g, s in enumerate(layout.sensitive) if s])
    schedule = np.random.default_rng([seed, 17])         # client selection and batch order: same for all defences
    attack_rng = np.random.default_rng([seed, 19])       # shadow sites: same for all defences
    proxy_rng = np.random.default_rng([seed, 31])        # the allocator's public proxy sites
    mpp = settings.metres_per_pixel
    out: dict[str, Any] = {"val_mse_db": [validation_mse_db(model, theta, data.validation)],
                           "val_other_mse_db": [validation_mse_db(model, theta, data.validation_other)],
                           "attack": [], "allocator": [], "shares": [], "update_norms": [], "template_attack": [],
                           "clipping_norms": []}
    templates_of: dict[int, Any] = {}   # client -> its TemplateAttacker (candidates on the client's public tile)
    if settings.attacker in ("template", "both") and shadows is None:
        shadows = shadow_updates(settings, data)
    for r in range(1, settings.rounds + 1):
        active = np.sort(schedule.choice(settings.clients, size=settings.active, replace=False))
        batch_seeds = schedule.integers(2**32, size=settings.active)
        if allocator is not None and (r - 1) % settings.allocator_every == 0:
            # Public inputs only, so every gateway of the round would train the same allocator: train it once.
            proxies = [_public_site(data, settings.proxy_maps, settings, proxy_rng)
                       for _ in range(settings.proxy_sites)]
            stats = clients[0].refresh_allocator(theta, proxies=[(p.maps, p.centre_px) for p in proxies],
                                                 round_index=r, total_rounds=settings.rounds,
                                                 settings=settings.allocator, seed=int(proxy_rng.integers(2**31)))
            out["allocator"].append({"round": r, **stats})
        if defence == "grouped-clipping" and (r - 1) % settings.allocator_every == 0:
            # public proxies only, so every gateway of the round computes the same profile: compute it once
            proxies = [_public_site(data, settings.proxy_maps, settings, proxy_rng)
                       for _ in range(settings.proxy_sites)]
            profile = clients[0].refresh_clipping_profile(theta, proxies=[(p.maps, p.centre_px) for p in proxies],
                                                          seed=r)
            for c in clients[1:]:
                c.mechanism = clients[0].mechanism
            out["clipping_norms"].append({"round": r, "norms": grouped_clipping_norms(
                profile, settings.clipping_norm).tolist()})
        released, norms, shares = [], [], []
        for k, bs in zip(active, batch_seeds):
            upload, event = clients[k].train_round(theta, round_index=r, total_rounds=settings.rounds,
                                                   rng=np.random.default_rng(bs))
            if ledger is not None and event is not None:
                ledger.record_round(f"{site_prefix}client{k:02d}", r, {RADIO_CATEGORY: event})
            released.append(upload.update.astype(np.float64))
            norms.append(upload.norm_before_clipping)
            if upload.shares is not None:
                shares.append(upload.shares.tolist())
        out["update_norms"].append(float(np.median(norms)))
        if shares:
            out["shares"].append({"round": r, "mean": np.mean(shares, axis=0).tolist()})
        if settings.attacker in ("template", "both") and (r == 1 or r % settings.attack_every == 0):
            from wildfed_sim.radio_attack import TemplateAttacker

            assert shadows is not None
            mechanism = clients[0].mechanism   # this round's clipping (grouped-clipping: this round's profile)
            for k, u in zip(active, released):
                # The attacker knows client k's tile (public building data): noise-free shadow updates at every
                # candidate centre on it, from this round's global model, through the defence's clipping. The
                # shadows' draws are seeded by (seed, client, round): the same for every defence.
                attacker = templates_of.setdefault(int(k), TemplateAttacker(template_candidates(data, int(k), settings),
                                                                            layout.index))
                deltas = shadows.deltas(int(k), attacker.candidates, theta,
                                        np.random.default_rng([seed, 37, int(k), r]))
                attacker.observe(f"client{k:02d}", u, np.stack([mechanism.clipped(d) for d in deltas]))
            errs = {name: err for k, a in sorted(templates_of.items())
                    for name, err in a.errors_m({f"client{k:02d}": data.clients[k].centre_px}, mpp).items()}
            rmse = float(np.sqrt(np.mean(np.square(list(errs.values())))))
            out["template_attack"].append({"round": r, "rmse_m": rmse, "errors_m": errs,
                                           "shadows": settings.template_shadow,
                                           "shadows_computed": shadows.computed, "shadows_reused": shadows.reused,
                                           "uploads": {f"client{k:02d}": a.uploads[f"client{k:02d}"]
                                                       for k, a in sorted(templates_of.items())},
                                           "candidates": {f"client{k:02d}": int(len(a.candidates))
                                                          for k, a in sorted(templates_of.items())}})
        if settings.attacker != "template" and (r == 1 or r % settings.attack_every == 0):
            # The attacker runs the gateways' own code on shadow sites of the public tiles.
            sites = [_public_site(data, settings.maps_per_client, settings, attack_rng)
                     for _ in range(settings.shadow_sites)]
            site_updates = [_trainer(settings, defence, s.maps, allocator, noise,
                                     clients[0].mechanism.clipping_profile).train_round(
                theta, round_index=r, total_rounds=settings.rounds, rng=attack_rng)[0].update for s in sites]
            predict, info = fit_attacker(np.stack(site_updates), np.stack([s.centre_px for s in sites]),
                                         sensitive)
            truth = np.stack([data.clients[k].centre_px for k in active])
            errors = np.linalg.norm(predict(np.stack(released)) - truth, axis=1) * mpp
            naive = np.linalg.norm(np.stack([s.centre_px for s in sites]).mean(axis=0) - truth, axis=1) * mpp
            out["attack"].append({"round": r, "rmse_m": float(np.sqrt(np.mean(errors ** 2))),
                                  "naive_rmse_m": float(np.sqrt(np.mean(naive ** 2))),
                                  "errors_m": errors.tolist(), "naive_errors_m": naive.tolist(), **info})
        theta = theta + settings.server_lr * np.mean(released, axis=0)
        out["val_mse_db"].append(validation_mse_db(model, theta, data.validation))
        out["val_other_mse_db"].append(validation_mse_db(model, theta, data.validation_other))
        if on_round is not None:
            on_round(r)
    return out


# ----------------------------------------------------------------------------------------------- summary
def _overall_rmse(attacks: Sequence[dict[str, Any]], key: str = "errors_m") -> float:
    errors = np.concatenate([np.asarray(a[key]) for a in attacks])
    return float(np.sqrt(np.mean(errors ** 2)))


def summarise(runs: Sequence[dict[str, Any]], settings: RadioMapSettings) -> list[dict[str, Any]]:
    """One entry per defence: final validation MSE (dB) on the held-out tiles and on the other city, attacker RMSE at the last attack round and over all attack
    rounds (metres), the naive baseline, and the ledger's epsilon (max over clients), mean ± std over seeds."""
    out = []
    for defence in settings.defences:
        mine = [r for r in runs if r["defence"] == defence]
        out.append({
            "defence": defence,
            "val_mse_db": mean_std([r["val_mse_db"][-1] for r in mine]),
            "val_other_mse_db": mean_std([r["val_other_mse_db"][-1] if r.get("val_other_mse_db") else None
                                          for r in mine]),
            "rmse_final_m": mean_std([r["attack"][-1]["rmse_m"] if r["attack"] else None for r in mine]),
            "rmse_all_m": mean_std([_overall_rmse(r["attack"]) if r["attack"] else None for r in mine]),
            "naive_rmse_all_m": mean_std([_overall_rmse(r["attack"], "naive_errors_m") if r["attack"] else None
                                          for r in mine]),
            "template_rmse_final_m": mean_std([r["template_attack"][-1]["rmse_m"] if r.get("template_attack")
                                               else None for r in mine]),
            "epsilon": mean_std([r.get("epsilon") for r in mine]),
            "seeds": [r["seed"] for r in mine],
        })
    return out


HEADERS = ["defence", "validation MSE (dB), held-out tiles, final", "validation MSE (dB), other city, final",
           "attacker RMSE (m), final round", "attacker RMSE (m), all rounds",
           "naive RMSE (m)", "template attacker RMSE (m), all uploads", "eps per site (ledger, max)"]


def _fmt(stat: dict[str, Any], digits: int = 2) -> str:
    if stat["mean"] is None:
        return "none"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def _cells(entry: dict[str, Any]) -> list[str]:
    eps = _fmt(entry["epsilon"]) if entry["epsilon"]["n"] else "no guarantee"
    return [entry["defence"], _fmt(entry["val_mse_db"]),
            _fmt(entry.get("val_other_mse_db", {"mean": None})), _fmt(entry["rmse_final_m"], 1),
            _fmt(entry["rmse_all_m"], 1), _fmt(entry["naive_rmse_all_m"], 1),
            _fmt(entry.get("template_rmse_final_m", {"mean": None}), 1), eps]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table (mean ± sample std over seeds)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_cells(entry)) + " |" for entry in summary]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], settings: RadioMapSettings, path: Path) -> None:
    """Validation MSE per round (solid: held-out tiles of the city; dashed: the other city) and attacker RMSE per
    attack round (circles: ridge; squares, dotted: template), seed means, one colour per defence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for defence in settings.defences:
        mine = [r for r in runs if r["defence"] == defence]
        if not mine:
            continue
        line, = left.plot(np.mean([r["val_mse_db"] for r in mine], axis=0), label=f"{defence}, held-out tiles")
        if all(r.get("val_other_mse_db") for r in mine):
            left.plot(np.mean([r["val_other_mse_db"] for r in mine], axis=0), linestyle="--", color=line.get_color(),
                      label=f"{defence}, other city")
        if mine[0]["attack"]:
            rounds = [a["round"] for a in mine[0]["attack"]]
            right.plot(rounds, np.mean([[a["rmse_m"] for a in r["attack"]] for r in mine], axis=0), marker="o",
                       color=line.get_color(), label=f"{defence}, ridge")
        if mine[0].get("template_attack"):
            rounds = [a["round"] for a in mine[0]["template_attack"]]
            right.plot(rounds, np.mean([[a["rmse_m"] for a in r["template_attack"]] for r in mine], axis=0),
                       marker="s", linestyle=":", color=line.get_color(), label=f"{defence}, template")
    if runs and runs[0]["attack"]:
        naive = np.mean([[a["naive_rmse_m"] for a in r["attack"]] for r in runs], axis=0)
        right.plot([a["round"] for a in runs[0]["attack"]], naive, "k--", label="naive (shadow mean)")
    left.set(xlabel="round", ylabel="validation MSE (dB)", title="utility (lower is better)")
    right.set(xlabel="round", ylabel="attacker RMSE (m)", title="privacy (higher is better)")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- the driver
@dataclass
class RadioMapResult:
    """Runs (one dict per (seed, defence)), the summary and where the files are."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None
    elapsed_s: float = 0.0


def run_radiomap_experiment(settings: RadioMapSettings, *, console: Any = None) -> RadioMapResult:
    """Every (seed, defence) run with the ledger; writes radiomap.json/.md/.png after each run.

    Raises:
        ConfigError: a city scene is named and sionna-rt, which ships the scenes, is not installed (checked before
            anything is written).
    """
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store
    from shared.radio.scenes import scene_path

    for city in (settings.city, settings.validation_city):  # before any folder, file or progress bar
        if city is not None and city in SCENES:
            scene_path(city)  # ConfigError naming the sionna-rt install when its scenes are absent
    out_dir = settings.out_dir or Path("runs") / time.strftime("radiomap-%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{out_dir / 'ledger.db'}", out_dir / "data")
    ledger = PrivacyLedger(store, target_delta=settings.target_delta)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = RadioMapResult(out_dir=out_dir)
    start = time.monotonic()
    total = len(settings.seeds) * len(settings.defences) * settings.rounds
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=console is None) as progress:
        bar = progress.add_task("radio-map federation rounds", total=total)
        for seed in settings.seeds:
            data = prepare_data(settings, seed, cache_dir=out_dir / "data")
            progress.update(bar, description=f"seed {seed}: public pretraining")
            def epoch_done(e: int, s: int = seed) -> None:
                progress.update(bar, description=f"seed {s}: public pretraining, epoch {e}/{settings.pretrain_epochs}")

            initial = pretrain(settings, data, seed, cache_dir=out_dir / "data", on_epoch=epoch_done)
            shadows = shadow_updates(settings, data) if settings.attacker in ("template", "both") else None
            for defence in settings.defences:
                progress.update(bar, description=f"seed {seed}, {defence}")
                prefix = f"seed{seed}-{defence}-"
                run = run_federation(settings, data, defence, seed, initial=initial, ledger=ledger, site_prefix=prefix,
                                     on_round=lambda _: progress.advance(bar), shadows=shadows)
                spend = [ledger.spent(f"{prefix}client{k:02d}", RADIO_CATEGORY) for k in range(settings.clients)
                         if ledger.events(f"{prefix}client{k:02d}", RADIO_CATEGORY)]
                run.update(seed=seed, defence=defence, epsilon=max(spend) if spend else None)
                result.runs.append(run)
                result.summary = summarise(result.runs, settings)
                result.elapsed_s = time.monotonic() - start
                _write(result, settings, out_dir)
    if console is not None:
        from rich.table import Table

        table = Table(title=f"radio maps: {settings.clients} clients, {settings.active} active, {settings.rounds} "
                            f"rounds, z = {settings.noise_multiplier}, seeds {list(settings.seeds)}")
        for h in HEADERS:
            table.add_column(h)
        for entry in result.summary:
            table.add_row(*_cells(entry))
        console.print(table)
        console.log(f"written {out_dir / 'radiomap.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result


def _write(result: RadioMapResult, settings: RadioMapSettings, out_dir: Path) -> None:
    payload = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
               "runs": result.runs, "summary": result.summary, "elapsed_s": result.elapsed_s}
    (out_dir / "radiomap.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "radiomap.md").write_text(markdown_table(result.summary))
    plot(result.runs, settings, out_dir / "radiomap.png")


def radiomap_command(
    seeds: str = opt("0,1,2", "comma-separated seeds (tiles, transmitters, initial model, schedule; noise is "
                     "never seeded)"),
    defences: str = opt(",".join(DEFENCES), "comma-separated defences, default all six: none, clip-only, uniform, "
                        "steered-uniform, adaptive (learned noise shares over a uniform floor), grouped-clipping "
                        "(per-group clipping norms from a public profile, noise calibrated to uniform's epsilon)"),
    rounds: int = opt(50, "federated rounds"),
    clients: int = opt(14, "clients (base-station sites)"),
    active: int = opt(6, "active clients per round"),
    maps_per_client: int = opt(50, "radio maps per client"),
    noise_multiplier: float = opt(3.0, "z: each upload's noise budget is d (z C)^2"),
    clipping_norm: float = opt(0.005, "C: L2 clipping norm of each upload (model delta)"),
    floor_fraction: float = opt(0.5, "phi: the adaptive defence's uniform noise floor, a fraction of the budget"),
    shadow_sites: int = opt(24, "shadow sites the attacker simulates per attack round"),
    attack_every: int = opt(10, "attack every this many rounds (and at round 1)"),
    attacker: str = opt("ridge", "ridge (regression on shadows, per upload), template (likelihood over a grid of "
                        "candidate centres, summed over a site's uploads: wildfed_sim.radio_attack) or both"),
    template_step_px: int = opt(6, "the template attacker's candidate grid spacing in pixels"),
    template_shadow: str = opt("first-order", "how the template attacker computes its shadow updates "
                               "(wildfed_sim.radio_shadows): first-order (one gradient per transmitter pixel of a "
                               "sub-grid at the global model, Adam replayed on its moments), batched (the gateways' "
                               "training, candidates vectorised) or sequential (one training run per candidate)"),
    template_pixel_stride: int = opt(3, "first-order shadows: the transmitter pixel sub-grid's step"),
    pretrain_epochs: int = opt(10, "epochs of public pretraining on other cities' maps (0: start from scratch)"),
    city: str = opt("munich", "the federation's city: a sionna-rt scene (munich, florence, san_francisco, etoile; "
                    "needs `pip install --no-deps sionna-rt==2.2.0`; each client gets its own disjoint 256 m tile, "
                    "the rest are held out for validation) or procedural"),
    validation_city: str | None = opt(None, "the city of the second validation set (default: florence, or munich "
                                      "when --city florence; procedural-old-town with --city procedural); the "
                                      "remaining cities' tiles are the public ones (pretraining, proxies, shadows)"),
    data: str = opt("cost231", "where the maps come from: cost231 (free space + multi-wall, computed here) or "
                    "sionna (a Sionna RT set made by `wildfed radio-data sionna`; needs --sionna-dir)"),
    sionna_dir: Path | None = opt(None, "with --data sionna: the set's folder (`wildfed radio-data sionna --out`)"),
    validation_tiles: int | None = opt(None, "held-out tiles per validation set (default: every tile of the city "
                                       "that no client has, and every tile of the other city)"),
    pretrain_tiles: int = opt(16, "public tiles (pretraining, proxy and shadow sites), from the remaining cities"),
    out: Path | None = opt(None, "output folder (default runs/radiomap-<UTC time>)"),
) -> None:
    """Federated RadioUNet radio maps with six defences (the seed's none, clip-only, uniform, steered-uniform,
    adaptive, and grouped-clipping) on per-client tiles; attacker localisation RMSE (m) and validation MSE (dB) on
    held-out tiles of the city and on another city, per round, 3 seeds.
    Writes radiomap.json, .md, .png and the ledger. The default grid (18 runs) takes well over an hour on 2 cores
    (15 runs took 104 minutes on busy ones; --attacker template with the default first-order shadows costs about
    25 s per attack round on one thread, its round-1 shadows shared by the defences of a seed);
    --rounds 2 --seeds 0 --pretrain-epochs 1 is a quick look (the real cities need `pip install --no-deps
    sionna-rt==2.2.0`; --city procedural needs nothing more)."""
    from rich.console import Console

    settings = RadioMapSettings(
        seeds=parse_list(seeds, int, "seeds", "0,1,2"), defences=parse_list(defences, str, "defences", "uniform"),
        rounds=rounds, clients=clients, active=active, maps_per_client=maps_per_client,
        noise_multiplier=noise_multiplier, clipping_norm=clipping_norm, floor_fraction=floor_fraction,
        shadow_sites=shadow_sites, attack_every=attack_every, city=city, pretrain_epochs=pretrain_epochs,
        attacker=attacker, template_step_px=template_step_px, template_shadow=template_shadow,
        template_pixel_stride=template_pixel_stride, validation_city=validation_city, data=data,
        sionna_dir=sionna_dir, validation_tiles=validation_tiles, pretrain_tiles=pretrain_tiles, out_dir=out)
    run_radiomap_experiment(settings, console=Console())
