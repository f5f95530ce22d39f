"""Reading the real camera-trap metadata the NIRA checks use (docs/nira.md, "Real metadata checks"): each Wildlife
Insights deployment's and each Snapshot Serengeti location's species (counts and lists), and IUCN categories from
the Mammal Diversity Database. The data stay in ``../shared/data`` (or ``$WILDFED_SHARED_DATA``); a missing file
is a :class:`~shared.errors.DatasetError` naming it. The checks themselves are :mod:`wildfed_sim.nira_metadata`.
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any


from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from wildfed_sim.detections import SHARED_DATA

__all__ = ["DEFAULT_DATA_ROOT", "WILDLIFE_INSIGHTS_PROJECTS", "MDD_RELATIVE_PATH", "SERENGETI_RELATIVE_PATH",
           "SERENGETI_SCIENTIFIC_NAMES", "SERENGETI_FALLBACK_CATEGORIES", "load_mdd_categories", "require_file",
           "wildlife_insights_metadata", "wildlife_insights_counts", "serengeti_counts", "serengeti_metadata"]

#: ``<repository root>/../shared/data``.
DEFAULT_DATA_ROOT = SHARED_DATA
WILDLIFE_INSIGHTS_PROJECTS = ("cajambre", "cristales")
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


def require_file(path: Path, what: str) -> Path:
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
        folder = require_file(root / name, "Wildlife Insights project folder")
        with require_file(folder / "deployments.csv", "deployments.csv").open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                dep = row["deployment_id"]
                project[dep] = name
                species.setdefault(dep, set())
                images.setdefault(dep, 0)
        with require_file(folder / "images.csv", "images.csv").open(newline="", encoding="utf-8") as f:
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
        folder = require_file(root / name, "Wildlife Insights project folder")
        with require_file(folder / "images.csv", "images.csv").open(newline="", encoding="utf-8") as f:
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
    path = require_file(Path(data_root) / SERENGETI_RELATIVE_PATH, "Snapshot Serengeti annotations")
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
