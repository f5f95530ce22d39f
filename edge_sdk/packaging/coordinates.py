"""``--deployments FILE``: where each deployment's camera stood, for ``deployments.csv``.

A CSV with a deployment column (``deploymentID``, ``deployment``, ``station``, ``name``, ``locationName``, matched
to the deployment's name within the site or to its whole ``SITE/DEPLOYMENT`` id), ``latitude`` (or ``lat``,
``decimalLatitude``) and ``longitude`` (or ``lon``, ``lng``, ``long``, ``decimalLongitude``) in WGS84 decimal
degrees, and optionally ``coordinateUncertainty`` in metres. A deployment the file does not list keeps empty
coordinates, and the command says so: Camtrap DP requires them before a package is published.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.errors import DatasetError

from edge_sdk.packaging.csvtable import pick_column, read_csv

__all__ = ["Coordinates", "read_coordinates"]


@dataclass(frozen=True)
class Coordinates:
    """A deployment's place: WGS84 ``latitude`` in [-90, 90], ``longitude`` in [-180, 180] (decimal degrees), and
    ``uncertainty_m`` (metres, >= 1) or None."""

    latitude: float
    longitude: float
    uncertainty_m: int | None = None


def _number(text: str, low: float, high: float, *, what: str, row: int, path: Path) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise DatasetError(f"row {row}: {what} {text!r} is not a number in [{low:g}, {high:g}]", source=path,
                           field=what, fix="write WGS84 decimal degrees, e.g. -2.1234")
    return value


def read_coordinates(path: Path) -> dict[str, Coordinates]:
    """``{deployment name or id as written: Coordinates}`` from a deployments CSV (see the module docstring).

    Raises:
        DatasetError: unreadable, a column is missing, a value out of range, or a deployment listed twice.
    """
    header, rows = read_csv(path)
    name_col = pick_column(header, None, ("deploymentID", "deployment", "station", "name", "locationName"),
                           what="deployment", option="deployment column", source=path)
    lat_col = pick_column(header, None, ("latitude", "lat", "decimalLatitude"), what="latitude",
                          option="latitude column", source=path)
    lon_col = pick_column(header, None, ("longitude", "lon", "lng", "long", "decimalLongitude"), what="longitude",
                          option="longitude column", source=path)
    unc_col = pick_column(header, None, ("coordinateUncertainty", "coordinateUncertaintyInMeters"),
                          what="uncertainty", option="coordinateUncertainty column", source=path, required=False)
    places: dict[str, Coordinates] = {}
    for number, row in enumerate(rows, start=2):
        name = row.get(name_col, "").strip()
        if not name:
            continue
        if name in places:
            raise DatasetError(f"deployment {name!r} is listed twice (row {number})", source=path, field=name_col,
                               fix="keep one row per deployment")
        uncertainty = None
        if unc_col and row.get(unc_col, "").strip():
            uncertainty = int(_number(row[unc_col], 1, 1e7, what=unc_col, row=number, path=path))
        places[name] = Coordinates(_number(row.get(lat_col, ""), -90, 90, what=lat_col, row=number, path=path),
                                   _number(row.get(lon_col, ""), -180, 180, what=lon_col, row=number, path=path),
                                   uncertainty)
    return places
