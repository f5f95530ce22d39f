"""The time padding of a round's replies (edge_sdk.privacy.timing): the slot rule by hand, the pacer on an injected
clock, two real agents whose records differ 500-fold releasing in the same slot, a Global DP round's shares held to
the slot, the site's floor on the padding, and the real loop reading ACKs while an update waits."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind, seal
from shared.errors import ConfigError, PayloadError
from shared.iucn import IUCNCategory as Cat
from shared.keys import load_private_key, load_public_key
from shared.models.kinds import model_spec
from shared.protocol import (SITE_STAGES, SecAggMessage, SecAggSettings, TrainingTask, decode_secagg, decode_task,
                             encode_secagg, encode_task)
from shared.secagg import AdvertisedKeys, SecAggClient, SecAggServer
from shared.topics import ack_topic, secagg_filter, updates_filter

from coordinator.config import config_from_dict

from edge_sdk.agent import EdgeAgent
from edge_sdk.backends.base import create_backend
from edge_sdk.config import load_site_config
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.timing import RoundPacer, release_time
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from tests.gateway_backend import needs_torch

from .test_agent import FED, SITE, make_site

E = 8  # embedding width of the small head model these tests train
SPEC = model_spec("head", 2, adapter_width=0, embedding_dim=E)


class FakeClock:
    """Monotonic seconds that move only when told to (by the test, or by the backend's work)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def clocked_backend(clock: FakeClock, cost_s: float):  # noqa: ANN201 - a TorchBackend subclass made here
    """The real torch backend whose per-example work costs ``cost_s`` seconds of the fake clock per record: a
    round's duration is then a known function of how many records it sampled, as on a real gateway. Its
    ``records_seen`` counts the records it was asked about."""
    from edge_sdk.backends.torch_backend import TorchBackend

    class ClockedBackend(TorchBackend):
        def __init__(self) -> None:
            super().__init__(model=SPEC)
            self.clock, self.cost_s, self.records_seen = clock, cost_s, 0

        def per_example(self, x, y, **kwargs):
            self.clock.advance(self.cost_s * len(y))
            self.records_seen += len(y)
            return super().per_example(x, y, **kwargs)

    return ClockedBackend()


def records(n_cr: int, n_nt: int) -> LocalDataset:
    rng = np.random.default_rng(n_cr + n_nt)
    n = n_cr + n_nt
    return LocalDataset(labels=np.arange(n, dtype=np.int64) % 2,
                        categories=np.array([Cat.CR.rank] * n_cr + [Cat.NT.rank] * n_nt, np.int8),
                        media_ids=tuple(f"m{i}" for i in range(n)),
                        features=rng.standard_normal((n, E)).astype(np.float32))


# ---- the slot rule -------------------------------------------------------------------------------------------
def test_release_time_is_the_first_slot_boundary_after_the_work() -> None:
    # accepted at 100 s, D = 10 s: work ending anywhere in (100, 110] leaves at 110; just over, at 120
    assert release_time(100.0, 100.001, 10.0) == 110.0
    assert release_time(100.0, 109.999, 10.0) == 110.0
    assert release_time(100.0, 110.0, 10.0) == 110.0
    assert release_time(100.0, 110.001, 10.0) == 120.0
    assert release_time(100.0, 135.0, 10.0) == 140.0
    assert release_time(100.0, 100.0, 10.0) == 110.0  # k >= 1 even for no work at all
    assert release_time(100.0, 103.5, 0.0) == 103.5  # D = 0: no padding
    with pytest.raises(ValueError, match="round_duration_s"):
        release_time(0.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="round_duration_s"):
        release_time(0.0, 1.0, math.inf)


def test_pacer_holds_releases_in_order_and_moves_a_missed_slot_to_the_next_boundary() -> None:
    clock, stats, sent = FakeClock(0.0), Counter(), []
    pacer = RoundPacer(clock=clock, tolerance_s=1.0, stats=stats)
    pacer.begin(1, 10.0)
    clock.advance(3.0)
    assert pacer.release(1, lambda: sent.append("a")) is True and pacer.release(1, lambda: sent.append("b"))
    assert sent == [] and pacer.pending() and pacer.wait_s(60.0) == 7.0 and pacer.wait_s(0.1) == 0.1
    clock.advance(6.9)
    assert pacer.run_due() == 0 and sent == []
    clock.advance(0.1)  # t = 10: the slot
    assert pacer.wait_s(0.1) == 0.0 and pacer.run_due() == 2 and sent == ["a", "b"] and not pacer.pending()
    clock.advance(25.0)  # later messages of the round (a secure-aggregation stage) are answered at once
    assert pacer.release(1, lambda: sent.append("c") or True) is True and sent[-1] == "c"
    assert stats == Counter(rounds_padded=1)
    # round 2: the loop gets to the waiting release 2.5 s after its slot (> tolerance): it waits for the next one
    pacer.begin(2, 10.0)
    started = clock()
    pacer.release(2, lambda: sent.append("d"))
    clock.advance(12.5)
    assert pacer.run_due() == 0 and sent[-1] == "c" and stats["releases_late"] == 1
    assert pacer.wait_s(60.0) == pytest.approx(7.5)
    clock.advance(7.5)
    assert pacer.run_due() == 1 and sent[-1] == "d" and clock() - started == pytest.approx(20.0)
    # round 3: work that overruns D by 0.5 s leaves at 2 D, and the overrun is counted
    pacer.begin(3, 10.0)
    clock.advance(10.5)
    assert pacer.ready(3) == pytest.approx(clock() + 9.5) and stats["rounds_overran"] == 1
    # D = 0 or a round never begun: at once, and the action's own answer is returned
    pacer.begin(4, 0.0)
    assert pacer.release(4, lambda: False) is False and pacer.release(99, lambda: 1) is True


# ---- two real agents -----------------------------------------------------------------------------------------
def _agent(tmp_path: Path, broker: InMemoryBroker, clock: FakeClock, dataset: LocalDataset, *,
           cost_s: float = 0.001, site_yaml: dict | None = None) -> tuple[EdgeAgent, object]:
    if site_yaml:
        cfg = yaml.safe_load((tmp_path / "site.yaml").read_text())
        (tmp_path / "site.yaml").write_text(yaml.safe_dump({**cfg, **site_yaml}))
    config = load_site_config(tmp_path / "site.yaml")
    backend = clocked_backend(clock, cost_s)
    agent = EdgeAgent(config=config, transport=InMemoryTransport(broker),
                      signing_key=load_private_key(config.private_key),
                      coordinator_key=load_public_key(config.coordinator_public_key), dataset=dataset,
                      backend=backend, clock=clock)
    agent.start()
    return agent, backend


def _time_to_update(tmp_path: Path, dataset: LocalDataset, duration_s: float) -> tuple[float, int, Counter]:
    """Fake-clock seconds from handing the agent a round-1 task to the coordinator receiving its update, and the
    records the round's steps touched."""
    broker, clock = InMemoryBroker(), FakeClock()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    coordinator.weights = SPEC.initial_weights(0)
    arrivals: list[float] = []
    coordinator.transport.subscribe(updates_filter(FED), lambda t, raw: arrivals.append(clock())
                                    if Envelope.from_bytes(raw).header.kind == MessageKind.UPDATE else None)
    agent, backend = _agent(tmp_path, broker, clock, dataset)
    try:
        received = clock()
        assert agent.handle_task(coordinator.task(1, round_duration_s=duration_s, expected_batch_size=100_000,
                                                  local_steps=2)) is True
        while not arrivals and clock() - received < 60:  # the loop's turns, 50 ms of fake time apart
            agent.ctx.pacer.run_due()
            if not arrivals:
                clock.advance(0.05)
        assert len(arrivals) == 1
        return arrivals[0] - received, backend.records_seen, agent.stats
    finally:
        agent.close()


@needs_torch  # the agent trains with a torch backend on the fake clock
def test_sites_with_10_and_5000_records_release_their_updates_in_the_same_slot(tmp_path: Path) -> None:
    # Prepare: 10 records (5 CR, 5 NT) against 5,000 (1,000 CR, 4,000 NT); every NT record is sampled (B far above
    # N: q = 1) and each costs 1 ms of the fake clock, so the small site's two steps take about 10 ms and the big
    # site's several seconds
    small, big = records(5, 5), records(1000, 4000)
    # Without padding the arrival time is a function of the counts (this is the leak)
    bare = [_time_to_update(tmp_path / f"bare{i}", data, 0.0) for i, data in enumerate((small, big))]
    assert bare[1][1] > 100 * bare[0][1] and bare[1][0] > 100 * bare[0][0] and bare[1][0] > 4.0
    # Execute: D = 10 s
    padded = [_time_to_update(tmp_path / f"pad{i}", data, 10.0) for i, data in enumerate((small, big))]
    # Assert: both arrive in the first slot, within the loop's 50 ms turn of its boundary, and nothing overran
    for elapsed, seen, stats in padded:
        assert 10.0 <= elapsed < 10.05 and math.floor(elapsed / 10.0) == 1
        assert stats["rounds_padded"] == 1 and stats["rounds_overran"] == 0
    assert padded[1][1] > 100 * padded[0][1]  # the work differed as much as without padding


@needs_torch  # the agent trains with a torch backend on the fake clock
def test_work_longer_than_the_duration_is_released_at_a_later_boundary(tmp_path: Path) -> None:
    elapsed, seen, stats = _time_to_update(tmp_path, records(1000, 4000), 2.0)
    work = seen * 0.001
    k = math.ceil(work / 2.0)
    assert k >= 2 and 2.0 * k <= elapsed < 2.0 * k + 0.05  # the boundary after the work, not before
    assert stats["rounds_overran"] == 1


@needs_torch  # the agent trains with a torch backend on the fake clock
def test_global_dp_shares_wait_for_the_slot_while_the_keys_leave_at_once(tmp_path: Path) -> None:
    broker, clock = InMemoryBroker(), FakeClock()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    coordinator.weights = SPEC.initial_weights(0)
    said: list[tuple[str, float]] = []
    bodies: list[dict] = []

    def on_secagg(topic: str, raw: bytes) -> None:
        message = decode_secagg(Envelope.from_bytes(raw).payload, stages=SITE_STAGES)
        said.append((message.stage, clock()))
        bodies.append(dict(message.body))

    coordinator.transport.subscribe(secagg_filter(FED), on_secagg)
    agent, _ = _agent(tmp_path, broker, clock, records(200, 800), site_yaml={"allow_global_dp": True})
    d = sum(w.size for w in coordinator.weights.values())
    settings = SecAggSettings(site_ids=("site-0", SITE), threshold=2, vector_length=d, max_abs_value=4.0,
                              scale=2.0 ** 20)
    task = coordinator.task(1, privacy="global", local_steps=1, expected_batch_size=100_000, secagg=settings,
                            noise_multiplier=1e4, round_duration_s=30.0)
    received = clock()
    assert agent.handle_task(task) is True
    assert [s for s, _ in said] == ["keys"] and said[0][1] == received  # before any record was read
    assert clock() - received > 0.5  # the sum took fake time: 1,000 records at 1 ms
    # the key list arrives while the round waits: the shares are computed and sent at the slot, not now
    params = settings.params(FED, 1)
    peer = SecAggClient("site-0", params)
    keys = SecAggServer(params).collect_keys([peer.public_keys(), AdvertisedKeys.from_json(bodies[0])])
    env = seal(private_key=coordinator.key, federation_id=FED, site_id=SITE, round=1,
               base_model_hash=model_hash(coordinator.weights), kind=MessageKind.SECAGG, sequence=1,
               payload=encode_secagg(SecAggMessage("key_list", {"keys": [k.to_json() for k in keys.values()]})))
    assert agent.handle_secagg(env.to_bytes()) is True and [s for s, _ in said] == ["keys"]
    while len(said) < 2 and clock() - received < 60:
        clock.advance(0.05)
        agent.ctx.pacer.run_due()
    assert [s for s, _ in said] == ["keys", "shares"] and 30.0 <= said[1][1] - received < 30.05
    agent.close()


@needs_torch  # the agent trains with a torch backend on the fake clock
def test_a_task_padding_less_than_the_sites_floor_is_refused(tmp_path: Path) -> None:
    broker, clock = InMemoryBroker(), FakeClock()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    coordinator.weights = SPEC.initial_weights(0)
    agent, _ = _agent(tmp_path, broker, clock, records(1, 2), site_yaml={"min_round_duration_s": 60})
    try:
        assert agent.handle_task(coordinator.task(1, round_duration_s=30.0)) is False
        assert agent.stats["rejected:round_duration_too_short"] == 1 and agent.ctx.last_round() == -1
        assert agent.handle_task(coordinator.task(1, round_duration_s=60.0)) is True  # held, not yet sent
        assert agent.ctx.pacer.pending()
    finally:
        agent.close()


def test_round_duration_travels_in_the_task_and_is_checked() -> None:
    fields = {"federation_id": "f", "round": 1, "model_hash": "0" * 64, "local_steps": 1, "expected_batch_size": 2,
              "learning_rate": 0.1, "clipping_norm": 1.0, "target_delta": 1e-5, "planned_rounds": 2,
              "privacy": "ccdp", "budgets": {Cat.NT: 1.0}}
    weights = SPEC.initial_weights(0)
    task = TrainingTask(**fields, round_duration_s=300)
    assert decode_task(encode_task(task, weights))[0].round_duration_s == 300.0
    assert "round_duration_s" not in TrainingTask(**fields).to_json()  # the default leaves the JSON as it was
    for bad in (-1.0, math.nan, math.inf, True, "300"):
        with pytest.raises(PayloadError, match="round_duration_s"):
            TrainingTask(**fields, round_duration_s=bad)


def test_coordinator_refuses_a_duration_that_outlasts_the_round() -> None:
    base = {"federation_id": "f", "round_deadline_s": 600}
    assert config_from_dict({**base, "round_duration_s": 300}).round_duration_s == 300.0
    with pytest.raises(ConfigError, match="round_duration_s"):
        config_from_dict({**base, "round_duration_s": 600})


# ---- the real loop -------------------------------------------------------------------------------------------
@needs_torch  # the agent trains with a torch backend on the fake clock
def test_the_loop_reads_an_ack_while_the_update_waits_for_its_slot(tmp_path: Path) -> None:
    # Prepare: an update of round 0 waits in the outbox for its ACK; the coordinator acks nothing by itself
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    coordinator.weights = SPEC.initial_weights(0)
    coordinator.ack = False
    seen: list[tuple[MessageKind, int, float]] = []
    got_update, got_receipt = threading.Event(), threading.Event()

    def on_message(topic: str, raw: bytes) -> None:
        header = Envelope.from_bytes(raw).header
        seen.append((header.kind, header.round, time.monotonic()))
        (got_update if (header.kind, header.round) == (MessageKind.UPDATE, 1) else got_receipt
         if header.kind == MessageKind.RECEIPT else threading.Event()).set()

    coordinator.transport.subscribe(updates_filter(FED), on_message)
    config = load_site_config(tmp_path / "site.yaml")
    agent = EdgeAgent(config=config, transport=InMemoryTransport(broker),
                      signing_key=load_private_key(config.private_key),
                      coordinator_key=load_public_key(config.coordinator_public_key), dataset=records(1, 2),
                      backend=create_backend("torch", model=SPEC))
    old = seal(private_key=agent.ctx.signing_key, federation_id=FED, site_id=SITE, round=0,
               base_model_hash="0" * 64, kind=MessageKind.UPDATE, sequence=agent.ctx.next_sequence(), payload=b"x")
    agent.outbox.put("update/0", agent.uploader.topic, old.to_bytes())
    agent.start()
    runner = threading.Thread(target=agent.run, kwargs={"max_rounds": 1, "idle_timeout_s": 60})
    runner.start()
    try:
        assert got_receipt.wait(30)  # connected: the loop resent update/0 and asked for the open round
        got_receipt.clear()
        # Execute: the task (D = 2 s), then at once the ACK of round 0
        sent = time.monotonic()
        coordinator.send(coordinator.task(1, round_duration_s=2.0))
        coordinator.transport.publish(ack_topic(FED, SITE), coordinator.sealed_ack(0, sequence=old.header.sequence)
                                      .to_bytes())
        # Assert: the ACK was handled (update/0 dropped, the drained outbox asked for the next round's task) while
        # round 1's update still waited, and the update left no earlier than D after the task
        assert got_receipt.wait(30) and not got_update.is_set()
        assert got_update.wait(30)
        update_at = next(t for kind, r, t in seen if (kind, r) == (MessageKind.UPDATE, 1))
        receipt_at = max(t for kind, _, t in seen if kind == MessageKind.RECEIPT)
        assert receipt_at < update_at and update_at - sent >= 2.0
        assert agent.stats["acks_accepted"] == 1
        coordinator.transport.publish(ack_topic(FED, SITE), coordinator.sealed_ack(
            1, sequence=coordinator.updates[-1].header.sequence).to_bytes())
        runner.join(30)
        assert not runner.is_alive() and agent.outbox.count() == 0
    finally:
        agent.stop()
        runner.join(30)
        agent.close()
