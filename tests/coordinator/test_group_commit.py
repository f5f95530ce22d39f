"""Group commit of accepted updates (coordinator/inbound/group_commit.py).

What is checked:
* a group of updates is durable (every row committed, in ONE transaction, every blob on disk) before the first of
  its ACKs is published; each update is folded into the running sum only after its own ACK;
* a group is committed inside the call that fills it (``max_updates``), before a re-delivery of one of its updates
  is judged (which is then re-ACKed as a duplicate of the stored update), and before the round closes;
* the ingest thread (QueuedCallback) commits a lone update by itself (nothing else arrives), and groups the
  updates that wait in its queue;
* bad settings are refused naming the field and the fix;
* a coordinator process killed between a group's commit and its ACKs (the power cut; test-only hook
  ``WILDFED_TEST_CRASH_AT=after_group_commit``) and restarted: the committed updates are there, their round is
  recovered counting each once, and the gateways' re-sent updates are re-ACKed as duplicates, not counted again.
"""

from __future__ import annotations

import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import event

from shared.codec import decode_tensors
from shared.envelope import Envelope, verify
from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.protocol import decode_ack, decode_task
from shared.topics import ack_topic, update_topic

from coordinator.config import config_from_dict, save_config
from coordinator.inbound.context import Accepted, Pending
from coordinator.inbound.group_commit import GroupCommitPolicy
from coordinator.inbound.reject import Rejected, RejectReason
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.inbound.staging import StagingLimits
from coordinator.storage import LedgerRow, ModelVersionRow
from coordinator.transport import handlers as handler_module
from coordinator.transport.handlers import QueuedCallback
from coordinator.transport.mqtt import MqttTransport
from tests.coordinator.helpers import EVENT, FED, FakeSite, tiny_weights
from tests.coordinator.test_crash import direct_epsilon, prepare_federation, run_coordinator
from tests.coordinator.test_mqtt import broker_url  # noqa: F401 - the broker fixture (skips without a broker)

LC = IUCNCategory.LC


@pytest.fixture
def open_round(federation):
    """A coordinator on the in-memory bus with three enrolled sites (N = 10, 20, 30) and round 1 open; every ACK
    is recorded with what was durable and accumulated when it was published."""

    def build(**overrides):
        coord, bus, key = federation(privacy="none", **overrides)
        sites = {}
        for sid, n in (("s1", 10), ("s2", 20), ("s3", 30)):
            site = FakeSite(sid, bus, key.public_key(), value=float(n), num_examples=n, events={})
            bus.subscribe(ack_topic(FED, sid), site._on_ack)
            coord.enrol(sid, site.public_pem, {"capacity": n})
            sites[sid] = site
        coord.start()
        ctx = coord.rounds.open_round()
        return coord, bus, ctx, sites

    return build


def _update(site: FakeSite, ctx) -> bytes:
    return site.envelope(ctx.round, ctx.model_hash, site.payload({k: np.full_like(v, site.value)
                                                                   for k, v in ctx.template.items()}))


def test_a_group_is_durable_before_any_of_its_acks_and_commits_once(open_round) -> None:
    # Prepare: commits deferred as the ingest thread defers them; every ACK notes the state at its publication
    coord, bus, ctx, sites = open_round(group_commit={"max_delay_s": 1.0})
    coord.ingestor.defer_commits = True
    commits: list[int] = []
    event.listen(coord.store.engine, "commit", lambda conn: commits.append(1))
    at_ack = []

    def observe(topic, raw):
        n_commits = len(commits)
        blobs = sorted(p.name for p in (coord.store.data_dir / "blobs").rglob("*.bin"))
        at_ack.append((topic.split("/")[-2], n_commits, coord.store.count_updates(), len(blobs),
                       ctx.strategy.count))

    for sid in sites:
        bus.subscribe(ack_topic(FED, sid), observe)
    # Execute 1: three checked updates wait for their group
    results = [coord.ingestor.handle(update_topic(FED, sid), _update(site, ctx)) for sid, site in sites.items()]
    # Assert 1: nothing durable, ACKed or accumulated yet
    assert results == [Pending(sid, ctx.round, 1) for sid in sites]
    assert at_ack == [] and coord.store.count_updates() == 0 and ctx.strategy.count == 0 and not ctx.accepted
    assert 0 < coord.ingestor.flush_in() <= 1.0
    # Execute 2: the group is committed
    commits.clear()
    coord.ingestor.flush()
    # Assert 2: at the first ACK, all three rows were in (one commit) and all three blobs on disk; each update was
    # accumulated after its own ACK only (0, 1, 2 before the ACKs in arrival order)
    assert at_ack == [("s1", 1, 3, 3, 0), ("s2", at_ack[1][1], 3, 3, 1), ("s3", at_ack[2][1], 3, 3, 2)]
    assert ctx.strategy.count == 3 and sorted(ctx.accepted) == ["s1", "s2", "s3"]
    assert [s.acks[-1].accepted for s in sites.values()] == [True, True, True]
    assert coord.ingestor.group_stats == (1, 3) and coord.ingestor.flush_in() is None


