"""``wildfed-edge detect``: detect animals and classify their species in camera-trap photos, write MegaDetector JSON
and Camtrap DP observations, and optionally publish signed detection records (docs/inference.md).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from shared.errors import WildFedError

from edge_sdk.cli_common import console
from edge_sdk.cli_common import error as _error
from edge_sdk.cli_common import setup_logging as _setup_logging

__all__ = ["detect"]


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
            from edge_sdk.uplink.site_transport import transport_from_config

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
    """How ``detect`` reads a crop's species probabilities with a site config: as the field loop does
    (:func:`edge_sdk.field.predictions.site_reader`; below the threshold a detection's species is unknown); None
    without a config (the top class)."""
    if site is None:
        return None
    from edge_sdk.field.predictions import site_reader

    return site_reader(site)  # type: ignore[arg-type]
