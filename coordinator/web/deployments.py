"""Deployments for the rangers' web view: imported with their coordinates and the IUCN categories they recorded,
shown to each role by :class:`coordinator.web.views.Viewer` with sensitive locations protected
(:mod:`coordinator.web.location_privacy`; issue 9).

Import sources (read with the csv module; only the columns named here are used):

* a Camtrap DP 1.0 package (``deployments.csv``: ``deploymentID``, ``latitude``, ``longitude``, ``locationName``;
  ``observations.csv``: ``deploymentID``, ``scientificName``), https://camtrap-dp.tdwg.org/ (TDWG 2023);
* a Wildlife Insights project export (``deployments.csv``: ``deployment_id``, ``latitude``, ``longitude``,
  ``placename``; ``images.csv``: ``deployment_id``, ``genus``, ``species``).

A species' category comes from ``category_of`` (the federation's species table, the same one that sets privacy
budgets); a species it does not know counts as NE (IUCN "Not Evaluated"). Re-importing a deployment replaces its
row (idempotent), but never the protection its place has earned: with a ``policy``, the import first records the
protection the stored data earned (:func:`coordinator.web.places.evaluate`), in the same transaction as its writes,
so a package re-imported without its CR observation cannot make a protected place exact (issue 16, item 8; only
``wildfed-coordinator places lift`` can).

Both files are checked whole before anything is written, and a bad one is refused with an error naming the file,
the line and the fix, leaving what is stored as it was (issue 16, item 8):

* not UTF-8 (both formats are UTF-8; a byte-order mark is accepted, as spreadsheet programs write one);
* a row with fewer or more fields than the header, or an unterminated quoted field (a file cut short mid-row);
* a last row without a line break whose last field is a column the import reads (it may be cut in that field:
  real Wildlife Insights exports end without a line break, so the break alone is not required);
* a deployment id given twice, or a record that names a deployment the deployments file does not list (a Camtrap
  DP foreign key: a deployments file cut at a row boundary shows up this way).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sqlalchemy import select

from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from coordinator.storage import DeploymentRow, Store
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.places import evaluate

__all__ = ["CategoryOf", "SpeciesCategories", "species_table_categories", "import_camtrap_dp",
           "import_wildlife_insights", "unknown_species"]

CategoryOf = Callable[[str], IUCNCategory]
"""``category_of(scientific name) -> IUCN category`` (NE when unknown)."""


class SpeciesCategories:
    """The federation's species table as a lookup: ``table(name)`` is the IUCN category of a scientific name (NE
    when the table does not list it) and ``table.known(name)`` says whether it lists it. Names compare
    case-insensitively, ignoring surrounding spaces.

    Args:
        species: entries with ``scientific_name`` and ``iucn_category`` (the coordinator config's ``species``).
    """

    def __init__(self, species: Iterable[object] | None) -> None:
        self._table = {str(getattr(s, "scientific_name")).strip().lower(): IUCNCategory(getattr(s, "iucn_category"))
                       for s in species or []}

    def __call__(self, name: str) -> IUCNCategory:
        return self._table.get((name or "").strip().lower(), IUCNCategory.NE)

    def known(self, name: str) -> bool:
        """Whether the table lists ``name``."""
        return (name or "").strip().lower() in self._table


def species_table_categories(species: Iterable[object] | None) -> SpeciesCategories:
    """The :class:`SpeciesCategories` of the coordinator config's species table."""
    return SpeciesCategories(species)


def unknown_species(store: Store, category_of: CategoryOf, *, source: str | None = None) -> dict[str, int]:
    """Species recorded by the stored deployments (of one import ``source``, or all) that the species table does
    not list, with how many deployments recorded each. The web view protects their places by default
    (``web.unknown_species: protect``); the import command lists them so the operator can add them to the table."""
    known = getattr(category_of, "known", None)
    if known is None:
        return {}
    out: dict[str, int] = {}
    with store.session() as s:
        q = select(DeploymentRow.species_json)
        if source is not None:
            q = q.where(DeploymentRow.source == source)
        for species_json in s.scalars(q):
            for name in json.loads(species_json or "[]"):
                if not known(name):
                    out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


_OTHER_FORMAT = {"camtrap-dp": "wildlife-insights", "wildlife-insights": "camtrap-dp"}


def _utf16(raw: bytes) -> str | None:
    """"UTF-16LE" / "UTF-16BE" when ``raw`` looks like UTF-16 text (a byte-order mark, or NUL bytes in every
    other position of its start, as ASCII text in UTF-16 has), else None."""
    if raw[:2] == b"\xff\xfe":
        return "UTF-16LE"
    if raw[:2] == b"\xfe\xff":
        return "UTF-16BE"
    head = raw[:512]
    if len(head) >= 8:
        even, odd = head[0::2], head[1::2]
        if odd.count(0) >= 0.9 * len(odd) and even.count(0) == 0:
            return "UTF-16LE"
        if even.count(0) >= 0.9 * len(even) and odd.count(0) == 0:
            return "UTF-16BE"
    return None


def _decode(path: Path, fmt: str) -> str:
    """The text of a UTF-8 file (a byte-order mark is dropped).

    Raises:
        DatasetError: the file is missing, is UTF-16 (named as such, with the ``iconv -f UTF-16`` fix), or is not
            UTF-8 (names the line and byte; the fix assumes Latin-1, the usual other encoding of such exports).
    """
    if not path.is_file():
        raise DatasetError("not found", source=path,
                           fix=f"point at the folder of a {fmt} export (it holds {path.name})")
    raw = path.read_bytes()
    wide = _utf16(raw)
    if wide:
        raise DatasetError(f"the file is {wide} text, not UTF-8 (a {fmt} file is UTF-8)", source=path,
                           fix=f"convert it: `iconv -f UTF-16 -t UTF-8 {path.name} > fixed.csv`, or save it as "
                               "\"CSV UTF-8\" in a spreadsheet program")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DatasetError(f"not UTF-8: byte 0x{raw[exc.start]:02x} (byte offset {exc.start}) is not valid UTF-8",
                           source=path, field=f"line {line}",
                           fix=f"save it as UTF-8 (a {fmt} file is UTF-8), e.g. `iconv -f latin1 -t utf-8 "
                               f"{path.name} > fixed.csv` for a Latin-1 file, or \"CSV UTF-8\" in a spreadsheet "
                               "program") from None


def _rows(path: Path, required: Iterable[str], fmt: str, *,
          used: Iterable[str] = ()) -> list[tuple[int, dict[str, str]]]:
    """Every row of a CSV file, checked whole (module docstring), as ``(line, row)``: ``line`` is the 1-based line
    of the file the row starts on. ``required``: columns it must have; ``used``: the other columns the import
    reads (a possibly cut last field matters only in those).

    Raises:
        DatasetError: missing file, not UTF-8, a missing column, a short or long row, an unterminated quote, or a
            last row that may be cut in a column the import reads.
    """
    text = _decode(path, fmt)
    cut_fix = f"the file looks cut short or damaged: export or copy {path.name} again"
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    start = 1
    try:
        header = next(reader, None)
        missing = [c for c in required if c not in (header or [])]
        if missing:
            raise DatasetError(f"no {', '.join(missing)} column: it is not a {fmt} table", source=path,
                               field=missing[0],
                               fix=f"is this a {_OTHER_FORMAT[fmt]} export? then use --format {_OTHER_FORMAT[fmt]}")
        assert header is not None
        rows: list[tuple[int, dict[str, str]]] = []
        start = reader.line_num + 1
        for fields in reader:
            line, start = start, reader.line_num + 1
            if not fields:
                continue  # a blank line
            if len(fields) != len(header):
                raise DatasetError(f"{len(fields)} fields, the header {len(header)}", source=path,
                                   field=f"line {line}", fix=cut_fix)
            rows.append((line, dict(zip(header, fields))))
    except csv.Error as exc:
        raise DatasetError(f"does not parse as CSV: {exc}", source=path, field=f"line {start}",
                           fix=cut_fix) from None
    if rows and not text.endswith(("\n", "\r")) and header[-1] in set(required) | set(used):
        raise DatasetError(f"the last line ends without a line break in column {header[-1]!r}, which the import "
                           "reads: the file may be cut in the middle of that value", source=path,
                           field=f"line {rows[-1][0]}",
                           fix=f"if the file is complete, add a line break at its end; else {cut_fix}")
    return rows


def _coordinate(row: Mapping[str, str], name: str, bound: float, source: Path, line: int) -> float:
    """The decimal degrees in column ``name`` of ``row`` (line ``line`` of ``source``), within [-bound, bound].

    Raises:
        DatasetError: naming the file, line, column and value, with the fix (a decimal comma, a NUL byte, a value
            out of range).
    """
    raw = row.get(name)
    where = f"line {line}, column {name}"
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        text = raw or ""
        if "\x00" in text:
            fix = "the value holds a NUL byte (0x00): the file is damaged; export or copy it again"
        elif re.fullmatch(r"\s*[+-]?\d+,\d+\s*", text):
            fix = (f"write decimal degrees with a point, {text.strip().replace(',', '.')} (a spreadsheet set to a "
                   "decimal-comma language wrote a comma: export with '.' as the decimal separator)")
        else:
            fix = "give decimal degrees (WGS 84), e.g. 51.496"
        raise DatasetError(f"{text!r} is not a number of degrees", source=source, field=where, fix=fix) from None
    if not math.isfinite(value) or abs(value) > bound:
        raise DatasetError(f"{raw!r} is outside [-{bound}, {bound}]", source=source, field=where,
                           fix="give decimal degrees (WGS 84); is latitude swapped with longitude?")
    return value


def _iso(value: str | None) -> str | None:
    """A deployment's start or end as ISO 8601 with an offset: Camtrap DP values pass as they are; a Wildlife
    Insights ``YYYY-MM-DD HH:MM:SS`` (no zone) is read as UTC; empty or "None" is None."""
    text = (value or "").strip()
    if not text or text.lower() in ("none", "nan", "na"):
        return None
    text = text.replace(" ", "T", 1)
    if len(text) == 10:
        text += "T00:00:00"
    if not (text.endswith("Z") or text[-6:-5] in ("+", "-")):
        text += "Z"
    return text


def _store(store: Store, deployments: Mapping[str, tuple[float, float, str, str | None, str | None]],
           categories: Mapping[str, set[IUCNCategory]], species: Mapping[str, set[str]], source: str, *,
           policy: LocationPolicy | None, category_of: CategoryOf) -> int:
    """Write the deployments in one transaction; with a ``policy``, record the protection the stored data earned
    before anything is replaced, and the protection the new data earns after (coordinator.web.places)."""
    with store.session() as s:
        if policy is not None:
            evaluate(s, policy, category_of)
        for dep_id, (lat, lon, name, start, end) in deployments.items():
            row = s.get(DeploymentRow, dep_id) or DeploymentRow(deployment_id=dep_id)
            row.latitude, row.longitude, row.location_name, row.source = lat, lon, name, source
            row.start, row.end = _iso(start), _iso(end)
            row.categories_json = json.dumps(sorted(c.value for c in categories.get(dep_id, set())))
            row.species_json = json.dumps(sorted(species.get(dep_id, set())))
            s.merge(row)
        if policy is not None:
            s.flush()
            evaluate(s, policy, category_of)
    return len(deployments)


def _import(store: Store, root: Path, *, columns: tuple[str, str, str, str, str, str], records: str, record_id: str,
            species_of: Callable[[Mapping[str, str]], str], species_columns: tuple[str, ...],
            category_of: CategoryOf, source: str, fmt: str, policy: LocationPolicy | None) -> int:
    """Read ``deployments.csv`` (columns: id, latitude, longitude, name, start, end) and the ``records`` file (its
    ``record_id`` column names the deployment; ``species_of(row)`` its species, "" for none), check them, then
    store."""
    dep_id, lat, lon, name, start, end = columns
    dep_file, rec_file = root / "deployments.csv", root / records
    table = _rows(dep_file, (dep_id, lat, lon), fmt, used=(name, start, end))
    deployments: dict[str, tuple[float, float, str, str | None, str | None]] = {}
    first: dict[str, int] = {}
    for n, r in table:
        key = r[dep_id].strip()
        if not key:
            raise DatasetError("an empty deployment id", source=dep_file, field=f"line {n}, column {dep_id}",
                               fix="give every deployment its id")
        if key in deployments:
            raise DatasetError(f"deployment {key!r} is listed twice (first on line {first[key]})", source=dep_file,
                               field=f"line {n}, column {dep_id}", fix="keep one row per deployment")
        first[key] = n
        deployments[key] = (_coordinate(r, lat, 90, dep_file, n), _coordinate(r, lon, 180, dep_file, n),
                            r.get(name) or key, r.get(start), r.get(end))
    categories: dict[str, set[IUCNCategory]] = {}
    recorded: dict[str, set[str]] = {}
    for n, r in _rows(rec_file, (record_id,), fmt, used=species_columns):
        key = r[record_id].strip()
        if key not in deployments:
            raise DatasetError(f"names deployment {key!r}, which {dep_file.name} does not list", source=rec_file,
                               field=f"line {n}, column {record_id}",
                               fix=f"is {dep_file.name} complete? export or copy the package again")
        species = species_of(r)
        if species:
            categories.setdefault(key, set()).add(category_of(species))
            recorded.setdefault(key, set()).add(species)
    return _store(store, deployments, categories, recorded, source, policy=policy, category_of=category_of)


def import_camtrap_dp(store: Store, package: str | Path, category_of: CategoryOf, *,
                      policy: LocationPolicy | None = None) -> int:
    """Import a Camtrap DP package's deployments; returns how many.

    Args:
        store: the coordinator's store. package: the package folder. category_of: the species table.
        policy: the web view's location policy: given (as the CLI does), protection earned by the stored data is
            recorded before it is replaced (module docstring).

    Raises:
        DatasetError: a missing, non-UTF-8 or damaged file, a duplicate or unknown deployment id, or a deployment
            without valid coordinates (nothing is written then).
    """
    root = Path(package)
    return _import(store, root, columns=("deploymentID", "latitude", "longitude", "locationName", "deploymentStart",
                            "deploymentEnd"),
                   records="observations.csv", record_id="deploymentID",
                   species_of=lambda r: (r.get("scientificName") or "").strip(), species_columns=("scientificName",),
                   category_of=category_of, source=f"camtrap-dp:{root.name}", fmt="camtrap-dp", policy=policy)


def _wi_species(row: Mapping[str, str]) -> str:
    genus, species = (row.get("genus") or "").strip(), (row.get("species") or "").strip()
    return f"{genus} {species}" if genus and species and genus.lower() not in ("no cv result", "nan") else ""


def import_wildlife_insights(store: Store, project: str | Path, category_of: CategoryOf, *,
                             policy: LocationPolicy | None = None) -> int:
    """Import a Wildlife Insights project export's deployments; returns how many. Arguments as
    :func:`import_camtrap_dp`.

    Raises:
        DatasetError: a missing, non-UTF-8 or damaged file, a duplicate or unknown deployment id, or a deployment
            without valid coordinates (nothing is written then).
    """
    root = Path(project)
    return _import(store, root, columns=("deployment_id", "latitude", "longitude", "placename", "start_date", "end_date"),
                   records="images.csv", record_id="deployment_id", species_of=_wi_species,
                   species_columns=("genus", "species"), category_of=category_of,
                   source=f"wildlife-insights:{root.name}", fmt="wildlife-insights", policy=policy)
