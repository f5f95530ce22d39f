"""The radio base-station gateway's trainer (edge_sdk.radio): profile, allocator store, clipped upload, DP event."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shared.errors import ConfigError  # noqa: E402
from shared.privacy.events import DPSGDEvent  # noqa: E402
from shared.radio import PathLossModel, RadioMapGeometry, city_tiles, generate_maps, transmitter_specs  # noqa: E402

from edge_sdk.privacy.noise_allocator import AllocatorTraining  # noqa: E402
from edge_sdk.radio import ALLOCATOR_FILE, RadioSiteTrainer, flat_weights, set_flat_weights  # noqa: E402

GEOMETRY = RadioMapGeometry(size_px=32, metres_per_pixel=8.0)


def maps(seed: int, n: int = 4):
    rng = np.random.default_rng(seed)
    tiles = city_tiles(rng, 1, geometry=GEOMETRY)
    return generate_maps(tiles, transmitter_specs(tiles, n, rng), model=PathLossModel(), geometry=GEOMETRY)


def test_built_from_the_radio_base_station_profile():
    trainer = RadioSiteTrainer.from_profile("radio-base-station", maps=maps(0), defence="uniform",
                                            clipping_norm=0.01, noise_multiplier=3.0, width=2)
    assert trainer.batch_size == 16  # the profile's training.microbatch_size
    assert torch.get_num_threads() == 2  # the profile's threads
    with pytest.raises(ConfigError, match="not a radio base station"):
        RadioSiteTrainer.from_profile("x86-gpu-gateway", maps=maps(0), defence="uniform", clipping_norm=0.01,
                                      noise_multiplier=3.0)


def test_upload_is_clipped_and_carries_its_event():
    trainer = RadioSiteTrainer(maps=maps(1), defence="clip-only", clipping_norm=0.003, noise_multiplier=3.0,
                               width=2, learning_rate=1e-2)
    theta = flat_weights(trainer.model)
    upload, event = trainer.train_round(theta, round_index=1, total_rounds=3, rng=np.random.default_rng(0))
    assert upload.norm_before_clipping > 0.003  # the local step moved further than C ...
    assert np.linalg.norm(upload.update.astype(np.float64)) <= 0.003 * (1 + 1e-6)  # ... and was clipped to C
    assert event is None  # clip-only states no guarantee
    adaptive = RadioSiteTrainer(maps=maps(1), defence="adaptive", clipping_norm=0.003, noise_multiplier=3.0,
                                floor_fraction=0.5, width=2)
    _, event = adaptive.train_round(theta, round_index=1, total_rounds=3, rng=np.random.default_rng(0))
    assert event == DPSGDEvent(math.sqrt(0.5) * 3.0 / 2, 1.0, 1)


def test_allocator_is_stored_with_the_gateways_model_and_reloaded(tmp_path):
    trainer = RadioSiteTrainer(maps=maps(2), defence="adaptive", clipping_norm=0.01, noise_multiplier=3.0,
                               width=2, model_store=tmp_path)
    proxies = [(maps(10 + i, 2), np.array([10.0 + i, 12.0])) for i in range(3)]
    trainer.refresh_allocator(flat_weights(trainer.model), proxies=proxies, round_index=1, total_rounds=2,
                              settings=AllocatorTraining(steps=2))
    assert (tmp_path / ALLOCATOR_FILE).exists()
    restarted = RadioSiteTrainer(maps=maps(2), defence="adaptive", clipping_norm=0.01, noise_multiplier=3.0,
                                 width=2, model_store=tmp_path)
    stats = np.random.default_rng(0).normal(size=(4, 7)).astype(np.float32)
    np.testing.assert_array_equal(restarted.allocator(stats), trainer.allocator(stats))
    (tmp_path / ALLOCATOR_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="delete the file"):
        RadioSiteTrainer(maps=maps(2), defence="adaptive", clipping_norm=0.01, noise_multiplier=3.0, width=2,
                         model_store=tmp_path)
    with pytest.raises(ValueError, match="no allocator"):
        RadioSiteTrainer(maps=maps(2), defence="uniform", clipping_norm=0.01, noise_multiplier=3.0,
                         width=2).refresh_allocator(flat_weights(trainer.model), proxies=proxies, round_index=1,
                                                    total_rounds=2)


def test_flat_weights_round_trip():
    trainer = RadioSiteTrainer(maps=maps(3), defence="none", clipping_norm=1.0, noise_multiplier=1.0, width=2)
    theta = np.random.default_rng(0).normal(size=flat_weights(trainer.model).shape).astype(np.float32)
    set_flat_weights(trainer.model, theta)
    np.testing.assert_array_equal(flat_weights(trainer.model), theta.astype(np.float64))
    with pytest.raises(ValueError, match="shape"):
        set_flat_weights(trainer.model, theta[:-1])


def test_grouped_clipping_takes_its_profile_from_public_proxies_and_clips_each_group():
    from edge_sdk.privacy.adaptive_noise import grouped_clipping_norms

    trainer = RadioSiteTrainer(maps=maps(2), defence="grouped-clipping", clipping_norm=0.003, noise_multiplier=3.0,
                               local_epochs=1, batch_size=2, width=4)
    flat = flat_weights(trainer.model)
    proxies = [(maps(10 + k), np.zeros(2)) for k in range(3)]
    profile = trainer.refresh_clipping_profile(flat, proxies=proxies, seed=1)
    assert trainer.mechanism.clipping_profile is profile and np.all(profile > 0)
    # the same public inputs give the same profile at another gateway
    other = RadioSiteTrainer(maps=maps(3), defence="grouped-clipping", clipping_norm=0.003, noise_multiplier=3.0,
                             local_epochs=1, batch_size=2, width=4)
    np.testing.assert_array_equal(other.refresh_clipping_profile(flat, proxies=proxies, seed=1), profile)
    delta = trainer.local_delta(flat, rng=np.random.default_rng(0))
    clipped = trainer.mechanism.clipped(delta)
    norms = grouped_clipping_norms(profile, 0.003)
    for g in range(len(norms)):
        assert np.linalg.norm(clipped[trainer.layout.index == g]) <= norms[g]
    _, event = trainer.train_round(flat, round_index=1, total_rounds=5, rng=np.random.default_rng(0))
    assert event is not None and event.noise_multiplier == 1.5
