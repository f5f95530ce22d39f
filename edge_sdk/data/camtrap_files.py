"""Reading a Camtrap DP 1.0 package's files (https://camtrap-dp.tdwg.org/): the three tables (``datapackage.json``
resource paths honoured, required columns checked, UTF-8 CSV), each media row's image file, its SHA-256 (streamed,
memoised by the caller across loads) and its pixels as a grayscale square (JPEG decoded at a reduced DCT scale).
Every failure is a :class:`~shared.errors.DatasetError` naming the file and the fix. Used by
:func:`edge_sdk.data.camtrap_dp.load_camtrap_dp`.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np

from shared.errors import DatasetError

__all__ = ["TABLES", "REQUIRED_COLUMNS", "table_paths", "read_table", "resolve_media_file", "file_sha256",
           "load_grayscale"]

#: the tables a package must hold
TABLES = ("deployments", "media", "observations")
#: the columns each table must have (Camtrap DP 1.0 names)
REQUIRED_COLUMNS = {
    "deployments": ("deploymentID",),
    "media": ("mediaID", "deploymentID", "filePath", "fileName"),
    "observations": ("observationID", "mediaID", "observationLevel", "observationType", "scientificName"),
}


def table_paths(package_dir: Path) -> dict[str, Path]:
    """Resolve the three table files, honouring ``datapackage.json`` resource paths when present."""
    paths = {name: package_dir / f"{name}.csv" for name in TABLES}
    descriptor = package_dir / "datapackage.json"
    if descriptor.is_file():
        try:
            meta = json.loads(descriptor.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise DatasetError(
                f"datapackage.json does not parse: {exc}", source=str(descriptor), fix="fix or remove datapackage.json"
            ) from exc
        for resource in meta.get("resources", []) if isinstance(meta, dict) else []:
            if isinstance(resource, dict) and resource.get("name") in paths and isinstance(resource.get("path"), str):
                rel = resource["path"]
                if "://" not in rel:
                    paths[resource["name"]] = package_dir / rel
    return paths


def read_table(path: Path, name: str) -> list[dict[str, str]]:
    """The rows of table ``name`` (one of :data:`TABLES`) at ``path`` as dicts, its required columns checked.

    Raises:
        DatasetError: the file is missing or unreadable, or a required column is missing.
    """
    if not path.is_file():
        raise DatasetError(
            f"Camtrap DP table {name!r} is missing",
            source=str(path),
            fix=f"add {path.name} (Camtrap DP 1.0 {name} table) to the package",
        )
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            for column in REQUIRED_COLUMNS[name]:
                if column not in columns:
                    raise DatasetError(
                        f"column {column!r} is missing",
                        source=str(path),
                        field=column,
                        fix=f"add the Camtrap DP 1.0 column {column!r} to {path.name}",
                    )
            return [dict(row) for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DatasetError(f"cannot read CSV: {exc}", source=str(path), fix="write it as UTF-8 CSV") from exc


def resolve_media_file(package_dir: Path, row: dict[str, str]) -> Path:
    """The image file of a media row: its ``filePath`` inside the package when that file exists, else
    ``media/<fileName>``."""
    file_path = (row.get("filePath") or "").strip()
    if file_path and "://" not in file_path:
        candidate = package_dir / file_path
        if candidate.is_file():
            return candidate
    return package_dir / "media" / (row.get("fileName") or "").strip()


def file_sha256(path: Path, digests: dict | None = None) -> str:
    """SHA-256 hex digest of a media file's bytes (streamed: the file is not held in memory). ``digests``: a memo
    keyed by (path, size, mtime_ns) that a caller keeps across loads (a gateway reloads its package every round)."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if digests is not None and key in digests:
            return digests[key]
        hasher = hashlib.sha256()
        with path.open("rb") as handle:  # streamed in 1 MiB blocks (hashlib.file_digest is Python >= 3.11)
            while block := handle.read(1 << 20):
                hasher.update(block)
        digest = hasher.hexdigest()
    except OSError as exc:
        raise DatasetError(
            f"image cannot be read: {exc}",
            source=str(path),
            fix="make the file readable, or remove its rows from media.csv",
        ) from exc
    if digests is not None:
        digests[key] = digest
    return digest


def load_grayscale(path: Path, image_size: int) -> np.ndarray:
    """uint8 (image_size, image_size) grayscale pixels of the image at ``path`` (bilinear resize).

    Raises:
        DatasetError: the file is not a readable image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.draft("L", (image_size, image_size))  # JPEG: decode at a reduced DCT scale (>= target size)
            gray = image.convert("L").resize((image_size, image_size), Image.Resampling.BILINEAR)
            return np.asarray(gray, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DatasetError(
            f"image cannot be read: {exc}",
            source=str(path),
            fix="replace the file with a readable image (JPEG/PNG) or remove its rows from media.csv",
        ) from exc
