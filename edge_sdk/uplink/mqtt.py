"""MQTT transport on paho-mqtt 2.x (the only module of the gateway that imports paho).

QoS 1 (MQTT 3.1.1, OASIS 2014, sec. 4.3.2): :meth:`MqttTransport.publish` blocks until the broker's PUBACK. On every
CONNACK this transport publishes the site's retained ``online`` status (when it has a status topic), resubscribes
every filter, and once every SUBACK is in (a refused subscription drops the link: the reconnect tries again) it counts as connected and calls the connect listeners (the agent resends
its outbox then). So :meth:`connect` returning means that messages published to the subscribed topics from then on
reach this client. Callbacks run on paho's thread and must not block.

URL forms: ``mqtt://host:port`` (port defaults to 1883) and ``mqtts://host:port`` (TLS, port defaults to 8883).

Security (docs/security.md):

* TLS: the broker's certificate must chain to ``ca_file`` (or the system's CAs when none is given) and name the
  host of the URL (hostname checking on); TLS 1.2 is the minimum. ``cert_file``/``key_file`` add a client
  certificate (mutual TLS; the broker can take the certificate's CN as the username).
* Credentials: ``username``/``password`` (MQTT CONNECT); :func:`load_broker_credentials` reads the 0600 YAML file
  ``wildfed-coordinator broker-config`` writes for each site.
* Client id = username: the generated broker config sets ``use_username_as_clientid true`` (shared.broker), so a
  session is bound to its account and no other account can take it over; this transport sends its username as
  client id as well. A second client of the same site (``wildfed-edge detect --publish`` beside the agent) uses
  the site's role account ``site-<id>@detect`` (``edge_sdk.uplink.site_transport.transport_from_config(config,
  role="detect")``), else the two would keep disconnecting each other.
* Presence: with ``status_topic`` the broker holds a last will, ``{"site_id": ..., "state": "offline"}`` retained
  at QoS 1, which it publishes when the link dies without a DISCONNECT; after every (re)connect the transport
  publishes ``online`` retained, and :meth:`MqttTransport.close` publishes ``offline`` itself (a clean DISCONNECT
  discards the will). The will is not signed (the broker sends it), so status is advisory only.

Reconnection (full-jitter back-off), failover to further nodes of a broker cluster and the in-flight window
when the link drops: :mod:`edge_sdk.uplink.mqtt_link`. Broker URLs: :mod:`edge_sdk.uplink.mqtt_settings`.

Refused messages: a message that was in flight each of ``max_drops`` times in a row the link dropped (the site's
``max_chunk_requests``) is taken for one the broker refuses by closing the connection, i.e. over its packet limit
(which is then below the configured ``broker_max_packet_bytes``): :meth:`MqttTransport.publish` raises
:class:`~edge_sdk.uplink.transport.MessageRefusedError` naming ``chunk_size_bytes`` and ``broker_max_packet_bytes``
instead of the usual TransportError, and from then on refuses every message at least that large without sending
it (shared.broker.RefusedMessages). The agent gives such an upload up (edge_sdk.agent) instead of re-sending it
on every reconnect.
"""

from __future__ import annotations

import logging
import os
import random
import ssl
import threading
import time
import uuid
from collections.abc import Callable

import paho.mqtt.client as mqtt

from shared.broker import (DEFAULT_MAX_DROPS, BrokerCredentials, RefusedMessages, check_client_options,
                           load_broker_credentials, tls_context)
from shared.errors import ConfigError
from shared.topics import status_payload

from edge_sdk.uplink.mqtt_link import LinkSupervisor, full_jitter_delay
from edge_sdk.uplink.mqtt_settings import parse_mqtt_url, parse_mqtt_url_tls
from edge_sdk.uplink.transport import MessageCallback, MessageRefusedError, Transport, TransportError, topic_matches

__all__ = ["MqttTransport", "BrokerCredentials", "parse_mqtt_url", "parse_mqtt_url_tls", "full_jitter_delay",
           "load_broker_credentials", "tls_context"]

