"""From an operator's label to a Camtrap DP observation type and scientific name.

A label is looked up in the species map first (``--species-map``: code or common name -> scientific name, or ->
one of the reserved words below), case-insensitively. What comes out is then read as:

- a word meaning nothing there (``blank``, ``empty``, ``none``, ``nothing``, ``no animal``): ``blank``;
- a person (``human``, ``person``, ``people``): ``human``; a vehicle (``vehicle``, ``car``): ``vehicle``;
- an animal nobody named (``unidentified``, ``unid``, ``unknown``): ``unknown``;
- anything else: ``animal``, with that text as ``scientificName``.

With a site config, every animal's scientific name must be in the site's species table (the loader would refuse
the package otherwise, and the IUCN category that sets a record's privacy budget comes from that table):
:func:`check_site_species` lists every name that is not, at once, with the fix.
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from shared.errors import DatasetError

__all__ = ["Label", "RESERVED_WORDS", "load_species_map", "classify", "check_site_species", "looks_scientific"]

RESERVED_WORDS: dict[str, str] = {
    **dict.fromkeys(("blank", "empty", "none", "nothing", "noanimal"), "blank"),
    **dict.fromkeys(("human", "humans", "person", "people"), "human"),
    **dict.fromkeys(("vehicle", "vehicles", "car"), "vehicle"),
    **dict.fromkeys(("unidentified", "unid", "unknown", "unknownanimal"), "unknown"),
}
"""Normalised label (lower case, letters only) -> observation type."""


@dataclass(frozen=True, order=True)
class Label:
    """An observation's type (``animal``, ``blank``, ``human``, ``vehicle``, ``unknown``) and, for an animal, its
    scientific name (``""`` otherwise)."""

    observation_type: str
    scientific_name: str = ""


def _key(text: str) -> str:
    return " ".join(text.split()).casefold()


def load_species_map(path: Path) -> dict[str, str]:
    """Read a species map: CSV (two columns, label then scientific name; a header naming ``scientificName`` picks
    that column and the first other one as the label) or YAML (a mapping ``label: scientific name``).

    Returns:
        ``{casefolded label: value}``.

    Raises:
        DatasetError: unreadable, empty, a label listed twice with different values, or an empty value.
    """
    if not path.is_file():
        raise DatasetError("species map not found", source=path, field="--species-map",
                           fix="pass a CSV (code,scientificName) or YAML (code: scientific name) file")
    try:
        text = path.read_text(encoding="utf-8-sig")
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
            if not isinstance(data, dict):
                raise DatasetError("expected a YAML mapping of label: scientific name", source=path,
                                   field="--species-map", fix="write one `CODE: Genus species` line per label")
            pairs = [(str(k), "" if v is None else str(v)) for k, v in data.items()]
        else:
            rows = [r for r in csv.reader(text.splitlines()) if any(c.strip() for c in r)]
            pairs = _csv_pairs(rows, path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, csv.Error) as exc:
        raise DatasetError(f"cannot read the species map: {exc}", source=path, field="--species-map",
                           fix="save it as UTF-8 CSV or YAML") from exc
    mapping: dict[str, str] = {}
    for label, value in pairs:
        label, value = label.strip(), " ".join(value.split())
        if not label:
            continue
        if not value:
            raise DatasetError(f"label {label!r} maps to nothing", source=path, field="--species-map",
                               fix="give its scientific name, or blank/human/vehicle/unknown")
        if _key(label) in mapping and mapping[_key(label)] != value:
            raise DatasetError(f"label {label!r} is mapped twice ({mapping[_key(label)]!r}, {value!r})", source=path,
                               field="--species-map", fix="keep one line per label")
        mapping[_key(label)] = value
    if not mapping:
        raise DatasetError("the species map is empty", source=path, field="--species-map",
                           fix="add one line per label: CODE,Genus species")
    return mapping


def _csv_pairs(rows: list[list[str]], path: Path) -> list[tuple[str, str]]:
    if not rows:
        return []
    if any(len(r) < 2 for r in rows):
        raise DatasetError("every row needs two columns: label, scientific name", source=path,
                           field="--species-map", fix="write rows like PBE,Prionailurus bengalensis")
    header = [re.sub(r"[^a-z]", "", c.lower()) for c in rows[0]]
    if "scientificname" in header:
        value = header.index("scientificname")
        label = next(i for i in range(len(header)) if i != value)
        return [(r[label], r[value]) for r in rows[1:]]
    return [(r[0], r[1]) for r in rows]


def classify(label: str, species_map: Mapping[str, str] | None = None) -> Label:
    """The observation a label stands for (see the module docstring)."""
    text = " ".join(label.split())
    text = (species_map or {}).get(text.casefold(), text)
    word = RESERVED_WORDS.get(re.sub(r"[^a-z]", "", text.casefold()))
    if word is not None:
        return Label(word)
    return Label("animal", text)


def looks_scientific(name: str) -> bool:
    """Whether ``name`` has the form of a binomial or a higher taxon (``Genus species``, ``Genus``, ``Felidae``):
    a capitalised word of letters, then lower-case words. A code such as ``PBE`` does not."""
    return re.fullmatch(r"[A-Z][a-z]+( [a-z][a-z.-]+){0,2}", name) is not None


def check_site_species(labels: Iterable[tuple[str, Label]], species: Iterable[str], *, site_config: Path,
                       mapped: bool) -> None:
    """Refuse animal names that are not in the site's species table, all of them in one error.

    Args:
        labels: ``(label as written, classified label)`` of every photo.
        species: the scientific names of the site's species table.
        site_config: the site config file (named in the message).
        mapped: whether a species map was given (the fix says so).

    Raises:
        DatasetError: naming each missing scientific name, the labels it came from and its photo count.
    """
    known = set(species)
    missing: Counter[str] = Counter()
    written: dict[str, set[str]] = {}
    for raw, label in labels:
        if label.observation_type == "animal" and label.scientific_name not in known:
            missing[label.scientific_name] += 1
            written.setdefault(label.scientific_name, set()).add(raw)
    if not missing:
        return
    listed = "; ".join(
        f"{name!r} ({count} photo(s)" + (f", from label(s) {sorted(written[name] - {name})}" if written[name] -
                                         {name} else "") + ")"
        for name, count in sorted(missing.items()))
    how = "fix the species map's entry" if mapped else "map the label to a listed name with --species-map FILE"
    raise DatasetError(
        f"{len(missing)} species are not in the site's species table: {listed}", source=site_config,
        field="species",
        fix=f"add each to `species:` in {site_config.name} (scientific_name, class_index, iucn_category), or {how}")
