"""NIRA ecological clustering on real camera-trap metadata (docs/nira.md, "Real metadata checks").

Two public datasets from ``../shared/data`` (relative to the repository root; never copied into the repository):

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

import csv
import gzip
from collections.abc import Iterable, Iterator, Mapping
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
from wildfed_sim.detections import SHARED_DATA

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

#: ``<repository root>/../shared/data``.
DEFAULT_DATA_ROOT = SHARED_DATA
WILDLIFE_INSIGHTS_PROJECTS = ("cajambre", "cristales")
#: The NIRA seed's range of pairwise Jaccard similarity between sites (docs/nira.md, "Real metadata checks").
SEED_JACCARD_RANGE = (0.02, 0.78)
MDD_RELATIVE_PATH = Path("iucn") / "mdd_2020-09.csv"
SERENGETI_RELATIVE_PATH = Path("snapshot-serengeti") / "annotations.csv.gz"

#: Snapshot Serengeti labels that name one species, with that species' scientific name (used only to look up its
#: IUCN category in the MDD). Group labels (``otherbird``, ``rodents``, ``mongoose``, ``jackal``, ``genet``,
#: ``hare``, ``bat``, ``vulture``, ...) are absent: no single category applies to them.
SERENGETI_SCIENTIFIC_NAMES: dict[str, str] = {
    "aardvark": "Orycteropus afer", "aardwolf": "Proteles cristatus", "baboon": "Papio anubis",
    "batearedfox": "Otocyon megalotis", "buffalo": "Syncerus caffer", "caracal": "Caracal caracal",
    "cheetah": "Acinonyx jubatus", "civet": "Civettictis civetta", "dikdik": "Madoqua kirkii",
    "elephant": "Loxodonta africana", "gazellegrants": "Nanger granti", "gazellethomsons": "Eudorcas thomsonii",
    "giraffe": "Giraffa camelopardalis", "hartebeest": "Alcelaphus buselaphus",
    "hippopotamus": "Hippopotamus amphibius", "honeybadger": "Mellivora capensis",
    "hyenabrown": "Parahyaena brunnea", "hyenaspotted": "Crocuta crocuta", "hyenastriped": "Hyaena hyaena",
    "impala": "Aepyceros melampus", "leopard": "Panthera pardus", "lion": "Panthera leo",
    "monkeyvervet": "Chlorocebus pygerythrus", "pangolin": "Smutsia temminckii", "porcupine": "Hystrix cristata",
    "reedbuck": "Redunca redunca", "rhinoceros": "Diceros bicornis", "serval": "Leptailurus serval",
    "steenbok": "Raphicerus campestris", "topi": "Damaliscus lunatus", "warthog": "Phacochoerus africanus",
    "waterbuck": "Kobus ellipsiprymnus", "wildcat": "Felis lybica", "wildebeest": "Connochaetes taurinus",
    "wilddog": "Lycaon pictus", "zebra": "Equus quagga", "zorilla": "Ictonyx striatus",
}
#: Used when the MDD file is absent: the Serengeti labels that are CR/EN in the MDD (Sep 2020).
SERENGETI_FALLBACK_CATEGORIES: dict[str, IUCNCategory] = {"rhinoceros": IUCNCategory.CR, "wilddog": IUCNCategory.EN}

_MDD_STATUS = {"CR": IUCNCategory.CR, "CR(PE)": IUCNCategory.CR, "EN": IUCNCategory.EN, "VU": IUCNCategory.VU,
               "NT": IUCNCategory.NT, "LC": IUCNCategory.LC, "DD": IUCNCategory.NE, "NA": IUCNCategory.NE}


def load_mdd_categories(path: str | Path) -> dict[str, IUCNCategory]:
    """``{scientific name: IUCN category}`` from the Mammal Diversity Database CSV (``sciName``, ``iucnStatus``).

    ``Genus_species`` names become ``Genus species``. ``CR(PE)`` (possibly extinct) counts as CR; ``DD`` and
    ``NA`` (not assessed) as NE (as shared.iucn does for DD); ``EX``, ``EW`` and blanks are left out.

    Raises:
        DatasetError: the file is missing or lacks those columns.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p} does not exist", source=p, fix="pass the path of mdd_2020-09.csv")
    out: dict[str, IUCNCategory] = {}
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not {"sciName", "iucnStatus"} <= set(reader.fieldnames or ()):
            raise DatasetError("missing sciName/iucnStatus columns", source=p, fix="use the MDD species CSV")
        for row in reader:
            cat = _MDD_STATUS.get(row["iucnStatus"].strip())
            if cat is not None:
                out[row["sciName"].replace("_", " ").strip()] = cat
    return out


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise DatasetError(f"{what} not found at {path}", source=path,
                           fix="run from a checkout next to ../shared/data, or pass --data DIR (data_root in Python)")
    return path


