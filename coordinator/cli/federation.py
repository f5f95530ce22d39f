"""``wildfed-coordinator`` commands that run the federation: ``init``, ``run``, ``service``, ``budget``,
``ingest-worker`` (``status``: :mod:`coordinator.cli.status`).

::

    wildfed-coordinator init DIR --federation-id ID     config + coordinator key pair (0600) + database
    wildfed-coordinator run                             run the configured rounds with a progress bar
    wildfed-coordinator service [--no-web] [--print-unit]
                                                        the long-lived coordinator: ingest at all times, rounds on
                                                        the schedule, the web view (coordinator/daemon.py)
    wildfed-coordinator budget [--accountant rdp|pld] [--plot FILE]
                                                        site x IUCN category: budget, spent, remaining, rounds left
                                                        (the halt check's dry run), the observers the figures hold
                                                        against (and, under distributed noise, what each faces);
                                                        textbook / seed formulas beside
    wildfed-coordinator ingest-worker --worker-id W     one of N ingest workers (ingest_workers: N; docs/transport.md)
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, save_private_key, save_public_key

from coordinator.cli.common import (DEFAULT_CONFIG, config_option, console, err_console, friendly, open_state,
                                    warn_plain_http)
from coordinator.cli.status import status
from coordinator.config import config_from_dict, load_config, save_config
from coordinator.reports import (ROUNDS_LEFT_CAP, ObserverReport, budget_report, observer_report,
                                 plot_burn_down)
from coordinator.service import Coordinator

__all__ = ["app"]

app = typer.Typer()


@app.command()
@friendly
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
                               "round_duration_s": 300.0,  # timing padding (docs/privacy.md, "Timing")
                               "data_dir": "data", "database_url": database_url,
                               "signing_key_path": "keys/coordinator.key",
                               "public_key_path": "keys/coordinator.pub"}, source="init options")
    save_config(config, cfg_path)
    resolved = load_config(cfg_path)
    if not resolved.signing_key_path.exists():
        key = generate_signing_key()
        save_private_key(key, resolved.signing_key_path)
        save_public_key(key.public_key(), resolved.public_key_path)
    store, _, _ = open_state(resolved)
    store.dispose()
    console.print(f"[green]initialised[/] federation [bold]{escape(federation_id)}[/] in "
                  f"{escape(str(directory.resolve()))}")
    console.print(escape(f"  config      {cfg_path}"))
    console.print(escape(f"  public key  {resolved.public_key_path} (give this to gateways)"))
    console.print(escape(f"  database    {resolved.database_url}"))


BUDGET_HELP = (
    "Privacy budget per site and IUCN category: budget, epsilon spent, remaining, and rounds left.\n\n"
    "Spent composes every recorded event of the ledger. Rounds left is the halt check's own dry run repeated: how "
    "many more rounds of the predicted events (every release, NIRA's noisy counts included, after the rounds whose "
    "charges can still arrive) the accountant composes within the budget; not a linear extrapolation of epsilon, "
    "and 0 exactly when the next round would halt the category.\n\n"
    "Records train in cohorts (those that joined in the same round) and retire once they have spent a category's "
    "budget, while new records join a new cohort: for such a site each row is its oldest cohort still training "
    "the category ('of cohort': the round its records joined), with the cohorts training it and those retired (a "
    "cohort opens every round, also when no record joins in it); "
    "'halted' is yes only when no cohort trains the category (a cohort's halts are in `status`); a line under the "
    "table gives the most any record has spent where a cohort no longer training the category spent more than the "
    "row's. The burn-down plot "
    "shows, after each round, the largest spend of any of a site's records.\n\n"
    "Below it, the observers the figures hold against (docs/privacy.md, 'Who the guarantee holds against'); under "
    "distributed noise, the epsilon each observer faces, from one participant to colluding ones.\n\n"
    "Beside it, for comparison only: the textbook Gaussian noise and the seed's bound (docs/privacy.md).")


def _print_retired_spend(rows: list) -> None:
    """One line naming the rows where a cohort that no longer trains the category (retired, or halted on it)
    spent more than the cohort the row shows (BudgetReportRow's ``most_spent``): there the table's spent is not
    the most any record of the site has spent."""
    more = [r for r in rows if r.most_spent > r.spent * (1 + 1e-9) + 1e-12]
    if more:
        console.print("records of cohorts no longer training a category have spent more on it than the row's cohort: "
                      + "; ".join(f"{r.site_id} {r.category.value} {r.most_spent:.4f} "
                                  f"({r.most_spent / r.budget:.0%} of {r.budget:.4f})" if r.budget > 0 else
                                  f"{r.site_id} {r.category.value} {r.most_spent:.4f}" for r in more))


@app.command(help=BUDGET_HELP)
@friendly
def budget(config: Path = config_option(),
           accountant: str | None = typer.Option(None, "--accountant", help="rdp or pld (default: the config's)"),
           plot: Path | None = typer.Option(None, "--plot", help="write a burn-down PNG (spent per round per "
                                            "category vs budget) to this file")) -> None:
    """Privacy budget per site and IUCN category (the help text is :data:`BUDGET_HELP`)."""
    cfg = load_config(config)
    acc = accountant or cfg.accountant
    if acc not in ("rdp", "pld"):
        raise ConfigError(f"unknown accountant {acc!r}", field="accountant", fix="use --accountant rdp or pld")
    store, registry, ledger = open_state(cfg)
    try:
        with console.status(f"composing the ledger with the {acc} accountant"):
            rows = budget_report(cfg, registry, ledger, acc)  # type: ignore[arg-type]
            observers = observer_report(cfg, registry, ledger, acc)  # type: ignore[arg-type]
            if plot is not None:
                plot_burn_down(cfg, ledger, acc, plot)  # type: ignore[arg-type]
    finally:
        store.dispose()
    if cfg.privacy == "none":
        console.print("[yellow]privacy is 'none' in this config: updates carry no DP guarantee[/]")
    table = Table(title=f"privacy budget (epsilon per record, delta={cfg.target_delta:g}, accountant={acc})")
    for col, just in (("site", "left"), ("category", "left"), ("budget", "right"), ("spent", "right"),
                      ("remaining", "right"), ("used", "right"), ("rounds left", "right"), ("of cohort", "right"),
                      ("cohorts training/retired", "right"), ("halted", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        used = r.spent / r.budget if r.budget > 0 else float("inf")
        colour = "red" if r.halted else ("yellow" if used > 0.8 else "green")
        left = ("-" if r.rounds_left is None else
                f">={ROUNDS_LEFT_CAP}" if r.rounds_left >= ROUNDS_LEFT_CAP else str(r.rounds_left))
        table.add_row(r.site_id, r.category.value, f"{r.budget:.4f}", f"{r.spent:.4f}", f"{r.remaining:.4f}",
                      f"[{colour}]{used:.0%}[/]", left, "-" if r.cohort is None else str(r.cohort),
                      "-" if r.cohorts_active is None else f"{r.cohorts_active}/{r.cohorts_retired}",
                      "[red]yes[/]" if r.halted else "no")
    console.print(table)
    _print_retired_spend(rows)
    if observers is not None:
        _print_observers(observers, cfg.target_delta)
    if acc != cfg.accountant:
        console.print(f"[yellow]note: halting uses the config's accountant ({cfg.accountant}); spent and rounds left "
                      f"above are what {acc} gives[/]")
    cmp_ = Table(title="for comparison only: never used to calibrate, halt, or claim a guarantee",
                 caption="z calibrated, q: the site's last event's noise multiplier (dp-accounting) and sampling "
                         "rate (CCDP samples each category at its own rate). textbook z = "
                         "sqrt(2 ln(1.25/δ))/ε_budget: one Gaussian release, holds only for ε < 1. seed's loose "
                         "bound: q sqrt(2 T ln(1/δ))/z (Abadi et al. Thm 1 without its constant; not a guarantee).")
    for col in ("site", "category", "eps RDP", "seed's loose bound", "z calibrated", "q", "textbook z"):
        cmp_.add_column(col, justify="left" if col in ("site", "category") else "right")
    for r in rows:
        z_text = f"{r.z_textbook:.3f}" if r.textbook_valid else f"[dim]{r.z_textbook:.3f} invalid (eps >= 1)[/]"
        cmp_.add_row(r.site_id, r.category.value, f"{r.eps_rdp:.4f}", f"{r.eps_seed_bound:.4f}",
                     "-" if r.z_calibrated is None else f"{r.z_calibrated:.3f}",
                     "-" if r.q_recorded is None else f"{r.q_recorded:.4g}", z_text)
    console.print(cmp_)
    if plot is not None:
        console.print(escape(f"burn-down plot written to {plot}"))


def _print_observers(report: ObserverReport, delta: float) -> None:
    """Who the budget table's figures hold against and, under distributed noise, what every observer faces."""
    console.print(escape(f"observer: {report.statement}"))
    if not report.rows:
        return
    cats = [c for c in IUCNCategory if c in report.rows[0].epsilon]
    table = Table(title=f"epsilon each observer faces (spend so far, the site that spent most per category; "
                        f"t = {report.threshold} survivors, delta={delta:g})")
    for col in ("observer", "noise left", "within the charge", *(c.value for c in cats)):
        table.add_column(col, justify="left" if col == "observer" else "right", overflow="fold")
    for r in report.rows:
        table.add_row(escape(r.observer), f"{r.noise_fraction:.3g}x", "yes" if r.charged else "[red]NO[/]",
                      *("none" if r.epsilon[c] == float("inf") else f"{r.epsilon[c]:.4f}" for c in cats))
    console.print(table)


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
                if not res.selected and res.stale:  # a buffered run's last round: no task, it folds what came late
                    progress.update(task, total=res.round - first + 1)
                line = (f"round {res.round} {res.status}: {len(res.accepted)}/{len(res.selected)} updates"
                        f"{f' + {len(res.stale)} stale' if res.stale else ''}, model {res.model_hash[:12]}")
                progress.update(task, advance=1, description=line)
                if not console.is_terminal:  # a log file gets a line per round as it closes, not a bar at the end
                    console.print(escape(line))
                    console.file.flush()
    finally:
        coord.close()
    status(config)


@app.command()
@friendly
def run(config: Path = config_option(),
        rounds: int | None = typer.Option(None, help="run until this many rounds exist (default: config)")) -> None:
    """Run the configured rounds against the broker, with a progress bar."""
    logging.basicConfig(level=logging.WARNING)
    _run(config, rounds)


#: Exit status of ``service`` when the broker or the database cannot be reached at start (sysexits.h EX_TEMPFAIL):
#: not 2, so that systemd's ``Restart=on-failure`` tries again (``RestartPreventExitStatus=2`` is for config errors).
EXIT_TEMPORARY = 75

SERVICE_HELP = (
    "Run the coordinator as one long-lived process: ingest updates, secure aggregation and detection records at all "
    "times, run rounds on the config's schedule, and serve the web view, until SIGTERM or Ctrl-C.\n\n"
    "Rounds: one every schedule.round_interval_s seconds (default a day) after the last one, none once "
    "schedule.max_rounds exist; a round that cannot run is logged with the reason and tried at the next slot. The "
    "MQTT session is persistent: what gateways published while the service was stopped is delivered when it starts. "
    "`run` and `service` share that session and refuse to run beside each other.\n\n"
    "Exit status: 0 stopped, 2 configuration error (not restarted by the unit), 75 broker or database not reachable "
    "at start (restarted). --print-unit prints the systemd unit for this config (docs/service.md).")


@app.command(help=SERVICE_HELP)
@friendly
def service(config: Path = config_option(),
            no_web: bool = typer.Option(False, "--no-web", help="do not serve the web view in this process"),
            host: str | None = typer.Option(None, help="web view address (default: web.host)"),
            port: int | None = typer.Option(None, help="web view TCP port (default: web.port)"),
            print_unit: bool = typer.Option(False, "--print-unit", help="print the systemd unit for this config "
                                            "and exit"),
            user: str | None = typer.Option(None, "--user", help="the account in the printed unit (default: "
                                            "the one running this command)"),
            log_level: str = typer.Option("INFO", help="DEBUG, INFO, WARNING or ERROR")) -> None:
    """The long-lived coordinator (the help text is :data:`SERVICE_HELP`; coordinator/daemon.py)."""
    import getpass
    import shutil
    import sys

    from coordinator.daemon import CoordinatorService, install_stop_signals, render_service_unit
    from coordinator.storage import DatabaseUnavailable
    from coordinator.transport import TransportError

    cfg = load_config(config)
    if print_unit:
        beside = Path(sys.executable).parent / "wildfed-coordinator"  # the virtual environment's own command
        exe = (str(beside) if beside.is_file() else shutil.which("wildfed-coordinator")
               or f"{sys.executable} -m coordinator.cli")
        console.print(render_service_unit(cfg, str(config), executable=exe, user=user or getpass.getuser()),
                      markup=False, highlight=False, end="", soft_wrap=True)
        return
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not no_web:
        warn_plain_http(host or cfg.web.host, cfg.web.tls_cert_file is not None)
    try:
        svc = CoordinatorService(cfg, web=not no_web, host=host, port=port)
        install_stop_signals(svc)
        svc.run()
    except (TransportError, DatabaseUnavailable) as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))} (exit {EXIT_TEMPORARY}: the unit tries again)")
        raise typer.Exit(code=EXIT_TEMPORARY) from exc


@app.command("ingest-worker")
@friendly
def ingest_worker(config: Path = config_option(),
                  worker_id: str = typer.Option(..., "--worker-id", help="unique name of this worker (letters, digits, "
                                                "_.-); its partial sums are stored under it"),
                  log_level: str = typer.Option("INFO", help="DEBUG, INFO, WARNING or ERROR")) -> None:
    """Ingest updates on the MQTT shared subscription until stopped (Ctrl-C / SIGTERM): one of the N workers of a
    coordinator with `ingest_workers: N` (docs/transport.md, "Scale-out")."""
    import signal as _signal
    import threading

    from coordinator.inbound.workers import IngestWorker

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
