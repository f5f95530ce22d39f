"""A gateway's side of model releases (edge_sdk/rounds/releases.py): what it keeps, what it refuses.

A fake coordinator signs MODEL envelopes as the real one does (shared.releases); the agent is real, on the in-memory
broker (which keeps retained messages). Refused: a model signed by another key, altered in transit, addressed to
another site, whose weights do not hash to the signed model hash, or older than the model kept (a replay of an
earlier release, or a release of a round before the task the gateway trained); the same model twice changes
nothing. Chunks that arrive before their manifest (retained messages come in no fixed order) are kept until it does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind, seal
from shared.keys import generate_signing_key
from shared.releases import ModelRelease, encode_release
from shared.topics import model_chunk_topic, model_topic
from shared.transfer import piece_size_for, seal_manifest, split

from edge_sdk.agent import EdgeAgent
from edge_sdk.config import global_model_path
from edge_sdk.global_model import KeptModel, kept_version
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from .test_agent import FED, SITE, make_site


def _weights(coordinator, shift: float) -> dict[str, np.ndarray]:
    return {k: (v + shift).astype(np.float32) for k, v in coordinator.weights.items()}


def _model(coordinator, round_: int, weights: dict[str, np.ndarray], *, key=None, site: str = SITE,
           hash_: str | None = None, offsets=None, piece_size: int | None = None) -> Envelope:
    h = hash_ or model_hash(weights)
    payload = encode_release(ModelRelease(federation_id=FED, round=round_, model_hash=h, prediction_offsets=offsets),
                             weights)
    return seal(private_key=key or coordinator.key, federation_id=FED, site_id=site, round=round_,
                base_model_hash=h, kind=MessageKind.MODEL, sequence=round_, payload=payload,
                **({"piece_size": piece_size} if piece_size else {}))


@pytest.fixture
def gateway(tmp_path: Path):
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    yield coordinator, agent
    agent.close()


def _kept(agent) -> tuple[str, int, str] | None:
    v = kept_version(global_model_path(agent.config))
    return None if v is None else (v.model_hash, v.round, v.source)


def test_a_release_is_kept_once_with_its_offsets_and_the_same_model_again_is_a_no_op(gateway) -> None:
    coordinator, agent = gateway
    w = _weights(coordinator, 0.1)
    offsets = tuple(0.25 * (-1) ** k for k in range(w["psi.bias"].shape[0]))
    env = _model(coordinator, 3, w, offsets=offsets)
    assert agent.releases.handle(env.to_bytes()) is True
    assert _kept(agent) == (model_hash(w), 3, "release")
    kept = KeptModel.load(global_model_path(agent.config), backbone_id=agent.config.backbone_id)
    np.testing.assert_allclose(kept.weights["psi.bias"], w["psi.bias"] - np.asarray(offsets, np.float32), atol=1e-7)
    mtime = global_model_path(agent.config).stat().st_mtime_ns
    assert agent.releases.handle(env.to_bytes()) is False  # a re-delivery
    assert agent.releases.handle(_model(coordinator, 4, w).to_bytes()) is False  # same model, later round
    assert agent.stats["models_kept"] == 1 and agent.stats["models_unchanged"] == 2
    assert global_model_path(agent.config).stat().st_mtime_ns == mtime


def test_forged_altered_misaddressed_and_mismatched_releases_are_refused(gateway) -> None:
    coordinator, agent = gateway
    w = _weights(coordinator, 0.2)
    forged = _model(coordinator, 2, w, key=generate_signing_key())
    altered = bytearray(_model(coordinator, 2, w).to_bytes())
    altered[-5] ^= 0x01
    other_site = _model(coordinator, 2, w, site="site-2")
    wrong_hash = _model(coordinator, 2, w, hash_=model_hash(_weights(coordinator, 0.3)))  # signed, lies about w
    task = coordinator.task(2)  # a TASK on the model topic
    for data in (forged.to_bytes(), bytes(altered), other_site.to_bytes(), wrong_hash.to_bytes(), task, b"junk"):
        assert agent.releases.handle(data) is False
    assert _kept(agent) is None
    assert agent.stats["rejected:bad_signature"] == 2 and agent.stats["rejected:wrong_site"] == 1
    assert agent.stats["rejected:model_hash"] == 1 and agent.stats["rejected:wrong_kind"] == 1
    assert agent.stats["rejected:malformed"] == 1


def test_an_older_release_never_replaces_a_newer_model(gateway) -> None:
    coordinator, agent = gateway
    old, new = _weights(coordinator, 0.1), _weights(coordinator, 0.2)
    replay = _model(coordinator, 3, old)
    assert agent.releases.handle(_model(coordinator, 5, new).to_bytes()) is True
    assert agent.releases.handle(replay.to_bytes()) is False
    assert _kept(agent) == (model_hash(new), 5, "release")
    assert agent.stats["rejected:stale_model"] == 1
    # the task of round 6 carries a newer model (made after round 5): kept; a release of round 5 is older than it
    assert agent.handle_task(coordinator.task(6)) is True
    assert _kept(agent) == (model_hash(coordinator.weights), 6, "task")
    assert agent.releases.handle(_model(coordinator, 5, _weights(coordinator, 0.4)).to_bytes()) is False
    assert agent.stats["rejected:stale_model"] == 2
    # ... and the release of round 6 (the model round 6 made) is newer than round 6's task
    final = _weights(coordinator, 0.5)
    assert agent.releases.handle(_model(coordinator, 6, final).to_bytes()) is True
    assert _kept(agent) == (model_hash(final), 6, "release")


def test_a_task_older_than_the_kept_release_trains_but_does_not_replace_it(gateway) -> None:
    coordinator, agent = gateway
    final = _weights(coordinator, 0.5)
    assert agent.releases.handle(_model(coordinator, 4, final).to_bytes()) is True
    assert agent.handle_task(coordinator.task(3)) is True  # trains (its round is new to the site) ...
    assert _kept(agent) == (model_hash(final), 4, "release")  # ... but the newer released model stays


def test_retained_chunks_before_their_manifest_are_kept_until_it_comes(tmp_path: Path) -> None:
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    w = _weights(coordinator, 0.1)
    env = _model(coordinator, 2, w, piece_size=piece_size_for(4096))
    manifest, chunks = split(env)
    assert len(chunks) > 3
    publisher = InMemoryTransport(broker)
    publisher.connect()
    stale = _model(coordinator, 1, _weights(coordinator, 0.7), piece_size=piece_size_for(4096))
    for chunk in split(stale)[1][:2]:  # leftovers of an earlier release on higher chunk topics
        publisher.publish(model_chunk_topic(FED, SITE, 50 + chunk.index), chunk.to_bytes(), retain=True)
    for chunk in reversed(chunks):  # all before the manifest, last first
        publisher.publish(model_chunk_topic(FED, SITE, chunk.index), chunk.to_bytes(), retain=True)
    publisher.publish(model_topic(FED, SITE),
                      seal_manifest(private_key=coordinator.key, manifest=manifest).to_bytes(), retain=True)
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    try:
        agent.start()  # subscribing delivers the retained messages (chunk topics first, as the dict holds them)
        assert agent.run(idle_timeout_s=0.2) == 0
        assert _kept(agent) == (model_hash(w), 2, "release")
        assert agent.stats["models_kept"] == 1
    finally:
        agent.close()