def test_a_chunked_update_costs_one_transaction_and_one_read_of_the_updates_table(tmp_path: Path) -> None:
    """Manifest + chunks of one update through the receiver of a single coordinator: the whole accept path is one
    database commit, and the only read of ``updates`` is the group's duplicate check inside it (no manifest row,
    no per-chunk query, the keys cached)."""
    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport
    from shared.keys import generate_signing_key
    from shared.transfer import send
    from tests.coordinator.helpers import make_config

    bus, key = InMemoryTransport(), generate_signing_key()
    weights = {"phi.w": np.linspace(-1, 1, 2048, dtype=np.float32).reshape(64, 32),
               "psi.b": np.zeros(2, np.float32)}  # 8 KiB: a manifest and 9 chunks of 1 KiB
    coord = Coordinator(make_config(tmp_path, privacy="none", ship_ort_artifacts=False), transport=bus,
                        signing_key=key, initial_weights=weights)
    site = FakeSite("s1", bus, key.public_key(), value=1.0, num_examples=10, events={},
                    piece_size=1024)  # its update travels in 1 KiB chunks (envelope format 2: pieces = chunks)
    bus.subscribe(ack_topic(FED, "s1"), site._on_ack)
    coord.enrol("s1", site.public_pem, {"capacity": 10})
    coord.start()
    ctx = coord.rounds.open_round()
    sites = {"s1": site}
    raw = _update(sites["s1"], ctx)
    messages: list[bytes] = []
    send(lambda t, p: messages.append(p), update_topic(FED, "s1"), raw, private_key=sites["s1"].key,
         chunk_size=1024)
    assert len(messages) >= 4  # a manifest and 3+ chunks
    coord.registry.verification_keys("s1")  # the key cache warm, as after the site's first message
    commits, update_reads = [], []
    event.listen(coord.store.engine, "commit", lambda conn: commits.append(1))
    event.listen(coord.store.engine, "before_cursor_execute",
                 lambda conn, cur, sql, params, context, many: update_reads.append(sql)
                 if sql.lstrip().upper().startswith("SELECT") and "FROM updates" in sql else None)
    results = [coord.transfers.handle(update_topic(FED, "s1"), m) for m in messages]
    assert isinstance(results[-1], Accepted) and all(r is None for r in results[:-1])
    assert commits == [1] and len(update_reads) == 1
    assert sites["s1"].acks[-1].accepted and coord.store.count_updates() == 1
    coord.close()


