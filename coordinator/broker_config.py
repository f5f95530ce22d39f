"""Mosquitto 2.x broker configuration generated from the site registry: TLS listener, per-site credentials, ACL.

``wildfed-coordinator broker-config --out DIR`` calls :func:`generate_broker_config`, which writes::

    DIR/mosquitto.conf                       the broker config (absolute paths to everything below)
    DIR/acl                                  the ACL (render_acl): each site may write only its own topics
    DIR/passwd                               Mosquitto password file, PBKDF2-SHA512 ("$7$") hashes, mode 0600
    DIR/tls/ca.crt, ca.key (0600)            the federation's broker CA (or a copy of an operator's CA certificate)
    DIR/tls/server.crt, server.key (0600)    the broker's certificate for the given host names / IP addresses
    DIR/coordinator/broker-credentials.yaml  the coordinator's MQTT username and password (0600)
    DIR/coordinator/client.crt, client.key   its client certificate (with --client-certs)
    DIR/sites/<id>/broker-credentials.yaml   each site's MQTT username and password (0600), for provisioning
    DIR/sites/<id>/broker-ca.pem             the CA certificate the site's gateway verifies the broker with
    DIR/sites/<id>/client.crt, client.key    the site's client certificate, CN = its username (--client-certs)
    DIR/<identity>/roles/<role>/client.crt   a role account's client certificate, CN = its username (--client-certs)

Names: a site's broker username is ``site-<site_id>`` (:func:`site_username`), the coordinator's is
``coordinator-<federation_id>`` (:func:`coordinator_username`); the prefixes keep the two name spaces apart, so no
site id can ever be the coordinator's username. One generated configuration serves one federation.

Client ids are bound to credentials: ``use_username_as_clientid true`` makes the broker replace the client id of
every connection by its username (Mosquitto 2.0, mosquitto.conf(5)). Without it, MQTT's session takeover (a CONNECT
with a client id in use disconnects the older connection, MQTT 3.1.1 sec. 3.1.4) let anyone with any site's
password disconnect the coordinator over and over by connecting under its (predictable) client id. With it, site
A's credentials can only ever take over site A's own session. So every client that runs beside another of the same
identity has an account of its own, a *role account* ``<username>@<role>`` (shared.broker.role_username), kept in
the identity's credentials file under ``roles``:

* the coordinator's ingest workers: ``coordinator-<fed>@ingest-<i>`` for i = 1..``ingest_workers`` (run them with
  ``--worker-id ingest-<i>``); they may read every site's update topic and write its task and ack topics;
* each site's detection publisher (``wildfed-edge detect --publish``): ``site-<id>@detect``, which may only write
  the site's detection topic.

The ACL keys every rule by username (``user`` blocks), never by client id (``%c``), which the client chooses.

Message size: ``max_packet_size`` (default :data:`shared.broker.DEFAULT_BROKER_MAX_PACKET_BYTES`). Mosquitto 2.0.11
still accepts ``message_size_limit`` but says "It is recommended to replace `message_size_limit` with
`max_packet_size`" at start-up; ``max_packet_size`` also counts the MQTT header and is checked on the packet's
announced length, before the payload is read, and the sender is disconnected (``message_size_limit`` reads the
whole payload, acknowledges it and drops it silently). Gateways and the coordinator check their chunk sizes against
the same limit at start-up (``broker_max_packet_bytes`` in both configs).

Which sites: every enrolled site with at least one valid key (coordinator.registry.SiteRegistry.verification_keys);
a site whose keys are all revoked loses its broker account on the next run.

ACL semantics (Mosquitto 2.0 ``acl_file``, read from its source, src/security_default.c): a client is checked when
it *publishes* (``write``) and when a message is *delivered* to it (``read``), each time against the message's
actual topic; subscription filters themselves are not checked (subscribing to ``#`` succeeds, but nothing the ACL
does not allow is delivered). A denied publish is acknowledged and dropped silently. A shared subscription
``$share/<group>/wildfed/v1/<fed>/site/+/update`` therefore needs no ``$share`` ACL entry: each delivery is checked
against the underlying topic ``wildfed/v1/<fed>/site/<id>/update``, which the coordinator may read. The last will
is checked as a ``write`` of the will topic when the client connects.

Re-running is safe: the CA, the server certificate (while it matches the host names, verifies with the CA and has
more than 30 days left), the client certificates and every existing credential are kept; ``rotate_passwords=True``
draws new passwords for every account. Password hashes whose password is unchanged are kept byte for byte.

Password hashing: ``mosquitto_passwd -U`` when the binary exists (Mosquitto 2.0's default, PBKDF2-HMAC-SHA512 with
101 iterations and a 12-byte salt); otherwise the same ``$7$<iterations>$<b64 salt>$<b64 hash>`` line is computed
with :func:`hashlib.pbkdf2_hmac` (format from Mosquitto 2.0's ``apps/mosquitto_passwd`` and
``src/security_default.c``; checked against ``mosquitto_passwd`` 2.0.11 output in the tests). The passwords are
``secrets.token_urlsafe(32)`` (256 random bits), so the low iteration count does not make guessing feasible.

TLS material is made with ``cryptography`` (RFC 5280 profiles): an ECDSA P-256 CA (basicConstraints CA, pathlen 0,
keyCertSign), a server certificate with the host names and IP addresses as subjectAltName and extendedKeyUsage
serverAuth, client certificates with CN = the broker username and extendedKeyUsage clientAuth.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.broker import (DEFAULT_BROKER_MAX_PACKET_BYTES, SITE_ROLES, BrokerCredentials, coordinator_username,
                           load_broker_credentials, role_cert_paths, role_username, site_username, validate_role)
from shared.errors import ConfigError
from shared.keys import write_file_atomic
from shared.topics import PREFIX

from coordinator.registry import SiteRegistry

__all__ = ["BrokerConfigResult", "BrokerCredentials", "generate_broker_config", "render_acl", "render_mosquitto_conf",
           "site_username", "coordinator_username", "hash_password_pbkdf2", "verify_password_pbkdf2",
           "load_broker_credentials", "validate_hostname", "SITE_WRITE_CHANNELS", "SITE_READ_CHANNELS",
           "MOSQUITTO_PBKDF2_ITERATIONS", "WORKER_READ_CHANNELS", "WORKER_WRITE_CHANNELS", "ingest_worker_roles"]

#: Channels a site publishes on (its own topics only).
SITE_WRITE_CHANNELS = ("update", "detection", "secagg", "status", "health")
#: Channels a site reads (its own topics only): ``model/#`` are the chunk topics of a released model
#: (shared.topics.model_chunk_topic), ``software/#`` those of a published SDK version; the parents are listed too, so
#: the rule does not rest on ``#`` matching its parent.
SITE_READ_CHANNELS = ("task", "ack", "model", "model/#", "software", "software/#")
#: Channels an ingest worker reads (every site's).
WORKER_READ_CHANNELS = ("update",)
#: Channels an ingest worker writes (every site's): ACKs and receipts, and the task chunks it resends.
WORKER_WRITE_CHANNELS = ("task", "ack")
#: Channels a site's detection publisher (role ``detect``) writes (its own site's only).
DETECT_WRITE_CHANNELS = ("detection",)
#: Mosquitto 2.0's default PBKDF2 iteration count (``mosquitto_passwd``).
MOSQUITTO_PBKDF2_ITERATIONS = 101
_SALT_BYTES = 12
_RENEW_BEFORE = _dt.timedelta(days=30)
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_KEY_MODE = 0o600


def ingest_worker_roles(ingest_workers: int) -> tuple[str, ...]:
    """The role names of the coordinator's ingest workers: ``ingest-1`` .. ``ingest-<ingest_workers>`` (each
    worker runs with ``--worker-id`` set to its role and connects with that role's account)."""
    return tuple(f"ingest-{i}" for i in range(1, int(ingest_workers) + 1))


