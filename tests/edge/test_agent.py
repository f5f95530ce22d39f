"""The agent end to end over the in-memory transport, with a fake coordinator that signs tasks and acks.

The site trains with torch where it is installed, else with ONNX Runtime on the artifacts its tasks carry
(``tests.gateway_backend``: the Python 3.10 gateway run)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind, seal, verify
from shared.iucn import IUCNCategory as Cat
from shared.keys import generate_signing_key, save_private_key, save_public_key
from shared.protocol import Ack, TrainingTask, decode_update, encode_ack, encode_task
from shared.topics import ack_topic, parse_topic, task_topic, updates_filter

from edge_sdk.agent import EdgeAgent
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport, Transport
from tests.gateway_backend import GATEWAY_BACKEND, artifact_digests, artifact_set, model_weights

from .conftest import write_package

FED, SITE = "fed1", "site-1"


class FakeCoordinator:
    """Signs tasks, verifies updates with the enrolled site key, acks them."""

    def __init__(self, transport: Transport, site_public_key, *, ack: bool = True,
                 ack_in_thread: bool = False) -> None:
        self.key = generate_signing_key()
        self.site_public_key = site_public_key
        self.transport = transport
        self.ack_in_thread = ack_in_thread  # a real broker's callbacks must not block paho's network thread
        self.transport.subscribe(updates_filter(FED), self._on_update)
        self.transport.connect()
        self.updates: list[Envelope] = []
        self.receipts: list[Envelope] = []  # what sites ask for after connecting (shared.transfer receipts)
        self.ack = ack
        # the head model on backbone embeddings, a narrower adapter than the gateway's default: the agent builds
        # its backend for the task's architecture
        self.weights = model_weights("agent")
        # a site without torch trains with ONNX Runtime: tasks of this model version carry its ORT training
        # artifacts, as the real coordinator's do (tests/gateway_backend.py); {model hash: files}
        self.artifacts = {model_hash(self.weights): artifact_set("agent")} if GATEWAY_BACKEND == "ort" else {}

    def _on_update(self, topic: str, payload: bytes) -> None:
        envelope = Envelope.from_bytes(payload)
        verify(envelope, self.site_public_key)
        if envelope.header.kind == MessageKind.RECEIPT:
            self.receipts.append(envelope)
            return
        self.updates.append(envelope)
        if self.ack:
            _, site, _ = parse_topic(topic)
            data = self.sealed_ack(envelope.header.round, site, sequence=envelope.header.sequence).to_bytes()
            if self.ack_in_thread:
                threading.Thread(target=self.transport.publish, args=(ack_topic(FED, site), data)).start()
            else:
                self.transport.publish(ack_topic(FED, site), data)

    def sealed_ack(self, round_: int, site: str = SITE, *, sequence: int) -> Envelope:
        """A signed ACK of the update with this sequence (as the real coordinator's: the ACK echoes it)."""
        return seal(private_key=self.key, federation_id=FED, site_id=site, round=round_, base_model_hash="0" * 64,
                    kind=MessageKind.ACK, sequence=sequence, payload=encode_ack(Ack(round=round_, accepted=True)))

    def task(self, round_: int, *, site: str = SITE, key=None, **overrides) -> bytes:
        h = model_hash(self.weights)
        fields = dict(federation_id=FED, round=round_, model_hash=h, local_steps=2, expected_batch_size=2,
                      learning_rate=0.1, clipping_norm=1.0, target_delta=1e-5, planned_rounds=5, privacy="ccdp",
                      budgets={Cat.CR: 0.5, Cat.NT: 1.5}, capacity=3)  # the site's declared capacity
        files = self.artifacts.get(h, {})
        if files:
            fields["artifacts"] = artifact_digests(files)
        fields.update(overrides)
        return seal(private_key=key or self.key, federation_id=FED, site_id=site, round=round_, base_model_hash=h,
                    kind=MessageKind.TASK, sequence=round_,
                    payload=encode_task(TrainingTask(**fields), self.weights, files)).to_bytes()

    def send(self, data: bytes, site: str = SITE) -> None:
        self.transport.publish(task_topic(FED, site), data)


def make_site(tmp_path: Path, coordinator_transport: Transport, *, ack_in_thread: bool = False):
    """Keys, a Camtrap DP package and a site.yaml in tmp_path; returns the fake coordinator."""
    site_key = generate_signing_key()
    coordinator = FakeCoordinator(coordinator_transport, site_key.public_key(), ack_in_thread=ack_in_thread)
    save_private_key(site_key, tmp_path / "keys" / "site.key")
    save_public_key(coordinator.key.public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    config = {
        "federation_id": FED, "site_id": SITE, "dataset": "pkg",
        "species": [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
                    {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}],
        "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
        "outbox": "state/outbox.sqlite", "threads": 1, "backend": GATEWAY_BACKEND,
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    return coordinator


@pytest.fixture
def world(tmp_path: Path):
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))

    def make_agent() -> tuple[EdgeAgent, InMemoryTransport]:
        transport = InMemoryTransport(broker)
        return EdgeAgent.from_config(tmp_path / "site.yaml", transport=transport), transport

    return coordinator, make_agent


def test_round_trip_task_update_ack(world) -> None:
    coordinator, make_agent = world
    agent, _ = make_agent()
    agent.start()
    coordinator.send(coordinator.task(1))
    assert agent.run(max_rounds=1, idle_timeout_s=10) == 1

    assert len(coordinator.updates) == 1
    header = coordinator.updates[0].header
    assert (header.kind, header.site_id, header.round) == (MessageKind.UPDATE, SITE, 1)
    assert header.base_model_hash == model_hash(coordinator.weights)
    report, delta = decode_update(coordinator.updates[0].payload)
    # 3 records (1 CR, 2 NT), B = 2: q = 2/3; both site categories are active and reported. CCDP "sample": NT
    # (the larger budget) at q, CR at a lower rate, one noise multiplier.
    assert report.num_examples == 3 and report.local_steps == 2
    assert set(report.events) == {Cat.CR, Cat.NT}
    assert all(event.steps == 2 for event in report.events.values())
    assert report.events[Cat.NT].sampling_rate == pytest.approx(2 / 3)
    assert 0 < report.events[Cat.CR].sampling_rate < 2 / 3
    assert report.events[Cat.CR].noise_multiplier == report.events[Cat.NT].noise_multiplier
    assert {k: v.shape for k, v in delta.items()} == {k: v.shape for k, v in coordinator.weights.items()}
    assert all(np.all(np.isfinite(v)) for v in delta.values()) and any(np.any(v != 0) for v in delta.values())
    assert agent.outbox.pending() == []  # acked -> removed
    assert agent.stats["acks_accepted"] == 1
    agent.close()


def test_the_gateway_keeps_the_newest_accepted_global_model_for_detect(world) -> None:
    from safetensors import safe_open

    from edge_sdk.config import global_model_path

    coordinator, make_agent = world
    agent, _ = make_agent()
    path = global_model_path(agent.config)
    assert not path.exists()
    assert agent.handle_task(coordinator.task(1, site="site-2")) is False  # refused: nothing kept
    assert not path.exists()
    task = coordinator.task(1)
    assert agent.handle_task(task) is True
    with safe_open(str(path), framework="numpy") as fh:
        # the site's backbone (defaults: Lite0 at 128 px) is recorded, so detect can refuse the head on another;
        # source and signing time order it against a model the coordinator releases (edge_sdk.global_model)
        assert fh.metadata() == {"round": "1", "model_hash": model_hash(coordinator.weights),
                                 "backbone_id": "efficientnet-lite0@579344248a93e230/p1/128px", "source": "task",
                                 "timestamp": str(Envelope.from_bytes(task).header.timestamp)}
        kept = {k: fh.get_tensor(k) for k in fh.keys()}
    assert set(kept) == set(coordinator.weights)
    for name, value in coordinator.weights.items():
        np.testing.assert_array_equal(kept[name], value)
    agent.close()


def test_the_model_kept_for_detect_carries_the_tasks_logit_adjustment(world) -> None:
    import json

    from safetensors import safe_open

    from edge_sdk.config import global_model_path

    coordinator, make_agent = world
    agent, _ = make_agent()
    path = global_model_path(agent.config)
    classes = coordinator.weights["psi.bias"].shape[0]
    # offsets that do not fit the head: the round still trains, but no model is kept for detect
    assert agent.handle_task(coordinator.task(1, prediction_offsets=[0.1] * (classes + 1))) is True
    assert not path.exists()
    offsets = [0.5 * (-1) ** k for k in range(classes)]
    assert agent.handle_task(coordinator.task(2, prediction_offsets=offsets)) is True
    with safe_open(str(path), framework="numpy") as fh:
        meta = fh.metadata()
        kept = {k: fh.get_tensor(k) for k in fh.keys()}
    assert meta["model_hash"] == model_hash(coordinator.weights) and json.loads(meta["prediction_offsets"]) == offsets
    np.testing.assert_allclose(kept["psi.bias"], coordinator.weights["psi.bias"] - np.asarray(offsets), atol=1e-7)
    for name in set(coordinator.weights) - {"psi.bias"}:
        np.testing.assert_array_equal(kept[name], coordinator.weights[name])
    agent.close()


def test_rejects_forged_misaddressed_duplicate_and_non_private_tasks(world) -> None:
    coordinator, make_agent = world
    agent, _ = make_agent()
    forged = coordinator.task(1, key=generate_signing_key())
    tampered = bytearray(coordinator.task(1))
    tampered[-10] ^= 0xFF
    assert agent.handle_task(forged) is False
    assert agent.handle_task(bytes(tampered)) is False
    assert agent.handle_task(coordinator.task(1, site="site-2")) is False
    assert agent.handle_task(b"garbage") is False
    assert agent.handle_task(coordinator.task(1, privacy="none", budgets={})) is False
    assert agent.stats["rejected:bad_signature"] == 2 and agent.stats["rejected:wrong_site"] == 1
    assert agent.stats["rejected:malformed"] == 1 and agent.stats["rejected:non_private_refused"] == 1
    assert agent.handle_task(coordinator.task(1)) is True
    assert agent.handle_task(coordinator.task(1)) is False  # duplicate
    assert agent.stats["rejected:stale_round"] == 1
    agent.close()
    # A restarted agent remembers the round durably and never trains twice for it.
    again, _ = make_agent()
    assert again.handle_task(coordinator.task(1)) is False and again.stats["rejected:stale_round"] == 1
    again.close()


def test_update_waits_in_outbox_during_outage_and_is_resent(world) -> None:
    coordinator, make_agent = world
    agent, transport = make_agent()
    agent.start()
    coordinator.send(coordinator.task(3))
    transport.go_offline()
    assert agent.run(max_rounds=1, idle_timeout_s=0.3) == 1
    assert [m.message_id for m in agent.outbox.pending()] == ["update/3"] and coordinator.updates == []
    transport.go_online()  # reconnect -> the agent resends what is pending
    agent.run(max_rounds=0, idle_timeout_s=5)
    assert len(coordinator.updates) == 1 and agent.outbox.pending() == []
    agent.close()


def test_forged_ack_does_not_drop_the_update(world) -> None:
    coordinator, make_agent = world
    coordinator.ack = False
    agent, _ = make_agent()
    assert agent.handle_task(coordinator.task(1)) is True
    forged = seal(private_key=generate_signing_key(), federation_id=FED, site_id=SITE, round=1,
                  base_model_hash="0" * 64, kind=MessageKind.ACK, sequence=1,
                  payload=encode_ack(Ack(round=1, accepted=True)))
    assert agent.handle_ack(forged.to_bytes()) is False and len(agent.outbox.pending()) == 1
    sequence = Envelope.from_bytes(agent.outbox.get(agent.outbox.pending()[0].message_id).payload).header.sequence
    # A genuine ACK of another upload (another sequence) for the same round does not drop this one.
    assert agent.handle_ack(coordinator.sealed_ack(1, sequence=sequence + 7).to_bytes()) is False
    assert agent.stats["rejected:stale_ack"] == 1 and len(agent.outbox.pending()) == 1
    assert agent.handle_ack(coordinator.sealed_ack(1, sequence=sequence).to_bytes()) is True
    assert agent.outbox.pending() == []
    agent.close()


def test_task_seed_is_honoured_only_when_the_site_allows_it(world, tmp_path: Path) -> None:
    coordinator, make_agent = world

    fresh = iter(range(100))

    def delta_for(round_: int, allow: bool) -> dict:
        cfg = yaml.safe_load((tmp_path / "site.yaml").read_text())
        cfg.update(allow_seeded_noise=allow, outbox=f"state/outbox-{next(fresh)}.sqlite")  # a fresh gateway
        (tmp_path / "site.yaml").write_text(yaml.safe_dump(cfg))
        agent, _ = make_agent()
        agent.start()
        coordinator.ack = False
        if allow:
            with pytest.warns(UserWarning, match="seeded"):
                assert agent.handle_task(coordinator.task(round_, seed=42, local_steps=1))
        else:
            assert agent.handle_task(coordinator.task(round_, seed=42, local_steps=1))
        agent.close()
        return decode_update(coordinator.updates[-1].payload)[1]

    a, b = delta_for(1, True), delta_for(1, True)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # reproducible when the site opts in
    c, d = delta_for(1, False), delta_for(1, False)
    assert not all(np.array_equal(c[k], d[k]) for k in c)  # otherwise secure, fresh randomness


@pytest.mark.parametrize("distributed", [False, True])
def test_global_dp_task_runs_the_secure_aggregation_stages(world, tmp_path: Path, distributed: bool) -> None:
    # Prepare: the agent (site-1) and a peer site-0 run by the test with the real client; q = 1 (B = N = 3).
    # distributed: the agent also adds its Skellam share of the noise (and clips CR at its smaller C_c)
    from shared.protocol import (SITE_STAGES, SecAggMessage, SecAggSettings, canonical_flatten, decode_secagg,
                                 encode_secagg)
    from shared.secagg import AdvertisedKeys, EncryptedShare, RecoveryShares, SecAggClient, SecAggServer
    from shared.topics import secagg_filter

    from edge_sdk.backends.base import unflatten
    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from edge_sdk.data.embedding import embed_dataset
    from edge_sdk.privacy.ccdp import clip_per_example

    coordinator, make_agent = world
    received: list = []
    coordinator.transport.subscribe(secagg_filter(FED), lambda t, raw: received.append(Envelope.from_bytes(raw)))
    d = sum(w.size for w in coordinator.weights.values())
    # distributed: the shares survive one colluder (f = 1 of t = 2), so this site's share alone carries mu
    settings = SecAggSettings(site_ids=("site-0", SITE), threshold=2, vector_length=d, max_abs_value=4.0,
                              scale=2.0 ** 24, colluding_sites=1 if distributed else 0)
    task = coordinator.task(1, privacy="global", local_steps=1, expected_batch_size=3, clipping_norm=0.01,
                            secagg=settings, distributed_noise=distributed,
                            # trusted: z so large that every category samples at q = 1; distributed: every category
                            # samples at q = 1 anyway, and z = 2 keeps the noise far inside the 2^32 grid
                            noise_multiplier=2.0 if distributed else 1e4)
    agent, _ = make_agent()
    # Refused unless the site config allows Global DP
    assert agent.handle_task(task) is False and agent.stats["rejected:global_dp_refused"] == 1
    agent.close()
    cfg = yaml.safe_load((tmp_path / "site.yaml").read_text())
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**cfg, "allow_global_dp": True}))
    agent, _ = make_agent()
    agent.start()

    def coordinator_says(stage: str, body: dict) -> None:
        env = seal(private_key=coordinator.key, federation_id=FED, site_id=SITE, round=1,
                   base_model_hash=model_hash(coordinator.weights), kind=MessageKind.SECAGG, sequence=1,
                   payload=encode_secagg(SecAggMessage(stage, body)))
        assert agent.handle_secagg(env.to_bytes()) is True

    def site_said(stage: str):
        env = received[-1]
        verify(env, agent._signing_key.public_key())
        msg = decode_secagg(env.payload, stages=SITE_STAGES)
        assert msg.stage == stage and env.header.kind == MessageKind.SECAGG
        return msg

    # Execute: task -> keys (no UPDATE is ever published); key list -> shares; inbox -> masked; recovery
    assert agent.handle_task(task) is True and coordinator.updates == []
    params = settings.params(FED, 1)
    server, peer = SecAggServer(params), SecAggClient("site-0", params)
    keys = server.collect_keys([peer.public_keys(), AdvertisedKeys.from_json(dict(site_said("keys").body))])
    coordinator_says("key_list", {"keys": [k.to_json() for k in keys.values()]})
    agent_shares = {s.recipient: s for s in map(EncryptedShare.from_json, site_said("shares").body["shares"])}
    inbox = server.route_shares({"site-0": peer.shares_for(keys), SITE: agent_shares})
    peer.receive_shares(inbox["site-0"])
    coordinator_says("share_inbox", {"shares": [s.to_json() for s in inbox[SITE].values()]})
    masked = site_said("masked")
    assert masked.body == {"num_examples": 3, "categories": ["CR", "NT"]}
    peer_vector = np.full(d, 0.5, dtype=np.float32)
    server.add_masked(SITE, masked.masked)
    server.add_masked("site-0", peer.mask(peer_vector))
    request = server.recovery_request()
    coordinator_says("recovery_request", request.to_json())
    total = server.unmask_sum([RecoveryShares.from_json(dict(site_said("recovery").body)),
                               peer.reveal_for_recovery(request)])
    coordinator_says("round_end", {"status": "closed", "reason": ""})
    # Assert: the unmasked sum is the peer's vector plus the agent's clipped gradient sum over its 3 records,
    # recomputed here from materialised per-example gradients (the agent uses the implicit/ghost path)
    data = embed_dataset(load_camtrap_dp(tmp_path / "pkg", agent.config.species_table, image_size=28),
                         tmp_path / "state" / "embeddings")  # what the gateway cached and trained on
    agent.backend.set_weights(coordinator.weights)
    raw = agent.backend.per_example_gradients(data.features, data.labels)
    if not distributed:
        grads = clip_per_example(raw, 0.01)
    else:  # each record clipped at its category's C_c (the plan both sides compute from public values)
        from edge_sdk.privacy.ccdp import clip_factors_from_norms
        from shared.privacy.distributed import distributed_plan, skellam_share_variance

        _, norms = distributed_plan(budgets={Cat.CR: 0.5, Cat.NT: 1.5}, target_delta=1e-5, planned_rounds=5,
                                    clipping_norm=0.01, vector_length=d, scale=2.0 ** 24)
        by_rank = {c.rank: c for c in Cat}
        bound = np.array([norms[by_rank[int(r)]] for r in data.categories])
        grads = raw * clip_factors_from_norms(np.linalg.norm(raw.astype(np.float64), axis=1), bound)[:, None]
    expected = canonical_flatten(unflatten(grads.sum(axis=0), agent.backend.parameter_layout)) + 0.5
    if not distributed:
        np.testing.assert_allclose(total, expected, atol=2 / 2 ** 24 + 1e-6)
    else:  # the opened sum carries the agent's integer share: variance share / scale^2 per coordinate
        share = skellam_share_variance(noise_multiplier=2.0, clipping_norm=0.01, vector_length=d, scale=2.0 ** 24,
                                       threshold=2, colluding_sites=1)
        # mu / (t - f) with mu = (z (C scale + sqrt d))^2, t - f = 1: by hand
        assert share == pytest.approx((2.0 * (0.01 * 2 ** 24 + np.sqrt(d))) ** 2, rel=1e-12)
        noise = (total - expected) * 2.0 ** 24
        assert abs(noise.var() / share - 1) < 0.05  # d = 20,530 coordinates: relative sd of the estimate ~1 %
        assert abs(noise.mean()) < 5 * np.sqrt(share / d)
    assert agent._secagg is None and agent.stats["tasks_trained"] == 1
    agent.close()


