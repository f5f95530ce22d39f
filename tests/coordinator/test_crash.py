"""Crash safety of the ledger (docs/transport.md, "Exactly-once effect"): a coordinator process is SIGKILLed between
receiving a round's updates and publishing the model derived from them, then restarted. The ledger holds every spend
exactly once, the round completes from the durably stored updates (no update lost, none aggregated twice), and the spend
equals dp-accounting composed directly.

The coordinator runs as a real subprocess (``python -m coordinator.cli run``) over the real Mosquitto on
127.0.0.1:1883 (or a private one, see tests/coordinator/test_mqtt.py), with fake sites in this process. The kill
comes from the test-only hook ``WILDFED_TEST_CRASH_AT`` (coordinator/rounds.py), which SIGKILLs the process at
``after_ingest`` (updates stored and ACKed, ledger not written) or ``after_ledger`` (ledger written, model not yet
stored)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.codec import decode_tensors, encode_tensors, model_hash
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, save_private_key, save_public_key

from coordinator.config import save_config
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import LedgerRow, ModelVersionRow, Store
from coordinator.transport.mqtt import MqttTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights
from tests.coordinator.test_mqtt import broker_url  # noqa: F401 - the broker fixture (skips without a broker)

pytestmark = pytest.mark.broker  # about 5 s per case: not marked slow

ROOT = Path(__file__).resolve().parents[2]
LC = IUCNCategory.LC
SITES = (("s1", 1.0, 10), ("s2", 4.0, 30))  # (site, delta value, N): FedAvg mean (10*1 + 30*4)/40 = 3.25


def direct_epsilon(rounds: int) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for _ in range(rounds):
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            EVENT.sampling_rate, dp_accounting.GaussianDpEvent(EVENT.noise_multiplier)), EVENT.steps))
    return acc.get_epsilon(1e-5)


def prepare_federation(tmp_path: Path, broker_url: str, fed: str, weights):
    """A coordinator config (2 rounds, quorum 1, 30 s deadline) saved as YAML, its key pair on disk, and a store
    holding the round-0 model ``weights``; returns ``(config, config path, key, store)``."""
    cfg = make_config(tmp_path, federation_id=fed, broker_url=broker_url, rounds=2, round_deadline_s=30.0,
                      quorum_fraction=1.0, ship_ort_artifacts=False)
    cfg_path = save_config(cfg, tmp_path / "coordinator.yaml")
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    store.put_model(model_hash(weights), encode_tensors(weights), round=0)
    return cfg, cfg_path, key, store


def subprocess_env(crash_at: str | None) -> dict[str, str]:
    """The environment of a coordinator or gateway subprocess: this checkout on PYTHONPATH, wide rich output, and
    the test-only crash hook set to ``crash_at`` (or cleared)."""
    env = {k: v for k, v in os.environ.items() if k != "WILDFED_TEST_CRASH_AT"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"
    if crash_at is not None:
        env["WILDFED_TEST_CRASH_AT"] = crash_at
    return env


def run_coordinator(cfg_path: Path, crash_at: str | None) -> subprocess.CompletedProcess:
    """``python -m coordinator.cli run`` as a real process, killed by the hook at ``crash_at`` if given."""
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "run", "--config", str(cfg_path)], cwd=ROOT,
                          env=subprocess_env(crash_at), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("crash_at", ["after_ingest", pytest.param("after_ledger", marks=pytest.mark.slow)])
def test_sigkill_between_ingest_and_publish_charges_each_spend_once(tmp_path, broker_url, crash_at):  # noqa: F811
    # Prepare: config, coordinator key, round-0 model and two enrolled fake sites listening on the broker
    fed = f"crash{uuid.uuid4().hex[:8]}"
    w0 = tiny_weights()
    cfg, cfg_path, key, store = prepare_federation(tmp_path, broker_url, fed, w0)
    transports, sites = [], []
    try:
        for sid, value, n in SITES:
            t = MqttTransport(broker_url, client_id=f"{fed}-{sid}")
            transports.append(t)
            site = FakeSite(sid, t, key.public_key(), value=value, num_examples=n, events={LC: EVENT}, fed=fed)
            site.attach()
            t.connect()
            SiteRegistry(store).enrol(sid, site.public_pem, {"capacity": n})
            sites.append(site)

        # Execute 1: the coordinator dies at the hook in round 1
        first = run_coordinator(cfg_path, crash_at)
        assert first.returncode == -signal.SIGKILL, (first.returncode, first.stdout, first.stderr)
        # Assert 1: updates durable, round still open, no model derived from them; ledger written iff after_ledger
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "open")]
        assert store.count_updates() == 2
        with store.session() as db:
            ledger_rows = db.query(LedgerRow).count()
            assert db.query(ModelVersionRow).filter(ModelVersionRow.round >= 1).count() == 0
        assert ledger_rows == (2 if crash_at == "after_ledger" else 0)
        # (The sites' ACKs are not asserted: the kill may come before paho flushed them. A real gateway then re-sends
        # from its outbox and gets a "duplicate: already stored" re-ACK; nothing is charged or aggregated twice.)

        # Execute 2: restart without the hook; it recovers round 1 and runs round 2
        second = run_coordinator(cfg_path, None)
        assert second.returncode == 0, (second.stdout, second.stderr)
        assert "recovered round 1: closed" in second.stdout
        assert "round 2 closed: 2/2 updates, model " in second.stdout  # a line per round when not on a terminal

        # Assert 2: every spend exactly once, equal to dp-accounting composed directly
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "closed"), (2, "closed")]
        with store.session() as db:
            rows = sorted((r.site_id, r.round, r.category) for r in db.query(LedgerRow).all())
        # each round's charge once per cohort of records that trained in it: round 1's cohort in rounds 1 and 2,
        # round 2's in round 2
        assert rows == sorted((f"{sid}@c{c}", r, "LC") for sid, _, _ in SITES for c, r in ((1, 1), (1, 2), (2, 2)))
        ledger = PrivacyLedger(store, target_delta=1e-5)
        for sid, _, _ in SITES:
            assert ledger.events(sid, LC) == [EVENT, EVENT]
            assert ledger.spent(sid, LC) == pytest.approx(direct_epsilon(2), rel=1e-9)
            assert ledger.spent(sid, LC) < direct_epsilon(3)
        # round 1 aggregated once (not lost, not twice): two FedAvg steps of 3.25
        final, _ = decode_tensors(store.get_model(store.latest_model_hash()))
        for name, w in w0.items():
            np.testing.assert_allclose(final[name], w + 2 * 3.25, rtol=1e-6)
        r1 = store.rounds()[0].new_model_hash
        assert all([t.round for t in site.tasks] == [1, 2] and site.tasks[1].model_hash == r1 for site in sites)
        assert store.count_updates() == 4
    finally:
        for t in transports:
            t.close()
        store.dispose()


@pytest.mark.slow  # about 21 s
def test_sigkill_after_charging_a_global_dp_round_charges_it_once(tmp_path, broker_url):  # noqa: F811
    # Prepare: Global DP; three fake sites run the real secure-aggregation client over the broker
    from tests.coordinator.helpers import SecAggSite

    fed = f"crashg{uuid.uuid4().hex[:8]}"
    cfg = make_config(tmp_path, federation_id=fed, broker_url=broker_url, rounds=2, round_deadline_s=30.0,
                      privacy="global", local_steps=1, expected_batch_size=4, ship_ort_artifacts=False,
                      secagg={"stage_timeout_s": 20.0})
    cfg_path = save_config(cfg, tmp_path / "coordinator.yaml")
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    w0 = tiny_weights()
    store.put_model(model_hash(w0), encode_tensors(w0), round=0)
    transports = []
    try:
        for sid in ("a", "b", "c"):
            t = MqttTransport(broker_url, client_id=f"{fed}-{sid}")
            transports.append(t)
            site = SecAggSite(sid, t, key.public_key(), value=0.5, num_examples=8, categories=["LC"], fed=fed)
            t.connect()
            SiteRegistry(store).enrol(sid, site.public_pem, {"capacity": 8, "categories": ["LC"]})

        # Execute 1: killed after the survivors were charged, before the sum was unmasked
        first = run_coordinator(cfg_path, "after_ledger")
        assert first.returncode == -signal.SIGKILL, (first.returncode, first.stdout, first.stderr)
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "open")]
        with store.session() as db:
            assert sorted((r.site_id, r.round) for r in db.query(LedgerRow).all()) == [("a@c1", 1), ("b@c1", 1), ("c@c1", 1)]
            assert db.query(ModelVersionRow).filter(ModelVersionRow.round >= 1).count() == 0

        # Execute 2: restart; round 1 cannot be finished (secagg state was in memory) and is marked failed
        second = run_coordinator(cfg_path, None)
        assert second.returncode == 0, (second.stdout, second.stderr)

        # Assert: round 1 failed, round 2 closed; each round charged exactly once per site
        assert [(r.round, r.status) for r in store.rounds()] == [(1, "failed"), (2, "closed")]
        assert "stopped during secure aggregation" in store.rounds()[0].detail
        with store.session() as db:
            rows = sorted((r.site_id, r.round, r.category, r.steps) for r in db.query(LedgerRow).all())
        assert rows == sorted((f"{sid}@c{c}", r, "LC", 1) for sid in ("a", "b", "c") for c, r in ((1, 1), (1, 2), (2, 2)))
        ledger = PrivacyLedger(store, target_delta=1e-5)
        budget = cfg.budgets()[LC]
        for sid in ("a", "b", "c"):
            z, q = ledger.events(sid, LC)[0].noise_multiplier, ledger.events(sid, LC)[0].sampling_rate
            # at most B / N = 4 / 8: LC is sampled at the rate its budget allows at the round's one z (planned for
            # the federation's largest budget, NE)
            assert 0 < q < 0.5
            acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 2)
            assert ledger.spent(sid, LC) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
            assert ledger.spent(sid, LC) <= budget * (1 + 1e-9)
        with store.session() as db:
            assert db.query(ModelVersionRow).filter(ModelVersionRow.round >= 1).count() == 1  # round 2's only
    finally:
        for t in transports:
            t.close()
        store.dispose()