def _write_credentials(path: Path, creds: BrokerCredentials, *, who: str,
                       roles: Mapping[str, BrokerCredentials] | None = None) -> None:
    body: dict[str, object] = {"username": creds.username, "password": creds.password}
    if roles:
        body["roles"] = {r: {"username": c.username, "password": c.password} for r, c in sorted(roles.items())}
    text = (f"# MQTT broker credentials of {who}, written by `wildfed-coordinator broker-config`.\n"
            "# A secret: keep this file mode 0600 and install it only on that machine.\n"
            + ("# roles: accounts of further clients of the same identity (the broker uses the username as client\n"
               "# id, so two clients sharing one account would disconnect each other).\n" if roles else "")
            + yaml.safe_dump(body, sort_keys=False))
    write_file_atomic(path, text.encode("utf-8"), _KEY_MODE)


# ---- ACL and mosquitto.conf ----------------------------------------------------------------------------------------
def render_acl(federation_id: str, site_ids: Sequence[str], *, coordinator_roles: Sequence[str] = (),
               site_roles: Sequence[str] = ()) -> str:
    """The Mosquitto ACL file of a federation.

    Each site user ``site-<id>`` may write ``wildfed/v1/<fed>/site/<id>/{update,detection,secagg,status,health}``
    and read ``.../site/<id>/{task,ack,model,model/#,software,software/#}``; the coordinator user may read every
    site's update, detection, secagg, status and health topics and write every site's task, ack, model and software
    topics. Role accounts (module docstring): an ingest worker (``coordinator_roles``) reads every site's update
    topic and writes every task and ack topic; a site's ``detect`` role (in ``site_roles``) writes only that site's detection topic. Every rule is keyed by username
    (``user`` blocks), never by the client-chosen client id. Nothing else (no anonymous section, no patterns, no
    ``$SYS``). Sites and roles are listed sorted, so the text depends only on the sets.

    Raises:
        ConfigError: a bad role name, or a site role other than ``detect``.
    """
    base = f"{PREFIX}/{federation_id}/site"
    coord = coordinator_username(federation_id)
    lines = [f"# Mosquitto ACL of WildFed federation {federation_id}, written by `wildfed-coordinator broker-config`.",
             "# Mosquitto checks 'write' when a client publishes and 'read' when a message is delivered to it, against",
             "# the message's topic (also for $share/... subscriptions). Regenerate rather than edit.",
             "",
             f"user {coord}"]
    lines += [f"topic read {base}/+/{channel}" for channel in SITE_WRITE_CHANNELS]
    lines += [f"topic write {base}/+/{channel}" for channel in SITE_READ_CHANNELS]
    for role in sorted(coordinator_roles):
        lines += ["", f"user {role_username(coord, role)}"]
        lines += [f"topic read {base}/+/{channel}" for channel in WORKER_READ_CHANNELS]
        lines += [f"topic write {base}/+/{channel}" for channel in WORKER_WRITE_CHANNELS]
    for role in site_roles:
        if validate_role(role) not in SITE_ROLES:
            raise ConfigError(f"site role {role!r} is not one of {list(SITE_ROLES)}", field="site_roles",
                              fix=f"use {', '.join(SITE_ROLES)}")
    for site_id in sorted(site_ids):
        lines += ["", f"user {site_username(site_id)}"]
        lines += [f"topic write {base}/{site_id}/{channel}" for channel in SITE_WRITE_CHANNELS]
        lines += [f"topic read {base}/{site_id}/{channel}" for channel in SITE_READ_CHANNELS]
        for role in sorted(site_roles):
            lines += ["", f"user {role_username(site_username(site_id), role)}"]
            lines += [f"topic write {base}/{site_id}/{channel}" for channel in DETECT_WRITE_CHANNELS]
    return "\n".join(lines) + "\n"


