"""NIRA ecological clustering on real camera-trap metadata (docs/nira.md, "Real metadata checks").

Two public datasets from ``../shared/data`` (read by :mod:`wildfed_sim.nira_datasets`; never copied into the repository):

- ``wildlife-insights/{cajambre,cristales}``: two Wildlife Insights projects in Colombia (wiutils 1.1.0 package
  data, CC-BY-4.0), 38 deployments. A deployment's species list is every ``genus species`` identified in its
  ``images.csv`` rows (rows identified only to class/genus, blanks and ``Homo sapiens`` are left out). The
  clustering is compared with the project each deployment belongs to: contingency table, purity, adjusted Rand
  index.
- ``snapshot-serengeti/annotations.csv.gz``: Snapshot Serengeti labels (LILA, CDLA-Permissive), 223 camera
  locations. A location's list is the set of its ``category_id`` labels over all seasons, with ``fire`` (not an
  animal) dropped and ``lionfemale``/``lionmale``/``lioncub`` merged into ``lion``; the other labels are kept as
  the dataset's taxa (a few are groups: ``otherbird``, ``rodents``, ``reptiles``, ``insectspider``, ...). The
  report gives the Jaccard distribution (to compare with the NIRA seed's 0.02-0.78) and the clusters.

Sensitive species (CR/EN by default) are removed exactly as the coordinator would remove them
(:func:`coordinator.strategies.ecological_clustering.site_species_lists`), with categories from the Mammal Diversity
Database (``iucn/mdd_2020-09.csv``; 2020 statuses) where that file is present. Birds are not in the MDD: their
category is unknown and they are kept.

:func:`run_metadata_checks` returns both reports as plain dicts (JSON-ready) for a CLI command to print; the
numbers measured on this data are in ``docs/nira.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from coordinator.strategies.cluster_agreement import adjusted_rand_index, contingency_table, purity
from coordinator.strategies.cluster_assignment import ClusterAssignment
from coordinator.strategies.ecological_clustering import (
    DEFAULT_EXCLUDED_CATEGORIES,
    cluster_sites,
    jaccard_matrix,
    pairwise_values,
    plot_similarity_heatmap,
    site_species_lists,
)
from wildfed_sim.nira_datasets import (DEFAULT_DATA_ROOT, MDD_RELATIVE_PATH, SERENGETI_FALLBACK_CATEGORIES,
                                       SERENGETI_SCIENTIFIC_NAMES, WILDLIFE_INSIGHTS_PROJECTS, load_mdd_categories,
                                       serengeti_counts, serengeti_metadata, wildlife_insights_counts,
                                       wildlife_insights_metadata)

__all__ = [
    "DEFAULT_DATA_ROOT",
    "WILDLIFE_INSIGHTS_PROJECTS",
    "SERENGETI_SCIENTIFIC_NAMES",
    "SEED_JACCARD_RANGE",
    "load_mdd_categories",
    "wildlife_insights_metadata",
    "wildlife_insights_counts",
    "serengeti_metadata",
    "serengeti_counts",
    "jaccard_summary",
    "wildlife_insights_report",
    "serengeti_report",
    "run_metadata_checks",
]

#: The NIRA seed's range of pairwise Jaccard similarity between sites (docs/nira.md, "Real metadata checks").
SEED_JACCARD_RANGE = (0.02, 0.78)


def jaccard_summary(similarity: np.ndarray, *, seed_range: tuple[float, float] = SEED_JACCARD_RANGE,
                    ) -> dict[str, Any]:
    """Distribution of the pairwise (i < j) similarities of a (K, K) matrix.

    Returns:
        ``{"pairs", "min", "q1", "median", "q3", "max", "mean", "min_nonzero", "fraction_zero",
        "fraction_below_seed_min", "fraction_above_seed_max", "seed_range"}`` (floats; quartiles by numpy's
        default linear interpolation; ``min_nonzero`` is None when every pair is 0).
    """
    v = pairwise_values(similarity)
    if v.size == 0:
        return {"pairs": 0}
    q = np.quantile(v, [0.0, 0.25, 0.5, 0.75, 1.0])
    nz = v[v > 0]
    return {"pairs": int(v.size), "min": float(q[0]), "q1": float(q[1]), "median": float(q[2]), "q3": float(q[3]),
            "max": float(q[4]), "mean": float(v.mean()), "min_nonzero": float(nz.min()) if nz.size else None,
            "fraction_zero": float(np.mean(v == 0)), "fraction_below_seed_min": float(np.mean(v < seed_range[0])),
            "fraction_above_seed_max": float(np.mean(v > seed_range[1])), "seed_range": list(seed_range)}


def _categories(data_root: Path) -> tuple[dict[str, IUCNCategory], str]:
    mdd = data_root / MDD_RELATIVE_PATH
    if mdd.is_file():
        return load_mdd_categories(mdd), str(MDD_RELATIVE_PATH)
    return {}, "none (MDD file absent)"


def _assignment_summary(assignment: ClusterAssignment) -> dict[str, Any]:
    return {"num_clusters": len(assignment.clusters),
            "cluster_sizes": {label: len(m) for label, m in assignment.clusters.items()},
            "clusters": {label: list(m) for label, m in assignment.clusters.items()}}


def wildlife_insights_report(data_root: str | Path = DEFAULT_DATA_ROOT, *,
                             distance_thresholds: Iterable[float] = (0.7, 0.8, 0.9),
                             num_clusters: Iterable[int] = (2, 3),
                             exclude_categories: Iterable[IUCNCategory | str] = DEFAULT_EXCLUDED_CATEGORIES,
                             heatmap_path: str | Path | None = None, heatmap_threshold: float = 0.9,
                             ) -> dict[str, Any]:
    """Cluster the 38 Wildlife Insights deployments and compare the clusters with the two projects.

    For every cut (each distance threshold and each target number of clusters) the report holds the clusters,
    the contingency table (rows: projects in sorted order; columns: cluster labels), purity and adjusted Rand
    index (:func:`~coordinator.strategies.cluster_agreement.adjusted_rand_index`).

    Args:
        data_root: folder holding ``wildlife-insights`` (and optionally ``iucn/mdd_2020-09.csv``).
        distance_thresholds, num_clusters: the cuts to report.
        exclude_categories: categories removed from the public lists (MDD categories; birds unknown, kept).
        heatmap_path: write the heatmap PNG of the ``heatmap_threshold`` cut there (None: no file).

    Returns:
        JSON-ready dict: ``num_deployments``, ``deployments_per_project``, ``species_per_deployment`` (min, median,
        max), ``num_species``, ``removed_sensitive`` (names), ``jaccard`` (:func:`jaccard_summary`),
        ``mean_jaccard_within_project``, ``mean_jaccard_between_projects``, ``cuts`` (list of per-cut dicts) and
        ``heatmap`` (path or None).

    Raises:
        DatasetError: data missing.
    """
    root = Path(data_root)
    metadata, project = wildlife_insights_metadata(root)
    categories, source = _categories(root)
    lists = site_species_lists(metadata, exclude_categories=exclude_categories, species_categories=categories)
    removed = sorted({s for d in metadata for s in metadata[d]["species"]} - {s for v in lists.values() for s in v})
    ids, sim = jaccard_matrix(lists)
    same = np.array([[project[a] == project[b] for b in ids] for a in ids])
    iu = np.triu_indices(len(ids), k=1)
    sizes = np.array([len(lists[d]) for d in ids])
    cuts = []
    for kind, values in (("distance_threshold", distance_thresholds), ("num_clusters", num_clusters)):
        for value in values:
            assignment = cluster_sites(sim, ids, **{kind: value})
            rows, cols, table = contingency_table(project, assignment.site_cluster)
            cuts.append({"cut": {kind: value}, **_assignment_summary(assignment),
                         "contingency": {"projects": list(rows), "clusters": list(cols), "table": table.tolist()},
                         "purity": purity(table), "adjusted_rand_index": adjusted_rand_index(table)})
    heatmap = None
    if heatmap_path is not None:
        heatmap = str(plot_similarity_heatmap(cluster_sites(sim, ids, distance_threshold=heatmap_threshold),
                                              heatmap_path, title="Wildlife Insights (cajambre, cristales): "
                                              f"38 deployments, cut at 1 - J = {heatmap_threshold}"))
    return {"dataset": "wildlife-insights", "num_deployments": len(ids),
            "deployments_per_project": {p: sum(1 for d in ids if project[d] == p) for p in WILDLIFE_INSIGHTS_PROJECTS},
            "species_per_deployment": {"min": int(sizes.min()), "median": float(np.median(sizes)),
                                       "max": int(sizes.max())},
            "num_species": len({s for v in lists.values() for s in v}), "category_source": source,
            "removed_sensitive": removed, "jaccard": jaccard_summary(sim),
            "mean_jaccard_within_project": float(sim[iu][same[iu]].mean()),
            "mean_jaccard_between_projects": float(sim[iu][~same[iu]].mean()), "cuts": cuts, "heatmap": heatmap}


def serengeti_report(data_root: str | Path = DEFAULT_DATA_ROOT, *, distance_threshold: float = 0.6,
                     exclude_categories: Iterable[IUCNCategory | str] = DEFAULT_EXCLUDED_CATEGORIES,
                     heatmap_path: str | Path | None = None) -> dict[str, Any]:
    """Jaccard distribution and clusters of the 223 Snapshot Serengeti camera locations.

    The default cut 0.6 joins groups whose mean Jaccard is at least 0.4 (below the median pair, 0.5).
    Per cluster the report gives its size, mean list length and mean number of annotation rows (survey effort),
    to show whether small clusters are ecological or just under-sampled locations.

    Args:
        data_root: folder holding ``snapshot-serengeti`` (and optionally ``iucn/mdd_2020-09.csv``).
        distance_threshold: the cut (distance ``1 - J``).
        exclude_categories: categories removed (labels mapped by :data:`SERENGETI_SCIENTIFIC_NAMES` to MDD
            categories, or :data:`SERENGETI_FALLBACK_CATEGORIES` without the MDD file).
        heatmap_path: write the heatmap PNG there (None: no file).

    Returns:
        JSON-ready dict: ``num_locations``, ``species_per_location`` (min, median, max), ``removed_sensitive``,
        ``jaccard`` (:func:`jaccard_summary`), ``cut``, ``num_clusters``, ``cluster_sizes``, ``clusters``,
        ``cluster_profile`` ({label: {size, mean_species, mean_annotations}}), ``heatmap``.

    Raises:
        DatasetError: data missing.
    """
    root = Path(data_root)
    metadata = serengeti_metadata(root)
    mdd, source = _categories(root)
    if mdd:
        categories = {label: mdd[sci] for label, sci in SERENGETI_SCIENTIFIC_NAMES.items() if sci in mdd}
    else:
        categories, source = dict(SERENGETI_FALLBACK_CATEGORIES), "built-in CR/EN table (MDD file absent)"
    lists = site_species_lists(metadata, exclude_categories=exclude_categories, species_categories=categories)
    removed = sorted({s for d in metadata for s in metadata[d]["species"]} - {s for v in lists.values() for s in v})
    ids, sim = jaccard_matrix(lists)
    assignment = cluster_sites(sim, ids, distance_threshold=distance_threshold)
    sizes = np.array([len(lists[d]) for d in ids])
    profile = {label: {"size": len(m), "mean_species": float(np.mean([len(lists[s]) for s in m])),
                       "mean_annotations": float(np.mean([metadata[s]["num_annotations"] for s in m]))}
               for label, m in assignment.clusters.items()}
    heatmap = None
    if heatmap_path is not None:
        heatmap = str(plot_similarity_heatmap(assignment, heatmap_path, title="Snapshot Serengeti: 223 locations, "
                                              f"cut at 1 - J = {distance_threshold}"))
    return {"dataset": "snapshot-serengeti", "num_locations": len(ids),
            "species_per_location": {"min": int(sizes.min()), "median": float(np.median(sizes)),
                                     "max": int(sizes.max())},
            "num_labels": len({s for v in lists.values() for s in v}), "category_source": source,
            "removed_sensitive": removed, "jaccard": jaccard_summary(sim), "cut": {"distance_threshold":
                                                                                     distance_threshold},
            **_assignment_summary(assignment), "cluster_profile": profile, "heatmap": heatmap}


def run_metadata_checks(data_root: str | Path = DEFAULT_DATA_ROOT, *, out_dir: str | Path | None = None,
                        ) -> dict[str, Any]:
    """Both real-metadata checks, for a CLI command to print or store.

    Args:
        data_root: the shared data folder (default ``<repo>/../shared/data``).
        out_dir: if given, heatmaps are written there (``nira-wildlife-insights.png``,
            ``nira-serengeti.png``).

    Returns:
        ``{"wildlife_insights": report or {"skipped": reason}, "serengeti": report or {"skipped": reason}}``; a
        dataset whose files are absent is skipped with the reason, never an error.
    """
    out = Path(out_dir) if out_dir is not None else None
    results: dict[str, Any] = {}
    for key, fn, png in (("wildlife_insights", wildlife_insights_report, "nira-wildlife-insights.png"),
                         ("serengeti", serengeti_report, "nira-serengeti.png")):
        try:
            results[key] = fn(data_root, heatmap_path=None if out is None else out / png)
        except DatasetError as exc:
            results[key] = {"skipped": str(exc)}
    return results
