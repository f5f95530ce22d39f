"""Shamir t-out-of-n secret sharing of 32-byte secrets over ``GF(2^521 - 1)`` (Shamir 1979; Bonawitz et al. §3):
the shares by which the survivors recover a dropped site's mask key or a survivor's self-mask seed."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import PayloadError
from shared.secagg.errors import NotEnoughSharesError, SecAggError

#: The Mersenne prime 2^521 - 1: the Shamir field. Much larger than the 256-bit secrets, so a reconstruction from
#: inconsistent shares lands below 2^256 only with probability 2^-265 and is detected (see :func:`shamir_combine`).
SHAMIR_PRIME = (1 << 521) - 1
SECRET_BYTES = 32
_SHARE_Y_BYTES = (SHAMIR_PRIME.bit_length() + 7) // 8  # 66
SHARE_BYTES = 2 + _SHARE_Y_BYTES


@dataclass(frozen=True)
class Share:
    """One Shamir share ``(x, y)``: the polynomial's value y at x, in ``GF(SHAMIR_PRIME)``; x is the holder's
    :meth:`SecAggParams.x_coordinate`. Wire form: 2-byte big-endian x, 66-byte big-endian y."""

    x: int
    y: int

    def __post_init__(self) -> None:
        if type(self.x) is not int or not (1 <= self.x < 1 << 16):
            raise PayloadError(f"share x must be in [1, 65535], got {self.x!r}")
        if type(self.y) is not int or not (0 <= self.y < SHAMIR_PRIME):
            raise PayloadError("share y must be an integer in [0, 2^521 - 1)")

    def to_bytes(self) -> bytes:
        """The 68-byte wire form: x (2 bytes) then y (66 bytes), both big-endian."""
        return self.x.to_bytes(2, "big") + self.y.to_bytes(_SHARE_Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Share":
        """Raises PayloadError on a wrong length or out-of-range value."""
        if len(data) != SHARE_BYTES:
            raise PayloadError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
        return cls(int.from_bytes(data[:2], "big"), int.from_bytes(data[2:], "big"))


def shamir_split(secret: bytes, *, threshold: int, xs: Sequence[int]) -> dict[int, Share]:
    """Shamir t-out-of-n sharing (Shamir 1979; Bonawitz et al. §3) of a 32-byte secret.

    Draws a polynomial ``f`` of degree ``threshold - 1`` over ``GF(SHAMIR_PRIME)`` with ``f(0) = secret`` (as a
    big-endian integer) and uniformly random other coefficients (:func:`secrets.randbelow`); returns ``f(x)`` for
    every x. Any ``threshold - 1`` shares are jointly uniform and independent of the secret.

    Args:
        secret: 32 bytes.
        threshold: t >= 1.
        xs: distinct x-coordinates in [1, 65535].

    Returns:
        ``{x: Share(x, f(x))}``.
    """
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"a shared secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(not (1 <= x < 1 << 16) for x in xs):
        raise SecAggError(f"x-coordinates must be distinct and in [1, 65535], got {list(xs)!r}")
    if not (1 <= threshold <= len(xs)):
        raise SecAggError(f"threshold {threshold} must be in [1, {len(xs)}]")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(SHAMIR_PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % SHAMIR_PRIME
        shares[x] = Share(x, y)
    return shares


def _interpolate(points: Sequence[Share], at: Sequence[int]) -> list[int]:
    """Values at ``at`` of the polynomial of degree < len(points) through ``points`` (Lagrange, mod p)."""
    p = SHAMIR_PRIME
    xs = [s.x for s in points]
    inv_denominators = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if j != i:
                d = d * (xi - xj) % p
        inv_denominators.append(pow(d, -1, p))
    values = []
    for a in at:
        # numerator_i = prod_{j != i} (a - x_j), by prefix and suffix products: O(t) per point.
        diffs = [(a - xj) % p for xj in xs]
        prefix = [1]
        for d in diffs:
            prefix.append(prefix[-1] * d % p)
        suffix = [1]
        for d in reversed(diffs):
            suffix.append(suffix[-1] * d % p)
        suffix.reverse()
        total = 0
        for i, share in enumerate(points):
            total = (total + share.y * prefix[i] % p * suffix[i + 1] % p * inv_denominators[i]) % p
        values.append(total)
    return values


def shamir_combine(shares: Iterable[Share], *, threshold: int) -> bytes:
    """Reconstruct a 32-byte secret from at least ``threshold`` shares.

    Interpolates ``f(0)`` from the ``threshold`` shares with the smallest x, then checks every further share lies
    on the same polynomial, and that ``f(0) < 2^256``. The field is far larger than the secret space, so a single
    altered share among exactly ``threshold`` is still caught with probability ``1 - 2^-265``.

    Raises:
        NotEnoughSharesError: fewer than ``threshold`` distinct shares.
        SecAggError: two different shares for one x, or inconsistent shares.
    """
    by_x: dict[int, Share] = {}
    for share in shares:
        if share.x in by_x and by_x[share.x] != share:
            raise SecAggError(f"two different shares for x = {share.x}")
        by_x[share.x] = share
    if len(by_x) < threshold:
        raise NotEnoughSharesError(f"{len(by_x)} shares given, {threshold} needed to reconstruct the secret")
    ordered = [by_x[x] for x in sorted(by_x)]
    basis, extra = ordered[:threshold], ordered[threshold:]
    values = _interpolate(basis, [0] + [s.x for s in extra])
    if any(v != s.y for v, s in zip(values[1:], extra)):
        raise SecAggError("shares are inconsistent: they do not lie on one polynomial of degree threshold - 1")
    if values[0] >= 1 << (8 * SECRET_BYTES):
        raise SecAggError("shares are inconsistent: the reconstructed value is not a 32-byte secret")
    return values[0].to_bytes(SECRET_BYTES, "big")
