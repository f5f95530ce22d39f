"""``wildfed-coordinator``: the operator's command line (typer + rich).

Commands::

    wildfed-coordinator init DIR --federation-id ID     config + coordinator key pair (0600) + database
    wildfed-coordinator enrol SITE --public-key FILE [--metadata JSON]
    wildfed-coordinator rotate-key SITE --public-key FILE [--grace-hours H]   new current key; old one valid H hours
    wildfed-coordinator revoke-key SITE [--fingerprint F]                     revoke one key, or all of the site's
    wildfed-coordinator keys SITE                                             a site's keys and their validity
    wildfed-coordinator broker-config --out DIR [--hostname H ...] [--client-certs] ...
                                                        Mosquitto 2.x config, ACL, passwords and TLS material from
                                                        the registry (coordinator/broker_config.py, docs/security.md)
    wildfed-coordinator status                          rounds, accepted updates, rejections by reason, halts + why
    wildfed-coordinator budget [--accountant rdp|pld] [--plot FILE]
                                                        site x IUCN category: budget, spent, remaining, rounds left;
                                                        textbook / seed formulas beside them (comparison only)
    wildfed-coordinator run                             run the configured rounds with a progress bar
    wildfed-coordinator ingest-worker --worker-id W     one of N ingest workers (ingest_workers: N; docs/transport.md)
    wildfed-coordinator user add|list|set-role|set-password|disable|enable
                                                        web-view accounts (Argon2id; coordinator/web/auth.py)
    wildfed-coordinator import-deployments PATH [--format camtrap-dp|wildlife-insights]   deployments for the map
    wildfed-coordinator import-detections FILE --site S --deployment D [--images DIR] [--utc-offset +HH:MM]
                                                        MegaDetector batch output for the web view
    wildfed-coordinator export-camtrap-dp OUT --role R  the detections as a Camtrap DP 1.0 package, as role R sees
                                                        them (sensitive locations fuzzed for partner/public)
    wildfed-coordinator places list|lift                the web view's protected places; lift earned protection
                                                        (recorded; coordinator/web/places_cli.py)
    wildfed-coordinator serve [--host H] [--port P]    the rangers' web view (FastAPI; docs/web.md)
    wildfed-coordinator clusters show|recluster|pin     NIRA's clusters (coordinator/cli_clusters.py)

Every command but ``init`` reads ``--config`` (default ``$WILDFED_COORDINATOR_CONFIG`` or
``./coordinator.yaml``). User errors (:class:`shared.errors.WildFedError`) print one red line naming the file, field
and fix, and exit with status 2.

The laboratory's commands (the demo, the experiments, the privacy audit, the metadata checks) are ``wildfed``'s
(wildfed_sim/cli.py): they run both sides on one machine, so they are not the operator's.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.errors import ConfigError, WildFedError
from shared.keys import generate_signing_key, save_private_key, save_public_key

from coordinator.config import CoordinatorConfig, config_from_dict, load_config, save_config
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.reports import ROUNDS_LEFT_CAP, BudgetReportRow, budget_report, plot_burn_down  # noqa: F401
from coordinator.rounds import known_categories
from coordinator.service import Coordinator, status_report
from coordinator.storage import Store

__all__ = ["app", "BudgetReportRow", "budget_report", "plot_burn_down"]

app = typer.Typer(name="wildfed-coordinator", help="WildFed coordinator: federated rounds, ledger, registry.",
                  no_args_is_help=True, add_completion=False)
console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_CONFIG = "coordinator.yaml"


def _config_option() -> Any:
    return typer.Option(Path(os.environ.get("WILDFED_COORDINATOR_CONFIG", DEFAULT_CONFIG)), "--config", "-c",
                        help="coordinator YAML config")


def _friendly(fn: F) -> F:
    """Turn WildFed's typed errors into one red line and exit status 2 (anything else is a bug: traceback)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WildFedError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(code=2) from exc

    return wrapper  # type: ignore[return-value]


def _parse_utc_offset(text: str) -> Any:
    """The ``--utc-offset`` option: ``+HH:MM`` or ``-HH:MM`` (``Z`` for UTC) as a :class:`datetime.timezone`.

    Raises:
        ConfigError: not that form, or outside UTC-12:00 .. UTC+14:00.
    """
    import datetime as _dt
    import re

    value = (text or "").strip()
    if value.upper() in ("Z", "UTC"):
        return _dt.timezone.utc
    m = re.fullmatch(r"([+-])([0-9]{2}):?([0-9]{2})", value)
    fix = "give the camera clock's offset from UTC as +HH:MM or -HH:MM, e.g. --utc-offset -05:00"
    if m is None:
        raise ConfigError(f"--utc-offset {text!r} is not +HH:MM or -HH:MM", field="utc-offset", fix=fix)
    sign, hours, minutes = (-1 if m.group(1) == "-" else 1), int(m.group(2)), int(m.group(3))
    offset = sign * _dt.timedelta(hours=hours, minutes=minutes)
    if minutes >= 60 or not _dt.timedelta(hours=-12) <= offset <= _dt.timedelta(hours=14):
        raise ConfigError(f"--utc-offset {text!r} is not a UTC offset (-12:00 to +14:00, minutes below 60)",
                          field="utc-offset", fix=fix)
    return _dt.timezone(offset)


