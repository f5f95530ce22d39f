"""Which observations of a Camtrap DP package label a photo for training: the photo's current classification.

A site's package holds, for one photo, machine observations (``classificationMethod: machine``: the gateway's
detector and species head) and any number of human ones (``human``: a ranger's verdicts,
:mod:`edge_sdk.field.verdicts`; or the labels of a package built by ``wildfed-edge package``). A row that leaves
``classificationMethod`` empty counts as human: labels written by people in tools that predate the column.

The photo's current classification is

- its **last human verdict**: the human rows that share the ``classificationTimestamp`` and ``classifiedBy`` of the
  last human row in file order (the tables only grow, so file order is time order; a later verdict supersedes an
  earlier one);
- else, only with ``train_on: machine``, its **machine rows**, and only when every animal row among them names a
  species with ``classificationProbability >= machine_threshold``;
- else nothing: the photo does not train.

From the chosen rows, the ``animal`` rows with a ``scientificName`` give the photo's species and their ``bbox*``
columns its boxes (a row without a complete box stands for the whole photo). Rows of other types (``blank``,
``human``, ``vehicle``, ``unknown``, ``unclassified``) give no training record. Only media-level rows are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Labelled", "current_labels", "row_bbox"]

_BBOX = ("bboxX", "bboxY", "bboxWidth", "bboxHeight")


@dataclass(frozen=True)
class Labelled:
    """A photo's current classification.

    Attributes:
        species: scientific names of its animal rows (one, for a record that can train).
        boxes: normalised ``(x, y, w, h)`` boxes of those rows, in file order, without repeats; empty when a row
            stands for the whole photo.
        method: ``human`` or ``machine``.
        unlisted: species of machine rows that the site's table does not list (left out, reported by the loader).
    """

    species: frozenset[str]
    boxes: tuple[tuple[float, float, float, float], ...]
    method: str
    unlisted: frozenset[str] = frozenset()


def row_bbox(row: Mapping[str, str]) -> tuple[float, float, float, float] | None:
    """The row's normalised box, or None when any of ``bboxX/bboxY/bboxWidth/bboxHeight`` is empty.

    Raises:
        ValueError: a box value that is not a number in [0, 1], or a zero width or height.
    """
    raw = [(row.get(c) or "").strip() for c in _BBOX]
    if not all(raw):
        return None
    x, y, w, h = (float(v) for v in raw)
    if not all(0.0 <= v <= 1.0 for v in (x, y, w, h)) or w <= 0 or h <= 0:
        raise ValueError(f"bbox ({x}, {y}, {w}, {h}) is not a normalised box inside the photo")
    return x, y, w, h


def _method(row: Mapping[str, str]) -> str:
    return (row.get("classificationMethod") or "").strip().lower() or "human"


def _verdict(rows: list[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """The rows of the last human verdict among ``rows`` (file order)."""
    last = rows[-1]
    key = ((last.get("classificationTimestamp") or "").strip(), (last.get("classifiedBy") or "").strip())
    return [r for r in rows if ((r.get("classificationTimestamp") or "").strip(),
                                (r.get("classifiedBy") or "").strip()) == key]


def _labelled(rows: list[Mapping[str, str]], method: str, listed: Mapping[str, object] | None) -> Labelled | None:
    animals = [r for r in rows if (r.get("observationType") or "").strip() == "animal"
               and (r.get("scientificName") or "").strip()]
    if not animals:
        return None
    unlisted = frozenset()
    if method == "machine" and listed is not None:
        unlisted = frozenset(r["scientificName"].strip() for r in animals if r["scientificName"].strip() not in listed)
        animals = [r for r in animals if r["scientificName"].strip() in listed]
        if not animals:
            return Labelled(frozenset(), (), method, unlisted)
    boxes: list[tuple[float, float, float, float]] = []
    whole = False
    for r in animals:
        box = row_bbox(r)
        if box is None:
            whole = True
        elif box not in boxes:
            boxes.append(box)
    return Labelled(frozenset(r["scientificName"].strip() for r in animals), () if whole else tuple(boxes), method,
                    unlisted)


def current_labels(rows: Iterable[Mapping[str, str]], *, train_on: str = "verified",
                   machine_threshold: float = 0.95,
                   listed: Mapping[str, object] | None = None) -> dict[str, Labelled]:
    """Each photo's current classification (module docstring), by ``mediaID``.

    Args:
        rows: ``observations.csv`` rows in file order.
        train_on: ``verified`` or ``machine``.
        machine_threshold: the probability every machine animal row needs (``train_on: machine``).
        listed: the site's species table (names); machine rows of other species are left out of the record.

    Returns:
        ``{mediaID: Labelled}`` for the photos that have animal labels (possibly several species: the loader
        decides what to do with those).

    Raises:
        ValueError: an unknown ``train_on``, or a malformed box (the message names the observation).
    """
    if train_on not in ("verified", "machine"):
        raise ValueError(f"train_on must be 'verified' or 'machine', got {train_on!r}")
    by_media: dict[str, dict[str, list[Mapping[str, str]]]] = {}
    for row in rows:
        if (row.get("observationLevel") or "").strip() != "media" or not (row.get("mediaID") or "").strip():
            continue
        try:
            row_bbox(row)
        except ValueError as exc:
            raise ValueError(f"observation {row.get('observationID')!r}: {exc}") from None
        method = "machine" if _method(row) == "machine" else "human"
        by_media.setdefault(row["mediaID"].strip(), {}).setdefault(method, []).append(row)
    out: dict[str, Labelled] = {}
    for media_id, groups in by_media.items():
        if "human" in groups:
            labelled = _labelled(_verdict(groups["human"]), "human", None)
        elif train_on == "machine" and _confident(groups["machine"], machine_threshold):
            labelled = _labelled(groups["machine"], "machine", listed)
        else:
            labelled = None
        if labelled is not None:
            out[media_id] = labelled
    return out


def _confident(rows: list[Mapping[str, str]], threshold: float) -> bool:
    animals = [r for r in rows if (r.get("observationType") or "").strip() == "animal"]
    if not animals:
        return False
    for r in animals:
        try:
            p = float((r.get("classificationProbability") or "").strip())
        except ValueError:
            return False
        if not (r.get("scientificName") or "").strip() or p < threshold:
            return False
    return True
