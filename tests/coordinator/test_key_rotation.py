"""Key rotation and revocation in the site registry (coordinator/registry.py), on SQLite and PostgreSQL, and the
rotate-key / revoke-key / keys CLI commands."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from shared.keys import generate_signing_key, key_fingerprint, public_key_to_pem

from coordinator.registry import KeyRotationError, SiteRegistry, UnknownSiteError
from coordinator.storage import SiteRow, Store
from tests.coordinator import test_postgres as _postgres

PG_URL = _postgres.PG_URL
pg_schema = _postgres.pg_schema  # the fixture: a throw-away PostgreSQL schema (skips without PostgreSQL)

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)
HOUR = dt.timedelta(hours=1)


class Clock:
    """An injectable clock (naive UTC)."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def _pem():
    key = generate_signing_key().public_key()
    return public_key_to_pem(key), key_fingerprint(key)


def _fps(reg: SiteRegistry, site: str, now: dt.datetime | None = None) -> list[str]:
    return [fp for fp, _ in reg.verification_keys(site, now=now)]


def _rotation_scenario(store: Store) -> None:
    # Prepare
    clock = Clock(T0)
    reg = SiteRegistry(store, clock=clock)
    old_pem, old_fp = _pem()
    new_pem, new_fp = _pem()
    reg.enrol("s1", old_pem)
    assert _fps(reg, "s1") == [old_fp]
    # Execute: rotate with a 2-hour grace period
    key = reg.rotate_key("s1", new_pem, grace_s=2 * 3600)
    # Assert: both valid inside the grace period (current first), only the new one after it
    assert key.fingerprint == new_fp and key_fingerprint(reg.get_public_key("s1")) == new_fp
    clock.now = T0 + HOUR
    assert _fps(reg, "s1") == [new_fp, old_fp]
    clock.now = T0 + 2 * HOUR
    assert _fps(reg, "s1") == [new_fp]
    assert _fps(reg, "s1", now=T0 + HOUR) == [new_fp, old_fp]  # an explicit time wins over the clock
    # aware times are taken as UTC
    assert _fps(reg, "s1", now=(T0 + HOUR).replace(tzinfo=dt.timezone.utc)) == [new_fp, old_fp]


def test_rotation_grace_period_with_injected_clock(tmp_path: Path) -> None:
    _rotation_scenario(Store("sqlite://", tmp_path / "d"))


def test_revocation_is_immediate_and_seen_by_another_registry(tmp_path: Path) -> None:
    # Prepare: two registries on one database file, as the service and the CLI are two processes
    url = f"sqlite:///{tmp_path / 'c.db'}"
    running, cli = SiteRegistry(Store(url, tmp_path / "d")), SiteRegistry(Store(url, tmp_path / "d"))
    old_pem, old_fp = _pem()
    new_pem, new_fp = _pem()
    running.enrol("s1", old_pem)
    assert _fps(running, "s1") == [old_fp]  # the running registry has now cached s1
    cli.rotate_key("s1", new_pem)  # default grace: 24 h
    assert _fps(running, "s1") == [new_fp, old_fp]
    # Execute: revoke the old key in the other "process"
    assert cli.revoke_key("s1", old_fp[:12]) == [old_fp]
    # Assert
    assert _fps(running, "s1") == [new_fp]
    assert cli.revoke_key("s1") == [new_fp]  # all the rest
    assert running.verification_keys("s1") == []
    assert cli.revoke_key("s1") == []
    keys = running.keys("s1")
    assert [k.fingerprint for k in keys] == [new_fp, old_fp] and keys[0].current and all(k.revoked_at for k in keys)


