"""The secure noise source WildFed used before the cipher-speed one, kept as the benchmarks' baseline only: an
AES-256-CTR keystream from ``cryptography`` (keyed and nonced from ``os.urandom``), uniforms from the top 52 bits
of each 64-bit word, Gaussians by the polar method (Marsaglia and Bray 1964) in numpy passes of 16,384 values."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["PolarAes256"]

_ACCEPT = np.pi / 4  # P(v1^2 + v2^2 < 1) for v uniform in the square (-1, 1)^2
_BLOCK = 1 << 14  # normals per block


class PolarAes256:
    """``random(size)`` and ``standard_normal(size)`` as the previous ``shared.privacy.randomness.SecureRandom``."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()

    def words(self, n: int) -> np.ndarray:
        """n uint64 keystream words."""
        return np.frombuffer(self._encryptor.update(bytes(8 * n)), dtype=np.uint64)

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms in (0, 1)."""
        return ((self.words(int(size)) >> np.uint64(12)).astype(np.float64) + 0.5) * (1.0 / 4503599627370496.0)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1) of shape ``size`` by the polar method."""
        shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
        n = int(np.prod(shape, dtype=np.int64))
        out = np.empty(n, dtype=np.float64)
        filled = 0
        while filled < n:
            need = min(n - filled, _BLOCK)
            pairs = int(need / 2 / _ACCEPT * 1.02) + 16
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
