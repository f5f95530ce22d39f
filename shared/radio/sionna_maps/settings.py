"""The settings a Sionna RT trace depends on (:class:`SionnaSettings`; the steps are those of
:mod:`shared.radio.sionna_maps`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import ConfigError


@dataclass(frozen=True)
class SionnaSettings:
    """What a traced tile depends on (:mod:`shared.radio.sionna_maps`, steps 1-5); defaults are WildFed's Sionna set.

    Attributes:
        frequency_hz: carrier in Hz (3.5 GHz, as the COST 231 maps: 5G NR band n78).
        tx_height_m: transmitter height above the ground in metres (6 m: a lamp-post small cell, below most roofs).
        rx_height_m: height of the measurement surface above the ground in metres (1.5 m, a handset). The two
            must differ by at least 0.5 m: a transmitter on the measurement surface sends its direct rays along
            it, so they never cross it and the radio map misses the line of sight (checked: with both at 1.5 m,
            line-of-sight pixels of Munich came out 3 dB below Friis, carried by the ground reflection alone;
            with 3 m or 6 m in free space, within 0.02 dB of Friis).
        max_depth: most interactions per path (reflections and refractions), >= 1.
        samples_per_tx: rays per transmitter of the first trace, >= 1000.
        max_samples_per_tx: the doubling stops here.
        min_coverage: target fraction of outdoor pixels with a value, averaged over a batch, in (0, 1].
        refraction, specular_reflection, diffuse_reflection, diffraction: ``RadioMapSolver`` switches.
        seed: the solver's seed, >= 0.
        tx_step_px: transmitters on outdoor pixels of a grid of this step (offset ``step // 2``), >= 1.
        tx_per_tile: at most this many of those (a seeded, spread-out subset, :func:`bank_positions`); None: all.
        batch: transmitters traced in one solver call, >= 1.

    Raises:
        ConfigError (a ValueError): a field out of range, naming it.
    """

    frequency_hz: float = 3.5e9
    tx_height_m: float = 6.0
    rx_height_m: float = 1.5
    max_depth: int = 20
    samples_per_tx: int = 1_000_000
    max_samples_per_tx: int = 8_000_000
    min_coverage: float = 0.9
    refraction: bool = True
    specular_reflection: bool = True
    diffuse_reflection: bool = False
    diffraction: bool = False
    seed: int = 0
    tx_step_px: int = 2
    tx_per_tile: int | None = None
    batch: int = 8

    def __post_init__(self) -> None:
        for name in ("frequency_hz", "tx_height_m", "rx_height_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                   and value > 0):
                raise ConfigError(f"must be a number > 0, got {value!r}", field=name,
                                  fix="give it in SI units (Hz, metres)")
        if abs(self.tx_height_m - self.rx_height_m) < 0.5:
            raise ConfigError(f"must differ from rx_height_m ({self.rx_height_m} m) by >= 0.5 m, got "
                              f"{self.tx_height_m} m", field="tx_height_m",
                              fix="raise the transmitter (default 6 m): on the measurement surface its direct rays "
                                  "are never counted")
        ints = {"max_depth": 1, "samples_per_tx": 1000, "max_samples_per_tx": 1000, "seed": 0, "tx_step_px": 1,
                "batch": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"must be an int >= {low}, got {value!r}", field=name, fix=f"use e.g. {low}")
        if self.max_samples_per_tx < self.samples_per_tx:
            raise ConfigError(f"must be >= samples_per_tx ({self.samples_per_tx}), got {self.max_samples_per_tx}",
                              field="max_samples_per_tx", fix="raise it or lower samples_per_tx")
        if self.tx_per_tile is not None and (isinstance(self.tx_per_tile, bool) or not isinstance(self.tx_per_tile, int)
                                             or self.tx_per_tile < 1):
            raise ConfigError(f"must be None or an int >= 1, got {self.tx_per_tile!r}", field="tx_per_tile",
                              fix="leave it out for every grid position, or give a count")
        if isinstance(self.min_coverage, bool) or not isinstance(self.min_coverage, (int, float)) \
                or not 0 < self.min_coverage <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.min_coverage!r}", field="min_coverage",
                              fix="use e.g. 0.9")
        for name in ("refraction", "specular_reflection", "diffuse_reflection", "diffraction"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"must be a bool, got {getattr(self, name)!r}", field=name, fix="use True or False")