def test_errors(tmp_path: Path) -> None:
    reg = SiteRegistry(Store("sqlite://", tmp_path / "d"))
    pem, fp = _pem()
    reg.enrol("s1", pem)
    with pytest.raises(UnknownSiteError):
        reg.verification_keys("nope")
    with pytest.raises(UnknownSiteError):
        reg.rotate_key("nope", _pem()[0])
    with pytest.raises(UnknownSiteError):
        reg.revoke_key("nope")
    with pytest.raises(KeyRotationError, match="already used"):
        reg.rotate_key("s1", pem)
    with pytest.raises(KeyRotationError) as exc:
        reg.rotate_key("s1", "not a pem")
    assert exc.value.field == "public_key"
    with pytest.raises(KeyRotationError) as exc:
        reg.rotate_key("s1", _pem()[0], grace_s=-1)
    assert exc.value.field == "grace_s"
    with pytest.raises(KeyRotationError) as exc:
        reg.revoke_key("s1", "0" * 64)
    assert exc.value.field == "fingerprint"
    with pytest.raises(KeyRotationError):
        reg.revoke_key("s1", fp[:4])  # too short a prefix
    reg.revoke_key("s1", fp)
    with pytest.raises(KeyRotationError, match="already used"):  # a revoked key never comes back
        reg.rotate_key("s1", pem)
    assert _fps(reg, "s1") == []


def test_zero_grace_ends_old_key_at_once_and_earlier_grace_is_kept(tmp_path: Path) -> None:
    clock = Clock(T0)
    reg = SiteRegistry(Store("sqlite://", tmp_path / "d"), clock=clock)
    (p1, f1), (p2, _), (p3, f3) = _pem(), _pem(), _pem()
    reg.enrol("s1", p1)
    reg.rotate_key("s1", p2, grace_s=3600)
    clock.now = T0 + dt.timedelta(minutes=30)
    reg.rotate_key("s1", p3, grace_s=0)
    assert _fps(reg, "s1") == [f3, f1]  # f1 keeps its own grace (until T0 + 1 h); f2 ended at once
    clock.now = T0 + HOUR
    assert _fps(reg, "s1") == [f3]


def test_data_survives_reopening_and_old_rows_stay_readable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    (p1, f1), (p2, f2) = _pem(), _pem()
    store = Store(url, tmp_path / "d")
    reg = SiteRegistry(store, clock=Clock(T0))
    reg.enrol("s1", p1)
    reg.rotate_key("s1", p2, grace_s=3600)
    # a site written straight into ``sites`` (as provisioning does, or a database from before site_keys existed)
    p3, f3 = _pem()
    with store.session() as s:
        s.add(SiteRow(site_id="legacy", public_key_pem=p3, metadata_json="{}"))
    store.dispose()
    reopened = SiteRegistry(Store(url, tmp_path / "d"), clock=Clock(T0 + dt.timedelta(minutes=59)))
    assert _fps(reopened, "s1") == [f2, f1]
    assert _fps(reopened, "s1", now=T0 + HOUR) == [f2]
    assert _fps(reopened, "legacy") == [f3] and key_fingerprint(reopened.get_public_key("legacy")) == f3
    assert reopened.revoke_key("legacy") == [f3] and _fps(reopened, "legacy") == []


def test_rotation_and_revocation_on_postgres(pg_schema, tmp_path: Path) -> None:
    store = Store(PG_URL, tmp_path / "d", schema=pg_schema)
    try:
        _rotation_scenario(store)
        reg = SiteRegistry(store, clock=Clock(T0 + HOUR))
        assert len(reg.verification_keys("s1")) == 2
        reg.revoke_key("s1")
        assert reg.verification_keys("s1") == []
        with store.engine.connect() as conn:
            n = conn.execute(text(f'SELECT count(*) FROM "{pg_schema}".site_keys')).scalar()
        assert n == 2
    finally:
        store.dispose()


