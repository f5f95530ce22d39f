"""The final model reaches the gateways: a real coordinator and real EdgeAgents over an in-process bus (with the
broker's retained messages), and over a real Mosquitto.

Checked: after the last round every running gateway keeps the coordinator's last model (same hash) as its global
model, with the logit adjustment folded in as a task's; a gateway that connects after the round (even after the
coordinator stopped) gets it from the retained message; a model larger than the chunk size arrives in retained
chunks; a site enrolled later gets the current model at the coordinator's next start; a restart publishes nothing
new.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np
from shared.codec import decode_tensors, model_hash
from shared.envelope import Envelope, MessageKind
from shared.keys import generate_signing_key, public_key_to_pem
from shared.topics import model_topic

from edge_sdk.agent import EdgeAgent
from edge_sdk.config import global_model_path
from edge_sdk.global_model import KeptModel, kept_version
from edge_sdk.uplink.transport import Transport

from coordinator.model_delivery import release_state_key
from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import make_config
from tests.coordinator.test_mqtt import broker_url  # noqa: F401 - the broker fixture (skips without a broker)
from tests.support import camera_site, wait_for

META = {"capacity": 8, "categories": ["VU", "NT"]}


class Bridge(Transport):
    """An edge Transport on the coordinator's in-process bus, which keeps retained messages as a broker does."""

    def __init__(self, bus: InMemoryTransport) -> None:
        self.bus = bus
        self.listeners: list = []

    def connect(self, timeout_s: float = 10.0) -> None:
        for listener in self.listeners:
            listener()

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        self.bus.publish(topic, payload)

    def subscribe(self, topic_filter: str, callback) -> None:  # noqa: ANN001
        self.bus.subscribe(topic_filter, callback)

    def add_connect_listener(self, listener) -> None:  # noqa: ANN001
        self.listeners.append(listener)

    def close(self) -> None:
        pass


def _federation(tmp_path: Path, sites: list[str], *, metadata: dict | None = None, **overrides: object):
    key = generate_signing_key()
    bus = InMemoryTransport()
    config = make_config(tmp_path, rounds=1, round_deadline_s=60.0, local_steps=2, expected_batch_size=2,
                         num_classes=2, ship_ort_artifacts=False, **overrides)
    coord = Coordinator(config, transport=bus, signing_key=key)
    for sid in sites:
        site_key = camera_site(tmp_path / sid, sid, key)
        coord.enrol(sid, public_key_to_pem(site_key.public_key()), (metadata or {}).get(sid, META))
    return coord, bus, key


def _run_agents(agents: list[EdgeAgent]) -> list[threading.Thread]:
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for a, t in zip(agents, threads):
        a.start()
        t.start()
    return threads


def _stop(agents: list[EdgeAgent], threads: list[threading.Thread]) -> None:
    for a in agents:
        a.stop()
    for t in threads:
        t.join(timeout=30)
    for a in agents:
        a.close()


def test_the_last_rounds_model_reaches_every_gateway_and_a_late_one_from_the_retained_message(tmp_path: Path) -> None:
    coord, bus, _ = _federation(tmp_path, ["g1", "g2", "late"], quorum_fraction=0.6)
    agents = [EdgeAgent.from_config(tmp_path / sid / "site.yaml", transport=Bridge(bus)) for sid in ("g1", "g2")]
    threads = _run_agents(agents)
    try:
        results = coord.run()  # the last round: g1 and g2 train (quorum 2 of 3); "late" is not running
        assert [r.status for r in results] == ["closed"] and results[0].accepted == ("g1", "g2")
        final = coord.status().model_hash
        assert final == results[0].model_hash
        for agent in agents:
            wait_for(lambda a=agent: a.stats["models_kept"] == 1, 30, f"{agent.config.site_id} keeps the model")
    finally:
        _stop(agents, threads)
    final_weights, _ = decode_tensors(coord.store.get_model(final))
    for agent in agents:
        version = kept_version(global_model_path(agent.config))
        assert (version.model_hash, version.round, version.source) == (final, 1, "release")
        kept = KeptModel.load(global_model_path(agent.config), backbone_id=agent.config.backbone_id)
        assert kept is not None and kept.model_hash == final
        for name, value in final_weights.items():  # no logit adjustment configured: the weights as trained
            np.testing.assert_array_equal(kept.weights[name], value)
    # one retained MODEL per site; the coordinator recorded what it released
    for sid in ("g1", "g2", "late"):
        env = Envelope.from_bytes(bus.retained[model_topic("testfed", sid)])
        assert (env.header.kind, env.header.site_id, env.header.round, env.header.base_model_hash) == (
            MessageKind.MODEL, sid, 1, final)
        assert coord.store.get_state(release_state_key(sid))["model"] == final
    coord.close()

    # the late gateway connects after the coordinator stopped: the broker's retained message is its final model
    late = EdgeAgent.from_config(tmp_path / "late" / "site.yaml", transport=Bridge(bus))
    threads = _run_agents([late])
    try:
        wait_for(lambda: late.stats["models_kept"] == 1, 30, "the late gateway keeps the retained model")
    finally:
        _stop([late], threads)
    assert kept_version(global_model_path(late.config)).model_hash == final
    assert late.stats["tasks_trained"] == 0


