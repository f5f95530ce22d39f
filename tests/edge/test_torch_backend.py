"""Torch backend: torch.func per-example gradients equal single-example autograd; SGD step; registry."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend's tests need torch (a gateway installed with "
                            "wildfed[edge-ort] has none; the Python 3.11 run covers them)")

from shared.errors import ConfigError
from shared.models.kinds import model_spec

from edge_sdk.backends.base import create_backend, flatten, register_backend, unflatten
from edge_sdk.backends.torch_backend import TorchBackend
from tests.support import assert_norm_upper_bounds


# custom modules (``module=``) get their input prepared as this spec's: float32 (B, 784) rows (a 28x28 image, flat)
IMAGE_INPUT = model_spec("head", 3, adapter_width=0, embedding_dim=28 * 28)


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    spec = model_spec("head", 4, adapter_width=16)  # the head model with a (narrow) tanh adapter
    b = create_backend("torch", model=spec, threads=2, microbatch_size=3)  # 3 forces several chunks
    b.set_weights(spec.initial_weights(3, head_init="uniform"))
    return b


def batch(rng: np.random.Generator, n: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """n backbone-embedding-like inputs, float32 (n, 1280) in [0, 6), and labels."""
    return (6 * rng.random((n, 1280))).astype(np.float32), rng.integers(0, 4, size=n).astype(np.int64)


def test_per_example_gradients_equal_a_loop_of_autograd(backend: TorchBackend, rng) -> None:
    x, y = batch(rng)
    per_example = backend.per_example_gradients(x, y)
    assert per_example.dtype == np.float32 and per_example.shape == (7, backend.num_parameters)
    model = backend.model
    for i in range(7):
        model.zero_grad(set_to_none=True)
        xi = torch.from_numpy(x[i:i + 1])
        loss = torch.nn.functional.cross_entropy(model(xi), torch.from_numpy(y[i:i + 1]))
        loss.backward()
        expected = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()]).numpy()
        np.testing.assert_allclose(per_example[i], expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(backend.gradient(x, y), per_example.mean(axis=0), rtol=1e-4, atol=1e-6)


def test_layout_weights_and_sgd_step(backend: TorchBackend, rng) -> None:
    layout = backend.parameter_layout
    assert [s.name for s in layout] == [n for n, _ in backend.model.named_parameters()]
    assert backend.num_parameters == sum(p.numel() for p in backend.model.parameters())
    before = flatten(backend.get_weights(), layout)
    step = rng.standard_normal(backend.num_parameters).astype(np.float32)
    backend.apply_gradient(step, 0.25)
    np.testing.assert_allclose(flatten(backend.get_weights(), layout), before - 0.25 * step, rtol=1e-6, atol=1e-7)
    backend.set_weights(unflatten(before, layout))
    np.testing.assert_array_equal(flatten(backend.get_weights(), layout), before)


def test_bad_weights_and_registry(backend: TorchBackend) -> None:
    weights = backend.get_weights()
    with pytest.raises(ConfigError, match="unknown parameter"):
        backend.set_weights({**weights, "extra": np.zeros(1, np.float32)})
    name = next(iter(weights))
    with pytest.raises(ConfigError, match="shape"):
        backend.set_weights({**weights, name: np.zeros((1,), np.float32)})
    with pytest.raises(ConfigError, match="unknown training backend"):
        create_backend("tensorflow")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch")(lambda **kw: None)


def test_ghost_clipping_path_equals_materialised_gradients(backend: TorchBackend, rng) -> None:
    assert backend._ghost_layers is not None  # the head model is all Linear
    x, y = batch(rng, 9)
    explicit = backend.per_example_gradients(x, y).astype(np.float64)
    implicit = backend.per_example(x, y)
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(explicit, axis=1))
    weights = rng.random((3, 9)).astype(np.float32)
    np.testing.assert_allclose(implicit.weighted_sum(weights), weights @ explicit, rtol=1e-4, atol=1e-6)


def test_unsupported_layers_fall_back_to_vmap(rng) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(28 * 28, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    b = TorchBackend(model=IMAGE_INPUT, module=model)
    assert b._ghost_layers is None
    x, y = rng.random((4, 28 * 28)).astype(np.float32), np.array([0, 1, 2, 0])
    implicit = b.per_example(x, y)
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(b.per_example_gradients(x, y), axis=1))


def test_ghost_path_on_strided_unpadded_and_rectangular_convs(rng) -> None:
    # Covers both per-example conv routes: shifted windows (stride 1: rectangular kernel, asymmetric padding, none)
    # and im2col (stride 2, dilation 2).
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 28, 28)),  # the backend feeds (B, 784) rows, as the head model's input check takes
        torch.nn.Conv2d(1, 3, (3, 2), padding=(1, 0)), torch.nn.Tanh(),
        torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.Tanh(),
        torch.nn.Conv2d(4, 2, 3, dilation=2, bias=False), torch.nn.Tanh(),
        torch.nn.Flatten(), torch.nn.LazyLinear(3))
    model(torch.zeros(1, 28 * 28))  # materialise the lazy layer
    b = TorchBackend(model=IMAGE_INPUT, module=model)
    assert b._ghost_layers is not None
    x, y = rng.random((5, 28 * 28)).astype(np.float32), np.array([0, 1, 2, 0, 1])
    explicit = b.per_example_gradients(x, y).astype(np.float64)
    implicit = b.per_example(x, y)
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(explicit, axis=1))
    weights = rng.random((2, 5)).astype(np.float32)
    np.testing.assert_allclose(implicit.weighted_sum(weights), weights @ explicit, rtol=1e-4, atol=1e-6)
