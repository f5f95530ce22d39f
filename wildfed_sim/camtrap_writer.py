"""Write one demo site's images as a Camera Trap Data Package (Camtrap DP 1.0).

Standard: Camtrap DP 1.0 (TDWG), tables as in version 1.0.2. The column order of the three tables is the standard's
(and that of the official example package, ``../shared/data/camtrap-dp-example``). What is written:

- ``datapackage.json``: profile, name, id, created, contributors, project, spatial, temporal, taxonomic, licenses,
  and the resources ``deployments`` / ``media`` / ``observations`` with their paths and their table schemas,
  which are local files (``schemas/*.json``, ``shared.camtrap_dp_schema``) so that ``frictionless validate`` checks
  the package offline, as on a gateway; ``profile`` is therefore the registered ``tabular-data-package``
  (``shared.camtrap_dp_schema.LOCAL_PACKAGE_PROFILE`` says why).
- ``deployments.csv``: one deployment per site (the site's fictional coordinates, its monitoring period, habitat).
- ``media.csv``: one PNG per image under ``media/``; ``filePath`` is ``media/<fileName>``, ``fileMediatype``
  ``image/png``, ``captureMethod`` ``activityDetection``, ``filePublic`` ``false`` (the images never leave the site).
- ``observations.csv``: one media-level observation per image (``observationLevel`` ``media``,
  ``observationType`` ``animal``, the class's ``scientificName``, ``count`` 1, ``eventStart`` = ``eventEnd`` = the
  image timestamp, ``classificationMethod`` ``human``: the dataset's labels were assigned by people).

The package is built in a temporary folder beside ``out_dir`` and renamed into place, so a reader sees either no
package or a complete one.

One record is one image (docs/privacy.md, "Unit and neighbouring relation"): the writer refuses byte-identical images
(Animal-MNIST holds 284 such pairs), which the gateway's loader would merge into one record
(``edge_sdk.data.camtrap_dp``), so that a site's image count (what the demo enrols as ``num_examples``) is exactly what
its gateway loads. :func:`distinct_images` picks the images to keep.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from shared.camtrap_dp import CAMTRAP_DP_PROFILE, DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, OBSERVATIONS_COLUMNS
from shared.camtrap_dp_schema import LOCAL_PACKAGE_PROFILE, local_resource, write_schema_files
from shared.errors import WildFedError

from .animal_mnist import PACKAGE_SPEC, SPECIES_TABLE, SpeciesTable
from .ecology import SiteSpec

__all__ = [
    "CAMTRAP_DP_PROFILE",
    "image_digest",
    "DEPLOYMENTS_COLUMNS",
    "MEDIA_COLUMNS",
    "OBSERVATIONS_COLUMNS",
    "CamtrapWriteError",
    "distinct_images",
    "write_camtrap_dp",
]

DAYS_PER_MONTH = 30.4375  # mean Gregorian month


class CamtrapWriteError(WildFedError, ValueError):
    """Bad input to :func:`write_camtrap_dp` (shapes, labels, destination); nothing was written."""


def image_digest(image: np.ndarray) -> bytes:
    """SHA-256 of an image array's bytes (C order): what makes two images "the same image" here."""
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).digest()


