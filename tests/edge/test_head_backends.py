"""The head model (shared.models.head) in both training backends: per-example gradients against the closed form,
torch against ONNX Runtime (materialised rows and the factor graph), one DP step through the gateway's step code,
the frozen-adapter scope, the artifact set of the head model, and training on a gateway without torch.

Closed form (cross-entropy of softmax, per example i; h_i = tanh(W1 x_i + b1), p_i = softmax(W2 h_i + b2)):

    g_i(psi.weight) = (p_i - onehot(y_i)) h_i^T        g_i(psi.bias) = p_i - onehot(y_i)
    d_i = (W2^T (p_i - onehot(y_i))) * (1 - h_i^2)
    g_i(phi.0.weight) = d_i x_i^T                      g_i(phi.0.bias) = d_i

computed here in float64 numpy, independently of both backends.

ORT tests are skipped, with the reason, where ``onnxruntime.training`` does not import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shared.codec import model_hash
from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat
from shared.models.kinds import ModelSpec, model_spec, spec_from_weights

from edge_sdk.backends.base import ParameterSpec, create_backend, flatten
from edge_sdk.backends.factored import LinearFactors
from edge_sdk.backends.ort_backend import ArtifactCache, ort_training_importable
from edge_sdk.privacy.ccdp import CCDPMechanism
from edge_sdk.privacy.randomness import SeededRandom
from edge_sdk.training import local_step
from tests.gateway_backend import artifact_set, model_weights, needs_torch
from tests.support import assert_norm_upper_bounds

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_ort = pytest.mark.skipif(not ort_training_importable(),
                               reason="onnxruntime.training is not importable here (pip install 'wildfed[edge-ort]')")

SMALL = model_spec("head", 5, adapter_width=12, embedding_dim=20)
SMALL_HEAD_ONLY = model_spec("head", 5, adapter_width=0, embedding_dim=20)


def closed_form(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, scope: str = "all") -> np.ndarray:
    """float64 (B, d) per-example gradients in layout order (module docstring)."""
    x = x.astype(np.float64)
    has_adapter = "phi.0.weight" in weights
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    h = np.tanh(x @ w["phi.0.weight"].T + w["phi.0.bias"]) if has_adapter else x
    logits = h @ w["psi.weight"].T + w["psi.bias"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    err = p - np.eye(w["psi.bias"].shape[0])[y]
    parts = [np.einsum("bk,bf->bkf", err, h).reshape(len(y), -1), err]
    if has_adapter and scope == "all":
        d = (err @ w["psi.weight"]) * (1.0 - h ** 2)
        parts = [np.einsum("bh,be->bhe", d, x).reshape(len(y), -1), d] + parts
    return np.concatenate(parts, axis=1)


def data(rng: np.random.Generator, spec: ModelSpec, n: int = 9) -> tuple[np.ndarray, np.ndarray]:
    e = spec.option_dict["embedding_dim"]
    x = rng.uniform(0, 6, size=(n, e)).astype(np.float32) * (rng.random((n, e)) < 0.5)  # ReLU6-like, sparse
    return x, rng.integers(0, spec.num_classes, n).astype(np.int64)


@needs_torch
@pytest.mark.parametrize("spec", [SMALL, SMALL_HEAD_ONLY], ids=["adapter", "head-only"])
@pytest.mark.parametrize("scope", ["all", "head"])
def test_torch_per_example_gradients_equal_the_closed_form(rng, spec, scope) -> None:
    backend = create_backend("torch", model=spec, scope=scope, threads=1, microbatch_size=4)
    weights = spec.initial_weights(rng, head_init="uniform")
    backend.set_weights(weights)
    x, y = data(rng, spec)
    expected = closed_form(weights, x, y, scope)
    names = [s.name for s in backend.parameter_layout]
    assert names == (["psi.weight", "psi.bias"] if scope == "head" or spec.option_dict["adapter_width"] == 0
                     else ["phi.0.weight", "phi.0.bias", "psi.weight", "psi.bias"])
    np.testing.assert_allclose(backend.per_example_gradients(x, y), expected, rtol=1e-4, atol=1e-6)  # vmap
    implicit = backend.per_example(x, y)  # one forward + one backward, no (B, d) matrix
    assert backend._ghost_layers is not None
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(expected, axis=1))
    w = rng.random((3, len(y))).astype(np.float32)
    np.testing.assert_allclose(implicit.weighted_sum(w), w @ expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(backend.gradient(x, y), expected.mean(axis=0), rtol=1e-4, atol=1e-6)


@needs_torch
def test_psi_gradient_is_softmax_error_outer_features_at_zero_init(rng) -> None:
    """With psi = 0 (the default initialisation) p = 1/K: g_i(psi.weight) = (1/K - onehot(y_i)) h_i^T exactly."""
    spec = SMALL
    backend = create_backend("torch", model=spec, threads=1)
    weights = spec.initial_weights(rng)  # head_init="zeros"
    backend.set_weights(weights)
    x, y = data(rng, spec)
    h = np.tanh(x.astype(np.float64) @ weights["phi.0.weight"].T + weights["phi.0.bias"])
    err = np.full((len(y), 5), 1 / 5) - np.eye(5)[y]
    got = backend.per_example_gradients(x, y)
    layout = {s.name: s for s in backend.parameter_layout}
    psi = layout["psi.weight"]
    np.testing.assert_allclose(got[:, psi.offset:psi.offset + psi.size],
                               np.einsum("bk,bf->bkf", err, h).reshape(len(y), -1), rtol=1e-5, atol=1e-7)
    # psi = 0 blocks the gradient to the adapter in the first step
    assert not got[:, :layout["psi.weight"].offset].any()


@needs_torch
def test_frozen_adapter_scope_trains_psi_only(rng) -> None:
    spec = SMALL
    backend = create_backend("torch", model=spec, scope="head", threads=1)
    weights = spec.initial_weights(rng, head_init="uniform")
    backend.set_weights(weights)
    assert backend.num_parameters == 5 * 12 + 5
    backend.apply_gradient(np.ones(backend.num_parameters, np.float32), 0.5)
    after = backend.get_weights()
    assert set(after) == set(weights)  # the whole model comes back, frozen adapter included
    np.testing.assert_array_equal(after["phi.0.weight"], weights["phi.0.weight"])
    np.testing.assert_allclose(after["psi.bias"], weights["psi.bias"] - 0.5, rtol=1e-6)
    with pytest.raises(ConfigError, match="phi.0.weight"):  # a model version always carries the adapter
        backend.set_weights({k: v for k, v in weights.items() if k != "phi.0.weight"})


@needs_torch
def test_head_model_refuses_images_and_bad_settings(rng) -> None:
    backend = create_backend("torch", model="head", num_classes=3, model_options={"adapter_width": 8}, threads=1)
    assert backend.spec == model_spec("head", 3, adapter_width=8)
    with pytest.raises(ValueError, match=r"embeddings, float32 \(B, 1280\)"):
        backend.per_example(np.zeros((2, 28, 28), np.uint8), np.zeros(2, np.int64))
    with pytest.raises(ConfigError, match="scope"):
        create_backend("torch", model=SMALL, scope="phi")
    with pytest.raises(ConfigError, match="unknown model kind"):
        create_backend("torch", model="vit", num_classes=3)


def test_linear_factors_equal_explicit_outer_products(rng) -> None:
    b, e, h, k = 6, 7, 4, 3
    a1, d1 = rng.standard_normal((b, e)), rng.standard_normal((b, h))
    a2, d2 = rng.standard_normal((b, h)), rng.standard_normal((b, k))
    layout, offset = [], 0
    for name, shape in (("phi.0.weight", (h, e)), ("phi.0.bias", (h,)), ("psi.weight", (k, h)), ("psi.bias", (k,))):
        layout.append(ParameterSpec(name, shape, offset))
        offset += int(np.prod(shape))
    g = LinearFactors({"phi.0": (a1, d1), "psi": (a2, d2)}, tuple(layout))
    explicit = np.concatenate([np.einsum("bo,bi->boi", d1, a1).reshape(b, -1), d1,
                               np.einsum("bo,bi->boi", d2, a2).reshape(b, -1), d2], axis=1)
    assert_norm_upper_bounds(g.norms, np.linalg.norm(explicit, axis=1))
    w = rng.random((2, b))
    np.testing.assert_allclose(g.weighted_sum(w), w @ explicit, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not the weight or bias"):
        LinearFactors({"psi": (a2, d2)}, tuple(layout))
    with pytest.raises(ValueError, match="do not fit"):
        LinearFactors({"phi.0": (a1, d1), "psi": (a1, d2)}, tuple(layout))


# ---- ONNX Runtime ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head_artifacts(tmp_path_factory):
    """Artifact sets of the full-size head model (1280 -> 256 -> 10) and of the small one, made by the
    coordinator's code from the weights alone (the spec is inferred from the tensors; tests.gateway_backend)."""
    if not ort_training_importable():
        pytest.skip("onnxruntime.training is not importable here")
    out = {}
    for name, spec, model in (("full", model_spec("head", 10), "head-full"), ("small", SMALL, "head-small"),
                              ("head-only", SMALL_HEAD_ONLY, "head-small-no-adapter")):
        weights = model_weights(model)  # spec.initial_weights(7, head_init="uniform")
        assert spec_from_weights(weights) == spec
        h = model_hash(weights)
        files = artifact_set(model)  # made here where torch is installed, else made beforehand with torch
        out[name] = (spec, weights, files, ArtifactCache(tmp_path_factory.mktemp(name)).store(h, files))
    return out


