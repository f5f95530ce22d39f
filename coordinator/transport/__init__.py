"""The coordinator's message transport: a two-method interface, an MQTT implementation and an in-memory one.

Everything above this package (ingest, rounds, service) depends only on :class:`Transport`:
``publish(topic, payload, qos=1)`` and ``subscribe(topic_filter, callback)``, where ``callback(topic, payload)``
receives raw bytes. :class:`~coordinator.transport.mqtt.MqttTransport` wraps paho-mqtt 2.x
(``CallbackAPIVersion.VERSION2``, QoS 1, re-subscribing after every reconnect, a message acknowledged only once its
handlers returned; the coordinator's own client keeps a persistent session, so what is published while it is
stopped waits at the broker: "Sessions" in its docstring). :class:`InMemoryTransport` delivers in-process for
tests, with MQTT topic filter semantics (``+`` one level, ``#`` the rest).

The gateway has its own transport (edge_sdk/uplink); the two sides share nothing but the wire.

The rest of the package: :mod:`coordinator.transport.mqtt` (the MQTT client, sessions, TLS,
:func:`~coordinator.transport.mqtt.transport_from_config`), :mod:`coordinator.transport.mqtt_publish` (how it
publishes: PUBACK waits, pipelining, refused messages) and :mod:`coordinator.transport.handlers` (the ingest thread
that runs handlers off paho's network thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

from shared.errors import WildFedError

__all__ = ["Callback", "Transport", "TransportError", "InMemoryTransport", "topic_matches", "pipelined_publish"]

log = logging.getLogger(__name__)

#: ``callback(topic, payload_bytes)``; exceptions it raises are logged by the transport, never propagated.
Callback = Callable[[str, bytes], None]


class TransportError(WildFedError):
    """The broker cannot be reached or refused a publish/subscribe."""


@runtime_checkable
class Transport(Protocol):
    """What the coordinator needs from a message bus."""

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """Publish ``payload`` on ``topic`` (at-least-once for ``qos=1``; ``retain``: the broker keeps it as the
        topic's retained message, delivered to every later subscriber, and an empty retained payload deletes it);
        raises :class:`TransportError`."""
        ...

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        """Deliver every message matching ``topic_filter`` to ``callback(topic, payload)``."""
        ...


def pipelined_publish(transport: Transport) -> AbstractContextManager[Callable[[str, bytes], None]]:
    """``with pipelined_publish(transport) as publish:`` QoS 1 publishes that do not wait for their PUBACK each
    where the transport can (:meth:`coordinator.transport.mqtt.MqttTransport.pipelined`: all acknowledged when the
    block ends), else plain ``transport.publish`` calls (the in-memory bus delivers at once)."""
    pipelined = getattr(transport, "pipelined", None)
    if pipelined is not None:
        return pipelined()
    return nullcontext(lambda topic, payload: transport.publish(topic, payload, qos=1))


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 §4.7 filter matching: ``+`` matches one level, a trailing ``#`` matches the rest."""
    f_parts = topic_filter.split("/")
    t_parts = topic.split("/")
    for i, f in enumerate(f_parts):
        if f == "#":
            return True
        if i >= len(t_parts):
            return False
        if f != "+" and f != t_parts[i]:
            return False
    return len(f_parts) == len(t_parts)


class InMemoryTransport:
    """In-process bus for tests: ``publish`` calls every matching subscriber synchronously, in subscription order.

    Subscriber exceptions are logged and swallowed (as a broker would isolate them). ``published`` keeps every
    ``(topic, payload)`` for assertions. Retained messages are kept per topic (``retained``; an empty retained
    payload deletes one) and delivered to each new subscription whose filter matches, as a broker does (MQTT 3.1.1
    sec. 3.3.1.3). Thread-safe; re-entrant publishing from inside a callback is allowed.
    """

    def __init__(self) -> None:
        self._subs: list[tuple[str, Callback]] = []
        self._lock = threading.RLock()
        self.published: list[tuple[str, bytes]] = []
        self.retained: dict[str, bytes] = {}

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """Record and deliver ``payload`` to every subscriber whose filter matches ``topic``; keep it as the topic's
        retained message when ``retain`` (an empty one deletes it and is not delivered)."""
        with self._lock:
            if retain:
                if not payload:
                    self.retained.pop(topic, None)
                    return
                self.retained[topic] = bytes(payload)
            self.published.append((topic, bytes(payload)))
            targets = [cb for f, cb in self._subs if topic_matches(f, topic)]
        for cb in targets:
            self._call(cb, topic, bytes(payload))

    @staticmethod
    def _call(cb: Callback, topic: str, payload: bytes) -> None:
        try:
            cb(topic, payload)
        except Exception:  # noqa: BLE001 - a subscriber's bug must not break the publisher (broker isolation)
            log.exception("in-memory transport: subscriber of %s raised", topic)

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        """Register ``callback`` for ``topic_filter`` and deliver it the retained messages that match."""
        with self._lock:
            self._subs.append((topic_filter, callback))
            retained = [(t, p) for t, p in self.retained.items() if topic_matches(topic_filter, t)]
        for topic, payload in retained:
            self._call(callback, topic, payload)

    def close(self) -> None:
        """Drop all subscriptions."""
        with self._lock:
            self._subs.clear()
