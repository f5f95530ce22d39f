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
row (idempotent).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sqlalchemy import select

from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from coordinator.storage import DeploymentRow, Store

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


def _rows(path: Path, required: Iterable[str], fmt: str) -> list[dict[str, str]]:
    if not path.is_file():
        raise DatasetError(f"{path.name} not found", source=path,
                           fix=f"point at the folder of a {fmt} export (it holds {path.name})")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise DatasetError(f"{path.name} has no {', '.join(missing)} column: it is not a {fmt} table",
                               source=path, field=missing[0],
                               fix=f"is this a {_OTHER_FORMAT[fmt]} export? then use --format {_OTHER_FORMAT[fmt]}")
        return list(reader)


def _coordinate(row: Mapping[str, str], name: str, bound: float, source: Path) -> float:
    try:
        value = float(row[name])
    except (KeyError, TypeError, ValueError):
        raise DatasetError(f"deployment {row!r:.80} has no numeric {name}", source=source, field=name,
                           fix="give decimal degrees (WGS 84)") from None
    if not math.isfinite(value) or abs(value) > bound:
        raise DatasetError(f"{name} {value} is outside [-{bound}, {bound}]", source=source, field=name,
                           fix="give decimal degrees (WGS 84)")
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
           categories: Mapping[str, set[IUCNCategory]], species: Mapping[str, set[str]], source: str) -> int:
    with store.session() as s:
        for dep_id, (lat, lon, name, start, end) in deployments.items():
            row = s.get(DeploymentRow, dep_id) or DeploymentRow(deployment_id=dep_id)
            row.latitude, row.longitude, row.location_name, row.source = lat, lon, name, source
            row.start, row.end = _iso(start), _iso(end)
            row.categories_json = json.dumps(sorted(c.value for c in categories.get(dep_id, set())))
            row.species_json = json.dumps(sorted(species.get(dep_id, set())))
            s.merge(row)
    return len(deployments)


def _import(store: Store, root: Path, *, columns: tuple[str, str, str, str, str, str], records: str, record_id: str,
            species_of: Callable[[Mapping[str, str]], str], category_of: CategoryOf, source: str, fmt: str) -> int:
    """Read ``deployments.csv`` (columns: id, latitude, longitude, name) and the ``records`` file (its
    ``record_id`` column names the deployment; ``species_of(row)`` its species, "" for none), then store."""
    dep_id, lat, lon, name, start, end = columns
    deployments = {r[dep_id]: (_coordinate(r, lat, 90, root / "deployments.csv"),
                               _coordinate(r, lon, 180, root / "deployments.csv"), r.get(name) or r[dep_id],
                               r.get(start), r.get(end))
                   for r in _rows(root / "deployments.csv", (dep_id, lat, lon), fmt)}
    categories: dict[str, set[IUCNCategory]] = {}
    recorded: dict[str, set[str]] = {}
    for r in _rows(root / records, (record_id,), fmt):
        species = species_of(r)
        if species:
            categories.setdefault(r[record_id], set()).add(category_of(species))
            recorded.setdefault(r[record_id], set()).add(species)
    return _store(store, deployments, categories, recorded, source)


def import_camtrap_dp(store: Store, package: str | Path, category_of: CategoryOf) -> int:
    """Import a Camtrap DP package's deployments; returns how many.

    Raises:
        DatasetError: a missing file, or a deployment without valid coordinates (nothing is written then).
    """
    root = Path(package)
    return _import(store, root, columns=("deploymentID", "latitude", "longitude", "locationName", "deploymentStart",
                            "deploymentEnd"),
                   records="observations.csv", record_id="deploymentID",
                   species_of=lambda r: (r.get("scientificName") or "").strip(), category_of=category_of,
                   source=f"camtrap-dp:{root.name}", fmt="camtrap-dp")


def _wi_species(row: Mapping[str, str]) -> str:
    genus, species = (row.get("genus") or "").strip(), (row.get("species") or "").strip()
    return f"{genus} {species}" if genus and species and genus.lower() not in ("no cv result", "nan") else ""


def import_wildlife_insights(store: Store, project: str | Path, category_of: CategoryOf) -> int:
    """Import a Wildlife Insights project export's deployments; returns how many.

    Raises:
        DatasetError: a missing file, or a deployment without valid coordinates (nothing is written then).
    """
    root = Path(project)
    return _import(store, root, columns=("deployment_id", "latitude", "longitude", "placename", "start_date", "end_date"),
                   records="images.csv", record_id="deployment_id", species_of=_wi_species,
                   category_of=category_of, source=f"wildlife-insights:{root.name}", fmt="wildlife-insights")
