"""Helpers of the packaging tests: small JPEGs with and without EXIF, a site config, and reading a package back."""

from __future__ import annotations

import csv
import datetime as dt
import os
from pathlib import Path

import yaml
from PIL import Image

from shared.camtrap_dp import media_id

FILE_TIME = dt.datetime(2023, 7, 14, 9, 15, 0, tzinfo=dt.timezone.utc)  # set with os.utime on photos without EXIF


def jpeg(path: Path, rgb: tuple[int, int, int], *, exif_time: str | None = None, size: tuple[int, int] = (64, 48),
         file_time: dt.datetime = FILE_TIME) -> Path:
    """A solid-colour JPEG; with ``exif_time`` (``YYYY:MM:DD hh:mm:ss``) as EXIF DateTimeOriginal; its modification
    time set to ``file_time``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    exif = Image.Exif()
    if exif_time is not None:
        exif.get_ifd(0x8769)[36867] = exif_time
    Image.new("RGB", size, rgb).save(path, format="JPEG", quality=95, exif=exif)
    os.utime(path, (file_time.timestamp(), file_time.timestamp()))
    return path


def site_config(tmp_path: Path, species: list[str], *, site_id: str = "site-07") -> Path:
    """A site.yaml whose species table lists ``species`` (classes 0.., category LC)."""
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "federation_id": "fed", "site_id": site_id, "dataset": "pkg", "private_key": "site.key",
        "coordinator_public_key": "coord.pub", "outbox": "outbox.sqlite",
        "species": [{"scientific_name": n, "class_index": i, "iucn_category": "LC"} for i, n in enumerate(species)]}))
    return path


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def digest(path: Path) -> str:
    return media_id(path.read_bytes())


def no_leftovers(parent: Path, keep: set[str]) -> bool:
    """Whether ``parent`` holds only ``keep`` (no temporary package folders)."""
    return {p.name for p in parent.iterdir()} <= keep