def test_cli_rotate_revoke_and_list(tmp_path: Path) -> None:
    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    cfg = str(tmp_path / "c" / "coordinator.yaml")
    (p1, f1), (p2, f2) = _pem(), _pem()
    (tmp_path / "1.pub").write_text(p1)
    (tmp_path / "2.pub").write_text(p2)
    assert runner.invoke(app, ["enrol", "s1", "--public-key", str(tmp_path / "1.pub"), "-c", cfg]).exit_code == 0
    res = runner.invoke(app, ["rotate-key", "s1", "--public-key", str(tmp_path / "2.pub"), "--grace-hours", "1",
                              "-c", cfg])
    assert res.exit_code == 0 and "2 key(s) valid" in res.output, res.output
    res = runner.invoke(app, ["revoke-key", "s1", "--fingerprint", f1[:16], "-c", cfg])
    assert res.exit_code == 0 and "1 key(s) still valid" in res.output, res.output
    res = runner.invoke(app, ["keys", "s1", "-c", cfg])
    assert res.exit_code == 0 and f2[:16] in res.output and f1[:16] in res.output
    res = runner.invoke(app, ["revoke-key", "s1", "--fingerprint", "deadbeefdeadbeef", "-c", cfg])
    assert res.exit_code == 2 and "fingerprint" in res.output
    res = runner.invoke(app, ["revoke-key", "nope", "-c", cfg])
    assert res.exit_code == 2 and "not enrolled" in res.output