def distinct_images(images: np.ndarray) -> np.ndarray:
    """Indices (int64, ascending, shape (M,)) of the first of each set of byte-identical images of ``images``
    (uint8, shape (N, H, W)): the rows to keep so that no two images written are the same image. Identity is the
    SHA-256 of the array's bytes, as the gateway's loader identifies an image by its file's bytes (identical
    arrays give identical PNG files)."""
    seen: set[bytes] = set()
    keep: list[int] = []
    for i, image in enumerate(np.asarray(images)):
        digest = image_digest(image)
        if digest not in seen:
            seen.add(digest)
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def _iso(ts: datetime) -> str:
    """ISO 8601 with seconds and a UTC offset (``2024-01-31T06:12:00+00:00``), as Camtrap DP requires."""
    return ts.isoformat(timespec="seconds")


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, object]]) -> None:
    """UTF-8 CSV, LF line ends, header ``columns``; missing keys are written empty."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), lineterminator="\n", restval="")
        writer.writeheader()
        writer.writerows(rows)


def _write_pngs(media_dir: Path, names: Sequence[str], images: np.ndarray) -> None:
    """One 8-bit grayscale (mode ``L``) PNG per image; lossless, so pixels read back exactly."""
    from PIL import Image  # edge / coordinator extra; imported where it is needed

    media_dir.mkdir()
    for name, image in zip(names, images, strict=True):
        Image.fromarray(np.ascontiguousarray(image)).save(media_dir / name, format="PNG")


def _checked_inputs(out: Path, site: SiteSpec, images: np.ndarray, labels: np.ndarray, species_table: SpeciesTable,
                    source_indices: np.ndarray | None, start_time: datetime, overwrite: bool) -> np.ndarray:
    """Check :func:`write_camtrap_dp`'s arguments (its Raises, in that order) and return ``source_indices`` as an
    array (default ``0..N-1``).

    Raises:
        CamtrapWriteError: the first argument that is wrong, naming the fix.
    """
    n = images.shape[0] if images.ndim == 3 else -1
    if images.dtype != np.uint8 or images.ndim != 3 or n < 1:
        raise CamtrapWriteError(f"images must be a non-empty uint8 (N, H, W) array, got {images.dtype} {images.shape}")
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise CamtrapWriteError(f"labels must be an integer ({n},) array, got {labels.dtype} {labels.shape}")
    if labels.min() < 0 or labels.max() >= len(species_table):
        raise CamtrapWriteError(
            f"labels must lie in 0..{len(species_table) - 1} (the species table), got {labels.min()}..{labels.max()}"
        )
    if n != site.num_images:
        raise CamtrapWriteError(f"site {site.site_id} has {site.num_images} images, {n} were given")
    distinct = distinct_images(images)
    if distinct.size != n:
        first_dup = int(np.setdiff1d(np.arange(n), distinct)[0])
        raise CamtrapWriteError(
            f"{n - distinct.size} image(s) repeat an earlier image byte for byte (first: row {first_dup}); one image "
            "is one record, and the gateway would merge them, loading fewer records than the site has; fix: keep "
            "the rows distinct_images(images) returns (and the site's indices with them)")
    if source_indices is None:
        source_indices = np.arange(n, dtype=np.int64)
    source_indices = np.asarray(source_indices)
    if source_indices.shape != (n,):
        raise CamtrapWriteError(f"source_indices must have shape ({n},), got {source_indices.shape}")
    if np.unique(source_indices).size != n:
        raise CamtrapWriteError("source_indices must be unique (they name the media files)")
    if start_time.tzinfo is None or start_time.utcoffset() is None:
        raise CamtrapWriteError("start_time must be timezone-aware (Camtrap DP timestamps carry an offset); "
                                "fix: pass e.g. datetime(2024, 1, 1, tzinfo=timezone.utc)")
    if out.exists() and not overwrite:
        raise CamtrapWriteError(f"{out} already exists; fix: choose another folder or pass overwrite=True")
    return source_indices


def _deployment_row(site: SiteSpec, start: datetime, end: datetime) -> dict[str, object]:
    """The one row of ``deployments.csv``: the site's fictional deployment from ``start`` to ``end``."""
    return {
        "deploymentID": site.site_id,
        "locationID": f"loc-{site.site_id}",
        "locationName": f"{site.biome} {site.site_id}",
        "latitude": f"{site.latitude:.3f}",
        "longitude": f"{site.longitude:.3f}",
        "coordinateUncertainty": 100,
        "deploymentStart": _iso(start),
        "deploymentEnd": _iso(end),
        "setupBy": "WildFed demo",
        "cameraID": f"cam-{site.site_id}",
        "timestampIssues": "false",
        "baitUse": "false",
        "habitat": site.habitat,
        "deploymentGroups": f"biome:{site.biome}",
        "deploymentComments": "Fictional deployment: Animal-MNIST images placed by WildFed's ecological site design",
    }


def _descriptor(site: SiteSpec, species_table: SpeciesTable, labels: np.ndarray, start: datetime, end: datetime,
                seed: int) -> dict[str, object]:
    """``datapackage.json``: the local resources and schemas, the project, and the site's spatial, temporal and
    taxonomic coverage (the species of ``labels``)."""
    present = sorted({int(c) for c in labels})
    return {
        "resources": [local_resource(name) for name in ("deployments", "media", "observations")],
        "profile": LOCAL_PACKAGE_PROFILE,
        "name": f"wildfed-demo-{site.site_id}",
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"wildfed-demo/{site.site_id}/{_iso(start)}/{seed}")),
        "created": _iso(datetime.now(timezone.utc)),
        "title": f"WildFed demo camera-trap site {site.site_id} ({site.biome})",
        "description": ("Animal-MNIST silhouettes (" + PACKAGE_SPEC + ") arranged as one camera-trap deployment by "
                        "WildFed's ecological site design. Coordinates and timestamps are fictional."),
        "version": "1.0",
        "contributors": [{"title": "WildFed demo", "role": "contact"}],
        "licenses": [{"name": "MIT", "scope": "data"}, {"name": "MIT", "scope": "media"}],
        "project": {
            "title": "WildFed federated-learning demo",
            "samplingDesign": "targeted",
            "captureMethod": ["activityDetection"],
            "individualAnimals": False,
            "observationLevel": ["media"],
        },
        "coordinatePrecision": 0.001,
        "spatial": {"type": "Point", "coordinates": [round(site.longitude, 3), round(site.latitude, 3)]},
        "temporal": {"start": start.date().isoformat(), "end": end.date().isoformat()},
        "taxonomic": [
            {
                "scientificName": species_table[c].scientific_name,
                "taxonRank": "species",
                "vernacularNames": {"eng": species_table[c].common_name},
            }
            for c in present
        ],
    }


