"""Randomness for privacy: a cryptographically secure source in production, a seeded one only on request.

Floating-point Gaussian noise from a predictable generator (e.g. a seeded Mersenne Twister or PCG64) gives no
privacy against anyone who can guess the seed. The production source here is a stream cipher's keystream, keyed
from ``os.urandom`` afresh for every instance, read by numpy's ``Generator`` as its 64-bit words:

- ``"aes128-ctr"``: AES-128 in counter mode (NIST SP 800-38A) with AES-NI, randomgen's ``AESCounter``: the block
  ``AES_k(i)`` for the 128-bit little-endian counter ``i = 0, 1, 2, ...``, i.e. the keystream of NIST SP 800-90A's
  CTR_DRBG construction without reseeding, at security strength 128;
- ``"chacha20"``: ChaCha20 (RFC 8439's block function, 20 rounds, 256-bit key, zero nonce), randomgen's
  ``ChaCha``; the default where the CPU has no AES instructions, since randomgen's software AES fallback is
  table-based (slow, and its memory accesses depend on the key) while ChaCha20 is add-rotate-xor only.

``tests/shared/test_randomness.py`` checks both streams bit for bit against ``cryptography``'s (OpenSSL's) AES and
ChaCha20. The transforms are numpy's C loops: normals by its 256-layer ziggurat (``Generator.standard_normal``;
Marsaglia and Tsang 2000), Skellam noise by its Poisson sampler (``shared.privacy.distributed``), uniforms from the
top 52 bits of each word. How many words a draw uses depends on the keystream alone, never on data.

A forked child process never continues its parent's stream: the first draw in a new process rekeys from
``os.urandom``; and a :class:`SecureRandom` cannot be copied or pickled (two gateways, two instances or two
processes never share a stream).

Known limit (Mironov 2012, "On significance of the least significant bits for differential privacy"): textbook
floating-point noise samplers have gaps in their support; the ziggurat's values lie on a 52-bit grid per layer,
and this module does not implement a snapping or discrete-Gaussian defence. Documented in docs, not claimed away.

:class:`SeededRandom` wraps ``numpy.random.default_rng(seed)`` for reproducible tests and demos and emits an
:class:`InsecureRandomnessWarning` when created.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Protocol

import numpy as np

__all__ = ["RandomSource", "SecureRandom", "SeededRandom", "InsecureRandomnessWarning", "make_random_source",
           "secure_generator", "default_cipher", "CIPHERS"]

#: the stream ciphers a :class:`SecureRandom` can read, with their key lengths in bytes
CIPHERS = {"aes128-ctr": 16, "chacha20": 32}


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


@functools.lru_cache(maxsize=1)
def default_cipher() -> str:
    """``"aes128-ctr"`` where randomgen's AES runs on the CPU's AES instructions (x86 AES-NI), else
    ``"chacha20"`` (module docstring)."""
    from randomgen import AESCounter

    return "aes128-ctr" if AESCounter(key=0).use_aesni else "chacha20"


def _bit_generator(cipher: str, key: bytes) -> np.random.BitGenerator:
    from randomgen import AESCounter, ChaCha

    if cipher == "aes128-ctr":
        return AESCounter(key=int.from_bytes(key, "little"), counter=0)
    return ChaCha(key=int.from_bytes(key, "little"), counter=0, rounds=20)


def _check(cipher: str | None, key: bytes | None) -> str:
    cipher = default_cipher() if cipher is None else cipher
    if cipher not in CIPHERS:
        raise ValueError(f"cipher must be one of {sorted(CIPHERS)}, got {cipher!r}")
    if key is not None and len(key) != CIPHERS[cipher]:
        raise ValueError(f"a {cipher} key is {CIPHERS[cipher]} bytes, got {len(key)}")
    return cipher


def secure_generator(key: bytes | None = None, *, cipher: str | None = None) -> np.random.Generator:
    """A ``numpy.random.Generator`` reading a stream cipher's keystream (module docstring), for samplers that
    take a Generator (e.g. ``shared.privacy.distributed.skellam_noise``). Unlike :class:`SecureRandom` it does
    not rekey after a fork: use it within one process.

    Args:
        key: ``None`` (production) draws a fresh key from ``os.urandom``; a key is for tests only
            (16 bytes for ``"aes128-ctr"``, 32 for ``"chacha20"``).
        cipher: one of :data:`CIPHERS`; ``None`` = :func:`default_cipher`.

    Raises:
        ValueError: an unknown cipher, or a key of the wrong length.
    """
    cipher = _check(cipher, key)
    return np.random.Generator(_bit_generator(cipher, os.urandom(CIPHERS[cipher]) if key is None else key))


class SecureRandom:
    """Uniforms and normals from a stream cipher's keystream keyed by ``os.urandom`` (see the module docstring).

    Args:
        key: ``None`` (production) draws the key from ``os.urandom``. Passing a key is for tests of this class
            only (16 bytes for ``"aes128-ctr"``, 32 for ``"chacha20"``).
        cipher: one of :data:`CIPHERS`; ``None`` = :func:`default_cipher` (AES-128-CTR on AES-NI, else ChaCha20).

    Raises:
        ValueError: an unknown cipher, or a key of the wrong length.
    """

    def __init__(self, key: bytes | None = None, *, cipher: str | None = None) -> None:
        self.cipher = _check(cipher, key)
        self._rekey(key)

    def _rekey(self, key: bytes | None = None) -> None:
        self._pid = os.getpid()
        self._gen = np.random.Generator(
            _bit_generator(self.cipher, os.urandom(CIPHERS[self.cipher]) if key is None else key))

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError("a SecureRandom cannot be copied or pickled: the copy would repeat its noise stream (and "
                        "the pickle would hold its key); create a new SecureRandom() where another source is needed")

    def _generator(self) -> np.random.Generator:
        if os.getpid() != self._pid:  # a forked child: a fresh key, never the parent's stream
            self._rekey()
        return self._gen

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms strictly inside (0, 1): ``(top 52 bits of a word + 0.5) / 2**52``.

        52 bits, not 53: ``(2**53 - 0.5) / 2**53`` rounds to exactly 1.0 in float64, ``(2**52 - 0.5) / 2**52`` does
        not, so neither end of the interval is ever returned.
        """
        words = self._generator().bit_generator.random_raw(int(size))
        words >>= np.uint64(12)
        out = words.astype(np.float64)
        out += 0.5
        out *= 1.0 / 4503599627370496.0
        return out

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1) of shape ``size``: numpy's ziggurat (``Generator.standard_normal``) on the
        keystream's words."""
        return self._generator().standard_normal(size)


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
