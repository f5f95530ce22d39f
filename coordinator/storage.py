"""Durable coordinator state: SQLAlchemy 2.x tables plus a content-addressed blob directory.

One idea: *where the coordinator's state lives*. Every other module (registry, ledger, ingest, rounds) reads and
writes through :class:`Store`; none of them builds an engine or touches the blob directory itself.

Tables (SQLite by default, PostgreSQL by URL): their definitions and what each holds are in
:mod:`coordinator.tables`; this module opens the database and holds the queries.

Blobs are written to a temporary file, ``fsync``-ed and atomically renamed, so a file that exists under its hash
name is complete. A blob is named by a 64-hex digest of its content: the SHA-256 the store computes, or a digest its
caller verified, such as an update's payload digest (envelope format 2: a BLAKE3 hash list, ``shared.envelope``), so
that a verified payload is not hashed again. The column ``payload_sha256`` keeps its name from envelope format 1,
when that digest was a SHA-256; rows written since hold the format-2 payload digest. Rows are committed before
:class:`Store` methods return ("durable" in the rest of the package means: committed to the database and, for
payloads, fsync-ed to disk). :meth:`Store.put_blobs` and
:meth:`Store.add_updates_if_open` are the batched forms ingest's group commit uses (coordinator.inbound.group_commit):
several blobs written before their fsyncs are issued, several updates' rows in one transaction.

SQLite runs in write-ahead-log mode with ``synchronous=FULL`` (set and checked on every new connection): a commit
appends to the WAL and fsyncs it, so it survives power loss, and readers never block the writer nor the writer them
(SQLite, "Write-Ahead Logging", https://www.sqlite.org/wal.html; "PRAGMA synchronous": in WAL mode FULL syncs the
WAL at every commit, NORMAL does not and may lose the last commits on power loss). WAL needs the database on a
local file system (its index is shared memory): a database file on a network share is refused with a clear error.

PostgreSQL isolation for tests or shared servers: ``Store(url, schema="wf_x")`` maps every table into that schema
through SQLAlchemy's ``schema_translate_map`` (the schema must exist).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, delete, event, func, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from shared.errors import ConfigError

from coordinator.schema_upgrade import upgrade_schema
# The tables (coordinator.tables), importable from here too: some eighty modules name them through the store.
from coordinator.tables import (Base, BufferedUpdateRow, CohortRoundRow, CohortRow, DeploymentRow, DetectionRow,
                                DetectionTallyRow, HaltRow, LedgerRow, ModelVersionRow, PartialSumRow, PlaceRow,
                                RegistryVersionRow, RejectionRow, RoundRow, SiteHealthRow, SiteKeyRow, SiteRow, StrategyStateRow,
                                TransferRow, UpdateRow, UserRow, WebSessionRow, deployment_key, utcnow)

__all__ = [
    "Base", "SiteRow", "SiteKeyRow", "RoundRow", "StrategyStateRow", "UpdateRow", "RejectionRow", "LedgerRow",
    "ModelVersionRow", "HaltRow", "CohortRow", "CohortRoundRow", "DetectionRow", "DetectionTallyRow", "TransferRow",
    "PartialSumRow", "SiteHealthRow", "UserRow", "WebSessionRow", "DeploymentRow", "PlaceRow", "RegistryVersionRow",
    "Store", "UpdateOutcome", "DatabaseUnavailable", "deployment_key", "utcnow", "dumps",
]


class DatabaseUnavailable(ConfigError):
    """The database did not answer when the store opened it: a wrong URL, or a server that is not (yet) running.
    A long-lived process may try again later (``wildfed-coordinator service`` exits so that systemd restarts it)."""


class UpdateOutcome(str, Enum):
    """What :meth:`Store.add_updates_if_open` did with one update row."""

    STORED = "stored"  #: inserted (committed with its group)
    DUPLICATE = "duplicate"  #: an update of this (round, site) was already stored: nothing written
    CLOSED = "closed"  #: the round is no longer open: nothing written (ingest charges the update as late)


def _fsync_dir(folder: Path) -> None:
    """fsync a folder, so the renames into it survive power loss (POSIX: fsync of the file is not enough)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _is_file_sqlite(url: str) -> bool:
    """Whether ``url`` is SQLite on a file (in-memory databases have no journal to put in WAL mode)."""
    if not url.startswith("sqlite"):
        return False
    database = make_url(url).database
    return bool(database) and database != ":memory:" and "mode=memory" not in url


