"""Reader: a labels CSV, one row per photo: a file column, a species column, optionally deployment and time.

Columns are chosen by option (``--file-column``, ``--species-column``, ``--deployment-column``, ``--time-column``)
or recognised by name, case and punctuation ignored: file ``file``, ``filepath``, ``path``, ``filename``,
``image``, ``relativepath``; species ``species``, ``label``, ``scientificname``, ``commonname``, ``class``,
``category``; deployment ``deployment``, ``deploymentid``, ``station``, ``camera``, ``location``; time
``timestamp``, ``datetime``, ``capturetime``, ``date_time``. (ENA24's ``filepath,label`` is found as it is.)

A file path is relative to ``--images`` when given, else to the CSV's folder (an absolute path is used as it is).
A row with an empty species is unlabelled and left out (counted); a row naming a file that does not exist is an
error listing every such row: a labelled photo is packaged or refused visibly, never dropped. Without a deployment
column every photo belongs to ``--deployment``, by default the CSV's folder name.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from shared.errors import DatasetError

from edge_sdk.packaging.csvtable import pick_column, read_csv
from edge_sdk.packaging.photos import ReadResult, SourcePhoto

__all__ = ["FILE_COLUMNS", "SPECIES_COLUMNS", "DEPLOYMENT_COLUMNS", "TIME_COLUMNS", "read_labels_csv",
           "resolve_photo"]

FILE_COLUMNS = ("file", "filepath", "path", "filename", "image", "imagepath", "relativepath")
SPECIES_COLUMNS = ("species", "label", "scientificname", "commonname", "class", "category")
DEPLOYMENT_COLUMNS = ("deployment", "deploymentid", "station", "camera", "location")
TIME_COLUMNS = ("timestamp", "datetime", "capturetime", "date_time")


def resolve_photo(written: str, bases: list[Path]) -> Path:
    """The file a CSV names: an absolute path as it is, else the first of ``bases / written`` that exists (else
    the first candidate). Backslashes (Windows exports) separate folders too."""
    parts = PureWindowsPath(written).parts if "\\" in written else PurePosixPath(written).parts
    relative = Path(*parts) if parts else Path(written)
    if relative.is_absolute():
        return relative
    candidates = [base / relative for base in bases]
    return next((c for c in candidates if c.is_file()), candidates[0])


def read_labels_csv(csv_path: Path, *, images: Path | None = None, file_column: str | None = None,
                    species_column: str | None = None, deployment_column: str | None = None,
                    time_column: str | None = None, deployment: str | None = None) -> ReadResult:
    """The labelled photos of a labels CSV, in row order (see the module docstring).

    Raises:
        DatasetError: the CSV cannot be read, a named column does not exist, no file or species column is found,
            or labelled rows name files that do not exist (all of them listed, up to ten, with the count).
    """
    header, rows = read_csv(csv_path)
    pick = dict(source=csv_path)
    file_col = pick_column(header, file_column, FILE_COLUMNS, what="file", option="--file-column", **pick)
    species_col = pick_column(header, species_column, SPECIES_COLUMNS, what="species", option="--species-column",
                              **pick)
    deployment_col = pick_column(header, deployment_column, DEPLOYMENT_COLUMNS, what="deployment",
                                 option="--deployment-column", required=False, **pick)
    time_col = pick_column(header, time_column, TIME_COLUMNS, what="time", option="--time-column", required=False,
                           **pick)
    bases = [images] if images is not None else [csv_path.parent]
    result = ReadResult()
    default_deployment = deployment or csv_path.resolve().parent.name
    missing: list[str] = []
    for number, row in enumerate(rows, start=2):
        label = " ".join(row.get(species_col, "").split())
        written = row.get(file_col, "").strip()
        if not label:
            result.skip(f"rows of {csv_path.name} without a {species_col}")
            continue
        if not written:
            raise DatasetError(f"row {number} has a label but no {file_col}", source=csv_path, field=file_col,
                               fix="fill in the photo's path, or remove the row")
        path = resolve_photo(written, bases)
        if not path.is_file():
            missing.append(f"row {number}: {written}")
            continue
        dep = (row.get(deployment_col, "").strip() if deployment_col else "") or default_deployment
        result.photos.append(SourcePhoto(path=path, label=label, deployment=dep,
                                         table_time=(row.get(time_col) or None) if time_col else None,
                                         origin=f"{csv_path.name} row {number}"))
    if missing:
        raise DatasetError(f"{len(missing)} labelled photo(s) not found under {bases[0]}: {'; '.join(missing[:10])}"
                           + (" ..." if len(missing) > 10 else ""), source=csv_path, field=file_col,
                           fix="pass --images with the folder the paths are relative to, or correct the paths")
    return result
