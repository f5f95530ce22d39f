"""Group commit of accepted updates: several updates made durable by one batch of blob fsyncs and one database
commit, each acknowledged only after its group is durable.

Group commit is the classic way to amortise the cost of forcing a log to disk over several transactions (DeWitt et
al., "Implementation techniques for main memory database systems", SIGMOD 1984, sec. 4; PostgreSQL's
``commit_delay``/``commit_siblings``, https://www.postgresql.org/docs/current/wal-configuration.html). Here the
"transactions" are accepted updates: :class:`coordinator.inbound.ingest.Ingestor` checks an update completely, then
hands it to a :class:`GroupCommitter` (through :class:`CommitGroups`) instead of writing it at once. A group is made
durable (:meth:`GroupCommitter.flush`)

1. by writing every payload of the group as a blob and then fsync-ing them (:meth:`Store.put_blobs`), and
2. by inserting every update row, and deleting the consumed ``transfers`` rows, in ONE database transaction
   (:meth:`Store.add_updates_if_open`: one commit, one WAL fsync on SQLite);

only then is each update's *finisher* called, in arrival order, which publishes its ACK and then folds it into the
round's running sum. The per-update order of the ingest module, durable -> ACK -> accumulate, is unchanged; what is
shared is the commit (one transaction, one WAL fsync) and the pass of blob fsyncs.

A coordinator (coordinator.service) makes its groups durable on a committer thread (:class:`BackgroundCommits`):
while one group's blobs are fsync-ed and its rows committed, the ingest thread goes on verifying and decoding the
next messages. The blob fsyncs cost what the disk takes to write the bytes (about 12 ms per 3.8 MiB update on the
development machine, the same batched or not), so overlapping them with the checks is what takes them off the
ingest thread's path. One group at most is in flight; its finishers run on the committer thread under the ingest
lock. Called without that thread (tests, ingest workers), a group is made durable and finished in the calling
thread.

When a group is flushed (the bound on latency and memory):

=========================================== =================================================================
 the group holds ``max_updates`` updates      at once, inside the call that submitted the last one
 or ``max_bytes`` of payload
 its oldest update waited ``max_delay_s``     by the ingest thread's loop
                                              (coordinator.transport.handlers.QueuedCallback), which never lets a
                                              group wait past that, busy or idle
 the ingest queue is empty                    the loop waits for another message until the group's deadline at
                                              most, then flushes: a lone update waits ``max_delay_s`` or less
 a message about a pending update arrives     first (its duplicate check must see the stored row)
 the round closes / the process stops         first (``Ingestor.close_round``, ``QueuedCallback.close``)
 nobody drives the loop (direct calls)        at the end of every ``Ingestor.handle``: groups of one
=========================================== =================================================================

Crash safety: an update is ACKed only after its group's blobs are fsync-ed and its row is committed. A process
killed before the commit loses only updates that were never ACKed (the gateways keep them in their outboxes and
send them again). A process killed after the commit but before the ACKs (the TEST-ONLY hook below) leaves updates
that are stored but un-ACKed: the restarted coordinator recovers their round from the stored rows, counting each
once (``RoundManager.recover``), and the gateway's re-sent copy is recognised as a duplicate of the stored update and
ACKed positively (``coordinator.inbound.replies.SiteReplies``), so it is neither lost nor counted twice
(tests/coordinator/test_group_commit.py).

TEST-ONLY crash hook: with the environment variable ``WILDFED_TEST_CRASH_AT=after_group_commit`` the process
SIGKILLs itself right after a group's commit, before any of its ACKs is published (the power cut between commit and
ACK). Never set it in production.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from shared.errors import ConfigError

from coordinator.storage import Store, UpdateOutcome, UpdateRow
from coordinator.transport.handlers import mark_handler_thread

if TYPE_CHECKING:
    from coordinator.config_operations import GroupCommitConfig

__all__ = ["GroupCommitPolicy", "StagedUpdate", "GroupCommitter", "BackgroundCommits", "CommitGroups",
           "CRASH_AFTER_COMMIT"]

log = logging.getLogger(__name__)

_CRASH_ENV = "WILDFED_TEST_CRASH_AT"
CRASH_AFTER_COMMIT = "after_group_commit"
"""The value of ``$WILDFED_TEST_CRASH_AT`` that SIGKILLs the process between a group's commit and its ACKs."""


