"""Buffered rounds end to end (docs/transport.md "Buffered rounds"): real gateway processes and a real coordinator
process on Mosquitto, a gateway that goes offline mid-upload and comes back rounds later, and a coordinator
SIGKILLed while a stale update waits in its buffer.

Three gateways (the tiny Camtrap DP package, capacity 3) train a buffered federation: K = 2 updates close a round,
max_staleness 4. Gateway g3 dies after two chunks of its round-1 update (``WILDFED_TEST_CRASH_AT=mid_upload``) and
is restarted once round 2 has closed: it resumes the upload, which is now stale. The coordinator, started with
``WILDFED_TEST_CRASH_AT=after_buffered``, SIGKILLs itself as soon as a stale update is stored and ACKed; it is
restarted and runs the federation to its eighth round (updates leave 2 s after their task, so a round takes
at least that long), and once the gateways have gone quiet one more round folds
whatever still waits. Asserted from the coordinator's database and model files:

- every stored update is folded into exactly one closed round: each round's new model equals its base plus
  ``sum s(t) n delta / (max(K, m) n_bar)`` over the round's own updates (t = 0) and the stale ones it claimed, computed here
  from the stored blobs (a double or a missing fold would break the equality);
- nothing charged is discarded: the (site, round) pairs the ledger charged are exactly the stored updates' pairs,
  and no update was refused as late;
- the stale update that waited across the kill was folded once, by the round that closed after the restart.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml
from sqlalchemy import select

from shared.codec import decode_tensors
from shared.keys import public_key_to_pem, save_private_key, save_public_key, generate_signing_key
from shared.protocol import decode_update

from coordinator.config import save_config
from coordinator.ledger_streams import base_site
from coordinator.registry import SiteRegistry
from coordinator.storage import BufferedUpdateRow, LedgerRow, RejectionRow, Store, UpdateRow
from tests.coordinator.test_crash import subprocess_env
from tests.test_faults import gateway_config, mqtt_url, wait_for, write_site  # noqa: F401 - mqtt_url: fixture

pytestmark = [pytest.mark.slow, pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[1]
K, MAX_STALENESS, CAPACITY, ROUNDS = 2, 4, 3, 8


def start(command: list[str], log: Path, crash_at: str | None) -> subprocess.Popen:
    """A real process of this checkout, its output appended to ``log`` (a file: a pipe nobody reads would block it)."""
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env=subprocess_env(crash_at), stdout=out,
                                stderr=subprocess.STDOUT)


def coordinator(cfg_path: Path, crash_at: str | None, *rounds: str) -> subprocess.Popen:
    return start(["coordinator.cli", "run", "--config", str(cfg_path), *rounds], cfg_path.parent / "run.log",
                 crash_at)


def gateway(site_yaml: Path, crash_at: str | None = None) -> subprocess.Popen:
    return start(["edge_sdk.cli", "run", "--config", str(site_yaml), "--idle-timeout", "25"],
                 site_yaml.parent / "run.log", crash_at)


def tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def closed_rounds(store: Store) -> list[int]:
    return [r.round for r in store.rounds() if r.status == "closed"]


def waiting(store: Store) -> list[int]:
    with store.session() as s:
        return list(s.scalars(select(BufferedUpdateRow.update_id).where(BufferedUpdateRow.buffer_round.is_(None))))


def expected_step(store: Store, round_: int, k: int = K, capacity: int = CAPACITY) -> dict[str, np.ndarray]:
    """``sum s(t) n delta / (max(K, m) n_bar)`` of the round's m folded updates: its own stored ones and the stale
    ones it claimed (K = ``k``, n_bar = ``capacity``, every site's declared capacity)."""
    with store.session() as s:
        claimed = set(s.scalars(select(BufferedUpdateRow.update_id).where(BufferedUpdateRow.buffer_round == round_)))
        rows = list(s.scalars(select(UpdateRow)))
        buffered = set(s.scalars(select(BufferedUpdateRow.update_id)))
    step: dict[str, np.ndarray] = {}
    m = 0
    for row in rows:
        if row.id in claimed:
            scale = 1.0 / math.sqrt(1.0 + round_ - row.round)
        elif row.round == round_ and row.id not in buffered:
            scale = 1.0
        else:
            continue
        report, delta = decode_update(store.get_blob(row.payload_sha256))
        m += 1
        for name, d in delta.items():
            step[name] = step.get(name, 0.0) + scale * report.num_examples * d.astype(np.float64)
    return {name: v / (max(k, m) * capacity) for name, v in step.items()}


def test_gateways_offline_and_back_and_a_coordinator_killed_mid_buffer(tmp_path: Path, mqtt_url: str):  # noqa: F811
    # Prepare: the coordinator's config and keys, three gateway folders (1 KiB chunks), all enrolled
    fed = f"fbuf{uuid.uuid4().hex[:8]}"
    key = generate_signing_key()
    cfg = gateway_config(tmp_path / "coord", mqtt_url, federation_id=fed, rounds=ROUNDS, round_deadline_s=60.0,
                         round_duration_s=2.0,
                         buffered={"buffer_size": K, "max_staleness": MAX_STALENESS})
    cfg_path = save_config(cfg, tmp_path / "coord" / "coordinator.yaml")
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    sites = {}
    for sid in ("g1", "g2", "g3"):
        sites[sid], site_key = write_site(tmp_path / sid, fed=fed, site_id=sid, coordinator_key=key,
                                          broker_url=mqtt_url, chunk_size_bytes=1024, resend_interval_s=5.0)
        SiteRegistry(store).enrol(sid, public_key_to_pem(site_key.public_key()),
                                  {"capacity": CAPACITY, "categories": ["VU", "NT"]})
    procs: list[subprocess.Popen] = []  # every process started, killed at the end if still running
    try:
        # Execute 1: the coordinator (killed once a stale update waits); g1, g2 online; g3 dies mid-upload
        first = coordinator(cfg_path, "after_buffered")
        gateways = [gateway(sites["g1"]), gateway(sites["g2"])]
        procs += [first, *gateways]
        g3 = gateway(sites["g3"], crash_at="mid_upload")
        procs.append(g3)
        assert g3.wait(timeout=120) == -signal.SIGKILL, tail(tmp_path / "g3" / "run.log")
        wait_for(lambda: 2 in closed_rounds(store), 120, "rounds 1 and 2 to close with g1 and g2")
        # Execute 2: g3 comes back: its round-1 update is resumed, now stale, and the coordinator dies with it waiting
        gateways.append(gateway(sites["g3"]))
        procs.append(gateways[-1])
        assert first.wait(timeout=120) == -signal.SIGKILL, tail(cfg_path.parent / "run.log")
        held = waiting(store)
        assert held, "the coordinator died without a stale update waiting"
        # Execute 3: restart; it recovers the open round (folding what waits) and runs to round 8
        second = coordinator(cfg_path, None)
        procs.append(second)
        assert second.wait(timeout=300) == 0, tail(cfg_path.parent / "run.log")
        for p in gateways:
            p.wait(timeout=120)  # the gateways go quiet (idle timeout) once no task comes
        # one more round folds what came after the last close (no gateway answers it: its deadline closes it)
        data = yaml.safe_load(cfg_path.read_text())
        cfg_path.write_text(yaml.safe_dump({**data, "round_deadline_s": 3.0, "round_duration_s": 0.0}))
        last = coordinator(cfg_path, None, "--rounds", str(ROUNDS + 1))
        procs.append(last)
        assert last.wait(timeout=120) == 0, tail(cfg_path.parent / "run.log")

        # Assert: nothing waits; every stored update folded once (closed form per round); charged == stored
        assert waiting(store) == []
        shown = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--config", str(cfg_path)],
                               cwd=ROOT, env=subprocess_env(None), capture_output=True, text=True, timeout=120)
        assert "stale update(s) folded, 0 waiting for the next close" in shown.stdout, shown.stdout[-3000:]
        with store.session() as s:
            claimed = {r.update_id: r.buffer_round for r in s.scalars(select(BufferedUpdateRow))}
            rows = {r.id: (r.site_id, r.round) for r in s.scalars(select(UpdateRow))}
            charged = {(base_site(r.site_id), r.round) for r in s.scalars(select(LedgerRow))}
            late = list(s.scalars(select(RejectionRow).where(RejectionRow.reason == "late")))
        assert all(claimed[i] is not None for i in held)  # the update that waited across the kill was folded
        assert any(claimed[i] - rows[i][1] >= 2 for i in held)  # g3's round-1 update, at least 2 rounds stale
        assert charged == set(rows.values()) and late == []
        closed = {r.round: r for r in store.rounds() if r.status == "closed"}
        for i, (site, r) in rows.items():
            folded_by = claimed.get(i, r)
            assert folded_by in closed, (site, r, folded_by)
        for r, row in closed.items():
            before, _ = decode_tensors(store.get_model(row.base_model_hash))
            after, _ = decode_tensors(store.get_model(row.new_model_hash))
            for name, step in expected_step(store, r).items():
                np.testing.assert_allclose(after[name], before[name] + step, rtol=1e-5, atol=1e-6,
                                           err_msg=f"round {r}, {name}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        store.dispose()
