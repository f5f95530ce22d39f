"""The DP-FedSOFIM vs DP-FedGD experiment (wildfed_sim/fedsofim.py).

Fast tests: the linear head's per-example gradients against torch autograd, the clip + noise path against a hand
computation (noise replaced by an injected constant source: unit tests only), the server's pseudo-gradient, and the
summary metrics on hand-made curves. A federation on synthetic features with a real SQLite ledger checks that the
ledger's spend is dp-accounting's composition of the run's events and stays within the target. The slow test runs
the whole command at a tiny size on Animal-MNIST.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch

from wildfed_sim import fedsofim as fs
from coordinator.ledger import PrivacyLedger
from coordinator.optimizers.server_sgd import ServerSGD
from coordinator.storage import Store
from edge_sdk.privacy.ccdp import CCDPMechanism
from shared.errors import ConfigError
from shared.privacy.accounting import calibrate_noise_multiplier
from shared.privacy.randomness import SecureRandom
from tests.support import assert_norm_upper_bounds


class ConstantNoise:
    """A fake noise source: every 'standard normal' is ``value`` (0 turns the noise off). Unit tests only."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self, size: int) -> np.ndarray:
        return np.full(size, 0.5)

    def standard_normal(self, size):
        return np.full(size, self.value, dtype=np.float64)


def _tiny(seed: int = 0, b: int = 5, f: int = 3, c: int = 4):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(c, f)), rng.normal(size=c), rng.normal(size=(b, f)) * 2, rng.integers(0, c, size=b))


def _torch_per_example(weight, bias, x, y) -> np.ndarray:
    """Per-example gradients of cross-entropy by autograd, one example at a time, in [weight.ravel(), bias] order."""
    out = []
    for i in range(len(y)):
        w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
        logits = torch.tensor(x[i:i + 1], dtype=torch.float64) @ w.T + b
        torch.nn.functional.cross_entropy(logits, torch.tensor([int(y[i])])).backward()
        out.append(np.concatenate([w.grad.numpy().ravel(), b.grad.numpy()]))
    return np.array(out)


def test_per_example_head_gradient_matches_autograd():
    weight, bias, x, y = _tiny()
    expected = _torch_per_example(weight, bias, x, y)
    np.testing.assert_allclose(fs.per_example_head_gradients(weight, bias, x, y), expected, rtol=1e-10, atol=1e-12)
    implicit = fs.LinearHeadGradients(fs.head_residuals(weight, bias, x, y), x)
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(expected, axis=1))
    w = np.random.default_rng(1).random((2, len(y)))
    np.testing.assert_allclose(implicit.weighted_sum(w), w @ expected, rtol=1e-5, atol=1e-6)


def test_clip_and_noise_path_by_hand():
    weight, bias, x, y = _tiny(seed=2)
    # the mechanism sees float32 weights and features: the reference starts from the same float32 values
    head = {fs.WEIGHT: weight.astype(np.float32), fs.BIAS: bias.astype(np.float32)}
    data = fs.HeadData(x.astype(np.float32), y.astype(np.int64))
    grads = _torch_per_example(head[fs.WEIGHT].astype(np.float64), head[fs.BIAS].astype(np.float64),
                               data.features.astype(np.float64), y)
    norms = np.linalg.norm(grads, axis=1)
    clip, z, n = 0.5, 3.0, len(y)
    assert (norms > clip).any()
    scale = np.where(norms > clip, clip / norms * (1 - 1e-5), 1.0)  # min(1, C/||g||), with the documented margin
    clipped_sum = (grads * scale[:, None]).sum(axis=0)
    for noise_value in (0.0, 1.0):
        mech = CCDPMechanism(clipping_norms={fs.UNIFORM_CATEGORY: clip}, noise_std=z * clip,
                             expected_batch_size=float(n), noise=ConstantNoise(noise_value))
        got = fs.client_private_gradient(mech, head, data)
        expected = (clipped_sum + noise_value * z * clip) / n
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert got.dtype == np.float32 and got.shape == (weight.size + bias.size,)


