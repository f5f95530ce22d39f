"""Models by digest (``transfer.models_by_digest``): each round's model, and each NIRA cluster's model, is published
once, retained on ``models/<digest>``, whatever the number of sites; the tasks name it and carry no weights; real
gateways (EdgeAgents on the in-process bus) train on the digest's model, and a gateway that holds it downloads
nothing; old digests are cleared."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shared.codec import model_hash
from shared.envelope import BROADCAST_SITE_ID, Envelope, MessageKind, verify
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import TrainingTask, decode_task, encode_task
from shared.releases import decode_release
from shared.topics import PREFIX, digest_chunk_topic, digest_filter, digest_topic, task_topic
from shared.transfer import is_chunk

from edge_sdk.agent import EdgeAgent

from coordinator.cli import app as cli_app
from coordinator.config import save_config
from coordinator.model_digests import STATE_KEY
from coordinator.registry import EnrolmentError
from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config
from tests.coordinator.test_model_release import META, Bridge, _run_agents, _stop
from tests.coordinator.test_nira import SPECIES, head_model
from tests.support import camera_site, wait_for

H = "ab" * 32


def _digest_manifests(bus: InMemoryTransport) -> Counter:
    """How many times each digest topic itself (the envelope or its manifest) was published with content."""
    prefix = f"{PREFIX}/testfed/models/"
    return Counter(t[len(prefix):] for t, p in bus.published if t.startswith(prefix) and "/" not in t[len(prefix):]
                   and p)


def _tasks(bus: InMemoryTransport) -> list[tuple[TrainingTask, dict]]:
    """Every whole TASK published (small enough not to be chunked), decoded."""
    out = []
    for t, p in bus.published:
        if t.endswith("/task") and not is_chunk(p) and Envelope.from_bytes(p).header.kind == MessageKind.TASK:
            out.append(decode_task(Envelope.from_bytes(p).payload))
    return out


# ---- wire units -----------------------------------------------------------------------------------------------------
def test_a_task_by_digest_round_trips_without_weights_and_refuses_weights_or_another_digest() -> None:
    task = TrainingTask(federation_id="f", round=2, model_hash=H, local_steps=1, expected_batch_size=2,
                        learning_rate=0.1, clipping_norm=1.0, target_delta=1e-5, planned_rounds=3,
                        budgets={IUCNCategory.LC: 1.0}, model_digest=H)
    assert task.to_json()["model_digest"] == H
    decoded, weights = decode_task(encode_task(task, {}))
    assert decoded == task and weights == {}
    with pytest.raises(PayloadError, match="no weights"):
        encode_task(task, {"w": np.zeros(2, np.float32)})
    with pytest.raises(PayloadError, match="model_digest"):
        TrainingTask(**{**task.__dict__, "model_digest": "cd" * 32})
    plain = TrainingTask(**{**task.__dict__, "model_digest": None})
    assert "model_digest" not in plain.to_json()  # older readers still read tasks that carry their weights


def test_digest_topics_and_the_reserved_broadcast_site() -> None:
    assert digest_topic("f", H) == f"wildfed/v1/f/models/{H}"
    assert digest_chunk_topic("f", H, 3) == f"wildfed/v1/f/models/{H}/3"
    assert digest_filter("f", H) == f"wildfed/v1/f/models/{H}/#"
    for bad in ("AB" * 32, "ab" * 31, "+", "#"):
        with pytest.raises(Exception, match="64 lowercase hex"):
            digest_topic("f", bad)


def test_no_site_can_be_enrolled_under_the_broadcast_id(tmp_path: Path) -> None:
    coord = Coordinator(make_config(tmp_path), transport=InMemoryTransport(), signing_key=generate_signing_key())
    with pytest.raises(EnrolmentError, match="reserved"):
        coord.enrol(BROADCAST_SITE_ID, public_key_to_pem(generate_signing_key().public_key()), {"capacity": 1})
    coord.close()


# ---- real gateways, FedAvg ------------------------------------------------------------------------------------------
def test_each_round_publishes_its_model_once_and_gateways_train_on_it(tmp_path: Path) -> None:
    key = generate_signing_key()
    bus = InMemoryTransport()
    sites = ["g1", "g2", "g3"]
    config = make_config(tmp_path, rounds=3, round_deadline_s=60.0, local_steps=2, expected_batch_size=2,
                         num_classes=2, ship_ort_artifacts=False, adapter_width=16,
                         transfer={"chunk_size_bytes": 16 * 1024, "models_by_digest": True,
                                   "model_retention_rounds": 1})
    coord = Coordinator(config, transport=bus, signing_key=key)
    for sid in sites:
        site_key = camera_site(tmp_path / sid, sid, key)
        coord.enrol(sid, public_key_to_pem(site_key.public_key()), META)
    agents = [EdgeAgent.from_config(tmp_path / sid / "site.yaml", transport=Bridge(bus)) for sid in sites]
    threads = _run_agents(agents)
    try:
        results = coord.run()
        assert [r.status for r in results] == ["closed"] * 3
        for agent in agents:
            wait_for(lambda a=agent: a.stats["tasks_trained"] == 3, 30, f"{agent.config.site_id} trains 3 rounds")
    finally:
        _stop(agents, threads)
    tasks = _tasks(bus)
    assert len(tasks) == 9 and all(w == {} and t.model_digest == t.model_hash for t, w in tasks)
    base = {r: {t.model_hash for t, _ in tasks if t.round == r} for r in (1, 2, 3)}
    assert all(len(h) == 1 for h in base.values())  # FedAvg: one model per round
    # each round's model published exactly once, chunked (manifest on the topic, chunks below), whatever the sites
    published = _digest_manifests(bus)
    assert published == Counter({next(iter(base[r])): 1 for r in (1, 2, 3)})
    assert coord.rounds._tasks.digests.published_now == [next(iter(base[r])) for r in (1, 2, 3)]
    # round 1's model was downloaded by every gateway; rounds 2 and 3 train from the model released after the
    # round before, which each gateway cached: nothing downloaded
    for agent in agents:
        assert agent.stats["models_by_digest_downloaded"] == 1, agent.stats
        assert agent.stats["models_by_digest_held"] == 2, agent.stats
    r3 = next(iter(base[3]))
    env = Envelope.from_bytes(bus.retained[digest_topic("testfed", r3)])
    assert (env.header.kind, env.header.site_id) == (MessageKind.MANIFEST, BROADCAST_SITE_ID)
    # retention 1: only round 3's model is still retained; older digests' topics and chunk topics are cleared
    left = {t.split("/")[4] for t in bus.retained if "/models/" in t}
    assert left == {r3}
    assert set(coord.store.get_state(STATE_KEY)) == {r3}
    # the operator sees what is retained by digest
    out = CliRunner().invoke(cli_app, ["status", "--config", str(save_config(config, tmp_path / "c.yaml"))],
                             env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    final = coord.rounds.current_model()[0]  # round 3's result: no task names it yet
    assert final != r3
    assert (f"models by digest: 1 retained on the broker, the newest {r3[:12]} (the model round 3's tasks trained "
            f"from); the current model {final[:12]} went to the gateways as a release, and is published by digest "
            "only when a round's tasks train from it"
            in " ".join(out.output.split())), out.output
    coord.close()


# ---- NIRA: each cluster's model once -------------------------------------------------------------------------------
class DigestSite(FakeSite):
    """A FakeSite that reads a task's model from its retained digest topic (checked as a gateway checks it)."""

    def _on_task(self, topic: str, raw: bytes) -> None:
        env = Envelope.from_bytes(raw)
        task, weights = decode_task(env.payload)
        assert weights == {} and task.model_digest is not None
        model = Envelope.from_bytes(self.transport.retained[digest_topic(self.fed, task.model_digest)])
        verify(model, self.coordinator_public_key)
        assert model.header.site_id == BROADCAST_SITE_ID
        _, weights = decode_release(model.payload)
        assert model_hash(weights) == task.model_digest
        super()._on_task(topic, raw)  # a task carrying no weights: the fake answers from the weights of the digest

    def attach(self) -> "DigestSite":
        super().attach()
        return self


