"""Load a site's local dataset from a Camtrap DP 1.0 package.

Camtrap DP (TDWG, https://camtrap-dp.tdwg.org, version 1.0) is a Frictionless Data Package with three tables:
``deployments.csv``, ``media.csv`` and ``observations.csv`` (names may be overridden by ``datapackage.json``
resources ``deployments``, ``media``, ``observations``). This loader uses:

- ``observations.csv``: media-level rows (``observationLevel == "media"``): each photo's current classification
  (:mod:`edge_sdk.data.observations`: the last human verdict, or with ``train_on="machine"`` confident machine
  rows), its ``scientificName`` and its boxes (``bbox*``);
- ``media.csv``: columns ``mediaID``, ``deploymentID``, ``filePath``, ``fileName``; the image is ``filePath`` when
  that is a relative path to an existing file in the package, otherwise ``media/<fileName>`` (``filePath`` is
  usually a URL in published packages);
- ``deployments.csv``: column ``deploymentID`` (every media row must point at a known deployment).

One record = one image (the unit of privacy: one observation record/image, docs/privacy.md). An image is identified
by its file's bytes (SHA-256) as well as its path: several ``media.csv`` rows (different ``mediaID``) that resolve to
the same file, or to byte-identical files at different paths, are ONE record, with the union of their labels and
the first row's ``mediaID`` (one logged warning with the number of rows merged). Loading them as separate records
would put the same pixels in the training data twice, possibly under two IUCN categories, so that image would be
protected only by the composition of both mechanisms rather than by its category's budget. An image with several
species (counted over all the rows merged into it) is left out (``multi_species="skip"``, the default, with a
warning) or an error (``"error"``) so that a record stays in exactly one CCDP category. (Images that differ in bytes
but not in pixels, e.g. a re-encoded copy, are not detected.)

A record trains on the crops of its boxes (:attr:`LocalDataset.boxes`; the whole image when it has none), embedded
exactly as ``wildfed-edge detect`` embeds a detection (:mod:`edge_sdk.data.crops`, :mod:`edge_sdk.data.embedding`).
Pixels are read only when an embedding is computed; ``image_size`` asks for an 8-bit grayscale copy of every image
(Pillow mode ``"L"``, resized to ``image_size x image_size`` bilinear) for code that wants the pixels in memory.

The loader reads everything into memory and returns only a complete dataset; it writes nothing, so a failure
leaves nothing half-done behind.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from edge_sdk.config import SpeciesEntry
from edge_sdk.data.camtrap_files import (TABLES, file_sha256, load_grayscale, read_table, resolve_media_file,
                                         table_paths)
from edge_sdk.data.observations import Labelled, current_labels

__all__ = ["LocalDataset", "load_camtrap_dp", "normalise_species_table"]

#: Skipped and merged rows are reported here, one line each (a log record, not a Python warning: the operator
#: reads ``check-config`` and ``run`` output, where a warning would print its source file and line).
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalDataset:
    """A site's training records, in memory.

    Attributes:
        labels: int64 array (N,), model class indices from the species table.
        categories: int8 array (N,), IUCN category rank of each record's species (CR=1 .. NE=6,
            ``shared.iucn.IUCNCategory.rank``).
        media_ids: tuple of N Camtrap DP ``mediaID`` strings, in the order of the arrays.
        images: uint8 array (N, H, W), grayscale, 0..255, or None (the loader decodes pixels only when asked).
        files: the N image files (paths as loaded; empty for a dataset built in memory).
        sha256: the N SHA-256 hex digests of those files' bytes (the record's content hash; empty likewise).
        features: float32 (N, E) backbone embeddings, what the head model trains on
            (:func:`edge_sdk.data.embedding.embed_dataset`), or None before embedding.
        boxes: per record, its normalised ``(x, y, w, h)`` boxes (empty: the whole image); empty for a dataset
            built in memory.
    """

    labels: np.ndarray
    categories: np.ndarray
    media_ids: tuple[str, ...]
    images: np.ndarray | None = None
    files: tuple[str, ...] = ()
    sha256: tuple[str, ...] = ()
    features: np.ndarray | None = None
    boxes: tuple[tuple[tuple[float, float, float, float], ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.media_ids)
        if self.images is not None and (self.images.dtype != np.uint8 or self.images.ndim != 3
                                        or self.images.shape[0] != n):
            raise ValueError(f"images must be uint8 (N={n}, H, W), got {self.images.dtype} {self.images.shape}")
        if self.labels.dtype != np.int64 or self.labels.shape != (n,):
            raise ValueError(f"labels must be int64 ({n},), got {self.labels.dtype} {self.labels.shape}")
        if self.categories.dtype != np.int8 or self.categories.shape != (n,):
            raise ValueError(f"categories must be int8 ({n},), got {self.categories.dtype} {self.categories.shape}")
        for name in ("files", "sha256", "boxes"):
            if len(getattr(self, name)) not in (0, n):
                raise ValueError(f"{name} must hold 0 or {n} entries, got {len(getattr(self, name))}")
        if self.features is not None and (self.features.dtype != np.float32 or self.features.ndim != 2
                                          or self.features.shape[0] != n):
            raise ValueError(f"features must be float32 (N={n}, E), got {self.features.dtype} {self.features.shape}")

    @property
    def inputs(self) -> np.ndarray:
        """What a model trains on: :attr:`features` (float32 (N, E)) once embedded, else :attr:`images`.

        Raises:
            ValueError: neither is present.
        """
        inputs = self.features if self.features is not None else self.images
        if inputs is None:
            raise ValueError("the dataset holds neither embeddings nor images: embed it first "
                             "(edge_sdk.data.embedding.embed_dataset)")
        return inputs

    def __len__(self) -> int:
        return len(self.media_ids)

    def category_counts(self) -> dict[IUCNCategory, int]:
        """Number of records per IUCN category (private data: never release without noise)."""
        return {c: int(np.sum(self.categories == c.rank)) for c in IUCNCategory if np.any(self.categories == c.rank)}


def normalise_species_table(
    species_table: Mapping[str, SpeciesEntry | tuple[int, IUCNCategory | str]],
) -> dict[str, SpeciesEntry]:
    """Accept ``{name: SpeciesEntry}`` or ``{name: (class_index, IUCN category)}`` and return SpeciesEntry values.

    Raises:
        DatasetError: an entry is neither form, or its category/class index is invalid.
    """
    table: dict[str, SpeciesEntry] = {}
    for name, value in species_table.items():
        if isinstance(value, SpeciesEntry):
            if value.scientific_name != name:
                raise DatasetError(
                    f"species table key {name!r} differs from its entry's scientific_name {value.scientific_name!r}",
                    field="species",
                    fix="use the scientific name as the key",
                )
            table[name] = value
            continue
        try:
            class_index, category = value
            table[name] = SpeciesEntry(
                scientific_name=name, class_index=int(class_index), iucn_category=IUCNCategory(category)
            )
        except (TypeError, ValueError) as exc:
            raise DatasetError(
                f"species table entry for {name!r} is invalid: {value!r}",
                field="species",
                fix="give (class_index >= 0, IUCN category CR|EN|VU|NT|LC|NE) or a SpeciesEntry",
            ) from exc
    return table


def load_camtrap_dp(
    package_dir: str | Path,
    species_table: Mapping[str, SpeciesEntry | tuple[int, IUCNCategory | str]],
    *,
    image_size: int | None = None,
    missing_media: str = "error",
    multi_species: str = "skip",
    train_on: str = "verified",
    machine_threshold: float = 0.95,
    digests: dict | None = None,
) -> LocalDataset:
    """Read a Camtrap DP 1.0 package into a :class:`LocalDataset` (see the module docstring for the rules).

    Args:
        package_dir: directory holding the package.
        species_table: ``scientificName -> SpeciesEntry`` or ``-> (class_index, IUCN category)``.
        image_size: side in pixels of square grayscale copies of the images to keep in memory, or None (default:
            no pixels are read; embeddings are computed from the files).
        missing_media: ``"error"``: an absent media file raises; ``"skip"``: its record is left out (one warning
            with the count).
        multi_species: ``"skip"`` (one warning with the count) or ``"error"`` for an image labelled with several
            species (common in real packages: the TDWG example has 40 such images), counted over every media row
            that shows the same image (same file, or byte-identical files).
        train_on: ``"verified"`` (human classifications only) or ``"machine"`` (also confident machine ones);
            :mod:`edge_sdk.data.observations`.
        machine_threshold: the probability a machine classification needs with ``train_on="machine"``.
        digests: a memo of file digests kept by the caller across loads (see :func:`file_sha256`).

    Returns:
        LocalDataset with labels int64 (N,), categories int8 (N,), boxes per record, one entry per distinct image,
        ordered as the images first appear in ``media.csv``; ``media_ids`` holds the first row's ``mediaID`` of each
        image, ``files`` and ``sha256`` its file and content hash; ``images`` uint8 (N, image_size, image_size) when
        asked for, else None (``features`` None: :func:`edge_sdk.data.embedding.embed_dataset` adds the backbone
        embeddings).

    Raises:
        DatasetError: a table or column is missing, a media row points at an unknown deployment, an observation
            at an unknown media, a human-labelled species is not in the species table, a box is malformed, an image
            is missing (with ``missing_media="error"``) or unreadable. The message names the file, the field and
            the fix.
    """
    for name, value, allowed in (("missing_media", missing_media, ("error", "skip")),
                                 ("multi_species", multi_species, ("error", "skip")),
                                 ("train_on", train_on, ("verified", "machine"))):
        if value not in allowed:
            raise DatasetError(f"{name}={value!r}", field=name, fix=f"use one of {', '.join(map(repr, allowed))}")
    if image_size is not None and image_size < 1:
        raise DatasetError(f"image_size={image_size}", field="image_size", fix="use a positive pixel size or None")
    package_dir = Path(package_dir)
    if not package_dir.is_dir():
        raise DatasetError(
            "Camtrap DP package directory not found", source=str(package_dir), fix="point `dataset` at the package"
        )
    table = normalise_species_table(species_table)
    paths = table_paths(package_dir)
    tables: dict[str, list[dict[str, str]]] = {name: read_table(paths[name], name) for name in TABLES}
    media_rows = _media_rows(tables, paths)
    labels_of = _labels(tables["observations"], media_rows, table, paths["observations"], train_on,
                        machine_threshold)
    groups, missing = _group_by_image(package_dir, media_rows, labels_of, missing_media, digests)
    return _records(groups, table, missing, package_dir, paths, image_size, multi_species)


def _media_rows(tables: dict[str, list[dict[str, str]]], paths: dict[str, Path]) -> dict[str, dict[str, str]]:
    deployment_ids = {row["deploymentID"] for row in tables["deployments"]}
    media_rows: dict[str, dict[str, str]] = {}
    for row in tables["media"]:
        if row["deploymentID"] not in deployment_ids:
            raise DatasetError(
                f"media {row['mediaID']!r} refers to unknown deploymentID {row['deploymentID']!r}",
                source=str(paths["media"]),
                field="deploymentID",
                fix=f"add the deployment to {paths['deployments'].name} or remove the media row",
            )
        media_rows[row["mediaID"]] = row
    return media_rows


def _labels(rows: list[dict[str, str]], media_rows: Mapping[str, dict[str, str]], table: Mapping[str, SpeciesEntry],
            path: Path, train_on: str, machine_threshold: float) -> dict[str, Labelled]:
    for row in rows:
        if row["observationLevel"].strip() != "media" or not row["mediaID"].strip():
            continue
        if row["mediaID"].strip() not in media_rows:
            raise DatasetError(
                f"observation {row['observationID']!r} refers to unknown mediaID {row['mediaID'].strip()!r}",
                source=str(path), field="mediaID",
                fix="add the media row to media.csv or remove the observation")
        if row["observationType"].strip() == "animal" and not row["scientificName"].strip() \
                and (row.get("classificationMethod") or "").strip().lower() != "machine":
            raise DatasetError(
                f"animal observation {row['observationID']!r} has no scientificName",
                source=str(path), field="scientificName",
                fix="fill in the species, or set observationType to 'unknown'")
    try:
        labels = current_labels(rows, train_on=train_on, machine_threshold=machine_threshold, listed=table)
    except ValueError as exc:
        raise DatasetError(str(exc), source=str(path), field="bboxX",
                           fix="write bboxX/bboxY/bboxWidth/bboxHeight as fractions of the image in [0, 1]") from exc
    unlisted = sorted({n for lab in labels.values() for n in lab.unlisted})
    if unlisted:
        logger.warning("%s: machine observations of species the site does not list were left out: %s", path,
                       ", ".join(unlisted))
    for media_id, lab in labels.items():
        for name in sorted(lab.species):
            if name not in table:
                raise DatasetError(
                    f"species {name!r} (a human observation of media {media_id!r}) is not in the site's species "
                    "table", source=str(path), field="scientificName",
                    fix=f"add {name!r} with a class_index and an IUCN category to the species table of the site "
                        "config")
    return {m: lab for m, lab in labels.items() if lab.species}


def _group_by_image(package_dir: Path, media_rows: Mapping[str, dict[str, str]], labels_of: Mapping[str, Labelled],
                    missing_media: str, digests: dict | None) -> tuple[dict[str, dict], list[str]]:
    """Group the labelled media rows by image (resolved path, then SHA-256 of the bytes), in media.csv order."""
    groups: dict[str, dict] = {}  # sha256 hex -> {"media_id", "path", "names", "boxes", "rows"}
    by_path: dict[Path, str] = {}
    missing: list[str] = []
    for media_id, row in media_rows.items():  # media.csv order
        labelled = labels_of.get(media_id)
        if labelled is None:
            continue
        image_path = resolve_media_file(package_dir, row)
        if not image_path.is_file():
            if missing_media == "error":
                raise DatasetError(
                    f"media file for mediaID {media_id!r} is missing",
                    source=str(image_path),
                    field="fileName",
                    fix="copy the file into media/, or set missing_media: skip",
                )
            missing.append(media_id)
            continue
        resolved = image_path.resolve()
        digest = by_path.get(resolved)
        if digest is None:
            digest = file_sha256(image_path, digests)
            by_path[resolved] = digest
            if digest not in groups:
                groups[digest] = {"media_id": media_id, "path": image_path, "names": set(), "boxes": [], "rows": 0,
                                  "whole": False}
        group = groups[digest]
        group["names"] |= labelled.species
        group["whole"] |= not labelled.boxes
        group["boxes"] += [b for b in labelled.boxes if b not in group["boxes"]]
        group["rows"] += 1
    return groups, missing


def _records(groups: Mapping[str, dict], table: Mapping[str, SpeciesEntry], missing: list[str], package_dir: Path,
             paths: Mapping[str, Path], image_size: int | None, multi_species: str) -> LocalDataset:
    images: list[np.ndarray] = []
    labels: list[int] = []
    ranks: list[int] = []
    media_ids: list[str] = []
    files: list[str] = []
    digests: list[str] = []
    boxes: list[tuple] = []
    multi: list[str] = []
    merged = 0
    for digest, group in groups.items():
        names = group["names"]
        merged += group["rows"] - 1
        if len(names) > 1:
            if multi_species == "error":
                raise DatasetError(
                    f"media {group['media_id']!r} has observations of several species {sorted(names)}"
                    + (f" (over {group['rows']} media rows showing the same image)" if group["rows"] > 1 else ""),
                    source=str(paths["observations"]),
                    field="scientificName",
                    fix="split the image, or load with multi_species='skip' to leave such images out",
                )
            multi.append(group["media_id"])
            continue
        entry = table[next(iter(names))]
        if image_size is not None:
            images.append(load_grayscale(group["path"], image_size))
        labels.append(entry.class_index)
        ranks.append(entry.iucn_category.rank)
        media_ids.append(group["media_id"])
        files.append(str(group["path"]))
        digests.append(digest)
        boxes.append(() if group["whole"] else tuple(group["boxes"]))

    if missing:
        logger.warning("%s: %d media file(s) missing were skipped (first: %r)", package_dir, len(missing), missing[0])
    if merged:
        logger.warning("%s: %d media row(s) show an image already listed (same file or identical bytes) and were "
                       "merged into its record (one image = one record)", package_dir, merged)
    if multi:
        logger.warning("%s: %d multi-species image(s) were skipped", package_dir, len(multi))
    stacked = None
    if image_size is not None:
        stacked = (np.stack(images) if images else np.zeros((0, image_size, image_size), np.uint8)).astype(np.uint8)
    return LocalDataset(
        images=stacked,
        labels=np.asarray(labels, dtype=np.int64),
        categories=np.asarray(ranks, dtype=np.int8),
        media_ids=tuple(media_ids),
        files=tuple(files),
        sha256=tuple(digests),
        boxes=tuple(boxes),
    )
