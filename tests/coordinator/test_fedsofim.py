"""DP-FedSOFIM and server momentum: Sherman-Morrison against a dense solve, limits, groups, warm-up, and state that
resumes bit-identically, in the optimizer and through a coordinator restart."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key

from coordinator.optimizers.fedadam import ServerAdam
from coordinator.optimizers.fedsofim import DPFedSOFIM, sherman_morrison_solve
from coordinator.optimizers.server_sgd import ServerSGD
from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights


@pytest.mark.parametrize("d", [1, 7, 64, 512])
@pytest.mark.parametrize("case", ["random", "ill-conditioned"])
def test_sherman_morrison_equals_a_dense_solve(d, case):
    rng = np.random.default_rng(d)
    m, g = rng.standard_normal(d), rng.standard_normal(d)
    rho = 0.7
    if case == "ill-conditioned":  # condition number (rho + |m|^2) / rho = 1e8 + 1
        m, rho = m / np.linalg.norm(m) * 1e2, 1e-4
    dense = np.linalg.solve(np.outer(m, m) + rho * np.eye(d), g)
    fast = sherman_morrison_solve(m, g, rho)
    assert np.linalg.norm(fast - dense) <= 1e-6 * np.linalg.norm(dense)


def test_the_float32_step_is_the_reference_solve():
    rng = np.random.default_rng(5)
    w = {"a": rng.standard_normal(200).astype(np.float32), "b": rng.standard_normal((10, 10)).astype(np.float32)}
    d1 = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
    d2 = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
    opt = DPFedSOFIM(learning_rate=0.7, beta=0.9, rho=0.3)
    w1 = opt.step(w, d1)
    w2 = opt.step(w1, d2)
    # reference in float64, in sorted-name order: M1 = 0.1 G1, M2 = 0.9 M1 + 0.1 G2
    flat = lambda t: np.concatenate([np.asarray(t[k], np.float64).reshape(-1) for k in sorted(t)])  # noqa: E731
    g1, g2 = -flat(d1), -flat(d2)
    m2 = 0.9 * (0.1 * g1) + 0.1 * g2
    expected = flat(w1) - 0.7 * sherman_morrison_solve(m2, g2, 0.3)
    np.testing.assert_allclose(flat(w2), expected, rtol=1e-5, atol=1e-6)


def test_large_rho_is_sgd_with_step_eta_over_rho():
    w = {"a": np.array([1.0, -2.0, 0.5], np.float32)}
    delta = {"a": np.array([0.3, 0.1, -0.2], np.float32)}  # G = -delta
    opt = DPFedSOFIM(learning_rate=2.0, beta=0.5, rho=1e8)
    out = opt.step(w, delta)
    np.testing.assert_allclose(out["a"], w["a"] + 2.0 / 1e8 * delta["a"], rtol=1e-7)


def test_one_step_by_hand():
    # G = (1, 0); M = (1 - 0.5) G = (0.5, 0); (M M^T + I)^-1 G = (1/1.25, 0) = (0.8, 0); eta 1 -> theta - (0.8, 0)
    opt = DPFedSOFIM(learning_rate=1.0, beta=0.5, rho=1.0)
    out = opt.step({"w": np.zeros(2, np.float32)}, {"w": np.array([-1.0, 0.0], np.float32)})
    np.testing.assert_allclose(out["w"], [-0.8, 0.0], rtol=1e-7)
    # a second step along G' = (0, 1): M = 0.5 (0.5, 0) + 0.5 (0, 1) = (0.25, 0.5); M^T G' = 0.5; |M|^2 = 0.3125
    # (M M^T + I)^-1 G' = G' - M * 0.5 / 1.3125 = (-0.0952381, 0.8095238)
    out2 = opt.step(out, {"w": np.array([0.0, -1.0], np.float32)})
    np.testing.assert_allclose(out2["w"], out["w"] - np.array([-0.25 * 0.5 / 1.3125, 1 - 0.5 * 0.5 / 1.3125]),
                               rtol=1e-6)


def test_warmup_steps_are_sgd_and_groups_keep_their_own_state():
    opt = DPFedSOFIM(learning_rate=1.0, beta=0.5, rho=2.0, warmup_rounds=1)
    w = {"phi.w": np.zeros(2, np.float32), "nira/c0/psi.b": np.zeros(1, np.float32),
         "nira/c1/psi.b": np.zeros(1, np.float32)}
    d = {"phi.w": np.array([-1.0, 0.0], np.float32), "nira/c0/psi.b": np.array([-2.0], np.float32),
         "nira/c1/psi.b": np.zeros(1, np.float32)}
    out = opt.step(w, d)
    np.testing.assert_allclose(out["phi.w"], [-0.5, 0.0])  # warm-up: theta - G / rho
    state = opt.state_tensors()
    assert set(state) == {f"fedsofim/{k}/{g}" for k in ("momentum", "step") for g in ("shared", "c0", "c1")}
    np.testing.assert_array_equal(state["fedsofim/momentum/c0"], [1.0])  # 0.5 * G_c0 = 0.5 * 2
    np.testing.assert_array_equal(state["fedsofim/momentum/c1"], [0.0])


def test_state_restore_gives_bit_identical_next_steps():
    rng = np.random.default_rng(3)
    w = {"a": rng.standard_normal(50).astype(np.float32), "b": rng.standard_normal((4, 5)).astype(np.float32)}
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()} for _ in range(4)]
    first = DPFedSOFIM(learning_rate=0.3, beta=0.8, rho=0.05)
    for d in deltas[:3]:
        w = first.step(w, d)
    second = DPFedSOFIM(learning_rate=0.3, beta=0.8, rho=0.05)
    second.load_state_tensors({k: v.copy() for k, v in first.state_tensors().items()})
    a, b = first.step(w, deltas[3]), second.step(w, deltas[3])
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_server_momentum_by_hand_and_bad_values():
    opt = ServerSGD(1.0, momentum=0.5)
    w = {"w": np.zeros(1, np.float32)}
    w = opt.step(w, {"w": np.array([1.0], np.float32)})   # v = 1
    w = opt.step(w, {"w": np.array([1.0], np.float32)})   # v = 0.5 + 1 = 1.5
    np.testing.assert_allclose(w["w"], [2.5])
    for kw in (dict(beta=1.0), dict(rho=0.0), dict(learning_rate=-1.0), dict(warmup_rounds=-1)):
        with pytest.raises(ConfigError):
            DPFedSOFIM(**kw)
    with pytest.raises(ConfigError, match="momentum"):
        ServerSGD(1.0, momentum=1.0)


def run_coordinator(tmp_path, transport, key, rounds, *, start=True):
    cfg = make_config(tmp_path, rounds=rounds, ship_ort_artifacts=False,
                      server_optimizer={"kind": "fedsofim", "beta": 0.5, "rho": 0.1})
    return Coordinator(cfg, transport=transport, signing_key=key, initial_weights=tiny_weights())


def test_a_restarted_coordinator_resumes_the_optimizer_exactly(tmp_path):
    # Prepare: the same two deterministic fake sites for an uninterrupted run and a run restarted after round 2
    def federation(folder, key):
        transport = InMemoryTransport()
        sites = [FakeSite(sid, transport, key.public_key(), value=v, num_examples=n,
                          events={IUCNCategory.LC: EVENT}).attach() for sid, v, n in (("s1", 1.0, 10), ("s2", -3.0, 30))]
        return transport, sites

    key = generate_signing_key()
    transport, sites = federation(tmp_path / "a", key)
    straight = run_coordinator(tmp_path / "a", transport, key, 3)
    for s in sites:
        straight.enrol(s.site_id, s.public_pem, {"capacity": s.num_examples})
    straight.run()
    expected = straight.rounds.current_model()[1]
    straight.close()

    transport, sites = federation(tmp_path / "b", key)
    first = run_coordinator(tmp_path / "b", transport, key, 3)
    for s in sites:
        first.enrol(s.site_id, s.public_pem, {"capacity": s.num_examples})
    first.run(rounds=2)
    first.close()
    # Execute: a new coordinator on the same database and data folder runs round 3
    again = run_coordinator(tmp_path / "b", transport, key, 3)
    again.run()
    # Assert: bit-identical to the uninterrupted run (the momentum came back from the stored state)
    got = again.rounds.current_model()[1]
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    again.close()


# ---- the momentum-preconditioned variant, FedAdam, and both selectable in the config -------------------------
def test_momentum_preconditioned_step_equals_a_dense_solve():
    # Prepare: two steps on d = 40 with rho below |M|^2, so the preconditioner acts
    rng = np.random.default_rng(11)
    w0 = {"a": rng.standard_normal(30).astype(np.float32), "b": rng.standard_normal((2, 5)).astype(np.float32)}
    d1, d2 = ({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w0.items()} for _ in range(2))
    eta, beta, rho = 0.7, 0.8, 0.05
    opt = DPFedSOFIM(learning_rate=eta, beta=beta, rho=rho, precondition="momentum")
    # Execute
    w1 = opt.step(w0, d1)
    w2 = opt.step(w1, d2)
    # Assert: theta_t - eta (M_t M_t^T + rho I)^-1 M_t by numpy's dense solve, in float64, sorted-name order
    flat = lambda t: np.concatenate([np.asarray(t[k], np.float64).reshape(-1) for k in sorted(t)])  # noqa: E731
    m1 = (1 - beta) * -flat(d1)
    m2 = beta * m1 + (1 - beta) * -flat(d2)
    assert m2 @ m2 > 10 * rho
    dense = lambda m: np.linalg.solve(np.outer(m, m) + rho * np.eye(m.size), m)  # noqa: E731
    np.testing.assert_allclose(flat(w1), flat(w0) - eta * dense(m1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(w2), flat(w1) - eta * dense(m2), rtol=1e-5, atol=1e-6)
    assert set(opt.state_tensors()) == {"fedsofim/momentum/shared", "fedsofim/step/shared"}  # format unchanged


def test_momentum_variant_state_round_trip_and_bad_precondition():
    rng = np.random.default_rng(4)
    w = {"a": rng.standard_normal(20).astype(np.float32)}
    deltas = [{"a": rng.standard_normal(20).astype(np.float32)} for _ in range(3)]
    first = DPFedSOFIM(learning_rate=0.3, beta=0.9, rho=0.01, precondition="momentum")
    for d in deltas[:2]:
        w = first.step(w, d)
    second = DPFedSOFIM(learning_rate=0.3, beta=0.9, rho=0.01, precondition="momentum")
    second.load_state_tensors(first.state_tensors())
    a, b = first.step(w, deltas[2]), second.step(w, deltas[2])
    assert np.array_equal(a["a"], b["a"])
    with pytest.raises(ConfigError, match="precondition"):
        DPFedSOFIM(precondition="fisher")


def test_fedadam_two_steps_by_hand():
    # Reddi et al. 2021, Alg. 2 with beta1 = 0.5, beta2 = 0.75, tau = 1, eta = 0.4, v_{-1} = tau^2 = 1.
    # coordinate 0: Delta_1 = 1 -> m = 0.5, v = 0.75 + 0.25 = 1, step 0.4 * 0.5 / (1 + 1) = +0.1
    #               Delta_2 = 3 -> m = 0.25 + 1.5 = 1.75, v = 0.75 + 2.25 = 3, step 0.4 * 1.75 / (sqrt 3 + 1)
    # coordinate 1: Delta = 0 twice -> m = 0, no move
    opt = ServerAdam(learning_rate=0.4, beta1=0.5, beta2=0.75, tau=1.0)
    w1 = opt.step({"w": np.array([2.0, -1.0])}, {"w": np.array([1.0, 0.0])})
    np.testing.assert_allclose(w1["w"], [2.1, -1.0], rtol=1e-12)
    w2 = opt.step(w1, {"w": np.array([3.0, 0.0])})
    np.testing.assert_allclose(w2["w"], [2.1 + 0.4 * 1.75 / (np.sqrt(3.0) + 1.0), -1.0], rtol=1e-12)
    assert w2["w"].dtype == np.float64


def test_fedadam_state_round_trip_and_bad_values():
    rng = np.random.default_rng(8)
    w = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)}
    deltas = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()} for _ in range(3)]
    first = ServerAdam(learning_rate=0.05, tau=1e-2)
    for d in deltas[:2]:
        w = first.step(w, d)
    state = first.state_tensors()
    assert set(state) == {"fedadam/m/a", "fedadam/v/a", "fedadam/m/b", "fedadam/v/b"}
    second = ServerAdam(learning_rate=0.05, tau=1e-2)
    second.load_state_tensors({k: v.copy() for k, v in state.items()})
    a, b = first.step(w, deltas[2]), second.step(w, deltas[2])
    assert all(np.array_equal(a[k], b[k]) for k in a) and a["a"].dtype == np.float32
    for kw in (dict(tau=0.0), dict(beta1=1.0), dict(beta2=-0.1), dict(learning_rate=0.0)):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            ServerAdam(**kw)
    with pytest.raises(ValueError, match="disagrees"):
        ServerAdam().load_state_tensors({"fedadam/m/a": np.zeros(2)})


def test_the_config_selects_fedadam_and_the_momentum_variant(tmp_path):
    from coordinator.service import build_optimizer

    cfg = make_config(tmp_path, server_learning_rate=0.01,
                      server_optimizer={"kind": "fedadam", "beta1": 0.8, "beta2": 0.9, "tau": 0.1})
    opt = build_optimizer(cfg)
    assert isinstance(opt, ServerAdam) and (opt.learning_rate, opt.beta1, opt.beta2, opt.tau) == (0.01, 0.8, 0.9, 0.1)
    cfg = make_config(tmp_path, server_optimizer={"kind": "fedsofim", "rho": 0.01, "precondition": "momentum"})
    opt = build_optimizer(cfg)
    assert isinstance(opt, DPFedSOFIM) and opt.precondition == "momentum" and opt.rho == 0.01
    assert build_optimizer(make_config(tmp_path, server_optimizer={"kind": "fedsofim"})).precondition == "gradient"
    with pytest.raises(ConfigError, match="precondition"):
        make_config(tmp_path, server_optimizer={"kind": "fedsofim", "precondition": "fisher"})
