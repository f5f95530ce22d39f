"""Shadow updates for the template attacker: the batched shadows are the sequential ones, the first-order pieces
match their definitions, the cache serves the defences that share a global model, and the fast attacker picks the
full attacker's candidate on clip-only uploads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.models import radio_unet
from shared.radio import PathLossModel, RadioMapGeometry, city_tiles

from edge_sdk.privacy.adaptive_noise import clip_update
from edge_sdk.radio import flat_weights, train_radio_maps
from wildfed_sim.radio_attack import TemplateAttacker, candidate_grid
from wildfed_sim.radio_shadows import (ShadowTraining, ShadowUpdates, _subgrid_pixels, adam_first_order_deltas,
                                       disc_weights, per_map_gradients)
from wildfed_sim.radio_tiles import Cost231Source, TileSet, draw_site

GEOMETRY = RadioMapGeometry(size_px=16, metres_per_pixel=4.0)   # the smallest maps the three-level U-Net takes
WIDTH = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two threads contend (measured 10x slower under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def city():
    """Four procedural 16 x 16 tiles, their COST 231 source and an untrained width-2 RadioUNet's weights."""
    tiles = TileSet("p", city_tiles(np.random.default_rng(3), 4, geometry=GEOMETRY), ("p/0", "p/1", "p/2", "p/3"))
    model = radio_unet.build_model(width=WIDTH)
    radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=WIDTH, seed=0))
    return tiles, Cost231Source(PathLossModel(max_walls=4), GEOMETRY), model, flat_weights(model)


def _training(**kw):
    base = dict(maps_per_site=6, epochs=2, learning_rate=5e-4, batch_size=4, radius_px=2.0, width=WIDTH,
                pixel_stride=1, chunk=2)
    return ShadowTraining(**{**base, **kw})


def test_batched_shadows_are_the_gateways_training_up_to_rounding(city):
    tiles, source, model, theta = city
    cands = candidate_grid(tiles.buildings[0], 5)[:3]
    # batches 4, 2 in each of 2 epochs; chunk 2 splits the 3 candidates into 2 calls
    training = _training()
    assert training.batch_sizes() == [4, 2, 4, 2]
    batched = ShadowUpdates("batched", training, source, tiles).deltas(0, cands, theta, np.random.default_rng(7))
    # the reference, written out: draw_site then the gateway's train_radio_maps, candidate by candidate
    rng, expected = np.random.default_rng(7), []
    for c in cands:
        maps, _ = draw_site(source, tiles, 0, 6, radius_px=2.0, rng=rng, centre=c)
        expected.append(train_radio_maps(model, theta, maps, epochs=2, learning_rate=5e-4, batch_size=4, rng=rng))
    expected = np.stack(expected)
    assert batched.shape == (3, theta.size)
    # a delta is float32 weights minus theta: its resolution is the weights' float32 spacing (about 6e-8 here)
    np.testing.assert_allclose(batched, expected, atol=3e-7)
    assert np.abs(expected).max() > 1e-3
    sequential = ShadowUpdates("sequential", training, source, tiles).deltas(0, cands, theta,
                                                                             np.random.default_rng(7))
    np.testing.assert_allclose(sequential, expected, rtol=1e-7)   # the same computation, rounded to float32


def test_per_map_gradients_average_to_the_batch_gradient(city):
    import torch

    tiles, source, model, theta = city
    maps = source.maps(tiles, np.array([[1, *p] for p in source.positions(tiles, 1)[:5]]))
    g = per_map_gradients(model, theta, maps.inputs, maps.targets, chunk=2)
    radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=WIDTH, seed=0))
    coarse, fine = model(torch.from_numpy(maps.inputs))
    y = torch.from_numpy(maps.targets)
    loss = torch.nn.functional.mse_loss(coarse, y) + torch.nn.functional.mse_loss(fine, y)   # mean over the 5 maps
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in sorted(params)])
    expected = np.concatenate([x.reshape(-1).numpy() for x in grads])
    np.testing.assert_allclose(g.mean(axis=0), expected, rtol=1e-4, atol=1e-7)


