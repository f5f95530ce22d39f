"""The store's durability settings and batched writes (coordinator/storage.py).

* every SQLite connection runs in WAL mode with ``synchronous=FULL`` (checked on each new connection); a reader is
  not blocked by an open write transaction (what WAL buys); a connection left in a weaker mode is refused clearly;
* ``put_blobs`` stores several blobs, each readable under its SHA-256 name afterwards, and is idempotent;
* ``add_updates_if_open`` stores a group's rows in ONE commit, refuses a duplicate (round, site) and a closed
  round's update, and deletes the consumed ``transfers`` rows in the same transaction.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import event

from shared.errors import ConfigError

from coordinator.storage import RoundRow, SiteRow, Store, TransferRow, UpdateOutcome, UpdateRow, _sqlite_wal_durable
from tests.coordinator import test_postgres as _postgres

pg_schema = _postgres.pg_schema  # the fixture: a throw-away PostgreSQL schema (skips without PostgreSQL)


def _store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "data")


def test_every_sqlite_connection_is_wal_with_full_sync(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for _ in range(2):  # a pooled and a fresh connection
        with store.engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert raw.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        store.engine.dispose()
    # the mode is on the file: another program opening it sees WAL too
    other = sqlite3.connect(tmp_path / "c.db")
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()
    store.dispose()


def test_a_reader_is_not_blocked_by_an_open_write_transaction(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with store.session() as s:
        s.add(SiteRow(site_id="s1", public_key_pem="pem"))
    writer = sqlite3.connect(tmp_path / "c.db", timeout=0.0)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE sites SET metadata_json = '{\"x\": 1}' WHERE site_id = 's1'")
    # With a rollback journal this read would wait for the writer (timeout 0: fail at once); WAL serves the last
    # committed state.
    with store.session() as s:
        assert s.get(SiteRow, "s1").metadata_json == "{}"
    writer.rollback()
    writer.close()
    store.dispose()


class _FakeCursor:
    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers

    def execute(self, sql: str):
        self.last = self.answers[sql]
        return self

    def fetchone(self):
        return (self.last,)

    def close(self) -> None:
        pass


class _FakeConnection:
    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers

    def cursor(self) -> _FakeCursor:
        return _FakeCursor(self.answers)


@pytest.mark.parametrize("journal, sync, fieldname_in", [("delete", 2, "journal_mode"), ("wal", 1, "synchronous")])
def test_a_connection_that_refuses_wal_or_full_is_a_config_error(journal, sync, fieldname_in) -> None:
    fake = _FakeConnection({"PRAGMA journal_mode=WAL": journal, "PRAGMA synchronous=FULL": None,
                            "PRAGMA synchronous": sync})
    with pytest.raises(ConfigError) as err:
        _sqlite_wal_durable(fake, None)
    assert err.value.field == "database_url" and fieldname_in in str(err.value) and err.value.fix


def test_put_blobs_stores_each_under_its_hash_and_is_idempotent(tmp_path: Path) -> None:
    store = _store(tmp_path)
    blobs = [(bytes([i]) * (1000 + i), hashlib.sha256(bytes([i]) * (1000 + i)).hexdigest()) for i in range(5)]
    store.put_blobs(blobs + blobs[:1])  # the same blob twice in one group: written once
    for data, digest in blobs:
        assert store.get_blob(digest) == data
    store.put_blobs(blobs)  # again: nothing changes
    files = sorted(p.name for p in (tmp_path / "data" / "blobs").rglob("*") if p.is_file())
    assert files == sorted(f"{d}.bin" for _, d in blobs)  # no temporary file left behind
    store.dispose()


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_add_updates_if_open_commits_a_group_once_and_sorts_out_duplicates_and_closed_rounds(tmp_path: Path, db,
                                                                                            request) -> None:
    if db == "sqlite":
        store = _store(tmp_path)
    else:
        store = Store(_postgres.PG_URL, tmp_path / "data", schema=request.getfixturevalue("pg_schema"))
    now = dt.datetime(2026, 1, 1)
    with store.session() as s:
        s.add_all([SiteRow(site_id=f"s{i}", public_key_pem=f"pem{i}") for i in range(1, 5)])
        s.add_all([RoundRow(round=1, status="closed", base_model_hash="a" * 64),
                   RoundRow(round=2, status="open", base_model_hash="b" * 64)])
        s.add(UpdateRow(round=2, site_id="s1", sequence=1, num_examples=1, payload_sha256="c" * 64))
        s.add_all([TransferRow(transfer_id=f"{i}" * 64, site_id=f"s{i}", round=2, sequence=1, manifest_payload=b"m",
                               num_chunks=1, created_at=now, expires_at=now) for i in (2, 4)])
    commits = []
    event.listen(store.engine, "commit", lambda conn: commits.append(1))

    def row(r: int, site: str) -> UpdateRow:
        return UpdateRow(round=r, site_id=site, sequence=7, num_examples=3, payload_sha256="d" * 64)

    outcomes = store.add_updates_if_open([row(2, "s1"), row(2, "s2"), row(1, "s3"), row(2, "s3"), row(2, "s2")])
    assert outcomes == [UpdateOutcome.DUPLICATE, UpdateOutcome.STORED, UpdateOutcome.CLOSED, UpdateOutcome.STORED,
                        UpdateOutcome.DUPLICATE]
    assert commits == [1]  # the whole group: one transaction
    commits.clear()
    assert sorted((u.round, u.site_id, u.sequence) for u in store.updates_for_round(2)) == [
        (2, "s1", 1), (2, "s2", 7), (2, "s3", 7)]
    with store.session() as s:  # s2's upload is consumed; s4's (not in the group) is not
        assert [t.site_id for t in s.query(TransferRow)] == ["s4"]
    commits.clear()
    assert store.add_updates_if_open([]) == [] and commits == []
    store.dispose()