def test_a_site_enrolled_later_gets_the_current_model_at_the_next_start_and_a_restart_sends_nothing_new(
        tmp_path: Path) -> None:
    coord, bus, key = _federation(tmp_path, ["g1"])
    agents = [EdgeAgent.from_config(tmp_path / "g1" / "site.yaml", transport=Bridge(bus))]
    threads = _run_agents(agents)
    try:
        assert [r.status for r in coord.run()] == ["closed"]
        wait_for(lambda: agents[0].stats["models_kept"] == 1, 30, "g1 keeps the model")
    finally:
        _stop(agents, threads)
    final = coord.status().model_hash
    site_key = camera_site(tmp_path / "g9", "g9", key)
    coord.enrol("g9", public_key_to_pem(site_key.public_key()), META)
    coord.close()
    published = len(bus.published)
    again = Coordinator(coord.config, transport=bus, signing_key=key)
    again.start()  # catches up: g9 lacks the current model; g1 has it already
    new = [(t, p) for t, p in bus.published[published:] if "/model" in t]
    assert [t for t, _ in new] == [model_topic("testfed", "g9")]
    assert Envelope.from_bytes(new[0][1]).header.base_model_hash == final
    assert again.release_models() == {}  # nothing left to release
    again.close()


def test_a_model_over_the_chunk_size_arrives_in_retained_chunks_with_its_logit_adjustment(tmp_path: Path) -> None:
    species = [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "VU"},
               {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]
    metadata = {"g1": {**META, "species": ["Loxodonta cyclotis", "Equus quagga"]},  # a prior of 12:4 (public)
                "g2": {**META, "species": ["Loxodonta cyclotis"]}}
    coord, bus, _ = _federation(tmp_path, ["g1", "g2"], metadata=metadata, adapter_width=16, species=species,
                                posthoc_logit_adjustment=1.0, transfer={"chunk_size_bytes": 16 * 1024})
    coord.start()
    _, weights = coord.rounds.current_model()
    bundle = {k: (v + 0.01).astype(np.float32) for k, v in weights.items()}  # a "new model" of round 1
    h = model_hash(bundle)
    assert coord.releases.release(1, h, bundle) == {"g1": h, "g2": h}
    prefix = model_topic("testfed", "g1")
    chunk_topics = sorted(t for t in bus.retained if t.startswith(prefix + "/"))
    n = coord.store.get_state(release_state_key("g1"))["chunks"]
    assert n > 3 and chunk_topics == sorted(f"{prefix}/{i}" for i in range(n))  # each chunk retained
    assert Envelope.from_bytes(bus.retained[prefix]).header.kind == MessageKind.MANIFEST
    agent = EdgeAgent.from_config(tmp_path / "g1" / "site.yaml", transport=Bridge(bus))
    threads = _run_agents([agent])
    try:
        wait_for(lambda: agent.stats["models_kept"] == 1, 30, "the chunked model is kept")
    finally:
        _stop([agent], threads)
    kept = KeptModel.load(global_model_path(agent.config), backbone_id=agent.config.backbone_id)
    assert kept.model_hash == h
    prior = np.log(np.array([12.0, 4.0]) / 16.0)  # capacity 8 spread over each site's listed species
    offsets = prior - prior.mean()
    np.testing.assert_allclose(coord.rounds.prediction_offsets(), offsets, rtol=1e-12)
    for name, value in bundle.items():
        want = value - offsets.astype(np.float32) if name == "psi.bias" else value
        np.testing.assert_allclose(kept.weights[name], want, atol=1e-6)
    # chunk topics an earlier, larger release used and this one does not are cleared (empty retained message)
    coord.store.set_state(release_state_key("g1"), {**coord.store.get_state(release_state_key("g1")), "chunks": n + 2})
    coord.releases.release(1, h, bundle, sites=["g1"])
    assert sorted(t for t in bus.retained if t.startswith(prefix + "/")) == chunk_topics
    coord.close()


