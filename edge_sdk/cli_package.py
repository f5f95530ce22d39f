"""``wildfed-edge package OUT --site SITE --from KIND SOURCE``: a site's Camtrap DP package from its labelled photos.

KIND is ``folder`` (camtrapR species folders), ``labels`` (a labels CSV), ``timelapse`` (Timelapse 2's CSV export)
or ``megadetector`` (MegaDetector output JSON, with ``--labels CSV``). The work is ``edge_sdk.packaging``'s; this
module parses the options, shows a progress bar over the photos and a summary table, and prints validation
errors as a table. docs/packaging.md.
"""

from __future__ import annotations

import datetime as _dt
import getpass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError, WildFedError

from edge_sdk import cli_common as _common

__all__ = ["package", "KINDS", "BOX_MODES"]

KINDS = ("folder", "labels", "timelapse", "megadetector")
BOX_MODES = ("auto", "detect", "none")
console = _common.console


def _fail(message: object, code: int = 2) -> typer.Exit:
    _common.error(message)
    return typer.Exit(code=code)


def _read(kind: str, source: Path, *, labels: Path | None, images: Path | None, columns: dict, deployment: str | None,
          confidence: float | None):
    """The reader's result for ``kind`` (and the detector output's box threshold, or None)."""
    from edge_sdk import packaging

    if kind == "folder":
        return packaging.read_folder(source, deployment=deployment), None
    if kind == "labels":
        return packaging.read_labels_csv(source, images=images, deployment=deployment, **columns), None
    if kind == "timelapse":
        return packaging.read_timelapse(source, images=images, deployment=deployment,
                                        species_column=columns["species_column"],
                                        deployment_column=columns["deployment_column"]), None
    if labels is None:
        raise typer.BadParameter("--from megadetector needs --labels CSV (the species of the photos)")
    return packaging.read_megadetector(source, labels, images=images, confidence=confidence, deployment=deployment,
                                       **columns)


def _warn(message: str) -> None:
    Console(stderr=True).print(f"[bold yellow]warning:[/] {escape(message)}")


def _detector(mode: str, confidence: float | None, model_dir: Path | None = None):
    """``(boxes mode, detector or None, note)`` for ``--boxes`` on an input without boxes of its own; ``model_dir``:
    the site's graph folder (its bundle's detector), searched first."""
    if mode == "none":
        return "none", None, None
    from edge_sdk.inference.detector import CONFIDENCE_THRESHOLD, YoloxDetector

    try:
        detector = YoloxDetector.open(download=True, batch_size=1,  # the first use fetches its weights (~41 MB)
                                      confidence=CONFIDENCE_THRESHOLD if confidence is None else confidence,
                                      model_dir=model_dir)
    except (WildFedError, ImportError, OSError) as exc:
        if mode == "detect":
            raise
        reason = exc.message if isinstance(exc, ConfigError) else str(exc)
        _warn(f"no boxes: the detector cannot be fetched or opened here ({reason}). The package's labels then "
              "stand for whole photos, while detect classifies the detector's crops: train on crops by running "
              "again with --boxes detect where the detector can be fetched (or $WILDFED_YOLOX_WEIGHTS points at "
              "its weights)")
        return "none", None, "no boxes: the detector did not open (see the warning above)"
    return "detect", detector, None


def _summary_table(summary, out: Path) -> Table:
    table = Table(title=escape(f"package {out}"), show_header=True)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("photos read (labelled)", str(summary.photos))
    table.add_row("media rows (distinct photos)", str(summary.media))
    if summary.duplicates:
        table.add_row("duplicate photos (same bytes, merged)", str(summary.duplicates))
    for (kind, name), count in sorted(summary.observations.items()):
        table.add_row(escape(f"observations: {kind}" + (f" {name}" if name else "")), str(count))
    table.add_row("boxes", str(summary.boxes))
    if summary.unboxed:
        table.add_row("animal photos without a box (one row without bbox)", str(summary.unboxed))
    for source, count in sorted(summary.timestamps.items()):
        table.add_row(f"timestamps from {source}", str(count))
    for reason, count in sorted(summary.skipped.items()):
        table.add_row(escape(f"left out: {reason}"), str(count))
    return table


def _problems_table(problems) -> Table:
    table = Table(title=f"{len(problems)} validation error(s); nothing was written")
    for column in ("table", "row", "field", "message"):
        table.add_column(column)
    for p in problems[:200]:
        table.add_row(escape(p.table or "datapackage.json"), "" if p.row is None else str(p.row),
                      escape(p.field or ""), escape(p.message))
    return table


