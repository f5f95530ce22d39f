"""ORT backend: per-example gradients, parity with the torch backend through the one CCDP mechanism, backend choice
in the agent, and a coordinator-made artifact round trip on a gateway without torch.

Skipped, with the reason, where ``onnxruntime.training`` does not import (e.g. aarch64: no wheel).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.backends.ort_backend import ArtifactCache, ort_training_importable

if not ort_training_importable():
    pytest.skip("onnxruntime.training is not importable here (pip install 'wildfed[edge-ort]' on x86_64); "
                "ORT backend tests skipped", allow_module_level=True)

from shared.codec import model_hash
from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat
from shared.models.kinds import model_spec
from shared.protocol import TrainingTask, decode_task_with_artifacts, encode_task

from edge_sdk.backends.base import create_backend, flatten
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.ccdp import CCDPMechanism
from edge_sdk.privacy.randomness import SecureRandom, SeededRandom
from edge_sdk.training import train_locally
from tests.gateway_backend import (NO_TORCH_REASON, TORCH_INSTALLED, artifact_digests, artifact_set, model_weights,
                                   needs_torch)
from tests.support import assert_norm_upper_bounds

K = 4
REPO_ROOT = Path(__file__).resolve().parents[2]


def initial_weights(num_classes: int, seed: int) -> dict[str, np.ndarray]:
    """The head model with a narrow tanh adapter (1280 -> 16 -> K), every layer non-zero, so that both layers'
    per-example gradients are exercised."""
    return model_spec("head", num_classes, adapter_width=16).initial_weights(seed, head_init="uniform")


SPEC = model_spec("head", K, adapter_width=16)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> tuple[dict[str, bytes], str, Path]:
    """The coordinator's artifact set of ``initial_weights(K, seed=3)`` (made with torch; where torch is absent, made
    beforehand by an interpreter that has it: tests.gateway_backend)."""
    weights = model_weights("ort-backend")
    assert model_hash(weights) == model_hash(initial_weights(K, seed=3))
    h = model_hash(weights)
    files = artifact_set("ort-backend")
    folder = ArtifactCache(tmp_path_factory.mktemp("cache")).store(h, files)
    return files, h, folder


@pytest.fixture(scope="module")
def ort_backend(artifacts):
    """An ORT backend on the artifacts, one thread."""
    return create_backend("ort", num_classes=K, threads=1, microbatch_size=5, artifacts=artifacts[2])


@pytest.fixture(scope="module")
def backends(ort_backend):
    """(ort, torch) backends on the same weights, one thread each (skipped where torch is absent)."""
    if not TORCH_INSTALLED:
        pytest.skip(NO_TORCH_REASON)
    return ort_backend, create_backend("torch", model=SPEC, threads=1)


def batch(rng: np.random.Generator, n: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """n backbone-embedding-like rows float32 (n, 1280) in [0, 6) (row 1 half zero, as ReLU6 features often are)."""
    x = (6 * rng.random((n, 1280))).astype(np.float32)
    x[1, :640] = 0
    return x, rng.integers(0, K, size=n).astype(np.int64)


def site_dataset(rng: np.random.Generator, n: int = 40) -> LocalDataset:
    x, y = batch(rng, n)
    cats = np.where(np.arange(n) % 3 == 0, Cat.CR.rank, Cat.NT.rank).astype(np.int8)
    return LocalDataset(images=np.zeros((n, 1, 1), np.uint8), features=x, labels=y, categories=cats,
                        media_ids=tuple(str(i) for i in range(n)))


def task(**overrides) -> TrainingTask:
    fields = dict(federation_id="f", round=1, model_hash="0" * 64, local_steps=3, expected_batch_size=8,
                  learning_rate=0.5, clipping_norm=0.05, target_delta=1e-5, planned_rounds=5, privacy="ccdp",
                  budgets={Cat.CR: 0.5, Cat.NT: 1.5})
    fields.update(overrides)
    return TrainingTask(**fields)


class NoNoise:
    """Seeded sampling, zero Gaussian noise: the clipped update alone (tests only)."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def random(self, size: int) -> np.ndarray:
        return self._rng.random(size)

    def standard_normal(self, size) -> np.ndarray:
        return np.zeros(size)


