"""Scale-out ingest (coordinator.inbound.workers): three ingest workers on one MQTT shared subscription of the real
Mosquitto, state in PostgreSQL (a throw-away schema), a finaliser that only opens, merges and closes rounds.

Checked against the FedAvg mean worked out by hand: the round closes with exactly the weighted mean of the six
sites' deltas, each update stored, charged and aggregated once, even when (a) each update is delivered twice
(QoS 1 is at least once) and (b) a worker "dies" after storing and ACKing an update but before writing its partial
sum (the finaliser then reads that update from its blob). The updates were spread over more than one worker (the
broker balanced the shared subscription).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key
from shared.topics import update_topic

from coordinator.inbound.partial_sums import decode_partial, encode_partial
from coordinator.service import Coordinator
from coordinator.storage import PartialSumRow, Store
from coordinator.strategies.fedavg import add_weighted, new_running_sum
from coordinator.transport.mqtt import MqttTransport
from coordinator.inbound.workers import IngestWorker
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights
from tests.coordinator.test_mqtt import broker_url  # noqa: F401 - the broker fixture
from tests.coordinator.test_postgres import PG_URL, pg_schema  # noqa: F401 - the PostgreSQL schema fixture

pytestmark = pytest.mark.broker

SITES = [("w1", 1.0, 10), ("w2", 2.0, 20), ("w3", -1.0, 30), ("w4", 0.5, 40), ("w5", 3.0, 5), ("w6", -2.0, 15)]


def test_partial_sum_blob_round_trip() -> None:
    acc = new_running_sum(tiny_weights())
    add_weighted(acc, {k: np.full_like(v, 0.25) for k, v in tiny_weights().items()}, 4.0)
    acc.contributors.append("s")
    back = decode_partial(encode_partial(acc))
    assert back.total_weight == 4.0 and back.count == 1 and back.contributors == ["s"]
    for k, v in acc.sums.items():
        assert back.sums[k].dtype == np.float64 and np.array_equal(back.sums[k], v)
        assert back.dtypes[k] == np.float32


class TwiceSite(FakeSite):
    """Publishes every update twice (an at-least-once redelivery), and may be "lost" by a dying worker."""

    def _on_task(self, topic: str, raw: bytes) -> None:
        published = []
        real = self.transport.publish
        self.transport.publish = lambda t, p, qos=1: (published.append((t, p)), real(t, p, qos))  # type: ignore
        try:
            super()._on_task(topic, raw)
        finally:
            self.transport.publish = real  # type: ignore
        for t, p in published:
            if t == update_topic(self.fed, self.site_id):
                real(t, p, 1)


def test_three_workers_on_a_shared_subscription_aggregate_each_update_once(tmp_path, broker_url, pg_schema):  # noqa: F811
    fed = f"so{uuid.uuid4().hex[:8]}"
    key = generate_signing_key()
    budget = {"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0}
    config = make_config(tmp_path, federation_id=fed, broker_url=broker_url, database_url=PG_URL, rounds=1,
                         round_deadline_s=30.0, ingest_workers=3, budget=budget, ship_ort_artifacts=False)
    coord = Coordinator(config, signing_key=key, initial_weights=tiny_weights(), schema=pg_schema)
    workers = [IngestWorker(config, f"worker-{i}", signing_key=key, schema=pg_schema) for i in range(3)]
    dying = "w4"

    def die_before_partial(original):  # whichever worker stores and ACKs w4's update fails before its partial sum
        def hook(ctx, accepted):
            if accepted.site_id == dying:
                raise RuntimeError("worker failed before writing its partial sum (test)")
            original(ctx, accepted)
        return hook

    for w in workers:
        w.start()
        w.ingestor.on_accepted = die_before_partial(w.ingestor.on_accepted)
    sites = []
    for sid, value, n in SITES:
        t = MqttTransport(broker_url, client_id=f"{fed}-{sid}")
        t.connect()
        s = TwiceSite(sid, t, key.public_key(), value=value, num_examples=n, events={IUCNCategory.VU: EVENT},
                      fed=fed).attach()
        coord.enrol(sid, s.public_pem, {"capacity": n, "categories": ["VU"]})
        sites.append(s)
    time.sleep(0.3)  # SUBACKs
    try:
        coord.start()
        result = coord.run_round()
    finally:
        for s in sites:
            s.transport.close()
        for w in workers:
            w.close()
    assert result.status == "closed", result
    assert result.accepted == tuple(sorted(sid for sid, _, _ in SITES))
    # FedAvg by hand: sum n_k v_k / sum n_k
    mean = sum(v * n for _, v, n in SITES) / sum(n for _, _, n in SITES)
    _, after = coord.rounds.current_model()
    for name, w in tiny_weights().items():
        np.testing.assert_allclose(after[name], w + mean, rtol=0, atol=1e-6)
    assert coord.store.count_updates() == len(SITES)  # each delivered twice, stored once
    for sid, _, _ in SITES:
        assert len(coord.ledger.events(sid, IUCNCategory.VU)) == 1  # charged once
    with coord.store.session() as s:
        partials = list(s.query(PartialSumRow).filter(PartialSumRow.round == result.round))
    assert len(partials) >= 2, "the broker should have spread the updates over several workers"
    assert coord.store.rejection_counts().get("duplicate", 0) >= 1
    coord.close()
    Store(PG_URL, tmp_path / "data", schema=pg_schema).dispose()


def test_collect_round_reads_updates_no_partial_covers_from_their_blobs(tmp_path) -> None:
    """A worker stored and ACKed s3's update, then died before its partial sum: the merge takes s1+s2 from the
    partial and s3 from its blob, once each (FedAvg by hand)."""
    from shared.protocol import UpdateReport, encode_update

    from coordinator.inbound.context import Accepted
    from coordinator.storage import RoundRow, UpdateRow
    from coordinator.inbound.partial_sums import accepted_to_json, collect_round

    store = Store("sqlite://", tmp_path / "d")
    from coordinator.registry import SiteRegistry
    from shared.keys import public_key_to_pem

    reg = SiteRegistry(store)
    w = tiny_weights()
    with store.session() as s:
        s.add(RoundRow(round=1, status="closing", base_model_hash="0" * 64, selected_json="[]"))
    acc = new_running_sum(w)
    covered = []
    for sid, value, n in (("s1", 1.0, 10), ("s2", -3.0, 30), ("s3", 5.0, 60)):
        reg.enrol(sid, public_key_to_pem(generate_signing_key().public_key()), {})  # each site its own key
        delta = {k: np.full_like(v, value) for k, v in w.items()}
        digest = store.put_blob(encode_update(UpdateReport(num_examples=n, local_steps=1,
                                                           events={IUCNCategory.VU: EVENT}), delta))
        with store.session() as s:
            s.add(UpdateRow(round=1, site_id=sid, sequence=1, num_examples=n, payload_sha256=digest))
        if sid != "s3":
            add_weighted(acc, delta, float(n))
            acc.contributors.append(sid)
            covered.append(accepted_to_json(Accepted(sid, 1, 1, n, float(n), digest, {IUCNCategory.VU: EVENT})))
    import json

    with store.session() as s:
        s.add(PartialSumRow(round=1, worker_id="dead", blob_sha256=store.put_blob(encode_partial(acc)),
                            sites_json=json.dumps(covered), total_weight=acc.total_weight))
    merged, accepted = collect_round(store, 1, w)
    assert sorted(accepted) == ["s1", "s2", "s3"] and merged.count == 3 and merged.total_weight == 100.0
    expected = (10 * 1.0 + 30 * -3.0 + 60 * 5.0) / 100  # = 2.2
    for k in w:
        np.testing.assert_allclose(merged.sums[k] / merged.total_weight, expected, rtol=1e-12)
    assert accepted["s3"].events == {IUCNCategory.VU: EVENT}


def test_an_update_stored_by_another_process_is_aggregated_and_charged_once(tmp_path) -> None:
    """A second ingesting process (a worker started beside a coordinator with ingest_workers: 0) stores a site's
    update first; the coordinator refuses its own copy as a duplicate, yet counts the stored one at the close: it is
    aggregated and charged once, never left out of the ledger."""
    from coordinator.inbound.ingest import Ingestor
    from coordinator.transport import InMemoryTransport

    key = generate_signing_key()
    bus = InMemoryTransport()
    budget = {"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0}
    coord = Coordinator(make_config(tmp_path, rounds=1, budget=budget, ship_ort_artifacts=False), transport=bus,
                        signing_key=key, initial_weights=tiny_weights())
    other = Ingestor(federation_id="testfed", store=coord.store, registry=coord.registry, ledger=coord.ledger,
                     transport=InMemoryTransport(), signing_key=key)
    s = FakeSite("x1", bus, key.public_key(), value=2.0, num_examples=10, events={IUCNCategory.VU: EVENT})
    coord.enrol("x1", s.public_pem, {"capacity": 10, "categories": ["VU"]})
    coord.start()
    ctx = coord.rounds.open_round()
    assert ctx is not None
    other.open_round(type(ctx)(**{**ctx.__dict__, "accepted": {}, "strategy": type(ctx.strategy)()}))
    other.context.strategy.begin_round(tiny_weights())
    raw = s.envelope(ctx.round, ctx.model_hash, s.payload({k: np.full_like(v, 2.0) for k, v in tiny_weights().items()}))
    assert type(other.handle(update_topic("testfed", "x1"), raw)).__name__ == "Accepted"
    assert coord.ingestor.handle(update_topic("testfed", "x1"), raw).reason.value == "duplicate"
    result = coord.rounds.close_round(ctx)
    assert result.status == "closed" and result.accepted == ("x1",)
    assert coord.ledger.events("x1", IUCNCategory.VU) == [EVENT]
    _, after = coord.rounds.current_model()
    for name, w in tiny_weights().items():
        np.testing.assert_allclose(after[name], w + 2.0, atol=1e-6)
    coord.close()
