"""``wildfed-edge``: the gateway agent's command line (typer + rich).

Commands:
    ``run --config site.yaml``   connect to the broker and serve training tasks until interrupted.
    ``keygen --out DIR``         create the site's Ed25519 key pair (``site.key`` 0600, ``site.pub``).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from shared.errors import WildFedError
from shared.keys import generate_signing_key, key_fingerprint, save_private_key, save_public_key

__all__ = ["app"]

app = typer.Typer(help="WildFed gateway agent: trains on local camera-trap data with CCDP and uploads signed "
                       "updates.", no_args_is_help=True, add_completion=False)
console = Console(stderr=True)


def _error(message: object) -> None:
    """Print ``error: <message>`` to stderr; the message is escaped, so ``[...]`` in an exception or a path (an
    extra such as ``wildfed[torch]``) is shown, not taken for rich markup."""
    console.print(f"[bold red]error:[/] {escape(str(message))}", soft_wrap=True)  # one line, whatever the width


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, rich_tracebacks=False, show_path=False)], force=True)


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


def _detect_backbone(backbone: str | None, input_size: int | None, site: object | None) -> dict[str, object]:
    """``{"backbone", "input_size"}`` of ``detect``: the options, else the site config's (its size only with its
    backbone), else the backbone's default size.

    Raises:
        ConfigError: an unknown backbone.
    """
    from shared.models.backbone import DEFAULT_BACKBONE, get_variant

    variant = get_variant(backbone or getattr(site, "backbone", None) or DEFAULT_BACKBONE)
    if input_size is None:
        same = site is not None and getattr(site, "backbone", None) == variant.name
        input_size = site.embedding_input_size if same else variant.default_input_size  # type: ignore[union-attr]
    return {"backbone": variant.name, "input_size": input_size}


@app.command()
def detect(
    paths: Annotated[list[Path], typer.Argument(help="image files or folders (searched recursively)")],
    weights: Annotated[Optional[Path], typer.Option(help="species classifier: a global model .safetensors "
                                                         "(the federated head on the frozen backbone); default with "
                                                         "--config: the latest global model the gateway received, "
                                                         "if any; otherwise detection only")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for megadetector.json, observations.csv, "
                                                          "media.csv")] = Path("detections"),
    deployment: Annotated[Optional[str], typer.Option(help="the images' deployment: with --config its name within "
                                                            "the site (deploymentID SITE/DEPLOYMENT, as the site's "
                                                            "package and field loop name it; default the field "
                                                            "loop's default_deployment), else the deploymentID "
                                                            "(default 'default')")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="site config: species names for the "
                                                   "classifier classes, site identity and key for --publish")]
    = None,
    publish: Annotated[bool, typer.Option(help="publish every record signed to the coordinator (needs "
                                               "--config)")] = False,
    engine: Annotated[str, typer.Option(help="auto (TensorRT where present, else ONNX Runtime), tensorrt or "
                                             "ort")] = "auto",
    batch_size: Annotated[int, typer.Option(min=1, help="images per detector call")] = 8,
    confidence: Annotated[float, typer.Option(min=0.0, max=1.0, help="detection threshold")] = 0.25,
    utc_offset: Annotated[str, typer.Option(help="camera clock zone for EXIF times without one, +HH:MM")]
    = "+00:00",
    threads: Annotated[Optional[int], typer.Option(min=1, help="ONNX Runtime CPU threads per session (default: "
                                                                "cores / workers)")] = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="batches run at once on threads (default: one per "
                                                               "core on ONNX Runtime CPU without --threads, else 1)")]
    = None,
    draft: Annotated[bool, typer.Option(help="decode large JPEGs for the detector at 1/2..1/8 in the DCT (long side "
                                             ">= 640; crops always from the full decode): faster, boxes move by a "
                                             "few pixels (docs/inference.md)")]
    = False,
    input_size: Annotated[Optional[int], typer.Option(min=32, help="backbone input size in px; the size the head "
                                                                   "was trained at (default: --config's "
                                                                   "embedding_input_size, else the backbone's "
                                                                   "default size)")] = None,
    backbone: Annotated[Optional[str], typer.Option(help="frozen backbone the head was trained on: "
                                                         "efficientnet-lite0, -lite1 or -lite2 (default: --config's "
                                                         "backbone, else efficientnet-lite0)")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "WARNING",
) -> None:
    """Detect animals (YOLOX-tiny) and classify species (the federated model) in camera-trap photos; write
    MegaDetector JSON 1.4 and Camtrap DP observations, and optionally publish signed records."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from edge_sdk.config import load_site_config
    from edge_sdk.inference.records import DetectionPublisher
    from edge_sdk.inference.run import run_detection
    from shared.keys import load_private_key

    _setup_logging(log_level)
    if engine not in ("auto", "tensorrt", "ort"):
        _error(f"--engine {engine!r} (fix: use auto, tensorrt or ort)")
        raise typer.Exit(code=2)
    if publish and config is None:
        _error("--publish needs --config (fix: pass the site config YAML)")
        raise typer.Exit(code=2)
    transport = publisher = None
    try:
        site = load_site_config(config) if config is not None else None
        class_names = site.names_by_class if site is not None else None
        if weights is None and site is not None and site.task == "camera":
            from edge_sdk.config import global_model_path

            kept = global_model_path(site)
            if kept.is_file():
                weights = kept
                typer.echo(f"classifier: the latest global model this gateway received ({kept})")
        if publish and site is not None:
            from edge_sdk.uplink.mqtt import transport_from_config

            transport = transport_from_config(site, role="detect")  # its own broker account, no presence
            transport.connect()
            publisher = DetectionPublisher(transport, private_key=load_private_key(site.private_key),
                                           federation_id=site.federation_id, site_id=site.site_id)
        with Progress(TextColumn("[bold]detect"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      TextColumn("{task.fields[last]}"), console=console) as progress:
            task = progress.add_task("detect", total=None, last="")
            summary = run_detection(
                paths, out_dir=out, deployment_id=_deployment_id(deployment, site),
                weights=weights, class_names=class_names, prefer=engine, batch_size=batch_size, threads=threads,
                confidence=confidence, utc_offset=utc_offset, publisher=publisher, workers=workers, draft=draft,
                model_dir=site.model_dir if site is not None else None, prediction=_site_reading(site),
                **_detect_backbone(backbone, input_size, site),
                on_start=lambda n: progress.update(task, total=n),
                on_record=lambda r: progress.update(task, advance=1,
                                                    last=escape(f"{r.file}: {len(r.detections)}")))
    except (WildFedError, FileNotFoundError, ValueError) as exc:
        _error(exc)
        raise typer.Exit(code=2) from None
    finally:
        if transport is not None:
            transport.close()
    typer.echo(f"images: {len(summary.records)}  with detections: {summary.images_with_detections}  "
               f"unreadable: {summary.failures}")
    typer.echo(f"engines: detector {summary.detector_engine}"
               + (f", classifier {summary.classifier_engine}" if summary.classifier_engine else ""))
    for name, path in summary.files.items():
        typer.echo(f"{name}: {path}")
    statuses = Counter(d.species_status for r in summary.records for d in r.detections if d.species_status)
    if statuses and site is not None:
        typer.echo(f"species of {sum(statuses.values())} detections: {statuses['confident']} named from the site's "
                   f"table, {statuses['unexpected']} named but not in it, {statuses['unknown']} unknown (below the "
                   f"confidence threshold {site.field.confidence_threshold:g}, field.confidence_threshold in the "
                   "site config)")
    if publisher is not None:
        typer.echo(f"published: {summary.published}  failed: {summary.publish_failed}")
        if summary.publish_failed:
            raise typer.Exit(code=1)


def _deployment_id(deployment: str | None, site: object | None) -> str:
    """The Camtrap DP deploymentID of ``detect``'s records: with a site config ``SITE/DEPLOYMENT`` as the site's
    package (``wildfed-edge package``) and the field loop name it, so the coordinator places the records at the
    deployment it imported (``deployment`` given whole, with its ``/``, is kept); else ``deployment`` or
    ``"default"``."""
    if site is None:
        return deployment or "default"
    if deployment and "/" in deployment:
        return deployment
    return site.field.deployment_id(site.site_id, deployment)  # type: ignore[attr-defined]


def _site_reading(site: object | None) -> object | None:
    """How ``detect`` reads a crop's species probabilities with a site config: as the field loop does (the site's
    species as a prior, ``field.confidence_threshold``, ``field.outside_prior``; below the threshold a detection's
    species is unknown); None without a config (the top class)."""
    if site is None:
        return None
    from functools import partial

    from edge_sdk.field.predictions import read_prediction

    return partial(read_prediction, site_classes={e.class_index for e in site.species},  # type: ignore[attr-defined]
                   threshold=site.field.confidence_threshold,  # type: ignore[attr-defined]
                   outside_prior=site.field.outside_prior)  # type: ignore[attr-defined]


app.command("package")(__import__("edge_sdk.cli_package", fromlist=["package"]).package)  # docs/packaging.md
__import__("edge_sdk.cli_review", fromlist=["register"]).register(app)  # review page: docs/review.md
app.command("evaluate")(__import__("edge_sdk.cli_evaluate", fromlist=["evaluate"]).evaluate)  # docs/field-loop.md

if __name__ == "__main__":  # pragma: no cover
    app()
