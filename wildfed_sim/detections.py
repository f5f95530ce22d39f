"""The demo's closing detection run: every gateway detects and classifies real camera-trap photos and publishes
signed detection records, so that ``wildfed-coordinator serve`` shows real boxes and species right after the demo
(docs/inference.md, "Demo: real detections at the end").

:func:`run_demo_detections` does, for each site config of the run:

1. takes its share of the real photos (:func:`demo_photos`: ``../shared/data/ena24-small`` and
   ``../shared/data/camtrapr-sample`` when present, else the downscaled ENA24 subset committed in
   ``wildfed_sim/assets/ena24``), dealt round-robin so that every gateway gets some and no photo is run twice;
2. runs the gateway's own detection path, ``edge_sdk.inference.run.run_detection`` (YOLOX-tiny, then each box's
   square crop through the frozen backbone and the federated head of its cluster), writing the site's
   MegaDetector JSON and Camtrap DP observations under ``<out_dir>/<site_id>/``;
3. publishes each record sealed in a DETECTION envelope signed with the site's key (``DetectionPublisher``) over
   the site's own ``detect`` role connection to the broker (``transport_from_config(..., role="detect")``);
4. waits (with a deadline) until the coordinator's detection ingest has handled every published record, and
   reports what was stored and what was rejected.

One detector and one backbone embedder are opened for all sites (the engines are per model, not per site). A head
whose weights are not a head model (the demo still on the camera CNN) is reported and the run is detection only.
"""

from __future__ import annotations

import csv
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SHARED_DATA", "COMMITTED_ENA24", "demo_photos", "SiteDetections", "DemoDetections",
           "run_demo_detections"]

log = logging.getLogger(__name__)

#: the real photos and tables: ``$WILDFED_SHARED_DATA`` when set, else ``../shared/data`` beside the checkout
#: (development machines; a user's fresh clone has none)
SHARED_DATA = Path(os.environ.get("WILDFED_SHARED_DATA")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "data")
#: the downscaled ENA24 subset shipped with the package (see its README for source and licence)
COMMITTED_ENA24 = Path(__file__).resolve().parent / "assets" / "ena24"
_SUFFIXES = (".jpg", ".jpeg", ".png")


def demo_photos(shared_data: Path | None = None, *, camtrapr_per_folder: int = 1) -> list[Path]:
    """The real camera-trap photos of the demo's detection run, sorted by source then name.

    Args:
        shared_data: the shared data folder (default :data:`SHARED_DATA`).
        camtrapr_per_folder: photos taken from each ``Station*/<species>`` folder of ``camtrapr-sample`` (the
            first in name order; 0 for none).

    Returns:
        ``ena24-small/*.jpg`` (listed in its ``labels.csv``) and the camtrapR photos when ``shared_data`` has
        them, else the 21 committed ENA24 photos. Never empty in an installed package.
    """
    root = Path(shared_data) if shared_data is not None else SHARED_DATA
    ena24 = root / "ena24-small"
    photos: list[Path] = []
    if (ena24 / "labels.csv").is_file():
        photos += _listed(ena24)
        camtrapr = root / "camtrapr-sample"
        if camtrapr.is_dir() and camtrapr_per_folder > 0:
            folders = sorted({p.parent for p in camtrapr.rglob("*") if p.suffix.lower() in _SUFFIXES})
            for folder in folders:
                photos += sorted(p for p in folder.iterdir() if p.suffix.lower() in _SUFFIXES)[:camtrapr_per_folder]
    if not photos:
        photos = _listed(COMMITTED_ENA24)
    return photos


def _listed(folder: Path) -> list[Path]:
    with (folder / "labels.csv").open(newline="") as fh:
        names = [row["filepath"] for row in csv.DictReader(fh)]
    return sorted((folder / n for n in names if (folder / n).is_file()), key=lambda p: p.name)


@dataclass
class SiteDetections:
    """One gateway's part of the run: photos, records, publish counts, output files, the classifier used."""

    site_id: str
    photos: int = 0
    records: int = 0
    with_detections: int = 0
    published: int = 0
    publish_failed: int = 0
    classifier: str = ""
    files: dict[str, Path] = field(default_factory=dict)
    error: str = ""


@dataclass
class DemoDetections:
    """The whole run: per-site results and what the coordinator's ingest did with the published records."""

    sites: list[SiteDetections] = field(default_factory=list)
    stored: int = 0
    rejected: int = 0
    arrived: bool = False
    elapsed_s: float = 0.0

    @property
    def published(self) -> int:
        """Records published by all sites."""
        return sum(s.published for s in self.sites)


def _ingest_total(coordinator: Any) -> int:
    return int(sum(coordinator.detections.counts.values()))


