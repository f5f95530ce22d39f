"""No budget overrun after a coordinator crash (or any round that closed without some of
its updates).

The failure: ``RoundManager.recover`` closed a round left open by a crash at once; the gateways' updates for it came
afterwards and were charged as ``late``; the next round's halt check counted only what was already recorded, so the
site trained once more and its spend passed the budget (VU 1.1013 of 1.0 in the field trial). The fix: the halt
check counts every round whose task went out and whose charge can still arrive as spent, and the budget check is
repeated at close against what has been charged by then.

1. Through the real path: ``python -m coordinator.cli run`` as a real process over the real Mosquitto, SIGKILLed by
   the test-only hook ``WILDFED_TEST_CRASH_AT=after_publish`` once round 2's tasks are out; the site holds its round-2
   update, and sends it (late) only when round 3's task comes, after the restarted coordinator recovered round 2.
   VU's budget fits exactly 2 rounds of the site's event (checked with dp-accounting directly): the restarted
   coordinator must halt VU for round 3, so that VU's final spend (rounds 1 and the late 2) stays within budget,
   while NT (whose budget fits 3 rounds) trains on.
2. In process: an update admitted while its site's budget had room is refused at close (charged, not aggregated)
   when a late update of an earlier round, costlier than any prediction, was charged in between.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.codec import decode_tensors
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.topics import update_topic

from coordinator.config import save_config
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import LedgerRow, RejectionRow
from coordinator.transport.mqtt import MqttTransport
from tests.support import wait_for
from tests.coordinator.helpers import FakeSite, tiny_weights
from tests.coordinator.test_crash import ROOT, prepare_federation, subprocess_env
from tests.coordinator.test_mqtt import broker_url  # noqa: F401 - the broker fixture (skips without a broker)

VU, NT, LC = IUCNCategory.VU, IUCNCategory.NT, IUCNCategory.LC
DELTA = 1e-5
# Budgets (the test config: from_anchor VU = 1.0, gamma = 1): VU 1.0, NT 4/3, LC 5/3.
EVENT = DPSGDEvent(noise_multiplier=1.45, sampling_rate=0.05, steps=5)


def direct_epsilon(rounds_of: list[DPSGDEvent]) -> float:
    """RDP epsilon at DELTA of the listed rounds, composed with dp-accounting directly (no WildFed code)."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for e in rounds_of:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            e.sampling_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier)), e.steps))
    return acc.get_epsilon(DELTA)


@dataclass
class LateSite(FakeSite):
    """A fake gateway that holds its update for the rounds in ``hold``: it trains them (the task is recorded) but
    sends the update only later, as a slow or disconnected gateway does, either just before answering the next
    task (``release_on_next_task``) or when the test calls :meth:`release`."""

    hold: set = field(default_factory=set)
    held: dict = field(default_factory=dict)  # round -> (model hash, events it ran)
    release_on_next_task: bool = False

    def _on_task(self, topic: str, raw: bytes) -> None:
        from shared.envelope import Envelope
        from shared.protocol import decode_task

        task, _ = decode_task(Envelope.from_bytes(raw).payload)
        if task.round in self.hold:
            self.tasks.append(task)
            self.held[task.round] = (task.model_hash, {c: e for c, e in self.events.items() if c not in task.halted})
            return
        if self.release_on_next_task:
            for r in sorted(self.held):
                self.release(r)
        super()._on_task(topic, raw)

    def release(self, round_: int, events: dict | None = None) -> None:
        """Send the held update of ``round_`` now (with ``events``, default the ones it ran)."""
        model_hash_, ran = self.held.pop(round_)
        delta = {k: np.full_like(v, self.value) for k, v in tiny_weights().items()}
        raw = self.envelope(round_, model_hash_, self.payload(delta, events=events if events is not None else ran))
        self.transport.publish(update_topic(self.fed, self.site_id), raw)


def run_coordinator(cfg_path: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    """``python -m coordinator.cli run`` as a real process (SIGKILLed by the hook at ``crash_at`` if given)."""
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "run", "--config", str(cfg_path), *args],
                          cwd=ROOT, env=subprocess_env(crash_at), capture_output=True, text=True, timeout=120)


def ledger_rounds(store, site: str, category: IUCNCategory) -> list[int]:
    with store.session() as db:
        return sorted(r.round for r in db.query(LedgerRow).filter(LedgerRow.site_id == site,
                                                                  LedgerRow.category == category.value))