def _open_state(config: CoordinatorConfig) -> tuple[Store, SiteRegistry, PrivacyLedger]:
    store = Store(config.database_url or "", config.data_dir)
    registry = SiteRegistry(store)
    if config.public_key_path.is_file():  # no site may be enrolled with the coordinator's own key
        from shared.keys import load_public_key

        registry.reserve(load_public_key(config.public_key_path))
    return store, registry, PrivacyLedger(store, target_delta=config.target_delta, accountant=config.accountant)


def _parse_metadata(text: str) -> dict[str, Any]:
    """The ``--metadata`` option: a JSON object of public site metadata.

    Raises:
        ConfigError: not JSON, or not an object.
    """
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--metadata is not JSON: {exc}", field="metadata",
                          fix='quote it for the shell: --metadata \'{"num_examples": 500}\'') from exc
    if not isinstance(meta, dict):
        raise ConfigError("--metadata must be a JSON object", field="metadata", fix='use {"key": value, ...}')
    return meta


@app.command()
@_friendly
def init(directory: Path = typer.Argument(Path("."), help="folder for the config, keys and data"),
         federation_id: str = typer.Option(..., "--federation-id", help="federation id (letters, digits, _.-)"),
         broker_url: str = typer.Option("mqtt://127.0.0.1:1883", "--broker", help="mqtt://host:port"),
         rounds: int = typer.Option(10, help="rounds to run"),
         database_url: str | None = typer.Option(None, "--database-url", help="default: SQLite in DIR/data"),
         force: bool = typer.Option(False, help="overwrite an existing config (keys are kept)")) -> None:
    """Write DIR/coordinator.yaml, a coordinator Ed25519 key pair (private key mode 0600) and the database."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg_path = directory / DEFAULT_CONFIG
    if cfg_path.exists() and not force:
        raise ConfigError("a config already exists", source=cfg_path, fix="pass --force to overwrite it")
    config = config_from_dict({"federation_id": federation_id, "broker_url": broker_url, "rounds": rounds,
                               "data_dir": "data", "database_url": database_url,
                               "signing_key_path": "keys/coordinator.key",
                               "public_key_path": "keys/coordinator.pub"}, source="init options")
    save_config(config, cfg_path)
    resolved = load_config(cfg_path)
    if not resolved.signing_key_path.exists():
        key = generate_signing_key()
        save_private_key(key, resolved.signing_key_path)
        save_public_key(key.public_key(), resolved.public_key_path)
    store, _, _ = _open_state(resolved)
    store.dispose()
    console.print(f"[green]initialised[/] federation [bold]{escape(federation_id)}[/] in "
                  f"{escape(str(directory.resolve()))}")
    console.print(escape(f"  config      {cfg_path}"))
    console.print(escape(f"  public key  {resolved.public_key_path} (give this to gateways)"))
    console.print(escape(f"  database    {resolved.database_url}"))


@app.command()
@_friendly
def enrol(site_id: str = typer.Argument(..., help="site id (letters, digits, _.-)"),
          public_key: Path = typer.Option(..., "--public-key", help="the site's Ed25519 public key PEM file"),
          metadata: str = typer.Option("{}", "--metadata", help='public metadata JSON, e.g. {"num_examples": 500}'),
          config: Path = _config_option()) -> None:
    """Enrol a site with its public key and public metadata."""
    cfg = load_config(config)
    meta = _parse_metadata(metadata)
    if not public_key.is_file():
        raise ConfigError("public key file not found", source=public_key, field="public_key",
                          fix="pass the .pub file the gateway wrote")
    store, registry, _ = _open_state(cfg)
    try:
        site = registry.enrol(site_id, public_key.read_text(), meta)
    finally:
        store.dispose()
    console.print(f"[green]enrolled[/] {site.site_id} (key {site.fingerprint[:16]})")
    sensitive = {e.scientific_name for e in cfg.species or [] if e.iucn_category.value in ("CR", "EN")}
    listed = sorted(sensitive & {str(n) for n in meta.get("species", []) if isinstance(n, str)})
    if listed:
        console.print(f"[yellow]warning:[/] the public metadata of {site.site_id} lists CR/EN species "
                      f"{escape(str(listed))}: "
                      "species lists are public (NIRA clustering), and a threatened species' presence can locate "
                      "it; leave them out unless that is intended")


@app.command("rotate-key")
@_friendly
def rotate_key(site_id: str = typer.Argument(..., help="an enrolled site"),
               public_key: Path = typer.Option(..., "--public-key", help="the site's NEW Ed25519 public key PEM"),
               grace_hours: float = typer.Option(24.0, "--grace-hours", help="hours the old key stays valid (0: "
                                                 "ends now)"),
               config: Path = _config_option()) -> None:
    """Make a new key the site's current key; its old key keeps verifying for --grace-hours (docs/security.md)."""
    cfg = load_config(config)
    if not public_key.is_file():
        raise ConfigError("public key file not found", source=public_key, field="public_key",
                          fix="pass the new .pub file the gateway wrote (`wildfed-edge keygen`)")
    store, registry, _ = _open_state(cfg)
    try:
        key = registry.rotate_key(site_id, public_key.read_text(), grace_s=grace_hours * 3600.0)
        valid = registry.verification_keys(site_id)
    finally:
        store.dispose()
    console.print(f"[green]rotated[/] {site_id}: current key {key.fingerprint[:16]}; "
                  f"{len(valid)} key(s) valid now (old key until {grace_hours:g} h from now)")