def test_first_order_adam_replay_by_hand():
    # one step, batch 4: v-hat = mu^2 + s^2 / 4; mu = 3, q = 9 + 16 (s^2 = 16) -> 3 / sqrt(9 + 4) per unit of lr
    got = adam_first_order_deltas(np.array([[3.0, 0.0]]), np.array([[25.0, 1.0]]), batch_sizes=[4],
                                  learning_rate=0.1)
    np.testing.assert_allclose(got, [[-0.1 * 3 / math.sqrt(13), 0.0]], rtol=1e-7)
    # no spread: every step moves lr * sign(mu), Adam's behaviour on a constant gradient
    got = adam_first_order_deltas(np.array([[-2.0, 5.0]]), np.array([[4.0, 25.0]]), batch_sizes=[16, 16, 2],
                                  learning_rate=0.01)
    np.testing.assert_allclose(got, [[0.03, -0.03]], rtol=1e-6)


def test_disc_weights_and_subgrid_pixels():
    cands = np.array([[2.0, 2.0], [9.0, 9.0]])
    pixels = np.array([[2, 2], [2, 4], [0, 0], [9, 9]])
    w = disc_weights(cands, pixels, radius_px=2.0)
    np.testing.assert_allclose(w, [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    allowed = np.argwhere(np.ones((12, 12), bool))
    # stride 4 (rows and columns multiples of 4): the nearest grid pixels to (2, 2) are 2.83 px away, so its whole
    # disc joins; (9, 9) has (8, 8) at 1.41 px and no other
    got = {tuple(p) for p in _subgrid_pixels(allowed, cands, 2.0, 4).tolist()}
    disc = {(r, c) for r in range(12) for c in range(12) if math.hypot(r - 2, c - 2) <= 2}
    assert got == disc | {(8, 8)}


def test_cache_keeps_the_first_global_model_for_every_defence(city):
    tiles, source, _, theta = city
    cands = candidate_grid(tiles.buildings[2], 5)[:2]
    shadows = ShadowUpdates("first-order", _training(), source, tiles, cache_entries=1)
    first = shadows.deltas(2, cands, theta, np.random.default_rng(0))
    again = shadows.deltas(2, cands, theta, np.random.default_rng(1))
    assert (shadows.computed, shadows.reused) == (2, 2)
    np.testing.assert_array_equal(again, first)
    # later models: only the most recent cache_entries are kept; the first model's entry stays
    for step in (1, 2):
        shadows.deltas(2, cands, theta + step * 1e-3, np.random.default_rng(0))
    assert shadows.computed == 6
    shadows.deltas(2, cands, theta + 2e-3, np.random.default_rng(0))    # the most recent: served
    shadows.deltas(2, cands, theta + 1e-3, np.random.default_rng(0))    # evicted: computed again
    assert (shadows.computed, shadows.reused) == (8, 4)
    np.testing.assert_array_equal(shadows.deltas(2, cands, theta, np.random.default_rng(0)), first)
    assert shadows.reused == 6
    with pytest.raises(ConfigError) as err:
        ShadowUpdates("exact", _training(), source, tiles)
    assert err.value.field == "template_shadow"


def test_fast_attacker_picks_the_full_attackers_candidate_on_clip_only_uploads(city):
    tiles, source, model, theta = city
    layout = radio_unet.parameter_groups(model)
    training = _training(maps_per_site=8, epochs=1)
    for tile in (0, 2):
        cands = candidate_grid(tiles.buildings[tile], 3)
        truth = cands[len(cands) // 3]
        # the site's clip-only upload: its own maps and batch order, then the clip
        maps, _ = draw_site(source, tiles, tile, 8, radius_px=2.0, rng=np.random.default_rng([tile, 1]),
                            centre=truth)
        upload, _ = clip_update(train_radio_maps(model, theta, maps, epochs=1, learning_rate=5e-4, batch_size=4,
                                                 rng=np.random.default_rng([tile, 2])), 1e-3)
        estimates = {}
        for kind in ("sequential", "first-order"):
            deltas = ShadowUpdates(kind, training, source, tiles).deltas(tile, cands, theta,
                                                                         np.random.default_rng([tile, 3]))
            attacker = TemplateAttacker(cands, layout.index)
            attacker.observe("site", upload, np.stack([clip_update(d, 1e-3)[0] for d in deltas]))
            estimates[kind] = attacker.estimate("site")
        assert len(cands) >= 12
        np.testing.assert_array_equal(estimates["first-order"], estimates["sequential"])
        np.testing.assert_array_equal(estimates["sequential"], truth)
