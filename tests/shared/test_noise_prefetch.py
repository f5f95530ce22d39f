"""The DP noise drawn ahead (shared.privacy.noise_prefetch): each vector once, nothing reused, a seeded source
untouched, a forked child never handed its parent's vectors, the distribution that of N(0, 1)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from scipy import stats

import shared.privacy.noise_prefetch as noise_prefetch
from shared.privacy.noise_prefetch import PrefetchedNormals
from shared.privacy.randomness import InsecureRandomnessWarning, SecureRandom, SeededRandom


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dp-noise-prefetch"]


def test_a_round_gets_count_distinct_vectors_then_synchronous_draws() -> None:
    with PrefetchedNormals(SecureRandom(), size=1000, count=3) as noise:
        assert noise.prefetching
        vectors = [noise.standard_normal(1000) for _ in range(5)]  # 3 prefetched, 2 drawn on the spot
    assert all(v.shape == (1000,) and v.dtype == np.float64 for v in vectors)
    # no vector (nor any part of one) handed out twice: continuous draws never repeat a value
    flat = np.concatenate(vectors)
    assert np.unique(flat).size == flat.size
    assert not _prefetch_threads()


def test_the_noise_stream_is_not_the_sampling_stream() -> None:
    key = bytes(range(16))
    source = SecureRandom(key, cipher="aes128-ctr")
    with PrefetchedNormals(source, size=64, count=1) as noise:
        drawn = noise.standard_normal(64)
    # the source itself was not read: its first normals are those of a fresh generator on the same key
    assert np.array_equal(source.standard_normal(64), SecureRandom(key, cipher="aes128-ctr").standard_normal(64))
    assert not np.array_equal(drawn, SecureRandom(key, cipher="aes128-ctr").standard_normal(64))


def test_other_sizes_are_drawn_from_the_round_source() -> None:
    key = bytes(range(16))
    with PrefetchedNormals(SecureRandom(key, cipher="aes128-ctr"), size=100, count=2) as noise:
        counts_noise = noise.standard_normal(7)
        uniforms = noise.random(5)
    reference = SecureRandom(key, cipher="aes128-ctr")
    assert np.array_equal(counts_noise, reference.standard_normal(7))
    assert np.array_equal(uniforms, reference.random(5))


def test_a_seeded_source_is_not_prefetched_and_stays_reproducible() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureRandomnessWarning)
        plain, through = SeededRandom(7), SeededRandom(7)
    with PrefetchedNormals(through, size=50, count=4) as noise:
        assert not noise.prefetching
        got = [noise.standard_normal(50) for _ in range(4)] + [noise.random(3)]
    want = [plain.standard_normal(50) for _ in range(4)] + [plain.random(3)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_close_discards_the_vectors_left_and_stops_the_worker() -> None:
    noise = PrefetchedNormals(SecureRandom(), size=10, count=50)
    noise.standard_normal(10)
    noise.close()
    noise.close()  # idempotent
    assert not _prefetch_threads()
    assert noise._ready.empty()
    # after close every draw is synchronous, from the round's source
    assert noise.standard_normal(10).shape == (10,)


def test_a_forked_child_never_gets_the_parents_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    noise = PrefetchedNormals(SecureRandom(), size=32, count=2)
    worker = noise._worker
    queued = noise._ready.get(timeout=30)  # the vector the parent would hand out next
    noise._ready.put(queued)
    real_pid = noise_prefetch.os.getpid()
    monkeypatch.setattr(noise_prefetch.os, "getpid", lambda: real_pid + 1)  # as seen from a forked child
    drawn = noise.standard_normal(32)
    again = noise.standard_normal(32)
    monkeypatch.undo()
    assert not np.array_equal(drawn, queued) and not np.array_equal(again, queued)
    assert not noise.prefetching
    # (in a real child the worker does not exist; here the parent's is stopped by hand)
    noise._stop.set()
    noise._discard()
    worker.join(timeout=30)
    assert not worker.is_alive()


def test_a_failing_draw_is_raised_in_the_training_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: SecureRandom, size: int) -> np.ndarray:
        raise RuntimeError("keystream unavailable")

    monkeypatch.setattr(SecureRandom, "standard_normal", broken)
    with PrefetchedNormals(SecureRandom(), size=8, count=3) as noise:
        with pytest.raises(RuntimeError, match="keystream unavailable"):
            noise.standard_normal(8)
    assert not _prefetch_threads()


def test_prefetched_noise_is_standard_normal() -> None:
    with PrefetchedNormals(SecureRandom(), size=20_000, count=5) as noise:
        z = np.concatenate([noise.standard_normal(20_000) for _ in range(5)])
    # 100,000 draws: mean and variance within about 5 standard errors, and a KS test against N(0, 1)
    assert abs(z.mean()) < 5 / np.sqrt(z.size)
    assert abs(z.var() - 1.0) < 5 * np.sqrt(2 / z.size)
    assert stats.kstest(z, "norm").pvalue > 1e-6


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="size and count"):
        PrefetchedNormals(SecureRandom(), size=-1, count=1)


def test_worth_prefetching_needs_a_large_model_and_a_second_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noise_prefetch, "_usable_cpus", lambda: 2)
    assert noise_prefetch.worth_prefetching(noise_prefetch.PREFETCH_MIN_SIZE)
    assert not noise_prefetch.worth_prefetching(noise_prefetch.PREFETCH_MIN_SIZE - 1)
    monkeypatch.setattr(noise_prefetch, "_usable_cpus", lambda: 1)
    assert not noise_prefetch.worth_prefetching(10 * noise_prefetch.PREFETCH_MIN_SIZE)