def test_global_task_naming_a_feature_centre_needs_the_same_centre(world, tmp_path: Path) -> None:
    # The coordinator folds the noisy sum back with the centre the task names: a site without it, or with another
    # one, must refuse before advertising keys (it would otherwise send gradients of another parametrisation)
    from shared.models.feature_centre import centre_digest, save_feature_centre
    from shared.protocol import SecAggSettings

    coordinator, make_agent = world
    d = sum(w.size for w in coordinator.weights.values())
    settings = SecAggSettings(site_ids=("site-0", SITE), threshold=2, vector_length=d, max_abs_value=4.0,
                              scale=2.0 ** 24)
    centre = np.linspace(0.0, 1.0, 1280, dtype=np.float32)
    save_feature_centre(tmp_path / "centre.safetensors", centre, num_images=3, source="test")
    cfg = yaml.safe_load((tmp_path / "site.yaml").read_text())

    def task(round_: int, digest: str) -> bytes:
        return coordinator.task(round_, privacy="global", local_steps=1, expected_batch_size=3, clipping_norm=0.01,
                                secagg=settings, noise_multiplier=1e4, feature_centre=digest)

    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**cfg, "allow_global_dp": True}))
    agent, _ = make_agent()
    agent.start()
    assert agent.handle_task(task(1, centre_digest(centre))) is False  # this site holds no centre
    assert agent.stats["rejected:feature_centre_mismatch"] == 1 and agent._secagg is None
    agent.close()
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**cfg, "allow_global_dp": True,
                                                        "feature_centre": "centre.safetensors"}))
    agent, _ = make_agent()
    agent.start()
    assert agent.handle_task(task(1, centre_digest(centre + 1))) is False  # another centre
    assert agent.stats["rejected:feature_centre_mismatch"] == 1
    assert agent.handle_task(task(2, centre_digest(centre))) is True  # the same: keys advertised
    assert agent._secagg is not None
    agent.close()


