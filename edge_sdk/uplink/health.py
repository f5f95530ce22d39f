"""The gateway's health records (``shared.health``): built from the gateway's own state and published, signed with
the site key, on its ``health`` topic at start and after every reconnect, when it keeps a new global model, and
every ``health_interval_s`` (site.yaml; 0 sends none).

What goes in is declared public (docs/privacy.md, "Public metadata"; the fields are described in
:class:`shared.health.HealthRecord`). The photo and detection backlogs are left out (None) where the site publishes
no detection records: there, how many photos arrive is not disclosed anyway, and the record must not start to.
A record that cannot be sent (no link) is dropped: the next one says the same, newer.

:class:`ErrorLog` is a logging handler on the ``edge_sdk`` logger that remembers the newest ERROR line (the
record's ``last_error``), cut to ``shared.health.MAX_ERROR_CHARS`` characters.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shared.envelope import MessageKind, seal
from shared.errors import WildFedError
from shared.health import MAX_ERROR_CHARS, VERSION_PATTERN, HealthRecord, encode_health, round_disk_free
from shared.topics import health_topic

from edge_sdk.config import global_model_path
from edge_sdk.global_model import kept_version
from edge_sdk.rounds.context import AgentContext
from edge_sdk.site_paths import detection_queue_path, state_dir
from edge_sdk.uplink.transport import TransportError

__all__ = ["ErrorLog", "HealthReporter", "sdk_version"]

log = logging.getLogger(__name__)

_SEQUENCE = "health_sequence"


def sdk_version() -> str:
    """The installed WildFed version (``importlib.metadata``), ``"unknown"`` when not installed as a package."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wildfed")
    except PackageNotFoundError:
        return "unknown"


class ErrorLog(logging.Handler):
    """Remembers the newest ERROR (or worse) record logged under ``logger`` (default ``edge_sdk``): its message,
    cut to :data:`shared.health.MAX_ERROR_CHARS` characters, and its time. :meth:`close` detaches it."""

    def __init__(self, logger: str = "edge_sdk") -> None:
        super().__init__(level=logging.ERROR)
        self._logger = logging.getLogger(logger)
        self._lock_last = threading.Lock()
        self.last: tuple[str, int] | None = None
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        """Keep ``record``'s message and time (never raises)."""
        try:
            text = " ".join(record.getMessage().split())  # one line
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            text = str(record.msg)
        with self._lock_last:
            self.last = (text[:MAX_ERROR_CHARS], int(record.created))

    def close(self) -> None:
        """Detach from the logger."""
        self._logger.removeHandler(self)
        super().close()


class HealthReporter:
    """Builds and sends the site's health records (module docstring).

    Args:
        ctx: the agent's shared state (config, keys, transport, outbox, counters).
        field_queue_pending: ``() -> int | None``: detection records waiting, from the running field loop (None:
            read the queue's file instead).
        errors: the :class:`ErrorLog` whose newest line goes in the record (None: none).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, ctx: AgentContext, *, field_queue_pending: Callable[[], int | None] = lambda: None,
                 errors: ErrorLog | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self._field_pending = field_queue_pending
        self._errors = errors
        self._clock = clock
        self._started_at = int(time.time())
        self._next: float | None = None  # when the next periodic record is due (monotonic)
        self.version = sdk_version()

    @property
    def enabled(self) -> bool:
        """Whether records are sent (``health_interval_s`` > 0)."""
        return self.ctx.config.health_interval_s > 0

    def due(self) -> bool:
        """Whether the periodic record is due now."""
        return self.enabled and self._next is not None and self._clock() >= self._next

    # -- the record --------------------------------------------------------------------------------------------
    def record(self) -> HealthRecord:
        """The site's health record now (module docstring)."""
        cfg = self.ctx.config
        kept = kept_version(global_model_path(cfg)) if cfg.task == "camera" else None
        has_model = kept is not None and bool(kept.model_hash)
        photos = detections = None
        if cfg.task == "camera" and cfg.incoming is not None and cfg.field.publish_detections:
            photos = _photos_waiting(Path(cfg.incoming))
            detections = self._field_pending()
            if detections is None:
                detections = _queued(detection_queue_path(cfg))
        error = self._errors.last if self._errors is not None and cfg.health_report_errors else None
        return HealthRecord(sdk_version=self.version if VERSION_PATTERN.match(self.version) else "unknown",
                            model_round=kept.round if has_model else None,  # type: ignore[union-attr]
                            model_hash=kept.model_hash if has_model else "",  # type: ignore[union-attr]
                            last_round=max(-1, self.ctx.last_round()), outbox_backlog=self.ctx.outbox.count(),
                            incoming_backlog=photos, detection_backlog=detections,
                            disk_free_bytes=_disk_free(state_dir(cfg)),
                            last_error=error[0] if error else "", last_error_at=error[1] if error else None,
                            started_at=self._started_at)

    def send(self, why: str) -> bool:
        """Seal and publish a record now (``why``: logged); the next periodic one is due ``health_interval_s``
        later. Returns whether the broker took it; never raises."""
        if not self.enabled:
            return False
        ctx = self.ctx
        self._next = self._clock() + ctx.config.health_interval_s
        try:
            record = self.record()
            sequence = int(ctx.outbox.get_state(_SEQUENCE, "0") or 0) + 1
            ctx.outbox.set_state(_SEQUENCE, str(sequence))
            envelope = seal(private_key=ctx.signing_key, federation_id=ctx.config.federation_id,
                            site_id=ctx.site_id, round=max(0, record.last_round), base_model_hash=record.model_hash,
                            kind=MessageKind.HEALTH, sequence=sequence, payload=encode_health(record))
            ctx.transport.publish(health_topic(ctx.config.federation_id, ctx.site_id), envelope.to_bytes(), qos=1)
        except (TransportError, WildFedError, OSError, sqlite3.Error) as exc:
            log.info("site %s: health record (%s) not sent: %s", ctx.site_id, why, exc)
            return False
        ctx.stats["health_sent"] += 1
        log.debug("site %s: health record sent (%s)", ctx.site_id, why)
        return True


def _photos_waiting(root: Path) -> int | None:
    """Photos in the incoming folder (what the field loop would read: ``IncomingFolder.candidate``), None when the
    folder cannot be read."""
    from edge_sdk.field.incoming import IncomingFolder

    if not root.is_dir():
        return 0
    count = 0
    try:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            count += sum(IncomingFolder.candidate(Path(folder) / name, root) for name in files)
    except OSError:
        return None
    return count


def _queued(path: Path) -> int | None:
    """Messages waiting in the detection queue's SQLite file (read-only), 0 when there is none, None unreadable."""
    if not path.is_file():
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
        try:
            return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return None


def _disk_free(folder: Path) -> int | None:
    """Free bytes of the file system holding ``folder``, rounded down to a whole GiB; None when unknown."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return round_disk_free(shutil.disk_usage(folder).free)
    except OSError:
        return None
