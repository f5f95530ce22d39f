"""Reading the operator's CSV files: a header, rows, and columns chosen by option or recognised by name."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

from shared.errors import DatasetError

__all__ = ["read_csv", "pick_column", "normalise_header"]


def normalise_header(name: str) -> str:
    """A column name as compared: lower case, letters and digits only (``File Path`` == ``file_path``)."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """``(header, rows)`` of a UTF-8 CSV (a byte-order mark is allowed; cells are kept as written, ``""`` when a
    row is short).

    Raises:
        DatasetError: the file is missing, unreadable, not UTF-8, or has no header.
    """
    if not path.is_file():
        raise DatasetError("file not found", source=path, fix="pass the path of an existing CSV file")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            header = [h.strip() for h in (reader.fieldnames or [])]
            rows = [{k.strip(): (v or "") for k, v in row.items() if k is not None} for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DatasetError(f"cannot read CSV: {exc}", source=path, fix="save it as UTF-8 CSV") from exc
    if not header:
        raise DatasetError("the CSV has no header row", source=path, fix="add a first row naming the columns")
    return header, rows


def pick_column(header: Sequence[str], given: str | None, candidates: Sequence[str], *, what: str, option: str,
                source: Path, required: bool = True) -> str | None:
    """The column to read ``what`` from: ``given`` (an option) when set, else the first header matching one of
    ``candidates`` (compared with :func:`normalise_header`).

    Returns:
        The column's name as written in the header, or None when not required and not found.

    Raises:
        DatasetError: ``given`` is not a column, or a required column is not found (the message lists the columns
            and the option that picks one).
    """
    by_norm = {normalise_header(h): h for h in header}
    if given:
        if given in header:
            return given
        if normalise_header(given) in by_norm:
            return by_norm[normalise_header(given)]
        raise DatasetError(f"{option} {given!r} is not a column (columns: {', '.join(header)})", source=source,
                           field=option, fix=f"name one of the columns with {option}")
    for candidate in candidates:
        if normalise_header(candidate) in by_norm:
            return by_norm[normalise_header(candidate)]
    if required:
        raise DatasetError(f"no {what} column found among: {', '.join(header)} (looked for "
                           f"{', '.join(candidates)})", source=source, field=option,
                           fix=f"name the {what} column with {option}")
    return None
