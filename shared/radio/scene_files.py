"""The files of sionna-rt's city scenes, read without importing ``sionna``: where a scene's Mitsuba XML is
(:func:`scene_path`) and its PLY shapes with the ground flagged (:func:`scene_meshes`). The rules (up axis, what is
ground) are in :mod:`shared.radio.scenes`, which exports all of this as before."""

from __future__ import annotations

import importlib.metadata
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ConfigError
from shared.radio.ply import read_ply

__all__ = ["GROUND_MAX_HEIGHT_M", "SCENES", "SceneMesh", "scene_meshes", "scene_path"]

SCENES = ("munich", "florence", "san_francisco", "etoile")
GROUND_MAX_HEIGHT_M = 1.0
_DISTRIBUTION = "sionna-rt"
_INSTALL_FIX = "pip install --no-deps sionna-rt==2.2.0"
_GROUND_NAME = re.compile(r"ground|plane|terrain", re.IGNORECASE)


def scene_path(scene: str) -> Path:
    """Path of the Mitsuba XML file of a sionna-rt city scene, found without importing ``sionna``.

    Args:
        scene: one of :data:`SCENES`.

    Returns:
        ``.../site-packages/sionna/rt/scenes/<scene>/<scene>.xml`` (an existing file).

    Raises:
        ConfigError (a ValueError, field ``city``): ``scene`` is not one of :data:`SCENES`, the ``sionna-rt``
            distribution is not installed, or its scene file is missing (fix: ``pip install --no-deps
            sionna-rt==2.2.0``).

    Source: the wheel's layout, ``sionna/rt/scenes/<name>/<name>.xml`` (sionna-rt 2.2.0).
    """
    if not isinstance(scene, str) or scene not in SCENES:
        raise ConfigError(f"unknown city scene {scene!r}; known: {', '.join(SCENES)}", field="city",
                          fix=f"use one of {', '.join(SCENES)}")
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the {_DISTRIBUTION} distribution (which ships the city scenes) is not installed",
                          field="city", fix=_INSTALL_FIX) from None
    path = Path(str(dist.locate_file(f"sionna/rt/scenes/{scene}/{scene}.xml")))
    if not path.is_file():
        raise ConfigError(f"scene file {path} is missing from {_DISTRIBUTION} {dist.version}", field="city",
                          fix=_INSTALL_FIX)
    return path


@dataclass(frozen=True, eq=False)
class SceneMesh:
    """One ``<shape type="ply">`` of a scene.

    Attributes:
        shape_id: the shape's ``id`` attribute (e.g. ``"mesh-Altes_Rathaus-itu_marble"``).
        material: the id of its BSDF (``<ref name="bsdf">``), e.g. ``"marble"``, or ``""``.
        path: the PLY file.
        vertices: float64 (N, 3) x, y, z in metres (z up).
        faces: int64 (M, 3) triangle vertex indices.
        is_ground: True if the mesh is ground by the rule of :mod:`shared.radio.scenes` (name/BSDF says ground, plane or terrain, or
            a flat sheet below 1 m).
    """

    shape_id: str
    material: str
    path: Path
    vertices: np.ndarray
    faces: np.ndarray
    is_ground: bool

    @property
    def height_m(self) -> float:
        """z extent (max z - min z) of the mesh in metres; 0.0 for an empty mesh."""
        return float(np.ptp(self.vertices[:, 2])) if len(self.vertices) else 0.0


def scene_meshes(scene: str) -> list[SceneMesh]:
    """All PLY shapes of a sionna-rt city scene, in XML order, with the ground flagged.

    Args:
        scene: one of :data:`SCENES`.

    Returns:
        one :class:`SceneMesh` per ``<shape type="ply">`` (file names are relative to the XML's folder).

    Raises:
        ConfigError (a ValueError): the scene is unknown or not installed (field ``city``), the XML does not parse
            or a shape has no file name (source = the XML), or a PLY file is malformed (source = the PLY).

    Source: Mitsuba 3 scene format (``<shape type="ply"><string name="filename" .../><ref name="bsdf" .../>``).
    """
    xml_path = scene_path(scene)
    try:
        root = ET.parse(xml_path).getroot()
    except ET.ParseError as exc:
        raise ConfigError(f"scene XML does not parse: {exc}", source=xml_path, field="city",
                          fix=_INSTALL_FIX) from None
    meshes = []
    for shape in root.iter("shape"):
        if shape.get("type") != "ply":
            continue
        name = shape.find("string[@name='filename']")
        if name is None or not name.get("value"):
            raise ConfigError(f"shape {shape.get('id')!r} has no filename", source=xml_path, field="city",
                              fix=_INSTALL_FIX)
        ref = shape.find("ref[@name='bsdf']")
        material = "" if ref is None else ref.get("id", "")
        path = xml_path.parent / name.get("value")
        vertices, faces = read_ply(path)
        shape_id = shape.get("id", "")
        top = float(vertices[:, 2].max()) if len(vertices) else 0.0
        height = float(np.ptp(vertices[:, 2])) if len(vertices) else 0.0
        ground = bool(_GROUND_NAME.search(shape_id) or _GROUND_NAME.search(path.stem)
                      or _GROUND_NAME.search(material)
                      or (height < GROUND_MAX_HEIGHT_M and top < GROUND_MAX_HEIGHT_M))
        meshes.append(SceneMesh(shape_id, material, path, vertices, faces, ground))
    return meshes
