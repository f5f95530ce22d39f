"""Message handlers off paho's network thread: :class:`QueuedCallback` (the ingest thread) and the handler-thread
mark that lets :meth:`coordinator.transport.mqtt.MqttTransport.publish` skip waiting for a PUBACK there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator.transport import Callback

__all__ = ["QueuedCallback", "mark_handler_thread", "on_handler_thread"]

log = logging.getLogger(__name__)

_HANDLER_THREAD = threading.local()
"""``active`` is True on a :class:`QueuedCallback`'s thread (and on threads that :func:`mark_handler_thread`)."""


def mark_handler_thread() -> None:
    """Declare the calling thread a message handler's thread: :meth:`coordinator.transport.mqtt.MqttTransport.publish`
    from it does not wait for the PUBACK (paho sends and retransmits QoS 1 by itself). For threads that publish ACKs
    on behalf of the ingest thread, e.g. the group committer (coordinator.inbound.group_commit.BackgroundCommits):
    waiting there would hold the ingest lock for a network round trip per ACK."""
    _HANDLER_THREAD.active = True


def on_handler_thread() -> bool:
    """Whether the calling thread is a message handler's thread (a :class:`QueuedCallback`'s, or one that called
    :func:`mark_handler_thread`)."""
    return bool(getattr(_HANDLER_THREAD, "active", False))


class QueuedCallback:
    """Runs a transport callback on its own thread, so that slow work (verify, decode, fsync) never runs on paho's
    network thread, which must keep reading the socket and completing PUBACKs (paho-mqtt docs: "do not block in
    callbacks").

    Messages are handled one at a time, in arrival order. The queue is bounded in bytes: when ``max_bytes`` are
    waiting, the network thread blocks in :meth:`__call__`, which stops reading the socket, and TCP back-pressure
    holds the rest at the broker.

    Group commit (coordinator.inbound.group_commit): with ``flush`` and ``flush_in`` given, this thread also drives the
    callback's commit groups. Between messages it asks ``flush_in()`` how long the open group may still wait: when
    that is over it calls ``flush()`` before taking another message, and while the queue is empty it waits for a
    message at most that long, then calls ``flush()``. So a group is never older than the policy's
    ``max_delay_s`` when it is committed, busy or idle, and a lone update waits at most that long.

    Args:
        callback: ``callback(topic, payload)``; its exceptions are logged, never propagated.
        name: thread name (logs).
        max_bytes: payload bytes that may wait, default 64 MiB (the rest waits at the broker: TCP back-pressure).
        flush: makes the callback's open commit group durable (e.g. ``Ingestor.flush``); its exceptions are logged.
        flush_in: seconds until the open group must be flushed (<= 0: now), None when none is open (e.g.
            ``Ingestor.flush_in``).
        busy: whether a commit group is still open or being committed (e.g. ``Ingestor.committing``); :meth:`drain`
            waits for it. Default: ``flush_in() is not None``.
    """

    def __init__(self, callback: Callback, *, name: str = "wildfed-ingest", max_bytes: int = 64 << 20,
                 flush: Callable[[], None] | None = None, flush_in: Callable[[], float | None] | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        import queue

        self._callback = callback
        self._max_bytes = int(max_bytes)
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._waiting = 0
        self._busy = False
        self._flush = flush
        self._flush_in = flush_in if flush is not None else None
        self._group_busy = busy
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __call__(self, topic: str, payload: bytes) -> None:
        """Enqueue (blocks while ``max_bytes`` are already waiting)."""
        with self._cond:
            while self._waiting and self._waiting + len(payload) > self._max_bytes:
                self._cond.wait()
            self._waiting += len(payload)
        self._queue.put((topic, payload))

    def _next(self) -> tuple[str, bytes] | None:
        """The next message; meanwhile flushes the callback's commit group when it is due (class docstring)."""
        import queue

        while True:
            left = self._flush_in() if self._flush_in is not None else None
            if left is None:
                return self._queue.get()
            if left > 0:
                try:
                    return self._queue.get(timeout=left)
                except queue.Empty:
                    pass
            self._run_flush()

    def _run_flush(self) -> None:
        with self._cond:
            self._busy = True
        try:
            assert self._flush is not None
            self._flush()
        except Exception:  # noqa: BLE001 - a storage failure must not stop ingest (the gateways re-send)
            log.exception("queued handler: group commit failed")
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _run(self) -> None:
        _HANDLER_THREAD.active = True  # publishes from here do not wait for their PUBACK (MqttTransport.publish)
        while True:
            item = self._next()
            if item is None:
                if self._flush is not None:
                    self._run_flush()  # what was checked before the stop is made durable and ACKed
                return
            topic, payload = item
            with self._cond:
                self._busy = True
            try:
                self._callback(topic, payload)
            except Exception:  # noqa: BLE001 - a handler bug must not stop ingest
                log.exception("queued handler for %s raised", topic)
            finally:
                with self._cond:
                    self._waiting -= len(payload)
                    self._busy = False
                    self._cond.notify_all()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was handled (and the commit group they opened is durable); returns
        False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting or self._busy or not self._queue.empty() or self._group_open():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _group_open(self) -> bool:
        if self._group_busy is not None:
            return self._group_busy()
        return self._flush_in is not None and self._flush_in() is not None

    def close(self) -> None:
        """Stop the thread after the messages already queued (messages not yet handled are resent by gateways,
        which keep them until ACKed)."""
        self._queue.put(None)
        self._thread.join(timeout=30)
