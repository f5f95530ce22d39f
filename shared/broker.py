"""What both MQTT clients (gateway and coordinator) need to reach a secured broker: the credentials file that
``wildfed-coordinator broker-config`` writes, and the client TLS context (docs/security.md).

Both sides read these from their own config; keeping one implementation here means the gateway and the coordinator
refuse the same bad files with the same messages. Nothing here imports paho.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import yaml

from shared.errors import ConfigError

__all__ = ["BrokerCredentials", "load_broker_credentials", "tls_context", "check_broker_fields", "check_client_options", "site_username",
           "coordinator_username"]


def site_username(site_id: str) -> str:
    """The broker username of a site: ``site-<site_id>`` (also the CN of its client certificate). The prefixes keep
    a site id from ever being the coordinator's username."""
    return f"site-{site_id}"


def coordinator_username(federation_id: str) -> str:
    """The broker username of the federation's coordinator: ``coordinator-<federation_id>``."""
    return f"coordinator-{federation_id}"


@dataclass(frozen=True)
class BrokerCredentials:
    """An MQTT username and password (a secret: ``repr`` hides the password)."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"BrokerCredentials(username={self.username!r}, password=<hidden>)"


def load_broker_credentials(path: str | os.PathLike[str]) -> BrokerCredentials:
    """Read a credentials YAML file ``{username: ..., password: ...}`` written by ``wildfed-coordinator
    broker-config`` (coordinator.broker_config): ``coordinator/`` or ``sites/<id>/broker-credentials.yaml``.

    Raises:
        ConfigError: missing file, readable by group/others (must be 0600), not YAML, or no non-empty username and
            password strings.
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
    return BrokerCredentials(username=raw["username"], password=raw["password"])


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
