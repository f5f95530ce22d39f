"""ORT training artifacts at the coordinator: what a set holds, caching by model hash, and tasks that carry them
only when the config asks (the torch path unchanged otherwise)."""

from __future__ import annotations

import json

import pytest

from coordinator.artifacts import ARTIFACT_FILES, FACTOR_FILES, ArtifactStore, artifact_digests, ort_training_available

if not ort_training_available():
    pytest.skip("onnxruntime.training (with onnx) is not importable here: ORT artifact tests skipped",
                allow_module_level=True)

import onnx

from shared.codec import model_hash
from shared.envelope import Envelope
from shared.keys import generate_signing_key, public_key_to_pem
from shared.models.kinds import model_spec
from shared.models.onnx_export import MAX_IR_VERSION
from shared.protocol import decode_task, decode_task_with_artifacts

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import make_config


def test_artifact_set_contents_and_cache(tmp_path) -> None:
    weights = model_spec("head", 5, adapter_width=8).initial_weights(0, head_init="uniform")
    h = model_hash(weights)
    store = ArtifactStore(tmp_path / "arts")
    files = store.get(h, weights, 5)
    # the base set plus, for the head model (all Linear), the factored per-example graphs of both scopes
    assert set(files) == set(ARTIFACT_FILES) | set(FACTOR_FILES.values())
    assert store.get(h, weights, 5) is files  # memory cache
    for name in files:
        if name.endswith(".onnx"):
            assert onnx.load_from_string(files[name]).ir_version <= MAX_IR_VERSION, name
    manifest = json.loads(files["manifest.json"])
    assert manifest["num_classes"] == 5 and manifest["model_hash"] == h
    assert [n for n, _ in manifest["parameters"]] == list(weights)  # named_parameters() order
    again = ArtifactStore(tmp_path / "arts").get(h, {}, 5)  # disk cache: weights not needed
    assert again == files
    assert set(artifact_digests(files)) == set(files)


def published_task(transport: InMemoryTransport) -> bytes:
    """The last task published, reassembled when it went as a manifest and chunks (shared.transfer): a task with
    ONNX Runtime artifacts is larger than the 256 KiB chunk size."""
    from shared.transfer import Chunk, assemble, check_chunk, decode_manifest, is_chunk

    messages = [p for t, p in transport.published if t.endswith("/task")]
    if not is_chunk(messages[-1]):
        return messages[-1]
    start = max(i for i, p in enumerate(messages) if not is_chunk(p))
    manifest = decode_manifest(Envelope.from_bytes(messages[start]).payload)
    chunks = sorted((Chunk.from_bytes(p, max_data_bytes=manifest.chunk_size) for p in messages[start + 1:]),
                    key=lambda c: c.index)
    for c in chunks:
        check_chunk(manifest, c)  # each piece against its leaf in the signed manifest
    return assemble(manifest, [c.data for c in chunks]).to_bytes()


@pytest.mark.parametrize("ship", [True, False])
def test_tasks_carry_artifacts_only_when_configured(tmp_path, ship: bool) -> None:
    config = make_config(tmp_path, ship_ort_artifacts=ship)
    transport = InMemoryTransport()
    coordinator = Coordinator(config, transport=transport, signing_key=generate_signing_key())
    coordinator.start()
    h, weights = coordinator.rounds.current_model()
    coordinator.enrol("site-a", public_key_to_pem(generate_signing_key().public_key()))
    ctx = coordinator.rounds.open_round()
    assert ctx is not None
    payload = Envelope.from_bytes(published_task(transport)).payload
    task, got_weights, files = decode_task_with_artifacts(payload)
    assert model_hash(got_weights) == h == task.model_hash
    if ship:
        assert set(files) == set(ARTIFACT_FILES) | set(FACTOR_FILES.values())
        assert task.artifacts == artifact_digests(files)
        assert (config.data_dir / "ort-artifacts" / h / "checkpoint").is_file()
    else:
        assert files == {} and task.artifacts == {} and "artifacts" not in task.to_json()
    assert decode_task(payload)[0] == task
    coordinator.close()
