"""The secure noise source (``shared.privacy.randomness``): its streams are AES-128-CTR and ChaCha20 bit for bit
(checked against ``cryptography``'s OpenSSL), each instance keys itself from ``os.urandom``, a forked child never
continues its parent's stream, no instance can be copied, and the uniforms and normals have the right
distribution; the seeded source warns.

Distribution checks run on fresh OS randomness. Each statistical assertion fails a correct source with probability
at most 1e-6 (KS and chi-square at significance 1e-6, the moment bounds at 2e-9; each says so in a comment), so a
run of this file fails a correct source with probability below 1e-5, while the bounds still catch a wrong transform
(the comments say which)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from edge_sdk.privacy.randomness import SecureRandom as EdgeSecureRandom
from shared.privacy.randomness import (CIPHERS, InsecureRandomnessWarning, SecureRandom, default_cipher,
                                       make_random_source, secure_generator)

KEYS = {"aes128-ctr": bytes(range(16)), "chacha20": bytes(range(100, 132))}
TWO52 = 4503599627370496.0


def reference_keystream(cipher: str, key: bytes, n_words: int) -> np.ndarray:
    """uint64 (n_words,): the keystream as ``cryptography`` (OpenSSL) computes it, read as little-endian words.
    AES-128-CTR: ``AES_k(i)`` for the 128-bit little-endian counter i = 0, 1, ...; ChaCha20: RFC 8439's block
    function with a zero nonce and block counter from 0 (cryptography's 16-byte nonce is counter || nonce)."""
    if cipher == "aes128-ctr":
        ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
        stream = ecb.update(b"".join(i.to_bytes(16, "little") for i in range((n_words + 1) // 2)))
    else:
        stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8 * n_words))
    return np.frombuffer(stream[:8 * n_words], dtype="<u8").astype(np.uint64)


@pytest.mark.parametrize("cipher", sorted(CIPHERS))
def test_streams_are_the_named_cipher_bit_for_bit(cipher) -> None:
    from randomgen import UserBitGenerator

    words = reference_keystream(cipher, KEYS[cipher], 4000)
    # uniforms: (top 52 bits + 0.5) / 2^52 of each word, in order
    expected = ((words >> np.uint64(12)).astype(np.float64) + 0.5) / TWO52
    np.testing.assert_array_equal(SecureRandom(KEYS[cipher], cipher=cipher).random(4000), expected)
    # normals: numpy's ziggurat reading exactly these words (fed one by one from the reference keystream)
    it = iter(words.tolist())
    reference = np.random.Generator(UserBitGenerator(lambda _: next(it), 64)).standard_normal(1000)
    np.testing.assert_array_equal(SecureRandom(KEYS[cipher], cipher=cipher).standard_normal(1000), reference)
    np.testing.assert_array_equal(secure_generator(KEYS[cipher], cipher=cipher).standard_normal(1000), reference)


def test_each_instance_keys_itself_from_os_urandom(monkeypatch) -> None:
    calls: list[int] = []

    def fake_urandom(n: int) -> bytes:
        calls.append(n)
        return bytes([len(calls)]) * n  # a distinct, known key per call

    for cipher in sorted(CIPHERS):
        calls.clear()
        monkeypatch.setattr(os, "urandom", fake_urandom)
        a, b = SecureRandom(cipher=cipher), SecureRandom(cipher=cipher)
        generator = secure_generator(cipher=cipher)
        monkeypatch.undo()
        assert calls == [CIPHERS[cipher]] * 3  # one full-length key per instance, nothing else
        n = CIPHERS[cipher]
        np.testing.assert_array_equal(a.random(16), SecureRandom(bytes([1]) * n, cipher=cipher).random(16))
        np.testing.assert_array_equal(b.standard_normal(16),
                                      SecureRandom(bytes([2]) * n, cipher=cipher).standard_normal(16))
        np.testing.assert_array_equal(generator.random(16), secure_generator(bytes([3]) * n, cipher=cipher).random(16))
    # with the real OS source two instances (two gateways) differ: equal 64-bit streams have probability 2^-512
    assert not np.array_equal(SecureRandom().random(8), SecureRandom().random(8))
    assert not np.array_equal(EdgeSecureRandom().standard_normal(8), EdgeSecureRandom().standard_normal(8))
    assert isinstance(make_random_source(None), SecureRandom)


def test_default_cipher_is_aes_on_aes_ni_and_chacha20_without(monkeypatch) -> None:
    import randomgen
    from randomgen import AESCounter

    default_cipher.cache_clear()
    assert default_cipher() == ("aes128-ctr" if AESCounter(key=0).use_aesni else "chacha20")

    class NoAesNi:  # randomgen's AESCounter on a CPU without AES instructions (its software AES fallback)
        def __init__(self, key: int) -> None:
            self.use_aesni = False

    monkeypatch.setattr(randomgen, "AESCounter", NoAesNi)
    default_cipher.cache_clear()
    try:
        assert default_cipher() == "chacha20" and SecureRandom().cipher == "chacha20"
    finally:
        monkeypatch.undo()
        default_cipher.cache_clear()
    with pytest.raises(ValueError, match="16 bytes"):
        SecureRandom(bytes(32), cipher="aes128-ctr")
    with pytest.raises(ValueError, match="cipher must be one of"):
        SecureRandom(cipher="rc4")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_never_continues_the_parents_stream() -> None:
    source = SecureRandom()
    source.random(3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: draw, send, exit without running the parent's test teardown
        try:
            os.write(write, source.random(4).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    child = np.frombuffer(os.read(read, 32), dtype=np.float64)
    os.close(read)
    os.waitpid(pid, 0)
    assert child.shape == (4,) and np.all((child > 0) & (child < 1))
    assert not np.array_equal(child, source.random(4))  # without the rekey both would read the same 4 words


def test_a_secure_source_cannot_be_copied_or_pickled() -> None:
    import copy
    import pickle

    source = SecureRandom()
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="would repeat its noise stream"):
            duplicate(source)


@pytest.mark.parametrize("cipher", sorted(CIPHERS))
def test_normals_have_the_standard_normal_distribution(cipher) -> None:
    n = 2_000_000
    x = SecureRandom(cipher=cipher).standard_normal(n)
    assert x.shape == (n,) and x.dtype == np.float64 and np.isfinite(x).all()
    # Moments against their standard errors for N(0, 1) samples of size n: mean 1/sqrt(n), variance sqrt(2/n),
    # skewness sqrt(6/n), excess kurtosis sqrt(24/n) (all asymptotically normal). A bound of 6 standard errors
    # fails a correct source with probability 2e-9 each, and catches a scale off by 0.5 % (variance 1.01 is
    # 7 SE), or a skew or kurtosis of 0.03 (e.g. a clipped or mis-weighted ziggurat tail).
    assert abs(x.mean()) < 6 / math.sqrt(n)
    assert abs(x.var() - 1.0) < 6 * math.sqrt(2 / n)
    assert abs(stats.skew(x)) < 6 * math.sqrt(6 / n)
    assert abs(stats.kurtosis(x)) < 6 * math.sqrt(24 / n)
    # Kolmogorov-Smirnov against N(0, 1) at significance 1e-6: at this n it rejects any CDF error above 0.0019
    assert stats.kstest(x, "norm").pvalue > 1e-6
    # chi-square on 34 bins, the tails beyond 4 sigma (about 127 draws) included, which KS barely sees; 1e-6
    edges = np.r_[-np.inf, np.arange(-4.0, 4.01, 0.25), np.inf]
    observed = np.histogram(x, bins=edges)[0]
    assert stats.chisquare(observed, n * np.diff(stats.norm.cdf(edges))).pvalue > 1e-6


@pytest.mark.parametrize("shape", [1, 7, (300, 1001), (2, 3, 4)])
def test_normals_come_in_the_asked_shape(shape) -> None:
    x = SecureRandom().standard_normal(shape)
    assert x.shape == ((shape,) if isinstance(shape, int) else shape) and x.dtype == np.float64


@pytest.mark.parametrize("cipher", sorted(CIPHERS))
def test_uniforms_lie_strictly_inside_zero_one_and_are_uniform(cipher) -> None:
    assert ((2 ** 52 - 1) + 0.5) / TWO52 < 1.0 and 0.5 / TWO52 > 0.0  # the transform's two extreme values
    n = 2_000_000
    u = SecureRandom(cipher=cipher).random(n)
    assert u.shape == (n,) and u.dtype == np.float64 and u.min() > 0.0 and u.max() < 1.0
    # U(0, 1): mean 1/2 with standard error sqrt(1/(12 n)); variance 1/12 with standard error sqrt(1/(180 n))
    # (the variance of (u - 1/2)^2 is 1/80 - 1/144 = 1/180); 6 SE each: false failure 2e-9
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / (12 * n))
    assert abs(u.var() - 1 / 12) < 6 * math.sqrt(1 / (180 * n))
    assert stats.kstest(u, "uniform").pvalue > 1e-6


def test_seeded_source_warns_loudly_and_repeats() -> None:
    with pytest.warns(InsecureRandomnessWarning, match="NO differential-privacy guarantee"):
        a = make_random_source(3).standard_normal(5)
    with pytest.warns(InsecureRandomnessWarning):
        b = make_random_source(3).standard_normal(5)
    np.testing.assert_array_equal(a, b)