def run_demo_detections(*, coordinator: Any, site_configs: Sequence[str | Path], out_dir: str | Path,
                        weights_for_site: Callable[[str], Mapping[str, np.ndarray] | None]
                        | Mapping[str, np.ndarray] | None = None,
                        class_names: Mapping[int, str] | None = None, model_round: int = 0,
                        photos: Sequence[str | Path] | None = None, prefer: str = "auto",
                        threads: int | None = None, input_size: int | None = None,
                        timeout_s: float = 60.0, console: Any = None) -> DemoDetections:
    """Detection on real photos by every demo gateway, published signed to ``coordinator`` (module docstring).

    Args:
        coordinator: the running ``coordinator.service.Coordinator`` (its ``detections`` ingest is subscribed).
        site_configs: the sites' config YAML files (identity, key, broker, species table).
        out_dir: folder for each site's output files (``<out_dir>/<site_id>/megadetector.json`` ...).
        weights_for_site: the head model each site classifies with (the latest global model of its cluster):
            one weights mapping for every site, a function of the site id, or None for detection only.
        class_names: class index -> scientific name for indices missing from a site's own species table
            (default: the coordinator config's species table when it has one).
        model_round: the round of the global model (goes into the envelope headers).
        photos: the photos to deal out (default :func:`demo_photos`).
        prefer: engine preference (``auto``, ``tensorrt``, ``ort``).
        threads: ONNX Runtime threads.
        input_size: backbone input size the head was trained at (default
            ``shared.models.backbone.DEFAULT_INPUT_SIZE``).
        timeout_s: how long to wait for the ingest to handle every published record.
        console: a rich console for progress lines (optional).

    Returns:
        :class:`DemoDetections`; a site that fails (bad config, broker refused) has ``error`` set and the others
        still run.

    Raises:
        ValueError: no site configs, or no photos.
    """
    from shared.codec import model_hash
    from shared.errors import WildFedError
    from shared.keys import load_private_key
    from shared.models.backbone import DEFAULT_INPUT_SIZE

    from edge_sdk.config import load_site_config
    from edge_sdk.inference.detector import YoloxDetector
    from edge_sdk.inference.embedder import OnnxEmbedder
    from edge_sdk.inference.records import DetectionPublisher
    from edge_sdk.inference.run import run_detection
    from edge_sdk.uplink.site_transport import transport_from_config

    t0 = time.monotonic()
    if not site_configs:
        raise ValueError("site_configs is empty: pass the demo's site config files")
    images = [Path(p) for p in (photos if photos is not None else demo_photos())]
    if not images:
        raise ValueError("no photos for the detection run (photos is empty)")
    size = int(input_size or DEFAULT_INPUT_SIZE)
    say = console.log if console is not None else log.info
    if class_names is None:
        table = getattr(getattr(coordinator, "config", None), "species", None) or ()
        class_names = {int(s.class_index): s.scientific_name for s in table}
    result = DemoDetections()
    before = _ingest_total(coordinator)
    before_counts = dict(coordinator.detections.counts)
    detector = YoloxDetector.open(prefer=prefer, threads=threads)  # type: ignore[arg-type]
    embedder = None
    share = {i: images[i::len(site_configs)] for i in range(len(site_configs))}
    for i, path in enumerate(site_configs):
        site_result = SiteDetections(site_id=Path(path).stem, photos=len(share[i]))
        result.sites.append(site_result)
        if not share[i]:
            continue
        transport = None
        try:
            site = load_site_config(path)
            site_result.site_id = site.site_id
            weights = weights_for_site(site.site_id) if callable(weights_for_site) else weights_for_site
            if weights is not None and not _is_head(weights):
                say(f"detections: {site.site_id}'s global model is not a head model (the camera CNN?): "
                    "detection only, no species")
                weights = None
            if weights is not None and embedder is None:
                embedder = OnnxEmbedder.open(size, prefer=prefer, threads=threads)  # type: ignore[arg-type]
            names = dict(class_names)
            names.update({s.class_index: s.scientific_name for s in site.species})
            transport = transport_from_config(site, role="detect")
            transport.connect()
            publisher = DetectionPublisher(transport, private_key=load_private_key(site.private_key),
                                           federation_id=site.federation_id, site_id=site.site_id,
                                           model_round=model_round,
                                           base_model_hash=model_hash(dict(weights)) if weights is not None else "")
            summary = run_detection(share[i], out_dir=Path(out_dir) / site.site_id, deployment_id=site.site_id,
                                    weights=weights, class_names=names, prefer=prefer,  # type: ignore[arg-type]
                                    threads=threads, publisher=publisher, detector=detector, input_size=size,
                                    embedder=embedder)
            site_result.records = len(summary.records)
            site_result.with_detections = summary.images_with_detections
            site_result.published, site_result.publish_failed = summary.published, summary.publish_failed
            site_result.classifier = summary.classifier_engine
            site_result.files = summary.files
        except (WildFedError, OSError, ValueError) as exc:
            site_result.error = str(exc)
            say(f"detections: {site_result.site_id} failed: {exc}")
        finally:
            if transport is not None:
                transport.close()
    result.arrived = _wait_for_ingest(coordinator, before + result.published, timeout_s)
    counts = {k: v - before_counts.get(k, 0) for k, v in coordinator.detections.counts.items()}
    result.stored = int(counts.get("stored", 0) + counts.get("replaced", 0) + counts.get("duplicate", 0))
    result.rejected = _ingest_total(coordinator) - before - result.stored
    result.elapsed_s = time.monotonic() - t0
    say(f"detections: {sum(s.records for s in result.sites)} real photos on {len(result.sites)} gateways, "
        f"{sum(s.with_detections for s in result.sites)} with animals; {result.published} signed records "
        f"published, {result.stored} stored by the coordinator, {result.rejected} rejected "
        f"({result.elapsed_s:.0f} s)" + ("" if result.arrived else f"; not all arrived within {timeout_s:.0f} s"))
    return result


def _is_head(weights: Mapping[str, np.ndarray]) -> bool:
    from shared.models.head import HeadConfig

    try:
        HeadConfig.from_weights(weights)
    except ValueError:
        return False
    return True


def _wait_for_ingest(coordinator: Any, target: int, timeout_s: float) -> bool:
    """Wait until the ingest has handled ``target`` messages in all (stored or rejected), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while _ingest_total(coordinator) < target:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        tick.wait(min(0.05, left))  # the ingest runs on the transport's thread; re-check its counter
    return True
