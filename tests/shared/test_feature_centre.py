"""The public feature centre: the fold/unfold identity, one hand-worked training step on centred inputs, the file
format's errors, and the gateway reading it from its site config."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat
from shared.models.kinds import model_spec
from shared.protocol import TrainingTask

from edge_sdk.backends.base import create_backend
from shared.models.feature_centre import (centre_digest, centred_weights, load_feature_centre, public_centre,
                                          save_feature_centre, uncentred_gradient, uncentred_weights)
from edge_sdk.training import TrainingInputs, clipped_sum_locally, train_locally
from tests.gateway_backend import GATEWAY_BACKEND, needs_torch


class AllRecords:
    """Samples every record (q = 1) and draws zero noise."""

    def random(self, size):
        return np.zeros(size)

    def standard_normal(self, size):
        return np.zeros(size)


class Records:
    def __init__(self, features, labels, ranks):
        self.features, self.labels, self.categories = features, labels, ranks

    def __len__(self):
        return len(self.labels)


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("adapter_width", [0, 3])
def test_fold_and_unfold_give_the_same_function_on_centred_inputs(adapter_width):
    rng = np.random.default_rng(0)
    e = 1280
    weights = model_spec("head", 4, adapter_width=adapter_width).initial_weights(1, head_init="uniform")
    c = rng.uniform(0, 6, e).astype(np.float32)
    x = rng.uniform(0, 6, (5, e))
    layer = "phi.0" if adapter_width else "psi"
    plain = weights[f"{layer}.weight"] @ x.T + weights[f"{layer}.bias"][:, None]
    unfolded = centred_weights(weights, c)
    centred = unfolded[f"{layer}.weight"] @ (x - c).T + unfolded[f"{layer}.bias"][:, None]
    np.testing.assert_allclose(centred, plain, rtol=1e-4, atol=1e-3)
    back = uncentred_weights(unfolded, c)
    for name in weights:
        np.testing.assert_allclose(back[name], weights[name], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="feature centre has 7 values"):
        centred_weights(weights, np.zeros(7, np.float32))


@needs_torch  # trains with the torch backend
def test_one_non_private_step_on_centred_inputs_matches_the_hand_worked_gradient():
    rng = np.random.default_rng(3)
    n, e, k = 6, 1280, 3
    x = rng.uniform(0, 6, (n, e)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 1])
    c = x[:4].mean(axis=0).astype(np.float32) + 0.5
    weights = {"psi.weight": np.zeros((k, e), np.float32), "psi.bias": np.array([0.2, -0.1, 0.0], np.float32)}
    task = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=1, expected_batch_size=n,
                        learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=1, privacy="none")
    result = train_locally(backend=create_backend("torch", model=model_spec("head", k, adapter_width=0)),
                           dataset=Records(x, y, np.full(n, 6)),
                           task=task, global_weights=weights, site_categories=[Cat.NE], randomness=AllRecords(),
                           feature_centre=c)
    # by hand: W = 0, so p = softmax(b) for every record; the mean gradient on centred inputs, one step, fold back
    p = _softmax(np.tile(weights["psi.bias"].astype(np.float64), (n, 1)))
    err = p - np.eye(k)[y]
    g_w = err.T @ (x - c).astype(np.float64) / n
    g_b = err.mean(axis=0)
    w1 = -0.5 * g_w
    b1 = weights["psi.bias"] - 0.5 * g_b            # centred form (b = b' + W c = b' since W = 0)
    b1_plain = b1 - w1 @ c.astype(np.float64)       # folded back: b' = b - W c
    np.testing.assert_allclose(result.delta["psi.weight"], w1, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.delta["psi.bias"], b1_plain - weights["psi.bias"], rtol=1e-4, atol=1e-5)
    # without the centre the bias gradient is the same, the weight gradient is on the raw inputs
    raw = train_locally(backend=create_backend("torch", model=model_spec("head", k, adapter_width=0)),
                        dataset=Records(x, y, np.full(n, 6)),
                        task=task, global_weights=weights, site_categories=[Cat.NE], randomness=AllRecords())
    np.testing.assert_allclose(raw.delta["psi.weight"], -0.5 * err.T @ x.astype(np.float64) / n, rtol=1e-4,
                               atol=1e-6)


@needs_torch  # trains with the torch backend
def test_global_dp_centred_clipped_sum_folded_by_the_coordinator_matches_the_hand_worked_step():
    # A Global DP round: the site clips gradients of the centred form, the coordinator folds the (here noise-free)
    # mean with the public c before its step. By hand: the plain-form head (W, b') with b = b' + W c.
    from shared.protocol import SecAggSettings

    rng = np.random.default_rng(5)
    n, e, k, clip, lr = 5, 1280, 3, 0.7, 0.4
    x = rng.uniform(0, 6, (n, e)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0])
    c = rng.uniform(0, 6, e).astype(np.float32)
    weights = {"psi.weight": (0.01 * rng.standard_normal((k, e))).astype(np.float32),
               "psi.bias": np.array([0.3, -0.2, 0.1], np.float32)}
    d = k * e + k
    task = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=1, expected_batch_size=n,
                        learning_rate=lr, clipping_norm=clip, target_delta=1e-5, planned_rounds=1, privacy="global",
                        budgets={Cat.NE: 1.0}, noise_multiplier=1e4, feature_centre=centre_digest(c),
                        secagg=SecAggSettings(site_ids=("a", "b"), threshold=2, vector_length=d, max_abs_value=10.0,
                                              scale=2.0 ** 20))
    backend = create_backend("torch", model=model_spec("head", k, adapter_width=0))
    part = clipped_sum_locally(backend=backend, dataset=Records(x, y, np.full(n, Cat.NE.rank, np.int8)), task=task,
                               global_weights=weights, site_categories=[Cat.NE], randomness=AllRecords(),
                               feature_centre=c)
    w, b_plain = weights["psi.weight"].astype(np.float64), weights["psi.bias"].astype(np.float64)
    xc = x.astype(np.float64) - c
    p = _softmax(x.astype(np.float64) @ w.T + b_plain)  # (n, k): the same function in either form
    err = p - np.eye(k)[y]
    norms = np.linalg.norm(err, axis=1) * np.sqrt((xc ** 2).sum(axis=1) + 1.0)
    # the site clips at C less the float64 rounding margin of a sum of MAX_SUMMED_RECORDS terms (sum_rounding)
    from edge_sdk.training import MAX_SUMMED_RECORDS
    from shared.privacy.sum_rounding import margin

    clip_at = clip - margin(num_records=MAX_SUMMED_RECORDS, clipping_norm=clip, vector_length=d, scale=2.0 ** 20,
                            max_abs_value=10.0)
    f = np.minimum(1.0, clip_at / norms)
    s_w, s_b = (f[:, None] * err).T @ xc, (f[:, None] * err).sum(axis=0)
    np.testing.assert_allclose(part.gradient_sum["psi.weight"], s_w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(part.gradient_sum["psi.bias"], s_b, rtol=1e-4, atol=1e-6)
    folded = uncentred_gradient({"psi.weight": s_w / n, "psi.bias": s_b / n}, c)
    new = {name: weights[name] - lr * folded[name] for name in weights}
    # the stepped plain model is the centred model stepped by the same gradient: W' (x - c) + b - lr g_b
    want = (w - lr * s_w / n) @ xc.T + (b_plain + w @ c - lr * s_b / n)[:, None]
    got = new["psi.weight"].astype(np.float64) @ x.astype(np.float64).T + new["psi.bias"][:, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # prepared inputs centred by another centre are refused, naming the field
    with pytest.raises(ConfigError, match="another feature centre"):
        clipped_sum_locally(backend=backend, dataset=TrainingInputs(Records(x, y, np.full(n, 6, np.int8)), None),
                            task=task, global_weights=weights, site_categories=[Cat.NE], randomness=AllRecords(),
                            feature_centre=c)


def test_centre_digest_is_sha256_of_the_float32_bytes():
    import hashlib

    c = np.arange(4, dtype=np.float64) / 3
    assert centre_digest(c) == hashlib.sha256(np.asarray(c, "<f4").tobytes()).hexdigest()
    assert centre_digest(c) != centre_digest(c + 1e-3)


@needs_torch  # trains with the torch backend
def test_ccdp_events_do_not_depend_on_the_centre():
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 6, (8, 1280)).astype(np.float32)
    data = Records(x, np.arange(8) % 2, np.full(8, Cat.VU.rank, np.int8))
    task = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=2, expected_batch_size=4,
                        learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=3, privacy="ccdp",
                        budgets={Cat.VU: 1.0})
    weights = model_spec("head", 2, adapter_width=0).initial_weights(0)
    runs = [train_locally(backend=create_backend("torch", model=model_spec("head", 2, adapter_width=0)), dataset=data,
                          task=task, global_weights=weights, site_categories=[Cat.VU], randomness=AllRecords(),
                          feature_centre=centre) for centre in (None, x.mean(axis=0))]
    assert runs[0].report.events == runs[1].report.events
    assert runs[0].noise_multipliers == runs[1].noise_multipliers


def test_file_round_trip_and_errors_name_the_field(tmp_path):
    feats = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_allclose(public_centre(feats), [4.5, 5.5, 6.5])
    path = save_feature_centre(tmp_path / "c.safetensors", public_centre(feats), num_images=4, source="test")
    np.testing.assert_allclose(load_feature_centre(path, dim=3), [4.5, 5.5, 6.5])
    with pytest.raises(ConfigError, match=r"shape \(5,\)") as info:
        load_feature_centre(path, dim=5)
    assert info.value.field == "feature_centre"
    with pytest.raises(ConfigError, match="does not exist"):
        load_feature_centre(tmp_path / "missing.safetensors", dim=3)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        load_feature_centre(tmp_path / "bad.safetensors", dim=3)
    with pytest.raises(ValueError, match="non-empty finite"):
        public_centre(np.zeros((0, 3)))


def test_the_gateway_reads_its_centre_from_the_site_config(tmp_path):
    from shared.keys import generate_signing_key
    from tests.support import camera_site

    from edge_sdk.agent import EdgeAgent
    from edge_sdk.config import load_site_config

    coordinator = generate_signing_key()
    centre = np.linspace(0, 1, 1280, dtype=np.float32)
    save_feature_centre(tmp_path / "site" / "centre.safetensors", centre, num_images=10, source="test")
    for name, file in (("site", "centre.safetensors"), ("other", "nowhere.safetensors")):
        site_key = camera_site(tmp_path / name, name, coordinator, feature_centre=file, backend=GATEWAY_BACKEND)
        config = load_site_config(tmp_path / name / "site.yaml")
        assert config.feature_centre == tmp_path / name / file  # resolved against the config's folder

        def build():
            return EdgeAgent(config=config, transport=_NoTransport(), signing_key=site_key,
                             coordinator_key=coordinator.public_key(), dataset=Records(centre[None], [0], [4]))

        if name == "site":
            np.testing.assert_array_equal(build().feature_centre, centre)
        else:
            with pytest.raises(ConfigError, match="does not exist") as info:
                build()
            assert info.value.field == "feature_centre"


class _NoTransport:
    """Never connected: building an agent does not touch the transport."""

    def __getattr__(self, name):
        raise AssertionError(f"the transport was used ({name})")
