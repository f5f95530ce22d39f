"""The radio-map part of a TASK payload (:class:`RadioTask`, docs/radiomap.md), carried by
:class:`shared.protocol.tasks.TrainingTask` for base-station gateways."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.errors import PayloadError

from shared.protocol.common import _ARTIFACT_NAME, GUARANTEED_RADIO_DEFENCES, RADIO_DEFENCES, _positive

__all__ = ["RadioTask"]


@dataclass(frozen=True)
class RadioTask:
    """The radio-map part of a task for base-station gateways (docs/radiomap.md).

    A radio task trains the two-stage RadioUNet (``shared.models.radio_unet``) on the site's radio maps and uploads
    the whole clipped delta through the grouped-noise defence. It reuses the task's generic fields with these
    meanings: ``local_steps`` = local epochs over the site's maps, ``expected_batch_size`` = mini-batch,
    ``learning_rate`` = local Adam step size, ``clipping_norm`` = C of the whole update (L2).

    Attributes:
        defence: one of :data:`RADIO_DEFENCES`; the task's privacy is ``"grouped"`` exactly when it is one of
            :data:`GUARANTEED_RADIO_DEFENCES`, else ``"none"``.
        noise_multiplier: z; each upload's noise budget is d (zC)^2.
        floor_fraction: phi in (0, 1], the adaptive defence's uniform floor.
        width: the RadioUNet's base width (the model's shape).
        allocator_every: the gateway retrains its allocator every this many rounds (round 1 included).
        proxy_sites, proxy_maps: public proxy sites on the city raster for the allocator's training, maps each.
        site_radius_m: radius (metres) of a proxy site's transmitter cluster.
        metres_per_pixel: the maps' resolution.
        max_walls: the path-loss model's wall cap for the proxies' maps (None: no cap).
        city_artifact: file name of the task artifact holding the public city raster (safetensors, ``buildings``
            uint8 (H, W), 1 inside buildings).

    Raises:
        PayloadError: a value out of range.
    """

    defence: str
    noise_multiplier: float
    floor_fraction: float = 0.5
    width: int = 8
    allocator_every: int = 5
    proxy_sites: int = 12
    proxy_maps: int = 8
    site_radius_m: float = 20.0
    metres_per_pixel: float = 4.0
    max_walls: int | None = 4
    city_artifact: str = "radio-city.safetensors"

    def __post_init__(self) -> None:
        if self.defence not in RADIO_DEFENCES:
            raise PayloadError(f"radio defence must be one of {RADIO_DEFENCES}, got {self.defence!r}")
        _positive("radio.noise_multiplier", self.noise_multiplier)
        _positive("radio.floor_fraction", self.floor_fraction)
        if self.floor_fraction > 1:
            raise PayloadError(f"radio.floor_fraction must be in (0, 1], got {self.floor_fraction!r}")
        for name in ("width", "allocator_every", "proxy_sites", "proxy_maps"):
            _positive(f"radio.{name}", getattr(self, name), integer=True)
        if self.proxy_sites < 3:
            raise PayloadError(f"radio.proxy_sites must be >= 3, got {self.proxy_sites}")
        _positive("radio.site_radius_m", self.site_radius_m)
        _positive("radio.metres_per_pixel", self.metres_per_pixel)
        if self.max_walls is not None:
            _positive("radio.max_walls", self.max_walls, integer=True)
        if not isinstance(self.city_artifact, str) or not _ARTIFACT_NAME.match(self.city_artifact):
            raise PayloadError(f"radio.city_artifact {self.city_artifact!r} is not a plain file name")

    @property
    def guaranteed(self) -> bool:
        """Whether the defence states an (eps, delta) (privacy ``"grouped"``)."""
        return self.defence in GUARANTEED_RADIO_DEFENCES

    def floor_noise_multiplier(self) -> float:
        """z_eff of one upload: sqrt(phi) z / 2 (adaptive), z / 2 (uniform, and grouped-clipping, whose per-group
        norms and noise are calibrated to it) (edge_sdk.privacy.adaptive_noise, "Formal guarantee").

        Raises:
            PayloadError: the defence states no guarantee.
        """
        if self.defence == "adaptive":
            return math.sqrt(self.floor_fraction) * self.noise_multiplier / 2.0
        if self.defence in ("uniform", "grouped-clipping"):
            return self.noise_multiplier / 2.0
        raise PayloadError(f"the {self.defence} defence states no guarantee")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"defence": self.defence, "noise_multiplier": float(self.noise_multiplier),
                "floor_fraction": float(self.floor_fraction), "width": self.width,
                "allocator_every": self.allocator_every, "proxy_sites": self.proxy_sites,
                "proxy_maps": self.proxy_maps, "site_radius_m": float(self.site_radius_m),
                "metres_per_pixel": float(self.metres_per_pixel), "max_walls": self.max_walls,
                "city_artifact": self.city_artifact}

    @classmethod
    def from_json(cls, data: Any) -> "RadioTask":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: not an object, unknown fields, or values out of range.
        """
        if not isinstance(data, dict):
            raise PayloadError("radio must be an object")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise PayloadError(f"unknown radio task fields {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise PayloadError(f"radio task fields wrong: {exc}") from exc
