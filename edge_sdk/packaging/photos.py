"""What every input reader of ``wildfed-edge package`` returns: the labelled photos, one value each.

A reader (folder tree, labels CSV, Timelapse export, MegaDetector output) only finds photos and what the operator
said about them; turning labels into observations, hashing, timestamps and boxes is the builder's
(:mod:`edge_sdk.packaging.build`), the same for every input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SourceBox", "SourcePhoto", "ReadResult"]


@dataclass(frozen=True)
class SourceBox:
    """One box of a detector's output file.

    Attributes:
        category: the detector's category name (MegaDetector: ``animal``, ``person``, ``vehicle``).
        confidence: the detector's score in [0, 1].
        bbox: ``(x_min, y_min, width, height)``, fractions of the image's width and height (MegaDetector and
            Camtrap DP convention).
    """

    category: str
    confidence: float
    bbox: tuple[float, float, float, float]


@dataclass(frozen=True)
class SourcePhoto:
    """One photo and what the input says about it.

    Attributes:
        path: the image file.
        label: the operator's label as written (a code such as ``PBE``, a common or scientific name, or a word
            for blank, human, vehicle or unidentified); never empty (readers leave unlabelled photos out).
        deployment: the deployment's name within the site (``deploymentID`` is ``SITE/<deployment>``).
        table_time: the capture time the input table gives, as written (None: the input has none).
        boxes: boxes from a detector output file (None: the input has none for this photo).
        origin: where the photo was named, for messages (``labels.csv row 7``, a folder).
    """

    path: Path
    label: str
    deployment: str
    table_time: str | None = None
    boxes: tuple[SourceBox, ...] | None = None
    origin: str = ""


@dataclass
class ReadResult:
    """A reader's output: the labelled photos, in input order, and what it left out (``reason -> count``, each
    reason a short sentence the command prints) plus notes worth a line of their own."""

    photos: list[SourcePhoto] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, count: int = 1) -> None:
        """Count ``count`` inputs left out for ``reason``."""
        self.skipped[reason] = self.skipped.get(reason, 0) + count
