"""How the coordinator's MQTT transport publishes: waiting for PUBACKs, pipelined publishing, refused messages.

:class:`MqttPublishing` is the publishing half of :class:`coordinator.transport.mqtt.MqttTransport` (a base of it);
its methods use the transport's paho client, lock, refusal counters and ``connect_timeout_s``.

Refused messages: a broker closes the connection, without a PUBACK, on a packet over its limit (Mosquitto
``max_packet_size``), and paho sends every unacknowledged message again after it reconnects: one task chunk over
the limit would disconnect the coordinator again and again (and it would receive nothing meanwhile). So at every
link drop the largest message awaiting its PUBACK is noted; the same one there ``max_drops`` drops in a row (the
config's ``transfer.max_dropped_sends``, default 3) is
taken for refused (shared.broker.RefusedMessages): paho's copies of it, and of every message at least as large,
are dropped, so they are not sent again, and a clear error naming ``transfer.chunk_size_bytes`` and
``broker_max_packet_bytes`` is logged (:attr:`coordinator.transport.mqtt.MqttTransport.refusals`,
:attr:`~coordinator.transport.mqtt.MqttTransport.refused`). A later
publish of a message that large is not sent (the same error, logged once per topic): the gateway's download then
stalls and it gives the task up after ``max_chunk_requests`` requests, with its own error. Publishing never raises
for this, so one site's oversized task does not stop the round's tasks to the other sites.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from coordinator.transport import TransportError
from coordinator.transport.handlers import on_handler_thread

if TYPE_CHECKING:
    from paho.mqtt.client import MQTTMessageInfo

__all__ = ["MqttPublishing"]

log = logging.getLogger("coordinator.transport.mqtt")  # the transport's log, whichever of its modules writes


class MqttPublishing:
    """Publishing over paho: :meth:`publish` (waits for the PUBACK), :meth:`pipelined` (many, waited for at the
    end), and giving up messages the broker refuses. A base of :class:`coordinator.transport.mqtt.MqttTransport`."""

    def _refuse_in_flight(self) -> None:
        """At a link drop: note the largest message awaiting its PUBACK; once the same one was there ``max_drops``
        drops in a row, drop paho's copies of it and of every message at least as large (module docstring,
        "Refused messages"). paho 2.x has no public call for it: this reads its ``_out_messages`` under its
        ``_out_message_mutex`` (as the gateway's transport does) and does nothing where a paho version lacks them."""
        messages = getattr(self._client, "_out_messages", None)
        mutex = getattr(self._client, "_out_message_mutex", None)
        if messages is None or mutex is None:
            return
        waiting = getattr(self._mqtt, "mqtt_ms_wait_for_puback", None)
        with mutex:
            in_flight = [m for m in messages.values() if waiting is None or m.state == waiting] or list(messages.values())
            if not in_flight:
                suspect = None
            else:
                largest = max(in_flight, key=lambda m: len(m.payload))  # the first of the largest: sent first
                suspect = (largest.topic, bytes(largest.payload))
            if self._suspect is not None and self._suspect != suspect:
                self.refusals.delivered(*self._suspect)  # another message this time: not in a row
            self._suspect = suspect
            if suspect is None:
                return
            error = self.refusals.dropped(*suspect)
            if error is None:
                return
            limit = self.refusals.refused_size or len(suspect[1])
            dropped = [mid for mid, m in messages.items() if len(m.payload) >= limit]
            for mid in dropped:
                del messages[mid]
            self._refused_mids.update(dropped)
            self.refused += len(dropped)
            self._suspect = None
        log.error("mqtt: %s (%d message(s) of that size or more dropped from the resend queue)", error, len(dropped))
        self._refusal_logged.add(suspect[0])

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """Publish (``retain``: as the topic's retained message) and wait until the broker has it (PUBACK for QoS 1),
        except when called from paho's own
        network thread or from a :class:`QueuedCallback` handler (an ACK or a receipt), where waiting could block
        the loop that delivers the PUBACK (the network thread may itself be waiting for room in that handler's
        queue): paho then completes the QoS 1 exchange in the background. Such a reply, if lost, is sent again when
        the gateway resends (a duplicate is re-ACKed).

        A message the broker refuses (module docstring, "Refused messages"), or one at least as large as a refused
        one, is not sent: the error naming the settings is logged (once per topic) and :attr:`refused` counts it.

        Raises:
            TransportError: paho refused the publish.
        """
        info = self._publish_nowait(topic, payload, qos, retain)
        if info is not None:
            self._wait_published([info])

    @contextmanager
    def pipelined(self, max_pending_bytes: int = 64 * 1024 * 1024) -> Iterator[Callable[[str, bytes], None]]:
        """``with transport.pipelined() as publish:`` each ``publish(topic, payload)`` (QoS 1) is handed to paho at
        once, without waiting for its PUBACK; leaving the block waits until the broker has them all (as
        :meth:`publish` waits for one, same deadline: ``connect_timeout_s`` without progress). The round trips of a
        round's task chunks overlap instead of adding up.

        Args:
            max_pending_bytes: payload bytes handed to paho and not yet acknowledged, at most; past it ``publish``
                waits for the oldest first (paho queues what it cannot send yet in memory).

        A block opened inside another one on the same thread joins it: its messages are waited for when the outer
        block ends (a round wraps all its sites' tasks, each of which ``coordinator.outgoing`` sends in a block).

        Raises:
            TransportError: paho refused a publish (raised at once; messages handed over before it still go out).
        """
        outer = getattr(self._pipeline, "publish", None)
        if outer is not None:
            yield outer
            return
        pending: deque[tuple[MQTTMessageInfo, int]] = deque()
        held = [0]

        def publish(topic: str, payload: bytes) -> None:
            info = self._publish_nowait(topic, payload, 1)
            if info is None:
                return
            pending.append((info, len(payload)))
            held[0] += len(payload)
            while held[0] > max_pending_bytes and pending:
                oldest, size = pending.popleft()
                self._wait_published([oldest])
                held[0] -= size

        self._pipeline.publish = publish
        try:
            yield publish
            self._wait_published([info for info, _ in pending])
        finally:
            self._pipeline.publish = None

    def _publish_nowait(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> MQTTMessageInfo | None:
        """Hand a message to paho; the ``MQTTMessageInfo`` to wait on, or None when there is nothing to wait for
        (refused before sending, queued while disconnected, or called where waiting could deadlock: see
        :meth:`publish`).

        Raises:
            TransportError: paho refused the publish.
        """
        refused = self.refusals.refused(topic, payload)
        if refused is not None:
            self.refused += 1
            if topic not in self._refusal_logged:
                self._refusal_logged.add(topic)
                log.error("mqtt: not sent: %s", refused)
            return None
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != self._mqtt.MQTT_ERR_SUCCESS and info.rc != self._mqtt.MQTT_ERR_NO_CONN:
            raise TransportError(f"publish to {topic} failed: {self._mqtt.error_string(info.rc)}")
        # With no connection paho queues the message and sends it after reconnecting (QoS 1).
        if info.rc != self._mqtt.MQTT_ERR_SUCCESS:
            return None
        if threading.get_ident() != self._loop_thread and not on_handler_thread():
            return info
        if qos > 0:  # not waited for here; close() lets paho finish it before it disconnects
            with self._lock:
                while self._unwaited and self._unwaited[0].is_published():
                    self._unwaited.popleft()
                self._unwaited.append(info)
        return None

    def _wait_published(self, infos: list[MQTTMessageInfo]) -> None:
        """Wait until each of ``infos`` is PUBACKed or refused by the broker; gives up (returns) after
        ``connect_timeout_s`` without progress (paho still completes the exchange in the background)."""
        deadline = time.monotonic() + self.connect_timeout_s
        for info in infos:
            while not info.is_published() and info.mid not in self._refused_mids:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                info.wait_for_publish(timeout=min(remaining, 0.05))
            deadline = time.monotonic() + self.connect_timeout_s
