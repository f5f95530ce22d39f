"""The gateway's index of its photos, events and the rangers' verdicts (SQLite, ``<state>/field.sqlite``).

The Camtrap DP package (:mod:`edge_sdk.field.site_package`) is the site's record; this index is what makes it
usable at the scale of years: which media ids are already stored (a photo copied twice is processed once), each
photo's detections with the classifier's full probability vector, the events with their running sum of
probabilities, and which events a ranger has reviewed, so that the review page can list the least certain events
first without reading every CSV row.

Two processes use it: the gateway service writes photos and events, the review page writes verdicts. SQLite in WAL
mode with a busy timeout serialises them; every change is one transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.field.events import DEFAULT_GAP_S, EventSpan, assign_event, epoch_seconds, event_id_for
from edge_sdk.field.predictions import Prediction

__all__ = ["PhotoEntry", "EventEntry", "FieldStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS media (
    media_id TEXT PRIMARY KEY, deployment_id TEXT NOT NULL, file_path TEXT NOT NULL, source_name TEXT NOT NULL,
    timestamp TEXT NOT NULL, timestamp_source TEXT NOT NULL, epoch REAL NOT NULL, width INTEGER NOT NULL,
    height INTEGER NOT NULL, event_id TEXT NOT NULL, boxes_json TEXT NOT NULL, probs BLOB,
    processed_at TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS media_event ON media(event_id);
CREATE TABLE IF NOT EXISTS events (
    event_id TEXT PRIMARY KEY, deployment_id TEXT NOT NULL, start TEXT NOT NULL, "end" TEXT NOT NULL,
    start_epoch REAL NOT NULL, end_epoch REAL NOT NULL, n_media INTEGER NOT NULL, n_classified INTEGER NOT NULL,
    prob_sum BLOB, species_index INTEGER, confidence REAL, status TEXT NOT NULL, uncertainty REAL NOT NULL,
    verdict TEXT, verdict_species TEXT, verdict_by TEXT, verdict_at TEXT, camera_time INTEGER NOT NULL DEFAULT 1);
CREATE INDEX IF NOT EXISTS events_span ON events(deployment_id, start_epoch, end_epoch);
CREATE INDEX IF NOT EXISTS events_review ON events(verdict, uncertainty);
"""


@dataclass(frozen=True)
class PhotoEntry:
    """One processed photo.

    Attributes:
        media_id: ``shared.camtrap_dp.media_id`` of its bytes.
        deployment_id: Camtrap DP deployment.
        file_path: its path inside the package (``media/...``).
        source_name: its name in the incoming folder (relative, POSIX).
        timestamp, timestamp_source: capture time (ISO 8601 with offset) and where it came from.
        width, height: pixels.
        boxes: per detection ``{"bbox": [x, y, w, h] normalised, "confidence": detector score, "species": name or
            None, "species_index": int or None, "species_confidence": float or None, "species_status": str or
            None}``, most confident first.
        probs: float (K,) probabilities of the most confident detection, or None (no box, or no classifier).
        event_id: the event it belongs to (set by :meth:`FieldStore.add_photo`).
    """

    media_id: str
    deployment_id: str
    file_path: str
    source_name: str
    timestamp: str
    timestamp_source: str
    width: int
    height: int
    boxes: tuple[dict, ...] = ()
    probs: np.ndarray | None = None
    event_id: str = ""


@dataclass(frozen=True)
class EventEntry:
    """An event as the review page shows it.

    Attributes:
        event_id, deployment_id, start, end: identity and span (ISO 8601).
        n_media: photos in it; n_classified: photos whose probabilities were averaged.
        species_index, confidence, status: the event's reading (``predictions.read_prediction`` of the mean
            vector), or None / ``blank`` (no photo had a detection) / ``unclassified`` (no model yet).
        uncertainty: 1 - confidence for classified events, 0 otherwise (what "least certain first" sorts by).
        verdict, verdict_species, verdict_by, verdict_at: the last ranger verdict, or None.
    """

    event_id: str
    deployment_id: str
    start: str
    end: str
    n_media: int
    n_classified: int
    species_index: int | None
    confidence: float | None
    status: str
    uncertainty: float
    verdict: str | None
    verdict_species: str | None
    verdict_by: str | None
    verdict_at: str | None


