"""Federated rounds through a three-node broker cluster (NATS 2.9 with its MQTT listener; docs/brokers.md).

The coordinator (in-process, persistent session) is on node 0; gateway s1 on node 1, gateway s2 on node 2, each
with the other nodes as ``broker_failover_urls``. All nodes up: two rounds close with both sites, chunked uploads
and tasks cross nodes, each update is stored, charged and aggregated once, and the retained model release of round
2 is on s2's node. Node 2 SIGKILLed just before s2's 6th chunk of its round-1 upload: s2's transport fails over to
another node, and nothing is stored, charged or aggregated twice; whether the round then closes is reported (on
NATS 2.9.10 it did in 1 of 4 measured runs: docs/brokers.md).

Skipped, with the reason, when ``nats-server`` is not installed. Waits poll real outcomes with deadlines.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from shared.codec import decode_tensors
from shared.envelope import Envelope, MessageKind
from shared.keys import generate_signing_key, public_key_to_pem
from shared.topics import model_topic

from coordinator.service import Coordinator
from tests.nats_cluster import NATS_SERVER, NatsCluster
from tests.cluster_checks import assert_rounds_once, killing_link
from tests.support import wait_for
from tests.test_faults import CHUNK, fedavg_of_stored, gateway_config, ledger_rows, write_site

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("WILDFED_CLUSTER_TESTS") != "1",
                                 reason="opt-in (WILDFED_CLUSTER_TESTS=1): on NATS 2.9.10 and 2 shared cores the cluster "
                                 "itself sometimes fails to form ('no suitable peers for placement') and a node's "
                                 "kill can disconnect clients of the surviving nodes for minutes, so the outcome is a "
                                 "measurement (docs/brokers.md), not a check CI can rely on"),
              pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (apt-get install "
                                 "nats-server; v2.9.10 measured): the three-node broker cluster needs it")]

SITES = ("s1", "s2")


@pytest.fixture
def cluster(tmp_path: Path):
    """Three NATS nodes with MQTT listeners on free loopback ports (tests/nats_cluster.py)."""
    with NatsCluster(tmp_path / "nats") as running:
        yield running


@pytest.mark.parametrize("kill", [False, True], ids=["all-nodes-up", "node-killed-mid-round"])
def test_rounds_through_a_three_node_cluster(tmp_path: Path, cluster: NatsCluster, kill: bool):
    """Without a kill: two rounds close with both sites, clients on three different nodes (strict). With node 2
    killed mid-upload: s2 fails over to another node; what is asserted is what held in every measured run, that
    nothing is stored, charged or aggregated twice and that s1's update is in. Whether round 1 closes is reported,
    not asserted: on NATS 2.9.10 (2 cores) the failed-over gateway's QoS 1 subscriptions were refused by JetStream
    timeouts in 3 of 4 runs (docs/brokers.md, "Measured")."""
    from edge_sdk.agent import EdgeAgent
    from edge_sdk.config import load_site_config
    from edge_sdk.uplink.mqtt import MqttTransport as EdgeMqtt
    from edge_sdk.uplink.site_transport import transport_from_config

    # Prepare: coordinator on node 0, s1 on node 1, s2 on node 2, each gateway listing the other nodes
    urls = cluster.urls
    fed = f"fnat{uuid.uuid4().hex[:8]}"
    key = generate_signing_key()
    coord = Coordinator(gateway_config(tmp_path / "coord", urls[0], federation_id=fed, rounds=2), signing_key=key)
    killed = {"at": None, "publish_errors": 0}
    connects: dict[str, list[tuple[float, int]]] = {s: [] for s in SITES}

    KillingLink = killing_link(cluster, killed, kill=kill)  # node 2 SIGKILLed before s2's 6th chunk

    agents, runners, transports = [], [], {}
    try:
        for node, sid in ((1, "s1"), (2, "s2")):
            failover = [u for i, u in enumerate(urls) if i != node]
            site_yaml, site_key = write_site(tmp_path / sid, fed=fed, site_id=sid, coordinator_key=key,
                                             broker_url=urls[node], broker_failover_urls=failover,
                                             chunk_size_bytes=CHUNK, resend_interval_s=3.0)
            coord.enrol(sid, public_key_to_pem(site_key.public_key()), {"capacity": 3, "categories": ["VU", "NT"]})
            config = load_site_config(site_yaml)
            # the config's list reaches the transport the agent would build (node order: its own, then the list)
            assert transport_from_config(config).brokers == [("127.0.0.1", cluster.mqtt_ports[i])
                                                             for i in (node, *[j for j in range(3) if j != node])]
            link = transports[sid] = KillingLink(config.broker_url, client_id=f"wildfed-{fed}-{sid}",
                                                 failover_urls=config.broker_failover_urls)
            link.add_connect_listener(lambda sid=sid, link=link: connects[sid].append((time.monotonic(),
                                                                                       link.broker)))
            agent = EdgeAgent.from_config(config, transport=link)
            agent.start()  # connected and subscribed before the round opens
            agents.append(agent)
        coord.start()

        # Execute: round 1 (node 2 killed mid-upload when `kill`), then round 2 (on the nodes left)
        results, closed_at = [], []
        for agent in agents:
            runners.append(threading.Thread(target=agent.run, kwargs={"max_rounds": 2, "idle_timeout_s": 90},
                                            daemon=True))
            runners[-1].start()
        for round_ in ((1,) if kill else (1, 2)):
            ctx = coord.rounds.open_round()
            assert ctx is not None and ctx.round == round_
            quorum = coord.rounds.wait_for_quorum(ctx, timeout_s=90)
            assert quorum or kill, (dict(coord.ingestor.counts), [dict(a.stats) for a in agents])
            results.append(coord.rounds.close_round(ctx))
            closed_at.append(time.monotonic())
        if kill:
            _assert_once_after_a_kill(coord, agents, transports, killed, connects, results[0], closed_at[0])
            return
        for runner in runners:
            runner.join(timeout=60)
            assert not runner.is_alive()
        assert all(len(connects[s]) == 1 for s in SITES)  # nobody had to move

        # Assert 2: both rounds closed with both sites, each update stored once, charged once, aggregated once
        assert_rounds_once(coord, agents, results, SITES)

        # Assert 3: the retained release of round 2 waits for s2 on its node
        got: list[bytes] = []
        host, port = transports["s2"].brokers[transports["s2"].broker]
        reader = EdgeMqtt(f"mqtt://{host}:{port}", client_id=f"reader-{fed}")
        reader.subscribe(model_topic(fed, "s2"), lambda t, p: got.append(p))
        reader.connect(timeout_s=10)
        try:
            wait_for(lambda: any(Envelope.from_bytes(p).header.round == 2 for p in got), 20,
                     "the retained round-2 model release of s2")
        finally:
            reader.close()
        release = next(Envelope.from_bytes(p) for p in got if Envelope.from_bytes(p).header.round == 2)
        assert release.header.kind in (MessageKind.MODEL, MessageKind.MANIFEST)
        assert release.header.base_model_hash == results[1].model_hash
    finally:
        for agent in agents:
            agent.stop()
        for runner in runners:
            runner.join(timeout=10)
        for agent in agents:
            agent.close()
        coord.close()


def _assert_once_after_a_kill(coord, agents, transports, killed, connects, result, closed_at) -> None:  # noqa: ANN001
    """After node 2's SIGKILL mid-upload: nothing stored, charged or aggregated twice; s1's update stored (s1 stayed
    on its node); a round that closed has the FedAvg of what was stored. Whether and when s2 got back to another
    node is printed, not asserted (docs/brokers.md, "Measured")."""
    assert killed["at"] is not None and killed["publish_errors"] >= 1  # the node died under s2's upload
    back = [(t, b) for t, b in connects["s2"] if t > killed["at"]]  # reported: NATS 2.9 may refuse it for minutes
    # s1's node survived; NATS 2.9 may still have dropped s1 for a while (docs/brokers.md): reported, not asserted
    stored = [u.site_id for u in coord.store.updates_for_round(1)]
    assert "s1" in stored and len(stored) == len(set(stored))
    rows = ledger_rows(coord.store)
    # charged once each; s2's update may be charged without being stored (it came after the round closed: late)
    assert len(rows) == len(set(rows)) and {r[0].split("@")[0] for r in rows} <= set(SITES)
    if result.status == "closed":
        rounds = coord.store.rounds()
        before, _ = decode_tensors(coord.store.get_model(rounds[0].base_model_hash))
        after, _ = decode_tensors(coord.store.get_model(result.model_hash))
        for name, avg in fedavg_of_stored(coord.store, 1).items():
            np.testing.assert_allclose(after[name], before[name] + avg, rtol=1e-5, atol=1e-6)
    moved = (f"s2 reconnected {back[0][0] - killed['at']:.2f} s after the kill, to node "
             f"{transports['s2'].brokers[back[0][1]]}" if back else "s2 did not get back in time")
    print(f"\nfailover: {moved}; round 1 {result.status} {closed_at - killed['at']:.1f} s after it with "
          f"{sorted(stored)}")