def test_over_a_real_mosquitto_a_gateway_that_connects_later_gets_the_retained_model(tmp_path: Path,
                                                                                     broker_url: str) -> None:
    from coordinator.transport.mqtt import MqttTransport

    from edge_sdk.uplink.mqtt import MqttTransport as EdgeMqtt

    fed = f"rel{uuid.uuid4().hex[:10]}"
    key = generate_signing_key()
    config = make_config(tmp_path, federation_id=fed, rounds=1, num_classes=2, broker_url=broker_url)
    transport = MqttTransport(broker_url, client_id=f"{fed}-coordinator")
    coord = Coordinator(config, transport=transport, signing_key=key)
    site_key = camera_site(tmp_path / "g1", "g1", key, federation_id=fed, broker_url=broker_url)
    coord.enrol("g1", public_key_to_pem(site_key.public_key()), META)
    coord.start()  # connects
    _, weights = coord.rounds.current_model()
    bundle = {k: (v + 0.5).astype(np.float32) for k, v in weights.items()}
    h = model_hash(bundle)
    try:
        assert coord.releases.release(1, h, bundle) == {"g1": h}
        coord.close()
        transport.close()  # nothing of the coordinator runs now
        agent = EdgeAgent.from_config(tmp_path / "g1" / "site.yaml",
                                      transport=EdgeMqtt(broker_url, client_id=f"{fed}-g1"))
        threads = _run_agents([agent])
        try:
            wait_for(lambda: agent.stats["models_kept"] == 1, 30, "the gateway keeps the retained model")
        finally:
            _stop([agent], threads)
        assert kept_version(global_model_path(agent.config)).model_hash == h
    finally:
        cleaner = EdgeMqtt(broker_url, client_id=f"{fed}-cleaner")
        cleaner.connect()
        cleaner.publish(model_topic(fed, "g1"), b"", retain=True)  # leave the shared broker as it was
        cleaner.close()




def test_each_site_is_released_its_own_clusters_model_and_an_unclustered_site_none(tmp_path: Path) -> None:
    from coordinator.strategies.fedavg import FedAvg

    class TwoClusters(FedAvg):
        """site_weights as NIRA's: the shared phi with the head of the site's cluster (g1: A, g2: B; g3: none)."""

        def site_weights(self, bundle, site_id):  # noqa: ANN001
            if site_id == "g3":
                raise KeyError("site 'g3' has no cluster yet")
            prefix = {"g1": "A/", "g2": "B/"}[site_id]
            return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in bundle.items()
                    if not k.startswith(("A/", "B/")) or k.startswith(prefix)}

    coord, bus, _ = _federation(tmp_path, ["g1", "g2", "g3"])
    coord.releases._strategy = TwoClusters()
    coord.start()
    _, weights = coord.rounds.current_model()
    heads = {n for n in weights if n.startswith("psi.")}
    bundle = {k: v for k, v in weights.items() if k not in heads}
    for cluster, shift in (("A/", 0.1), ("B/", -0.1)):
        bundle.update({cluster + n: (weights[n] + shift).astype(np.float32) for n in heads})
    model_a = {**{k: v for k, v in weights.items() if k not in heads}, **{n: bundle["A/" + n] for n in heads}}
    model_b = {**{k: v for k, v in weights.items() if k not in heads}, **{n: bundle["B/" + n] for n in heads}}
    released = coord.releases.release(1, model_hash(bundle), bundle)
    assert released == {"g1": model_hash(model_a), "g2": model_hash(model_b)} and released["g1"] != released["g2"]
    for site, model in (("g1", model_a), ("g2", model_b)):
        env = Envelope.from_bytes(bus.retained[model_topic("testfed", site)])
        assert env.header.site_id == site and env.header.base_model_hash == model_hash(model)
    assert model_topic("testfed", "g3") not in bus.retained
    assert coord.store.get_state(release_state_key("g3")) is None  # nothing recorded: the next catch-up tries again
    coord.close()
