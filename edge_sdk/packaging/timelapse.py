"""Reader: the CSV that Timelapse 2 exports (File > Export data to a CSV file).

Its columns are the template's data labels in spreadsheet order: the fixed ones ``RootFolder`` (the name of the
image set's root folder), ``File``, ``RelativePath`` (the sub-folder under the root, backslash-separated, empty for
the root itself), ``DateTime`` (or, when the export was set so, separate ``Date`` and ``Time`` columns) and
``DeleteFlag`` (``true`` for a file marked for deletion), older versions also ``Folder``, ``ImageQuality``; then the
project's own fields, e.g. a ``Species`` choice, ``Count``, ``Notes``. ``DateTime`` is written as
``YYYY-MM-DD hh:mm:ss`` or ``YYYY-MM-DDThh:mm:ss`` (local camera time), or with a zone; an option may put a space
before it (:mod:`edge_sdk.packaging.timestamps` reads them all).

The photo is ``IMAGES/RelativePath/File``, IMAGES being ``--images`` or else the CSV's folder (Timelapse keeps
its files in the root folder). The species column is ``--species-column`` or the first of ``Species``,
``Species1``, ``SpeciesName``, ``Animal``, ``CommonName``, ``Label``. Rows marked for deletion are left out, as are
rows with an empty species (not yet reviewed, not a claim of "blank"); both are counted. The deployment is
``--deployment-column``'s value, else ``--deployment``, else the first folder of ``RelativePath`` (one folder per
camera, as Timelapse's guide recommends), else ``RootFolder``, else the CSV's folder name.
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import DatasetError

from edge_sdk.packaging.csvtable import pick_column, read_csv
from edge_sdk.packaging.labels_csv import resolve_photo
from edge_sdk.packaging.photos import ReadResult, SourcePhoto

__all__ = ["REQUIRED_COLUMNS", "SPECIES_COLUMNS", "read_timelapse"]

REQUIRED_COLUMNS = ("File", "RelativePath")
SPECIES_COLUMNS = ("Species", "Species1", "SpeciesName", "Animal", "CommonName", "Label")
_TRUE = {"true", "1", "yes"}


def read_timelapse(csv_path: Path, *, images: Path | None = None, species_column: str | None = None,
                   deployment_column: str | None = None, deployment: str | None = None) -> ReadResult:
    """The labelled photos of a Timelapse CSV export, in row order (see the module docstring).

    Raises:
        DatasetError: ``File`` or ``RelativePath`` is missing (not a Timelapse export), no species column is found
            (the message lists the template's own data labels), or labelled rows name missing files (listed).
    """
    header, rows = read_csv(csv_path)
    absent = [c for c in REQUIRED_COLUMNS if c not in header]
    if absent:
        raise DatasetError(f"not a Timelapse export: column(s) {absent} missing (columns: {', '.join(header)})",
                           source=csv_path, fix="export with Timelapse's File > Export data to a CSV file, or use "
                                                "--from labels for another CSV")
    fixed = {"RootFolder", "File", "RelativePath", "Folder", "DateTime", "Date", "Time", "UtcOffset", "DeleteFlag",
             "ImageQuality"}
    try:
        species_col = pick_column(header, species_column, SPECIES_COLUMNS, what="species", option="--species-column",
                                  source=csv_path)
    except DatasetError as exc:
        own = [h for h in header if h not in fixed]
        raise DatasetError(f"{exc.message}; the template's own data labels are: {', '.join(own) or 'none'}",
                           source=csv_path, field="--species-column", fix=exc.fix) from None
    deployment_col = pick_column(header, deployment_column, (), what="deployment", option="--deployment-column",
                                 source=csv_path, required=False)
    base = images if images is not None else csv_path.parent
    result = ReadResult()
    missing: list[str] = []
    for number, row in enumerate(rows, start=2):
        if row.get("DeleteFlag", "").strip().lower() in _TRUE:
            result.skip("Timelapse rows marked for deletion (DeleteFlag true)")
            continue
        label = " ".join(row.get(species_col, "").split())
        if not label:
            result.skip(f"Timelapse rows with an empty {species_col} (not reviewed)")
            continue
        relative = row.get("RelativePath", "").strip().replace("\\", "/").strip("/")
        written = f"{relative}/{row['File'].strip()}" if relative else row["File"].strip()
        path = resolve_photo(written, [base])
        if not path.is_file():
            missing.append(f"row {number}: {written}")
            continue
        dep = ((row.get(deployment_col, "").strip() if deployment_col else "") or deployment
               or relative.split("/")[0] or row.get("RootFolder", "").strip() or csv_path.resolve().parent.name)
        when = row.get("DateTime", "").strip() or " ".join(
            v for v in (row.get("Date", "").strip(), row.get("Time", "").strip()) if v)
        result.photos.append(SourcePhoto(path=path, label=label, deployment=dep, table_time=when or None,
                                         origin=f"{csv_path.name} row {number}"))
    if missing:
        raise DatasetError(f"{len(missing)} photo(s) of the export not found under {base}: {'; '.join(missing[:10])}"
                           + (" ..." if len(missing) > 10 else ""), source=csv_path, field="RelativePath",
                           fix="pass --images with the image set's root folder (where the .tdb file is)")
    return result
