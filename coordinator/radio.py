"""The coordinator's side of a radio-map federation (``model: radio_unet``; docs/radiomap.md).

What a radio round adds to a camera round: the task carries a :class:`shared.protocol.RadioTask` (the defence and
its parameters) and the public city raster as an artifact (``radio-city.safetensors``: ``buildings`` uint8 (H, W),
1 inside buildings), from which each gateway draws its allocator's public proxy sites; and ingest expects each
upload to report exactly the DP event its defence has (:func:`expected_events`), filed under IUCN NE because a radio
map has no species. Aggregation (FedAvg of the released deltas), the ledger, halting and storage are the camera
federation's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
from safetensors.numpy import save

from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import RADIO_CATEGORY, RadioTask

from coordinator.config import CoordinatorConfig
from coordinator.config_learning import RadioConfig

__all__ = ["RADIO_CATEGORY", "radio_task", "city_raster", "city_artifact", "expected_events", "initial_weights"]


def radio_task(radio: RadioConfig) -> RadioTask:
    """The task's radio part from the config (the wire form of :class:`coordinator.config_learning.RadioConfig`)."""
    return RadioTask(defence=radio.defence, noise_multiplier=float(radio.noise_multiplier),
                     floor_fraction=float(radio.floor_fraction), width=radio.width,
                     allocator_every=radio.allocator_every, proxy_sites=radio.proxy_sites,
                     proxy_maps=radio.proxy_maps, site_radius_m=float(radio.site_radius_m),
                     metres_per_pixel=float(radio.metres_per_pixel), max_walls=radio.max_walls)


@functools.lru_cache(maxsize=8)
def _city(city: str, seed: int, size_px: int, metres_per_pixel: float) -> bytes:
    from shared.radio import RadioMapGeometry, city_tiles, scene_tiles

    geometry = RadioMapGeometry(size_px=size_px, metres_per_pixel=metres_per_pixel)
    rng = np.random.default_rng([seed, 7])
    tile = city_tiles(rng, 1, geometry=geometry)[0] if city == "procedural" else \
        scene_tiles(city, 1, rng, geometry=geometry)[0]
    return np.ascontiguousarray(tile, dtype=np.uint8).tobytes()


def city_raster(radio: RadioConfig) -> np.ndarray:
    """bool (size_px, size_px): the federation's public city tile, True inside buildings (a procedural tile or a
    crop of a sionna-rt scene, chosen by ``city_seed``; the same for every round and every run).

    Raises:
        ConfigError: an unknown city, or a sionna-rt scene whose files are not installed (the fix names the pip
            line).
    """
    raw = _city(radio.city, radio.city_seed, radio.size_px, float(radio.metres_per_pixel))
    return np.frombuffer(raw, dtype=np.uint8).reshape(radio.size_px, radio.size_px).astype(bool)


def city_artifact(radio: RadioConfig) -> dict[str, bytes]:
    """``{city artifact file name: safetensors bytes}`` of :func:`city_raster` (``buildings`` uint8 (H, W))."""
    name = radio_task(radio).city_artifact
    return {name: save({"buildings": city_raster(radio).astype(np.uint8)},
                       metadata={"metres_per_pixel": str(float(radio.metres_per_pixel))})}


def expected_events(config: CoordinatorConfig) -> Mapping[IUCNCategory, DPSGDEvent] | None:
    """The exact events every radio upload must report: ``{NE: DPSGDEvent(z_eff, 1.0, 1)}`` for the guaranteed
    defences (z_eff = sigma_floor / (2C), :meth:`RadioTask.floor_noise_multiplier`), ``{}`` for the others; None
    for camera federations (whose events ingest checks its own way)."""
    if config.model != "radio_unet" or config.radio is None:
        return None
    task = radio_task(config.radio)
    if not task.guaranteed:
        return {}
    return {RADIO_CATEGORY: DPSGDEvent(task.floor_noise_multiplier(), 1.0, 1)}


def initial_weights(config: CoordinatorConfig) -> dict[str, np.ndarray]:
    """The round-0 RadioUNet (PyTorch's default initialisation drawn with ``config.seed``; imports torch)."""
    from shared.models import radio_unet

    if config.radio is None:
        raise ValueError("initial_weights needs the radio: block")
    return radio_unet.initial_weights(width=config.radio.width, seed=config.seed or 0)
