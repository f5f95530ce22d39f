"""The DP-FedSOFIM experiment (wildfed_sim/fedsofim.py; docs/fedsofim.md).

Fast tests: the linear head's per-example gradients against torch autograd, the clip + noise path against a hand
computation (noise replaced by an injected constant source: unit tests only), the server's pseudo-gradient, the
pooled batched release against the per-client mechanisms, the grid widening on toy objectives, the optimizers the
grid points name, and the summary on hand-made curves. A federation on synthetic features with a real SQLite
ledger checks that the ledger's spend is dp-accounting's composition of the run's events and stays within the
target. The slow test runs the whole command at a tiny size on Animal-MNIST.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch

from wildfed_sim import fedsofim as fs
from wildfed_sim import fedsofim_tuning as fs_tuning
from wildfed_sim.common.options import parse_list
from wildfed_sim.common.stats import mean_std
from coordinator.ledger import PrivacyLedger
from coordinator.optimizers.fedadam import ServerAdam
from coordinator.optimizers.fedsofim import DPFedSOFIM
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


def test_rounds_to_reach_and_mean_std():
    assert fs.rounds_to_reach([0.1, 0.5, 0.7, 0.6, 0.8], 0.7) == 2
    assert fs.rounds_to_reach([0.1, 0.5], 0.9) is None
    stat = mean_std([0.7, 0.8, None, 0.9])
    assert stat["mean"] == pytest.approx(0.8) and stat["std"] == pytest.approx(0.1) and stat["n"] == 3


def _synthetic(n: int = 120, f: int = 6, c: int = 3, seed: int = 0) -> fs.HeadData:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, size=n)
    feats = (rng.normal(size=(c, f))[labels] + 0.5 * rng.normal(size=(n, f))).astype(np.float32)
    return fs.HeadData(feats, labels.astype(np.int64))


def test_pooled_release_is_the_per_client_mechanisms_summed():
    # Prepare: 4 clients of one pool, two different heads, clipping active, noise off
    data = _synthetic()
    clients = [fs.HeadData(data.features[i::4], data.labels[i::4]) for i in range(4)]
    heads = np.random.default_rng(1).normal(size=(2, 3 * 6 + 3))
    # Execute
    pooled = fs.released_aggregates(heads, fs.Pool.of(data), num_classes=3, clipping_norm=0.5, noise_std=0.0,
                                    noise=ConstantNoise(0.0))
    # Assert: sum_k N_k g~_k / N with each client's CCDPMechanism (the product's path)
    for p in range(2):
        mechanisms = [CCDPMechanism(clipping_norms={fs.UNIFORM_CATEGORY: 0.5}, noise_std=1.0,
                                    expected_batch_size=float(len(c)), noise=ConstantNoise(0.0)) for c in clients]
        grads = [fs.client_private_gradient(m, fs.unflatten_head(heads[p], 3), c) for m, c in zip(mechanisms, clients)]
        expected = fs.server_pseudo_gradient(grads, [len(c) for c in clients])
        np.testing.assert_allclose(pooled[p], expected, rtol=1e-4, atol=1e-7)


def test_run_batch_draws_noise_of_std_sqrt_k_z_c():
    # One DP-FedGD round from the zero head with every 'standard normal' = 1: theta_1 = -eta (S + sqrt(K) z C) / N,
    # S the clipped sum at theta = 0 (from the per-client mechanisms, noise off)
    data = _synthetic(n=40)
    k, z, clip, eta = 4, 3.0, 0.5, 0.7
    res = fs.run_batch([ServerSGD(eta), ServerSGD(2 * eta)], fs.Pool.of(data), {"all": data}, rounds=1,
                       clipping_norm=clip, noise_multiplier=z, num_clients=k, noise=ConstantNoise(1.0), num_classes=3)
    zero = {fs.WEIGHT: np.zeros((3, 6), np.float32), fs.BIAS: np.zeros(3, np.float32)}
    mech = CCDPMechanism(clipping_norms={fs.UNIFORM_CATEGORY: clip}, noise_std=1.0, expected_batch_size=1.0,
                         noise=ConstantNoise(0.0))
    s_sum = fs.client_private_gradient(mech, zero, data).astype(np.float64)
    theta1 = -eta * (s_sum + math.sqrt(k) * z * clip) / len(data)
    logits = data.features.astype(np.float64) @ theta1[:18].reshape(3, 6).T + theta1[18:]
    assert res[0]["curves"]["all"] == [pytest.approx(np.mean(data.labels == 0)),
                                       pytest.approx(np.mean(np.argmax(logits, axis=1) == data.labels))]
    assert res[0]["momentum_sq"] is None and res[0]["diverged_round"] is None


def test_grid_points_name_the_right_optimizers():
    avgm = fs.make_optimizer("dp-fedavgm", {"eta_eff": 2.0, "momentum": 0.75})
    assert isinstance(avgm, ServerSGD) and avgm.server_lr == pytest.approx(0.5) and avgm.momentum == 0.75
    so = fs.make_optimizer("dp-fedsofim-m", {"eta_over_rho": 3.0, "rho": 0.01, "beta": 0.9})
    assert isinstance(so, DPFedSOFIM) and so.precondition == "momentum" and so.learning_rate == pytest.approx(0.03)
    assert fs.make_optimizer("dp-fedsofim", {"eta_over_rho": 3.0, "rho": 0.01, "beta": 0.9}).precondition == "gradient"
    adam = fs.make_optimizer("dp-fedadam", {"eta": 0.01, "tau": 1e-3, "beta1": 0.9, "beta2": 0.99})
    assert isinstance(adam, ServerAdam) and adam.tau == 1e-3
    assert fs.step_size("dp-fedavgm", {"eta_eff": 2.0, "momentum": 0.75}) == pytest.approx(0.5)
    for m in fs.OPTIMIZERS + (fs.CEILING,):  # every first grid point builds
        fs.make_optimizer(m, fs.grid_points(fs.GRIDS[m])[0])
    with pytest.raises(ConfigError, match="optimizers"):
        fs.make_optimizer("dp-fedyogi", {})


def test_a_grid_widens_until_the_optimum_is_interior():
    # Prepare: a concave toy in log10(eta) peaked at eta = 1000, far above the first grid 0.1 .. 10
    calls = []

    def score(todo):
        calls.append(len(todo))
        return [-(math.log10(pt["eta"]) - 3.0) ** 2 for _, pt in todo]

    # Execute
    res = fs.tune_grids(score, {"toy": (fs.Axis("eta", (0.1, 1.0, 10.0), factor=10.0, per_widening=1),)},
                        max_widenings=5)["toy"]
    # Assert: widened 10 -> 100 -> 1000 -> 10000, then 1000 is interior
    assert res["best"] == {"eta": 1000.0} and res["on_edge"] == []
    assert res["widened"] == [{"axis": "eta", "edge": "high", "added": [v]} for v in (100.0, 1000.0, 10000.0)]
    assert calls == [3, 1, 1, 1] and len(res["tried"]) == 6


def test_widening_stops_at_its_limit_and_fixed_axes_never_widen():
    # a two-axis toy with its optimum at rho = 1e-7 (below the grid 1e-4 .. 1) and mu at the top of a fixed list;
    # two methods are scored in one call per pass
    def score(todo):
        return [-abs(math.log10(pt["rho"]) + 7) - (1 - pt.get("mu", 1)) for _, pt in todo]

    grids = {"a": (fs_tuning._log_axis("rho", -4, 0, 1), fs.Axis("mu", (0.5, 0.9))),
             "b": (fs_tuning._log_axis("rho", -2, 0, 1),)}
    seen = []
    res = fs.tune_grids(lambda todo: (seen.append(sorted({m for m, _ in todo})), score(todo))[1], grids,
                        max_widenings=2)
    assert seen[0] == ["a", "b"]
    assert res["a"]["best"] == {"rho": 1e-6, "mu": 0.9} and res["a"]["axes"]["rho"][0] == 1e-6
    assert [w["added"] for w in res["a"]["widened"]] == [[1e-5], [1e-6]]
    assert res["a"]["on_edge"] == ["rho", "mu"]            # still on an edge after 2 widenings, recorded
    assert res["b"]["best"] == {"rho": 1e-4} and len(res["b"]["widened"]) == 2


def test_summarise_cell_hand_made_curves():
    def run(opt, seed, curve, msq=None):
        return {"seed": seed, "optimizer": opt, "test": curve, "momentum_sq": msq}

    runs = [run("dp-fedgd", 0, [0.1, 0.5, 0.6, 0.7]), run("dp-fedavgm", 0, [0.1, 0.6, 0.7, 0.72]),
            run("dp-fedsofim", 0, [0.1, 0.7, 0.72, 0.74], [0.1, 0.2, 0.3]),
            run("dp-fedgd", 1, [0.1, 0.4, 0.6, 0.6]), run("dp-fedavgm", 1, [0.1, 0.5, 0.5, 0.62]),
            run("dp-fedsofim", 1, [0.1, 0.5, 0.55, 0.58], [0.1, 0.1, 0.5])]
    tuning = {"dp-fedsofim": {"best": {"eta_over_rho": 2.0, "rho": 0.1, "beta": 0.9}, "widened": [], "on_edge": [],
                              "tried": [{"score": 0.7}, {"score": 0.2}, {"score": math.nan}]}}
    s = fs.summarise_cell(runs, tuning, ("dp-fedgd", "dp-fedavgm", "dp-fedsofim"))
    assert s["round0"]["mean"] == pytest.approx(0.1)
    so = s["dp-fedsofim"]
    assert so["final"]["mean"] == pytest.approx(0.66) and so["eta"] == pytest.approx(0.2)
    assert so["grid_spread"] == pytest.approx(0.5)
    # paired vs DP-FedAvgM, final: diffs +0.02, -0.04 -> mean -0.01, sd 0.03 sqrt 2, t_{0.975, 1} = 12.7062
    iv = so["paired_final"]
    assert iv["mean"] == pytest.approx(-0.01) and iv["high"] - iv["mean"] == pytest.approx(12.7062 * 0.03, rel=1e-4)
    # seed 0: GD's final 0.7 -> SOFIM at round 1, seed 1: 0.6 -> never (0.58 at most)
    assert so["rounds_to_gd_final"]["mean"] == 1 and so["not_reached"] == 1
    assert so["momentum_sq"] == {"median": pytest.approx(0.15), "final": pytest.approx(0.4)}
    assert "paired_final" not in s["dp-fedavgm"]
    cell = {"clients": 20, "epsilon": 1.0, "noise_multiplier": 40.0, "spent_epsilon": 0.99, "summary": s}
    text = fs.markdown_tables([cell], ("dp-fedgd", "dp-fedavgm", "dp-fedsofim"), None)
    assert "-1.0 [" in text and "eta 0.2, rho 0.1" in text and "(1 never)" in text


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
    curves = fs.run_federation(optimizer=fs.make_optimizer("dp-fedsofim", {"eta_over_rho": 1.0, "beta": 0.9,
                                                                          "rho": 1.0}),
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
    with pytest.raises(ConfigError, match="tuning_seeds"):
        fs.FedSofimSettings(seeds=(0, 101), tuning_seeds=(101,))
    with pytest.raises(ConfigError, match="optimizers"):
        fs.FedSofimSettings(optimizers=("dp-fedyogi",))
    with pytest.raises(ConfigError, match="epsilons"):
        parse_list("1,x", float, "epsilons", "0.5,1")


@pytest.mark.slow
def test_command_end_to_end_tiny(tmp_path):
    out = tmp_path / "out"
    settings = fs.FedSofimSettings(seeds=(0, 1), tuning_seeds=(101,), clients=(5,), epsilons=(1.0,), rounds=4,
                                   pretrain_epochs=1, max_widenings=0, out_dir=out)
    result = fs.run_fedsofim_experiment(settings)
    assert {p.name for p in out.iterdir()} >= {"fedsofim.json", "fedsofim.md", "fedsofim.png", "ledger.db"}
    report = json.loads((out / "fedsofim.json").read_text())
    (cell,) = report["cells"]
    assert {r["optimizer"] for r in cell["runs"]} == set(fs.OPTIMIZERS) and len(cell["runs"]) == 10
    assert {m: len(t["tried"]) for m, t in cell["tuning"].items()} == {m: len(fs.grid_points(fs.GRIDS[m]))
                                                                       for m in fs.OPTIMIZERS}
    assert all(len(r["test"]) == 5 for r in cell["runs"])
    assert cell["spent_epsilon"] == pytest.approx(_direct_epsilon(cell["noise_multiplier"], 4, 1e-5), rel=1e-9)
    assert cell["spent_epsilon"] <= 1.0
    assert report["ceiling"]["summary"][fs.CEILING]["last10"]["n"] == 2
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