def test_per_example_gradients_match_torch_full_and_head(backends, artifacts, rng) -> None:
    ort, torch_backend = backends
    weights = initial_weights(K, seed=11)
    ort.set_weights(weights)
    torch_backend.set_weights(weights)
    x, y = batch(rng)
    expected = torch_backend.per_example_gradients(x, y)
    got = ort.per_example_gradients(x, y)  # micro-batches of 5: three graph runs
    assert [s.name for s in ort.parameter_layout] == [s.name for s in torch_backend.parameter_layout]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    # the norms the mechanism clips with: upper bounds (float32 sums raised by the summation bound), computed on
    # ORT's own float32 factors, which differ from torch's gradients in the last bits
    assert_norm_upper_bounds(ort.per_example(x, y).norms, np.linalg.norm(expected.astype(np.float64), axis=1),
                             below=1e-5)
    np.testing.assert_allclose(ort.gradient(x, y), torch_backend.gradient(x, y), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(ort.predict(x), torch_backend.predict(x))

    head = create_backend("ort", num_classes=K, threads=1, artifacts=artifacts[2], scope="head")
    head.set_weights(weights)
    assert [s.name for s in head.parameter_layout] == ["psi.weight", "psi.bias"]
    np.testing.assert_allclose(head.per_example_gradients(x, y), expected[:, -head.num_parameters:],
                               rtol=1e-4, atol=1e-6)
    head.apply_gradient(np.ones(head.num_parameters, np.float32), 0.1)
    after = head.get_weights()
    np.testing.assert_array_equal(after["phi.0.weight"], weights["phi.0.weight"])  # frozen
    np.testing.assert_allclose(after["psi.bias"], weights["psi.bias"] - 0.1, rtol=1e-6)


def test_sgd_step_and_bad_weights(ort_backend, rng) -> None:
    ort = ort_backend
    ort.set_weights(initial_weights(K, seed=5))
    before = flatten(ort.get_weights(), ort.parameter_layout)
    step = rng.standard_normal(ort.num_parameters).astype(np.float32)
    ort.apply_gradient(step, 0.25)
    np.testing.assert_allclose(flatten(ort.get_weights(), ort.parameter_layout), before - 0.25 * step,
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="unknown parameter"):
        ort.set_weights({**ort.get_weights(), "extra": np.zeros(1, np.float32)})
    with pytest.raises(ConfigError, match="shape"):
        ort.set_weights({**ort.get_weights(), "psi.bias": np.zeros(3, np.float32)})
    with pytest.raises(ConfigError, match="no artifacts"):
        create_backend("ort", num_classes=K).per_example_gradients(*batch(rng))
    with pytest.raises(ConfigError, match="classes"):
        create_backend("ort", num_classes=K + 1).load_artifacts(ort.artifacts_folder)


def test_clipped_update_parity_without_noise(backends, rng) -> None:
    """Same seed, same batches, noise off: the CCDP updates of both backends agree within 1e-5."""
    ort, torch_backend = backends
    data, weights = site_dataset(rng), initial_weights(K, seed=7)
    results = [train_locally(backend=b, dataset=data, task=task(), global_weights=weights,
                             site_categories=(Cat.CR, Cat.NT), randomness=NoNoise(seed=42))
               for b in (ort, torch_backend)]
    assert results[0].report == results[1].report
    for name, value in results[1].delta.items():
        assert np.abs(value).max() > 0
        np.testing.assert_allclose(results[0].delta[name], value, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.filterwarnings("ignore::edge_sdk.privacy.randomness.InsecureRandomnessWarning")
def test_noisy_update_parity_and_noise_statistics(backends, rng) -> None:
    ort, torch_backend = backends
    data, weights = site_dataset(rng), initial_weights(K, seed=8)
    # Same seeded source: same batches and the same noise draws, so the same update.
    results = [train_locally(backend=b, dataset=data, task=task(), global_weights=weights,
                             site_categories=(Cat.CR, Cat.NT), randomness=SeededRandom(7))
               for b in (ort, torch_backend)]
    for name, value in results[1].delta.items():
        np.testing.assert_allclose(results[0].delta[name], value, rtol=0, atol=1e-5, err_msg=name)
    # Secure noise: the privatised gradient minus the noiseless one has per-coordinate std sigma / (q N).
    x, y = batch(rng, 16)
    cats = np.full(16, Cat.NT.rank)
    norms = {Cat.CR: 0.02, Cat.NT: 0.05}
    for b in (ort, torch_backend):
        b.set_weights(weights)
        grads = b.per_example(x, y)
        clean = CCDPMechanism(clipping_norms=norms, noise_std=0.05 * 1.3, expected_batch_size=16.0,
                              noise=NoNoise(0)).privatize(grads, cats)
        noisy = CCDPMechanism(clipping_norms=norms, noise_std=0.05 * 1.3, expected_batch_size=16.0,
                              noise=SecureRandom()).privatize(grads, cats)
        expected_std = 0.05 * 1.3 / 16.0
        diff = (noisy - clean).astype(np.float64)
        assert abs(diff.mean()) < 5 * expected_std / np.sqrt(diff.size)
        assert diff.std() == pytest.approx(expected_std, rel=0.03)  # d = 20,564 coordinates: ~0.5% sampling error


def test_task_payload_carries_verified_artifacts(artifacts) -> None:
    files, h, _ = artifacts
    weights = initial_weights(K, seed=3)
    t = task(model_hash=h, artifacts=artifact_digests(files))
    decoded, got_weights, got_files = decode_task_with_artifacts(encode_task(t, weights, files))
    assert decoded == t and got_files == files and model_hash(got_weights) == h
    old_style = task(model_hash=h)
    assert "artifacts" not in old_style.to_json()  # tasks without artifacts read as before


@pytest.mark.parametrize("torch_installed", [True, False], ids=["torch-installed", "torch-absent"])
def test_artifacts_train_on_a_gateway_without_torch(artifacts, tmp_path, torch_installed) -> None:
    """Coordinator-made artifacts in a task payload; a fresh process decodes them, caches them by model hash and
    trains CCDP steps with the ORT backend without importing torch (where torch is installed: it stays unimported;
    "absent" makes ``import torch`` fail, as on an x86 gateway installed with ``wildfed[edge-ort]``)."""
    files, h, _ = artifacts
    weights = initial_weights(K, seed=3)
    payload = encode_task(task(model_hash=h, artifacts=artifact_digests(files)), weights, files)
    (tmp_path / "task.bin").write_bytes(payload)
    code = textwrap.dedent(f"""
        import sys
        if not {torch_installed!r}:  # make torch unfindable, as if it were not installed
            class NoTorch:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch" or name.startswith("torch."):
                        raise ModuleNotFoundError("No module named 'torch'", name=name)
            sys.meta_path.insert(0, NoTorch())
        from pathlib import Path
        import numpy as np
        from shared.codec import model_hash
        from shared.iucn import IUCNCategory as Cat
        from shared.protocol import decode_task_with_artifacts, encode_update
        from edge_sdk.backends.base import create_backend
        from edge_sdk.backends.ort_backend import ArtifactCache
        from edge_sdk.data.camtrap_dp import LocalDataset
        from edge_sdk.privacy.randomness import SecureRandom
        from edge_sdk.training import train_locally

        task, weights, files = decode_task_with_artifacts(Path({str(tmp_path / "task.bin")!r}).read_bytes())
        assert model_hash(weights) == task.model_hash
        folder = ArtifactCache(Path({str(tmp_path / "cache")!r})).store(task.model_hash, files)
        backend = create_backend("ort", num_classes={K}, threads=1, artifacts=folder)
        rng = np.random.default_rng(0)
        n = 30
        data = LocalDataset(images=np.zeros((n, 1, 1), np.uint8),
                            features=(6 * rng.random((n, 1280))).astype(np.float32), labels=rng.integers(0, {K}, n).astype(np.int64),
                            categories=np.where(np.arange(n) % 2 == 0, 1, 4).astype(np.int8),
                            media_ids=tuple(map(str, range(n))))
        result = train_locally(backend=backend, dataset=data, task=task, global_weights=weights,
                               site_categories=(Cat.CR, Cat.NT), randomness=SecureRandom())
        assert all(np.isfinite(v).all() for v in result.delta.values())
        assert any(np.abs(v).max() > 0 for v in result.delta.values())
        encode_update(result.report, result.delta)
        assert backend.predict(data.features).shape == (n,)
        print("torch imported:", "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("torch imported: False"), out.stdout + out.stderr


@needs_torch  # auto falls back to torch for a model version without artifacts
def test_agent_backend_auto_picks_ort_only_with_artifacts(tmp_path) -> None:
    """``backend: auto``: ORT for a task that carries artifacts (cached by model hash, so the next task of that
    model version uses them too), torch for a model version without any; ``backend: ort`` refuses such a task."""
    import yaml

    from coordinator.artifacts import build_artifacts

    from shared.envelope import MessageKind, seal

    from edge_sdk.agent import EdgeAgent
    from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

    from .test_agent import FED, SITE, make_site

    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    config = yaml.safe_load((tmp_path / "site.yaml").read_text())
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**config, "backend": "auto"}))
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    agent.start()
    weights = coordinator.weights
    h = model_hash(weights)
    files = build_artifacts(weights, 2, model_hash=h)
    t = TrainingTask(federation_id=FED, round=1, model_hash=h, local_steps=2, expected_batch_size=2,
                     learning_rate=0.1, clipping_norm=1.0, target_delta=1e-5, planned_rounds=5,
                     budgets={Cat.CR: 0.5, Cat.NT: 1.5}, artifacts=artifact_digests(files), capacity=3)
    coordinator.send(seal(private_key=coordinator.key, federation_id=FED, site_id=SITE, round=1, base_model_hash=h,
                          kind=MessageKind.TASK, sequence=1, payload=encode_task(t, weights, files)).to_bytes())
    assert agent.run(max_rounds=1, idle_timeout_s=20) == 1
    assert agent.backend.name == "ort" and agent.artifact_cache.path(h) is not None

    coordinator.send(coordinator.task(2))  # same model version, no artifacts in the task: the cache has them
    assert agent.run(max_rounds=1, idle_timeout_s=20) == 1
    assert agent.backend.name == "ort"

    coordinator.weights = initial_weights(num_classes=2, seed=1)  # a version without artifacts: torch
    coordinator.send(coordinator.task(3))
    assert agent.run(max_rounds=1, idle_timeout_s=20) == 1
    assert agent.backend.name == "torch" and len(coordinator.updates) == 3
    agent.close()

    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**config, "backend": "ort"}))
    strict = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    strict.start()
    coordinator.weights = initial_weights(num_classes=2, seed=2)
    coordinator.send(coordinator.task(4))
    assert strict.run(max_rounds=1, idle_timeout_s=2) == 0
    assert strict.stats["rejected:ort_artifacts_missing"] == 1
    strict.close()