def _write_package(out: Path, file_names: Sequence[str], images: np.ndarray, deployment: dict[str, object],
                   media_rows: Sequence[dict[str, object]], observation_rows: Sequence[dict[str, object]],
                   descriptor: dict[str, object]) -> None:
    """Write the package in a temporary folder beside ``out`` and rename it into place (replacing an old ``out``
    only once the new one is complete); on any error the temporary folder is removed and ``out`` is untouched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_pngs(tmp / "media", file_names, images)
        _write_csv(tmp / "deployments.csv", DEPLOYMENTS_COLUMNS, [deployment])
        _write_csv(tmp / "media.csv", MEDIA_COLUMNS, media_rows)
        _write_csv(tmp / "observations.csv", OBSERVATIONS_COLUMNS, observation_rows)
        write_schema_files(tmp)
        (tmp / "datapackage.json").write_text(json.dumps(descriptor, indent=2) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():  # overwrite: move the old package aside, put the new one in, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "pkg")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_camtrap_dp(
    out_dir: str | os.PathLike[str],
    *,
    site: SiteSpec,
    images: np.ndarray,
    labels: np.ndarray,
    start_time: datetime,
    species_table: SpeciesTable = SPECIES_TABLE,
    source_indices: np.ndarray | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write ``site``'s images as a Camtrap DP 1.0 package at ``out_dir``, atomically.

    Args:
        out_dir: the package folder to create (its parent must exist or is created).
        site: the site (deployment ID, coordinates, habitat, monitoring months).
        images: uint8 array, shape (N, H, W), grey levels 0-255 (Animal-MNIST: H = W = 28).
        labels: integer array, shape (N,), class index of each image into ``species_table``.
        start_time: timezone-aware deployment start; the deployment ends ``site.monitoring_months`` months
            (30.4375 days each) later.
        species_table: class -> scientific name table (default: the demo's
            :data:`~wildfed_sim.animal_mnist.SPECIES_TABLE`).
        source_indices: int array, shape (N,): each image's index in the published dataset; recorded in
            ``observationTags`` as ``sourceIndex:<i>`` for traceability. Default ``0..N-1``.
        seed: seeds the image timestamps (independent uniform draws over the deployment, to the second); the
            tables list the images in timestamp order.
        overwrite: replace an existing ``out_dir`` (the old one is removed only after the new one is complete).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        CamtrapWriteError: wrong shapes or dtypes, a label outside the table, byte-identical images (see
            :func:`distinct_images`), a naive ``start_time``, or ``out_dir`` exists and ``overwrite`` is false.
            Nothing is written in these cases.
        OSError: the file system failed; the temporary folder is removed and ``out_dir`` is untouched.
    """
    out = Path(out_dir)
    images = np.asarray(images)
    labels = np.asarray(labels)
    source_indices = _checked_inputs(out, site, images, labels, species_table, source_indices, start_time,
                                     overwrite)
    n = images.shape[0]

    start = start_time.replace(microsecond=0)
    end = start + timedelta(days=site.monitoring_months * DAYS_PER_MONTH)
    span_s = int((end - start).total_seconds())
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, span_s, size=n)  # image i was taken offsets[i] seconds after the start
    order = np.argsort(offsets, kind="stable")  # tables list media chronologically, as camera exports do
    stamps = [_iso(start + timedelta(seconds=int(offsets[i]))) for i in order]
    media_ids = [f"{site.site_id}-{int(source_indices[i]):05d}" for i in order]
    file_names = [f"{m}.png" for m in media_ids]
    entries = [species_table[int(labels[i])] for i in order]
    images = images[order]
    source_indices = source_indices[order]

    deployment = _deployment_row(site, start, end)
    media_rows = [
        {
            "mediaID": m, "deploymentID": site.site_id, "captureMethod": "activityDetection", "timestamp": ts,
            "filePath": f"media/{f}", "filePublic": "false", "fileName": f, "fileMediatype": "image/png",
        }
        for m, f, ts in zip(media_ids, file_names, stamps, strict=True)
    ]
    observation_rows = [
        {
            "observationID": f"{m}_1", "deploymentID": site.site_id, "mediaID": m, "eventStart": ts, "eventEnd": ts,
            "observationLevel": "media", "observationType": "animal", "scientificName": e.scientific_name,
            "count": 1, "classificationMethod": "human", "classifiedBy": f"{PACKAGE_SPEC} labels",
            "observationTags": f"datasetClass:{e.class_name} | sourceIndex:{int(i)}",
        }
        for m, ts, e, i in zip(media_ids, stamps, entries, source_indices, strict=True)
    ]
    descriptor = _descriptor(site, species_table, labels, start, end, seed)

    _write_package(out, file_names, images, deployment, media_rows, observation_rows, descriptor)
    return out