@dataclass(frozen=True)
class GroupCommitPolicy:
    """How large and how old a group of accepted updates may grow before it is made durable (``group_commit:`` in
    the coordinator config).

    Attributes:
        max_updates: updates per group (>= 1; 1 turns group commit off: every update is committed alone).
        max_delay_s: seconds the first update of a group may wait for others, >= 0 (the longest an ACK is delayed
            by grouping; 0: flush whenever the ingest queue is empty). As PostgreSQL's ``commit_delay``, a few
            milliseconds: far below a gateway's resend interval, long enough to gather the updates in flight.
        max_bytes: payload bytes per group (>= 1024): the decoded updates wait in memory until their group is
            durable.

    Raises:
        ConfigError: a value out of range (names the field ``group_commit.<name>`` and the fix).
    """

    max_updates: int = 32
    max_delay_s: float = 0.005
    max_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        if isinstance(self.max_updates, bool) or not isinstance(self.max_updates, int) or self.max_updates < 1:
            raise ConfigError(f"max_updates is {self.max_updates!r}", field="group_commit.max_updates",
                              fix="give a whole number >= 1 (1: commit every update alone)")
        if not isinstance(self.max_delay_s, (int, float)) or not 0 <= self.max_delay_s <= 1.0:
            raise ConfigError(f"max_delay_s is {self.max_delay_s!r}", field="group_commit.max_delay_s",
                              fix="give seconds between 0 and 1 (a few milliseconds, e.g. 0.005)")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1024:
            raise ConfigError(f"max_bytes is {self.max_bytes!r}", field="group_commit.max_bytes",
                              fix="give at least 1024 bytes (e.g. 134217728 for 128 MiB)")

    @classmethod
    def from_config(cls, config: GroupCommitConfig) -> GroupCommitPolicy:
        """The policy of the ``group_commit:`` section of the coordinator config
        (:class:`coordinator.config_operations.GroupCommitConfig`).

        Raises:
            ConfigError: a value out of range (see the class).
        """
        return cls(max_updates=config.max_updates, max_delay_s=config.max_delay_s, max_bytes=config.max_bytes)


@dataclass
class StagedUpdate:
    """An update that passed every check and waits for its group to become durable.

    Attributes:
        row: its ``updates`` row (not yet in any session).
        payload: the bytes to store as a blob; digest: their verified hex SHA-256 (the blob's name).
        finish: ``finish(outcome)``, called once after the group's commit (ACK, then accumulate; or refuse it when
            the outcome is not :attr:`UpdateOutcome.STORED`); its return value is the update's ingest result.
        nbytes: ``len(payload)``.
        done, result: set by :meth:`GroupCommitter.flush` once ``finish`` returned: True and its return value.
    """

    row: UpdateRow
    payload: bytes
    digest: str
    finish: Callable[[UpdateOutcome], object]
    nbytes: int = field(init=False)
    done: bool = field(default=False, init=False)
    result: object = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.payload)

    @property
    def key(self) -> tuple[int, str]:
        """(round, site id): at most one update per pair is stored."""
        return (self.row.round, self.row.site_id)