@needs_ort
def test_head_artifact_set_names_the_model_and_its_factor_graphs(head_artifacts) -> None:
    spec, _, files, _ = head_artifacts["full"]
    manifest = json.loads(files["manifest.json"])
    assert ModelSpec.from_json(manifest["model"]) == spec
    assert manifest["parameters"] == [[n, list(s)] for n, s in spec.parameter_shapes()]
    assert manifest["per_example_factors"] == {"all": "factors_all.onnx", "head": "factors_head.onnx"}
    assert {"factors_all.onnx", "factors_head.onnx"} <= set(files)


@needs_ort
@pytest.mark.parametrize("which", ["full", "small", "head-only"])
@pytest.mark.parametrize("scope", ["all", "head"])
def test_ort_matches_the_closed_form(head_artifacts, rng, which, scope) -> None:
    spec, _, _, folder = head_artifacts[which]
    ort = create_backend("ort", num_classes=spec.num_classes, threads=1, microbatch_size=4, artifacts=folder,
                         scope=scope)
    weights = spec.initial_weights(rng, head_init="uniform")
    ort.set_weights(weights)
    assert ort.spec == spec
    assert [s.name for s in ort.parameter_layout] == [n for n, _ in spec.parameter_shapes()
                                                      if scope == "all" or n.startswith("psi.")]
    x, y = data(rng, spec, 10)  # micro-batches of 4: three graph runs
    expected = closed_form(weights, x, y, scope)
    tol = dict(rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(ort.per_example_gradients(x, y), expected, **tol)
    implicit = ort.per_example(x, y)
    assert isinstance(implicit, LinearFactors)  # the factor graph, not the (B, d) rows
    assert_norm_upper_bounds(implicit.norms, np.linalg.norm(expected, axis=1))
    w = rng.random((2, len(y))).astype(np.float32)
    np.testing.assert_allclose(implicit.weighted_sum(w), w @ expected, **tol)
    np.testing.assert_allclose(ort.gradient(x, y), expected.mean(axis=0), **tol)


@needs_ort
@needs_torch
@pytest.mark.parametrize("which", ["full", "small", "head-only"])
@pytest.mark.parametrize("scope", ["all", "head"])
def test_ort_matches_torch(head_artifacts, rng, which, scope) -> None:
    spec, _, _, folder = head_artifacts[which]
    ort = create_backend("ort", num_classes=spec.num_classes, threads=1, microbatch_size=4, artifacts=folder,
                         scope=scope)
    torch_backend = create_backend("torch", model=spec, scope=scope, threads=1)
    weights = spec.initial_weights(rng, head_init="uniform")
    ort.set_weights(weights)
    torch_backend.set_weights(weights)
    assert [s.name for s in ort.parameter_layout] == [s.name for s in torch_backend.parameter_layout]
    x, y = data(rng, spec, 10)
    tol = dict(rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(ort.gradient(x, y), torch_backend.gradient(x, y), **tol)
    np.testing.assert_array_equal(ort.predict(x), torch_backend.predict(x))


@needs_torch
@needs_ort
@pytest.mark.filterwarnings("ignore::edge_sdk.privacy.randomness.InsecureRandomnessWarning")
def test_one_dp_step_parity_through_the_gateway_step(head_artifacts, rng) -> None:
    """``edge_sdk.training.local_step`` (Poisson sampling, per-example gradients, CCDP privatize, SGD) on both
    backends from the same weights with the same seeded source: the same batch, the same noise, the same step."""
    spec, _, _, folder = head_artifacts["full"]
    weights = spec.initial_weights(3)
    n = 40
    x, y = data(rng, spec, n)
    site = SimpleNamespace(images=x, labels=y, categories=np.where(np.arange(n) % 3 == 0, Cat.CR.rank,
                                                                   Cat.LC.rank).astype(np.int8))
    after, sizes = [], []
    for backend in (create_backend("ort", num_classes=10, threads=1, artifacts=folder),
                    create_backend("torch", model=spec, threads=1)):
        backend.set_weights(weights)
        randomness = SeededRandom(11)
        mech = CCDPMechanism(clipping_norms={Cat.CR: 0.2, Cat.LC: 0.5}, noise_std=0.4,
                             expected_batch_size=0.5 * n, noise=randomness)
        rates = np.where(site.categories == Cat.CR.rank, 0.25, 0.5)  # individualized rates, as "sample" runs
        for _ in range(2):  # the second step starts from the first one's (noisy) weights
            sizes.append(local_step(backend=backend, dataset=site, inclusion_rates=rates,
                                    mechanism=mech, randomness=randomness, learning_rate=0.3))
        after.append(flatten(backend.get_weights(), backend.parameter_layout))
    assert sizes[:2] == sizes[2:] and min(sizes) > 0
    moved = np.abs(after[1] - flatten(weights, create_backend("torch", model=spec).parameter_layout)).max()
    assert moved > 1e-3
    np.testing.assert_allclose(after[0], after[1], rtol=0, atol=1e-5)


@needs_ort
def test_ort_refuses_artifacts_of_another_model(head_artifacts) -> None:
    _, _, _, folder = head_artifacts["small"]
    with pytest.raises(ConfigError, match="unknown model kind 'camera_cnn'"):  # the retired CNN
        create_backend("ort", model="camera_cnn", num_classes=5, artifacts=folder)
    with pytest.raises(ConfigError, match="model"):
        create_backend("ort", model=model_spec("head", 5, adapter_width=7), artifacts=folder)
    with pytest.raises(ConfigError, match="model"):
        create_backend("ort", model=model_spec("head", 5, adapter_width=13, embedding_dim=20), artifacts=folder)
    ok = create_backend("ort", model=SMALL, artifacts=folder)
    with pytest.raises(ValueError, match="embeddings"):
        ok.per_example(np.zeros((2, 28, 28), np.uint8), np.zeros(2, np.int64))


@needs_torch
@needs_ort
def test_artifact_store_makes_and_reloads_head_sets(head_artifacts, tmp_path) -> None:
    from coordinator.artifacts import ArtifactStore

    spec, weights, files, _ = head_artifacts["small"]
    h = model_hash(weights)
    made = ArtifactStore(tmp_path).get(h, weights, 5)
    assert set(made) == set(files) and made["manifest.json"] == files["manifest.json"]
    again = ArtifactStore(tmp_path).get(h, {}, 5)  # from disk (weights not needed), factor graphs included
    assert again == made
    assert ArtifactStore(tmp_path).get(h, {}, None, model=spec) == made
    with pytest.raises(ValueError, match="disagrees"):
        ArtifactStore(tmp_path / "other").get(h, weights, 6)


@needs_ort
@pytest.mark.parametrize("torch_installed", [True, False], ids=["torch-installed", "torch-absent"])
def test_head_model_trains_on_a_gateway_without_torch(head_artifacts, tmp_path, torch_installed) -> None:
    """A fresh process loads the head model's artifacts and runs DP steps and predictions without importing torch."""
    spec, weights, files, folder = head_artifacts["small"]
    code = textwrap.dedent(f"""
        import sys
        if not {torch_installed!r}:
            class NoTorch:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch" or name.startswith("torch."):
                        raise ModuleNotFoundError("No module named 'torch'", name=name)
            sys.meta_path.insert(0, NoTorch())
        import numpy as np
        from shared.iucn import IUCNCategory as Cat
        from edge_sdk.backends.base import create_backend
        from edge_sdk.privacy.ccdp import CCDPMechanism
        from edge_sdk.privacy.randomness import SecureRandom
        backend = create_backend("ort", num_classes=5, threads=1, artifacts={str(folder)!r})
        rng = np.random.default_rng(0)
        x = rng.uniform(0, 6, (16, 20)).astype(np.float32)
        y = rng.integers(0, 5, 16)
        mech = CCDPMechanism(clipping_norms={{Cat.NT: 1.0}}, noise_std=1.0, expected_batch_size=16.0,
                             noise=SecureRandom())
        before = backend.get_weights()
        backend.apply_gradient(mech.privatize(backend.per_example(x, y), np.full(16, Cat.NT.rank)), 0.1)
        assert any(np.abs(backend.get_weights()[k] - before[k]).max() > 0 for k in before)
        assert backend.predict(x).shape == (16,)
        print("torch imported:", "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("torch imported: False"), out.stdout + out.stderr
