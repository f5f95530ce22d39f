"""The text of a Mosquitto 2.x ``mosquitto.conf`` for a federation's broker (:func:`render_mosquitto_conf`).

Message size: ``max_packet_size`` (default :data:`shared.broker.DEFAULT_BROKER_MAX_PACKET_BYTES`). Mosquitto 2.0.11
still accepts ``message_size_limit`` but says "It is recommended to replace `message_size_limit` with
`max_packet_size`" at start-up; ``max_packet_size`` also counts the MQTT header and is checked on the packet's
announced length, before the payload is read, and the sender is disconnected (``message_size_limit`` reads the
whole payload, acknowledges it and drops it silently). Gateways and the coordinator check their chunk sizes against
the same limit at start-up (``broker_max_packet_bytes`` in both configs).
"""

from __future__ import annotations

from pathlib import Path

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES
from shared.errors import ConfigError

__all__ = ["render_mosquitto_conf"]


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
