"""Persistent outbox: an update is written durably before it is published, and dropped only after the ack.

docs/transport.md, "Exactly-once effect" (the transactional-outbox pattern): ``put`` commits the message to SQLite
before the first publish; ``remove`` runs only when the coordinator's signed ACK has been verified; ``pending`` lists
what must be (re)sent after a crash, a restart or a reconnect. SQLite runs in WAL mode with ``synchronous=FULL``, so a
committed ``put`` survives power loss (https://sqlite.org/wal.html, "Durability").

The same file holds a small key/value table for the agent's durable state (last round trained, envelope
sequence number), so that a restarted gateway never trains twice for one round.

Payloads are read only when they are sent: :meth:`Outbox.pending` and :meth:`Outbox.count` query ids, sizes and
digests (a 40 MB update is not read on every message the agent handles), and :meth:`Outbox.get` reads one payload.
Each row keeps the SHA-256 of its payload (the transfer id of a chunked upload, ``shared.transfer``), so a receipt
is matched to its upload without hashing the payloads. A database written before these columns existed is
upgraded when opened (one pass over the stored payloads).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["OutboxMessage", "OutboxEntry", "Outbox"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL UNIQUE,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL,
    size INTEGER,
    sha256 TEXT
);
CREATE TABLE IF NOT EXISTS agent_state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class OutboxEntry:
    """A pending message without its payload: ``size`` in bytes, ``sha256`` the hex SHA-256 of the payload."""

    message_id: str
    topic: str
    created_at: float
    size: int
    sha256: str


@dataclass(frozen=True)
class OutboxMessage:
    """A message waiting for its ack: ``payload`` is the full signed envelope bytes for ``topic``."""

    message_id: str
    topic: str
    payload: bytes
    created_at: float


class Outbox:
    """SQLite outbox at ``path`` (created with its parent directory if absent). Thread-safe.

    Attributes:
        payload_reads: number of payloads read from the database since it was opened (observability, tests).

    Raises:
        ConfigError: the file cannot be opened as an SQLite database.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._upgrade()
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot open outbox database: {exc}", source=str(self.path), field="outbox",
                              fix="point `outbox` at a writable path (it is created if absent)") from exc
        self.payload_reads = 0

    def _upgrade(self) -> None:
        """Add the ``size`` and ``sha256`` columns to an outbox written before they existed, and fill them."""
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(outbox)")}
        for name, kind in (("size", "INTEGER"), ("sha256", "TEXT")):
            if name not in columns:
                self._db.execute(f"ALTER TABLE outbox ADD COLUMN {name} {kind}")
        missing = [r[0] for r in self._db.execute("SELECT seq FROM outbox WHERE size IS NULL OR sha256 IS NULL")]
        for seq in missing:
            (payload,) = self._db.execute("SELECT payload FROM outbox WHERE seq = ?", (seq,)).fetchone()
            self._db.execute("UPDATE outbox SET size = ?, sha256 = ? WHERE seq = ?",
                             (len(payload), hashlib.sha256(bytes(payload)).hexdigest(), seq))

    def put(self, message_id: str, topic: str, payload: bytes) -> None:
        """Durably store a message (committed and fsynced on return). Re-putting an id replaces its content."""
        payload = bytes(payload)
        with self._lock:
            self._db.execute(
                "INSERT INTO outbox (message_id, topic, payload, created_at, size, sha256) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(message_id) DO UPDATE SET topic=excluded.topic, payload=excluded.payload, "
                "size=excluded.size, sha256=excluded.sha256",
                (message_id, topic, payload, time.time(), len(payload), hashlib.sha256(payload).hexdigest()),
            )

    def pending(self) -> list[OutboxEntry]:
        """Messages not yet acknowledged, oldest first, without their payloads (:meth:`get` reads one)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT message_id, topic, created_at, size, sha256 FROM outbox ORDER BY seq").fetchall()
        return [OutboxEntry(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def entry(self, message_id: str) -> OutboxEntry | None:
        """The pending message with this id without its payload, or None."""
        with self._lock:
            r = self._db.execute("SELECT message_id, topic, created_at, size, sha256 FROM outbox WHERE message_id = ?",
                                 (message_id,)).fetchone()
        return None if r is None else OutboxEntry(r[0], r[1], r[2], r[3], r[4])

    def count(self) -> int:
        """Number of messages not yet acknowledged (no payload is read)."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def get(self, message_id: str) -> OutboxMessage | None:
        """The pending message with this id, payload included, or None."""
        with self._lock:
            r = self._db.execute("SELECT message_id, topic, payload, created_at FROM outbox WHERE message_id = ?",
                                 (message_id,)).fetchone()
            if r is not None:
                self.payload_reads += 1
        return None if r is None else OutboxMessage(r[0], r[1], bytes(r[2]), r[3])

    def remove(self, message_id: str) -> bool:
        """Drop a message after its ack was verified; returns False if it was not pending."""
        with self._lock:
            cur = self._db.execute("DELETE FROM outbox WHERE message_id = ?", (message_id,))
        return cur.rowcount > 0

    def get_state(self, key: str, default: str | None = None) -> str | None:
        """A durable agent-state value, or ``default``."""
        with self._lock:
            r = self._db.execute("SELECT value FROM agent_state WHERE key = ?", (key,)).fetchone()
        return default if r is None else r[0]

    def set_state(self, key: str, value: str) -> None:
        """Durably set an agent-state value."""
        with self._lock:
            self._db.execute("INSERT INTO agent_state (key, value) VALUES (?, ?) "
                             "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:  # pragma: no cover - closing twice is harmless
                pass

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
