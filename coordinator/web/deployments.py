"""Deployments for the rangers' web view: imported with their coordinates and the IUCN categories they recorded,
shown to each role by :class:`coordinator.web.views.Viewer` with sensitive locations protected
(:mod:`coordinator.web.location_privacy`; docs/location-privacy.md).

Import sources (read with the csv module; only the columns named here are used):

* a Camtrap DP 1.0 package (``deployments.csv``: ``deploymentID``, ``latitude``, ``longitude``, ``locationName``;
  ``observations.csv``: ``deploymentID``, ``scientificName``), https://camtrap-dp.tdwg.org/ (TDWG 2023);
* a Wildlife Insights project export (``deployments.csv``: ``deployment_id``, ``latitude``, ``longitude``,
  ``placename``; ``images.csv``: ``deployment_id``, ``genus``, ``species``).

Coordinates only (``species=False``, ``import-deployments --coordinates-only``): only ``deployments.csv`` is read,
no species or categories are stored. For a package of a site's training records (a gateway's own package), whose
species per deployment no DP noise covers: the map then takes species from published detection records alone.

A package is one site's: its deployments are stored under that site, keyed by (site, deployment id), since
deployment ids are unique within one package only (two reserves both have a ``StationA``, each keeps its own
coordinates), and each site's detection records join its own deployments. ``import-deployments --site S`` names
the site; it may be left out while exactly one site is enrolled (:func:`resolve_site`).

A species' category comes from ``category_of`` (the federation's species table, the same one that sets privacy
budgets); a species it does not know counts as NE (IUCN "Not Evaluated"). Re-importing a deployment replaces its
row (idempotent), but never the protection its place has earned: with a ``policy``, the import first records the
protection the stored data earned (:func:`coordinator.web.places.evaluate`), in the same transaction as its writes,
so a package re-imported without its CR observation cannot make a protected place exact (only
``wildfed-coordinator places lift`` can).

Both files are checked whole before anything is written, and a bad one is refused with an error naming the file,
the line and the fix, leaving what is stored as it was:

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
from sqlalchemy.orm import Session

from shared.errors import ConfigError, DatasetError
from shared.iucn import IUCNCategory

from coordinator.storage import DeploymentRow, PlaceRow, SiteRow, Store, deployment_key
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.places import evaluate

__all__ = ["CategoryOf", "SpeciesCategories", "species_table_categories", "import_camtrap_dp",
           "import_wildlife_insights", "unknown_species", "resolve_site"]

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


def unknown_species(store: Store, category_of: CategoryOf, *, source: str | None = None,
                    site_id: str | None = None) -> dict[str, int]:
    """Species recorded by the stored deployments (of one import ``source`` and one site, or all) that the species
    table does not list, with how many deployments recorded each. The web view protects their places by default
    (``web.unknown_species: protect``); the import command lists them so the operator can add them to the table."""
    known = getattr(category_of, "known", None)
    if known is None:
        return {}
    out: dict[str, int] = {}
    with store.session() as s:
        q = select(DeploymentRow.species_json)
        if source is not None:
            q = q.where(DeploymentRow.source == source)
        if site_id is not None:
            q = q.where(DeploymentRow.site_id == site_id)
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


def _take_over(s: Session, site_id: str, dep_id: str) -> None:
    """An unassigned row of ``dep_id`` (site ``""``, left by the schema upgrade: coordinator.schema_upgrade) is
    replaced by the one being imported for ``site_id``: the row is deleted and the places that list it list the
    new key instead."""
    orphan = s.get(DeploymentRow, ("", dep_id))
    if orphan is None or not site_id:
        return
    s.delete(orphan)
    old, new = deployment_key("", dep_id), deployment_key(site_id, dep_id)
    for place in s.scalars(select(PlaceRow)):
        members = json.loads(place.members_json or "[]")
        if old in members:
            place.members_json = json.dumps(sorted({new if m == old else m for m in members}))


def _store(store: Store, deployments: Mapping[str, tuple[float, float, str, str | None, str | None]],
           categories: Mapping[str, set[IUCNCategory]], species: Mapping[str, set[str]], source: str, *,
           site_id: str, policy: LocationPolicy | None, category_of: CategoryOf) -> int:
    """Write the deployments of ``site_id`` in one transaction; with a ``policy``, record the protection the stored
    data earned before anything is replaced, and the protection the new data earns after (coordinator.web.places)."""
    with store.session() as s:
        if policy is not None:
            evaluate(s, policy, category_of)
        for dep_id, (lat, lon, name, start, end) in deployments.items():
            _take_over(s, site_id, dep_id)
            row = (s.get(DeploymentRow, (site_id, dep_id))
                   or DeploymentRow(site_id=site_id, deployment_id=dep_id))
            row.latitude, row.longitude, row.location_name, row.source = lat, lon, name, source
            row.start, row.end = _iso(start), _iso(end)
            row.categories_json = json.dumps(sorted(c.value for c in categories.get(dep_id, set())))
            row.species_json = json.dumps(sorted(species.get(dep_id, set())))
            s.merge(row)
        if policy is not None:
            s.flush()
            evaluate(s, policy, category_of)
    return len(deployments)


def _import(store: Store, root: Path, *, site_id: str, columns: tuple[str, str, str, str, str, str],
            records: str | None, record_id: str,
            species_of: Callable[[Mapping[str, str]], str], species_columns: tuple[str, ...],
            category_of: CategoryOf, source: str, fmt: str, policy: LocationPolicy | None,
            skipped: list[str] | None = None) -> int:
    """Read ``deployments.csv`` (columns: id, latitude, longitude, name, start, end) and the ``records`` file (its
    ``record_id`` column names the deployment; ``species_of(row)`` its species, "" for none; None: no records file
    is read and no species stored), check them, then store. With ``skipped`` given, a deployment whose latitude and
    longitude are both empty is left out and its id appended there (its records are ignored), instead of an
    error."""
    dep_id, lat, lon, name, start, end = columns
    dep_file = root / "deployments.csv"
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
        if not (r.get(lat) or "").strip() and not (r.get(lon) or "").strip():
            if skipped is not None:  # a camera a gateway added before the operator gave its coordinates
                skipped.append(key)
                continue
        deployments[key] = (_coordinate(r, lat, 90, dep_file, n), _coordinate(r, lon, 180, dep_file, n),
                            r.get(name) or key, r.get(start), r.get(end))
    categories: dict[str, set[IUCNCategory]] = {}
    recorded: dict[str, set[str]] = {}
    rec_file = root / (records or "")
    rows = _rows(rec_file, (record_id,), fmt, used=species_columns) if records is not None else []
    for n, r in rows:
        key = r[record_id].strip()
        if skipped is not None and key in skipped:
            continue
        if key not in deployments:
            raise DatasetError(f"names deployment {key!r}, which {dep_file.name} does not list", source=rec_file,
                               field=f"line {n}, column {record_id}",
                               fix=f"is {dep_file.name} complete? export or copy the package again")
        species = species_of(r)
        if species:
            categories.setdefault(key, set()).add(category_of(species))
            recorded.setdefault(key, set()).add(species)
    return _store(store, deployments, categories, recorded, source, site_id=site_id, policy=policy,
                  category_of=category_of)


def import_camtrap_dp(store: Store, package: str | Path, category_of: CategoryOf, *, site_id: str,
                      policy: LocationPolicy | None = None, species: bool = True,
                      skipped: list[str] | None = None) -> int:
    """Import a Camtrap DP package's deployments as deployments of one site; returns how many.

    Args:
        store: the coordinator's store. package: the package folder. category_of: the species table.
        site_id: the site the package belongs to (deployments are keyed by (site, deployment id); the CLI resolves
            it with :func:`resolve_site`).
        policy: the web view's location policy: given (as the CLI does), protection earned by the stored data is
            recorded before it is replaced (module docstring).
        species: False: coordinates only, ``observations.csv`` is not read (module docstring: for a package of
            training records).
        skipped: when given, deployments without coordinates (a gateway's cameras before the operator gave them)
            are left out and their ids appended to it, instead of failing the import.

    Raises:
        ConfigError: an empty ``site_id``.
        DatasetError: a missing, non-UTF-8 or damaged file, a duplicate or unknown deployment id, or a deployment
            without valid coordinates (nothing is written then).
    """
    root = Path(package)
    _need_site(site_id)
    return _import(store, root, site_id=site_id, columns=("deploymentID", "latitude", "longitude", "locationName", "deploymentStart",
                            "deploymentEnd"),
                   records="observations.csv" if species else None, record_id="deploymentID",
                   species_of=lambda r: ((r.get("scientificName") or "").strip()
                                         if (r.get("observationType") or "animal").strip() == "animal" else ""),
                   species_columns=("scientificName", "observationType"),
                   category_of=category_of, source=f"camtrap-dp:{root.name}", fmt="camtrap-dp", policy=policy,
                   skipped=skipped)


def _wi_species(row: Mapping[str, str]) -> str:
    genus, species = (row.get("genus") or "").strip(), (row.get("species") or "").strip()
    return f"{genus} {species}" if genus and species and genus.lower() not in ("no cv result", "nan") else ""


def import_wildlife_insights(store: Store, project: str | Path, category_of: CategoryOf, *, site_id: str,
                             policy: LocationPolicy | None = None, species: bool = True) -> int:
    """Import a Wildlife Insights project export's deployments as deployments of one site; returns how many.
    Arguments as :func:`import_camtrap_dp`.

    Raises:
        ConfigError: an empty ``site_id``.
        DatasetError: a missing, non-UTF-8 or damaged file, a duplicate or unknown deployment id, or a deployment
            without valid coordinates (nothing is written then).
    """
    root = Path(project)
    _need_site(site_id)
    return _import(store, root, site_id=site_id, columns=("deployment_id", "latitude", "longitude", "placename", "start_date", "end_date"),
                   records="images.csv" if species else None, record_id="deployment_id", species_of=_wi_species,
                   species_columns=("genus", "species"), category_of=category_of,
                   source=f"wildlife-insights:{root.name}", fmt="wildlife-insights", policy=policy)


def _need_site(site_id: str) -> None:
    if not isinstance(site_id, str) or not site_id:
        raise ConfigError("no site given for the deployments", field="site",
                          fix="pass the site the package belongs to: --site SITE")


def resolve_site(store: Store, site: str | None) -> str:
    """The site an ``import-deployments`` writes to: ``site`` when given (it must be enrolled), else the only
    enrolled site.

    Raises:
        ConfigError: ``site`` is not enrolled, or it is not given and no site, or more than one, is enrolled (the
            message lists them and names ``--site``).
    """
    with store.session() as s:
        enrolled = sorted(s.scalars(select(SiteRow.site_id)))
    if site is not None:
        if site not in enrolled:
            raise ConfigError(f"site {site!r} is not enrolled", field="--site",
                              fix=f"enrol it first (`wildfed-coordinator enrol {site} --public-key FILE`), or give "
                                  f"one of: {', '.join(enrolled) or '(none enrolled)'}")
        return site
    if len(enrolled) == 1:
        return enrolled[0]
    if not enrolled:
        raise ConfigError("no site is enrolled, so the deployments belong to none", field="--site",
                          fix="enrol the site the package belongs to first (`wildfed-coordinator enrol SITE "
                              "--public-key FILE`), then import with --site SITE")
    shown = ", ".join(enrolled[:10]) + (f", ... ({len(enrolled)} in all)" if len(enrolled) > 10 else "")
    raise ConfigError(f"{len(enrolled)} sites are enrolled and deployment ids are unique only within one site "
                      "(two sites may both have a StationA)", field="--site",
                      fix=f"say which site the package belongs to: --site SITE (one of {shown})")
