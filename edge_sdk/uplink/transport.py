"""The uplink transport interface, and an in-memory broker for tests.

Trainers and the agent talk to a :class:`Transport`, never to paho (as Flower's ``ClientProxy`` hides its transport).
Semantics follow MQTT 3.1.1 QoS 1 (OASIS 2014, sec. 4.3.2): :meth:`Transport.publish` returns only after the
broker's PUBACK, else raises :class:`TransportError`; delivery is at least once, so receivers deduplicate.
Callbacks run on the transport's own thread and must not block (the agent only enqueues).

Topic filters use MQTT wildcards: ``+`` one level, ``#`` the rest (sec. 4.7).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from shared.errors import WildFedError

__all__ = ["TransportError", "MessageRefusedError", "MessageCallback", "Transport", "topic_matches", "InMemoryBroker", "InMemoryTransport"]

MessageCallback = Callable[[str, bytes], None]
"""``callback(topic, payload)``."""


class TransportError(WildFedError):
    """The broker is unreachable, or a publish was not acknowledged (PUBACK) in time."""


class MessageRefusedError(TransportError):
    """The broker keeps closing the connection on this message (it was dropped before its PUBACK again and again,
    or one no larger was): sending it again would only drop the link again. The message names the settings to
    change (``chunk_size_bytes``, ``broker_max_packet_bytes``; shared.broker.RefusedMessages). Whoever sent it gives
    it up instead of retrying (the agent abandons the upload)."""


class Transport(ABC):
    """A QoS-1 publish/subscribe connection to the broker."""

    @abstractmethod
    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect (blocking until CONNACK or ``timeout_s``). Raises TransportError."""

    @abstractmethod
    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        """Publish and block until the broker acknowledges (QoS 1). Raises TransportError."""

    @abstractmethod
    def subscribe(self, topic_filter: str, callback: MessageCallback) -> None:
        """Subscribe (QoS 1); kept across reconnects. ``callback(topic, payload)`` must not block."""

    def unsubscribe(self, topic_filter: str) -> bool:
        """Drop the subscriptions to ``topic_filter`` (now and on reconnects). Returns whether this transport could;
        this default cannot (returns False: the messages keep coming, and their handler ignores them)."""
        return False

    @abstractmethod
    def add_connect_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called after every (re)connect (after resubscribing). It must not block."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect and release resources (idempotent)."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 sec. 4.7 filter matching with ``+`` and ``#``."""
    f_parts, t_parts = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(f_parts):
        if part == "#":
            return True
        if i >= len(t_parts) or (part != "+" and part != t_parts[i]):
            return False
    return len(f_parts) == len(t_parts)


class InMemoryBroker:
    """A process-local broker: delivers every publish synchronously to matching subscribers (tests, logic).

    Retained messages (``retained``, one per topic; an empty retained payload deletes it) are delivered to each new
    subscription whose filter matches, as an MQTT broker does (MQTT 3.1.1 sec. 3.3.1.3)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: list[tuple[InMemoryTransport, str, MessageCallback]] = []
        self.published: list[tuple[str, bytes]] = []
        self.retained: dict[str, bytes] = {}

    def _subscribe(self, transport: InMemoryTransport, topic_filter: str, callback: MessageCallback) -> None:
        with self._lock:
            self._subscriptions.append((transport, topic_filter, callback))
            retained = [(t, p) for t, p in self.retained.items() if topic_matches(topic_filter, t)]
        for topic, payload in retained:
            callback(topic, payload)

    def _unsubscribe(self, transport: InMemoryTransport, topic_filter: str) -> None:
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[0] is not transport or s[1] != topic_filter]

    def _unsubscribe_all(self, transport: InMemoryTransport) -> None:
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[0] is not transport]

    def deliver(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Route one message to every connected subscriber whose filter matches (outside the lock); keep it as the
        topic's retained message when ``retain`` (an empty one deletes it and is not delivered)."""
        with self._lock:
            if retain:
                if not payload:
                    self.retained.pop(topic, None)
                    return
                self.retained[topic] = payload
            self.published.append((topic, payload))
            targets = [(t, cb) for t, f, cb in self._subscriptions if t.connected and topic_matches(f, topic)]
        for _, callback in targets:
            callback(topic, payload)


class InMemoryTransport(Transport):
    """A :class:`Transport` on an :class:`InMemoryBroker`; :meth:`go_offline`/:meth:`go_online` simulate outages."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker
        self._filters: list[tuple[str, MessageCallback]] = []
        self._listeners: list[Callable[[], None]] = []
        self.connected = False
        self._reachable = True

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect, resubscribe, notify listeners. Raises TransportError while offline."""
        if not self._reachable:
            raise TransportError("in-memory broker unreachable (simulated outage)")
        self.connected = True
        for topic_filter, callback in self._filters:
            self._broker._subscribe(self, topic_filter, callback)
        for listener in list(self._listeners):
            listener()

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0, *,
                retain: bool = False) -> None:
        """Deliver synchronously (``retain``: also keep it as the topic's retained message). Raises TransportError
        when not connected."""
        if not self.connected:
            raise TransportError(f"not connected: cannot publish to {topic}")
        self._broker.deliver(topic, bytes(payload), retain=retain)

    def subscribe(self, topic_filter: str, callback: MessageCallback) -> None:
        """Register the subscription now (if connected) and on every reconnect."""
        self._filters.append((topic_filter, callback))
        if self.connected:
            self._broker._subscribe(self, topic_filter, callback)

    def unsubscribe(self, topic_filter: str) -> bool:
        """See :meth:`Transport.unsubscribe`."""
        self._filters = [(f, cb) for f, cb in self._filters if f != topic_filter]
        self._broker._unsubscribe(self, topic_filter)
        return True

    def add_connect_listener(self, listener: Callable[[], None]) -> None:
        """See :meth:`Transport.add_connect_listener`."""
        self._listeners.append(listener)

    def go_offline(self) -> None:
        """Simulate losing the link: drop the session; publishes fail until :meth:`go_online`."""
        self._reachable = False
        self.connected = False
        self._broker._unsubscribe_all(self)

    def go_online(self) -> None:
        """Simulate the link coming back: reconnect (resubscribes, fires connect listeners)."""
        self._reachable = True
        self.connect()

    def close(self) -> None:
        """Disconnect."""
        self.connected = False
        self._broker._unsubscribe_all(self)