def test_a_site_with_every_key_revoked_is_not_selected(tmp_path: Path) -> None:
    """Revocation also takes the site out of the rounds (it could not send a verifiable update), so a round does
    not wait for it until its deadline."""
    import numpy as np

    from shared.iucn import IUCNCategory

    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport
    from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights

    key = generate_signing_key()
    bus = InMemoryTransport()
    coord = Coordinator(make_config(tmp_path, rounds=1, ship_ort_artifacts=False,
                                    budget={"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0}),
                        transport=bus, signing_key=key, initial_weights=tiny_weights())
    for sid in ("kept", "revoked"):
        s = FakeSite(sid, bus, key.public_key(), value=1.0, num_examples=10, events={IUCNCategory.VU: EVENT}).attach()
        coord.enrol(sid, s.public_pem, {"capacity": 10, "categories": ["VU"]})
    coord.registry.revoke_key("revoked")
    result = coord.run_round()
    assert result.selected == ("kept",) and result.status == "closed" and result.accepted == ("kept",)
    _, after = coord.rounds.current_model()
    np.testing.assert_allclose(after["psi.b"], tiny_weights()["psi.b"] + 1.0, atol=1e-6)
    coord.close()


def test_ingest_worker_refuses_to_start_beside_a_coordinator_that_ingests(tmp_path: Path) -> None:
    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    res = runner.invoke(app, ["ingest-worker", "--worker-id", "w1", "-c", str(tmp_path / "c" / "coordinator.yaml")])
    assert res.exit_code == 2 and "ingest_workers" in res.output, res.output


# ---- the verification-key cache -------------------------------------------------------------------------------------
def _count_key_reads(store: Store) -> list[str]:
    """Every SQL statement that reads the ``site_keys`` or ``sites`` table (the key cache's misses)."""
    from sqlalchemy import event

    seen: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def _record(conn, cursor, statement, params, context, executemany) -> None:  # noqa: ANN001
        if statement.lstrip().upper().startswith("SELECT") and ("site_keys" in statement or "FROM sites" in statement):
            seen.append(statement)

    return seen


def test_keys_are_cached_and_a_revocation_in_this_process_counts_at_once(tmp_path: Path) -> None:
    # Prepare: a site with two valid keys (rotated, in its grace period), its keys read once
    store = Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "d")
    reg = SiteRegistry(store, clock=Clock(T0))
    (p1, f1), (p2, f2) = _pem(), _pem()
    reg.enrol("s1", p1)
    reg.rotate_key("s1", p2, grace_s=3600)
    reads = _count_key_reads(store)
    assert _fps(reg, "s1") == [f2, f1]
    first = len(reads)
    assert first >= 1
    # Execute 1: many verifications, nothing changed: no key read at all (the cache serves them)
    for _ in range(20):
        assert _fps(reg, "s1") == [f2, f1]
    assert len(reads) == first
    # Execute 2: revoke the old key in this process; Assert: the very next call no longer has it
    assert reg.revoke_key("s1", f1) == [f1]
    assert _fps(reg, "s1") == [f2]
    assert len(reads) > first  # re-read after the change
    # the grace period still ends on the clock, with no change to invalidate anything
    reg.revoke_key("s1", f2)
    assert _fps(reg, "s1") == []
    store.dispose()


def test_a_revoked_key_stops_verifying_updates_at_once(tmp_path: Path) -> None:
    """Through ingest: an update signed with a key revoked a moment ago (after the registry cached it) is refused
    (``no_valid_key``), the one before the revocation was accepted."""
    from coordinator.inbound.context import Accepted
    from coordinator.inbound.reject import Rejected, RejectReason
    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport
    from shared.iucn import IUCNCategory
    from shared.topics import update_topic
    from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights

    bus = InMemoryTransport()
    key = generate_signing_key()
    coord = Coordinator(make_config(tmp_path, round_deadline_s=5.0), transport=bus, signing_key=key,
                        initial_weights=tiny_weights())
    sites = {sid: FakeSite(sid, bus, key.public_key(), value=1.0, num_examples=10, events={IUCNCategory.LC: EVENT})
             for sid in ("s1", "s2")}
    for sid, site in sites.items():
        coord.enrol(sid, site.public_pem, {"capacity": 10})
    coord.start()
    ctx = coord.rounds.open_round()
    delta = {k: v * 0 + 1 for k, v in tiny_weights().items()}
    first = coord.ingestor.handle(update_topic("testfed", "s1"), sites["s1"].envelope(
        ctx.round, ctx.model_hash, sites["s1"].payload(delta)))
    assert isinstance(first, Accepted)  # s1's keys are cached now
    coord.registry.revoke_key("s2")
    refused = coord.ingestor.handle(update_topic("testfed", "s2"), sites["s2"].envelope(
        ctx.round, ctx.model_hash, sites["s2"].payload(delta)))
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.NO_VALID_KEY
    coord.registry.revoke_key("s1")
    again = coord.ingestor.handle(update_topic("testfed", "s1"), sites["s1"].envelope(
        ctx.round, ctx.model_hash, sites["s1"].payload(delta)))
    assert isinstance(again, Rejected) and again.reason is RejectReason.NO_VALID_KEY
    coord.close()


def test_a_revocation_by_another_process_is_seen_by_the_next_verification(tmp_path: Path) -> None:
    """The CLI in a real subprocess revokes a key the running registry has cached: the next verification in this
    process no longer returns it (the registry's change counter moved), with no time bound to wait out."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from coordinator.cli import app
    from coordinator.config import load_config

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    cfg_path = tmp_path / "c" / "coordinator.yaml"
    (p1, f1), (p2, f2) = _pem(), _pem()
    (tmp_path / "1.pub").write_text(p1)
    (tmp_path / "2.pub").write_text(p2)
    assert runner.invoke(app, ["enrol", "s1", "--public-key", str(tmp_path / "1.pub"), "-c", str(cfg_path)]
                         ).exit_code == 0
    cfg = load_config(cfg_path)
    running = SiteRegistry(Store(cfg.database_url, cfg.data_dir))
    assert _fps(running, "s1") == [f1]  # cached
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "coordinator.cli"]
    done = subprocess.run(cmd + ["rotate-key", "s1", "--public-key", str(tmp_path / "2.pub"), "--grace-hours", "1",
                                 "-c", str(cfg_path)], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _fps(running, "s1") == [f2, f1]
    done = subprocess.run(cmd + ["revoke-key", "s1", "--fingerprint", f1[:16], "-c", str(cfg_path)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _fps(running, "s1") == [f2]
