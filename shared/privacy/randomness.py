"""Randomness for privacy: a cryptographically secure source in production, a seeded one only on request.

Floating-point Gaussian noise from a predictable generator (e.g. a seeded Mersenne Twister or PCG64) gives no
privacy against anyone who can guess the seed. The production source here is AES-256 in counter mode
(NIST SP 800-38A) keyed with 32 bytes from ``os.urandom``: its keystream is a cryptographically secure
pseudo-random stream (the construction of NIST SP 800-90A's CTR_DRBG, without reseeding). Uniforms take the top
53 bits of each 64-bit keystream word; Gaussians come from the Box-Muller transform (Box & Muller 1958).

Known limit (Mironov 2012, "On significance of the least significant bits for differential privacy"): textbook
floating-point noise samplers have gaps in their support; this module does not implement a snapping or
discrete-Gaussian defence. Documented in docs, not claimed away.

:class:`SeededRandom` wraps ``numpy.random.default_rng(seed)`` for reproducible tests and demos and emits an
:class:`InsecureRandomnessWarning` when created.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
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
        not, so neither end of the interval is ever returned (Box-Muller takes ``log`` of it).
        """
        return ((self._words(int(size)) >> np.uint64(12)).astype(np.float64) + 0.5) * (1.0 / 4503599627370496.0)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1) of shape ``size`` by Box-Muller (both outputs of each pair are used).

        The keystream is drawn in one call; the transform of large requests runs in a few threads (numpy's
        ufuncs release the GIL), which changes nothing about the values.
        """
        shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
        n = int(np.prod(shape, dtype=np.int64))
        pairs = (n + 1) // 2
        u = self.random(2 * pairs)
        out = np.empty(2 * pairs, dtype=np.float64)
        chunks = [(lo, min(pairs, lo + _CHUNK)) for lo in range(0, pairs, _CHUNK)]
        if len(chunks) > 1:
            list(_pool().map(lambda c: _box_muller(u, out, pairs, *c), chunks))
        else:
            _box_muller(u, out, pairs, 0, pairs)
        return out[:n].reshape(shape)


_CHUNK = 1 << 17  # Box-Muller pairs per thread task
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="noise")
    return _POOL


def _box_muller(u: np.ndarray, out: np.ndarray, pairs: int, lo: int, hi: int) -> None:
    """out[lo:hi] = r cos(t), out[pairs+lo : pairs+hi] = r sin(t), r = sqrt(-2 ln u1), t = 2 pi u2."""
    radius = np.log(u[lo:hi])
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle = u[pairs + lo:pairs + hi] * (2.0 * np.pi)
    np.multiply(radius, np.cos(angle), out=out[lo:hi])
    np.multiply(radius, np.sin(angle), out=out[pairs + lo:pairs + hi])


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