def test_waiting_for_an_ack_with_max_rounds_reads_no_payload_per_message(world) -> None:
    """With ``max_rounds`` set, the run loop asks after every message whether the outbox is
    empty; that must not read the stored updates (a 40 MB update took 0.25 s per message). Counted two ways: the
    SQL statements that select the payload column (SQLite's trace hook) and the outbox's own counter."""
    import time

    coordinator, make_agent = world
    coordinator.ack = False  # the update stays pending until the test acknowledges it
    agent, _ = make_agent()
    payload_selects = []

    def trace(sql: str) -> None:
        words = sql.upper().split()
        if words[:1] == ["SELECT"] and "PAYLOAD" in sql.upper().split("FROM")[0]:
            payload_selects.append(sql)

    agent.start()
    coordinator.send(coordinator.task(1))
    runner = threading.Thread(target=agent.run, kwargs={"max_rounds": 1, "idle_timeout_s": 60})
    runner.start()
    deadline = time.monotonic() + 60
    while agent.stats["tasks_trained"] < 1 and time.monotonic() < deadline:  # trained: the update is pending
        time.sleep(0.02)
    assert agent.stats["tasks_trained"] == 1 and agent.outbox.count() == 1
    agent.outbox._db.set_trace_callback(trace)
    reads_before = agent.outbox.payload_reads
    # Execute: 50 messages arrive while the update waits for its ACK (here: junk on the task topic)
    for _ in range(50):
        coordinator.send(b"junk")
    while agent.stats["rejected:malformed"] < 50 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert agent.stats["rejected:malformed"] == 50
    during_flood = len(payload_selects), agent.outbox.payload_reads - reads_before
    # the ACK ends the run: reading the pending update once, to check the ACK's sequence, is allowed
    sequence = coordinator.updates[0].header.sequence
    coordinator.transport.publish(ack_topic(FED, SITE), coordinator.sealed_ack(1, sequence=sequence).to_bytes())
    runner.join(timeout=30)
    agent.outbox._db.set_trace_callback(None)
    # Assert
    assert not runner.is_alive() and agent.outbox.count() == 0
    assert during_flood == (0, 0)
    assert agent.outbox.payload_reads - reads_before == 1 and len(payload_selects) == 1
    agent.close()


