"""``wildfed-coordinator``: the operator's command line (typer + rich).

Commands::

    wildfed-coordinator init DIR --federation-id ID     config + coordinator key pair (0600) + database
    wildfed-coordinator enrol SITE --public-key FILE [--metadata JSON]
    wildfed-coordinator status                          rounds, accepted updates, rejections by reason
    wildfed-coordinator budget                          site x IUCN category: epsilon spent vs budget, halted
    wildfed-coordinator run   (alias: serve)            run the configured rounds with a progress bar
    wildfed-coordinator demo ...                        the whole-federation demo (coordinator.experiments.demo)

Every command but ``init`` and ``demo`` reads ``--config`` (default ``$WILDFED_COORDINATOR_CONFIG`` or
``./coordinator.yaml``). User errors (:class:`shared.errors.WildFedError`) print one red line naming the file, field
and fix, and exit with status 2.
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.errors import ConfigError, WildFedError
from shared.keys import generate_signing_key, save_private_key, save_public_key

from coordinator.config import CoordinatorConfig, config_from_dict, load_config, save_config
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.service import Coordinator, budget_rows, status_report
from coordinator.storage import Store

__all__ = ["app"]

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
            err_console.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(code=2) from exc

    return wrapper  # type: ignore[return-value]


def _open_state(config: CoordinatorConfig) -> tuple[Store, SiteRegistry, PrivacyLedger]:
    store = Store(config.database_url or "", config.data_dir)
    return store, SiteRegistry(store), PrivacyLedger(store, target_delta=config.target_delta,
                                                     accountant=config.accountant)


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
    console.print(f"[green]initialised[/] federation [bold]{federation_id}[/] in {directory.resolve()}")
    console.print(f"  config      {cfg_path}")
    console.print(f"  public key  {resolved.public_key_path} (give this to gateways)")
    console.print(f"  database    {resolved.database_url}")


@app.command()
@_friendly
def enrol(site_id: str = typer.Argument(..., help="site id (letters, digits, _.-)"),
          public_key: Path = typer.Option(..., "--public-key", help="the site's Ed25519 public key PEM file"),
          metadata: str = typer.Option("{}", "--metadata", help='public metadata JSON, e.g. {"num_examples": 500}'),
          config: Path = _config_option()) -> None:
    """Enrol a site with its public key and public metadata."""
    cfg = load_config(config)
    try:
        meta = json.loads(metadata)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--metadata is not JSON: {exc}", field="metadata",
                          fix='quote it for the shell: --metadata \'{"num_examples": 500}\'') from exc
    if not isinstance(meta, dict):
        raise ConfigError("--metadata must be a JSON object", field="metadata", fix='use {"key": value, ...}')
    if not public_key.is_file():
        raise ConfigError("public key file not found", source=public_key, field="public_key",
                          fix="pass the .pub file the gateway wrote")
    store, registry, _ = _open_state(cfg)
    try:
        site = registry.enrol(site_id, public_key.read_text(), meta)
    finally:
        store.dispose()
    console.print(f"[green]enrolled[/] {site.site_id} (key {site.fingerprint[:16]})")


@app.command()
@_friendly
def status(config: Path = _config_option()) -> None:
    """Rounds, accepted updates, and rejections counted by reason."""
    cfg = load_config(config)
    store, registry, _ = _open_state(cfg)
    try:
        rep = status_report(store, registry)
    finally:
        store.dispose()
    console.print(f"federation [bold]{cfg.federation_id}[/]: {rep.sites} site(s), {len(rep.rounds)} round(s), "
                  f"{rep.accepted} accepted update(s), model {(rep.model_hash or '-')[:12]}")
    table = Table(title="rounds")
    for col in ("round", "status", "accepted", "new model"):
        table.add_column(col)
    for r, st, n, h in rep.rounds:
        table.add_row(str(r), st, str(n), (h or "-")[:12])
    console.print(table)
    rej = Table(title="rejections by reason")
    rej.add_column("reason")
    rej.add_column("count", justify="right")
    for reason, n in sorted(rep.rejections.items()):
        rej.add_row(reason, str(n))
    if not rep.rejections:
        rej.add_row("(none)", "0")
    console.print(rej)


@app.command()
@_friendly
def budget(config: Path = _config_option()) -> None:
    """Privacy budget per site and IUCN category: epsilon spent (ledger, all steps) vs budget, halted."""
    cfg = load_config(config)
    store, registry, ledger = _open_state(cfg)
    try:
        rows = budget_rows(cfg, registry, ledger)
    finally:
        store.dispose()
    if cfg.privacy == "none":
        console.print("[yellow]privacy is 'none' in this config: updates carry no DP guarantee[/]")
    table = Table(title=f"epsilon spent vs budget (delta={cfg.target_delta:g}, accountant={cfg.accountant})")
    table.add_column("site")
    table.add_column("category")
    table.add_column("spent", justify="right")
    table.add_column("budget", justify="right")
    table.add_column("used", justify="right")
    table.add_column("halted")
    for r in rows:
        used = r.spent / r.budget if r.budget > 0 else float("inf")
        colour = "red" if r.halted else ("yellow" if used > 0.8 else "green")
        table.add_row(r.site_id, r.category.value, f"{r.spent:.4f}", f"{r.budget:.4f}",
                      f"[{colour}]{used:.0%}[/]", "[red]yes[/]" if r.halted else "no")
    console.print(table)


def _run(config: Path, rounds: int | None) -> None:
    cfg = load_config(config)
    coord = Coordinator(cfg)
    try:
        recovered = coord.start()
        for r in recovered:
            console.print(f"recovered round {r.round}: {r.status}")
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


app.command("serve", help="Alias of `run`.")(run)


@app.command()
@_friendly
def demo(
    sites: int = typer.Option(8, help="gateway sites, one process each"),
    rounds: int = typer.Option(10, help="federated rounds"),
    privacy: str = typer.Option("ccdp", help="ccdp (per-IUCN-category DP-SGD) or none (non-private reference)"),
    gamma: float = typer.Option(1.0, help="CCDP steepness: eps_c = eps_anchor * (rank(c)/rank(anchor))^gamma"),
    anchor_category: str = typer.Option("VU", help="IUCN category pinned to --anchor-epsilon"),
    anchor_epsilon: float = typer.Option(1.0, help="total epsilon of the anchor category over the federation"),
    local_steps: int = typer.Option(10, help="DP-SGD steps per site per round"),
    expected_batch_size: int = typer.Option(128, help="records per step in expectation (q = B / N_site)"),
    learning_rate: float = typer.Option(0.5, help="local SGD step size"),
    clipping_norm: float = typer.Option(1.0, help="L2 clipping norm C of per-example gradients"),
    target_delta: float = typer.Option(1e-5, help="delta of every category's guarantee"),
    seed: int = typer.Option(0, help="data split, site design and model initialisation (noise stays random)"),
    broker: str | None = typer.Option(None, help="mqtt://host:port of a running broker (default: embedded amqtt)"),
    out: Path | None = typer.Option(None, help="run folder (default runs/demo-<UTC time>)"),
    centralised_epochs: int = typer.Option(0, help="also train on the pooled data for N epochs as a reference"),
    round_deadline_s: float = typer.Option(300.0, help="seconds a round waits for its sites"),
) -> None:
    """A whole federation on one machine, on real images: MQTT broker, coordinator and one gateway process per
    site; prints accuracy and epsilon per IUCN category and writes report.json + report.png."""
    from coordinator.experiments.demo import DemoSettings, run_demo

    settings = DemoSettings(sites=sites, rounds=rounds, privacy=privacy, gamma=gamma,
                            anchor_category=anchor_category.upper(), anchor_epsilon=anchor_epsilon,
                            local_steps=local_steps, expected_batch_size=expected_batch_size,
                            learning_rate=learning_rate, clipping_norm=clipping_norm, target_delta=target_delta,
                            seed=seed, broker=broker, out_dir=out, centralised_epochs=centralised_epochs,
                            round_deadline_s=round_deadline_s)
    try:
        run_demo(settings, console=console)
    except KeyboardInterrupt:
        err_console.print("[bold yellow]interrupted:[/] broker and gateway processes stopped; the run folder keeps "
                          "what was written so far")
        raise typer.Exit(code=130) from None


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
    try:
        meta = json.loads(metadata)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--metadata is not JSON: {exc}", field="metadata",
                          fix='quote it for the shell: --metadata \'{"num_examples": 500}\'') from exc
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
    console.print(f"  bundle      {result.bundle_path} (holds the site's private key: mode 0600, delete after "
                  "install)")
    console.print(f"  on the gateway: wildfed-edge install-bundle {result.bundle_path.name} --prefix /opt/wildfed "
                  f"--coordinator-fingerprint {result.coordinator_fingerprint[:32]}")


if __name__ == "__main__":  # pragma: no cover
    app()
