"""Secure aggregation's public round parameters (:class:`SecAggParams`) and the largest scale that cannot wrap."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.envelope import validate_identifier
from shared.errors import ConfigError, MalformedEnvelopeError
from shared.secagg.errors import SecAggError

_MIN_MODULUS_BITS, _MAX_MODULUS_BITS = 16, 64


@dataclass(frozen=True)
class SecAggParams:
    """The public parameters of one secure-aggregation round; every site and the server must hold equal copies.

    Attributes:
        federation_id: identifier of the federation (bound into every derived key).
        round: round number (>= 0; bound into every derived key, so masks never repeat across rounds).
        site_ids: the sites selected for the round (``U`` of Fig. 4); stored sorted. Its order defines each site's
            Shamir x-coordinate (position + 1) and the sign ``Delta_{u,v}`` of pairwise masks.
        threshold: t of the t-out-of-n Shamir sharing: the fewest surviving sites that can unmask, and one more
            than the largest coalition of sites that (with the server) learns nothing beyond the sum. Must satisfy
            ``2 <= t <= n`` and ``2t > n`` (a majority: two disjoint groups of survivors cannot both reach t,
            so a server cannot obtain a site's mask key from one group and its self-mask seed from another).
        vector_length: d, number of float32 coordinates of one (flattened) update.
        max_abs_value: B, the clipping bound on each coordinate (same unit as the update).
        scale: integers per unit of the update: ``Q(x) = rint(clip(x, -B, B) * scale) mod 2^k``.
        modulus_bits: k, masks and sums live in ``Z_{2^k}``; 16 <= k <= 64; ``uint32`` arrays for k <= 32, else
            ``uint64``.

    Raises:
        ConfigError: a value out of range, or ``n * rint(B * scale) >= 2^(k-1)`` (the modular sum could wrap).
    """

    federation_id: str
    round: int
    site_ids: tuple[str, ...]
    threshold: int
    vector_length: int
    max_abs_value: float
    scale: float
    modulus_bits: int = 32

    def __post_init__(self) -> None:
        try:
            validate_identifier(self.federation_id, "federation_id")
            for site in self.site_ids:
                validate_identifier(site, "site_id")
        except MalformedEnvelopeError as err:
            raise ConfigError(str(err), field="site_ids/federation_id",
                              fix="use identifiers of 1-64 characters from A-Za-z0-9_.-") from None
        if type(self.round) is not int or self.round < 0:
            raise ConfigError(f"round must be a non-negative integer, got {self.round!r}", field="round")
        sites = tuple(sorted(self.site_ids))
        if len(set(sites)) != len(sites) or len(sites) < 2:
            raise ConfigError(f"site_ids must hold at least 2 distinct sites, got {list(self.site_ids)!r}",
                              field="site_ids", fix="list each selected site once")
        if len(sites) >= 1 << 16:
            raise ConfigError("at most 65535 sites per round", field="site_ids")
        object.__setattr__(self, "site_ids", sites)
        n, t = len(sites), self.threshold
        if type(t) is not int or not (2 <= t <= n) or 2 * t <= n:
            raise ConfigError(f"threshold must be an integer with 2 <= t <= n and 2t > n (n = {n}), got {t!r}",
                              field="threshold", fix=f"use threshold = {n // 2 + 1} (the smallest majority)")
        if type(self.vector_length) is not int or self.vector_length < 1:
            raise ConfigError(f"vector_length must be a positive integer, got {self.vector_length!r}",
                              field="vector_length")
        k = self.modulus_bits
        if type(k) is not int or not (_MIN_MODULUS_BITS <= k <= _MAX_MODULUS_BITS):
            raise ConfigError(f"modulus_bits must be an integer in [16, 64], got {k!r}", field="modulus_bits")
        for name in ("max_abs_value", "scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}", field=name)
        if self.max_quantised < 1:
            raise ConfigError(f"max_abs_value * scale rounds to 0 ({self.max_abs_value} * {self.scale})",
                              field="scale", fix="raise scale so that one unit of B is at least one integer step")
        if n * self.max_quantised >= 1 << (k - 1):
            best = max_power_of_two_scale(num_sites=n, max_abs_value=self.max_abs_value, modulus_bits=k)
            raise ConfigError(
                f"the sum of {n} quantised updates can wrap mod 2^{k}: n * rint(B * scale) = "
                f"{n * self.max_quantised} >= 2^{k - 1}", field="scale",
                fix=f"use scale <= {best!r} (largest power of two that fits), lower max_abs_value, "
                    "or raise modulus_bits to 64")

    @property
    def num_sites(self) -> int:
        """n = |U|."""
        return len(self.site_ids)

    @property
    def modulus(self) -> int:
        """2^k."""
        return 1 << self.modulus_bits

    @property
    def dtype(self) -> np.dtype:
        """``uint32`` for k <= 32, else ``uint64``."""
        return np.dtype(np.uint32) if self.modulus_bits <= 32 else np.dtype(np.uint64)

    @property
    def max_quantised(self) -> int:
        """``rint(B * scale)``: the largest |Q(x)| of one coordinate of one site (rint is monotone)."""
        return int(np.rint(np.float64(self.max_abs_value) * np.float64(self.scale)))

    def x_coordinate(self, site_id: str) -> int:
        """The site's Shamir x-coordinate: its position in the sorted ``site_ids`` plus one (never 0)."""
        try:
            return self.site_ids.index(site_id) + 1
        except ValueError:
            raise SecAggError(f"site {site_id!r} is not in this round's site_ids") from None


def max_power_of_two_scale(*, num_sites: int, max_abs_value: float, modulus_bits: int) -> float:
    """The largest power-of-two ``scale`` with ``num_sites * rint(max_abs_value * scale) < 2^(modulus_bits-1)``.

    A power of two makes ``sum / scale`` an exact float operation. The per-coordinate rounding error of the
    dequantised sum is then at most ``num_sites / (2 * scale)`` (:func:`quantisation_error_bound`).
    """
    limit = 1 << (modulus_bits - 1)
    exponent = math.floor(math.log2(limit / (num_sites * max_abs_value))) + 1
    while exponent > -1074:
        scale = math.ldexp(1.0, exponent)
        if num_sites * int(np.rint(max_abs_value * scale)) < limit:
            return scale
        exponent -= 1
    raise ConfigError("no positive scale fits", field="max_abs_value")
