"""Reader: a folder tree sorted by species, the camtrapR layout.

``ROOT/STATION/SPECIES/*.jpg`` (each station a deployment, camtrapR's ``inDir`` with species sub-folders) or
``ROOT/SPECIES/*.jpg`` (one deployment, named by ``--deployment`` or else after ROOT). The species folder's name
is the label (a code such as ``PBE``, a name, or ``UNID`` for unidentified; :mod:`edge_sdk.packaging.labels`).
Hidden files and folders are ignored; other files that are not images (a camtrapR folder may hold videos) are left
out and counted. Photos at another depth, or a tree mixing both layouts, are refused: the label would be a guess.
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import DatasetError

from edge_sdk.inference.records import IMAGE_SUFFIXES
from edge_sdk.packaging.photos import ReadResult, SourcePhoto

__all__ = ["read_folder"]


def read_folder(root: Path, *, deployment: str | None = None) -> ReadResult:
    """The labelled photos of a species-sorted folder tree (see the module docstring), sorted by path.

    Args:
        root: the top folder.
        deployment: the deployment of a one-deployment tree (default: ``root``'s name); a tree with station
            folders takes its deployments from them and notes that the option was not used.

    Raises:
        DatasetError: ``root`` is not a folder, holds no photos, or photos lie at another depth than the layout's.
    """
    if not root.is_dir():
        raise DatasetError("folder not found", source=root, fix="pass the top folder of the species-sorted photos")
    result = ReadResult()
    by_depth: dict[int, list[Path]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            result.skip(f"files that are not photos ({', '.join(IMAGE_SUFFIXES)}), e.g. videos")
            continue
        by_depth.setdefault(len(rel.parts), []).append(path)
    if not by_depth:
        raise DatasetError("no photos found", source=root,
                           fix="pass the folder holding STATION/SPECIES/*.jpg or SPECIES/*.jpg")
    if set(by_depth) - {2, 3} or len(by_depth) > 1:
        odd = min(by_depth, key=lambda d: (d in (2, 3), len(by_depth[d])))  # the odd one out
        example = by_depth[odd][0].relative_to(root)
        raise DatasetError(
            f"photos lie at {len(by_depth)} different depths or at an unexpected one (e.g. {example}): the layout is "
            "STATION/SPECIES/photo or SPECIES/photo", source=root,
            fix="sort every photo into a species folder (inside a station folder for several deployments)")
    (depth, photos), = by_depth.items()
    if depth == 3 and deployment:
        result.notes.append(f"--deployment {deployment!r} not used: the deployments are the station folders")
    for path in photos:
        parts = path.relative_to(root).parts
        station = parts[0] if depth == 3 else (deployment or root.resolve().name)
        result.photos.append(SourcePhoto(path=path, label=parts[-2], deployment=station,
                                         origin=str(path.relative_to(root).parent)))
    return result
