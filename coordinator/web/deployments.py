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


from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from coordinator.storage import DeploymentRow, Store

__all__ = ["CategoryOf", "species_table_categories", "import_camtrap_dp", "import_wildlife_insights"]

CategoryOf = Callable[[str], IUCNCategory]
"""``category_of(scientific name) -> IUCN category`` (NE when unknown)."""


def species_table_categories(species: Iterable[object] | None) -> CategoryOf:
    """A :data:`CategoryOf` from the coordinator config's species table (entries with ``scientific_name`` and
    ``iucn_category``); names compare case-insensitively, unknown names are NE."""
    table = {str(getattr(s, "scientific_name")).strip().lower(): IUCNCategory(getattr(s, "iucn_category"))
             for s in species or []}
    return lambda name: table.get((name or "").strip().lower(), IUCNCategory.NE)


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise DatasetError(f"{path.name} not found", source=path, fix="point at the package's folder")
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


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


def _store(store: Store, deployments: Mapping[str, tuple[float, float, str]],
           categories: Mapping[str, set[IUCNCategory]], source: str) -> int:
    with store.session() as s:
        for dep_id, (lat, lon, name) in deployments.items():
            row = s.get(DeploymentRow, dep_id) or DeploymentRow(deployment_id=dep_id)
            row.latitude, row.longitude, row.location_name, row.source = lat, lon, name, source
            row.categories_json = json.dumps(sorted(c.value for c in categories.get(dep_id, set())))
            s.merge(row)
    return len(deployments)


def _import(store: Store, root: Path, *, columns: tuple[str, str, str, str], records: str, record_id: str,
            species_of: Callable[[Mapping[str, str]], str], category_of: CategoryOf, source: str) -> int:
    """Read ``deployments.csv`` (columns: id, latitude, longitude, name) and the ``records`` file (its
    ``record_id`` column names the deployment; ``species_of(row)`` its species, "" for none), then store."""
    dep_id, lat, lon, name = columns
    deployments = {r[dep_id]: (_coordinate(r, lat, 90, root / "deployments.csv"),
                               _coordinate(r, lon, 180, root / "deployments.csv"), r.get(name) or r[dep_id])
                   for r in _rows(root / "deployments.csv")}
    categories: dict[str, set[IUCNCategory]] = {}
    for r in _rows(root / records):
        species = species_of(r)
        if species:
            categories.setdefault(r[record_id], set()).add(category_of(species))
    return _store(store, deployments, categories, source)


def import_camtrap_dp(store: Store, package: str | Path, category_of: CategoryOf) -> int:
    """Import a Camtrap DP package's deployments; returns how many.

    Raises:
        DatasetError: a missing file, or a deployment without valid coordinates (nothing is written then).
    """
    root = Path(package)
    return _import(store, root, columns=("deploymentID", "latitude", "longitude", "locationName"),
                   records="observations.csv", record_id="deploymentID",
                   species_of=lambda r: (r.get("scientificName") or "").strip(), category_of=category_of,
                   source=f"camtrap-dp:{root.name}")


def _wi_species(row: Mapping[str, str]) -> str:
    genus, species = (row.get("genus") or "").strip(), (row.get("species") or "").strip()
    return f"{genus} {species}" if genus and species and genus.lower() not in ("no cv result", "nan") else ""


def import_wildlife_insights(store: Store, project: str | Path, category_of: CategoryOf) -> int:
    """Import a Wildlife Insights project export's deployments; returns how many.

    Raises:
        DatasetError: a missing file, or a deployment without valid coordinates (nothing is written then).
    """
    root = Path(project)
    return _import(store, root, columns=("deployment_id", "latitude", "longitude", "placename"),
                   records="images.csv", record_id="deployment_id", species_of=_wi_species,
                   category_of=category_of, source=f"wildlife-insights:{root.name}")