def test_nira_publishes_each_clusters_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transport, key = InMemoryTransport(), generate_signing_key()
    cfg = make_config(tmp_path, rounds=2, species=SPECIES, ship_ort_artifacts=False, num_classes=3,
                      strategy={"kind": "nira", "distance_threshold": 0.5, "embedding_merging": True},
                      transfer={"models_by_digest": True})
    coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=head_model())
    seen: dict[str, dict] = {}
    import tests.coordinator.helpers as helpers

    real = helpers.decode_task

    def decode_with_digest(payload):  # noqa: ANN001, ANN202 - the fake's decode, given the digest's weights
        task, weights = real(payload)
        if task.model_digest is not None:
            _, weights = decode_release(Envelope.from_bytes(transport.retained[digest_topic("testfed",
                                                                                            task.model_digest)]).payload)
            seen[task.model_digest] = weights
        return task, weights

    monkeypatch.setattr(helpers, "decode_task", decode_with_digest)
    specs = [("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]), ("c", 2.0, 20, ["C"]), ("d", 3.0, 20, ["C"])]
    for sid, value, n, species in specs:
        site = DigestSite(sid, transport, key.public_key(), value=value, num_examples=n,
                          events={IUCNCategory.LC: EVENT}).attach()
        coord.enrol(sid, site.public_pem, {"capacity": n, "species": species})
    assert coord.run_round().status == "closed"
    assert coord.run_round().status == "closed"  # round 2: two clusters {a, b} and {c, d}, two models
    r2 = [t for t, _ in _tasks(transport) if t.round == 2]
    assert len(r2) == 4 and len({t.model_digest for t in r2}) == 2
    published = _digest_manifests(transport)
    assert all(published[t.model_digest] == 1 for t in r2)  # each cluster's model once, not once per site
    assert sum(published.values()) == len(coord.rounds._tasks.digests.published_now) == 3  # round 1: one model
    for digest, weights in seen.items():
        assert model_hash(weights) == digest
    coord.close()
