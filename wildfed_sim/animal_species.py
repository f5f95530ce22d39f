"""The demo's species table: each Animal-MNIST class (:data:`CLASS_NAMES`) and the wild or domestic species it stands
for, with that species' IUCN Red List category (:data:`SPECIES_TABLE`), which sets the records' CCDP budgets and
names them in Camtrap DP. Re-exported by :mod:`wildfed_sim.animal_mnist`, the dataset's loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.iucn import IUCNCategory

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "SpeciesEntry", "SpeciesTable", "SPECIES_TABLE"]

CLASS_NAMES: tuple[str, ...] = (
    "bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra",
)
"""Class name of each label value 0-9 (confirmed by looking at a rendered grid of the images)."""
NUM_CLASSES = len(CLASS_NAMES)


@dataclass(frozen=True, slots=True)
class SpeciesEntry:
    """One Animal-MNIST class and the wild (or domestic) species it stands for in the demo.

    Attributes:
        class_index: label value in the dataset, 0-9.
        class_name: the dataset's class name (``CLASS_NAMES[class_index]``).
        scientific_name: binomial written into Camtrap DP ``observations.scientificName``.
        common_name: English vernacular name.
        iucn: IUCN Red List category of that species (``NE`` for domestic forms, which the Red List does not
            assess); it decides the record's CCDP privacy budget.
    """

    class_index: int
    class_name: str
    scientific_name: str
    common_name: str
    iucn: IUCNCategory


@dataclass(frozen=True, slots=True)
class SpeciesTable:
    """The class -> species -> IUCN category table, looked up by label or by scientific name.

    Raises:
        ValueError: on construction, if class indices are not exactly ``0..n-1`` in order or a scientific
            name repeats (the mapping must be invertible for a Camtrap DP loader).
    """

    entries: tuple[SpeciesEntry, ...]
    _by_name: dict[str, SpeciesEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        indices = [e.class_index for e in self.entries]
        if indices != list(range(len(self.entries))):
            raise ValueError(f"species table class indices must be 0..{len(self.entries) - 1} in order, got {indices}")
        by_name = {e.scientific_name: e for e in self.entries}
        if len(by_name) != len(self.entries):
            raise ValueError("species table has a repeated scientific name; each class needs its own")
        object.__setattr__(self, "_by_name", by_name)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[SpeciesEntry]:
        return iter(self.entries)

    def __getitem__(self, class_index: int) -> SpeciesEntry:
        """Entry for label ``class_index`` (raises ``IndexError`` outside ``0..len-1``)."""
        if not 0 <= int(class_index) < len(self.entries):
            raise IndexError(f"class index {class_index} outside 0..{len(self.entries) - 1}")
        return self.entries[int(class_index)]

    def by_scientific_name(self, name: str) -> SpeciesEntry:
        """Entry whose ``scientific_name`` is ``name``.

        Raises:
            KeyError: unknown name (the message lists the known ones).
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown scientific name {name!r}; known: {sorted(self._by_name)}") from None

    @property
    def scientific_names(self) -> tuple[str, ...]:
        """Scientific names in label order."""
        return tuple(e.scientific_name for e in self.entries)

    def to_config(self) -> list[dict[str, object]]:
        """Plain rows (``class_index``, ``class_name``, ``scientific_name``, ``common_name``, ``iucn`` as its
        enum name, e.g. ``"CR"``) for a site config file."""
        return [
            {
                "class_index": e.class_index,
                "class_name": e.class_name,
                "scientific_name": e.scientific_name,
                "common_name": e.common_name,
                "iucn": e.iucn.name,
            }
            for e in self.entries
        ]


SPECIES_TABLE = SpeciesTable(
    entries=(
        SpeciesEntry(0, "bear", "Ursus maritimus", "polar bear", IUCNCategory.VU),
        SpeciesEntry(1, "bird", "Passer domesticus", "house sparrow", IUCNCategory.LC),
        SpeciesEntry(2, "cat", "Felis silvestris", "European wildcat", IUCNCategory.LC),
        SpeciesEntry(3, "cow", "Bos taurus", "domestic cattle", IUCNCategory.NE),
        SpeciesEntry(4, "dog", "Lycaon pictus", "African wild dog", IUCNCategory.EN),
        SpeciesEntry(5, "elephant", "Loxodonta cyclotis", "African forest elephant", IUCNCategory.CR),
        SpeciesEntry(6, "giraffe", "Giraffa camelopardalis", "giraffe", IUCNCategory.VU),
        SpeciesEntry(7, "horse", "Equus caballus", "domestic horse", IUCNCategory.NE),
        SpeciesEntry(8, "sheep", "Ovis aries", "domestic sheep", IUCNCategory.NE),
        SpeciesEntry(9, "zebra", "Equus quagga", "plains zebra", IUCNCategory.NT),
    )
)
"""The demo's species table. Red List categories as assessed by IUCN (Loxodonta cyclotis CR 2021, Lycaon pictus
EN 2012, Giraffa camelopardalis VU 2016, Ursus maritimus VU 2015, Equus quagga NT 2016, Passer domesticus LC,
Felis silvestris LC); domestic cattle, horse and sheep are not evaluated (NE)."""
