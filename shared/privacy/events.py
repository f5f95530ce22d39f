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

from shared.errors import PayloadError, tagged_fields
from shared.privacy.skellam import SkellamDpEvent, skellam_rdp

__all__ = ["DPSGDEvent", "SkellamEvent", "PrivacyEvent", "parse_event"]


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

    def mechanism_key(self) -> tuple[Any, ...]:
        """What identifies the per-step mechanism (events with equal keys compose by adding their steps)."""
        return ("dpsgd", float(self.noise_multiplier), float(self.sampling_rate))

    def with_steps(self, steps: int) -> "DPSGDEvent":
        """The same mechanism, ``steps`` steps."""
        return DPSGDEvent(self.noise_multiplier, self.sampling_rate, int(steps))

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
        return cls(**tagged_fields(data, "dpsgd", {"noise_multiplier", "sampling_rate", "steps"}, "DP event"))


@dataclass(frozen=True)
class SkellamEvent:
    """``steps`` releases of the multi-dimensional Skellam mechanism (Agarwal, Kairouz and Liu, "The Skellam
    Mechanism for Differentially Private Federated Learning", NeurIPS 2021): an integer vector whose every
    coordinate carries independent symmetric Skellam noise of variance ``variance``, computed from data whose
    add/remove-one sensitivity is at most ``l2_sensitivity`` in L2 and ``l1_sensitivity`` in L1 (all in the
    integer units of the secure-aggregation grid). No subsampling is credited.

    Privacy (their Thm 3.5): for every integer order alpha > 1 the mechanism is (alpha, eps(alpha))-RDP with
    ``eps(alpha) = alpha D2^2/(2 mu) + min(((2 alpha - 1) D2^2 + 6 D1)/(4 mu^2), 3 D1/(2 mu))``
    (:func:`shared.privacy.skellam.skellam_rdp`). :meth:`to_dp_event` is that bound as a dp-accounting event
    (:class:`shared.privacy.skellam.SkellamDpEvent`), composed and converted by the RDP accountant of
    :func:`shared.privacy.accounting.make_accountant` (dp-accounting's, extended to this event; the PLD accountant
    does not take it and raises, never skips). The fields say what was released, not how it is accounted, so a
    stored event is charged by the bound the accountant implements.

    Attributes:
        variance: mu > 0, per-coordinate variance of the released noise (integer units).
        l2_sensitivity: D2 > 0. l1_sensitivity: D1 >= D2 (D1 <= sqrt(d) D2 always holds).
        steps: number of releases (>= 0).

    Raises:
        PayloadError: a value is out of range (events arrive over the wire and from the ledger).
    """

    variance: float
    l2_sensitivity: float
    l1_sensitivity: float
    steps: int

    def __post_init__(self) -> None:
        for name in ("variance", "l2_sensitivity", "l1_sensitivity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise PayloadError(f"{name} must be positive and finite, got {v!r}")
        if self.l1_sensitivity < self.l2_sensitivity:
            raise PayloadError("l1_sensitivity must be at least l2_sensitivity")
        if type(self.steps) is not int or self.steps < 0:
            raise PayloadError(f"steps must be a non-negative integer, got {self.steps!r}")

    @property
    def noise_multiplier(self) -> float:
        """``sqrt(mu) / D2``: the noise standard deviation over the L2 sensitivity (shown in the ledger's
        columns; the accounting uses the exact parameters)."""
        return float(math.sqrt(self.variance) / self.l2_sensitivity)

    @property
    def sampling_rate(self) -> float:
        """1.0: no amplification by subsampling is credited."""
        return 1.0

    def rdp(self, orders: Any) -> Any:
        """float64 array: the RDP of one release at each of ``orders`` (each > 1; Thm 3.5, a fractional order
        bounded by the next integer one: :func:`shared.privacy.skellam.skellam_rdp`)."""
        return skellam_rdp(orders, self.variance, self.l2_sensitivity, self.l1_sensitivity)

    def mechanism_key(self) -> tuple[Any, ...]:
        """What identifies the per-release mechanism (events with equal keys compose by adding their steps)."""
        return ("skellam", float(self.variance), float(self.l2_sensitivity), float(self.l1_sensitivity))

    def with_steps(self, steps: int) -> "SkellamEvent":
        """The same mechanism, ``steps`` releases."""
        return SkellamEvent(self.variance, self.l2_sensitivity, self.l1_sensitivity, int(steps))

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """``SelfComposed(SkellamDpEvent(mu, D2, D1), steps)`` (class docstring)."""
        return dp_accounting.SelfComposedDpEvent(
            SkellamDpEvent(float(self.variance), float(self.l2_sensitivity), float(self.l1_sensitivity)), self.steps)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``type`` tag."""
        return {"type": "skellam", "variance": float(self.variance), "l2_sensitivity": float(self.l2_sensitivity),
                "l1_sensitivity": float(self.l1_sensitivity), "steps": int(self.steps)}

    @classmethod
    def from_json(cls, data: Any) -> "SkellamEvent":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: unknown ``type``, missing/extra fields, or values out of range.
        """
        return cls(**tagged_fields(data, "skellam", {"variance", "l2_sensitivity", "l1_sensitivity", "steps"},
                                   "DP event"))


#: the event types the ledger composes
PrivacyEvent = DPSGDEvent | SkellamEvent


def parse_event(data: Any) -> PrivacyEvent:
    """An event from its JSON form, by its ``type`` tag (``"dpsgd"`` or ``"skellam"``).

    Raises:
        PayloadError: an unknown type (a reader never skips an event it cannot interpret) or bad fields.
    """
    if isinstance(data, dict) and data.get("type") == "skellam":
        return SkellamEvent.from_json(data)
    return DPSGDEvent.from_json(data)
