"""Satellite-like links over the real broker with buffered rounds (wildfed_sim/link_driver.py, link_relay.py;
docs/transport.md "Buffered rounds"): real gateway processes, each behind its own link relay to Mosquitto, an
in-process coordinator, and a link driver that plays satellite passes in compressed time.

Four gateways (the tiny Camtrap DP package, capacity 3) train a buffered federation: K = 2 updates close a round.
Passes are 10 simulated minutes every 40 at one simulated minute = 0.25 s (2.5 s online every 10 s), each gateway at
its own phase, and every reply leaves 3 s after its task (``round_duration_s``): longer than a window, so every
update waits in its gateway's outbox for the next pass, and a round closes with the first two while the others
are still on their way, which makes them stale by construction. Asserted from the coordinator's database and model
files, with the gateways stopped:

- at least one stale update was folded into a later round;
- every stored update is folded into exactly one closed round, or waits (it arrived after the last round): each
  round's new model equals its base plus ``sum s(t) n delta / (K n_bar)`` over the round's own updates and the
  stale ones it claimed, from the stored blobs (a double or a missing fold would break the equality);
- nothing charged is discarded: every (site, round) the ledger charged has a stored update, and none was late;
- the links were really cut: every gateway was online well under half the time and its relay cut connections.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from shared.codec import decode_tensors
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key

from coordinator.ledger_streams import base_site
from coordinator.service import Coordinator
from coordinator.storage import BufferedUpdateRow, LedgerRow, RejectionRow, UpdateRow
from tests.test_buffered_e2e import expected_step
from tests.test_faults import gateway_config, mqtt_url, write_site  # noqa: F401 - mqtt_url: fixture
from wildfed_sim.gateway_processes import spawned_gateways
from wildfed_sim.link_driver import LinkDriver, RelayGate
from wildfed_sim.link_models import SatellitePasses
from wildfed_sim.link_relay import LinkRelay

pytestmark = [pytest.mark.slow, pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[1]
SITES, K, CAPACITY, ROUNDS = ("s1", "s2", "s3", "s4"), 2, 3, 4
MINUTE_S, PASSES = 0.25, SatellitePasses(window=10.0, period=40.0)


class _Quiet:
    def log(self, *args: object) -> None:
        pass


def test_buffered_rounds_under_satellite_passes_fold_stale_updates_and_discard_nothing(
        tmp_path: Path, mqtt_url: str, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{__import__('os').environ.get('PYTHONPATH', '')}")
    fed = f"flink{uuid.uuid4().hex[:8]}"
    key = generate_signing_key()
    cfg = gateway_config(tmp_path / "coord", mqtt_url, federation_id=fed, rounds=ROUNDS, round_deadline_s=60.0,
                         round_duration_s=3.0, buffered={"buffer_size": K, "max_staleness": 10})
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    relays = [LinkRelay(mqtt_url) for _ in SITES]
    paths, pems = [], []
    for sid, relay in zip(SITES, relays):
        path, site_key = write_site(tmp_path / sid, fed=fed, site_id=sid, coordinator_key=key, broker_url=relay.url,
                                    resend_interval_s=5.0)
        paths.append(path)
        pems.append(public_key_to_pem(site_key.public_key()))
    (tmp_path / "logs").mkdir()
    (tmp_path / "ready").mkdir()
    driver = None
    try:
        with Coordinator(cfg) as coord:
            for sid, pem in zip(SITES, pems):
                coord.enrol(sid, pem, {"capacity": CAPACITY, "categories": ["VU", "NT"]})
            with spawned_gateways(paths, tmp_path / "logs", tmp_path / "ready") as gateways:
                gateways.wait_ready(_Quiet(), timeout_s=180.0)
                schedules = [PASSES.schedule(7, g, 10_000.0) for g in range(len(SITES))]
                driver = LinkDriver([RelayGate(r) for r in relays], schedules, minute_s=MINUTE_S,
                                    horizon_min=10_000.0)
                driver.start()
                try:
                    results = list(coord.iter_rounds())
                finally:
                    applied = driver.stop()  # every link up before the gateways stop
            store = coord.store
            # Assert (gateways stopped, nothing in flight)
            assert [r.status for r in results[:ROUNDS]] == ["closed"] * ROUNDS, results
            # the run's last round sends no task and folds what came after round ROUNDS (when anything did)
            assert len(results) <= ROUNDS + 1 and all(r.selected == () for r in results[ROUNDS:]), results
            with store.session() as s:
                claimed = {r.update_id: r.buffer_round for r in s.scalars(select(BufferedUpdateRow))}
                rows = {r.id: (r.site_id, r.round) for r in s.scalars(select(UpdateRow))}
                charged = {(base_site(r.site_id), r.round) for r in s.scalars(select(LedgerRow))}
                late = list(s.scalars(select(RejectionRow).where(RejectionRow.reason == "late")))
            closed = {r.round: r for r in store.rounds() if r.status == "closed"}
            folded = [i for i, r in claimed.items() if r is not None]
            assert folded, f"no stale update was folded: {results}"
            assert all(claimed[i] in closed and claimed[i] > rows[i][1] for i in folded)
            for i, (site, r) in rows.items():  # folded into its own closed round, a later closed one, or waits
                assert (claimed[i] is None or claimed[i] in closed) if i in claimed else r in closed, (site, r)
            assert sum(len(r.stale) for r in results) == len(folded)
            for r, row in closed.items():  # exactly once: each round's step is its own and claimed updates' sum
                before, _ = decode_tensors(store.get_model(row.base_model_hash))
                after, _ = decode_tensors(store.get_model(row.new_model_hash))
                for name, step in expected_step(store, r, k=K, capacity=CAPACITY).items():
                    np.testing.assert_allclose(after[name], before[name] + step, rtol=1e-5, atol=1e-6,
                                               err_msg=f"round {r}, {name}")
            assert charged <= set(rows.values()) and late == [], (charged - set(rows.values()), late)
            assert all(a.applied_fraction < 0.5 for a in applied), [a.applied_fraction for a in applied]
            assert all(relay.cuts >= 1 for relay in relays) and driver.error is None
    finally:
        if driver is not None:
            driver.stop()
        for relay in relays:
            relay.close()