@pytest.mark.slow  # about 14 s
def test_sigkill_with_tasks_out_then_late_updates_never_overrun_a_budget(tmp_path, broker_url):  # noqa: F811
    # Prepare: the budgets fit exactly 2 rounds of EVENT for VU and at least 3 for NT (dp-accounting directly)
    budget_vu, budget_nt = 1.0, 4.0 / 3.0
    assert direct_epsilon([EVENT] * 2) <= budget_vu < direct_epsilon([EVENT] * 3)
    assert direct_epsilon([EVENT] * 3) <= budget_nt
    fed = f"late{uuid.uuid4().hex[:8]}"
    cfg, cfg_path, key, store = prepare_federation(tmp_path, broker_url, fed, tiny_weights())
    save_config(cfg.model_copy(update={"rounds": 3}), cfg_path)
    transport = MqttTransport(broker_url, client_id=f"{fed}-s1")
    site = LateSite("s1", transport, key.public_key(), value=1.0, num_examples=10, events={VU: EVENT, NT: EVENT},
                    fed=fed, hold={2}, release_on_next_task=True)
    try:
        site.attach()
        transport.connect()
        SiteRegistry(store).enrol("s1", site.public_pem, {"capacity": 10, "categories": ["VU", "NT"]})

        # Execute 1: round 1 runs normally
        first = run_coordinator(cfg_path, "--rounds", "1")
        assert first.returncode == 0, (first.stdout, first.stderr)
        # Execute 2: round 2 opens, its task goes out, the coordinator is SIGKILLed; the site holds its update
        second = run_coordinator(cfg_path, "--rounds", "2", crash_at="after_publish")
        assert second.returncode == -signal.SIGKILL, (second.returncode, second.stdout, second.stderr)
        wait_for(lambda: 2 in site.held, 30, "the site to receive round 2's task")
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "closed"), (2, "open")]
        # Execute 3: restart: recover closes round 2 without updates; round 3's halt check must count round 2's
        # charge as still to come. The site then sends its late round-2 update, then its round-3 update.
        third = run_coordinator(cfg_path)
        assert third.returncode == 0, (third.stdout, third.stderr)
        assert "recovered round 2: failed" in third.stdout

        # Assert: round 3's task halted VU (and only VU) in the records of round 1's cohort, and said why; the
        # cohorts of rounds 2 and 3 train VU on
        assert [t.round for t in site.tasks] == [1, 2, 3]
        assert site.tasks[2].cohorts == {1: (VU,), 2: (), 3: ()} and site.tasks[2].halted == ()
        ledger = PrivacyLedger(store, target_delta=DELTA)
        (halt,) = ledger.halts("s1")
        assert (halt.site_id, halt.category, halt.round) == ("s1@c1", VU, 3) and "not yet charged" in halt.reason
        # the late round-2 update was charged; cohort 1's VU stops at 2 rounds, its NT ran 3
        assert ledger_rounds(store, "s1@c1", VU) == [1, 2]
        assert ledger_rounds(store, "s1@c1", NT) == [1, 2, 3]
        assert ledger_rounds(store, "s1@c2", VU) == [2, 3] and ledger_rounds(store, "s1@c3", VU) == [3]
        assert ledger.spent("s1", VU) == pytest.approx(direct_epsilon([EVENT] * 2), rel=1e-9)
        assert ledger.spent("s1", NT) == pytest.approx(direct_epsilon([EVENT] * 3), rel=1e-9)
        # spend never passes a budget
        assert ledger.spent("s1", VU) <= budget_vu and ledger.spent("s1", NT) <= budget_nt
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "closed"), (2, "failed"), (3, "closed")]
    finally:
        transport.close()
        store.dispose()


def test_close_refuses_an_update_that_a_late_charge_pushed_past_its_budget(federation):
    # Prepare: s1 (VU, +1, N 10) and s2 (LC, +4, N 30); quorum 1 of 2. Three rounds of EVENT1 fit VU's 1.0, but
    # EVENT1 + a costlier late event + EVENT1 do not (dp-accounting directly).
    event1, costly = DPSGDEvent(1.5, 0.05, 5), DPSGDEvent(1.0, 0.05, 5)
    assert direct_epsilon([event1] * 3) <= 1.0 < direct_epsilon([event1, costly, event1])
    coord, transport, key = federation(quorum_fraction=0.5, rounds=5)
    s1 = LateSite("s1", transport, key.public_key(), value=1.0, num_examples=10, events={VU: event1},
                  hold={2}).attach()
    s2 = FakeSite("s2", transport, key.public_key(), value=4.0, num_examples=30, events={LC: event1}).attach()
    for s in (s1, s2):
        coord.enrol(s.site_id, s.public_pem, {"capacity": s.num_examples})
    coord.start()
    w0 = tiny_weights()

    # Execute: round 1 both; round 2 only s2 (s1 holds its update); round 3 both answer, then s1's round-2 update
    # arrives late, charged with a costlier event than the halt check could predict
    assert coord.run_round().status == "closed"
    ctx2 = coord.rounds.open_round()
    r2 = coord.rounds.close_round(ctx2)
    assert (r2.status, r2.accepted) == ("closed", ("s2",))
    ctx3 = coord.rounds.open_round()
    assert set(ctx3.accepted) == {"s1", "s2"}  # both admitted: s1's recorded spend had room
    s1.release(2, {VU: costly})
    r3 = coord.rounds.close_round(ctx3)

    # Assert: s1's round-3 update was charged (the coordinator saw it) but not aggregated: round 3 is s2's alone
    assert (r3.status, r3.accepted) == ("closed", ("s2",))
    final, _ = decode_tensors(coord.store.get_model(r3.model_hash))
    for name, w in w0.items():  # FedAvg: round 1 (10*1 + 30*4)/40 = 3.25, rounds 2 and 3 s2's +4 alone
        np.testing.assert_allclose(final[name], w + 3.25 + 4.0 + 4.0, rtol=1e-6)
    assert ledger_rounds(coord.store, "s1@c1", VU) == [1, 2, 3]  # the records that joined in round 1
    with coord.store.session() as db:
        rows = db.query(RejectionRow).filter(RejectionRow.round == 3, RejectionRow.site_id == "s1").all()
        assert [r.reason for r in rows] == ["over_budget"] and "at close" in rows[0].detail