def test_only_the_newest_waiting_task_is_trained(world) -> None:
    # Prepare: the gateway was busy while round 1's and round 2's tasks came, and a forged round 3 task
    coordinator, make_agent = world
    agent, _ = make_agent()
    agent.start()
    coordinator.send(coordinator.task(1))
    coordinator.send(coordinator.task(2))
    coordinator.send(coordinator.task(3, key=generate_signing_key()))  # not the coordinator's: supersedes nothing
    # Execute
    trained = agent.run(max_rounds=1, idle_timeout_s=10)
    # Assert: round 1's task was skipped (its update would be late), round 2 trained once, round 3 refused
    assert trained == 1 and [u.header.round for u in coordinator.updates] == [2]
    assert agent.stats["rejected:superseded"] == 1 and agent.stats["rejected:bad_signature"] == 1
    agent.close()


def test_a_buffered_task_known_to_be_too_stale_is_not_trained(world) -> None:
    # Prepare: the gateway has seen round 5's task; buffered tasks of rounds 2 and 3 come, max_staleness 2
    coordinator, make_agent = world
    agent, _ = make_agent()
    agent.start()
    agent.ctx.newest_round_seen = 5
    coordinator.send(coordinator.task(2, max_staleness=2))
    assert agent.run(max_rounds=1, idle_timeout_s=1) == 0
    assert agent.stats["rejected:too_stale"] == 1 and coordinator.updates == []  # 5 - 2 > 2: no budget spent
    coordinator.send(coordinator.task(3, max_staleness=2))
    assert agent.run(max_rounds=1, idle_timeout_s=10) == 1  # 5 - 3 = 2: still aggregated, trained
    assert [u.header.round for u in coordinator.updates] == [3]
    agent.close()