@app.command("revoke-key")
@_friendly
def revoke_key(site_id: str = typer.Argument(..., help="an enrolled site"),
               fingerprint: str | None = typer.Option(None, "--fingerprint", help="the key to revoke (full hex or a "
                                                      "unique prefix of >= 8 characters); default: ALL the site's "
                                                      "keys"),
               config: Path = _config_option()) -> None:
    """Revoke one key of a site, or all of them, at once: messages signed with it stop verifying. A site with no
    valid key cannot send until `rotate-key` gives it a fresh one; rerun `broker-config` to remove its broker
    account too."""
    cfg = load_config(config)
    store, registry, _ = _open_state(cfg)
    try:
        revoked = registry.revoke_key(site_id, fingerprint)
        valid = registry.verification_keys(site_id)
    finally:
        store.dispose()
    console.print(f"[yellow]revoked[/] {len(revoked)} key(s) of {site_id}: "
                  f"{', '.join(f[:16] for f in revoked) or 'none left to revoke'}; {len(valid)} key(s) still valid")
    if not valid:
        err_console.print(f"[bold yellow]warning:[/] {site_id} has no valid key: it cannot send until rotated")


@app.command("keys")
@_friendly
def keys_command(site_id: str = typer.Argument(..., help="an enrolled site"),
                 config: Path = _config_option()) -> None:
    """List a site's keys: fingerprint, current or not, valid-until (grace period end), revoked-at (UTC)."""
    cfg = load_config(config)
    store, registry, _ = _open_state(cfg)
    try:
        keys = registry.keys(site_id)
        valid = {fp for fp, _ in registry.verification_keys(site_id)}
    finally:
        store.dispose()
    table = Table(title=f"keys of {site_id} (times UTC)")
    for col in ("fingerprint", "current", "valid now", "created", "valid until", "revoked at"):
        table.add_column(col, no_wrap=col == "fingerprint")
    for k in keys:
        table.add_row(k.fingerprint[:16], "yes" if k.current else "", "yes" if k.fingerprint in valid else "[red]no[/]",
                      f"{k.created_at:%Y-%m-%d %H:%M}" if k.created_at else "",
                      f"{k.valid_until:%Y-%m-%d %H:%M}" if k.valid_until else "",
                      f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "")
    console.print(table)


@app.command("broker-config")
@_friendly
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
    config: Path = _config_option(),
) -> None:
    """Write a Mosquitto 2.x config (TLS listener, no anonymous access), a per-site ACL, a password file with one
    random credential per enrolled site, and TLS material, from the registry (docs/security.md). Plain credentials
    go only to OUT/sites/<id>/broker-credentials.yaml and OUT/coordinator/broker-credentials.yaml (mode 0600)."""
    from coordinator.broker_config import coordinator_username, generate_broker_config

    cfg = load_config(config)
    store, registry, _ = _open_state(cfg)
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