def test_a_group_committed_in_the_background_is_durable_before_its_acks(open_round) -> None:
    """The committer thread (coordinator.service's wiring): the group's rows and blobs are in before its first ACK;
    a re-delivery of an update whose group is in flight waits for it and is re-ACKed as a duplicate."""
    coord, bus, ctx, sites = open_round(group_commit={"max_delay_s": 1.0})
    coord.ingestor.defer_commits = True
    coord.ingestor.commit_in_background()
    at_ack, acked = [], threading.Event()

    def observe(topic, raw):  # the in-memory bus delivers in the publishing (committer) thread
        at_ack.append((coord.store.count_updates(), len(list((coord.store.data_dir / "blobs").rglob("*.bin"))),
                       getattr(handler_module._HANDLER_THREAD, "active", False)))
        if len(at_ack) == 3:
            acked.set()

    for sid in sites:
        bus.subscribe(ack_topic(FED, sid), observe)
    raws = {sid: _update(site, ctx) for sid, site in sites.items()}
    assert [coord.ingestor.handle(update_topic(FED, sid), raw) for sid, raw in raws.items()] == [
        Pending(sid, ctx.round, 1) for sid in sites]
    coord.ingestor.flush_async()  # returns at once; the committer thread does the rest
    again = coord.ingestor.handle(update_topic(FED, "s2"), raws["s2"])  # waits for the group in flight
    assert isinstance(again, Rejected) and again.reason is RejectReason.DUPLICATE
    # durable before the first ACK; the committer publishes without waiting for PUBACKs (MqttTransport.publish)
    assert acked.wait(30) and at_ack[0] == (3, 3, True)
    assert [(a.accepted, a.reason) for a in sites["s2"].acks] == [(True, "stored"),
                                                                  (True, "duplicate: already stored")]
    assert ctx.strategy.count == 3 and coord.ingestor.group_stats == (1, 3) and not coord.ingestor.committing


def test_a_full_group_commits_inside_the_call_that_fills_it(open_round) -> None:
    coord, bus, ctx, sites = open_round(group_commit={"max_updates": 2, "max_delay_s": 1.0})
    coord.ingestor.defer_commits = True
    first = coord.ingestor.handle(update_topic(FED, "s1"), _update(sites["s1"], ctx))
    second = coord.ingestor.handle(update_topic(FED, "s2"), _update(sites["s2"], ctx))
    assert isinstance(first, Pending) and isinstance(second, Accepted) and second.site_id == "s2"
    assert sorted(ctx.accepted) == ["s1", "s2"] and coord.store.count_updates() == 2
    assert coord.ingestor.group_stats == (1, 2)


def test_a_redelivered_pending_update_waits_for_its_group_and_is_reacked_as_a_duplicate(open_round) -> None:
    coord, bus, ctx, sites = open_round()
    coord.ingestor.defer_commits = True
    raw = _update(sites["s1"], ctx)
    assert isinstance(coord.ingestor.handle(update_topic(FED, "s1"), raw), Pending)
    again = coord.ingestor.handle(update_topic(FED, "s1"), raw)  # QoS 1 re-delivery before the group committed
    assert isinstance(again, Rejected) and again.reason is RejectReason.DUPLICATE
    assert [(a.accepted, a.reason) for a in sites["s1"].acks] == [(True, "stored"),
                                                                  (True, "duplicate: already stored")]
    assert ctx.strategy.count == 1 and coord.store.count_updates() == 1


def test_closing_the_round_commits_the_waiting_group_first(open_round) -> None:
    coord, bus, ctx, sites = open_round()
    coord.ingestor.defer_commits = True
    assert isinstance(coord.ingestor.handle(update_topic(FED, "s2"), _update(sites["s2"], ctx)), Pending)
    closed = coord.ingestor.close_round()
    assert closed is ctx and list(ctx.accepted) == ["s2"] and ctx.strategy.count == 1
    assert sites["s2"].acks[-1].accepted and coord.store.count_updates() == 1


