"""What both MQTT clients (gateway and coordinator) need to reach a secured broker: the credentials file that
``wildfed-coordinator broker-config`` writes, and the client TLS context (docs/security.md).

Both sides read these from their own config; keeping one implementation here means the gateway and the coordinator
refuse the same bad files with the same messages. Nothing here imports paho.

Client ids are bound to credentials: the generated Mosquitto config sets ``use_username_as_clientid true``, so the
broker replaces whatever client id a client sends by its username, and whoever holds site A's password can only
ever take over site A's own session (docs/security.md, "Client ids"). Both transports therefore use the username as
their client id. A second client of the same identity (an ingest worker beside the coordinator, ``wildfed-edge
detect`` beside the gateway agent) needs an account of its own, or the two would keep disconnecting each other:
a *role account* ``<identity username>@<role>`` (:func:`role_username`), stored in the identity's credentials file
under ``roles`` and picked with ``load_broker_credentials(path, role=...)``.

Message size: the broker refuses MQTT packets over its limit (Mosquitto 2.0 ``max_packet_size``, EMQX
``mqtt.max_packet_size``; :data:`DEFAULT_BROKER_MAX_PACKET_BYTES` in the generated config), and a refused QoS 1
message may vanish without a trace. :func:`check_chunk_fits` is run on both sides' configs at start-up.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import yaml

from shared.errors import ConfigError
from shared.transfer import CHUNK_HEADER_LENGTH

__all__ = ["BrokerCredentials", "load_broker_credentials", "tls_context", "check_broker_fields", "check_client_options",
           "check_failover_urls",
           "site_username", "coordinator_username", "role_username", "validate_role", "role_cert_paths",
           "check_chunk_fits", "DEFAULT_BROKER_MAX_PACKET_BYTES", "MQTT_PUBLISH_OVERHEAD", "CHUNK_HEADER_BYTES",
           "SITE_ROLES", "DETECT_ROLE", "RefusedMessages", "DEFAULT_MAX_DROPS"]

#: The broker's packet limit the generated Mosquitto config sets (``max_packet_size``), bytes: the coordinator's
#: default ``transfer.max_message_bytes`` (1 MiB + 64 KiB of payload) plus room for the MQTT header. A 100 MB
#: message is refused by the broker (the client is disconnected) before it reaches anyone.
DEFAULT_BROKER_MAX_PACKET_BYTES = (1 << 20) + 65536 + 1024
#: Bytes an MQTT 3.1.1 PUBLISH adds to its payload, bounded from above: fixed header (1 byte + up to 4 of
#: remaining length), topic (2-byte length + at most 152 bytes: ``wildfed/v1/`` + a 64-character federation id +
#: ``/site/`` + a 64-character site id + ``/update``), packet id (2 bytes); OASIS MQTT 3.1.1 sec. 2.2 and 3.3.
#: Rounded up to 256.
MQTT_PUBLISH_OVERHEAD = 256
#: Bytes a chunk adds to its data (``shared.transfer.CHUNK_HEADER_LENGTH``: magic, transfer id, index).
CHUNK_HEADER_BYTES = CHUNK_HEADER_LENGTH
#: The role account every site gets beside its own: ``wildfed-edge detect --publish`` (detections only).
DETECT_ROLE = "detect"
#: Roles a site's credentials file carries (``broker-config`` makes one account per site and role).
SITE_ROLES = (DETECT_ROLE,)


def site_username(site_id: str) -> str:
    """The broker username of a site: ``site-<site_id>`` (also the CN of its client certificate). The prefixes keep
    a site id from ever being the coordinator's username."""
    return f"site-{site_id}"


def coordinator_username(federation_id: str) -> str:
    """The broker username of the federation's coordinator: ``coordinator-<federation_id>``."""
    return f"coordinator-{federation_id}"


def validate_role(role: str) -> str:
    """A role name (1-64 of ``A-Za-z0-9_.-``, starting with a letter or digit), returned as given.

    Raises:
        ConfigError: anything else (field ``role``).
    """
    if (not isinstance(role, str) or not 0 < len(role) <= 64 or not role[0].isascii() or not role[0].isalnum()
            or not all(c.isascii() and (c.isalnum() or c in "_.-") for c in role)):
        raise ConfigError(f"role {role!r} is not 1-64 characters of A-Za-z0-9_.- starting with a letter or digit",
                          field="role", fix="e.g. ingest-1 or detect")
    return role