@app.command()
@_friendly
def status(config: Path = _config_option()) -> None:
    """Rounds, accepted updates, rejections counted by reason, and halted categories per site with the reason."""
    cfg = load_config(config)
    store, registry, ledger = _open_state(cfg)
    try:
        rep = status_report(store, registry)
        halts = ledger.halts()
        left = [site.site_id for site in registry.list()
                if (known := known_categories(site, ledger)) and known <= ledger.halted(site.site_id)]
        site_ids = [site.site_id for site in registry.list()]
    finally:
        store.dispose()
    console.print(f"federation [bold]{escape(cfg.federation_id)}[/]: {rep.sites} site(s), {len(rep.rounds)} round(s), "
                  f"{rep.accepted} accepted update(s), model {(rep.model_hash or '-')[:12]}")
    if site_ids:
        shown = ", ".join(site_ids[:30]) + (f", ... (+{len(site_ids) - 30})" if len(site_ids) > 30 else "")
        console.print(f"enrolled sites: {shown}")
    table = Table(title="rounds")
    for col in ("round", "status", "accepted", "new model", "privacy", "note"):
        table.add_column(col, overflow="fold")
    for r, st, n, h in rep.rounds:
        mode, detail = rep.details.get(r, (None, None))
        table.add_row(str(r), escape(st), str(n), (h or "-")[:12], escape(mode or "-"), escape(detail or ""))
    console.print(table)
    if cfg.strategy.kind == "nira":
        console.print("strategy NIRA: see `wildfed-coordinator clusters show` for the clusters and their changes")
    rej = Table(title="rejections by reason")
    rej.add_column("reason")
    rej.add_column("count", justify="right")
    for reason, n in sorted(rep.rejections.items()):
        rej.add_row(escape(reason), str(n))
    if not rep.rejections:
        rej.add_row("(none)", "0")
    console.print(rej)
    hal = Table(title="halted categories (records no longer sampled)")
    for col in ("site", "category", "from round", "why"):
        hal.add_column(col, overflow="fold")
    for h in halts:
        hal.add_row(h.site_id, h.category.value, str(h.round), escape(h.reason or "(no reason recorded)"))
    if not halts:
        hal.add_row("(none)", "-", "-", "-")
    console.print(hal)
    for site_id in left:
        console.print(f"[red]site {site_id} has every category halted: it is no longer selected[/]")


@app.command()
@_friendly
def budget(config: Path = _config_option(),
           accountant: str | None = typer.Option(None, "--accountant", help="rdp or pld (default: the config's)"),
           plot: Path | None = typer.Option(None, "--plot", help="write a burn-down PNG (spent per round per "
                                            "category vs budget) to this file")) -> None:
    """Privacy budget per site and IUCN category: budget, epsilon spent (ledger, all steps), remaining, rounds left
    at the current rate; beside it, for comparison only, the textbook Gaussian noise and the seed's bound."""
    cfg = load_config(config)
    acc = accountant or cfg.accountant
    if acc not in ("rdp", "pld"):
        raise ConfigError(f"unknown accountant {acc!r}", field="accountant", fix="use --accountant rdp or pld")
    store, registry, ledger = _open_state(cfg)
    try:
        with console.status(f"composing the ledger with the {acc} accountant"):
            rows = budget_report(cfg, registry, ledger, acc)  # type: ignore[arg-type]
            if plot is not None:
                plot_burn_down(cfg, ledger, acc, plot)  # type: ignore[arg-type]
    finally:
        store.dispose()
    if cfg.privacy == "none":
        console.print("[yellow]privacy is 'none' in this config: updates carry no DP guarantee[/]")
    table = Table(title=f"privacy budget (epsilon per record, delta={cfg.target_delta:g}, accountant={acc})")
    for col, just in (("site", "left"), ("category", "left"), ("budget", "right"), ("spent", "right"),
                      ("remaining", "right"), ("used", "right"), ("rounds left", "right"), ("halted", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        used = r.spent / r.budget if r.budget > 0 else float("inf")
        colour = "red" if r.halted else ("yellow" if used > 0.8 else "green")
        left = ("-" if r.rounds_left is None else
                f">={ROUNDS_LEFT_CAP}" if r.rounds_left >= ROUNDS_LEFT_CAP else str(r.rounds_left))
        table.add_row(r.site_id, r.category.value, f"{r.budget:.4f}", f"{r.spent:.4f}", f"{r.remaining:.4f}",
                      f"[{colour}]{used:.0%}[/]", left, "[red]yes[/]" if r.halted else "no")
    console.print(table)
    if acc != cfg.accountant:
        console.print(f"[yellow]note: halting uses the config's accountant ({cfg.accountant}); spent and rounds left "
                      f"above are what {acc} gives[/]")
    cmp_ = Table(title="for comparison only: never used to calibrate, halt, or claim a guarantee",
                 caption="z calibrated: the site's last event's noise multiplier (dp-accounting). textbook z = "
                         "sqrt(2 ln(1.25/δ))/ε_budget: one Gaussian release, holds only for ε < 1. seed's loose "
                         "bound: q sqrt(2 T ln(1/δ))/z (Abadi et al. Thm 1 without its constant; not a guarantee).")
    for col in ("site", "category", "eps RDP", "seed's loose bound", "z calibrated", "textbook z"):
        cmp_.add_column(col, justify="left" if col in ("site", "category") else "right")
    for r in rows:
        z_text = f"{r.z_textbook:.3f}" if r.textbook_valid else f"[dim]{r.z_textbook:.3f} invalid (eps >= 1)[/]"
        cmp_.add_row(r.site_id, r.category.value, f"{r.eps_rdp:.4f}", f"{r.eps_seed_bound:.4f}",
                     "-" if r.z_calibrated is None else f"{r.z_calibrated:.3f}", z_text)
    console.print(cmp_)
    if plot is not None:
        console.print(escape(f"burn-down plot written to {plot}"))


def _run(config: Path, rounds: int | None) -> None:
    cfg = load_config(config)
    coord = Coordinator(cfg)
    try:
        recovered = coord.start()
        for r in recovered:
            console.print(escape(f"recovered round {r.round}: {r.status}"))
        target = cfg.rounds if rounds is None else rounds
        first = coord.rounds.next_round()
        with Progress(TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console) as progress:
            task = progress.add_task("", total=max(0, target - first + 1))
            for res in coord.iter_rounds(target):
                progress.update(task, advance=1, description=f"round {res.round} {res.status}: "
                                f"{len(res.accepted)}/{len(res.selected)} updates, model {res.model_hash[:12]}")
    finally:
        coord.close()
    status(config)


@app.command()
@_friendly
def run(config: Path = _config_option(),
        rounds: int | None = typer.Option(None, help="run until this many rounds exist (default: config)")) -> None:
    """Run the configured rounds against the broker, with a progress bar."""
    logging.basicConfig(level=logging.WARNING)
    _run(config, rounds)




@app.command()
@_friendly
def serve(config: Path = _config_option(),
          host: str | None = typer.Option(None, help="address to listen on (default: web.host, 127.0.0.1)"),
          port: int | None = typer.Option(None, help="TCP port (default: web.port, 8080)")) -> None:
    """Serve the rangers' web view (map, detections, species, sites; budgets and rounds for operators) until
    interrupted. Make accounts first with `user add`; docs/web.md. Listens on the config's web.host and web.port
    (defaults 127.0.0.1 and 8080: http://127.0.0.1:8080/); --host and --port override them. For HTTPS set
    web.tls_cert_file and web.tls_key_file (PEM files) in the config; without them it serves plain HTTP, safe only
    on loopback or behind a TLS proxy."""
    from coordinator.web.app import serve as serve_web

    cfg = load_config(config)
    where = host or cfg.web.host
    scheme = "https" if cfg.web.tls_cert_file else "http"
    if scheme == "http" and where not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/] serving plain HTTP on {escape(where)}: passwords and session cookies "
                          "cross "
                          "the network in the clear, and browsers drop Secure cookies over HTTP. Put a TLS proxy "
                          "in front or set web.tls_cert_file and web.tls_key_file.")
    console.print(escape(f"web view on {scheme}://{where}:{port or cfg.web.port}/ (Ctrl-C stops it)"))
    serve_web(cfg, host=host, port=port)