def test_server_pseudo_gradient_and_fedgd_step():
    g1, g2 = np.array([1.0, 0.0, 2.0]), np.array([0.0, 3.0, -1.0])
    g = fs.server_pseudo_gradient([g1, g2], [10, 30])
    np.testing.assert_allclose(g, [0.25, 2.25, -0.25])
    # avg_delta = -G: one DP-FedGD step with eta is theta - eta G (C = 1 class-row of 2 weights + 1 bias)
    weights = {fs.WEIGHT: np.ones((1, 2), np.float32), fs.BIAS: np.zeros(1, np.float32)}
    new = ServerSGD(server_lr=2.0).step(weights, fs.unflatten_head(-g, 1))
    np.testing.assert_allclose(fs.flatten_head(new), [1 - 0.5, 1 - 4.5, 0.5], rtol=1e-6)


def test_rounds_to_reach_dip_and_mean_std():
    assert fs.rounds_to_reach([0.1, 0.5, 0.7, 0.6, 0.8], 0.7) == 2
    assert fs.rounds_to_reach([0.1, 0.5], 0.9) is None
    dip = fs.largest_dip([0.1, 0.6, 0.7, 0.5, 0.55, 0.72, 0.71])
    assert dip["peak_round"] == 2 and dip["dip_round"] == 3 and dip["recovered_round"] == 5
    assert dip["depth"] == pytest.approx(0.2)
    assert fs.largest_dip([0.1, 0.8, 0.6])["recovered_round"] is None
    assert fs.largest_dip([0.1, 0.2, 0.3])["depth"] == 0.0
    stat = fs.mean_std([0.7, 0.8, None, 0.9])
    assert stat["mean"] == pytest.approx(0.8) and stat["std"] == pytest.approx(0.1) and stat["n"] == 3


def test_summarise_hand_made_curves():
    def run(opt, seed, curve):
        return {"clients": 20, "epsilon": 1.0, "seed": seed, "optimizer": opt, "test": curve,
                "spent_epsilon": 0.99, "noise_multiplier": 40.0}

    runs = [run("dp-fedgd", 0, [0.1, 0.5, 0.6, 0.7]), run("dp-fedsofim", 0, [0.1, 0.7, 0.72, 0.74]),
            run("dp-fedgd", 1, [0.1, 0.4, 0.6, 0.6]), run("dp-fedsofim", 1, [0.1, 0.5, 0.55, 0.58])]
    (e,) = fs.summarise(runs)
    assert e["dp-fedgd"]["final"]["mean"] == pytest.approx(0.65)
    assert e["dp-fedgd"]["final"]["std"] == pytest.approx(math.sqrt(2 * 0.05 ** 2))
    assert e["dp-fedsofim"]["final"]["mean"] == pytest.approx(0.66)
    assert e["delta_final"]["mean"] == pytest.approx((0.04 - 0.02) / 2)
    # seed 0: GD reaches 0.7 at round 3, SOFIM at round 1 (2 earlier); seed 1: GD reaches 0.6 at 2, SOFIM never
    assert e["rounds_per_seed"] == {"dp-fedgd": [3, 2], "dp-fedsofim": [1, None]}
    assert e["rounds_earlier"]["mean"] == 2 and e["rounds_earlier"]["n"] == 1 and e["sofim_not_reached"] == 1
    np.testing.assert_allclose(e["dp-fedgd"]["mean_curve"], [0.1, 0.45, 0.6, 0.65])
    # last-10 variants (the curves have 4 points, so "last 10" is all of them): GD seed 0 mean 0.475, seed 1 0.425
    assert e["dp-fedgd"]["final_last10"]["mean"] == pytest.approx((0.475 + 0.425) / 2)
    assert e["delta_last10"]["mean"] == pytest.approx(((0.565 - 0.475) + (0.4325 - 0.425)) / 2)
    # seed 0: target 0.475 -> GD round 1 (0.5), SOFIM round 1; seed 1: target 0.425 -> GD round 2, SOFIM round 1
    assert e["rounds_per_seed_last10"] == {"dp-fedgd": [1, 2], "dp-fedsofim": [1, 1]}
    assert e["rounds_earlier_last10"]["mean"] == 0.5 and e["sofim_not_reached_last10"] == 0
    assert "1 seed(s) never" in fs.markdown_table([e])


