"""Sites made of the real camera-trap photos in ``../shared/data``, built the way an operator builds them: with
``wildfed-edge package`` (a labels CSV, or a folder tree by species; the detector's boxes on every labelled photo).

Two small reserves:

- **ENA24** (eastern North America; 21 photos, 7 species x 3): three sites, each holding one photo of every
  species (the k-th by file name), so a held-out site's species are all held by the others;
- **camtrapR** (Borneo; 68 photos of 5 species and an unidentified animal at three stations): one site per
  station. A held-out station is scored only on the species another station holds (the leopard cat and the Malay
  civet are at all three; the macaque only at B, the moonrat and mouse-deer only at C).

IUCN categories are those of the Mammal Diversity Database (September 2020, ``../shared/data/iucn``) for the
mammals: Macaca nemestrina EN, every other mammal here LC; the American crow is LC (BirdLife) and the chicken, a
domestic animal, NE. The species tables name them by scientific name; the maps from the datasets' own labels are
:data:`ENA24_NAMES` and :data:`CAMTRAPR_NAMES`.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from wildfed_sim.detections import SHARED_DATA

__all__ = ["DATA_DIR", "ENA24_NAMES", "CAMTRAPR_NAMES", "CATEGORIES", "SiteSource", "Reserve", "reserve",
           "build_sites"]

DATA_DIR = SHARED_DATA
"""``../shared/data`` beside the repository."""

ENA24_NAMES = {"Virginia Opossum": "Didelphis virginiana", "Eastern Fox Squirrel": "Sciurus niger",
               "American Black Bear": "Ursus americanus", "American Crow": "Corvus brachyrhynchos",
               "Striped Skunk": "Mephitis mephitis", "Chicken": "Gallus gallus domesticus",
               "Grey Fox": "Urocyon cinereoargenteus"}
CAMTRAPR_NAMES = {"PBE": "Prionailurus bengalensis", "VTA": "Viverra tangalunga", "MNE": "Macaca nemestrina",
                  "EGY": "Echinosorex gymnura", "TRA": "Tragulus kanchil"}
CATEGORIES = {name: "LC" for name in [*ENA24_NAMES.values(), *CAMTRAPR_NAMES.values()]}
CATEGORIES.update({"Macaca nemestrina": "EN", "Gallus gallus domesticus": "NE"})


@dataclass(frozen=True)
class SiteSource:
    """One site of a reserve: its id and the Camtrap DP package ``wildfed-edge package`` built for it."""

    site_id: str
    package: Path


@dataclass(frozen=True)
class Reserve:
    """A reserve's class table (index -> scientific name, the federation's model classes) and its sites."""

    name: str
    classes: tuple[str, ...]
    sites: tuple[SiteSource, ...]

    def species_table(self) -> list[dict]:
        """The site config's ``species:`` entries for every class (each site trains only the species its package
        labels, so listing all is harmless and names every class)."""
        return [{"scientific_name": n, "class_index": i, "iucn_category": CATEGORIES[n]}
                for i, n in enumerate(self.classes)]


def _package(out: Path, site: str, args: list[str], species_map: Path) -> Path:
    """Run ``wildfed-edge package`` as an operator would (a subprocess of this interpreter)."""
    if (out / "datapackage.json").is_file():
        return out
    cmd = [sys.executable, "-m", "edge_sdk.cli", "package", str(out), "--site", site, *args,
           "--species-map", str(species_map), "--boxes", "detect"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"wildfed-edge package failed for {site} ({done.returncode}):\n{done.stdout}\n"
                           f"{done.stderr}")
    return out


def _species_map(path: Path, names: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["code", "scientificName"])
        writer.writerows(sorted(names.items()))
    return path


def _ena24(work: Path) -> Reserve:
    src = DATA_DIR / "ena24-small"
    with (src / "labels.csv").open(newline="", encoding="utf-8") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda r: r["filepath"])
    by_label: dict[str, list[dict]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    species_map = _species_map(work / "ena24-species.csv", ENA24_NAMES)
    sites = []
    for k in range(3):
        site = f"ena24-{'abc'[k]}"
        labels = work / f"{site}-labels.csv"
        with labels.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["filepath", "label"])
            writer.writeheader()
            writer.writerows({"filepath": r["filepath"], "label": r["label"]} for r in
                             (by_label[label][k] for label in sorted(by_label)))
        out = _package(work / site, site, ["--from", "labels", str(labels), "--images", str(src),
                                           "--deployment", "cam"], species_map)
        sites.append(SiteSource(site, out))
    return Reserve("ena24", tuple(sorted(ENA24_NAMES.values())), tuple(sites))


def _camtrapr(work: Path) -> Reserve:
    src = DATA_DIR / "camtrapr-sample"
    species_map = _species_map(work / "camtrapr-species.csv", CAMTRAPR_NAMES)
    sites = []
    for station in ("StationA", "StationB", "StationC"):
        site = f"borneo-{station[-1].lower()}"
        out = _package(work / site, site, ["--from", "folder", str(src / station), "--deployment", station],
                       species_map)
        sites.append(SiteSource(site, out))
    return Reserve("camtrapr", tuple(sorted(CAMTRAPR_NAMES.values())), tuple(sites))


def reserve(name: str, work: Path) -> Reserve:
    """Build (once; kept under ``work``) the sites of ``ena24`` or ``camtrapr``.

    Raises:
        FileNotFoundError: ``../shared/data`` is absent. ValueError: another name. RuntimeError: packaging failed.
    """
    if not DATA_DIR.is_dir():
        raise FileNotFoundError(f"the real photos are not at {DATA_DIR} (../shared/data beside the repository)")
    builders = {"ena24": _ena24, "camtrapr": _camtrapr}
    if name not in builders:
        raise ValueError(f"unknown reserve {name!r}; use one of {sorted(builders)}")
    target = work / name
    target.mkdir(parents=True, exist_ok=True)
    return builders[name](target)


def build_sites(names: list[str], work: Path) -> list[Reserve]:
    """:func:`reserve` for each name."""
    return [reserve(n, work) for n in names]
