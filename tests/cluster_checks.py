"""What the three-node broker cluster tests (tests/test_cluster.py on NATS, tests/test_rabbit_cluster.py on RabbitMQ)
check alike: rounds whose every update was stored, charged and aggregated exactly once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.codec import decode_tensors

from tests.test_faults import fedavg_of_stored, ledger_rows


def assert_rounds_once(coord, agents: Sequence, results: Sequence, sites: tuple[str, ...]) -> None:  # noqa: ANN001
    """Every round of ``results`` closed with all ``sites``; each update stored once, charged once (one ledger row
    per site, round and event) and aggregated once (each new model = its base + the FedAvg of the stored updates);
    every agent trained every round with nothing left in its outbox."""
    rounds_run = len(results)
    assert [r.status for r in results] == ["closed"] * rounds_run
    assert all(r.accepted == sites for r in results)
    assert coord.ingestor.counts["accepted"] == rounds_run * len(sites)
    for round_ in range(1, rounds_run + 1):
        assert sorted(u.site_id for u in coord.store.updates_for_round(round_)) == list(sites)
    rows = ledger_rows(coord.store)
    assert len(rows) == len(set(rows)) and {(r[1], r[0].split("@")[0]) for r in rows} == \
        {(r, s) for r in range(1, rounds_run + 1) for s in sites}
    stored_rounds = coord.store.rounds()
    for i, result in enumerate(results):
        before, _ = decode_tensors(coord.store.get_model(stored_rounds[i].base_model_hash))
        after, _ = decode_tensors(coord.store.get_model(result.model_hash))
        for name, avg in fedavg_of_stored(coord.store, i + 1).items():
            np.testing.assert_allclose(after[name], before[name] + avg, rtol=1e-5, atol=1e-6)
    assert all(a.outbox.pending() == [] and a.stats["tasks_trained"] == rounds_run for a in agents)


def killing_link(cluster, killed: dict, *, kill: bool, node: int = 2, at_chunk: int = 6) -> type:  # noqa: ANN001
    """The gateway's real paho transport (``edge_sdk.uplink.mqtt.MqttTransport``) as a class whose publish, when
    ``kill``, SIGKILLs ``cluster`` node ``node`` just before the ``at_chunk``-th update chunk sent while connected to
    that node (once). ``killed`` is filled in: ``"at"`` the monotonic time of the kill (None before), and
    ``"publish_errors"`` the publishes that failed (the node died under them)."""
    import time

    from edge_sdk.uplink.mqtt import MqttTransport
    from edge_sdk.uplink.transport import TransportError
    from shared.transfer import is_chunk

    class KillingLink(MqttTransport):
        chunks = 0

        def publish(self, topic, payload, qos=1, timeout_s=10.0, **kw):  # noqa: ANN001
            if kill and self.brokers[self.broker][1] == cluster.mqtt_ports[node] and is_chunk(payload) \
                    and killed["at"] is None:
                KillingLink.chunks += 1
                if KillingLink.chunks == at_chunk:
                    cluster.kill(node)
                    killed["at"] = time.monotonic()
            try:
                super().publish(topic, payload, qos, timeout_s, **kw)
            except TransportError:
                killed["publish_errors"] += 1
                raise

    return KillingLink
