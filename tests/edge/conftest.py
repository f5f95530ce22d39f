"""Fixtures for the gateway tests: a tiny Camtrap DP package written by the test, and key pairs."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tests.support import SHARED_DATA

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PACKAGE = SHARED_DATA / "camtrap-dp-example"

DEPLOYMENT_COLUMNS = ["deploymentID", "locationID", "latitude", "longitude", "deploymentStart", "deploymentEnd"]
MEDIA_COLUMNS = ["mediaID", "deploymentID", "captureMethod", "timestamp", "filePath", "filePublic", "fileName",
                 "fileMediatype"]
OBSERVATION_COLUMNS = ["observationID", "deploymentID", "mediaID", "eventID", "eventStart", "eventEnd",
                       "observationLevel", "observationType", "scientificName", "count"]

# Solid RGB colours and their ITU-R 601-2 luma (Pillow "L"): L = 0.299 R + 0.587 G + 0.114 B, rounded.
#   (100, 150, 200): 29.9 + 88.05 + 22.8 = 140.75 -> 141
#   (255, 0, 0):     76.245                      -> 76
#   (0, 0, 255):     29.07                       -> 29
COLOURS = {"m1": ((100, 150, 200), 141), "m2": ((255, 0, 0), 76), "m3": ((0, 0, 255), 29), "m4": ((0, 0, 255), 29)}

SPECIES = {"Loxodonta cyclotis": (0, "CR"), "Equus quagga": (1, "NT")}


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})


def write_package(root: Path, *, drop_column: tuple[str, str] | None = None,
                  extra_observations: list[dict[str, str]] | None = None) -> Path:
    """A 4-media package:

    - m1: elephant (CR), file at a relative filePath ``media/sub/m1.png`` (filePath wins);
    - m2: zebra (NT), filePath is a URL, file at ``media/m2.png`` (fileName fallback);
    - m3: blank observation only (not a record);
    - m4: two media-level zebra observations (one record), plus an event-level elephant observation (ignored).

    Expected records in media order: m1 (label 0, rank 1), m2 (label 1, rank 4), m4 (label 1, rank 4).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "media" / "sub").mkdir(parents=True, exist_ok=True)
    for media_id, (rgb, _) in COLOURS.items():
        target = root / "media" / ("sub" if media_id == "m1" else "") / f"{media_id}.png"
        Image.new("RGB", (40, 30), rgb).save(target)
    deployments = [{"deploymentID": "d1", "locationID": "l1", "latitude": "0.5", "longitude": "11.2",
                    "deploymentStart": "2024-01-01T00:00:00Z", "deploymentEnd": "2024-02-01T00:00:00Z"}]
    media = [
        {"mediaID": "m1", "deploymentID": "d1", "filePath": "media/sub/m1.png", "fileName": "other.png"},
        {"mediaID": "m2", "deploymentID": "d1", "filePath": "https://example.org/m2", "fileName": "m2.png"},
        {"mediaID": "m3", "deploymentID": "d1", "filePath": "https://example.org/m3", "fileName": "m3.png"},
        {"mediaID": "m4", "deploymentID": "d1", "filePath": "https://example.org/m4", "fileName": "m4.png"},
    ]
    for row in media:
        row.update(captureMethod="activityDetection", timestamp="2024-01-02T00:00:00Z", filePublic="true",
                   fileMediatype="image/png")
    observations = [
        {"observationID": "o1", "mediaID": "m1", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Loxodonta cyclotis", "count": "1"},
        {"observationID": "o2", "mediaID": "m2", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Equus quagga", "count": "1"},
        {"observationID": "o3", "mediaID": "m3", "observationLevel": "media", "observationType": "blank"},
        {"observationID": "o4a", "mediaID": "m4", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Equus quagga", "count": "1"},
        {"observationID": "o4b", "mediaID": "m4", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Equus quagga", "count": "2"},
        {"observationID": "e1", "mediaID": "", "observationLevel": "event", "observationType": "animal",
         "scientificName": "Loxodonta cyclotis", "count": "1"},
    ] + list(extra_observations or [])
    for row in observations:
        row.update(deploymentID="d1", eventID="ev1")
    tables = {"deployments": (DEPLOYMENT_COLUMNS, deployments), "media": (MEDIA_COLUMNS, media),
              "observations": (OBSERVATION_COLUMNS, observations)}
    for name, (columns, rows) in tables.items():
        if drop_column and drop_column[0] == name:
            columns = [c for c in columns if c != drop_column[1]]
        _write_csv(root / f"{name}.csv", columns, rows)
    return root


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """The tiny package of :func:`write_package`."""
    return write_package(tmp_path / "pkg")


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """Factory for variants of the tiny package."""
    counter = iter(range(1000))
    return lambda **kw: write_package(tmp_path / f"pkg{next(counter)}", **kw)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator for test data (not for privacy noise)."""
    return np.random.default_rng(12345)
