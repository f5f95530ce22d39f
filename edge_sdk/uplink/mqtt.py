"""MQTT transport on paho-mqtt 2.x (the only module of the gateway that imports paho).

QoS 1 (MQTT 3.1.1, OASIS 2014, sec. 4.3.2): :meth:`MqttTransport.publish` blocks until the broker's PUBACK.
paho's network thread (``loop_start``) reconnects on its own with exponential back-off
(``reconnect_delay_set``); on every CONNACK this transport resubscribes every filter, and once every SUBACK is in it
counts as connected and calls the connect listeners (the agent resends its outbox then). So :meth:`connect`
returning means that messages published to the subscribed topics from then on reach this client. Callbacks run on paho's thread and must not block.

URL form: ``mqtt://host:port`` (port defaults to 1883).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from urllib.parse import urlparse

import paho.mqtt.client as mqtt

from shared.errors import ConfigError

from edge_sdk.uplink.transport import MessageCallback, Transport, TransportError, topic_matches

__all__ = ["MqttTransport", "parse_mqtt_url"]

log = logging.getLogger(__name__)


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtt://host:port`` -> ``(host, port)``.

    Raises:
        ConfigError: another scheme or no host.
    """
    parsed = urlparse(url)
    if parsed.scheme != "mqtt" or not parsed.hostname:
        raise ConfigError(f"bad broker URL {url!r}", field="broker_url", fix="use mqtt://host:port")
    return parsed.hostname, parsed.port or 1883


class MqttTransport(Transport):
    """:class:`~edge_sdk.uplink.transport.Transport` over a paho-mqtt 2.x client.

    Args:
        url: ``mqtt://host:port``.
        client_id: MQTT client id (default: ``wildfed-<random>``).
        keepalive_s: MQTT keep-alive in seconds.
    """

    def __init__(self, url: str, *, client_id: str | None = None, keepalive_s: int = 30) -> None:
        self._host, self._port = parse_mqtt_url(url)
        self._keepalive = keepalive_s
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                   client_id=client_id or f"wildfed-{uuid.uuid4().hex[:12]}")
        self._client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._client.max_inflight_messages_set(20)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._lock = threading.Lock()
        self._filters: list[tuple[str, MessageCallback]] = []
        self._listeners: list[Callable[[], None]] = []
        self._connected = threading.Event()
        self._awaiting_suback: set[int] = set()
        self._started = False
        self._closing = False

    # paho callbacks (network thread) -------------------------------------------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object,
                    properties: object) -> None:
        if getattr(reason_code, "is_failure", False):
            log.warning("MQTT connect to %s:%s refused: %s", self._host, self._port, reason_code)
            return
        with self._lock:
            filters = [f for f, _ in self._filters]
            self._awaiting_suback = set()
            for topic_filter in filters:
                result, mid = client.subscribe(topic_filter, qos=1)
                if result == mqtt.MQTT_ERR_SUCCESS:
                    self._awaiting_suback.add(mid)
            ready = not self._awaiting_suback
        log.info("MQTT connected to %s:%s (%d subscription(s))", self._host, self._port, len(filters))
        if ready:
            self._ready()

    def _on_subscribe(self, client: mqtt.Client, userdata: object, mid: int, reason_codes: object,
                      properties: object) -> None:
        with self._lock:
            if mid not in self._awaiting_suback:
                return
            self._awaiting_suback.discard(mid)
            ready = not self._awaiting_suback
        if ready:
            self._ready()

    def _ready(self) -> None:
        """Connected and every subscription acknowledged: mark connected, then notify listeners."""
        self._connected.set()
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object,
                       properties: object) -> None:
        self._connected.clear()
        if self._closing:
            log.info("MQTT disconnected from %s:%s", self._host, self._port)
        else:
            log.warning("MQTT disconnected from %s:%s (%s); paho reconnects", self._host, self._port, reason_code)

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            callbacks = [cb for f, cb in self._filters if topic_matches(f, message.topic)]
        for callback in callbacks:
            try:
                callback(message.topic, bytes(message.payload))
            except Exception:  # a bad callback must not kill paho's network thread
                log.exception("message callback failed for %s", message.topic)

    # Transport -----------------------------------------------------------------------------------------------
    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect and start paho's network thread; block until CONNACK and every SUBACK.

        Raises:
            TransportError: broker unreachable or no CONNACK within ``timeout_s``.
        """
        if not self._started:
            try:
                self._client.connect(self._host, self._port, keepalive=self._keepalive)
            except OSError as exc:
                raise TransportError(f"cannot reach MQTT broker {self._host}:{self._port}: {exc}") from exc
            self._client.loop_start()
            self._started = True
        if not self._connected.wait(timeout_s):
            raise TransportError(f"no CONNACK from {self._host}:{self._port} within {timeout_s} s")

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        """Publish and wait for PUBACK.

        Raises:
            TransportError: not connected, queue full, or no PUBACK within ``timeout_s``.
        """
        if not self._connected.is_set():
            raise TransportError(f"not connected to {self._host}:{self._port}: cannot publish to {topic}")
        info = self._client.publish(topic, bytes(payload), qos=qos)
        try:
            info.wait_for_publish(timeout=timeout_s)
        except (ValueError, RuntimeError) as exc:
            raise TransportError(f"publish to {topic} failed: {exc}") from exc
        if not info.is_published():
            raise TransportError(f"no PUBACK for {topic} within {timeout_s} s")

    def subscribe(self, topic_filter: str, callback: MessageCallback) -> None:
        """Subscribe with QoS 1 now (if connected) and after every reconnect."""
        with self._lock:
            self._filters.append((topic_filter, callback))
        if self._connected.is_set():
            self._client.subscribe(topic_filter, qos=1)

    def add_connect_listener(self, listener: Callable[[], None]) -> None:
        """Called on paho's thread after each (re)connect and resubscription."""
        with self._lock:
            self._listeners.append(listener)

    def close(self) -> None:
        """Disconnect and stop the network thread (idempotent)."""
        if self._started:
            self._closing = True
            self._client.disconnect()
            self._client.loop_stop()
            self._started = False
        self._connected.clear()
