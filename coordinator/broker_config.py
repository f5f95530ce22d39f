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

Which sites: every enrolled site with at least one valid key (coordinator.registry.SiteRegistry.verification_keys);
a site whose keys are all revoked loses its broker account on the next run.

Re-running is safe: the CA, the server certificate (while it matches the host names, verifies with the CA and has
more than 30 days left), the client certificates and every existing credential are kept; ``rotate_passwords=True``
draws new passwords for every account. Password hashes whose password is unchanged are kept byte for byte.

The parts, one module each: the ACL (:mod:`coordinator.broker_acl`), the password and credentials files
(:mod:`coordinator.broker_passwords`), the TLS material (:mod:`coordinator.broker_tls`) and ``mosquitto.conf``
(:mod:`coordinator.mosquitto_conf`); this module puts them together.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES, SITE_ROLES, coordinator_username, site_username
from shared.errors import ConfigError
from shared.keys import write_file_atomic

from coordinator.broker_acl import ingest_worker_roles, render_acl
from coordinator.broker_passwords import account_credentials, write_password_file
from coordinator.broker_tls import ensure_ca, ensure_leaf, issue_client_certs, validate_hostname
from coordinator.mosquitto_conf import render_mosquitto_conf
from coordinator.registry import SiteRegistry

__all__ = ["BrokerConfigResult", "generate_broker_config"]


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
    docstring for the files and names, :mod:`coordinator.broker_acl` for the ACL's semantics). Idempotent; never
    logs a password.

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
    ca, ca_private, ca_path = ensure_ca(tls_dir, federation_id, ca_cert=Path(ca_cert) if ca_cert else None,
                                         ca_key=Path(ca_key) if ca_key else None, days=ca_days)
    issued: list[Path] = []
    server_cert, server_key = tls_dir / "server.crt", tls_dir / "server.key"
    if ensure_leaf(server_cert, server_key, ca, ca_private, common_name=names[0], days=cert_days,
                    server_names=names):
        issued.append(server_cert)

    accounts: dict[str, str] = {}
    new_accounts: list[str] = []
    coord_user = coordinator_username(federation_id)
    coord_dir = root / "coordinator"
    coord_creds_path = coord_dir / "broker-credentials.yaml"
    creds, roles, fresh = account_credentials(coord_creds_path, coord_user, rotate=rotate_passwords,
                                       who=f"the coordinator of federation {federation_id}", roles=coordinator_roles)
    accounts[creds.username] = creds.password
    accounts.update({c.username: c.password for c in roles.values()})
    new_accounts += fresh
    if client_certs:
        issued += issue_client_certs(coord_dir, coord_user, roles, ca, ca_private, days=cert_days)

    site_creds: dict[str, Path] = {}
    usernames: dict[str, str] = {}
    for site_id in sites:
        user = site_username(site_id)
        site_dir = root / "sites" / site_id
        path = site_dir / "broker-credentials.yaml"
        creds, roles, fresh = account_credentials(path, user, rotate=rotate_passwords, who=f"site {site_id}",
                                           roles=tuple(site_roles))
        accounts[user] = creds.password
        accounts.update({c.username: c.password for c in roles.values()})
        new_accounts += fresh
        site_creds[site_id], usernames[site_id] = path, user
        write_file_atomic(site_dir / "broker-ca.pem", ca.public_bytes(serialization.Encoding.PEM), 0o644)
        if client_certs:
            issued += issue_client_certs(site_dir, user, roles, ca, ca_private, days=cert_days)

    binary = shutil.which("mosquitto_passwd") if use_mosquitto_passwd else None
    password_file = root / "passwd"
    used_binary = write_password_file(password_file, accounts, binary)
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