@pytest.mark.parametrize("committer", ["ingest_thread", "background"])
def test_the_ingest_thread_commits_a_lone_update_and_groups_a_busy_queue(open_round, committer) -> None:
    # Prepare: the ingest thread of an MQTT coordinator (QueuedCallback driving the groups; with "background" the
    # groups are made durable on a committer thread, as coordinator.service wires it), with a gate that can hold it
    # inside its next message
    coord, bus, ctx, sites = open_round(group_commit={"max_updates": 3, "max_delay_s": 1.0})
    acked = {sid: threading.Event() for sid in sites}
    for sid in sites:
        bus.subscribe(ack_topic(FED, sid), lambda t, raw, sid=sid: acked[sid].set())
    gate = threading.Event()
    gate.set()

    def gated(topic, raw):
        gate.wait(30)
        coord.transfers(topic, raw)

    if committer == "background":
        coord.ingestor.commit_in_background()
        queue = QueuedCallback(gated, flush=coord.ingestor.flush_async, flush_in=coord.ingestor.flush_in,
                               busy=lambda: coord.ingestor.committing)
    else:
        queue = QueuedCallback(gated, flush=coord.ingestor.flush, flush_in=coord.ingestor.flush_in)
    coord.ingestor.defer_commits = True
    try:
        # Execute 1: a lone update; nothing follows it
        queue(update_topic(FED, "s1"), _update(sites["s1"], ctx))
        # Assert 1: the thread commits and ACKs it by itself (once the queue stayed empty for max_delay_s)
        assert acked["s1"].wait(30) and queue.drain(30)
        assert coord.ingestor.group_stats == (1, 1) and list(ctx.accepted) == ["s1"]
        # Execute 2: s2 holds the thread at the gate while s3 queues behind it
        gate.clear()
        queue(update_topic(FED, "s2"), _update(sites["s2"], ctx))
        queue(update_topic(FED, "s3"), _update(sites["s3"], ctx))
        gate.set()
        assert acked["s2"].wait(30) and acked["s3"].wait(30) and queue.drain(30)
    finally:
        queue.close()
    # Assert 2: s2 and s3 were committed together, in one group
    assert coord.ingestor.group_stats == (2, 3) and sorted(ctx.accepted) == ["s1", "s2", "s3"]
    assert all(s.acks[-1].accepted for s in sites.values()) and coord.store.count_updates() == 3


def test_bad_group_commit_and_staging_settings_name_the_field_and_the_fix(tmp_path: Path) -> None:
    for kwargs, name in (({"max_updates": 0}, "group_commit.max_updates"),
                         ({"max_delay_s": -0.001}, "group_commit.max_delay_s"),
                         ({"max_bytes": 10}, "group_commit.max_bytes")):
        with pytest.raises(ConfigError) as err:
            GroupCommitPolicy(**kwargs)
        assert err.value.field == name and err.value.fix
    for kwargs, name in (({"memory_limit_bytes": -1}, "transfer.memory_limit_bytes"),
                         ({"spill_above_bytes": 1.5}, "transfer.spill_above_bytes")):
        with pytest.raises(ConfigError) as err:
            StagingLimits(**kwargs)
        assert err.value.field == name and err.value.fix
    base = {"federation_id": "f", "data_dir": str(tmp_path)}
    for section, bad, name in (("group_commit", {"max_delay_s": 5}, "group_commit.max_delay_s"),
                               ("transfer", {"memory_limit_bytes": -1}, "transfer.memory_limit_bytes")):
        with pytest.raises(ConfigError) as err:
            config_from_dict({**base, section: bad})
        assert name in str(err.value) and err.value.fix


# ---- the power cut between a group's commit and its ACKs ---------------------------------------------------------
@dataclass
class OutboxSite(FakeSite):
    """A fake gateway with an outbox: every update is kept until it is ACKed positively, and the un-ACKed ones are
    sent again before the answer to the next task (as the edge agent resends its outbox on reconnecting). Its
    round-1 update waits until every site has its task (``barrier``), so the updates reach the coordinator
    together."""

    barrier: threading.Barrier | None = None
    outbox: dict = field(default_factory=dict)
    ack_events: dict = field(default_factory=dict)

    def _on_task(self, topic: str, raw: bytes) -> None:
        env = Envelope.from_bytes(raw)
        verify(env, self.coordinator_public_key)
        task, weights = decode_task(env.payload)
        self.tasks.append(task)
        for old in list(self.outbox.values()):
            self.transport.publish(update_topic(self.fed, self.site_id), old)
        update = self.envelope(task.round, task.model_hash, self.payload(
            {k: np.full_like(v, self.value) for k, v in weights.items()}))
        self.outbox[task.round] = update
        if task.round == 1 and self.barrier is not None:
            self.barrier.wait(60)
        self.transport.publish(update_topic(self.fed, self.site_id), update)

    def _on_ack(self, topic: str, raw: bytes) -> None:
        env = Envelope.from_bytes(raw)
        verify(env, self.coordinator_public_key)
        ack = decode_ack(env.payload)
        self.acks.append(ack)
        if ack.accepted:
            self.outbox.pop(ack.round, None)
        self.ack_events.setdefault(ack.round, threading.Event()).set()

    def wait_ack(self, round: int, timeout: float) -> bool:
        return self.ack_events.setdefault(round, threading.Event()).wait(timeout)