def package(
    out: Annotated[Path, typer.Argument(help="the package folder to create")],
    source: Annotated[Path, typer.Argument(help="the input: a folder (folder), a CSV (labels, timelapse) or a "
                                                "MegaDetector .json (megadetector)")],
    kind: Annotated[str, typer.Option("--from", help=f"input kind: {', '.join(KINDS)}")],
    site: Annotated[Optional[str], typer.Option(help="site id (deploymentID = SITE/DEPLOYMENT); default: the "
                                                     "--site-config's site_id")] = None,
    labels: Annotated[Optional[Path], typer.Option(help="labels CSV for --from megadetector")] = None,
    images: Annotated[Optional[Path], typer.Option(help="folder the input's file paths are relative to (default: "
                                                        "the CSV's or JSON's folder)")] = None,
    deployment: Annotated[Optional[str], typer.Option(help="deployment of photos the input gives none (default: "
                                                           "the input's folder name)")] = None,
    deployments: Annotated[Optional[Path], typer.Option(help="CSV of deployment, latitude, longitude[, "
                                                             "coordinateUncertainty]")] = None,
    species_map: Annotated[Optional[Path], typer.Option(help="CSV or YAML: label (code, common name) -> "
                                                             "scientific name")] = None,
    site_config: Annotated[Optional[Path], typer.Option(help="site.yaml: every animal species must be in its "
                                                             "species table")] = None,
    classified_by: Annotated[Optional[str], typer.Option(help="who labelled the photos (default: your user "
                                                              "name)")] = None,
    boxes: Annotated[str, typer.Option(help="auto (detect; no boxes, with a warning, where the detector cannot be "
                                            "fetched), detect (fail instead) or none; "
                                            "--from megadetector uses the file's boxes")] = "auto",
    confidence: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="box threshold (default: 0.25 for "
                                                        "detect; the file's typical threshold, else 0.25, for "
                                                        "megadetector)")] = None,
    utc_offset: Annotated[str, typer.Option(help="camera clock zone of times without one, +HH:MM")] = "+00:00",
    file_column: Annotated[Optional[str], typer.Option(help="labels CSV: the file column")] = None,
    species_column: Annotated[Optional[str], typer.Option(help="the species (label) column")] = None,
    deployment_column: Annotated[Optional[str], typer.Option(help="the deployment column")] = None,
    time_column: Annotated[Optional[str], typer.Option(help="labels CSV: the capture time column")] = None,
    force: Annotated[bool, typer.Option(help="replace an existing OUT (once the new package is complete)")] = False,
) -> None:
    """Build a site's Camtrap DP 1.0 package (validated offline with frictionless) from labelled photos."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from edge_sdk import packaging
    from edge_sdk.inference.records import parse_utc_offset
    from shared.envelope import validate_identifier

    if kind not in KINDS:
        raise _fail(f"--from {kind!r} (fix: use one of {', '.join(KINDS)})")
    if boxes not in BOX_MODES:
        raise _fail(f"--boxes {boxes!r} (fix: use one of {', '.join(BOX_MODES)})")
    try:
        zone = parse_utc_offset(utc_offset)
    except ValueError as exc:
        raise _fail(f"--utc-offset: {exc}") from None
    try:
        packaging.check_destination(out, force=force)
        site_species = config_path = model_dir = None
        if site_config is not None:
            from edge_sdk.config import load_site_config

            config = load_site_config(site_config)
            site = site or config.site_id
            site_species, config_path, model_dir = frozenset(config.species_table), site_config, config.model_dir
        if not site:
            raise _fail("--site is required (or --site-config, whose site_id is used)")
        validate_identifier(site, "--site")
        columns = dict(file_column=file_column, species_column=species_column, deployment_column=deployment_column,
                       time_column=time_column)
        read, threshold = _read(kind, source, labels=labels, images=images, columns=columns, deployment=deployment,
                                confidence=confidence)
        if kind == "megadetector":
            mode, detector, note = "file", None, f"boxes from {source.name} at confidence >= {threshold:g}"
        else:
            mode, detector, note = _detector(boxes, confidence, model_dir)
        if note:
            read.notes.append(note)
        options = packaging.PackageOptions(
            site=site, classified_by=classified_by or getpass.getuser(), boxes=mode, detector=detector,
            utc_offset=zone, species_map=packaging.load_species_map(species_map) if species_map else None,
            site_species=site_species, site_config=config_path,
            coordinates=packaging.read_coordinates(deployments) if deployments else None,
            now=_dt.datetime.now(_dt.timezone.utc))
        with Progress(TextColumn("[bold]package"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      TextColumn("{task.fields[last]}"), console=console) as progress:
            task = progress.add_task("photos", total=len(read.photos), last="")
            content = packaging.build_content(read, options, on_photo=lambda p: progress.update(
                task, advance=1, last=escape(p.path.name)))
        packaging.write_package(out, content, site=site, contributor=options.classified_by, force=force)
    except packaging.PackageValidationError as exc:
        Console().print(_problems_table(exc.problems))
        raise _fail(exc, code=1) from None
    except WildFedError as exc:
        raise _fail(exc) from None
    out_console = Console()
    out_console.print(_summary_table(content.summary, out))
    for line in content.summary.warnings:
        out_console.print(f"[yellow]warning:[/] {escape(line)}")
    out_console.print(escape(f"wrote {out} (validated: frictionless validate {out / 'datapackage.json'})"))
