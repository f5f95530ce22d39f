"""DP events as plain frozen data, shared by the gateway (which reports what it ran) and the ledger (which
composes it).

Compatibility rules (as dp-accounting's ``dp_event`` module states them): a field is never removed and never
changes meaning; new fields are optional with a default that reproduces the old meaning; a reader that meets an
unknown ``type`` raises rather than skipping the event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dp_accounting

from shared.errors import PayloadError

__all__ = ["DPSGDEvent"]


@dataclass(frozen=True)
class DPSGDEvent:
    """``steps`` steps of the Poisson-subsampled Gaussian mechanism (DP-SGD, Abadi et al. 2016, Alg. 1).

    For one IUCN category at one site: each step samples each record independently with probability
    ``sampling_rate`` and adds Gaussian noise of standard deviation ``noise_multiplier * clipping_norm`` to the sum of
    that category's clipped per-example gradients.

    Attributes:
        noise_multiplier: z = sigma / C (dimensionless, > 0).
        sampling_rate: q, Poisson sampling probability per record per step, in (0, 1].
        steps: number of steps (>= 0).

    Raises:
        PayloadError: a value is out of range (events arrive over the wire).
    """

    noise_multiplier: float
    sampling_rate: float
    steps: int

    def __post_init__(self) -> None:
        z, q, t = self.noise_multiplier, self.sampling_rate, self.steps
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (0 < z < math.inf):
            raise PayloadError(f"noise_multiplier must be positive and finite, got {z!r}")
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0 < q <= 1):
            raise PayloadError(f"sampling_rate must be in (0, 1], got {q!r}")
        if type(t) is not int or t < 0:
            raise PayloadError(f"steps must be a non-negative integer, got {t!r}")

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event: ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)``."""
        step = dp_accounting.PoissonSampledDpEvent(self.sampling_rate,
                                                   dp_accounting.GaussianDpEvent(self.noise_multiplier))
        return dp_accounting.SelfComposedDpEvent(step, self.steps)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``type`` tag."""
        return {"type": "dpsgd", "noise_multiplier": float(self.noise_multiplier),
                "sampling_rate": float(self.sampling_rate), "steps": int(self.steps)}

    @classmethod
    def from_json(cls, data: Any) -> "DPSGDEvent":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: unknown ``type``, missing/extra fields, or values out of range.
        """
        if not isinstance(data, dict) or data.get("type") != "dpsgd":
            raise PayloadError(f"unknown DP event {data!r}: this reader knows type 'dpsgd'")
        fields = {k: v for k, v in data.items() if k != "type"}
        if set(fields) != {"noise_multiplier", "sampling_rate", "steps"}:
            raise PayloadError(f"DP event fields wrong: {sorted(fields)}")
        return cls(**fields)