@app.command("ingest-worker")
@_friendly
def ingest_worker(config: Path = _config_option(),
                  worker_id: str = typer.Option(..., "--worker-id", help="unique name of this worker (letters, digits, "
                                                "_.-); its partial sums are stored under it"),
                  log_level: str = typer.Option("INFO", help="DEBUG, INFO, WARNING or ERROR")) -> None:
    """Ingest updates on the MQTT shared subscription until stopped (Ctrl-C / SIGTERM): one of the N workers of a
    coordinator with `ingest_workers: N` (docs/transport.md, "Scale-out")."""
    import signal as _signal
    import threading

    from coordinator.workers import IngestWorker

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not worker_id or not all(c.isalnum() or c in "_.-" for c in worker_id) or len(worker_id) > 64:
        raise ConfigError(f"worker id {worker_id!r} is not 1-64 characters of letters, digits, _.-",
                          field="--worker-id", fix="e.g. --worker-id ingest-1")
    cfg = load_config(config)
    if cfg.ingest_workers == 0:  # the coordinator would ingest the same updates on its plain subscription
        raise ConfigError("this config has ingest_workers: 0, so the coordinator ingests every update itself; a "
                          "worker beside it would store updates the coordinator then refuses as duplicates",
                          source=config, field="ingest_workers",
                          fix="set ingest_workers to the number of workers you run, and restart the coordinator")
    worker = IngestWorker(cfg, worker_id)
    stop = threading.Event()
    _signal.signal(_signal.SIGTERM, lambda *_: stop.set())
    worker.start()
    console.print(escape(f"ingest worker {worker_id} listening (federation {cfg.federation_id}); Ctrl-C stops it"))
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()


