"""Randomness for privacy: a cryptographically secure source in production, a seeded one only on request.

Floating-point Gaussian noise from a predictable generator (e.g. a seeded Mersenne Twister or PCG64) gives no
privacy against anyone who can guess the seed. The production source here is AES-256 in counter mode
(NIST SP 800-38A) keyed with 32 bytes from ``os.urandom``: its keystream is a cryptographically secure
pseudo-random stream (the construction of NIST SP 800-90A's CTR_DRBG, without reseeding). Uniforms take the top
52 bits of each 64-bit keystream word; Gaussians come from the polar method (Marsaglia and Bray 1964), the
rejection form of Box-Muller that needs no trigonometric functions.

Known limit (Mironov 2012, "On significance of the least significant bits for differential privacy"): textbook
floating-point noise samplers have gaps in their support; this module does not implement a snapping or
discrete-Gaussian defence. Documented in docs, not claimed away.

:class:`SeededRandom` wraps ``numpy.random.default_rng(seed)`` for reproducible tests and demos and emits an
:class:`InsecureRandomnessWarning` when created.
"""

from __future__ import annotations

import os
import warnings
from typing import Protocol

import numpy as np

__all__ = ["RandomSource", "SecureRandom", "SeededRandom", "InsecureRandomnessWarning", "make_random_source"]


class InsecureRandomnessWarning(UserWarning):
    """Privacy noise or sampling is drawn from a seeded, predictable generator: no privacy guarantee holds."""


class RandomSource(Protocol):
    """Uniforms and standard normals as float64 arrays."""

    def random(self, size: int) -> np.ndarray:  # pragma: no cover - protocol
        """float64 (size,) uniforms in [0, 1)."""
        ...

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:  # pragma: no cover - protocol
        """float64 array of the given shape, i.i.d. N(0, 1)."""
        ...


class SecureRandom:
    """AES-256-CTR keystream keyed by ``os.urandom`` (see the module docstring).

    Args:
        key: 32-byte AES key; ``None`` (production) draws it from ``os.urandom``. Passing a key is for tests of
            this class only.
    """

    def __init__(self, key: bytes | None = None) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        nonce = os.urandom(16) if key is None else b"\x00" * 16
        key = os.urandom(32) if key is None else key
        if len(key) != 32:
            raise ValueError("AES-256 key must be 32 bytes")
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()

    def _words(self, n: int) -> np.ndarray:
        """n uint64 keystream words."""
        return np.frombuffer(self._encryptor.update(bytes(8 * n)), dtype=np.uint64)

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms strictly inside (0, 1): ``(top 52 bits + 0.5) / 2**52``.

        52 bits, not 53: ``(2**53 - 0.5) / 2**53`` rounds to exactly 1.0 in float64, ``(2**52 - 0.5) / 2**52`` does
        not, so neither end of the interval is ever returned.
        """
        return ((self._words(int(size)) >> np.uint64(12)).astype(np.float64) + 0.5) * (1.0 / 4503599627370496.0)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1) of shape ``size`` by the polar method (Marsaglia and Bray 1964; Knuth, TAOCP
        vol. 2, 3.4.1, Algorithm P): pairs ``v = 2u - 1`` uniform in the square, kept when ``0 < s = v1^2 + v2^2
        < 1`` (probability pi/4), give the two independent normals ``v1 f`` and ``v2 f`` with
        ``f = sqrt(-2 ln(s) / s)``. The same distribution as Box-Muller without its cosine and sine, which cost
        two thirds of a noise draw. How many uniforms are used depends on the keystream alone, never on data.
        """
        shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
        n = int(np.prod(shape, dtype=np.int64))
        out = np.empty(n, dtype=np.float64)
        filled = 0
        while filled < n:  # in cache-sized blocks (a few hundred kB of temporaries each)
            need = min(n - filled, _POLAR_BLOCK)
            pairs = int(need / 2 / _POLAR_ACCEPT * 1.02) + 16  # one round almost always suffices
            v = self.random(2 * pairs)
            v *= 2.0
            v -= 1.0
            v1, v2 = v[:pairs], v[pairs:]
            s = v1 * v1 + v2 * v2
            keep = (s < 1.0) & (s > 0.0)
            v1, v2, s = v1[keep], v2[keep], s[keep]
            f = np.sqrt(-2.0 * np.log(s) / s)
            z = np.concatenate([v1 * f, v2 * f])
            take = min(need, z.shape[0])
            out[filled:filled + take] = z[:take]
            filled += take
        return out.reshape(shape)


_POLAR_ACCEPT = np.pi / 4  # P(v1^2 + v2^2 < 1) for v uniform in the square (-1, 1)^2
_POLAR_BLOCK = 1 << 14  # normals per block


class SeededRandom:
    """``numpy.random.default_rng(seed)`` behind the :class:`RandomSource` interface; warns loudly when created."""

    def __init__(self, seed: int) -> None:
        warnings.warn(
            f"privacy randomness is seeded (seed={seed}): sampling and noise are reproducible by anyone who knows "
            "the seed, so NO differential-privacy guarantee holds. Use this only for tests and demos.",
            InsecureRandomnessWarning,
            stacklevel=2,
        )
        self._rng = np.random.default_rng(seed)

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms in [0, 1)."""
        return self._rng.random(int(size))

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1) of shape ``size``."""
        return self._rng.standard_normal(size)


def make_random_source(seed: int | None = None) -> RandomSource:
    """:class:`SecureRandom` when ``seed`` is None, else :class:`SeededRandom` (with its warning)."""
    return SecureRandom() if seed is None else SeededRandom(seed)