@pytest.mark.broker
def test_killed_between_group_commit_and_ack_the_updates_survive_and_count_once(tmp_path: Path,
                                                                               broker_url) -> None:  # noqa: F811
    # Prepare: two gateways whose round-1 updates arrive together; a group holds both (max 2, up to 1 s apart)
    fed = f"gcrash{uuid.uuid4().hex[:8]}"
    w0 = tiny_weights()
    cfg, cfg_path, key, store = prepare_federation(tmp_path, broker_url, fed, w0)
    cfg = cfg.model_copy(update={"group_commit": cfg.group_commit.model_copy(
        update={"max_updates": 2, "max_delay_s": 1.0})})
    save_config(cfg, cfg_path)
    barrier = threading.Barrier(2)
    transports, sites = [], []
    try:
        for sid, value, n in (("s1", 1.0, 10), ("s2", 4.0, 30)):  # FedAvg mean (10 * 1 + 30 * 4) / 40 = 3.25
            t = MqttTransport(broker_url, client_id=f"{fed}-{sid}")
            transports.append(t)
            site = OutboxSite(sid, t, key.public_key(), value=value, num_examples=n, events={LC: EVENT}, fed=fed,
                              barrier=barrier)
            site.attach()
            t.connect()
            SiteRegistry(store).enrol(sid, site.public_pem, {"capacity": n})
            sites.append(site)

        # Execute 1: the coordinator commits the group of both updates, then loses power before any ACK
        first = run_coordinator(cfg_path, "after_group_commit")
        assert first.returncode == -signal.SIGKILL, (first.returncode, first.stdout[-3000:], first.stderr[-3000:])
        # Assert 1: both committed (rows and blobs), nothing ACKed, round 1 still open, nothing charged or released
        rows = store.updates_for_round(1)
        assert sorted(r.site_id for r in rows) == ["s1", "s2"]
        assert all(store.get_blob(r.payload_sha256) for r in rows)
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "open")]
        assert all(s.acks == [] and sorted(s.outbox) == [1] for s in sites)
        with store.session() as db:
            assert db.query(LedgerRow).count() == 0
            assert db.query(ModelVersionRow).filter(ModelVersionRow.round >= 1).count() == 0

        # Execute 2: restart without the hook: round 1 is recovered from the committed rows, round 2 runs, and each
        # gateway re-sends its un-ACKed round-1 update on the round-2 task
        second = run_coordinator(cfg_path, None)
        assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-3000:])
        assert "recovered round 1: closed" in second.stdout
        for s in sites:
            assert s.wait_ack(1, 30) and s.wait_ack(2, 30)

        # Assert 2: the re-sent updates were recognised as the stored ones and re-ACKed positively; every update is
        # stored, charged and aggregated exactly once
        for s in sites:
            assert sorted((a.round, a.accepted, a.reason) for a in s.acks) == [
                (1, True, "duplicate: already stored"), (2, True, "stored")]
            assert s.outbox == {}
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "closed"), (2, "closed")]
        assert store.count_updates() == 4 and store.rejection_counts() == {"duplicate": 2}
        ledger = PrivacyLedger(store, target_delta=1e-5)
        for s in sites:
            assert ledger.events(s.site_id, LC) == [EVENT, EVENT]
            assert ledger.spent(s.site_id, LC) == pytest.approx(direct_epsilon(2), rel=1e-9)
        final, _ = decode_tensors(store.get_model(store.latest_model_hash()))
        for name, w in w0.items():  # two FedAvg steps of 3.25: round 1 counted once, not lost, not twice
            np.testing.assert_allclose(final[name], w + 2 * 3.25, rtol=1e-6)
    finally:
        for t in transports:
            t.close()
        store.dispose()