@app.command()
@_friendly
def provision(
    site_id: str = typer.Argument(..., help="the new site's id (letters, digits, _.-)"),
    profile: str = typer.Option(..., "--profile", "-p", help="gateway profile name (firmware_configs/) or path"),
    config: Path = _config_option(),
    out: Path | None = typer.Option(None, "--out", "-o", help="bundle file (default ./<SITE>.wildfed-bundle.tar)"),
    broker_ca: Path | None = typer.Option(None, "--broker-ca", help="PEM certificate of the broker's CA"),
    broker_url: str | None = typer.Option(None, "--broker-url", help="broker URL the gateway uses (default: the "
                                          "profile's, else this config's)"),
    species: Path | None = typer.Option(None, "--species", help="YAML/JSON list of the site's species rows "
                                        "(scientific_name, class_index, iucn_category)"),
    dataset: str | None = typer.Option(None, "--dataset", help="Camtrap DP folder on the gateway (default "
                                       "<profile data>/camtrap)"),
    metadata: str = typer.Option("{}", "--metadata", help='public metadata JSON, e.g. {"num_examples": 500}'),
    wheel: Path | None = typer.Option(None, "--wheel", help="a prebuilt wildfed-*.whl (default: build it)"),
    force: bool = typer.Option(False, help="overwrite an existing bundle file"),
) -> None:
    """Write a site's provisioning bundle (SDK wheel, profile, fresh key pair, coordinator key, broker CA,
    site.yaml, systemd unit) and enrol the site's public key, together or not at all."""
    import yaml

    from coordinator.provisioning import provision_site

    cfg = load_config(config)
    meta = _parse_metadata(metadata)
    rows = None
    if species is not None:
        if not species.is_file():
            raise ConfigError("species file not found", source=species, field="species", fix="check the path")
        try:
            loaded = yaml.safe_load(species.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}", source=species, field="species", fix="fix the syntax") from exc
        rows = loaded.get("species") if isinstance(loaded, dict) else loaded
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError("expected a list of species rows", source=species, field="species",
                              fix="write - {scientific_name: ..., class_index: 0, iucn_category: CR} per species")
    store, _, _ = _open_state(cfg)
    try:
        with console.status("building the SDK wheel and the bundle"):
            result = provision_site(config=cfg, store=store, site_id=site_id, profile=profile,
                                    out=out or Path(f"{site_id}.wildfed-bundle.tar"), broker_ca=broker_ca,
                                    broker_url=broker_url, species=rows, dataset=dataset, metadata=meta,
                                    wheel=wheel, force=force)
    finally:
        store.dispose()
    console.print(f"[green]provisioned[/] {result.site_id} (profile {result.profile}, key {result.fingerprint[:16]})")
    console.print(escape(f"  bundle      {result.bundle_path} (holds the site's private key: mode 0600, delete after "
                         "install)"))
    if result.broker_is_loopback:
        err_console.print(f"[bold yellow]warning:[/] the gateway will connect to {escape(result.broker_url)}, its own "
                          "loopback "
                          "address; pass --broker-url mqtt://<broker host>:1883 for a gateway in the field")
    console.print(escape(f"  on the gateway: wildfed-edge install-bundle {result.bundle_path.name} --prefix "
                         f"/opt/wildfed --coordinator-fingerprint {result.coordinator_fingerprint[:32]}"))


from coordinator.cli_clusters import clusters_app  # noqa: E402 - registered last: it reuses this module's helpers

app.add_typer(clusters_app, name="clusters")

from coordinator.web.places_cli import places_app  # noqa: E402 - it reuses this module's helpers too

app.add_typer(places_app, name="places")

user_app = typer.Typer(name="user", help="Accounts of the rangers' web view: add, list, set-role, set-password, "
                       "disable, enable.",
                       no_args_is_help=True, add_completion=False)
app.add_typer(user_app, name="user")


def _accounts(config: Path):  # noqa: ANN202 - (Store, AccountStore)
    from coordinator.web.auth import AccountStore

    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    return store, AccountStore(store)


@user_app.command("add")
@_friendly
def user_add(username: str = typer.Argument(..., help="2-64 characters of a-z, 0-9, _.-"),
             role: str = typer.Option(..., "--role", help="operator, ranger (exact locations), partner or public "
                                      "(sensitive locations fuzzed)"),
             config: Path = _config_option()) -> None:
    """Create a web-view account; the password is asked twice and never echoed (Argon2id hash stored)."""
    from coordinator.web.auth import AccountError

    store, accounts = _accounts(config)  # a broken config fails before the password is asked
    try:
        if accounts.get(username) is not None:  # and so does a taken name
            raise AccountError(f"user {username!r} exists", field="username",
                               fix="choose another name, or use `user set-role` / `user set-password`")
        password = typer.prompt("password", hide_input=True, confirmation_prompt=True)
        account = accounts.create(username, password, role)
    finally:
        store.dispose()
    console.print(f"[green]created[/] {escape(account.username)} ({account.role.value})")


