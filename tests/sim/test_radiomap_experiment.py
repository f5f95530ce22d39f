"""The radio-map experiment (docs/radiomap.md, "Evaluation"; per-client tiles): a small setting end to end,
client sites on their own tiles, the attacker, the allocator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shared.models import radio_unet  # noqa: E402
from shared.privacy.accounting import epsilon_spent  # noqa: E402
from shared.privacy.events import DPSGDEvent  # noqa: E402

from edge_sdk.privacy.adaptive_noise import STATISTICS  # noqa: E402
from edge_sdk.privacy.noise_allocator import AllocatorTraining, NoiseAllocator, train_allocator  # noqa: E402

from wildfed_sim.radiomap import (  # noqa: E402
    RADIO_CATEGORY,
    RadioMapSettings,
    fit_attacker,
    make_site,
    prepare_data,
    run_federation,
    run_radiomap_experiment,
    shadow_updates,
)

SMALL = dict(clients=3, active=2, rounds=2, maps_per_client=4, validation_maps=4, pretrain_tiles=2,
             pretrain_maps_per_tile=3, pretrain_epochs=1, shadow_sites=4, proxy_sites=3, proxy_maps=2, width=2,
             attack_every=2, size_px=32, metres_per_pixel=8.0, noise_multiplier=3.0, clipping_norm=0.01,
             floor_fraction=0.5, allocator=AllocatorTraining(steps=2), city="procedural")


@pytest.mark.slow
def test_small_setting_end_to_end(tmp_path):
    settings = RadioMapSettings(seeds=(0,), out_dir=tmp_path, **SMALL)
    result = run_radiomap_experiment(settings)
    runs = {r["defence"]: r for r in result.runs}
    assert set(runs) == {"none", "clip-only", "uniform", "steered-uniform", "adaptive", "grouped-clipping"}
    for run in runs.values():
        assert len(run["val_mse_db"]) == settings.rounds + 1 and all(math.isfinite(v) for v in run["val_mse_db"])
        other = run["val_other_mse_db"]  # the second validation set: the other city
        assert len(other) == settings.rounds + 1 and all(math.isfinite(v) for v in other)
        assert [a["round"] for a in run["attack"]] == [1, 2]
        for attack in run["attack"]:
            assert len(attack["errors_m"]) == settings.active
            assert all(0 <= e <= 2 * 32 * 8.0 for e in attack["errors_m"])  # inside two map diagonals' worth
    # The ledger: one event per upload, only for the defences with a guarantee; epsilon recomputed by hand from
    # the Gaussian mechanism at the floor, sensitivity 2C: z_eff = sqrt(phi) z / 2 (adaptive), z / 2 (uniform).
    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store

    ledger = PrivacyLedger(Store(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "data"), target_delta=1e-5)
    for defence, z_eff in (("uniform", 3.0 / 2), ("adaptive", math.sqrt(0.5) * 3.0 / 2), ("grouped-clipping", 1.5)):
        uploads = {}
        for k in range(settings.clients):
            events = ledger.events(f"seed0-{defence}-client{k:02d}", RADIO_CATEGORY)
            assert all(e == DPSGDEvent(z_eff, 1.0, 1) for e in events)
            uploads[k] = len(events)
        assert sum(uploads.values()) == settings.rounds * settings.active
        worst = max(uploads.values())
        expected = epsilon_spent([DPSGDEvent(z_eff, 1.0, 1)] * worst, target_delta=1e-5)
        assert runs[defence]["epsilon"] == pytest.approx(expected)
    for defence in ("none", "clip-only", "steered-uniform"):
        assert runs[defence]["epsilon"] is None
        assert all(not ledger.events(f"seed0-{defence}-client{k:02d}", RADIO_CATEGORY) for k in range(3))
    payload = json.loads((tmp_path / "radiomap.json").read_text())
    assert [s["defence"] for s in payload["summary"]] == list(settings.defences)
    assert "no guarantee" in (tmp_path / "radiomap.md").read_text()
    assert (tmp_path / "radiomap.png").stat().st_size > 0


def test_each_client_site_is_on_its_own_tile_around_its_centre(tmp_path):
    settings = RadioMapSettings(seeds=(0,), **SMALL)
    data = prepare_data(settings, 0, cache_dir=tmp_path)
    radius_px = settings.site_radius_m / settings.metres_per_pixel
    assert len(data.tiles.clients) == settings.clients
    for k, site in enumerate(data.clients):
        assert site.tile == k and np.all(site.maps.tiles == k)
        tile = data.tiles.clients.buildings[k]
        distances = np.linalg.norm(site.maps.transmitters - site.centre_px, axis=1)
        assert np.all(distances <= radius_px + 1e-9)
        assert not tile[tuple(site.centre_px.astype(int))]  # centre outdoors, on the client's own tile
        # the maps' building channel is the client's tile, not a shared crop
        np.testing.assert_array_equal(site.maps.inputs[:, 0], np.broadcast_to(tile, site.maps.inputs[:, 0].shape))
    # The two validation sets lie on the held-out tiles and the other city's, pretraining on the public tiles.
    for maps, tiles in ((data.validation, data.tiles.validation), (data.validation_other, data.tiles.other_city),
                        (data.pretraining, data.tiles.public)):
        np.testing.assert_array_equal(maps.inputs[:, 0], tiles.buildings[maps.tiles])
    assert len(data.validation) == len(data.validation_other) == settings.validation_maps
    again = prepare_data(settings, 0, cache_dir=tmp_path)  # from the cache: identical
    np.testing.assert_array_equal(again.clients[1].maps.targets, data.clients[1].maps.targets)
    np.testing.assert_array_equal(again.validation_other.targets, data.validation_other.targets)


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (two contend on a loaded 2-core machine), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_template_attack_shares_round_one_shadows_between_defences(tmp_path, one_torch_thread):
    from dataclasses import replace

    settings = RadioMapSettings(seeds=(0,), **{**SMALL, "rounds": 1, "attacker": "template"})
    data = prepare_data(settings, 0, cache_dir=tmp_path)
    shadows = shadow_updates(settings, data)
    first = run_federation(settings, data, "clip-only", 0, shadows=shadows)["template_attack"]
    attack = first[0]
    assert attack["round"] == 1 and attack["shadows"] == "first-order" and attack["shadows_reused"] == 0
    assert attack["shadows_computed"] == sum(attack["candidates"].values()) > 0
    assert len(attack["errors_m"]) == settings.active and all(e >= 0 for e in attack["errors_m"].values())
    # every defence starts from the same global model: round 1's shadows come from the cache
    again = run_federation(settings, data, "uniform", 0, shadows=shadows)["template_attack"][0]
    assert again["shadows_computed"] == attack["shadows_computed"]
    assert again["shadows_reused"] == attack["shadows_computed"]
    with pytest.raises(Exception) as err:
        replace(settings, template_shadow="exact")
    assert getattr(err.value, "field", None) == "template_shadow"


def test_attacker_recovers_a_linear_leak_and_not_pure_noise():
    rng = np.random.default_rng(0)
    centres = rng.uniform(0, 64, size=(40, 2))
    mixing = rng.normal(size=(2, 300))
    sensitive = np.zeros(300, dtype=bool)
    sensitive[:10] = True
    leaky = centres @ mixing + 0.01 * rng.normal(size=(40, 300))
    predict, info = fit_attacker(leaky[:30], centres[:30], sensitive)
    errors = np.linalg.norm(predict(leaky[30:]) - centres[30:], axis=1)
    assert np.sqrt(np.mean(errors ** 2)) < 1.0  # pixels, against a naive error of ~26
    assert info["loo_rmse"] < 1.0
    noise = rng.normal(size=(40, 300))
    predict, info = fit_attacker(noise[:30], centres[:30], sensitive)
    naive = np.sqrt(np.mean(np.sum((centres[30:] - centres[:30].mean(axis=0)) ** 2, axis=1)))
    errors = np.linalg.norm(predict(noise[30:]) - centres[30:], axis=1)
    assert np.sqrt(np.mean(errors ** 2)) > 0.8 * naive  # nothing to learn: no better than guessing the mean


def test_allocator_shares_state_and_training(tmp_path):
    allocator = NoiseAllocator(seed=3)
    stats = np.random.default_rng(0).normal(size=(4, len(STATISTICS))).astype(np.float32)
    shares = allocator(stats)
    assert shares.shape == (4,) and shares.sum() == pytest.approx(1.0) and np.all(shares > 0)
    copy = NoiseAllocator(state=allocator.state())
    np.testing.assert_array_equal(copy(stats), shares)
    with pytest.raises(ValueError, match="allocator weights"):
        NoiseAllocator(state={"allocator.x": np.zeros(1)})

    settings = RadioMapSettings(seeds=(0,), **SMALL)
    data = prepare_data(settings, 0)
    model = radio_unet.build_model(width=2)
    layout = radio_unet.parameter_groups(model)
    proxies = [make_site(data.source, data.tiles.public, i % len(data.tiles.public), 2, settings,
                         np.random.default_rng(i)) for i in range(3)]
    before = {k: v.copy() for k, v in allocator.state().items()}
    out = train_allocator(allocator, model=model, layout=layout, proxy_inputs=[p.maps.inputs for p in proxies],
                          proxy_targets=[p.maps.targets for p in proxies],
                          proxy_centres=np.stack([p.centre_px for p in proxies]) / 32,
                          task_inputs=proxies[0].maps.inputs, task_targets=proxies[0].maps.targets,
                          clipping_norm=0.01, noise_multiplier=3.0, floor_fraction=0.5, round_index=1,
                          total_rounds=2, settings=AllocatorTraining(steps=3))
    assert all(math.isfinite(v) for v in out.values())
    assert 0 < out["sensitive_share"] < 1
    assert any(not np.array_equal(before[k], v) for k, v in allocator.state().items())
    with pytest.raises(ValueError, match="3 pseudo-sites"):
        train_allocator(allocator, model=model, layout=layout, proxy_inputs=[], proxy_targets=[],
                        proxy_centres=np.zeros((0, 2)), task_inputs=proxies[0].maps.inputs,
                        task_targets=proxies[0].maps.targets, clipping_norm=0.01, noise_multiplier=3.0,
                        floor_fraction=0.5, round_index=1, total_rounds=2)


def test_a_city_without_sionna_rt_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # the city scenes ship with sionna-rt; where it is absent the run stops with the install step and leaves no
    # folder, ledger or cached data behind
    import importlib.metadata

    from shared.errors import ConfigError
    from wildfed_sim.radiomap import RadioMapSettings, run_radiomap_experiment

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    out = tmp_path / "run"
    settings = RadioMapSettings(seeds=(0,), city="munich", out_dir=out)  # names are checked, not the install
    with pytest.raises(ConfigError, match="sionna-rt") as err:
        run_radiomap_experiment(settings)
    assert err.value.field == "city" and not out.exists()


def test_both_attackers_in_one_run_without_shadows_given(tmp_path, one_torch_thread):
    """attacker "both" with no shadows passed: run_federation makes its own, and the ridge attacker's shadow sites
    of a round do not replace the template attacker's shadows for the next attack round (they did: the second
    template attack then read a list of sites)."""
    settings = RadioMapSettings(seeds=(0,), **{**SMALL, "rounds": 2, "attack_every": 1, "attacker": "both"})
    data = prepare_data(settings, 0, cache_dir=tmp_path)
    out = run_federation(settings, data, "clip-only", 0)
    assert [a["round"] for a in out["template_attack"]] == [1, 2]
    assert [a["round"] for a in out["attack"]] == [1, 2]
    assert all(a["shadows"] == "first-order" for a in out["template_attack"])