def role_username(username: str, role: str) -> str:
    """The broker username of ``role`` of the identity ``username``: ``<username>@<role>``, e.g.
    ``coordinator-f@ingest-1`` or ``site-a@detect``. ``@`` never occurs in a site or federation id, so a role
    account can never be another identity's account.

    Raises:
        ConfigError: a bad role name.
    """
    return f"{username}@{validate_role(role)}"


def role_cert_paths(cert_file: str | os.PathLike[str], role: str) -> tuple[Path, Path]:
    """Where ``broker-config --client-certs`` puts the client certificate and key of ``role`` of the identity whose
    certificate is ``cert_file``: ``<its folder>/roles/<role>/client.crt`` and ``client.key``.

    Raises:
        ConfigError: a bad role name.
    """
    folder = Path(cert_file).parent / "roles" / validate_role(role)
    return folder / "client.crt", folder / "client.key"


def check_chunk_fits(chunk_size: int, broker_max_packet_bytes: int, *, field: str, limit_field: str) -> None:
    """Check that the largest message a sender makes with chunks of ``chunk_size`` bytes (a chunk: data + 40-byte
    chunk header; a whole envelope is at most ``chunk_size``) fits the broker's packet limit with the MQTT header
    (:data:`MQTT_PUBLISH_OVERHEAD`). A broker drops what does not fit, and the transfer would be retried forever.

    Args:
        chunk_size: bytes of data per chunk. broker_max_packet_bytes: the broker's limit on one MQTT packet.
        field, limit_field: the config fields to name in the error.

    Raises:
        ConfigError: naming ``field``, the limit and the largest chunk size that fits.
    """
    largest = broker_max_packet_bytes - CHUNK_HEADER_BYTES - MQTT_PUBLISH_OVERHEAD
    if chunk_size > largest:
        raise ConfigError(
            f"{chunk_size} bytes per chunk + {CHUNK_HEADER_BYTES} bytes of chunk header + {MQTT_PUBLISH_OVERHEAD} "
            f"bytes of MQTT header do not fit the broker's limit of {broker_max_packet_bytes} bytes per message "
            f"({limit_field}); the broker would drop every chunk", field=field,
            fix=f"set {field} to at most {largest}, or, if the broker really takes larger messages, set "
            f"{limit_field} to its limit (Mosquitto max_packet_size, EMQX mqtt.max_packet_size)")


#: How many times in a row the broker may close the connection while one message waits for its PUBACK before the
#: message counts as refused (:class:`RefusedMessages`; the gateway uses its ``max_chunk_requests`` instead).
DEFAULT_MAX_DROPS = 3