def _direct_epsilon(z: float, steps: int, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z)), steps))
    return acc.get_epsilon(delta)


def test_federation_smoke_with_ledger(tmp_path):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 8))
    labels = rng.integers(0, 3, size=300)
    feats = np.tanh(centres[labels] + 0.3 * rng.normal(size=(300, 8))).astype(np.float32)
    data = fs.HeadData(feats, labels.astype(np.int64))
    clients = [fs.HeadData(feats[i::5], data.labels[i::5]) for i in range(5)]
    rounds, eps, delta = 5, 1.0, 1e-5
    z = calibrate_noise_multiplier(target_epsilon=eps, target_delta=delta, sampling_rate=1.0, steps=rounds)
    ledger = PrivacyLedger(Store(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "data"), target_delta=delta)
    curves = fs.run_federation(optimizer=fs.make_optimizer("dp-fedsofim", {"eta": 1.0, "beta": 0.9, "rho": 1.0}),
                               clients=clients, evaluate_on={"all": data}, rounds=rounds, clipping_norm=1.0,
                               noise_multiplier=z, noise=SecureRandom(), num_classes=3, ledger=ledger,
                               site_prefix="t/")
    assert len(curves["all"]) == rounds + 1 and curves["all"][0] == pytest.approx(np.mean(labels == 0))
    assert ledger.sites() == [f"t/client{k:03d}" for k in range(5)]
    direct = _direct_epsilon(z, rounds, delta)
    for k in range(5):
        assert len(ledger.events(f"t/client{k:03d}", fs.UNIFORM_CATEGORY)) == rounds
        spent = ledger.spent(f"t/client{k:03d}", fs.UNIFORM_CATEGORY)
        assert spent == pytest.approx(direct, rel=1e-9)
        assert eps * 0.95 <= spent <= eps


def test_settings_errors_name_the_field():
    with pytest.raises(ConfigError, match="rounds"):
        fs.FedSofimSettings(rounds=0)
    with pytest.raises(ConfigError, match="epsilons"):
        fs._parse_list("1,x", float, "epsilons", "0.5,1")


@pytest.mark.slow
def test_command_end_to_end_tiny(tmp_path):
    out = tmp_path / "out"
    settings = fs.FedSofimSettings(seeds=(0,), clients=(5,), epsilons=(1.0,), rounds=5, pretrain_epochs=1,
                                   tune=False, out_dir=out)
    result = fs.run_fedsofim_experiment(settings)
    assert {p.name for p in out.iterdir()} >= {"fedsofim.json", "fedsofim.md", "fedsofim.png", "ledger.db"}
    report = json.loads((out / "fedsofim.json").read_text())
    assert len(report["runs"]) == 2 and {r["optimizer"] for r in report["runs"]} == set(fs.OPTIMIZERS)
    z = report["runs"][0]["noise_multiplier"]
    for r in report["runs"]:
        assert len(r["test"]) == 6
        assert r["spent_epsilon"] == pytest.approx(_direct_epsilon(z, 5, 1e-5), rel=1e-9)
        assert r["spent_epsilon"] <= 1.0
    info = result.seeds_info[0]
    assert info["public"] == 1000 and info["val"] == 700 and info["client_pool"] == 8000 - 1000 - 700


def test_the_cli_command_is_registered_and_refuses_bad_options():
    from typer.testing import CliRunner

    from wildfed_sim.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["experiment", "fedsofim", "--help"])
    assert shown.exit_code == 0 and "--clients" in shown.output and "--epsilons" in shown.output
    bad = runner.invoke(app, ["experiment", "fedsofim", "--clients", "0"])
    assert bad.exit_code == 2 and "clients" in bad.output
