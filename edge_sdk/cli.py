"""``wildfed-edge``: the gateway agent's command line (typer + rich).

Commands:
    ``run --config site.yaml``   connect to the broker and serve training tasks until interrupted.
    ``keygen --out DIR``         create the site's Ed25519 key pair (``site.key`` 0600, ``site.pub``).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from shared.errors import WildFedError
from shared.keys import generate_signing_key, key_fingerprint, save_private_key, save_public_key

from edge_sdk import cli_common as _common

__all__ = ["app"]

app = typer.Typer(help="WildFed gateway agent: trains on local camera-trap data with CCDP and uploads signed "
                       "updates.", no_args_is_help=True, add_completion=False)
console = _common.console
_error = _common.error
_setup_logging = _common.setup_logging


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="site config YAML (see edge_sdk/config.py)")],
    max_rounds: Annotated[Optional[int], typer.Option(help="stop after this many rounds (all acknowledged)")] = None,
    idle_timeout: Annotated[Optional[float], typer.Option(help="stop after this many seconds without messages")]
    = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
    ready_file: Annotated[Optional[Path], typer.Option(help="touch this file once connected and subscribed "
                                                              "(for supervisors and the demo)")] = None,
) -> None:
    """Serve training tasks for one site until interrupted (Ctrl-C or SIGTERM stops cleanly). Exit status 2: a
    configuration error (the checks of `check-config`, one line each), which restarting cannot fix. A signed SDK
    update published by the operator is installed beside this version, checked, and switched to (docs/gateways.md,
    "Updating the gateways")."""
    _setup_logging(log_level)
    from edge_sdk.agent import EdgeAgent
    from edge_sdk.preflight import check_site

    checked = check_site(config, load_dataset=False)  # the agent reads the package itself, right below
    for warning in checked.warnings:
        logging.getLogger("wildfed-edge").warning("%s", warning)
    if checked.problems:
        for field, message in checked.problems:
            _error(f"{config}: {field}: {message}")
        raise typer.Exit(code=2)
    try:
        agent = EdgeAgent.from_config(checked.config, site_config_path=config)
    except WildFedError as exc:
        _error(exc)
        raise typer.Exit(code=2) from None
    except ImportError as exc:  # a package the site's settings need is not installed: restarting cannot fix it
        _error(f"{config}: a package is missing: {exc}; fix: reinstall the site's bundle (`wildfed-edge "
               "install-bundle --force`) or install the package")
        raise typer.Exit(code=2) from None
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    try:
        agent.start()
        agent.software.report_start()  # a version on trial confirms here: it reached the broker
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.write_text(f"{agent.config.site_id}\n")
        rounds = agent.run(max_rounds=max_rounds, idle_timeout_s=idle_timeout)
    except KeyboardInterrupt:
        rounds = None
    except WildFedError as exc:
        _error(exc)
        raise typer.Exit(code=1) from None
    finally:
        agent.close()
    if agent.staged is not None:
        from edge_sdk.updates.switch import switch_to

        switch_to(agent.software, agent.staged, sys.argv[1:])  # does not return
    trained = agent.stats.get("tasks_trained", 0) if rounds is None else rounds  # interrupted: what the stats counted
    console.print(escape(f"stopped{' (interrupted)' if rounds is None else ''}; rounds trained: {trained}; "
                         f"stats: {dict(agent.stats)}"))


@app.command()
def keygen(
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for site.key and site.pub")],
    name: Annotated[str, typer.Option(help="file stem")] = "site",
    force: Annotated[bool, typer.Option(help="overwrite an existing key pair")] = False,
) -> None:
    """Create an Ed25519 key pair: ``<out>/<name>.key`` (PEM, mode 0600) and ``<out>/<name>.pub``."""
    private_path, public_path = out / f"{name}.key", out / f"{name}.pub"
    if private_path.exists() and not force:
        _error(f"{private_path} exists (fix: pass --force to replace it, which invalidates the site's enrolment)")
        raise typer.Exit(code=2)
    key = generate_signing_key()
    save_private_key(key, private_path)
    save_public_key(key.public_key(), public_path)
    typer.echo(f"private key: {private_path}\npublic key:  {public_path}\n"
               f"fingerprint: {key_fingerprint(key.public_key())}")


# -- gateway profiles, doctor and bundle installation (docs/gateways.md) ------------------------------------------
@app.command("check-config")
def check_config(
    file: Annotated[Path, typer.Argument(help="a gateway profile (firmware_configs/*.yaml) or a site config")],
    kind: Annotated[str, typer.Option(help="auto (from the keys), profile or site")] = "auto",
    schema_only: Annotated[bool, typer.Option("--schema-only", help="site config: skip the key, dataset and "
                                              "file checks")] = False,
) -> None:
    """Validate a profile or a site config and list EVERY problem with its field; exit status 2 if any. For a site
    config, every check `run` makes before it starts (profile vs this machine, backend, keys, broker files, the
    ONNX graphs, the dataset): exit 0 only when `run` would start."""
    import yaml
    from rich.table import Table

    from edge_sdk.profiles import FirmwareProfile, profile_problems

    out = Console()
    if not file.is_file():
        _error(f"{file}: file not found")
        raise typer.Exit(code=2)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        _error(f"{file}: not valid YAML: {exc}")
        raise typer.Exit(code=2) from None
    if kind == "auto":
        keys = set(data) if isinstance(data, dict) else set()
        kind = "site" if keys & {"site_id", "federation_id", "dataset", "species"} else "profile"
    if kind not in ("profile", "site"):
        _error(f"--kind must be auto, profile or site, not {kind!r}")
        raise typer.Exit(code=2)
    if kind == "profile":
        problems, warnings, dataset = profile_problems(data, FirmwareProfile, file_stem=file.stem), [], None
    else:
        from edge_sdk.preflight import check_site

        checked = check_site(file, schema_only=schema_only)
        problems, warnings, dataset = checked.problems, checked.warnings, checked.dataset
    for warning in warnings:
        out.print(f"[yellow]warning:[/] {escape(warning)}")
    if not problems:
        what = "gateway profile" if kind == "profile" else "site config"
        out.print(f"[green]OK[/] {escape(str(file))}: valid {what}"
                  + (" (run would start: every check it makes passed)" if kind == "site" and not schema_only else ""))
        if kind == "site" and not schema_only:
            from edge_sdk.cli_report import print_training_report

            print_training_report(out, file, dataset)
        return
    table = Table(title=escape(f"{file}: {len(problems)} problem(s) ({kind})"))
    table.add_column("field", style="bold")
    table.add_column("problem")
    for field, message in problems:
        table.add_row(escape(field), escape(message))
    out.print(table)
    raise typer.Exit(code=2)


@app.command()
def doctor(
    profiles_dir: Annotated[Optional[Path], typer.Option(help="folder of profile YAML files (default: the "
                                                         "shipped firmware_configs/ or $WILDFED_PROFILES_DIR)")]
    = None,
) -> None:
    """Show the training backends, inference engines and accelerators this machine has, and which gateway
    profile fits it."""
    from rich.table import Table

    from edge_sdk.doctor import detect_kind, probe_machine, rank_profiles
    from edge_sdk.profiles import available_profiles, load_profile, profiles_dir as default_dir

    out = Console()
    report = probe_machine()
    table = Table(title="this machine")
    for col in ("area", "component", "available", "detail"):
        table.add_column(col)
    for p in report.probes:
        table.add_row(p.area, escape(p.name), "[green]yes[/]" if p.available else "[red]no[/]", escape(p.detail))
    out.print(table)
    directory = profiles_dir or default_dir()
    profiles = []
    for name in available_profiles(directory):
        try:
            profiles.append(load_profile(name, directory))
        except WildFedError as exc:
            out.print(f"[yellow]skipping profile {escape(name)}:[/] {escape(str(exc))}")
    fits = rank_profiles(report, profiles)
    ptable = Table(title=escape(f"profiles ({directory}); detected hardware: {detect_kind(report).value}"))
    for col in ("profile", "kind", "fits", "why"):
        ptable.add_column(col)
    for f in fits:
        why = "; ".join(f.problems + f.warnings) or "all requirements met"
        ptable.add_row(escape(f.name), f.kind.value, "[green]yes[/]" if f.fits else "[red]no[/]", escape(why))
    out.print(ptable)
    best = next((f for f in fits if f.fits), None)
    if best is not None:
        out.print(f"recommended profile: [bold]{escape(best.name)}[/]")
    elif fits:
        closest = f"no profile fits; closest: {fits[0].name} ({'; '.join(fits[0].problems)})"
        out.print(f"[yellow]{escape(closest)}[/]")
    else:
        out.print(f"[yellow]no profiles found in {escape(str(directory))}[/]")


@app.command("install-bundle")
def install_bundle_command(
    file: Annotated[Path, typer.Argument(help="the .tar bundle from `wildfed-coordinator provision`")],
    prefix: Annotated[Path, typer.Option(help="install folder")] = Path("/opt/wildfed"),
    venv: Annotated[bool, typer.Option("--venv/--no-venv", help="create <prefix>/venv and pip-install the bundled "
                                       "wheel (--no-venv: this interpreter's SDK runs the agent)")] = True,
    system_site_packages: Annotated[bool, typer.Option("--system-site-packages", help="the venv also sees this "
                                                       "interpreter's packages (e.g. JetPack's torch)")] = False,
    no_deps: Annotated[bool, typer.Option("--no-deps", help="install the wheel alone: no index, no download")]
    = False,
    force: Annotated[bool, typer.Option(help="replace an existing install (outbox and data are kept)")] = False,
    coordinator_fingerprint: Annotated[Optional[str], typer.Option(help="expected SHA-256 fingerprint of the "
                                                                   "coordinator key (from the operator)")] = None,
    service_user: Annotated[str, typer.Option(help="User= of the systemd unit")] = "wildfed",
    find_links: Annotated[Optional[list[Path]], typer.Option("--find-links", help="a folder of wheels for the "
                                                             "training backend's dependencies: install offline "
                                                             "from it (repeatable)")] = None,
) -> None:
    """Verify a provisioning bundle (signed manifest, SHA-256 of every member, no unsafe paths) and install it
    with the profile's training backend (torch or onnxruntime-training; docs/gateways.md)."""
    from edge_sdk.bundle import install_bundle

    try:
        result = install_bundle(file, prefix=prefix, venv=venv, system_site_packages=system_site_packages,
                                no_deps=no_deps, force=force, coordinator_fingerprint=coordinator_fingerprint,
                                service_user=service_user, find_links=tuple(find_links or ()))
    except WildFedError as exc:
        _error(exc)
        raise typer.Exit(code=2) from None
    out = Console()
    out.print(f"[green]installed[/] site [bold]{escape(result.site_id)}[/] "
              + escape(f"of federation {result.federation_id} (profile {result.profile}) under {result.prefix}"))
    out.print(f"  coordinator key fingerprint {result.coordinator_fingerprint} (compare with the operator's)")
    out.print(escape(f"  start:   {result.executable} run --config {result.site_config}"))
    out.print(escape(f"  service: sudo cp {result.unit} /etc/systemd/system/ && sudo systemctl enable --now "
                     "wildfed-edge"))
    out.print(escape(f"  delete the bundle now: it holds the site's private key ({file})"))
    for warning in result.warnings:
        out.print(f"[yellow]todo:[/] {escape(warning)}")


app.command("detect")(__import__("edge_sdk.cli_detect", fromlist=["detect"]).detect)  # docs/inference.md
app.command("package")(__import__("edge_sdk.cli_package", fromlist=["package"]).package)  # docs/packaging.md
__import__("edge_sdk.cli_review", fromlist=["register"]).register(app)  # review page: docs/review.md
app.command("evaluate")(__import__("edge_sdk.cli_evaluate", fromlist=["evaluate"]).evaluate)  # docs/field-loop.md

if __name__ == "__main__":  # pragma: no cover
    app()