def _blob(values: np.ndarray | None) -> bytes | None:
    return None if values is None else np.ascontiguousarray(values, dtype="<f8").tobytes()


def _array(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f8").copy()


class FieldStore:
    """The index (module docstring). Thread-safe within a process.

    Args:
        path: the SQLite file (created with its folder).
        gap_s: the event gap in seconds (:mod:`edge_sdk.field.events`).
    """

    def __init__(self, path: str | Path, *, gap_s: float = DEFAULT_GAP_S) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.gap_s = float(gap_s)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    # -- photos and events ------------------------------------------------------------------------------------
    def has_media(self, media_id: str) -> bool:
        """Whether a photo with this media id was processed."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM media WHERE media_id = ?", (media_id,)).fetchone() is not None

    def add_photo(self, photo: PhotoEntry, read: Callable[[np.ndarray], Prediction],
                  write: Callable[[str], str] | None = None) -> str:
        """Store a processed photo and put it in an event (joining or opening one); returns the event id.

        Args:
            photo: the photo (``event_id`` ignored).
            read: reads an event's mean probability vector (``predictions.read_prediction`` with the site's
                settings).
            write: called with the event id inside the transaction, before it commits (the caller writes the
                package there); returns the photo's ``filePath`` in the package, stored instead of
                ``photo.file_path``. If it raises, nothing is stored.

        A media id stored already is not stored again (its event id is returned, ``write`` is not called).
        """
        when = epoch_seconds(photo.timestamp)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT event_id FROM media WHERE media_id = ?", (photo.media_id,)).fetchone()
                if row is not None:
                    self._db.execute("COMMIT")
                    return str(row[0])
                event_id = self._join_event(photo, when, read)
                file_path = write(event_id) if write is not None else photo.file_path
                self._db.execute(
                    "INSERT INTO media VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, datetime('now'))",
                    (photo.media_id, photo.deployment_id, file_path, photo.source_name, photo.timestamp,
                     photo.timestamp_source, when, photo.width, photo.height, event_id,
                     json.dumps(list(photo.boxes)), _blob(photo.probs)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return event_id

    def _join_event(self, photo: PhotoEntry, when: float, read: Callable[[np.ndarray], Prediction]) -> str:
        # only a camera's own clock groups photos: a file time (a card copied, an upload) says when the file came,
        # not when the animal was there, so such a photo is an event of its own and nothing joins it
        camera_time = photo.timestamp_source == "exif"
        near = self._db.execute(
            'SELECT event_id, start_epoch, end_epoch FROM events WHERE deployment_id = ? AND start_epoch <= ? '
            'AND end_epoch >= ? AND camera_time = 1',
            (photo.deployment_id, when + self.gap_s, when - self.gap_s)).fetchall() if camera_time else []
        joined = assign_event([EventSpan(e, s, t) for e, s, t in near], when, gap_s=self.gap_s)
        if joined is None:
            event_id = event_id_for(photo.deployment_id, photo.media_id)
            self._db.execute('INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, 0, 0, NULL, NULL, NULL, ?, 0, '
                             'NULL, NULL, NULL, NULL, ?)',
                             (event_id, photo.deployment_id, photo.timestamp, photo.timestamp, when, when,
                              "blank", int(camera_time)))
        else:
            event_id = joined.event_id
        start, end, s_epoch, e_epoch, n, k, prob_sum = self._db.execute(
            'SELECT start, "end", start_epoch, end_epoch, n_media, n_classified, prob_sum FROM events '
            'WHERE event_id = ?', (event_id,)).fetchone()
        if when < s_epoch:
            start, s_epoch = photo.timestamp, when
        if when > e_epoch:
            end, e_epoch = photo.timestamp, when
        total = _array(prob_sum)
        if photo.probs is not None:
            vec = np.asarray(photo.probs, dtype=np.float64)
            total = vec if total is None else total + vec
            k += 1
        if total is not None:
            reading = read(total / k)
            species, confidence, status = reading.index, reading.confidence, reading.status
            uncertainty = 1.0 - reading.confidence
        else:
            has_boxes = any(json.loads(b)
                            for (b,) in self._db.execute("SELECT boxes_json FROM media WHERE event_id = ?",
                                                         (event_id,))) or bool(photo.boxes)
            species, confidence, uncertainty = None, None, 0.0
            status = "unclassified" if has_boxes else "blank"
        self._db.execute(
            'UPDATE events SET start = ?, "end" = ?, start_epoch = ?, end_epoch = ?, n_media = ?, n_classified = ?, '
            'prob_sum = ?, species_index = ?, confidence = ?, status = ?, uncertainty = ? WHERE event_id = ?',
            (start, end, s_epoch, e_epoch, n + 1, k, _blob(total), species, confidence, status, uncertainty,
             event_id))
        return event_id

    # -- reading for the review page --------------------------------------------------------------------------
    #: Sort keys of :meth:`events`: (column, descending) pairs; ``event_id`` breaks ties, so paging is stable.
    ORDERS = {"uncertain": (("uncertainty", True), ("end_epoch", True), ("event_id", False)),
              "newest": (("end_epoch", True), ("event_id", False))}
    #: Event statuses (:class:`EventEntry`).
    STATUSES = ("confident", "unexpected", "unknown", "blank", "unclassified")

    def _filters(self, reviewed: bool | None, deployment_id: str | None,
                 status: str | None) -> tuple[list[str], list[object]]:
        if status is not None and status not in self.STATUSES:
            raise ValueError(f"status must be one of {', '.join(self.STATUSES)}, got {status!r}")
        where: list[str] = []
        args: list[object] = []
        if reviewed is not None:
            where.append("verdict IS NOT NULL" if reviewed else "verdict IS NULL")
        if deployment_id is not None:
            where.append("deployment_id = ?")
            args.append(deployment_id)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        return where, args

    def _after(self, order: str, event_id: str) -> tuple[str, list[object]]:
        """A WHERE clause selecting the events after ``event_id`` in ``order`` (a keyset; lexicographic on the
        order's key)."""
        keys = self.ORDERS[order]
        row = self._db.execute(f"SELECT {', '.join(c for c, _ in keys)} FROM events WHERE event_id = ?",
                               (event_id,)).fetchone()
        if row is None:
            raise KeyError(event_id)
        terms, args = [], []
        for i, (column, descending) in enumerate(keys):
            equal = [f"{c} = ?" for c, _ in keys[:i]]
            terms.append("(" + " AND ".join([*equal, f"{column} {'<' if descending else '>'} ?"]) + ")")
            args.extend([*row[:i], row[i]])
        return "(" + " OR ".join(terms) + ")", args

    def events(self, *, order: str = "uncertain", reviewed: bool | None = False, deployment_id: str | None = None,
               status: str | None = None, after: str | None = None, limit: int = 50,
               offset: int = 0) -> list[EventEntry]:
        """Events for review.

        Args:
            order: ``uncertain`` (least certain first, then newest) or ``newest`` (latest end first); ties in event
                id order.
            reviewed: False: only events without a verdict; True: only reviewed ones; None: all.
            deployment_id: only this deployment's events.
            status: only events with this reading (one of :data:`STATUSES`).
            after: only events that come after this event in ``order`` (the event itself may match the filters or
                not).
            limit, offset: paging.

        Raises:
            ValueError: an unknown order or status.
            KeyError: ``after`` names no event.
        """
        if order not in self.ORDERS:
            raise ValueError(f"order must be one of {sorted(self.ORDERS)}, got {order!r}")
        where, args = self._filters(reviewed, deployment_id, status)
        order_by = ", ".join(f"{c} {'DESC' if d else 'ASC'}" for c, d in self.ORDERS[order])
        with self._lock:
            if after is not None:
                clause, more = self._after(order, after)
                where.append(clause)
                args.extend(more)
            sql = ('SELECT event_id, deployment_id, start, "end", n_media, n_classified, species_index, confidence, '
                   'status, uncertainty, verdict, verdict_species, verdict_by, verdict_at FROM events'
                   + (f" WHERE {' AND '.join(where)}" if where else "") + f" ORDER BY {order_by} LIMIT ? OFFSET ?")
            rows = self._db.execute(sql, (*args, int(limit), int(offset))).fetchall()
        return [EventEntry(*r) for r in rows]

    def count_events(self, *, reviewed: bool | None = False, deployment_id: str | None = None,
                     status: str | None = None) -> int:
        """How many events :meth:`events` lists with these filters (for paging).

        Raises:
            ValueError: an unknown status.
        """
        where, args = self._filters(reviewed, deployment_id, status)
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM events"
                                        + (f" WHERE {' AND '.join(where)}" if where else ""), args).fetchone()[0])

    def event(self, event_id: str) -> EventEntry | None:
        """One event, or None."""
        with self._lock:
            row = self._db.execute(
                'SELECT event_id, deployment_id, start, "end", n_media, n_classified, species_index, confidence, '
                'status, uncertainty, verdict, verdict_species, verdict_by, verdict_at FROM events '
                'WHERE event_id = ?', (event_id,)).fetchone()
        return EventEntry(*row) if row is not None else None

    def event_photos(self, event_id: str) -> list[PhotoEntry]:
        """The photos of an event in capture order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT media_id, deployment_id, file_path, source_name, timestamp, timestamp_source, width, "
                "height, boxes_json, probs, event_id FROM media WHERE event_id = ? ORDER BY epoch, media_id",
                (event_id,)).fetchall()
        return [PhotoEntry(m, d, f, s, t, ts, w, h, tuple(json.loads(b)), _array(p), e)
                for m, d, f, s, t, ts, w, h, b, p, e in rows]

    def photo(self, media_id: str) -> PhotoEntry | None:
        """One photo, or None."""
        with self._lock:
            row = self._db.execute("SELECT event_id FROM media WHERE media_id = ?", (media_id,)).fetchone()
        if row is None:
            return None
        return next((p for p in self.event_photos(row[0]) if p.media_id == media_id), None)

    def counts(self) -> dict[str, int]:
        """``{"media": n, "events": n, "reviewed": n, "unreviewed": n}``."""
        with self._lock:
            media = self._db.execute("SELECT COUNT(*) FROM media").fetchone()[0]
            events, reviewed = self._db.execute(
                "SELECT COUNT(*), COUNT(verdict) FROM events").fetchone()
        return {"media": media, "events": events, "reviewed": reviewed, "unreviewed": events - reviewed}

    def set_verdict(self, event_id: str, *, verdict: str, species: str | None, by: str, at: str) -> None:
        """Record the ranger's last verdict on an event (the package keeps every verdict as observations).

        Raises:
            KeyError: no such event.
        """
        with self._lock:
            cur = self._db.execute("UPDATE events SET verdict = ?, verdict_species = ?, verdict_by = ?, "
                                   "verdict_at = ? WHERE event_id = ?", (verdict, species, by, at, event_id))
        if cur.rowcount != 1:
            raise KeyError(event_id)

    def deployments(self) -> Sequence[str]:
        """Deployment ids with events, sorted."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT deployment_id FROM events ORDER BY 1")]