def wildlife_insights_metadata(data_root: str | Path = DEFAULT_DATA_ROOT, *,
                               exclude_taxa: Iterable[str] = ("Homo sapiens",),
                               ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Per-deployment metadata of the two Wildlife Insights projects, in the registry's form.

    Args:
        data_root: folder holding ``wildlife-insights/{cajambre,cristales}/{deployments,images}.csv``.
        exclude_taxa: ``genus species`` names left out (default: people).

    Returns:
        ``(metadata, project)``: ``metadata[deployment_id] = {"species": sorted names, "num_images": int}``
        (every deployment of ``deployments.csv``, also one without identified species) and
        ``project[deployment_id]`` = the project folder name.

    Raises:
        DatasetError: a file is missing, or an image row names a deployment not in ``deployments.csv``.
    """
    root = Path(data_root) / "wildlife-insights"
    excluded = set(exclude_taxa)
    species: dict[str, set[str]] = {}
    images: dict[str, int] = {}
    project: dict[str, str] = {}
    for name in WILDLIFE_INSIGHTS_PROJECTS:
        folder = _require(root / name, "Wildlife Insights project folder")
        with _require(folder / "deployments.csv", "deployments.csv").open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                dep = row["deployment_id"]
                project[dep] = name
                species.setdefault(dep, set())
                images.setdefault(dep, 0)
        with _require(folder / "images.csv", "images.csv").open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                dep = row["deployment_id"]
                if dep not in project:
                    raise DatasetError(f"image {row['image_id']} names unknown deployment {dep!r}",
                                       source=folder / "images.csv")
                images[dep] += 1
                genus, epithet = row["genus"].strip(), row["species"].strip()
                if genus and epithet and f"{genus} {epithet}" not in excluded:
                    species[dep].add(f"{genus} {epithet}")
    metadata = {d: {"species": sorted(species[d]), "num_images": images[d]} for d in sorted(species)}
    return metadata, project


def wildlife_insights_counts(data_root: str | Path = DEFAULT_DATA_ROOT, *,
                             exclude_taxa: Iterable[str] = ("Homo sapiens",)) -> dict[str, dict[str, int]]:
    """Per-deployment image counts of each identified species of the two Wildlife Insights projects.

    Args:
        data_root: folder holding ``wildlife-insights/{cajambre,cristales}/images.csv``.
        exclude_taxa: ``genus species`` names left out (default: people).

    Returns:
        ``{deployment_id: {"genus species": images}}`` (deployments without an identified species are absent).

    Raises:
        DatasetError: a file is missing.
    """
    root = Path(data_root) / "wildlife-insights"
    excluded = set(exclude_taxa)
    counts: dict[str, dict[str, int]] = {}
    for name in WILDLIFE_INSIGHTS_PROJECTS:
        folder = _require(root / name, "Wildlife Insights project folder")
        with _require(folder / "images.csv", "images.csv").open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                genus, epithet = row["genus"].strip(), row["species"].strip()
                taxon = f"{genus} {epithet}"
                if genus and epithet and taxon not in excluded:
                    per = counts.setdefault(row["deployment_id"], {})
                    per[taxon] = per.get(taxon, 0) + 1
    return {d: dict(sorted(c.items())) for d, c in sorted(counts.items())}


def _serengeti_rows(data_root: str | Path, drop_labels: Iterable[str], merge_labels: Mapping[str, str] | None
                    ) -> Iterator[tuple[str, str, str | None]]:
    """``(location, season, label)`` of every annotation row of ``annotations.csv.gz``; the label is None for a
    dropped one (``drop_labels``) and renamed by ``merge_labels`` (default: the three lion labels to ``lion``).

    Raises:
        DatasetError: the file is missing.
    """
    path = _require(Path(data_root) / SERENGETI_RELATIVE_PATH, "Snapshot Serengeti annotations")
    drop = set(drop_labels)
    merge = dict(merge_labels) if merge_labels is not None else {
        "lionfemale": "lion", "lionmale": "lion", "lioncub": "lion"}
    with gzip.open(path, "rt", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            label = row["category_id"]
            yield row["location"], row["season"], None if label in drop else merge.get(label, label)


def serengeti_counts(data_root: str | Path = DEFAULT_DATA_ROOT, *, drop_labels: Iterable[str] = ("fire",),
                     merge_labels: Mapping[str, str] | None = None) -> dict[str, dict[str, int]]:
    """Per-location annotation counts of each label of Snapshot Serengeti (``annotations.csv.gz``), with the same
    label clean-up as :func:`serengeti_metadata` (``fire`` dropped, the three lion labels merged by default).

    Returns:
        ``{location: {label: annotation rows}}``.

    Raises:
        DatasetError: the file is missing.
    """
    counts: dict[str, dict[str, int]] = {}
    for loc, _, label in _serengeti_rows(data_root, drop_labels, merge_labels):
        if label is not None:
            per = counts.setdefault(loc, {})
            per[label] = per.get(label, 0) + 1
    return {loc: dict(sorted(c.items())) for loc, c in sorted(counts.items())}


def serengeti_metadata(data_root: str | Path = DEFAULT_DATA_ROOT, *, drop_labels: Iterable[str] = ("fire",),
                       merge_labels: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Per-location metadata of Snapshot Serengeti (``annotations.csv.gz``), in the registry's form.

    Args:
        data_root: folder holding ``snapshot-serengeti/annotations.csv.gz``.
        drop_labels: ``category_id`` values that are not animals (default ``fire``).
        merge_labels: label renames before the lists are built (default: the three lion labels to ``lion``).

    Returns:
        ``{location: {"species": sorted labels, "num_annotations": int, "seasons": sorted season codes}}``.

    Raises:
        DatasetError: the file is missing.
    """
    species: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    seasons: dict[str, set[str]] = {}
    for loc, season, label in _serengeti_rows(data_root, drop_labels, merge_labels):
        counts[loc] = counts.get(loc, 0) + 1
        seasons.setdefault(loc, set()).add(season)
        s = species.setdefault(loc, set())
        if label is not None:
            s.add(label)
    return {loc: {"species": sorted(species[loc]), "num_annotations": counts[loc], "seasons": sorted(seasons[loc])}
            for loc in sorted(species)}


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
