"""The head model (shared.models.head) and model kinds (shared.models.kinds): names, shapes, the forward pass
against numpy, a deterministic numpy initialisation, JSON round trips, telling kinds apart by their tensors, and
input checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.models import head
from shared.models.head import HeadConfig
from shared.models.kinds import KINDS, ModelSpec, as_spec, model_spec, spec_from_weights
from shared.models.state import load_numpy_state, to_numpy_state
from tests.gateway_backend import needs_torch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2024)


@needs_torch
@pytest.mark.parametrize("width", [256, 16, 0])
def test_names_shapes_and_order_match_the_torch_module(width) -> None:
    config = HeadConfig(num_classes=7, adapter_width=width, embedding_dim=40)
    module = head.build_model(config)
    assert [(n, tuple(p.shape)) for n, p in module.named_parameters()] == list(config.parameter_shapes())
    assert config.num_parameters == sum(p.numel() for p in module.parameters())
    names = [n for n, _ in config.parameter_shapes()]
    assert names[-2:] == ["psi.weight", "psi.bias"]  # the head, whatever the adapter
    assert all(n.startswith("phi.") for n in names[:-2]) and (len(names) == 2) == (width == 0)


def test_parameter_counts_of_the_default_sizes() -> None:
    # 1280 * 256 + 256 + 256 * 10 + 10 and 1280 * 10 + 10
    assert HeadConfig(num_classes=10).num_parameters == 330_506
    assert HeadConfig(num_classes=10, adapter_width=0).num_parameters == 12_810
    assert HeadConfig(num_classes=10).embedding_dim == 1280


@needs_torch
def test_forward_is_tanh_adapter_then_linear_head(rng) -> None:
    import torch

    config = HeadConfig(num_classes=5, adapter_width=8, embedding_dim=12)
    weights = head.initial_weights(config, rng, head_init="uniform")
    module = head.build_model(config)
    load_numpy_state(module, weights)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    x64 = x.astype(np.float64)
    h = np.tanh(x64 @ weights["phi.0.weight"].T.astype(np.float64) + weights["phi.0.bias"])
    expected = h @ weights["psi.weight"].T.astype(np.float64) + weights["psi.bias"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    no_adapter = HeadConfig(num_classes=5, adapter_width=0, embedding_dim=12)
    w0 = head.initial_weights(no_adapter, 0, head_init="uniform")
    m0 = head.build_model(no_adapter)
    load_numpy_state(m0, w0)
    with torch.no_grad():
        np.testing.assert_allclose(m0(torch.from_numpy(x)).numpy(), x64 @ w0["psi.weight"].T + w0["psi.bias"],
                                   rtol=1e-5, atol=1e-6)


def test_initial_weights_are_deterministic_and_follow_the_stated_law() -> None:
    config = HeadConfig(num_classes=10)
    a = head.initial_weights(config, 3)
    b = head.initial_weights(config, np.random.default_rng(3))
    c = head.initial_weights(config, 4)
    assert list(a) == [n for n, _ in config.parameter_shapes()]
    for name in a:
        assert a[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["phi.0.weight"], c["phi.0.weight"])
    # psi starts at zero by default (De et al. 2022)
    assert not a["psi.weight"].any() and not a["psi.bias"].any()
    # adapter: U(-1/sqrt(1280), 1/sqrt(1280)): bound, mean 0 and variance bound^2 / 3 (327,680 draws)
    bound = 1 / np.sqrt(1280)
    w = a["phi.0.weight"].astype(np.float64)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.999 * bound
    assert abs(w.mean()) < 5 * bound / np.sqrt(3 * w.size)
    assert w.var() == pytest.approx(bound ** 2 / 3, rel=0.01)
    uniform = head.initial_weights(config, 3, head_init="uniform")
    assert 0 < np.abs(uniform["psi.weight"]).max() <= 1 / np.sqrt(256)
    np.testing.assert_array_equal(uniform["phi.0.weight"], a["phi.0.weight"])  # same draws for the adapter
    # a generator is advanced: two draws from one generator differ
    g = np.random.default_rng(0)
    assert not np.array_equal(head.initial_weights(config, g)["phi.0.weight"],
                              head.initial_weights(config, g)["phi.0.weight"])


def test_initial_weights_do_not_need_torch() -> None:
    """The coordinator builds the round-0 model without importing torch."""
    code = ("import sys; from shared.models.kinds import model_spec; "
            "w = model_spec('head', 10).initial_weights(0); "
            "print(sorted(w), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False"), out.stdout


def test_bad_configurations_name_the_field() -> None:
    for kwargs, field in (({"num_classes": 1}, "num_classes"), ({"num_classes": 3, "adapter_width": -1},
                                                                 "adapter_width"),
                          ({"num_classes": 3, "embedding_dim": 0}, "embedding_dim"),
                          ({"num_classes": 3.0}, "num_classes"), ({"num_classes": True}, "num_classes")):
        with pytest.raises(ValueError, match=field):
            HeadConfig(**kwargs)
    with pytest.raises(ValueError, match="head_init"):
        head.initial_weights(HeadConfig(3), 0, head_init="normal")
    with pytest.raises(ValueError, match="Generator"):
        head.initial_weights(HeadConfig(3), "seed")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="adapter_width"):
        model_spec("head", 3, adapter_width=-2)
    with pytest.raises(ConfigError, match="unknown option"):
        model_spec("head", 3, width=8)
    with pytest.raises(ConfigError, match="unknown model kind"):
        model_spec("resnet", 3)
    with pytest.raises(ConfigError, match="disagrees"):
        as_spec(model_spec("head", 3), 4)


def test_prepare_input_takes_embeddings_only() -> None:
    spec = model_spec("head", 3, adapter_width=4, embedding_dim=6)
    x = np.arange(12, dtype=np.float64).reshape(2, 6)
    out = spec.prepare_input(x)
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.shape == (2, 6)
    assert spec.prepare_input(np.zeros((0, 6), np.float32)).shape == (0, 6)
    for bad in (np.zeros((2, 28, 28), np.uint8), np.zeros((2, 6), np.uint8), np.zeros((2, 5), np.float32),
                np.zeros(6, np.float32)):
        with pytest.raises(ValueError, match=r"embeddings, float32 \(B, 6\)"):
            spec.prepare_input(bad)


def test_model_spec_json_round_trip_and_defaults() -> None:
    spec = model_spec("head", 10)
    assert spec.option_dict == {"adapter_width": 256, "embedding_dim": 1280} and spec.example_shape == (1280,)
    assert spec.linear_only
    assert ModelSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert hash(spec) == hash(model_spec("head", 10, adapter_width=256))
    # a manifest from before kinds (the retired camera CNN's artifacts) is refused with the fix
    with pytest.raises(ConfigError, match="rebuild the artifacts"):
        ModelSpec.from_json(None, num_classes=4)
    assert set(KINDS) == {"head"}
    with pytest.raises(ConfigError, match="unknown model kind 'camera_cnn'"):
        model_spec("camera_cnn", 10)


SPECS = [model_spec("head", 6), model_spec("head", 6, adapter_width=0),
         model_spec("head", 6, adapter_width=32, embedding_dim=64)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.options}")
def test_kinds_are_told_apart_by_their_tensors(spec) -> None:
    assert spec_from_weights(spec.initial_weights(1)) == spec


@needs_torch
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.options}")
def test_a_specs_initial_weights_fit_its_torch_module(spec) -> None:
    weights = spec.initial_weights(1)
    module = spec.build()
    assert [(n, tuple(p.shape)) for n, p in module.named_parameters()] == list(spec.parameter_shapes())
    load_numpy_state(module, weights)  # the spec's initial weights fit its module
    assert set(to_numpy_state(module)) == set(weights)


def test_foreign_weights_are_refused() -> None:
    w = model_spec("head", 4, adapter_width=8, embedding_dim=10).initial_weights(0)
    with pytest.raises(ConfigError, match="not a model of any kind"):
        spec_from_weights({**w, "phi.0.bias": np.zeros(9, np.float32)})  # inconsistent adapter
    with pytest.raises(ConfigError, match="not a model of any kind"):
        spec_from_weights({"fc.weight": np.zeros((2, 3), np.float32)})
