"""The coordinator's MQTT transport: :class:`MqttTransport` (paho-mqtt 2.x) and :func:`transport_from_config`.

Security (docs/security.md): ``mqtts://host:port`` (default port 8883) connects over TLS 1.2+ with the broker's
certificate checked against ``ca_file`` (system CAs when None) and the URL's host; ``cert_file``/``key_file`` add a
client certificate (mutual TLS); ``username``/``password`` authenticate the coordinator (its credentials file is
written by ``wildfed-coordinator broker-config``). :func:`transport_from_config` builds the transport from a
:class:`~coordinator.config.CoordinatorConfig`.

Client id = username: the generated broker config sets ``use_username_as_clientid true`` (shared.broker), so the
broker binds every session to its account; this transport sends its username as client id too, so that it means
the same on any broker. An ingest worker runs beside the coordinator, so it connects with a role account of its
own (``transport_from_config(config, role="ingest-1")``: ``coordinator-<fed>@ingest-1``); sharing one account,
the two would disconnect each other.

Refused messages (a message over the broker's packet limit, which would disconnect the coordinator again and again)
are given up as :mod:`coordinator.transport.mqtt_publish` describes, where publishing lives.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from shared.broker import (DEFAULT_MAX_DROPS, RefusedMessages, check_client_options, load_broker_credentials,
                           role_cert_paths, tls_context)
from shared.errors import ConfigError

from coordinator.transport import Callback, TransportError, topic_matches
from coordinator.transport.mqtt_publish import MqttPublishing

if TYPE_CHECKING:
    from paho.mqtt.client import MQTTMessageInfo

    from coordinator.config import CoordinatorConfig

__all__ = ["MqttTransport", "parse_broker_url", "transport_from_config"]

log = logging.getLogger(__name__)


def _unshared(topic_filter: str) -> str:
    """The filter a shared subscription ``$share/<group>/<filter>`` (MQTT 5.0 sec. 4.8.2; Mosquitto also accepts
    it from MQTT 3.1.1 clients) matches messages with: ``<filter>``. Other filters are returned unchanged."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        if len(parts) == 3:
            return parts[2]
    return topic_filter


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    """``mqtt://host:port`` (or ``mqtts://``) -> ``(host, port, tls)``; default ports 1883 / 8883.

    Raises:
        ConfigError: another scheme or no host.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parsed.hostname:
        raise ConfigError(f"broker URL {url!r} is not mqtt://host:port", field="broker_url",
                          fix="use e.g. mqtt://127.0.0.1:1883")
    tls = parsed.scheme in ("mqtts", "ssl")
    return parsed.hostname, parsed.port or (8883 if tls else 1883), tls


_MAX_TOPICS_CACHED = 4096
"""Topics whose handlers :class:`MqttTransport` remembers (then it starts over): bounded, since the wildcard filters
match any site id a broker lets through."""


class MqttTransport(MqttPublishing):
    """paho-mqtt 2.x client (``CallbackAPIVersion.VERSION2``), QoS 1, auto re-subscribe after reconnects.

    Sessions (MQTT 3.1.1 sec. 3.1.2.4): with ``persistent_session`` the client connects with clean session 0 under
    its stable client id, so the broker keeps its QoS 1 subscriptions while it is away and queues every message
    published to them meanwhile (up to the broker's ``max_queued_messages``/``max_queued_bytes``), and delivers them
    when it connects again; the coordinator's own client is persistent (:func:`transport_from_config`), so detection
    records published while no coordinator runs are not lost (what it unsubscribes from before a clean stop,
    :meth:`unsubscribe`, is not queued: coordinator.service.Coordinator.close). Without it (a second
    client such as an ingest worker, tests) the broker keeps nothing. Either way updates are also guaranteed end to
    end: a gateway keeps each one in its outbox and re-sends it until a signed ACK arrives.

    Acknowledgement: a message is PUBACKed only after every handler it was given returned (paho ``manual_ack``);
    one whose handler raised is not, so the broker delivers it again after the next reconnect of a persistent
    session (a handler that stores a record commits before it returns: it is stored once, and the re-delivery is a
    duplicate). Handlers must be registered (:meth:`subscribe`) before :meth:`connect`: a resumed session delivers
    its queued messages right after the CONNACK.

    Args:
        broker_url: ``mqtt://host:port`` or ``mqtts://host:port`` (TLS).
        client_id: MQTT client id; default the username (what a broker with ``use_username_as_clientid`` uses
            anyway), else ``wildfed-coordinator``. Unique per connected client.
        connect_timeout_s: how long :meth:`connect` waits for CONNACK.
        ca_file: PEM CA bundle of the broker's certificate (``mqtts://`` only; default: system CAs).
        cert_file, key_file: PEM client certificate and key (mutual TLS; both or neither).
        username, password: MQTT credentials.
        max_drops: link drops in a row with one message awaiting its PUBACK that make it refused
            (:mod:`coordinator.transport.mqtt_publish`, "Refused messages").
        broker_max_packet_bytes: the configured broker limit, bytes, named in the refused-message error.
        persistent_session: connect with clean session 0 (class docstring, "Sessions"); the client id must then be
            stable and used by one connected client at a time.

    Raises:
        ConfigError: bad URL, TLS files with a plain URL, unreadable TLS files, a password without a username.
        TransportError: from :meth:`connect` when the broker cannot be reached or refuses the connection.
    """

    def __init__(self, broker_url: str, *, client_id: str | None = None,
                 connect_timeout_s: float = 10.0, ca_file: str | os.PathLike[str] | None = None,
                 cert_file: str | os.PathLike[str] | None = None, key_file: str | os.PathLike[str] | None = None,
                 username: str | None = None, password: str | None = None, max_drops: int = DEFAULT_MAX_DROPS,
                 broker_max_packet_bytes: int | None = None, persistent_session: bool = False) -> None:
        import paho.mqtt.client as mqtt  # paho only here: nothing else in the coordinator sees it

        self._mqtt = mqtt
        self.host, self.port, tls = parse_broker_url(broker_url)
        check_client_options(broker_url, tls=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
                             username=username, password=password)
        self.connect_timeout_s = connect_timeout_s
        self.client_id = client_id or username or "wildfed-coordinator"
        self.persistent_session = bool(persistent_session)
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                   protocol=mqtt.MQTTv311, clean_session=not self.persistent_session,
                                   manual_ack=True)
        if tls:
            self._client.tls_set_context(tls_context(ca_file=ca_file, cert_file=cert_file, key_file=key_file))
        if username:
            self._client.username_pw_set(username, password)
        self._refused: str | None = None
        self._client.max_inflight_messages_set(64)
        self._subs: list[tuple[str, Callback]] = []
        self._targets: dict[str, list[Callback]] = {}  # topic -> its handlers, emptied when a filter is added
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._loop_thread: int | None = None
        self._closing = False
        self.disconnects = 0
        """Times the link dropped or was closed (observability: e.g. a session taken over by another client)."""
        self.session_present: bool | None = None
        """Whether the broker resumed a stored session at the last CONNACK (None before the first)."""
        self.unacknowledged = 0
        """Messages left unacknowledged because a handler raised (the broker re-delivers them after a reconnect)."""
        self.refusals = RefusedMessages(max_drops, chunk_field="transfer.chunk_size_bytes",
                                        configured_limit=broker_max_packet_bytes)
        self.refused = 0
        """Messages given up as refused by the broker, or not sent because one no larger was (observability)."""
        self._refused_mids: set[int] = set()
        self._pipeline = threading.local()  # the open pipelined() block of each thread (nested blocks join it)
        self._unwaited: deque[MQTTMessageInfo] = deque()  # QoS 1 replies sent where waiting could deadlock
        self._refusal_logged: set[str] = set()
        self._suspect: tuple[str, bytes] | None = None  # the largest message in flight at the last drop
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_unsubscribe = self._on_unsubscribe
        self._unsubacks: dict[int, threading.Event] = {}
        self._early_unsubacks: set[int] = set()

    # paho callbacks (network thread) ---------------------------------------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._loop_thread = threading.get_ident()
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.error("mqtt: connection refused: %s", reason_code)
            return
        self._refused = None
        self.session_present = bool(getattr(flags, "session_present", False))
        if self.persistent_session:
            log.info("mqtt: connected as %s, %s", self.client_id,
                     "session resumed: what was published while away is delivered now" if self.session_present
                     else "new session")
        with self._lock:
            filters = sorted({f for f, _ in self._subs})
        for f in filters:
            client.subscribe(f, qos=1)
        self._connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._connected.clear()
        self.disconnects += 1
        if not self._closing:
            self._refuse_in_flight()
        if self._closing:
            log.info("mqtt: disconnected (%s)", reason_code)
        else:
            log.warning("mqtt: disconnected (%s); paho reconnects", reason_code)

    def _on_message(self, client, userdata, message) -> None:  # noqa: ANN001
        self._loop_thread = threading.get_ident()
        topic = message.topic
        with self._lock:  # the handlers of a topic are looked up once (a chunked update is 17 messages on one topic)
            targets = self._targets.get(topic)
            if targets is None:
                if len(self._targets) >= _MAX_TOPICS_CACHED:
                    self._targets.clear()
                targets = self._targets[topic] = [cb for f, cb in self._subs if topic_matches(_unshared(f), topic)]
        failed = False
        for cb in targets:
            try:
                cb(topic, bytes(message.payload))
            except Exception:  # noqa: BLE001 - never let a handler bug kill paho's network thread
                failed = True
                log.exception("mqtt: handler for %s raised", topic)
        if failed and message.qos > 0:  # not acknowledged: the broker delivers it again after a reconnect
            self.unacknowledged += 1
            log.error("mqtt: message on %s not acknowledged (its handler failed); the broker delivers it again "
                      "after the next reconnect%s", topic,
                      "" if self.persistent_session else " only if the session is persistent")
            return
        self._client.ack(message.mid, message.qos)

    # public API ------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect and start paho's network thread; wait for CONNACK.

        Raises:
            TransportError: unreachable broker or no CONNACK within ``connect_timeout_s``.
        """
        try:
            self._client.connect(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise TransportError(f"cannot reach MQTT broker {self.host}:{self.port}: {exc} "
                                 "(fix: start mosquitto or set broker_url)") from exc
        self._client.loop_start()
        deadline = time.monotonic() + self.connect_timeout_s
        while not self._connected.wait(0.05):
            if self._refused is not None or time.monotonic() >= deadline:
                self._closing = True
                self._client.disconnect()
                self._client.loop_stop()
                if self._refused is not None:
                    raise TransportError(f"MQTT broker {self.host}:{self.port} refused the connection: "
                                         f"{self._refused} (fix: check broker_username / broker_password_file and "
                                         "the TLS client certificate)")
                raise TransportError(f"no CONNACK from {self.host}:{self.port} within {self.connect_timeout_s} s")

    def subscribe(self, topic_filter: str, callback: Callback) -> None:
        """Register ``callback`` for ``topic_filter`` and subscribe at QoS 1 (again after each reconnect).

        ``topic_filter`` may be a shared subscription, ``$share/<group>/<filter>`` (several coordinator workers
        splitting the messages; docs/transport.md, "Scale-out"): ``callback`` then gets the messages matching
        ``<filter>``."""
        with self._lock:
            self._subs.append((topic_filter, callback))
            self._targets.clear()
        if self._connected.is_set():
            self._client.subscribe(topic_filter, qos=1)

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        with self._lock:
            done = self._unsubacks.pop(mid, None)
            if done is None:  # acknowledged before unsubscribe() registered its wait
                self._early_unsubacks.add(mid)
        if done is not None:
            done.set()

    def unsubscribe(self, topic_filters: list[str]) -> bool:
        """Drop the handlers of ``topic_filters`` and, when connected, unsubscribe the session from them, waiting
        (``connect_timeout_s`` at most) for the broker's UNSUBACK. A persistent session's broker then keeps nothing
        more for them while the client is away.

        Returns:
            True when the broker confirmed (or there was nothing to send), False when not connected or no UNSUBACK
            came in time (the session then keeps the subscriptions; the next connect subscribes again anyway).
        """
        with self._lock:
            self._subs = [(f, cb) for f, cb in self._subs if f not in topic_filters]
            self._targets.clear()
        if not topic_filters:
            return True
        if not self._connected.is_set():
            return False
        done = threading.Event()
        rc, mid = self._client.unsubscribe(list(topic_filters))
        if rc != self._mqtt.MQTT_ERR_SUCCESS or mid is None:
            return False
        with self._lock:
            if mid in self._early_unsubacks:
                self._early_unsubacks.discard(mid)
                return True
            self._unsubacks[mid] = done
        return done.wait(self.connect_timeout_s)

    def close(self) -> None:
        """Disconnect and stop the network thread, after waiting (``connect_timeout_s`` without progress at most)
        for the QoS 1 messages that were handed to paho without a wait (the ACKs and receipts of
        :class:`QueuedCallback` handlers): a coordinator that stops right after a round must not drop its last ACKs
        in paho's buffers."""
        if self._connected.is_set() and threading.get_ident() != self._loop_thread:
            with self._lock:
                unwaited = list(self._unwaited)
                self._unwaited.clear()
            self._wait_published(unwaited)
        self._closing = True
        self._client.disconnect()
        self._client.loop_stop()


def transport_from_config(config: CoordinatorConfig, *, client_id: str | None = None,
                          role: str | None = None, persistent: bool | None = None) -> MqttTransport:
    """The coordinator's :class:`MqttTransport` from its config: ``broker_url``, ``broker_ca_file``,
    ``broker_cert_file``/``broker_key_file`` and credentials (``broker_username``, else the username in
    ``broker_password_file``; the password from that file).

    Args:
        config: the (resolved) coordinator config.
        client_id: MQTT client id when the broker needs no credentials (default
            ``wildfed-coordinator-<federation>``, plus ``-<role>`` for a role). With credentials the client id is
            the username (module docstring).
        role: a second client of the coordinator (an ingest worker: its ``--worker-id``, e.g. ``ingest-1``):
            its role account from ``broker_password_file`` (shared.broker.load_broker_credentials), and with
            client certificates ``roles/<role>/client.crt`` beside ``broker_cert_file``.
        persistent: a persistent session (:class:`MqttTransport`, "Sessions"); default: yes for the coordinator's
            own client (``wildfed-coordinator run`` and ``service`` resume the same session: its identity is the
            client id, so they must not run at once, coordinator.instance_lock), no for a role's.

    Raises:
        ConfigError: bad URL, TLS files or credentials file, or no account (or certificate) for ``role``.
    """
    username, password = config.broker_username, None
    cert_file, key_file = config.broker_cert_file, config.broker_key_file
    if role is not None and config.broker_username is not None and config.broker_password_file is None:
        raise ConfigError(f"broker_username {config.broker_username!r} is the coordinator's own account; a second "
                          f"client ({role}) on it would disconnect the coordinator", field="broker_username",
                          fix="leave broker_username unset and point broker_password_file at the credentials file "
                          "broker-config wrote (it holds the role accounts)")
    if config.broker_password_file is not None:
        creds = load_broker_credentials(config.broker_password_file, role=role)
        if role is not None:
            username, password = creds.username, creds.password
        else:
            username, password = username or creds.username, creds.password
    if role is not None and cert_file is not None:
        cert_file, key_file = role_cert_paths(cert_file, role)
        if not (cert_file.is_file() and key_file.is_file()):
            raise ConfigError(f"no client certificate for role {role!r} at {cert_file}", source=cert_file,
                              field="broker_cert_file", fix=f"copy roles/{role}/ from the coordinator/ folder "
                              "broker-config --client-certs wrote beside the coordinator's client.crt")
    default_id = f"wildfed-coordinator-{config.federation_id}" + (f"-{role}" if role else "")
    return MqttTransport(config.broker_url, client_id=username or client_id or default_id,
                         ca_file=config.broker_ca_file, cert_file=cert_file, key_file=key_file, username=username,
                         password=password, max_drops=config.transfer.max_dropped_sends,
                         broker_max_packet_bytes=config.broker_max_packet_bytes,
                         persistent_session=role is None if persistent is None else persistent)
