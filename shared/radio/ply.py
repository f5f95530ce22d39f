"""A binary little-endian PLY mesh reader with numpy only (:func:`read_ply`), for the meshes of the sionna-rt city
scenes (:mod:`shared.radio.scenes`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.errors import ConfigError

__all__ = ["read_ply"]

# PLY scalar types -> little-endian numpy dtypes (both the PLY 1.0 names and the sized aliases).
_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "<i2", "int16": "<i2", "ushort": "<u2", "uint16": "<u2",
    "int": "<i4", "int32": "<i4", "uint": "<u4", "uint32": "<u4",
    "float": "<f4", "float32": "<f4", "double": "<f8", "float64": "<f8",
}


def read_ply(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a binary little-endian PLY mesh with numpy only.

    Supported: ``format binary_little_endian 1.0``; an ``element vertex`` with scalar properties including
    ``x``, ``y``, ``z`` (others such as normals, uv or colours are read and dropped); an ``element face`` with a
    single list property ``vertex_indices`` (or ``vertex_index``), any integer count and index types. Polygons
    with more than three corners are split into triangle fans.

    Args:
        path: the ``.ply`` file.

    Returns:
        ``(vertices, faces)``: float64 (N, 3) x, y, z in the file's units (metres for sionna-rt scenes), and
        int64 (M, 3) vertex indices of triangles.

    Raises:
        ConfigError (a ValueError, source = the file): an ASCII or big-endian file, an unknown element or property
            type, a missing x/y/z or face list, a truncated file, a face with fewer than 3 corners or an index out
            of range.
        OSError: the file cannot be read.

    Source: the PLY format description (Greg Turk, 1994; http://paulbourke.net/dataformats/ply/).
    """
    path = Path(path)
    raw = path.read_bytes()

    def bad(message: str) -> ConfigError:
        return ConfigError(message, source=path, field="ply", fix="use a binary little-endian PLY mesh")

    end = raw.find(b"end_header")
    if not raw.startswith(b"ply") or end < 0:
        raise bad("not a PLY file (no 'ply' magic or no end_header)")
    body_start = raw.index(b"\n", end) + 1
    lines = [ln.strip() for ln in raw[:end].decode("ascii", errors="replace").splitlines()[1:]]
    elements: list[tuple[str, int, list[tuple[str, ...]]]] = []
    for line in lines:
        words = line.split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "format":
            if words[1:] != ["binary_little_endian", "1.0"]:
                raise bad(f"unsupported format {' '.join(words[1:])!r}")
        elif words[0] == "element" and len(words) == 3 and words[2].isdigit():
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property" and elements:
            elements[-1][2].append(tuple(words[1:]))
        else:
            raise bad(f"unexpected header line {line!r}")

    vertices = faces = None
    offset = body_start
    for name, count, props in elements:
        if name == "vertex":
            if any(p[0] == "list" or p[0] not in _PLY_TYPES or len(p) != 2 for p in props):
                raise bad(f"vertex properties must be scalars of known types, got {props}")
            dtype = np.dtype([(p[1], _PLY_TYPES[p[0]]) for p in props])
            if not {"x", "y", "z"} <= set(dtype.names or ()):
                raise bad("vertex element lacks x, y or z")
            if offset + count * dtype.itemsize > len(raw):
                raise bad("truncated vertex data")
            table = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
            vertices = np.stack([table["x"], table["y"], table["z"]], axis=1).astype(np.float64)
            offset += count * dtype.itemsize
        elif name == "face":
            if (len(props) != 1 or len(props[0]) != 4 or props[0][0] != "list"
                    or props[0][3] not in ("vertex_indices", "vertex_index")
                    or props[0][1] not in _PLY_TYPES or props[0][2] not in _PLY_TYPES
                    or np.dtype(_PLY_TYPES[props[0][2]]).kind not in "iu"
                    or np.dtype(_PLY_TYPES[props[0][1]]).kind not in "iu"):
                raise bad(f"face element must have one integer list property vertex_indices, got {props}")
            faces, offset = _read_faces(raw, offset, count, np.dtype(_PLY_TYPES[props[0][1]]),
                                        np.dtype(_PLY_TYPES[props[0][2]]), bad)
        else:
            raise bad(f"unsupported element {name!r}")
    if vertices is None or faces is None:
        raise bad("needs a vertex and a face element")
    if faces.size and (faces.min() < 0 or faces.max() >= len(vertices)):
        raise bad("face vertex index out of range")
    return vertices, faces


def _read_faces(raw: bytes, offset: int, count: int, count_type: np.dtype, index_type: np.dtype,
                bad) -> tuple[np.ndarray, int]:
    """Face lists from ``raw[offset:]``: int64 (T, 3) triangles and the offset after the face element."""
    triangle = np.dtype([("n", count_type), ("i", index_type, (3,))])
    end = offset + count * triangle.itemsize
    if end <= len(raw):  # fast path: every face a triangle (all sionna-rt meshes)
        table = np.frombuffer(raw, dtype=triangle, count=count, offset=offset)
        if np.all(table["n"] == 3):
            return table["i"].astype(np.int64), end
    triangles: list[list[int]] = []
    for _ in range(count):  # general path: read each face's corner count
        if offset + count_type.itemsize > len(raw):
            raise bad("truncated face data")
        corners = int(np.frombuffer(raw, dtype=count_type, count=1, offset=offset)[0])
        offset += count_type.itemsize
        if corners < 3:
            raise bad(f"a face has {corners} corners")
        if offset + corners * index_type.itemsize > len(raw):
            raise bad("truncated face data")
        idx = np.frombuffer(raw, dtype=index_type, count=corners, offset=offset).astype(np.int64)
        offset += corners * index_type.itemsize
        triangles.extend([int(idx[0]), int(idx[k]), int(idx[k + 1])] for k in range(1, corners - 1))
    return np.asarray(triangles, dtype=np.int64).reshape(-1, 3), offset