def test_a_buffered_task_waits_until_the_previous_update_is_acknowledged(world) -> None:
    # Prepare: the coordinator does not ACK yet; buffered tasks of rounds 1 and 2 come one after the other
    coordinator, make_agent = world
    coordinator.ack = False
    agent, _ = make_agent()
    agent.start()
    coordinator.send(coordinator.task(1, max_staleness=5))
    coordinator.send(coordinator.task(2, max_staleness=5))
    # Execute 1: round 2 supersedes round 1 (both waiting); round 2 trains; round 3 comes while it is unacknowledged
    assert agent.run(max_rounds=1, idle_timeout_s=1) == 1
    coordinator.send(coordinator.task(3, max_staleness=5))
    assert agent.run(max_rounds=2, idle_timeout_s=1) == 0  # round 3 waits: round 2's update is in flight
    assert [u.header.round for u in coordinator.updates] == [2] and agent.outbox.count() == 1
    # Execute 2: the ACK of round 2 comes; round 3 trains then
    coordinator.ack = True
    sequence = coordinator.updates[0].header.sequence
    coordinator.transport.publish(ack_topic(FED, SITE), coordinator.sealed_ack(2, sequence=sequence).to_bytes())
    assert agent.run(max_rounds=1, idle_timeout_s=10) == 1
    assert [u.header.round for u in coordinator.updates] == [2, 3] and agent.outbox.count() == 0
    agent.close()