class GroupCommitter:
    """Collects :class:`StagedUpdate` objects and makes them durable together (see the module docstring).

    Not thread-safe by itself: :class:`coordinator.inbound.ingest.Ingestor` calls it under its lock.

    Args:
        store: where blobs and rows go.
        policy: the group's bounds (:class:`GroupCommitPolicy`).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, store: Store, policy: GroupCommitPolicy | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.policy = policy or GroupCommitPolicy()
        self._clock = clock
        self._items: list[StagedUpdate] = []
        self._keys: set[tuple[int, str]] = set()
        self._bytes = 0
        self._since: float | None = None
        #: groups flushed and updates committed in them (``updates / groups`` is the mean group size).
        self.groups = 0
        self.updates = 0

    def __len__(self) -> int:
        return len(self._items)

    def holds(self, round: int, site_id: str) -> bool:
        """Whether an update of (``round``, ``site_id``) waits in the open group."""
        return (round, site_id) in self._keys

    def submit(self, item: StagedUpdate) -> None:
        """Add ``item`` to the open group (starting the group's clock if it is the first)."""
        if not self._items:
            self._since = self._clock()
        self._items.append(item)
        self._keys.add(item.key)
        self._bytes += item.nbytes

    def full(self) -> bool:
        """Whether the group reached ``max_updates`` or ``max_bytes`` (flush it now)."""
        return len(self._items) >= self.policy.max_updates or self._bytes >= self.policy.max_bytes

    def seconds_left(self) -> float | None:
        """Seconds until the open group must be flushed (<= 0: now), or None when no group is open."""
        if self._since is None:
            return None
        return self._since + self.policy.max_delay_s - self._clock()

    def take(self) -> list[StagedUpdate]:
        """Close the open group and return its updates (empty when none was open); a new group starts with the next
        :meth:`submit`."""
        items, self._items, self._keys, self._bytes, self._since = self._items, [], set(), 0, None
        return items

    def make_durable(self, items: list[StagedUpdate]) -> list[UpdateOutcome]:
        """Step 1 for a taken group: write and fsync its blobs, then insert its rows in one transaction. Needs no
        lock (the store is thread-safe): :class:`BackgroundCommits` runs it beside the ingest thread.

        Returns:
            one :class:`UpdateOutcome` per update, in order.

        Raises:
            OSError: a blob could not be written; sqlalchemy errors: the database failed. Nothing of the group may
                then be ACKed: the gateways re-send what was not ACKed.
        """
        if not items:
            return []
        self._store.put_blobs([(it.payload, it.digest) for it in items])
        outcomes = self._commit_rows([it.row for it in items])
        self.groups += 1
        self.updates += len(items)
        if os.environ.get(_CRASH_ENV) == CRASH_AFTER_COMMIT:  # TEST ONLY: the power cut between commit and ACK
            os.kill(os.getpid(), signal.SIGKILL)
        return outcomes

    @staticmethod
    def finish(items: list[StagedUpdate], outcomes: list[UpdateOutcome]) -> list[object]:
        """Steps 2 and 3 for a durable group: each update's finisher (ACK, then accumulate; or the refusal the commit
        found), in arrival order. Call it under the ingest lock.

        Returns:
            the finishers' results, in arrival order.

        Raises:
            Exception: the first exception a finisher raised (a bug), re-raised after every other finisher ran (a
                stored update left un-ACKed that way is re-ACKed as a duplicate when its gateway re-sends it, and
                counted at the round's close: ``RoundManager._absorb_stored``).
        """
        results: list[object] = []
        error: Exception | None = None
        for it, outcome in zip(items, outcomes):
            try:
                it.result = it.finish(outcome)
                it.done = True
                results.append(it.result)
            except Exception as exc:  # noqa: BLE001 - a bug in one finisher must not leave the others un-ACKed
                log.exception("group commit: finishing %s's round %d update raised", it.row.site_id, it.row.round)
                results.append(None)
                error = error or exc
        if error is not None:
            raise error
        return results

    def flush(self) -> list[object]:
        """Make the open group durable, then call each update's finisher in arrival order, all in this thread.

        Returns:
            the finishers' results, in arrival order (empty when no group was open).

        Raises:
            OSError, sqlalchemy errors: see :meth:`make_durable` (the group is dropped, nothing ACKed).
            Exception: see :meth:`finish`.
        """
        items = self.take()
        if not items:
            return []
        return self.finish(items, self.make_durable(items))

    def _commit_rows(self, rows: list[UpdateRow]) -> list[UpdateOutcome]:
        """One transaction for the group; if another process stored one of its pairs meanwhile (IntegrityError on
        PostgreSQL with several workers), one transaction per row, so only that pair is a duplicate."""
        try:
            return self._store.add_updates_if_open(rows)
        except IntegrityError:
            log.info("group commit: another process stored one of %d updates meanwhile; committing one by one",
                     len(rows))
        outcomes = []
        for row in rows:
            fresh = UpdateRow(round=row.round, site_id=row.site_id, sequence=row.sequence,
                              num_examples=row.num_examples, payload_sha256=row.payload_sha256)
            try:
                outcomes.extend(self._store.add_updates_if_open([fresh]))
            except IntegrityError:
                outcomes.append(UpdateOutcome.DUPLICATE)
        return outcomes


class BackgroundCommits:
    """Makes taken groups durable on a thread of its own, so that the fsyncs and the commit of one group overlap the
    checks of the next (the ingest thread keeps verifying and decoding meanwhile); the blob fsyncs are bound by the
    disk's bandwidth (about 12 ms for a 3.8 MiB update on the development machine), so hiding them matters more
    than merging them. At most one group is in flight: :meth:`seal` waits for the previous one, which keeps ACKs in
    arrival order and bounds the memory to two groups.

    The finishers (ACK, then accumulate) run on this thread too, under ``cond``'s lock (the ingest lock), after the
    group is durable. Every method is called with that lock held; waiting releases it (``Condition.wait``).

    Args:
        committer: the :class:`GroupCommitter` whose groups are committed.
        cond: a condition on the ingest lock (``Ingestor.changed``); notified when a group is finished.
        name: thread name (logs).
    """

    def __init__(self, committer: GroupCommitter, cond: threading.Condition, *,
                 name: str = "wildfed-commit") -> None:
        self._committer = committer
        self._cond = cond
        self._inflight: list[StagedUpdate] | None = None
        self._keys: set[tuple[int, str]] = set()
        self._handoff: queue.SimpleQueue[list[StagedUpdate]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a group is being made durable or finished now."""
        return self._inflight is not None

    def holds(self, round: int, site_id: str) -> bool:
        """Whether an update of (``round``, ``site_id``) is in the group in flight."""
        return (round, site_id) in self._keys

    def wait(self) -> None:
        """Block (releasing the lock) until no group is in flight."""
        while self._inflight is not None:
            self._cond.wait()

    def seal(self) -> None:
        """Hand the committer's open group to the thread (after the group in flight, if any, is finished); no-op
        when no group is open."""
        self.wait()
        items = self._committer.take()
        if not items:
            return
        self._inflight = items
        self._keys = {it.key for it in items}
        self._handoff.put(items)

    def _run(self) -> None:
        mark_handler_thread()  # its ACKs go out as the ingest thread's do: no wait for each PUBACK under the lock
        while True:
            items = self._handoff.get()
            outcomes: list[UpdateOutcome] | None = None
            try:
                outcomes = self._committer.make_durable(items)
            except Exception:  # noqa: BLE001 - a storage failure must not stop ingest (the gateways re-send)
                log.exception("group commit: a group of %d update(s) could not be stored; none was ACKed", len(items))
            with self._cond:
                try:
                    if outcomes is not None:
                        self._committer.finish(items, outcomes)
                except Exception:  # noqa: BLE001 - logged per update by finish
                    pass
                finally:
                    self._inflight, self._keys = None, set()
                    self._cond.notify_all()


class CommitGroups:
    """The ingest path's handle on group commit: the open group (a :class:`GroupCommitter`) and, once
    :meth:`run_in_background` was called, the committer thread that makes sealed groups durable
    (:class:`BackgroundCommits`). Without that thread a sealed group is made durable in the calling thread.

    Every method is called with ``cond``'s lock held (the ingest lock); waiting for the group in flight releases it.

    Args:
        store: where blobs and rows go. policy: the group's bounds (None: the default :class:`GroupCommitPolicy`).
        cond: a condition on the ingest lock (``Ingestor.changed``), notified after each group commit.
    """

    def __init__(self, store: Store, policy: GroupCommitPolicy | None, cond: threading.Condition) -> None:
        self.committer = GroupCommitter(store, policy)
        self._cond = cond
        self._background: BackgroundCommits | None = None

    def run_in_background(self) -> None:
        """From now on :meth:`seal` hands a group to a committer thread. Idempotent."""
        if self._background is None:
            self._background = BackgroundCommits(self.committer, self._cond)

    def submit(self, item: StagedUpdate) -> None:
        """Add ``item`` to the open group."""
        self.committer.submit(item)

    def flush(self) -> None:
        """The group in flight finished (waiting releases the lock), then the open group made durable and finished
        in this thread.

        Raises:
            OSError, sqlalchemy errors: storing failed; nothing of the group was ACKed.
        """
        if self._background is not None:
            self._background.wait()
        if len(self.committer):
            try:
                self.committer.flush()
            finally:
                self._cond.notify_all()

    def seal(self) -> None:
        """Start making the open group durable: on the committer thread (waiting only for the group already in
        flight), else as :meth:`flush`."""
        if self._background is not None:
            self._background.seal()
        else:
            self.flush()

    def seal_if_due(self) -> None:
        """:meth:`seal` when the open group is full or past its deadline."""
        if self.committer.full() or (self.committer.seconds_left() or 0.0) < 0:
            self.seal()

    def holds(self, round: int, site_id: str) -> bool:
        """Whether an update of (``round``, ``site_id``) waits in the open group or is in the group in flight."""
        return self.committer.holds(round, site_id) or (self._background is not None
                                                        and self._background.holds(round, site_id))

    @property
    def busy(self) -> bool:
        """Whether an update is waiting for, or in, a group commit (open group or one in flight)."""
        return bool(len(self.committer)) or (self._background is not None and self._background.in_flight)

    def seconds_left(self) -> float | None:
        """Seconds until the open group must be flushed (<= 0: now), or None when none is open."""
        return self.committer.seconds_left()
