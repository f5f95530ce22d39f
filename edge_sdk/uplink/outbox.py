"""Persistent outbox: an update is written durably before it is published, and dropped only after the ack.

DESIGN.md data flow, step 2-3 (the transactional-outbox pattern): ``put`` commits the message to SQLite before
the first publish; ``remove`` runs only when the coordinator's signed ACK has been verified; ``pending`` lists what
must be (re)sent after a crash, a restart or a reconnect. SQLite runs in WAL mode with ``synchronous=FULL``, so a
committed ``put`` survives power loss (https://sqlite.org/wal.html, "Durability").

The same file holds a small key/value table for the agent's durable state (last round trained, envelope
sequence number), so that a restarted gateway never trains twice for one round.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["OutboxMessage", "Outbox"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL UNIQUE,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class OutboxMessage:
    """A message waiting for its ack: ``payload`` is the full signed envelope bytes for ``topic``."""

    message_id: str
    topic: str
    payload: bytes
    created_at: float


class Outbox:
    """SQLite outbox at ``path`` (created with its parent directory if absent). Thread-safe.

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
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot open outbox database: {exc}", source=str(self.path), field="outbox",
                              fix="point `outbox` at a writable path (it is created if absent)") from exc

    def put(self, message_id: str, topic: str, payload: bytes) -> None:
        """Durably store a message (committed and fsynced on return). Re-putting an id replaces its content."""
        with self._lock:
            self._db.execute(
                "INSERT INTO outbox (message_id, topic, payload, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(message_id) DO UPDATE SET topic=excluded.topic, payload=excluded.payload",
                (message_id, topic, bytes(payload), time.time()),
            )

    def pending(self) -> list[OutboxMessage]:
        """Messages not yet acknowledged, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT message_id, topic, payload, created_at FROM outbox ORDER BY seq").fetchall()
        return [OutboxMessage(r[0], r[1], bytes(r[2]), r[3]) for r in rows]

    def get(self, message_id: str) -> OutboxMessage | None:
        """The pending message with this id, or None."""
        with self._lock:
            r = self._db.execute("SELECT message_id, topic, payload, created_at FROM outbox WHERE message_id = ?",
                                 (message_id,)).fetchone()
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