def render_mosquitto_conf(*, password_file: Path, acl_file: Path, cafile: Path, certfile: Path, keyfile: Path,
                          tls_port: int = 8883, bind_address: str | None = None, client_certs: bool = False,
                          loopback_port: int | None = None, persistence_dir: Path | None = None,
                          broker_user: str | None = None, federation_id: str = "",
                          max_queued_messages: int = 100_000, max_queued_bytes: int = 1 << 30,
                          max_packet_bytes: int = DEFAULT_BROKER_MAX_PACKET_BYTES) -> str:
    """The text of a Mosquitto 2.x ``mosquitto.conf``.

    Queue limits (per client): Mosquitto's default ``max_queued_messages 1000`` drops QoS 1 messages for a
    subscriber that falls behind ("Outgoing messages are being dropped for client ..."). At the default chunk size a
    1M-parameter update is 17 messages, so 200 gateways uploading at once queue 3,400 messages for the coordinator:
    the default made 199 of 200 gateways resend (benchmarks/load_200.py). The limits here (100,000 messages, 1 GiB)
    keep a round's uploads queued; ``max_queued_bytes`` bounds the broker's memory.

    Global: ``per_listener_settings false``, ``allow_anonymous false``, ``password_file``, ``acl_file`` (the same
    authentication and ACL on every listener) and ``max_packet_size`` = ``max_packet_bytes`` (larger packets are
    refused and their sender disconnected; see the module docstring). Every listener sets
    ``use_username_as_clientid true`` (client ids bound to credentials: no one can take over another account's
    session); in Mosquitto 2.0 it is a listener setting, and written before the first ``listener`` it would open a
    default listener on port 1883. A TLS listener on ``tls_port`` (``cafile``/``certfile``/``keyfile``,
    ``tls_version tlsv1.2``, which Mosquitto 2.0 takes as the minimum); with ``client_certs``, ``require_certificate
    true`` and ``use_identity_as_username true`` (the certificate's CN is the username, no password is asked on that
    listener). With ``loopback_port``, a plain listener on 127.0.0.1 for local tests and tools (still
    authenticated, but the password crosses the loopback interface unencrypted). Paths must be absolute.

    Raises:
        ConfigError: a relative path, a port outside 1..65535, or ``max_packet_bytes`` below 2 KiB.
    """
    if not (isinstance(max_packet_bytes, int) and max_packet_bytes >= 2048):
        raise ConfigError(f"max_packet_bytes {max_packet_bytes!r} is too small for any WildFed message",
                          field="max_packet_bytes", fix=f"use the default {DEFAULT_BROKER_MAX_PACKET_BYTES}")
    for name, path in (("password_file", password_file), ("acl_file", acl_file), ("cafile", cafile),
                       ("certfile", certfile), ("keyfile", keyfile)):
        if not Path(path).is_absolute():
            raise ConfigError(f"{name} {path} is not absolute", field=name, fix="pass an absolute path")
    for name, port in (("tls_port", tls_port), ("loopback_port", loopback_port)):
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ConfigError(f"{name} {port!r} is not a TCP port", field=name, fix="use a port in 1..65535")
    lines = [f"# Mosquitto 2.x configuration of WildFed federation {federation_id}, written by",
             "# `wildfed-coordinator broker-config`. Regenerate after enrolling, rotating or revoking sites, then",
             "# reload mosquitto (SIGHUP re-reads the password and ACL files). Reference: mosquitto.conf(5), 2.0.",
             "per_listener_settings false",
             "allow_anonymous false",
             f"password_file {password_file}",
             f"acl_file {acl_file}",
             "# larger MQTT packets are refused and their sender disconnected (gateways and the coordinator check",
             "# their chunk sizes against broker_max_packet_bytes, which must equal this)",
             f"max_packet_size {int(max_packet_bytes)}"]
    if broker_user:
        lines.append(f"user {broker_user}")
    lines += [f"max_queued_messages {int(max_queued_messages)}", f"max_queued_bytes {int(max_queued_bytes)}"]
    if persistence_dir is not None:
        lines += ["persistence true", f"persistence_location {str(persistence_dir).rstrip('/')}/"]
    else:
        lines.append("persistence false")
    # use_username_as_clientid is a listener setting in Mosquitto 2.0 (before any `listener` line it would open a
    # default listener on 1883), so every listener carries it.
    bind_ids = ["# client id := username: no account can take over another one's session (docs/security.md)",
                "use_username_as_clientid true"]
    lines += ["", f"listener {tls_port}" + (f" {bind_address}" if bind_address else ""), "protocol mqtt",
              f"cafile {cafile}", f"certfile {certfile}", f"keyfile {keyfile}", "tls_version tlsv1.2"]
    if client_certs:
        lines += ["require_certificate true", "use_identity_as_username true"]
    lines += bind_ids
    if loopback_port is not None:
        lines += ["", "# plain MQTT on loopback only (local tests and tools); still authenticated",
                  f"listener {loopback_port} 127.0.0.1", "protocol mqtt", *bind_ids]
    return "\n".join(lines) + "\n"