@user_app.command("set-password")
@_friendly
def user_set_password(username: str = typer.Argument(..., help="an existing account"),
                      config: Path = _config_option()) -> None:
    """Give an account a new password (asked twice, never echoed); its web sessions end at once."""
    from coordinator.web.auth import AccountError

    store, accounts = _accounts(config)
    try:
        if accounts.get(username) is None:
            raise AccountError(f"user {username!r} does not exist", field="username",
                               fix="list the accounts with `wildfed-coordinator user list`, or create it with "
                                   "`wildfed-coordinator user add NAME --role ROLE`")
        password = typer.prompt("new password", hide_input=True, confirmation_prompt=True)
        account = accounts.update(username, password=password)
    finally:
        store.dispose()
    console.print(f"[green]password changed[/] for {escape(account.username)}; its web sessions have ended "
                  "(log in again with the new password)")


@user_app.command("list")
@_friendly
def user_list(config: Path = _config_option()) -> None:
    """List the web-view accounts and their roles."""
    store, accounts = _accounts(config)
    try:
        rows = accounts.list()
    finally:
        store.dispose()
    table = Table(title=f"{len(rows)} account(s)")
    for col in ("user", "role", "state"):
        table.add_column(col)
    for a in rows:
        table.add_row(escape(a.username), a.role.value, "disabled" if a.disabled else "active")
    console.print(table)


def _user_update(username: str, config: Path, **change: object) -> None:
    store, accounts = _accounts(config)
    try:
        account = accounts.update(username, **change)  # type: ignore[arg-type]
    finally:
        store.dispose()
    console.print(f"[green]updated[/] {escape(account.username)}: {account.role.value}, "
                  f"{'disabled' if account.disabled else 'active'}")


@user_app.command("set-role")
@_friendly
def user_set_role(username: str = typer.Argument(...), role: str = typer.Argument(..., help="operator, ranger, "
                  "partner or public"), config: Path = _config_option()) -> None:
    """Change an account's role."""
    _user_update(username, config, role=role)


@user_app.command("disable")
@_friendly
def user_disable(username: str = typer.Argument(...), config: Path = _config_option()) -> None:
    """Disable an account (it can no longer log in; nothing is deleted)."""
    _user_update(username, config, disabled=True)


@app.command("import-deployments")
@_friendly
def import_deployments(path: Path = typer.Argument(..., help="a Camtrap DP package folder or a Wildlife Insights "
                                                   "project export folder"),
                       source: str = typer.Option("camtrap-dp", "--format", help="camtrap-dp or wildlife-insights"),
                       config: Path = _config_option()) -> None:
    """Import deployments (coordinates and the IUCN categories of what they recorded, from the config's species
    table) for the web view's map; sensitive ones are shown fuzzed to partners (docs/location-privacy.md)."""
    from coordinator.web.deployments import (import_camtrap_dp, import_wildlife_insights, species_table_categories,
                                             unknown_species)

    cfg = load_config(config)
    importer = {"camtrap-dp": import_camtrap_dp, "wildlife-insights": import_wildlife_insights}.get(source)
    if importer is None:
        raise ConfigError(f"format {source!r} is unknown", field="--format", fix="use camtrap-dp or wildlife-insights")
    from coordinator.web.views import policy_from_config

    category_of = species_table_categories(cfg.species)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:  # with the policy: protection the stored data earned is kept (docs/location-privacy.md)
        n = importer(store, path, category_of, policy=policy_from_config(cfg))
        # the importer's source string (coordinator.web.deployments): "<format>:<folder name>"
        unknown = unknown_species(store, category_of, source=f"{source}:{Path(path).name}")
    finally:
        store.dispose()
    console.print(f"[green]imported[/] {n} deployment(s) from {escape(str(path))}")
    if unknown:
        names = ", ".join(f"{escape(name)} ({k} deployment{'s' * (k != 1)})" for name, k in unknown.items())
        if getattr(cfg.web, "unknown_species", "protect") == "ne":
            effect = ("they count as NE (web.unknown_species: ne), so the web view shows the places that recorded "
                      "them exactly to partners and the public, until you add them")
        else:
            effect = ("the web view protects the places that recorded them (web.unknown_species: protect) until "
                      "you add them")
        err_console.print(f"[yellow]warning:[/] {len(unknown)} species {'is' if len(unknown) == 1 else 'are'} not "
                          f"in the species table; {effect} to `species:` with their IUCN category: {names}")


@user_app.command("enable")
@_friendly
def user_enable(username: str = typer.Argument(...), config: Path = _config_option()) -> None:
    """Enable a disabled account again."""
    _user_update(username, config, disabled=False)