class RefusedMessages:
    """Messages the broker keeps closing the connection on: the same message dropped before its PUBACK
    ``max_drops`` times in a row is refused, with an error naming the settings to change.

    A broker closes the connection (it sends no PUBACK, and in MQTT 3.1.1 no reason) on a packet over its limit
    (Mosquitto ``max_packet_size``); a QoS 1 client would send it again after every reconnect, forever, and the link
    would carry nothing else. That happens when the broker's real limit is below what ``broker_max_packet_bytes``
    says (the start-up check, :func:`check_chunk_fits`, trusts that setting). Once a message of ``n`` bytes is
    refused, every message of ``n`` bytes or more is refused at once, without sending it: the broker's limit is on
    the packet size, so it would refuse those too. Counts live in memory (a restart, e.g. after fixing the broker,
    starts afresh). Thread-safe.

    Args:
        max_drops: drops in a row of one message that make it refused (>= 1).
        chunk_field, limit_field: the config fields to name (``chunk_size_bytes`` / ``transfer.chunk_size_bytes``,
            ``broker_max_packet_bytes``).
        configured_limit: the value of ``limit_field``, bytes, or None.
    """

    def __init__(self, max_drops: int = DEFAULT_MAX_DROPS, *, chunk_field: str = "chunk_size_bytes",
                 limit_field: str = "broker_max_packet_bytes", configured_limit: int | None = None) -> None:
        if max_drops < 1:
            raise ConfigError(f"max_drops must be >= 1, got {max_drops}", field="max_drops", fix="use e.g. 3")
        self.max_drops = max_drops
        self.chunk_field, self.limit_field, self.configured_limit = chunk_field, limit_field, configured_limit
        self.refused_size: int | None = None  # the smallest message size refused so far, bytes
        self._drops: dict[bytes, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(topic: str, payload: bytes) -> bytes:
        return hashlib.sha256(topic.encode("utf-8") + b"\0" + bytes(payload)).digest()

    def error(self, topic: str, size: int, times: int) -> str:
        """The error text for a refused message of ``size`` bytes to ``topic`` (dropped ``times`` times)."""
        largest_chunk = (self.configured_limit - CHUNK_HEADER_BYTES - MQTT_PUBLISH_OVERHEAD
                         if self.configured_limit else None)
        said = (f", below the {self.configured_limit} bytes {self.limit_field} says" if self.configured_limit
                else "")
        return (f"the broker closed the connection {times} time(s) in a row while a {size}-byte message to {topic} "
                f"waited for its PUBACK, so it is given up: most likely the message is over the broker's packet limit "
                f"(Mosquitto max_packet_size){said}; messages of {size} bytes or more are not sent again (fix: set "
                f"{self.limit_field} to the broker's real limit and {self.chunk_field} to at most that limit - "
                f"{CHUNK_HEADER_BYTES + MQTT_PUBLISH_OVERHEAD} bytes"
                + (f" (now {largest_chunk} at most)" if largest_chunk else "")
                + ", so that large messages go in chunks that fit; or raise the broker's max_packet_size)")

    def refused(self, topic: str, payload: bytes) -> str | None:
        """The error text if a message of this size is refused already (do not send it), else None."""
        with self._lock:
            if self.refused_size is not None and len(payload) >= self.refused_size:
                return self.error(topic, len(payload), self._drops.get(self._key(topic, payload), 0))
        return None

    def dropped(self, topic: str, payload: bytes) -> str | None:
        """The link dropped while this message waited for its PUBACK: count it; returns the error text when that
        makes ``max_drops`` in a row (the message is refused from now on, and every message at least as large)."""
        key = self._key(topic, payload)
        with self._lock:
            times = self._drops.get(key, 0) + 1
            self._drops[key] = times
            if times < self.max_drops:
                return None
            self.refused_size = len(payload) if self.refused_size is None else min(self.refused_size, len(payload))
        return self.error(topic, len(payload), times)

    def delivered(self, topic: str, payload: bytes) -> None:
        """The broker acknowledged this message: its drops no longer count (they were not in a row)."""
        with self._lock:
            self._drops.pop(self._key(topic, payload), None)


@dataclass(frozen=True)
class BrokerCredentials:
    """An MQTT username and password (a secret: ``repr`` hides the password)."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"BrokerCredentials(username={self.username!r}, password=<hidden>)"


def load_broker_credentials(path: str | os.PathLike[str], *, role: str | None = None) -> BrokerCredentials:
    """Read a credentials YAML file ``{username: ..., password: ..., roles: {<role>: {username, password}}}``
    written by ``wildfed-coordinator broker-config`` (coordinator.broker_config): ``coordinator/`` or
    ``sites/<id>/broker-credentials.yaml``; ``roles`` is optional.

    Args:
        path: the file. role: None for the identity's own account, else one of its role accounts (its username
            must be :func:`role_username` of the identity's).

    Raises:
        ConfigError: missing file, readable by group/others (must be 0600), not YAML, no non-empty username and
            password strings, or no account for ``role`` (field ``broker_password_file``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("broker credentials file not found", source=path, field="broker_password_file",
                          fix="run `wildfed-coordinator broker-config` and point broker_password_file at the "
                          "broker-credentials.yaml it wrote (coordinator/ or sites/<id>/)")
    if os.name == "posix" and path.stat().st_mode & 0o077:
        raise ConfigError(f"broker credentials are accessible by group/others (mode {oct(path.stat().st_mode & 0o777)})",
                          source=path, field="broker_password_file", fix=f"run `chmod 600 {path}`")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=path, field="broker_password_file",
                          fix="use the file broker-config wrote") from exc
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) and raw.get(k) for k in ("username",
                                                                                                 "password")):
        raise ConfigError("expected a mapping with non-empty 'username' and 'password'", source=path,
                          field="broker_password_file", fix="use the file broker-config wrote")
    if role is None:
        return BrokerCredentials(username=raw["username"], password=raw["password"])
    roles = raw.get("roles") or {}
    entry = roles.get(validate_role(role)) if isinstance(roles, dict) else None
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry.get(k)
                                              for k in ("username", "password")):
        known = sorted(roles) if isinstance(roles, dict) else []
        raise ConfigError(f"no broker account for role {role!r} of {raw['username']!r} (accounts for: "
                          f"{', '.join(map(str, known)) or 'none'}); sharing the identity's own account would make "
                          "the two clients disconnect each other (the broker uses the username as client id)",
                          source=path, field="broker_password_file",
                          fix="re-run `wildfed-coordinator broker-config` (it makes ingest-1..ingest-N for "
                          "ingest_workers: N and a detect account per site) and install the new file")
    if entry["username"] != role_username(raw["username"], role):
        raise ConfigError(f"role {role!r} names broker user {entry['username']!r}, expected "
                          f"{role_username(raw['username'], role)!r}", source=path, field="broker_password_file",
                          fix="use the file broker-config wrote")
    return BrokerCredentials(username=entry["username"], password=entry["password"])


