"""The radio-map experiment's settings (:mod:`wildfed_sim.radiomap`): :class:`RadioMapSettings`, checked on
construction, with the map geometry and path-loss model they imply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError
from shared.radio import SCENES, PathLossModel, RadioMapGeometry

from edge_sdk.privacy.adaptive_noise import DEFENCES
from edge_sdk.privacy.noise_allocator import AllocatorTraining

from wildfed_sim.radio_shadows import SHADOWS
from wildfed_sim.radio_tiles import PROCEDURAL


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