@app.command("import-detections")
@_friendly
def import_detections(path: Path = typer.Argument(..., help="a MegaDetector batch output .json (format 1.x)"),
                      site: str = typer.Option(..., "--site", help="the enrolled site the images come from"),
                      deployment: str = typer.Option(..., "--deployment", help="the Camtrap DP deployment (camera "
                                                     "placement) of every image in the file"),
                      images: Path | None = typer.Option(None, "--images", help="the folder the detector ran on: "
                                                         "images found there are stored for the web view (never "
                                                         "those with a person or vehicle)"),
                      utc_offset: str = typer.Option("+00:00", "--utc-offset", help="the camera clock's offset from "
                                                     "UTC as +HH:MM or -HH:MM, for capture times written without "
                                                     "one (e.g. -05:00)"),
                      config: Path = _config_option()) -> None:
    """Import detections from a MegaDetector results file for the web view (coordinator/web/formats.py); the whole
    file is checked before anything is written, and re-importing it changes nothing. Import the deployment's
    coordinates with `import-deployments` too: without them the map cannot place its records and
    `export-camtrap-dp` leaves them out."""
    from coordinator.storage import DeploymentRow
    from coordinator.web.deployments import species_table_categories
    from coordinator.web.formats import import_megadetector
    from coordinator.web.views import policy_from_config

    zone = _parse_utc_offset(utc_offset)
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        with Progress(TextColumn("importing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("import", total=None)
            summary = import_megadetector(store, path, site_id=site, deployment_id=deployment, images_dir=images,
                                          category_of=species_table_categories(cfg.species), utc_offset=zone,
                                          policy=policy_from_config(cfg),
                                          progress=lambda done, total: bar.update(task, completed=done,
                                                                                  total=total))
        with store.session() as s:
            placed = s.get(DeploymentRow, deployment) is not None
    finally:
        store.dispose()
    console.print(f"[green]imported[/] {summary.images} image(s) from {escape(str(path))}: {summary.stored} new, "
                  f"{summary.replaced} replaced, {summary.unchanged} unchanged, {summary.kept_gateway} kept "
                  f"(gateway rows), {summary.duplicates} duplicate(s), {summary.failures} failure(s), "
                  f"{summary.boxes} box(es)")
    if images is not None:
        console.print(f"images: {summary.images_stored} held ({summary.images_new} new), "
                      f"{summary.images_missing} missing, {summary.images_unreadable} unreadable, "
                      f"{summary.images_withheld} withheld (person/vehicle)")
    if summary.categories:
        console.print("boxes per IUCN category: " + ", ".join(f"{k} {v}" for k, v in summary.categories.items()))
    if not placed:
        err_console.print(f"[yellow]warning:[/] deployment {escape(repr(deployment))} is not in the deployments "
                          "table: its records have no coordinates, so the map cannot place them and "
                          "export-camtrap-dp leaves them out (fix: import the deployments first: "
                          "`wildfed-coordinator import-deployments PATH`, from the Camtrap DP package or Wildlife "
                          "Insights export that lists it; the records are placed as soon as it is there)")


@app.command("export-camtrap-dp")
@_friendly
def export_camtrap_dp_command(out_dir: Path = typer.Argument(..., help="folder for the Camtrap DP package"),
                              role: str = typer.Option(..., "--role", help="operator or ranger (exact locations), "
                                                       "partner or public (sensitive locations fuzzed, their "
                                                       "times cut to dates)"),
                              config: Path = _config_option()) -> None:
    """Export the detections as a Camtrap DP 1.0 package, as the given role sees them in the web view."""
    from coordinator.web.auth import Role
    from coordinator.web.formats import export_camtrap_dp
    from coordinator.web.views import Viewer

    try:
        viewer_role = Role(role.strip().lower())
    except ValueError:
        raise ConfigError(f"role {role!r} is unknown", field="--role",
                          fix=f"use one of {[r.value for r in Role]}") from None
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        viewer = Viewer.for_config(store, viewer_role, cfg)
        with console.status("exporting"):
            package = export_camtrap_dp(viewer, out_dir)
    finally:
        store.dispose()
    console.print(f"[green]wrote[/] {escape(str(package))} (as {viewer_role.value})")
    extra = json.loads(package.read_text(encoding="utf-8")).get("wildfed", {})
    left_out, unplaced = int(extra.get("recordsLeftOut", 0)), list(extra.get("unplacedDeployments", []))
    if left_out:
        err_console.print(f"[yellow]warning:[/] {left_out} record(s) left out: their deployment(s) "
                          f"{escape(', '.join(map(str, unplaced)))} have no coordinates (Camtrap DP requires them; "
                          "fix: `wildfed-coordinator import-deployments PATH` for them, then export again)")


if __name__ == "__main__":  # pragma: no cover
    app()