# ---- passwords -----------------------------------------------------------------------------------------------------
def hash_password_pbkdf2(password: str, *, salt: bytes | None = None,
                         iterations: int = MOSQUITTO_PBKDF2_ITERATIONS) -> str:
    """Mosquitto's ``$7$`` hash of ``password``: ``$7$<iterations>$<base64 salt>$<base64 PBKDF2-HMAC-SHA512>``
    (64-byte digest, 12-byte random salt), as ``mosquitto_passwd`` 2.0 writes it after ``username:``."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password_pbkdf2(password: str, hashed: str) -> bool:
    """Whether a ``$7$`` hash (:func:`hash_password_pbkdf2`) is that of ``password``; False for other formats."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7":
        return False
    try:
        iterations, salt, digest = int(parts[2]), base64.b64decode(parts[3]), base64.b64decode(parts[4])
    except ValueError:
        return False
    calc = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations, dklen=len(digest))
    return secrets.compare_digest(calc, digest)


def _read_password_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if ":" in line and not line.startswith("#"):
                user, hashed = line.split(":", 1)
                out[user] = hashed
    return out


def _write_password_file(path: Path, accounts: Mapping[str, str], mosquitto_passwd: str | None) -> bool:
    """Write ``user:$7$...`` lines for ``accounts`` (username -> password), keeping the existing hash of each
    unchanged password; new hashes by ``mosquitto_passwd -U`` when given, else by :func:`hash_password_pbkdf2`.
    Returns whether ``mosquitto_passwd`` was run."""
    existing = _read_password_file(path)
    kept = {u: existing[u] for u, p in accounts.items() if u in existing and verify_password_pbkdf2(p, existing[u])}
    fresh = {u: p for u, p in accounts.items() if u not in kept}
    hashed: dict[str, str] = dict(kept)
    used_binary = False
    if fresh and mosquitto_passwd:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".passwd-plain-")
        try:
            os.fchmod(fd, _KEY_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("".join(f"{u}:{p}\n" for u, p in sorted(fresh.items())))
            proc = subprocess.run([mosquitto_passwd, "-U", tmp], capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise ConfigError(f"mosquitto_passwd -U failed ({proc.returncode}): {proc.stderr.strip()[:200]}",
                                  field="mosquitto_passwd", fix="check the mosquitto installation, or pass "
                                  "--no-mosquitto-passwd to hash in Python")
            hashed.update(_read_password_file(Path(tmp)))
            used_binary = True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        hashed.update({u: hash_password_pbkdf2(p) for u, p in fresh.items()})
    text = "".join(f"{u}:{hashed[u]}\n" for u in sorted(accounts))
    write_file_atomic(path, text.encode("utf-8"), _KEY_MODE)
    return used_binary


# ---- TLS -----------------------------------------------------------------------------------------------------------
def validate_hostname(name: str) -> str:
    """A host name (RFC 1123 labels) or an IP address, returned as given.

    Raises:
        ConfigError: anything else (names the ``hostname`` field).
    """
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    labels = name.rstrip(".").split(".") if name else []
    if not labels or len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise ConfigError(f"{name!r} is neither a host name nor an IP address", field="hostname",
                          fix="pass the names clients use to reach the broker, e.g. --hostname broker.example.org "
                          "--hostname 10.0.0.5")
    return name


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    return key  # type: ignore[return-value]


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _make_ca(federation_id: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "WildFed"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"WildFed broker CA ({federation_id})")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _issue(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, common_name: str, days: int,
           server_names: Sequence[str] | None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate (RFC 5280): server (``server_names`` as subjectAltName, serverAuth) or client
    (clientAuth)."""
    key = _new_key()
    now = _now()
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "WildFed"),
                                        x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
                              critical=False))
    if server_names is not None:
        alt: list[x509.GeneralName] = []
        for name in server_names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        builder = (builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _san_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)}


def _leaf_ok(cert_path: Path, key_path: Path, ca: x509.Certificate, *, common_name: str,
             server_names: Sequence[str] | None) -> bool:
    """Whether an existing leaf certificate can be kept: readable with its key, issued by ``ca``, for the same
    name(s), and valid for more than 30 more days."""
    cert, key = _load_cert(cert_path), _load_key(key_path)
    if cert is None or key is None or not _issued_by(cert, ca):
        return False
    if cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        return False
    if cert.not_valid_after_utc - _now() < _RENEW_BEFORE:
        return False
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if server_names is not None:
        wanted = {str(ipaddress.ip_address(n)) if _is_ip(n) else n for n in server_names}
        return _san_names(cert) == wanted
    return cns == [common_name]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _ensure_leaf(cert_path: Path, key_path: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *,
                 common_name: str, days: int, server_names: Sequence[str] | None) -> bool:
    """Keep or (re)issue a leaf certificate; returns True when a new one was written."""
    if _leaf_ok(cert_path, key_path, ca, common_name=common_name, server_names=server_names):
        return False
    cert, key = _issue(ca, ca_key, common_name=common_name, days=days, server_names=server_names)
    write_file_atomic(key_path, _key_pem(key), _KEY_MODE)
    write_file_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def _ensure_ca(tls_dir: Path, federation_id: str, *, ca_cert: Path | None, ca_key: Path | None,
               days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    """The CA certificate and key: the operator's (``ca_cert`` + ``ca_key``, copied as ``tls/ca.crt``), else the
    existing ``tls/ca.crt``/``tls/ca.key``, else a new one. Returns ``(cert, key, path of tls/ca.crt)``."""
    out_cert, out_key = tls_dir / "ca.crt", tls_dir / "ca.key"
    if (ca_cert is None) != (ca_key is None):
        raise ConfigError("an existing CA needs both its certificate and its key", field="ca_cert",
                          fix="pass both --ca-cert and --ca-key, or neither (a CA is then generated and kept)")
    if ca_cert is not None and ca_key is not None:
        cert, key = _load_cert(Path(ca_cert)), _load_key(Path(ca_key))
        if cert is None:
            raise ConfigError("not a PEM X.509 certificate", source=ca_cert, field="ca_cert", fix="pass the CA's PEM")
        if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise ConfigError("not an unencrypted PEM EC or RSA private key", source=ca_key, field="ca_key",
                              fix="pass the CA's unencrypted PEM key (EC or RSA)")
        basic = None
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            pass
        if basic is None or not basic.ca:
            raise ConfigError("certificate is not a CA (basicConstraints CA:TRUE missing)", source=ca_cert,
                              field="ca_cert", fix="pass a CA certificate (RFC 5280 sec. 4.2.1.9)")
        if cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo) != \
                key.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
            raise ConfigError("the CA key does not match the CA certificate", source=ca_key, field="ca_key",
                              fix="pass the key of that certificate")
        write_file_atomic(out_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert, key, out_cert
    if out_cert.is_file() and out_key.is_file():
        cert, key = _load_cert(out_cert), _load_key(out_key)
        if cert is None or key is None:
            raise ConfigError("the existing CA in the output folder does not load", source=tls_dir, field="out",
                              fix="restore tls/ca.crt and tls/ca.key, or move them away to make a new CA (every "
                              "gateway then needs the new ca.crt)")
        return cert, key, out_cert
    cert, key = _make_ca(federation_id, days)
    write_file_atomic(out_key, _key_pem(key), _KEY_MODE)
    write_file_atomic(out_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key, out_cert


# ---- the whole configuration ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BrokerConfigResult:
    """What :func:`generate_broker_config` wrote (absolute paths).

    Attributes:
        conf, acl, password_file: the Mosquitto files.
        ca_cert, server_cert, server_key: TLS material of the broker.
        coordinator_credentials: the coordinator's credentials YAML.
        site_credentials: site id -> its credentials YAML.
        usernames: site id -> broker username.
        new_accounts: usernames whose password was drawn by this run.
        issued: certificates (re)issued by this run (paths).
        used_mosquitto_passwd: whether ``mosquitto_passwd`` hashed the new passwords.
    """

    conf: Path
    acl: Path
    password_file: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    coordinator_credentials: Path
    site_credentials: dict[str, Path] = field(default_factory=dict)
    usernames: dict[str, str] = field(default_factory=dict)
    new_accounts: tuple[str, ...] = ()
    issued: tuple[Path, ...] = ()
    used_mosquitto_passwd: bool = False


def _check_out_dir(out: Path) -> Path:
    out = Path(out).expanduser().absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{secrets.token_hex(4)}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write into {out}: {exc.strerror or exc}", source=out, field="out",
                          fix="pass --out a folder you can write (created if absent)") from exc
    return out


def _credentials(path: Path, username: str, *, rotate: bool, who: str, roles: Sequence[str] = ()
                 ) -> tuple[BrokerCredentials, dict[str, BrokerCredentials], list[str]]:
    """The account ``username`` and its role accounts (``roles``) in the credentials file ``path``: existing ones
    are kept (unless ``rotate`` or a username changed), missing ones drawn, roles no longer wanted dropped; the file
    (0600) is rewritten only when something changed. Returns ``(account, {role: account}, new usernames)``."""
    old: BrokerCredentials | None = None
    old_roles: dict[str, BrokerCredentials] = {}
    dropped = False
    if path.is_file() and not rotate:
        try:
            old = load_broker_credentials(path)
        except ConfigError:
            old = None
        if old is not None and old.username != username:
            old = None
        if old is not None:
            for role in roles:
                try:
                    old_roles[role] = load_broker_credentials(path, role=role)
                except ConfigError:
                    pass
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
            stored = raw.get("roles") if isinstance(raw, dict) else None
            dropped = isinstance(stored, dict) and bool(set(stored) - set(roles))
    fresh: list[str] = []
    creds = old
    if creds is None:
        creds = BrokerCredentials(username=username, password=secrets.token_urlsafe(32))
        fresh.append(username)
    accounts: dict[str, BrokerCredentials] = {}
    for role in roles:
        if role in old_roles:
            accounts[role] = old_roles[role]
        else:
            accounts[role] = BrokerCredentials(username=role_username(username, role),
                                               password=secrets.token_urlsafe(32))
            fresh.append(accounts[role].username)
    if fresh or dropped:
        _write_credentials(path, creds, who=who, roles=accounts)
    return creds, accounts, fresh


def _client_certs(folder: Path, username: str, roles: Mapping[str, BrokerCredentials], ca: x509.Certificate,
                  ca_key: ec.EllipticCurvePrivateKey, *, days: int) -> list[Path]:
    """Keep or issue the client certificate of an identity (``folder/client.crt``, CN = ``username``) and of each
    of its roles (``folder/roles/<role>/client.crt``, CN = the role's username); returns those (re)issued."""
    issued: list[Path] = []
    wanted = [(folder / "client.crt", folder / "client.key", username)]
    wanted += [(*role_cert_paths(folder / "client.crt", role), c.username) for role, c in sorted(roles.items())]
    for cert, key, cn in wanted:
        cert.parent.mkdir(parents=True, exist_ok=True)
        if _ensure_leaf(cert, key, ca, ca_key, common_name=cn, days=days, server_names=None):
            issued.append(cert)
    return issued


def generate_broker_config(*, registry: SiteRegistry, federation_id: str, out: str | os.PathLike[str],
                           hostnames: Sequence[str] = ("127.0.0.1", "localhost"), tls_port: int = 8883,
                           bind_address: str | None = None, loopback_port: int | None = None,
                           client_certs: bool = False, ca_cert: str | os.PathLike[str] | None = None,
                           ca_key: str | os.PathLike[str] | None = None, rotate_passwords: bool = False,
                           persistence: bool = True, broker_user: str | None = None,
                           use_mosquitto_passwd: bool = True, ca_days: int = 3650,
                           cert_days: int = 825, ingest_workers: int = 0, site_roles: Sequence[str] = SITE_ROLES,
                           max_packet_bytes: int = DEFAULT_BROKER_MAX_PACKET_BYTES) -> BrokerConfigResult:
    """Write a Mosquitto 2.x configuration for the federation's enrolled sites into ``out`` (see the module
    docstring for the files, names and semantics). Idempotent; never logs a password.

    Args:
        registry: the site registry (sites with at least one valid key get an account).
        federation_id: the federation (topic prefix ``wildfed/v1/<federation_id>/``).
        out: output folder (created if absent).
        hostnames: DNS names and IP addresses clients use to reach the broker (server certificate subjectAltName).
        tls_port: port of the TLS listener.
        bind_address: address the TLS listener binds (default: all).
        loopback_port: also a plain, authenticated listener on 127.0.0.1 at this port (local tests), or None.
        client_certs: require client certificates on the TLS listener (CN = username) and issue one per account.
        ca_cert, ca_key: an existing CA (PEM certificate and unencrypted key) instead of a generated one.
        rotate_passwords: draw new passwords for every account (default: keep existing ones).
        persistence: keep retained messages (site status, released models) and persistent sessions with their queued messages (the
            coordinator's: what gateways publish while it is stopped, docs/service.md) across broker restarts in
            ``out/persistence/``.
        broker_user: ``user`` line of the config (the account mosquitto drops root privileges to; it must be able
            to read the key and password files); None leaves Mosquitto's default (``mosquitto``).
        use_mosquitto_passwd: hash with ``mosquitto_passwd -U`` when it is on PATH (else in Python).
        ca_days, cert_days: validity of a new CA and of new leaf certificates, days.
        ingest_workers: role accounts ``ingest-1`` .. ``ingest-<N>`` for the coordinator's ingest workers (the
            coordinator config's ``ingest_workers``).
        site_roles: role accounts of every site (default: ``detect``, for ``wildfed-edge detect --publish``).
        max_packet_bytes: the broker's ``max_packet_size`` (both configs' ``broker_max_packet_bytes`` must match).

    Returns:
        A :class:`BrokerConfigResult`.

    Raises:
        ConfigError: no site with a valid key is enrolled (field ``sites``), ``out`` cannot be written (``out``),
            a bad host name (``hostname``), bad CA files (``ca_cert``/``ca_key``), a bad port, a bad role or
            ``ingest_workers``, or ``mosquitto_passwd`` failed.
    """
    if not isinstance(ingest_workers, int) or ingest_workers < 0:
        raise ConfigError(f"ingest_workers {ingest_workers!r} is not a count", field="ingest_workers",
                          fix="use the ingest_workers of the coordinator config (0 or more)")
    coordinator_roles = ingest_worker_roles(ingest_workers)
    render_acl("", [], site_roles=site_roles)  # validates the site roles before anything is written
    names = [validate_hostname(h) for h in hostnames]
    if not names:
        raise ConfigError("no host name for the server certificate", field="hostname",
                          fix="pass --hostname once per name or address clients use, e.g. --hostname 127.0.0.1")
    for name, days in (("ca_days", ca_days), ("cert_days", cert_days)):
        if not isinstance(days, int) or days < 1:
            raise ConfigError(f"{name} {days!r} is not a positive number of days", field=name, fix="e.g. 825")
    sites = [s.site_id for s in registry.list() if registry.verification_keys(s.site_id)]
    if not sites:
        raise ConfigError("no site with a valid key is enrolled: the broker would admit only the coordinator",
                          field="sites", fix="enrol sites first (`wildfed-coordinator enrol` or `provision`), "
                          "then run broker-config again")
    root = _check_out_dir(Path(out))
    tls_dir = root / "tls"
    ca, ca_private, ca_path = _ensure_ca(tls_dir, federation_id, ca_cert=Path(ca_cert) if ca_cert else None,
                                         ca_key=Path(ca_key) if ca_key else None, days=ca_days)
    issued: list[Path] = []
    server_cert, server_key = tls_dir / "server.crt", tls_dir / "server.key"
    if _ensure_leaf(server_cert, server_key, ca, ca_private, common_name=names[0], days=cert_days,
                    server_names=names):
        issued.append(server_cert)

    accounts: dict[str, str] = {}
    new_accounts: list[str] = []
    coord_user = coordinator_username(federation_id)
    coord_dir = root / "coordinator"
    coord_creds_path = coord_dir / "broker-credentials.yaml"
    creds, roles, fresh = _credentials(coord_creds_path, coord_user, rotate=rotate_passwords,
                                       who=f"the coordinator of federation {federation_id}", roles=coordinator_roles)
    accounts[creds.username] = creds.password
    accounts.update({c.username: c.password for c in roles.values()})
    new_accounts += fresh
    if client_certs:
        issued += _client_certs(coord_dir, coord_user, roles, ca, ca_private, days=cert_days)

    site_creds: dict[str, Path] = {}
    usernames: dict[str, str] = {}
    for site_id in sites:
        user = site_username(site_id)
        site_dir = root / "sites" / site_id
        path = site_dir / "broker-credentials.yaml"
        creds, roles, fresh = _credentials(path, user, rotate=rotate_passwords, who=f"site {site_id}",
                                           roles=tuple(site_roles))
        accounts[user] = creds.password
        accounts.update({c.username: c.password for c in roles.values()})
        new_accounts += fresh
        site_creds[site_id], usernames[site_id] = path, user
        write_file_atomic(site_dir / "broker-ca.pem", ca.public_bytes(serialization.Encoding.PEM), 0o644)
        if client_certs:
            issued += _client_certs(site_dir, user, roles, ca, ca_private, days=cert_days)

    binary = shutil.which("mosquitto_passwd") if use_mosquitto_passwd else None
    password_file = root / "passwd"
    used_binary = _write_password_file(password_file, accounts, binary)
    acl = root / "acl"
    write_file_atomic(acl, render_acl(federation_id, sites, coordinator_roles=coordinator_roles,
                                      site_roles=site_roles).encode("utf-8"), 0o644)
    conf = root / "mosquitto.conf"
    persistence_dir = root / "persistence" if persistence else None
    if persistence_dir is not None:
        persistence_dir.mkdir(exist_ok=True)
    text = render_mosquitto_conf(password_file=password_file, acl_file=acl, cafile=ca_path, certfile=server_cert,
                                 keyfile=server_key, tls_port=tls_port, bind_address=bind_address,
                                 client_certs=client_certs, loopback_port=loopback_port,
                                 persistence_dir=persistence_dir, broker_user=broker_user,
                                 federation_id=federation_id, max_packet_bytes=max_packet_bytes)
    write_file_atomic(conf, text.encode("utf-8"), 0o644)
    return BrokerConfigResult(conf=conf, acl=acl, password_file=password_file, ca_cert=ca_path,
                              server_cert=server_cert, server_key=server_key, coordinator_credentials=coord_creds_path,
                              site_credentials=site_creds, usernames=usernames, new_accounts=tuple(new_accounts),
                              issued=tuple(issued), used_mosquitto_passwd=used_binary)
