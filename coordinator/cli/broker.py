"""``wildfed-coordinator broker-config``: the Mosquitto 2.x config, ACL, passwords and TLS material from the registry
(coordinator/broker_config.py, docs/security.md).

::

    wildfed-coordinator broker-config --out DIR [--hostname H ...] [--client-certs] ...
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from coordinator.cli.common import config_option, console, friendly, open_state
from coordinator.config import load_config

__all__ = ["app"]

app = typer.Typer()


@app.command("broker-config")
@friendly
def broker_config(
    out: Path = typer.Option(..., "--out", "-o", help="output folder (created; re-running keeps the CA, "
                             "certificates and credentials)"),
    hostname: list[str] = typer.Option(["127.0.0.1", "localhost"], "--hostname", help="DNS name or IP address of "
                                       "the broker in its certificate (repeat the option)"),
    port: int = typer.Option(8883, "--port", help="TLS listener port"),
    bind: str | None = typer.Option(None, "--bind", help="address the TLS listener binds (default: all)"),
    loopback_port: int | None = typer.Option(None, "--loopback-port", help="also a plain, authenticated listener "
                                             "on 127.0.0.1:PORT (local tests and tools)"),
    client_certs: bool = typer.Option(False, "--client-certs", help="require TLS client certificates (CN = "
                                      "username) and issue one per site and for the coordinator"),
    ca_cert: Path | None = typer.Option(None, "--ca-cert", help="use this CA certificate (PEM) instead of a "
                                        "generated one (with --ca-key)"),
    ca_key: Path | None = typer.Option(None, "--ca-key", help="the unencrypted PEM key of --ca-cert"),
    rotate_passwords: bool = typer.Option(False, "--rotate-passwords", help="draw new passwords for every account "
                                          "(gateways need their new credentials file)"),
    persistence: bool = typer.Option(True, "--persistence/--no-persistence", help="keep retained status messages "
                                     "across broker restarts (OUT/persistence/)"),
    broker_user: str | None = typer.Option(None, "--broker-user", help="`user` line: account mosquitto runs as "
                                           "(must read OUT's key and password files; default mosquitto's own)"),
    mosquitto_passwd: bool = typer.Option(True, "--mosquitto-passwd/--no-mosquitto-passwd", help="hash with "
                                          "mosquitto_passwd when installed (else in Python, same $7$ format)"),
    config: Path = config_option(),
) -> None:
    """Write a Mosquitto 2.x config (TLS listener, no anonymous access), a per-site ACL, a password file with one
    random credential per enrolled site, and TLS material, from the registry (docs/security.md). Plain credentials
    go only to OUT/sites/<id>/broker-credentials.yaml and OUT/coordinator/broker-credentials.yaml (mode 0600)."""
    from coordinator.broker_config import generate_broker_config
    from shared.broker import coordinator_username

    cfg = load_config(config)
    store, registry, _ = open_state(cfg)
    try:
        result = generate_broker_config(registry=registry, federation_id=cfg.federation_id, out=out,
                                        hostnames=hostname, tls_port=port, bind_address=bind,
                                        loopback_port=loopback_port, client_certs=client_certs, ca_cert=ca_cert,
                                        ca_key=ca_key, rotate_passwords=rotate_passwords, persistence=persistence,
                                        broker_user=broker_user, use_mosquitto_passwd=mosquitto_passwd,
                                        ingest_workers=cfg.ingest_workers,
                                        max_packet_bytes=cfg.broker_max_packet_bytes)
    finally:
        store.dispose()
    table = Table(title=escape(f"broker accounts of {cfg.federation_id} ({len(result.usernames)} site(s))"))
    for col in ("site", "username", "credentials file", "password"):
        table.add_column(col)
    table.add_row("(coordinator)", coordinator_username(cfg.federation_id), escape(str(result.coordinator_credentials)),
                  "new" if coordinator_username(cfg.federation_id) in result.new_accounts else "kept")
    for site_id, user in result.usernames.items():
        table.add_row(site_id, user, escape(str(result.site_credentials[site_id])),
                      "new" if user in result.new_accounts else "kept")
    console.print(table)
    console.print("[green]written[/] " + escape(f"{result.conf} (ACL {result.acl.name}, passwords "
                                                f"{result.password_file.name}, CA {result.ca_cert}); "
                                                f"{len(result.issued)} certificate(s) issued"))
    console.print(escape(f"  start:  mosquitto -c {result.conf}   (or reload a running one with SIGHUP)"))
    if broker_user is None and hasattr(os, "geteuid") and os.geteuid() == 0:
        console.print("[yellow]note:[/] started as root, mosquitto drops to the `mosquitto` user, which cannot read "
                      f"these 0600 files: rerun with --broker-user <the account mosquitto runs as>, or `chown -R "
                      f"mosquitto {escape(str(result.conf.parent))}`")
    console.print(escape(f"  coordinator.yaml: broker_url: mqtts://{hostname[0] if hostname else 'HOST'}:{port}, "
                         f"broker_ca_file: {result.ca_cert}, broker_password_file: "
                         f"{result.coordinator_credentials}"))
    console.print("  each gateway: copy sites/<id>/broker-credentials.yaml and broker-ca.pem; in site.yaml set "
                  f"broker_url: mqtts://HOST:{port}, broker_password_file and broker_ca_file")