log = logging.getLogger(__name__)


class MqttTransport(LinkSupervisor, Transport):
    """:class:`~edge_sdk.uplink.transport.Transport` over a paho-mqtt 2.x client (MQTT 3.1.1, clean session).

    Args:
        url: ``mqtt://host:port`` or ``mqtts://host:port``.
        client_id: MQTT client id (default: the username, what a broker with ``use_username_as_clientid`` uses
            anyway; without one ``wildfed-<random>``).
        keepalive_s: MQTT keep-alive in seconds (a dead link is noticed after about 1.5 times this).
        ca_file: PEM CA bundle that signs the broker's certificate (``mqtts://`` only; default: system CAs).
        cert_file, key_file: PEM client certificate and key for mutual TLS (``mqtts://`` only; both or neither).
        username, password: MQTT credentials (password only with a username).
        status_topic: the site's presence topic (shared.topics.status_topic); with ``site_id``, enables the
            last will and the retained ``online``/``offline`` messages.
        site_id: the site the presence messages name.
        backoff_base_s, backoff_cap_s: full-jitter reconnect delays, seconds (:mod:`edge_sdk.uplink.mqtt_link`).
        rng: random source of the jitter (default: a fresh ``random.Random``; not security-relevant).
        max_drops: link drops in a row with one message awaiting its PUBACK that make it refused (module
            docstring, "Refused messages"; the site's ``max_chunk_requests``).
        broker_max_packet_bytes: the configured broker limit, bytes, named in the refused-message error.
        failover_urls: further nodes of the same broker cluster, same scheme as ``url`` (:mod:`edge_sdk.uplink.mqtt_link`,
            "Failover").

    Raises:
        ConfigError: bad URL, TLS options with ``mqtt://``, unreadable TLS files, a password without a username,
            only one of ``status_topic``/``site_id``, or a failover URL of another scheme.
    """

    def __init__(self, url: str, *, client_id: str | None = None, keepalive_s: int = 30,
                 ca_file: str | os.PathLike[str] | None = None, cert_file: str | os.PathLike[str] | None = None,
                 key_file: str | os.PathLike[str] | None = None, username: str | None = None,
                 password: str | None = None, status_topic: str | None = None, site_id: str | None = None,
                 backoff_base_s: float = 1.0, backoff_cap_s: float = 60.0, rng: random.Random | None = None,
                 max_drops: int = DEFAULT_MAX_DROPS, broker_max_packet_bytes: int | None = None,
                 failover_urls: tuple[str, ...] | list[str] = ()) -> None:
        self._host, self._port, tls = parse_mqtt_url_tls(url)
        self.brokers: list[tuple[str, int]] = [(self._host, self._port)]
        """Every node this transport may use, ``(host, port)``, ``url``'s first; :attr:`broker` is the current one."""
        for other in failover_urls:
            host, port, other_tls = parse_mqtt_url_tls(other)
            if other_tls != tls:
                raise ConfigError(f"failover broker {other!r} and {url!r} differ in TLS", field="broker_failover_urls",
                                  fix="reach every node of the cluster the same way: all mqtt:// or all mqtts://")
            self.brokers.append((host, port))
        self.broker = 0
        self.failovers = 0  # times a reconnect moved to another node (observability, tests)
        check_client_options(url, tls=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
                             username=username, password=password)
        if (status_topic is None) != (site_id is None):
            raise ConfigError("status_topic and site_id go together", field="status_topic",
                              fix="pass both (shared.topics.status_topic(federation, site), site) or neither")
        if not (backoff_base_s > 0 and backoff_cap_s >= backoff_base_s):
            raise ConfigError(f"bad reconnect back-off base {backoff_base_s} s / cap {backoff_cap_s} s",
                              field="backoff_base_s", fix="use base > 0 and cap >= base, e.g. 1 and 60")
        self._keepalive = keepalive_s
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                   client_id=client_id or username or f"wildfed-{uuid.uuid4().hex[:12]}",
                                   reconnect_on_failure=False)
        if tls:
            self._client.tls_set_context(tls_context(ca_file=ca_file, cert_file=cert_file, key_file=key_file))
        if username:
            self._client.username_pw_set(username, password)
        self._status_topic = status_topic
        self._site_id = site_id
        if status_topic is not None and site_id is not None:
            self._client.will_set(status_topic, status_payload(site_id, "offline"), qos=1, retain=True)
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
        self._stop = threading.Event()
        self._link_down = threading.Event()
        self._loop_lock = threading.Lock()  # starting and stopping paho's network thread (LinkSupervisor)
        self._generation = 0  # incremented on every disconnect: publishes in flight compare it
        self._attempt = 0  # reconnect attempts since the last successful CONNACK
        self._last_failure: str | None = None
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._rng = rng or random.Random()
        self._supervisor: threading.Thread | None = None
        self.refusals = RefusedMessages(max_drops, configured_limit=broker_max_packet_bytes)
        self.reconnect_delays: list[float] = []  # the delays actually waited (observability, tests)
        self.disconnects = 0  # times the link dropped or was closed (observability, tests)

    # paho callbacks (network thread) -------------------------------------------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object,
                    properties: object) -> None:
        if getattr(reason_code, "is_failure", False):
            self._last_failure = f"connection refused by the broker: {reason_code}"
            log.warning("MQTT connect to %s:%s refused: %s", self._host, self._port, reason_code)
            return
        self._last_failure = None
        if self._status_topic is not None and self._site_id is not None:
            client.publish(self._status_topic, status_payload(self._site_id, "online"), qos=1, retain=True)
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
        refused = [str(rc) for rc in (reason_codes or []) if getattr(rc, "is_failure", False)]  # type: ignore[attr-defined]
        if refused:  # e.g. a NATS node that could not make the subscription's JetStream consumer: not subscribed
            self._last_failure = f"the broker refused a subscription ({', '.join(refused)})"
            log.warning("MQTT %s:%s refused a subscription (%s); reconnecting, to the next node if there is one",
                        self._host, self._port, ", ".join(refused))
            client.disconnect()
            return
        with self._lock:
            if mid not in self._awaiting_suback:
                return
            self._awaiting_suback.discard(mid)
            ready = not self._awaiting_suback
        if ready:
            self._ready()

    def _ready(self) -> None:
        """Connected and every subscription acknowledged: mark connected, then notify listeners."""
        self._attempt = 0  # only now: a node that accepts the connection but refuses a subscription is failed over
        self._connected.set()
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

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
        """Connect and start the network threads; block until CONNACK and every SUBACK.

        Raises:
            TransportError: broker unreachable, TLS handshake failed, the broker refused the connection (bad
                credentials or certificate: the transport is then closed) or closed it before CONNACK, or no
                CONNACK within ``timeout_s`` (the transport keeps retrying in the background then).
        """
        deadline = time.monotonic() + timeout_s
        if not self._started:
            self._stop.clear()
            self._last_failure = None
            generation = self._generation
            try:
                for i in range(len(self.brokers)):  # the first node that accepts the TCP (and TLS) connection
                    self._use_broker(i)
                    try:
                        self._client.connect(self._host, self._port, keepalive=self._keepalive)
                        break
                    except OSError as exc:
                        if i + 1 == len(self.brokers):
                            raise
                        log.warning("MQTT broker %s:%s unreachable (%s); trying the next node", self._host,
                                    self._port, exc)
            except OSError as exc:  # includes ssl.SSLError (e.g. certificate verification failed)
                hint = (" (fix: set broker_ca_file to the CA that signed the broker's certificate, e.g. the ca.pem "
                        "of `wildfed-coordinator broker-config`, and connect by a host name the certificate lists)"
                        if isinstance(exc, ssl.SSLCertVerificationError) else "")
                raise TransportError(f"cannot reach MQTT broker {self._host}:{self._port}: {exc}{hint}") from exc
            self._client.loop_start()
            self._started = True
            self._supervisor = threading.Thread(target=self._supervise, name="wildfed-mqtt-reconnect", daemon=True)
            self._supervisor.start()
            while not self._connected.wait(0.05):
                if self._generation != generation:  # refused, or closed by the broker before CONNACK
                    reason = self._last_failure or "link closed before CONNACK"
                    self.close()
                    raise TransportError(f"MQTT broker {self._host}:{self._port}: {reason} (fix: check the "
                                         "broker username/password file, TLS client certificate and CA)")
                if time.monotonic() >= deadline:
                    raise TransportError(f"no CONNACK from {self._host}:{self._port} within {timeout_s} s")
            return
        if not self._connected.wait(max(0.0, deadline - time.monotonic())):
            raise TransportError(f"no CONNACK from {self._host}:{self._port} within {timeout_s} s"
                                 + (f" ({self._last_failure})" if self._last_failure else ""))

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0, *,
                retain: bool = False) -> None:
        """Publish and wait for PUBACK (QoS 1).

        Raises:
            MessageRefusedError: this message was dropped before its PUBACK ``max_drops`` times in a row, or one no
                larger was refused already ("Refused messages" in the module docstring); it is not sent.
            TransportError: not connected, queue full, the link dropped before the PUBACK (see "In-flight window"
                in :mod:`edge_sdk.uplink.mqtt_link`), or no PUBACK within ``timeout_s``.
        """
        refused = self.refusals.refused(topic, payload)
        if refused is not None:
            raise MessageRefusedError(refused)
        if not self._connected.is_set():
            raise TransportError(f"not connected to {self._host}:{self._port}: cannot publish to {topic}")
        generation = self._generation
        info = self._client.publish(topic, bytes(payload), qos=qos, retain=retain)
        deadline = time.monotonic() + timeout_s
        try:
            while not info.is_published():
                if self._generation != generation:
                    refused = self.refusals.dropped(topic, payload)
                    if refused is not None:
                        log.error("MQTT %s", refused)
                        raise MessageRefusedError(refused)
                    raise TransportError(f"link to {self._host}:{self._port} dropped before the PUBACK for {topic}; "
                                         "the outbox re-sends it after the reconnect")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(f"no PUBACK for {topic} within {timeout_s} s")
                info.wait_for_publish(timeout=min(remaining, 0.05))
        except (ValueError, RuntimeError) as exc:
            raise TransportError(f"publish to {topic} failed: {exc}") from exc
        self.refusals.delivered(topic, payload)

    def subscribe(self, topic_filter: str, callback: MessageCallback) -> None:
        """Subscribe with QoS 1 now (if connected) and after every reconnect."""
        with self._lock:
            self._filters.append((topic_filter, callback))
        if self._connected.is_set():
            self._client.subscribe(topic_filter, qos=1)

    def unsubscribe(self, topic_filter: str) -> bool:
        """Drop ``topic_filter``'s subscription now (if connected) and on reconnects; returns True."""
        with self._lock:
            self._filters = [(f, cb) for f, cb in self._filters if f != topic_filter]
        if self._connected.is_set():
            self._client.unsubscribe(topic_filter)
        return True

    def add_connect_listener(self, listener: Callable[[], None]) -> None:
        """Called on paho's thread after each (re)connect and resubscription."""
        with self._lock:
            self._listeners.append(listener)

    def close(self) -> None:
        """Publish ``offline`` (retained, when there is a status topic and a link), disconnect cleanly and stop the
        network and reconnect threads (idempotent)."""
        self._stop.set()
        self._link_down.set()  # wake the supervisor so that it sees the stop
        if self._started:
            self._closing = True
            if self._connected.is_set() and self._status_topic is not None and self._site_id is not None:
                try:
                    self.publish(self._status_topic, status_payload(self._site_id, "offline"), timeout_s=2.0,
                                 retain=True)
                except TransportError as exc:
                    log.info("could not publish offline status: %s", exc)
            self._client.disconnect()
            self._stop_network_thread()
            self._started = False
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
            self._supervisor = None
        self._connected.clear()
