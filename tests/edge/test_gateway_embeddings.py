"""The gateway pipeline: each record embedded once by the frozen backbone through the cache,
keyed by record and content; training reads the embeddings; a restarted gateway re-embeds nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from shared.keys import generate_signing_key, save_private_key, save_public_key
from shared.models.backbone import DEFAULT_INPUT_SIZE, preprocess_image

from edge_sdk.agent import EdgeAgent
from edge_sdk.data import embedding
from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from tests.gateway_backend import GATEWAY_BACKEND, model_weights, needs_torch, training_backend

from .conftest import SPECIES, write_package


def _site(tmp_path: Path) -> Path:
    key = generate_signing_key()
    save_private_key(key, tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "pkg",
              "species": [{"scientific_name": n, "class_index": c, "iucn_category": cat}
                          for n, (c, cat) in SPECIES.items()],
              "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
              "outbox": "state/outbox.sqlite", "threads": 1, "backend": GATEWAY_BACKEND}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "site.yaml"


@pytest.fixture
def counting(monkeypatch):
    """Counts the images the gateway's embedder is asked to embed (the real ONNX embedder underneath)."""
    calls: list[int] = []
    real_open = embedding.open_embedder

    def open_counted(input_size, *, backbone, threads=None, **options):
        inner = real_open(input_size, backbone=backbone, threads=threads, **options)

        class Counted:
            name, backbone_id = inner.name, inner.backbone_id

            def __init__(self):
                self.input_size = inner.input_size

            def embed_images(self, images):
                calls.append(len(images))
                return inner.embed_images(images)

        return Counted()

    monkeypatch.setattr(embedding, "open_embedder", open_counted)
    return calls


def test_agent_embeds_each_record_once_and_a_restart_reads_the_cache(tmp_path, counting) -> None:
    config = _site(tmp_path)
    broker = InMemoryBroker()
    first = EdgeAgent.from_config(config, transport=InMemoryTransport(broker))
    assert sum(counting) == 3  # 3 records (conftest: m1, m2, m4), each embedded once
    feats = first.dataset.features
    assert feats.dtype == np.float32 and feats.shape == (3, 1280)
    first.close()

    counting.clear()
    second = EdgeAgent.from_config(config, transport=InMemoryTransport(broker))
    assert counting == []  # nothing re-embedded
    np.testing.assert_array_equal(second.dataset.features, feats)
    second.close()


@needs_torch
def test_the_gateways_embeddings_are_the_torch_backbones(tmp_path) -> None:
    """What the agent trains on (``embed_dataset``, the exported graph on ONNX Runtime) against an independent
    reference: the torch backbone on each file, read as RGB, the whole image."""
    from edge_sdk.inference.embedder import TorchEmbedder

    write_package(tmp_path / "pkg")
    data = embedding.embed_dataset(load_camtrap_dp(tmp_path / "pkg", dict(SPECIES)), tmp_path / "cache")
    torch_embedder = TorchEmbedder(DEFAULT_INPUT_SIZE)
    ref = torch_embedder.embed(np.stack([preprocess_image(Image.open(f), DEFAULT_INPUT_SIZE) for f in data.files]))
    np.testing.assert_allclose(data.features, ref, atol=1e-4, rtol=1e-4)


def test_a_replaced_file_under_the_same_media_id_is_re_embedded(tmp_path, counting) -> None:
    config = _site(tmp_path)
    broker = InMemoryBroker()
    EdgeAgent.from_config(config, transport=InMemoryTransport(broker)).close()
    # m2 (media/m2.png) gets new pixels: its content hash, hence its cache key, changes
    Image.new("RGB", (40, 30), (10, 200, 10)).save(tmp_path / "pkg" / "media" / "m2.png")
    counting.clear()
    agent = EdgeAgent.from_config(config, transport=InMemoryTransport(broker))
    assert counting == [1]
    data = agent.dataset
    m2 = data.media_ids.index("m2")
    fresh = embedding.embed_pil(_onnx(), [Image.open(data.files[m2]).convert("RGB")])
    np.testing.assert_allclose(data.features[m2], fresh[0], atol=1e-5)
    agent.close()


def _onnx():
    from edge_sdk.inference.embedder import OnnxEmbedder

    return OnnxEmbedder.open(DEFAULT_INPUT_SIZE)


def test_record_key_names_record_and_content() -> None:
    from edge_sdk.data.crops import crop_record_id

    assert crop_record_id("m1", "ab" * 32, None) == "m1#" + "ab" * 8
    assert crop_record_id("m1", "ab" * 32, (1, 2, 30, 31)) == "m1#" + "ab" * 8 + "@1,2,30,31"
    with pytest.raises(ValueError, match="SHA-256"):
        crop_record_id("m1", "abc", None)


def test_training_reads_the_embeddings(tmp_path) -> None:
    """train_locally trains the head model on dataset.features (a dataset without them and an image-shaped
    input is refused by the model's input check)."""
    import dataclasses

    from shared.iucn import IUCNCategory as Cat
    from shared.protocol import TrainingTask

    from edge_sdk.privacy.randomness import SeededRandom
    from edge_sdk.training import train_locally

    write_package(tmp_path / "pkg")
    data = embedding.embed_dataset(load_camtrap_dp(tmp_path / "pkg", dict(SPECIES)), tmp_path / "cache")
    backend = training_backend("head-only", tmp_path / "artifacts")  # the head alone, K = 2, zero-initialised
    task = TrainingTask(federation_id="f", round=1, model_hash="0" * 64, privacy="none", local_steps=1,
                        expected_batch_size=3, learning_rate=1.0, clipping_norm=1.0, budgets={}, target_delta=1e-5,
                        planned_rounds=1)
    w0 = model_weights("head-only")
    out = train_locally(backend=backend, dataset=data, task=task, global_weights=w0,
                        site_categories=[Cat.CR, Cat.NT], randomness=SeededRandom(1))
    # q = 1: one full-batch step of lr 1 from a zero head: delta = -mean gradient, computed by hand
    x = data.features.astype(np.float64)
    onehot = np.eye(2)[data.labels]
    grad_w = ((np.full((3, 2), 0.5) - onehot).T @ x) / 3
    np.testing.assert_allclose(out.delta["psi.weight"], -grad_w, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        train_locally(backend=backend, dataset=dataclasses.replace(data, features=None), task=task,
                      global_weights=w0, site_categories=[Cat.CR, Cat.NT], randomness=SeededRandom(1))