def _sqlite_wal_durable(dbapi_connection: Any, _record: Any) -> None:
    """SQLAlchemy ``connect`` listener: put a new SQLite connection in WAL mode with ``synchronous=FULL`` and check
    that both took (https://www.sqlite.org/wal.html, https://www.sqlite.org/pragma.html#pragma_synchronous).

    Raises:
        ConfigError: SQLite refused WAL (e.g. the file is on a network file system without shared memory) or
            FULL (field ``database_url``).
    """
    cursor = dbapi_connection.cursor()
    try:
        mode = str(cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        if mode != "wal":
            raise ConfigError(f"SQLite kept journal_mode {mode!r} instead of 'wal'", field="database_url",
                              fix="put the SQLite file on a local file system (WAL needs shared memory), or use "
                                  "PostgreSQL")
        cursor.execute("PRAGMA synchronous=FULL")
        level = int(cursor.execute("PRAGMA synchronous").fetchone()[0])
        if level < 2:  # 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA
            raise ConfigError(f"SQLite synchronous is {level}, not FULL (2)", field="database_url",
                              fix="do not override PRAGMA synchronous below FULL: commits would not survive power "
                                  "loss")
    finally:
        cursor.close()


def _fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


class Store:
    """The coordinator's database and blob directory.

    Args:
        url: SQLAlchemy URL (``sqlite:///path.db``, ``sqlite://`` for in-memory,
            ``postgresql+psycopg2://user@host:5432/db``).
        data_dir: folder for blobs (``blobs/``) and model files (``models/``); created if absent.
        schema: optional PostgreSQL schema that every table is mapped into (must already exist).
        create: upgrade existing tables whose shape changed (coordinator.schema_upgrade), then create missing
            tables (``create_all``), on construction.

    Raises:
        ConfigError: the URL does not parse or the database cannot be reached (names ``database_url``).
    """

    def __init__(self, url: str, data_dir: str | os.PathLike[str], *, schema: str | None = None,
                 create: bool = True) -> None:
        self.url = url
        self.data_dir = Path(data_dir)
        self.blob_dir = self.data_dir / "blobs"
        self.model_dir = self.data_dir / "models"
        kwargs: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False}
            if url in ("sqlite://", "sqlite:///:memory:"):
                kwargs["poolclass"] = StaticPool
        try:
            engine = create_engine(url, **kwargs)
        except (ArgumentError, ImportError) as exc:
            raise ConfigError(f"cannot build a database engine from {url!r}: {exc}", field="database_url",
                              fix="use sqlite:///path/to/coordinator.db or postgresql+psycopg2://user@host/db"
                              ) from exc
        if _is_file_sqlite(url):
            event.listen(engine, "connect", _sqlite_wal_durable)
        if schema is not None:
            engine = engine.execution_options(schema_translate_map={None: schema})
        self.engine: Engine = engine
        self.schema = schema
        self._sessions = sessionmaker(bind=self.engine, expire_on_commit=False)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if create:
            try:
                upgrade_schema(self.engine, schema=schema)  # reshape existing tables first (no row is lost)
                Base.metadata.create_all(self.engine)
            except OperationalError as exc:
                raise DatabaseUnavailable(f"cannot reach the database at {url!r}: {exc.orig}", field="database_url",
                                          fix="start the database server or correct the URL") from exc
            try:  # the registry's change counter exists from the start, so key changes only ever update it
                with self.session() as s:
                    if s.get(RegistryVersionRow, 1) is None:
                        s.add(RegistryVersionRow(id=1, version=0))
            except IntegrityError:
                pass  # another process created it at the same moment

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on any exception (the exception propagates)."""
        with self._sessions() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        """Close every pooled connection (call before dropping a test schema)."""
        self.engine.dispose()

    # ---- blobs ---------------------------------------------------------------------------------------------------
    def blob_path(self, sha256_hex: str) -> Path:
        """Path of the blob named ``sha256_hex`` (two-character fan-out folder)."""
        return self.blob_dir / sha256_hex[:2] / f"{sha256_hex}.bin"

    def put_blob(self, data: bytes, *, sha256_hex: str | None = None) -> str:
        """Store ``data`` durably (fsync + atomic rename) and return its name (hex digest); idempotent.

        Args:
            data: the bytes. sha256_hex: a 64-hex digest of them the caller has just verified, to name the blob by
                without hashing again (an envelope's payload digest, checked against its signed header, or a
                SHA-256); None: their SHA-256 is computed.
        """
        digest = sha256_hex if sha256_hex is not None else hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            _fsync_write(path, data)
        return digest

    def put_blobs(self, blobs: Sequence[tuple[bytes, str]]) -> None:
        """Store several blobs durably, their syncs batched (group commit, coordinator.inbound.group_commit): every new file
        is written first, then each is fsync-ed, renamed into place, and each folder they went into is fsync-ed
        once. A file that exists under its name is complete, as with :meth:`put_blob`; idempotent.

        Batching lets the file system commit its journal once for the group where it can (ext4 and XFS merge the
        metadata of files synced back to back into one journal transaction), instead of once per blob.

        Args:
            blobs: ``(data, 64-hex digest of data)`` pairs, the digests already verified by the caller (e.g. an
                envelope's payload against its signed header).

        Raises:
            OSError: a write, fsync or rename failed (disk full, I/O error); files already renamed are complete
                blobs, temporary files are removed.
        """
        written: list[tuple[int, str, Path]] = []
        open_fds: set[int] = set()
        seen: set[Path] = set()
        try:
            for data, digest in blobs:
                path = self.blob_path(digest)
                if path in seen or path.exists():
                    continue
                seen.add(path)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
                open_fds.add(fd)
                written.append((fd, tmp, path))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            for fd, _, _ in written:
                os.fsync(fd)
            for fd, tmp, path in written:
                open_fds.discard(fd)
                os.close(fd)
                os.replace(tmp, path)
        except BaseException:
            for fd, tmp, _ in written:
                if fd in open_fds:
                    os.close(fd)
                if os.path.exists(tmp):
                    os.unlink(tmp)
            raise
        for folder in {path.parent for _, _, path in written}:
            _fsync_dir(folder)

    def get_blob(self, sha256_hex: str) -> bytes:
        """Read a blob back; raises ``FileNotFoundError`` if it was never stored."""
        return self.blob_path(sha256_hex).read_bytes()

    # ---- model versions ------------------------------------------------------------------------------------------
    def put_model(self, model_hash: str, data: bytes, *, round: int) -> Path:
        """Store a global model's safetensors bytes under ``models/<hash>.safetensors`` and record the version.

        Idempotent: storing the same hash twice keeps the first row.
        """
        path = self.model_dir / f"{model_hash}.safetensors"
        if not path.exists():
            _fsync_write(path, data)
        with self.session() as s:
            if s.get(ModelVersionRow, model_hash) is None:
                s.add(ModelVersionRow(model_hash=model_hash, path=str(path), round=round))
        return path

    def get_state(self, key: str, default: Any = None) -> Any:
        """The JSON value stored under ``key`` (strategy state), or ``default``."""
        with self.session() as s:
            row = s.get(StrategyStateRow, key)
            return default if row is None else json.loads(row.value_json)

    def set_state(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key`` (committed before return)."""
        text = json.dumps(value, sort_keys=True)
        with self.session() as s:
            row = s.get(StrategyStateRow, key)
            if row is None:
                s.add(StrategyStateRow(key=key, value_json=text))
            else:
                row.value_json, row.updated_at = text, utcnow()

    def get_model(self, model_hash: str) -> bytes:
        """Safetensors bytes of a stored model version; raises ``KeyError`` if the hash is unknown."""
        with self.session() as s:
            row = s.get(ModelVersionRow, model_hash)
            if row is None:
                raise KeyError(model_hash)
            return Path(row.path).read_bytes()

    def latest_model_hash(self) -> str | None:
        """Hash of the newest model version (highest round, then newest), or None if none is stored."""
        with self.session() as s:
            row = s.scalars(select(ModelVersionRow).order_by(ModelVersionRow.round.desc(),
                                                             ModelVersionRow.created_at.desc())).first()
            return None if row is None else row.model_hash

    # ---- rejections / status -------------------------------------------------------------------------------------
    def add_rejection(self, *, round: int | None, site_id: str | None, topic: str, reason: str,
                      error_kind: str, detail: str) -> None:
        """Record one rejected message (committed before return)."""
        with self.session() as s:
            s.add(RejectionRow(round=round, site_id=site_id, topic=topic[:512], reason=reason,
                               error_kind=error_kind, detail=detail))

    def rejection_counts(self) -> dict[str, int]:
        """Rejections counted per reason code, e.g. ``{"bad_signature": 2}``."""
        with self.session() as s:
            rows = s.execute(select(RejectionRow.reason, func.count()).group_by(RejectionRow.reason)).all()
            return {reason: int(n) for reason, n in rows}

    def rounds(self) -> list[RoundRow]:
        """All round rows, oldest first."""
        with self.session() as s:
            return list(s.scalars(select(RoundRow).order_by(RoundRow.round)))

    def add_update_if_open(self, row: UpdateRow) -> bool:
        """Insert an accepted update's row only while its round is ``open``, under a lock on the round's row
        (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises writers anyway), so that an ingest worker and
        the finaliser closing the round agree on which updates the round holds.

        Returns:
            False when the round is no longer open (nothing is written).

        Raises:
            sqlalchemy.exc.IntegrityError: an update of this (round, site) is already stored.
        """
        with self.session() as s:
            status = s.scalars(select(RoundRow.status).where(RoundRow.round == row.round).with_for_update()).first()
            if status is not None and status != "open":
                return False
            s.add(row)
        return True

    def add_updates_if_open(self, rows: Sequence[UpdateRow]) -> list[UpdateOutcome]:
        """Insert several accepted updates' rows in ONE transaction (one commit: one WAL fsync on SQLite), each only
        while its round is ``open`` (under a lock on the round rows, as :meth:`add_update_if_open`) and only if no
        update of its (round, site) is stored; the ``transfers`` rows of those (round, site) pairs are deleted in
        the same transaction (their uploads are consumed: stored, or refused as duplicate or late). For a group
        spanning several rounds, every (round, site) combination of the group's rounds and sites counts as consumed.

        Read once: the round statuses and the stored (round, site) pairs of the whole group are each read by one
        query inside the transaction.

        Args:
            rows: new :class:`UpdateRow` objects (not yet added to any session); at most one per (round, site) is
                stored, a later one of the same pair is a duplicate.

        Returns:
            one :class:`UpdateOutcome` per row, in order.

        Raises:
            sqlalchemy.exc.IntegrityError: another process stored an update of one of these (round, site) pairs
                between the read and the commit (PostgreSQL, several ingest workers); nothing of the group is
                written, and the caller retries row by row.
        """
        if not rows:
            return []
        rounds = sorted({r.round for r in rows})
        sites = sorted({r.site_id for r in rows})
        outcomes: list[UpdateOutcome] = []
        new: list[dict[str, Any]] = []
        # SQLAlchemy Core in one transaction (no ORM unit of work), with statements whose shape does not depend on
        # the group's size (expanding IN parameters), so their compiled form is cached. A group holds one round in
        # practice (a round's close commits the group first), so round IN x site IN is the group's pairs.
        with self.engine.begin() as conn:
            status = {r: st for r, st in conn.execute(
                select(RoundRow.round, RoundRow.status).where(RoundRow.round.in_(rounds)).with_for_update())}
            stored = {(r, site) for r, site in conn.execute(
                select(UpdateRow.round, UpdateRow.site_id).where(UpdateRow.round.in_(rounds),
                                                                 UpdateRow.site_id.in_(sites)))}
            for row in rows:
                key = (row.round, row.site_id)
                st = status.get(row.round)
                if st is not None and st != "open":
                    outcomes.append(UpdateOutcome.CLOSED)
                elif key in stored:
                    outcomes.append(UpdateOutcome.DUPLICATE)
                else:
                    new.append({"round": row.round, "site_id": row.site_id, "sequence": row.sequence,
                                "num_examples": row.num_examples, "payload_sha256": row.payload_sha256,
                                "received_at": row.received_at or utcnow()})
                    stored.add(key)
                    outcomes.append(UpdateOutcome.STORED)
            if new:
                conn.execute(insert(UpdateRow), new)
            conn.execute(delete(TransferRow).where(TransferRow.round.in_(rounds), TransferRow.site_id.in_(sites)))
        return outcomes

    def updates_for_round(self, round: int) -> list[UpdateRow]:
        """Accepted-update rows of one round, in arrival order, without the stale updates a buffered round folds
        (``buffered_updates``: they count in the round whose buffer took them, :mod:`coordinator.buffered_store`)."""
        with self.session() as s:
            waiting = select(BufferedUpdateRow.update_id)  # buffered rounds' stale updates: folded elsewhere
            return list(s.scalars(select(UpdateRow).where(UpdateRow.round == round, UpdateRow.id.not_in(waiting))
                                  .order_by(UpdateRow.id)))

    def count_updates(self) -> int:
        """Total number of accepted updates over all rounds."""
        with self.session() as s:
            return int(s.scalar(select(func.count()).select_from(UpdateRow)) or 0)


def dumps(obj: Any) -> str:
    """Canonical JSON used for metadata columns (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