def tls_context(*, ca_file: str | os.PathLike[str] | None, cert_file: str | os.PathLike[str] | None = None,
                key_file: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """A client TLS context: server certificate verified against ``ca_file`` (system CAs when None), hostname
    checked, TLS 1.2 minimum, and an optional client certificate (``cert_file`` + ``key_file``, both or neither).

    Raises:
        ConfigError: a file is missing or unreadable as PEM, or only one of ``cert_file``/``key_file`` is given.
    """
    if (cert_file is None) != (key_file is None):
        raise ConfigError("a client certificate needs both its certificate and its key", field="broker_cert_file",
                          fix="set both broker_cert_file and broker_key_file, or neither")
    for name, value in (("broker_ca_file", ca_file), ("broker_cert_file", cert_file), ("broker_key_file", key_file)):
        if value is not None and not Path(value).is_file():
            raise ConfigError("file not found", source=value, field=name, fix="check the path")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None if ca_file is None else str(ca_file))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert_file is not None and key_file is not None:
            ctx.load_cert_chain(str(cert_file), str(key_file))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"cannot load TLS material: {exc}", source=ca_file or cert_file, field="broker_ca_file",
                          fix="pass PEM files written by `wildfed-coordinator broker-config`") from exc
    return ctx


def check_broker_fields(url: str, ca_file: object, cert_file: object, key_file: object) -> None:
    """The broker fields of a config agree: a client certificate comes with its key, and TLS files go with an
    ``mqtts://`` URL (used by both configs' validators, which report the ValueError with the file and field).

    Raises:
        ValueError: only one of ``cert_file``/``key_file``, or TLS files with a plain ``mqtt://`` URL.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("broker_cert_file and broker_key_file go together (mutual TLS): set both or neither")
    if url.startswith("mqtt://") and any(f is not None for f in (ca_file, cert_file, key_file)):
        raise ValueError("broker TLS files are set but broker_url is mqtt:// (plain): use mqtts://host:8883")


def check_failover_urls(primary: str, others: object) -> tuple[str, ...]:
    """The further brokers of a cluster a client fails over to (``broker_failover_urls``; docs/brokers.md):
    each ``mqtt://host:port`` or ``mqtts://host:port`` with a host, of the same scheme as ``primary`` (the TLS
    files and credentials are the same for every node), none repeated and none equal to ``primary``.

    Returns:
        the URLs, as a tuple in the given order.

    Raises:
        ValueError: naming the bad URL and the rule it breaks (a config's validator reports it with the field).
    """
    if isinstance(others, str) or not isinstance(others, (list, tuple)):
        raise ValueError("must be a list of broker URLs, e.g. [mqtt://broker-2:1883, mqtt://broker-3:1883]")
    scheme = primary.split("://", 1)[0]
    seen = {primary}
    for url in others:
        parsed = urlparse(str(url))
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
            raise ValueError(f"{url!r} is not mqtt://host:port or mqtts://host:port")
        if parsed.scheme != scheme:
            raise ValueError(f"{url!r} is {parsed.scheme}:// but broker_url is {scheme}://: every node of the "
                             "cluster is reached the same way (the same TLS files and credentials)")
        if url in seen:
            raise ValueError(f"{url!r} is listed twice (or is broker_url itself)")
        seen.add(str(url))
    return tuple(str(u) for u in others)


def check_client_options(url: str, *, tls: bool, ca_file: object, cert_file: object, key_file: object,
                         username: str | None, password: str | None) -> None:
    """The options an MQTT client (gateway or coordinator) is built with agree: TLS files only with a TLS URL, a
    password only with a username.

    Raises:
        ConfigError: naming ``broker_url`` or ``broker_username`` and the fix.
    """
    if not tls and any(v is not None for v in (ca_file, cert_file, key_file)):
        raise ConfigError(f"TLS files given for a plain broker URL {url!r}", field="broker_url",
                          fix="use mqtts://host:8883 with broker_ca_file / broker_cert_file / broker_key_file")
    if password is not None and not username:
        raise ConfigError("a broker password needs a username", field="broker_username",
                          fix="set broker_username, or use the credentials file broker-config wrote")
