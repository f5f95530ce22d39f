"""Ray-traced radio maps from Sionna RT on the real city scenes it ships, cached per tile as npz.

The COST 231 generator (:mod:`shared.radio.pathloss`) follows the direct ray only. This module runs NVIDIA's
Sionna RT (``sionna-rt`` 2.2.0, on Mitsuba 3.9.1 / Dr.Jit 1.5.0; Apache-2.0) on the meshes of the same four
OpenStreetMap city scenes (munich, florence, san_francisco, etoile; ODbL), so the maps have reflections and
transmission through walls with the ITU radio materials of the scene files. Each map is computed on one disjoint
256 m tile of :func:`shared.radio.scenes.scene_grid`, on the same 64 x 64 px grid (4 m/px) as the COST 231 maps.

What one tile's trace does (Sionna RT documentation, "Radio Maps" and ``RadioMapSolver``):

1. **Scene.** ``sionna.rt.load_scene(sionna.rt.scene.<name>)``, ``scene.frequency`` = ``frequency_hz`` (3.5 GHz),
   one isotropic vertically polarised antenna at both ends (``PlanarArray(1, 1, pattern="iso",
   polarization="V")``).
2. **Ground height.** The scene's ground meshes (:func:`shared.radio.scenes.scene_meshes`, ``is_ground``) are loaded
   alone into a Mitsuba scene and a vertical ray is cast down at every point that needs a height (z = 0 where a
   ray misses). munich, florence and etoile have flat ground at z = 0; san_francisco's terrain spans 0-104 m.
3. **Measurement surface.** A mesh with two triangles per pixel, its vertices at the pixel corners (row 0 north)
   and ``rx_height_m`` above the ground. ``RadioMapSolver`` gives each triangle the path gain averaged over it
   (linear, unitless); a pixel's value is the mean over its two triangles.
4. **Transmitters.** At pixel centres, ``tx_height_m`` (6 m) above the ground, ``batch`` at a time. Every transmitter
   is an outdoor pixel of a grid with step ``tx_step_px`` (:func:`bank_positions`).
5. **Samples.** Each batch is traced with ``samples_per_tx`` rays per transmitter, ``max_depth`` interactions
   (specular reflection and refraction through walls on; diffuse reflection and diffraction off by default),
   seed ``seed``. While the fraction of outdoor pixels with a value (path gain > 0) averaged over the batch is
   below ``min_coverage``, the sample count is doubled (up to ``max_samples_per_tx``) and the batch traced again.
   Measured on Munich (4 transmitters 1.5 m above a measurement plane, 2 shared CPU cores): depth 12 gives 0.74 of outdoor pixels a value at 1e6
   samples and 0.79 at 3e6; depth 20 gives 0.93 at 1e6, 0.97 at 3e6 and 0.99 at 1e7 (8, 25 and 91 s per map).
   Depth limits coverage more than samples do, hence the default depth 20; with the transmitters at 6 m, 10^6 rays
   gave 0.93-0.99 of the outdoor pixels a value on every tile tried (docs/radiomap-data.md).

Files (``<out>/<scene>/<scene>-r<row>c<col>-<hash>.npz``, written by :func:`write_tile`): ``buildings`` bool
(H, W), ``transmitters`` int64 (n, 2), ``path_gain`` float32 (n, H, W) linear (0 where no ray arrived),
``samples_per_tx`` int64 (n,), ``coverage`` float64 (n,), ``elapsed_s`` float64 (), and ``key``, the canonical
JSON of everything the maps depend on (:func:`tile_key`); ``<hash>`` is the first 12 hex digits of its SHA-256.
``<out>/manifest.json`` lists the settings and the tiles written (format ``wildfed.sionna-radiomaps/1``); one
folder holds one settings. :class:`SionnaBank` reads them back without importing Sionna.

Installing (never needed by the default test suite): Debian's ``libllvm19`` and ``DRJIT_LIBLLVM_PATH`` pointing
at it (Dr.Jit's CPU backend; the LLVM 14 and 15 of Debian 12 crash it), and sionna-rt's dependencies; see
:data:`INSTALL_STEPS` and docs/radiomap-data.md.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ConfigError, DatasetError
from shared.radio.dataset import RadioMapGeometry
from shared.radio.scenes import SceneTile, scene_grid, scene_meshes

__all__ = [
    "INSTALL_STEPS",
    "MANIFEST_FORMAT",
    "SionnaUnavailable",
    "SionnaSettings",
    "TracedTile",
    "llvm_library",
    "check_sionna",
    "bank_positions",
    "tile_key",
    "tile_file",
    "write_tile",
    "read_tile",
    "trace_tile",
    "generate_sionna_set",
    "SionnaBank",
]

MANIFEST_FORMAT = "wildfed.sionna-radiomaps/1"
_REQUIRED_MODULES = ("drjit", "mitsuba", "sionna", "importlib_resources", "ipywidgets", "pythreejs", "IPython",
                     "scipy", "matplotlib")
_LLVM_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libLLVM-19.so", "/usr/lib/aarch64-linux-gnu/libLLVM-19.so",
                    "/usr/lib/*-linux-gnu/libLLVM.so.19*", "/usr/lib/llvm-19/lib/libLLVM*.so*")
INSTALL_STEPS = ("apt-get install -y libllvm19; export DRJIT_LIBLLVM_PATH=/usr/lib/x86_64-linux-gnu/libLLVM-19.so; "
                 "pip install mitsuba==3.9.1 drjit==1.5.0 'importlib_resources>=6.4.5' 'ipywidgets>=8.1.5' "
                 "'pythreejs>=2.4.2'; pip install --no-deps sionna-rt==2.2.0 (docs/radiomap-data.md)")


class SionnaUnavailable(ConfigError):
    """Sionna RT cannot run here: a Python package or Debian's libllvm19 is missing, or ``DRJIT_LIBLLVM_PATH`` points
    at a library that is missing or known to crash Dr.Jit. The message names what is missing; ``fix`` gives
    :data:`INSTALL_STEPS`."""


@dataclass(frozen=True)
class SionnaSettings:
    """What a traced tile depends on (module docstring, steps 1-5); defaults are WildFed's Sionna set.

    Attributes:
        frequency_hz: carrier in Hz (3.5 GHz, as the COST 231 maps: 5G NR band n78).
        tx_height_m: transmitter height above the ground in metres (6 m: a lamp-post small cell, below most roofs).
        rx_height_m: height of the measurement surface above the ground in metres (1.5 m, a handset). The two
            must differ by at least 0.5 m: a transmitter on the measurement surface sends its direct rays along
            it, so they never cross it and the radio map misses the line of sight (checked: with both at 1.5 m,
            line-of-sight pixels of Munich came out 3 dB below Friis, carried by the ground reflection alone;
            with 3 m or 6 m in free space, within 0.02 dB of Friis).
        max_depth: most interactions per path (reflections and refractions), >= 1.
        samples_per_tx: rays per transmitter of the first trace, >= 1000.
        max_samples_per_tx: the doubling stops here.
        min_coverage: target fraction of outdoor pixels with a value, averaged over a batch, in (0, 1].
        refraction, specular_reflection, diffuse_reflection, diffraction: ``RadioMapSolver`` switches.
        seed: the solver's seed, >= 0.
        tx_step_px: transmitters on outdoor pixels of a grid of this step (offset ``step // 2``), >= 1.
        tx_per_tile: at most this many of those (a seeded, spread-out subset, :func:`bank_positions`); None: all.
        batch: transmitters traced in one solver call, >= 1.

    Raises:
        ConfigError (a ValueError): a field out of range, naming it.
    """

    frequency_hz: float = 3.5e9
    tx_height_m: float = 6.0
    rx_height_m: float = 1.5
    max_depth: int = 20
    samples_per_tx: int = 1_000_000
    max_samples_per_tx: int = 8_000_000
    min_coverage: float = 0.9
    refraction: bool = True
    specular_reflection: bool = True
    diffuse_reflection: bool = False
    diffraction: bool = False
    seed: int = 0
    tx_step_px: int = 2
    tx_per_tile: int | None = None
    batch: int = 8

    def __post_init__(self) -> None:
        for name in ("frequency_hz", "tx_height_m", "rx_height_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                   and value > 0):
                raise ConfigError(f"must be a number > 0, got {value!r}", field=name,
                                  fix="give it in SI units (Hz, metres)")
        if abs(self.tx_height_m - self.rx_height_m) < 0.5:
            raise ConfigError(f"must differ from rx_height_m ({self.rx_height_m} m) by >= 0.5 m, got "
                              f"{self.tx_height_m} m", field="tx_height_m",
                              fix="raise the transmitter (default 6 m): on the measurement surface its direct rays "
                                  "are never counted")
        ints = {"max_depth": 1, "samples_per_tx": 1000, "max_samples_per_tx": 1000, "seed": 0, "tx_step_px": 1,
                "batch": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"must be an int >= {low}, got {value!r}", field=name, fix=f"use e.g. {low}")
        if self.max_samples_per_tx < self.samples_per_tx:
            raise ConfigError(f"must be >= samples_per_tx ({self.samples_per_tx}), got {self.max_samples_per_tx}",
                              field="max_samples_per_tx", fix="raise it or lower samples_per_tx")
        if self.tx_per_tile is not None and (isinstance(self.tx_per_tile, bool) or not isinstance(self.tx_per_tile, int)
                                             or self.tx_per_tile < 1):
            raise ConfigError(f"must be None or an int >= 1, got {self.tx_per_tile!r}", field="tx_per_tile",
                              fix="leave it out for every grid position, or give a count")
        if isinstance(self.min_coverage, bool) or not isinstance(self.min_coverage, (int, float)) \
                or not 0 < self.min_coverage <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.min_coverage!r}", field="min_coverage",
                              fix="use e.g. 0.9")
        for name in ("refraction", "specular_reflection", "diffuse_reflection", "diffraction"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"must be a bool, got {getattr(self, name)!r}", field=name, fix="use True or False")


# ---------------------------------------------------------------------------------------------- availability
def _llvm_major(path: Path) -> int | None:
    match = re.search(r"LLVM(?:-|\.so\.)(\d+)", path.name)
    return int(match.group(1)) if match else None


def llvm_library(*, environ: dict[str, str] | None = None) -> Path:
    """The libLLVM that Dr.Jit's CPU backend will load: ``DRJIT_LIBLLVM_PATH`` if set, else Debian's libllvm19.

    Without ``DRJIT_LIBLLVM_PATH`` Dr.Jit searches the default names and finds Debian 12's LLVM 14 or 15, which crash
    it; so the variable must name LLVM 19 (the version this module was checked with). When it is unset and a
    libLLVM-19 is found at a standard place (``/usr/lib/x86_64-linux-gnu/libLLVM-19.so`` and the like), the
    variable is set to it in ``environ`` (default ``os.environ``), before Dr.Jit is imported.

    Returns:
        the library's path.

    Raises:
        SionnaUnavailable (field ``DRJIT_LIBLLVM_PATH``): the variable names a missing file or an LLVM 14/15
            library, or it is unset and no libLLVM-19 is installed.
    """
    env = os.environ if environ is None else environ
    given = env.get("DRJIT_LIBLLVM_PATH")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SionnaUnavailable(f"{given} does not exist", field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)
        major = _llvm_major(path)
        if major is not None and major <= 15:
            raise SionnaUnavailable(f"{given} is LLVM {major}, which crashes Dr.Jit 1.5's CPU backend",
                                    field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)
        return path
    for pattern in _LLVM_CANDIDATES:
        for found in sorted(glob.glob(pattern)):
            if Path(found).is_file():
                env["DRJIT_LIBLLVM_PATH"] = found
                return Path(found)
    raise SionnaUnavailable("DRJIT_LIBLLVM_PATH is unset and no libLLVM-19 is installed (Debian's LLVM 14 and 15 "
                            "crash Dr.Jit)", field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)


def check_sionna(*, environ: dict[str, str] | None = None) -> None:
    """Fail early, with the install steps, if Sionna RT cannot run; never imports a module that could crash.

    Checks that every module ``import sionna.rt`` needs is installed (drjit, mitsuba, sionna, importlib_resources,
    ipywidgets, pythreejs, IPython, scipy, matplotlib) and resolves :func:`llvm_library` (in ``environ``, default
    ``os.environ``).

    Raises:
        SionnaUnavailable (a ConfigError): what is missing (field ``sionna`` for packages,
            ``DRJIT_LIBLLVM_PATH`` for LLVM), ``fix`` = :data:`INSTALL_STEPS`.
    """
    missing = [m for m in _REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SionnaUnavailable(f"Sionna RT needs the Python packages {', '.join(missing)}, which are not installed",
                                field="sionna", fix=INSTALL_STEPS)
    llvm_library(environ=environ)


# ---------------------------------------------------------------------------------------------- positions, keys
def bank_positions(tile: SceneTile, settings: SionnaSettings) -> np.ndarray:
    """Transmitter pixels of a tile: outdoor pixels on the grid of step ``s = tx_step_px``, offset ``s // 2``.

    With ``tx_per_tile = k`` set and more than k grid positions, k of them, drawn without replacement from
    ``numpy.random.default_rng([seed, tile.row, tile.col])``, in row-major order.

    Args:
        tile: a :class:`shared.radio.scenes.SceneTile`.
        settings: gives ``tx_step_px``, ``tx_per_tile`` and ``seed``.

    Returns:
        int64 (n, 2) ``(row, col)`` tile pixels, row-major, all outdoors; n >= 1.

    Raises:
        ConfigError (field ``tx_step_px``): no outdoor pixel lies on the grid.
    """
    step = int(settings.tx_step_px)
    size = tile.buildings.shape[0]
    rows, cols = np.meshgrid(np.arange(step // 2, size, step), np.arange(step // 2, size, step), indexing="ij")
    pts = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.int64)
    pts = pts[~tile.buildings[pts[:, 0], pts[:, 1]]]
    if len(pts) == 0:
        raise ConfigError(f"no outdoor pixel of {tile.tile_id} lies on a grid of step {step}", field="tx_step_px",
                          fix="use a smaller tx_step_px")
    if settings.tx_per_tile is not None and settings.tx_per_tile < len(pts):
        rng = np.random.default_rng([settings.seed, tile.row, tile.col])
        pts = pts[np.sort(rng.choice(len(pts), size=settings.tx_per_tile, replace=False))]
    return pts


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tile_key(tile: SceneTile, settings: SionnaSettings) -> dict[str, object]:
    """Everything a traced tile depends on: the tile (scene, grid position, size, spacing, a SHA-256 of its
    buildings), every :class:`SionnaSettings` field and the sionna-rt version. JSON-able ``dict``."""
    return {"scene": tile.scene, "row": tile.row, "col": tile.col, "size_px": tile.size_px,
            "metres_per_pixel": tile.metres_per_pixel,
            "buildings_sha256": hashlib.sha256(np.packbits(tile.buildings).tobytes()).hexdigest(),
            "settings": dataclasses.asdict(settings), "sionna_rt": _version("sionna-rt")}


def _canonical(key: dict[str, object]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)


def tile_file(out_dir: str | os.PathLike[str], tile: SceneTile, settings: SionnaSettings) -> Path:
    """``<out_dir>/<scene>/<scene>-r<row>c<col>-<first 12 hex digits of SHA-256(canonical key)>.npz``."""
    digest = hashlib.sha256(_canonical(tile_key(tile, settings)).encode()).hexdigest()[:12]
    return Path(out_dir) / tile.scene / f"{tile.scene}-r{tile.row:03d}c{tile.col:03d}-{digest}.npz"


@dataclass(frozen=True, eq=False)
class TracedTile:
    """One tile's ray-traced maps (module docstring, "Files").

    Attributes:
        key: :func:`tile_key` of the tile and settings.
        buildings: bool (H, W), True inside buildings.
        transmitters: int64 (n, 2) transmitter pixels ``(row, col)``.
        path_gain: float32 (n, H, W), linear path gain (unitless, 0 where no ray arrived), row 0 north.
        samples_per_tx: int64 (n,), the rays per transmitter of the trace that was kept.
        coverage: float64 (n,), fraction of the outdoor pixels with a value.
        elapsed_s: seconds the tile took to trace (all tries).
    """

    key: dict[str, object]
    buildings: np.ndarray
    transmitters: np.ndarray
    path_gain: np.ndarray
    samples_per_tx: np.ndarray
    coverage: np.ndarray
    elapsed_s: float

    @property
    def tile_id(self) -> str:
        """``"<scene>/r<row>c<col>"``, as :attr:`shared.radio.scenes.SceneTile.tile_id`."""
        return f"{self.key['scene']}/r{int(self.key['row']):03d}c{int(self.key['col']):03d}"

    def gain_db(self) -> np.ndarray:
        """float32 (n, H, W) path gain in dB, ``10 log10(path_gain)``; -inf where no ray arrived."""
        with np.errstate(divide="ignore"):
            return (10.0 * np.log10(self.path_gain.astype(np.float64))).astype(np.float32)


def write_tile(path: str | os.PathLike[str], traced: TracedTile) -> None:
    """Write ``traced`` as npz (no pickles) to ``path``, atomically (a temporary file beside it, then
    ``os.replace``); parent folders are created.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(tmp, key=np.array(_canonical(traced.key)), buildings=traced.buildings,
                            transmitters=traced.transmitters.astype(np.int64),
                            path_gain=traced.path_gain.astype(np.float32),
                            samples_per_tx=traced.samples_per_tx.astype(np.int64),
                            coverage=traced.coverage.astype(np.float64), elapsed_s=np.float64(traced.elapsed_s))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_tile(path: str | os.PathLike[str], *, key: dict[str, object] | None = None) -> TracedTile:
    """Read a file of :func:`write_tile`; with ``key``, check that the file was traced with exactly it.

    Raises:
        DatasetError (a ConfigError, source = the file): missing, unreadable or malformed file (wrong arrays,
            dtypes or shapes, a gain that is negative or not finite), or a stored key other than ``key``.
    """
    path = Path(path)
    fix = "delete the file and run `wildfed radio-data sionna` again"
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # missing, truncated or not an npz
        raise DatasetError(f"cannot read a traced tile: {exc}", source=path, fix=fix) from exc
    names = ("key", "buildings", "transmitters", "path_gain", "samples_per_tx", "coverage", "elapsed_s")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DatasetError(f"missing arrays {missing}", source=path, field="arrays", fix=fix)
    try:
        stored = json.loads(str(arrays["key"]))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"key is not JSON: {exc}", source=path, field="key", fix=fix) from exc
    if key is not None and stored != json.loads(_canonical(key)):
        raise DatasetError("was traced with other settings or another tile than asked for", source=path,
                           field="key", fix=fix)
    buildings, tx, gain = arrays["buildings"], arrays["transmitters"], arrays["path_gain"]
    n = tx.shape[0] if tx.ndim == 2 else -1
    if (buildings.dtype != np.bool_ or buildings.ndim != 2 or tx.dtype != np.int64 or tx.ndim != 2
            or tx.shape[1] != 2 or gain.dtype != np.float32 or gain.shape != (n, *buildings.shape)
            or arrays["samples_per_tx"].shape != (n,) or arrays["coverage"].shape != (n,)):
        raise DatasetError("arrays have the wrong dtypes or shapes", source=path, field="arrays", fix=fix)
    if not np.all(np.isfinite(gain)) or float(gain.min(initial=0.0)) < 0:
        raise DatasetError("path_gain must be finite and >= 0", source=path, field="path_gain", fix=fix)
    if n and ((tx < 0).any() or (tx >= buildings.shape[0]).any() or buildings[tx[:, 0], tx[:, 1]].any()):
        raise DatasetError("a transmitter lies outside the tile or in a building", source=path,
                           field="transmitters", fix=fix)
    return TracedTile(stored, buildings, tx, gain, arrays["samples_per_tx"].astype(np.int64),
                      arrays["coverage"].astype(np.float64), float(arrays["elapsed_s"]))


# ------------------------------------------------------------------------------------------------ tracing
_SCENE_CACHE: dict[str, object] = {}


def _sionna_scene(scene_name: str, settings: SionnaSettings):  # pragma: no cover - needs Sionna RT
    import sionna.rt as rt

    scene = _SCENE_CACHE.get(scene_name)
    if scene is None:
        _SCENE_CACHE.clear()  # one city at a time: the scenes are tens of MB each
        scene = rt.load_scene(getattr(rt.scene, scene_name))
        _SCENE_CACHE[scene_name] = scene
    scene.frequency = float(settings.frequency_hz)
    array = rt.PlanarArray(num_rows=1, num_cols=1, vertical_spacing=0.5, horizontal_spacing=0.5, pattern="iso",
                           polarization="V")
    scene.tx_array = array
    scene.rx_array = array
    for name in list(scene.transmitters):
        scene.remove(name)
    return scene


def _ground_heights(scene_name: str, xy: np.ndarray) -> np.ndarray:  # pragma: no cover - needs Mitsuba
    """float64 (n,) ground z in metres under the points xy, float (n, 2): a ray cast down onto the ground meshes."""
    import mitsuba as mi
    import sionna.rt  # noqa: F401 - sets Mitsuba's variant (llvm_ad_mono_polarized on a CPU)

    ground = {f"g{i}": {"type": "ply", "filename": str(m.path)}
              for i, m in enumerate(scene_meshes(scene_name)) if m.is_ground}
    if not ground:
        return np.zeros(len(xy))
    scene = mi.load_dict({"type": "scene", **ground})
    n = len(xy)
    origin = mi.Point3f(mi.Float(xy[:, 0].astype(np.float32)), mi.Float(xy[:, 1].astype(np.float32)),
                        mi.Float(np.full(n, 10_000.0, np.float32)))
    ray = mi.Ray3f(origin, mi.Vector3f(0.0, 0.0, -1.0))
    si = scene.ray_intersect(ray)
    z = np.asarray(si.p.z, dtype=np.float64)
    return np.where(np.asarray(si.is_valid(), dtype=bool), z, 0.0)


def _measurement_mesh(tile: SceneTile, rx_height_m: float):  # pragma: no cover - needs Mitsuba
    """A Mitsuba mesh, two triangles per pixel (pixel (r, c) owns faces 2 (r W + c) and 2 (r W + c) + 1), its
    vertices at the pixel corners, ``rx_height_m`` above the ground."""
    import mitsuba as mi

    size, m = tile.size_px, tile.metres_per_pixel
    vr, vc = np.meshgrid(np.arange(size + 1), np.arange(size + 1), indexing="ij")
    xy = np.stack([tile.origin_xy_m[0] + vc.ravel() * m, tile.origin_xy_m[1] - vr.ravel() * m], axis=1)
    z = _ground_heights(tile.scene, xy) + rx_height_m
    vertices = np.concatenate([xy, z[:, None]], axis=1).astype(np.float32)
    r, c = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    a = (r * (size + 1) + c).ravel()
    b, d, e = a + 1, a + size + 1, a + size + 2   # north-east, south-west, south-east corners
    faces = np.stack([np.stack([a, d, b], 1), np.stack([b, d, e], 1)], axis=1).reshape(-1, 3).astype(np.uint32)
    mesh = mi.Mesh("wildfed-measurement", vertex_count=len(vertices), face_count=len(faces),
                   has_vertex_normals=False, has_vertex_texcoords=False)
    params = mi.traverse(mesh)
    params["vertex_positions"] = mi.Float(vertices.ravel())
    params["faces"] = mi.UInt(faces.ravel())
    params.update()
    return mesh


def trace_tile(tile: SceneTile, settings: SionnaSettings, *,
               progress: Callable[[int, int, int], object] | None = None) -> TracedTile:  # pragma: no cover
    """Ray-trace the maps of every :func:`bank_positions` transmitter of ``tile`` (module docstring, steps 1-5).

    Args:
        tile: a tile of :func:`shared.radio.scenes.scene_grid`.
        settings: the solver's settings.
        progress: called as ``progress(done, total, samples_per_tx)`` after each batch.

    Returns:
        the :class:`TracedTile` (path gain float32 (n, H, W), linear, row 0 north).

    Raises:
        SionnaUnavailable: :func:`check_sionna` fails.

    Source: Sionna RT 2.2 ``RadioMapSolver`` on a mesh measurement surface (NVIDIA, sionna-rt documentation).
    """
    check_sionna()
    import sionna.rt as rt

    started = time.monotonic()
    scene = _sionna_scene(tile.scene, settings)
    mesh = _measurement_mesh(tile, settings.rx_height_m)
    solver = rt.RadioMapSolver()
    positions = bank_positions(tile, settings)
    xy = tile.pixel_centres_xy_m(positions)
    tx_z = _ground_heights(tile.scene, xy) + settings.tx_height_m
    size = tile.size_px
    outdoor = ~tile.buildings
    gains = np.zeros((len(positions), size, size), dtype=np.float32)
    samples = np.zeros(len(positions), dtype=np.int64)
    coverage = np.zeros(len(positions), dtype=np.float64)
    for start in range(0, len(positions), settings.batch):
        stop = min(start + settings.batch, len(positions))
        names = [f"tx{i}" for i in range(start, stop)]
        for name, (x, y), z in zip(names, xy[start:stop], tx_z[start:stop]):
            scene.add(rt.Transmitter(name=name, position=[float(x), float(y), float(z)]))
        spt = settings.samples_per_tx
        while True:
            radio_map = solver(scene, measurement_surface=mesh, samples_per_tx=int(spt),
                               max_depth=settings.max_depth, los=True,
                               specular_reflection=settings.specular_reflection,
                               diffuse_reflection=settings.diffuse_reflection, refraction=settings.refraction,
                               diffraction=settings.diffraction, seed=settings.seed)
            batch = np.asarray(radio_map.path_gain.numpy(), dtype=np.float64).reshape(stop - start, size, size, 2)
            batch = batch.mean(axis=-1)
            cover = (batch[:, outdoor] > 0).mean(axis=1)
            if cover.mean() >= settings.min_coverage or spt * 2 > settings.max_samples_per_tx:
                break
            spt *= 2
        gains[start:stop] = batch.astype(np.float32)
        samples[start:stop] = spt
        coverage[start:stop] = cover
        for name in names:
            scene.remove(name)
        if progress is not None:
            progress(stop, len(positions), int(spt))
    return TracedTile(tile_key(tile, settings), tile.buildings.copy(), positions, gains, samples, coverage,
                      time.monotonic() - started)


# ------------------------------------------------------------------------------------------------- the set
def _read_manifest(out_dir: Path) -> dict[str, object] | None:
    path = out_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read the manifest: {exc}", source=path,
                           fix="delete the folder and generate the set again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DatasetError(f"not a {MANIFEST_FORMAT} manifest", source=path, field="format",
                           fix="point at a folder written by `wildfed radio-data sionna`")
    return manifest


def _manifest_head(settings: SionnaSettings, geometry: RadioMapGeometry,
                   coverage_window: tuple[float, float]) -> dict[str, object]:
    return {"format": MANIFEST_FORMAT, "settings": dataclasses.asdict(settings),
            "geometry": dataclasses.asdict(geometry), "tile_coverage": list(coverage_window),
            "sionna_rt": _version("sionna-rt")}


def generate_sionna_set(out_dir: str | os.PathLike[str], tiles: Sequence[SceneTile], settings: SionnaSettings, *,
                        geometry: RadioMapGeometry = RadioMapGeometry(),
                        coverage_window: tuple[float, float] = (0.15, 0.6),
                        trace: Callable[..., TracedTile] | None = None,
                        progress: Callable[[str, int, int, int], object] | None = None) -> list[dict[str, object]]:
    """Trace ``tiles`` into ``out_dir`` (files and manifest of the module docstring), skipping tiles whose file
    already holds the same key; the manifest is rewritten after every tile, so an interrupted run keeps its work.

    Args:
        out_dir: the set's folder (one settings per folder).
        tiles: tiles of :func:`shared.radio.scenes.scene_grid` with ``geometry`` and ``coverage_window``.
        settings: the solver's settings.
        trace: the tracer (default :func:`trace_tile`; tests pass a stand-in).
        progress: ``progress(tile_id, done, total, samples_per_tx)`` after each batch.

    Returns:
        one record per tile: ``{"tile", "file", "transmitters", "coverage_mean", "coverage_min",
        "samples_per_tx", "elapsed_s", "cached"}``.

    Raises:
        SionnaUnavailable: Sionna RT cannot run and a tile needs tracing.
        DatasetError (field ``out``): ``out_dir`` holds a set of other settings, geometry or tile coverage.
    """
    out = Path(out_dir)
    head = _manifest_head(settings, geometry, coverage_window)
    manifest = _read_manifest(out)
    if manifest is not None:
        if {k: manifest.get(k) for k in head} != json.loads(json.dumps(head)):
            raise DatasetError("this folder holds a Sionna set made with other settings", source=out, field="out",
                               fix="use another --out folder, or the settings of its manifest.json")
    else:
        manifest = {**head, "tiles": {}}
    tracer = trace_tile if trace is None else trace
    records = []
    for tile in tiles:
        if tile.size_px != geometry.size_px or tile.metres_per_pixel != float(geometry.metres_per_pixel):
            raise ConfigError(f"{tile.tile_id} is not a tile of this geometry", field="tiles",
                              fix="cut the tiles with scene_grid(scene, geometry=geometry)")
        path = tile_file(out, tile, settings)
        key = tile_key(tile, settings)
        cached = True
        try:
            traced = read_tile(path, key=key)
        except DatasetError:
            cached = False
            traced = tracer(tile, settings, progress=None if progress is None else
                            (lambda done, total, spt, t=tile.tile_id: progress(t, done, total, spt)))
            write_tile(path, traced)
        record = {"tile": tile.tile_id, "file": str(path.relative_to(out)), "transmitters": int(len(traced.transmitters)),
                  "coverage_mean": float(traced.coverage.mean()), "coverage_min": float(traced.coverage.min()),
                  "samples_per_tx": sorted({int(s) for s in traced.samples_per_tx}),
                  "elapsed_s": float(traced.elapsed_s), "cached": cached}
        records.append(record)
        manifest["tiles"][tile.tile_id] = {k: v for k, v in record.items() if k not in ("tile", "cached")}
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".manifest.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, out / "manifest.json")
    return records


class SionnaBank:
    """A Sionna set read back for the experiment (no Sionna import): transmitter positions and path gains by tile.

    Args:
        out_dir: a folder written by :func:`generate_sionna_set` (``wildfed radio-data sionna --out DIR``).
        geometry: the map geometry the reader expects.

    Raises:
        DatasetError (a ConfigError): no or a malformed manifest, or a set of another geometry.
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, geometry: RadioMapGeometry = RadioMapGeometry()) -> None:
        self.out_dir = Path(out_dir)
        manifest = _read_manifest(self.out_dir)
        if manifest is None:
            raise DatasetError("no manifest.json: not a Sionna set", source=self.out_dir, field="sionna_dir",
                               fix="generate one with `wildfed radio-data sionna --out DIR --scene NAME --tiles all`")
        if manifest.get("geometry") != dataclasses.asdict(geometry):
            raise DatasetError(f"the set's geometry {manifest.get('geometry')} is not {dataclasses.asdict(geometry)}",
                               source=self.out_dir, field="geometry", fix="generate a set with this geometry")
        try:
            self.settings = SionnaSettings(**manifest["settings"])
            self.coverage_window = tuple(float(c) for c in manifest["tile_coverage"])
            self.entries = dict(manifest["tiles"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"malformed manifest: {exc}", source=self.out_dir / "manifest.json",
                               fix="delete the folder and generate the set again") from exc
        self.geometry = geometry
        self._tiles: dict[str, TracedTile] = {}

    def tile(self, tile: SceneTile) -> TracedTile:
        """The traced maps of ``tile`` (read once, then kept in memory).

        Raises:
            DatasetError (field ``sionna_dir``): the set has no file for the tile (the fix names the command that
                traces it), or the file does not match the tile and the set's settings.
        """
        if tile.tile_id in self._tiles:
            return self._tiles[tile.tile_id]
        path = tile_file(self.out_dir, tile, self.settings)
        if tile.tile_id not in self.entries or not path.is_file():
            raise DatasetError(f"the Sionna set has no tile {tile.tile_id} (tile {tile.index} of {tile.scene})",
                               source=self.out_dir, field="sionna_dir",
                               fix=f"wildfed radio-data sionna --out {self.out_dir} --scene {tile.scene} --tiles all "
                                   "(with the settings of its manifest.json)")
        traced = read_tile(path, key=tile_key(tile, self.settings))
        self._tiles[tile.tile_id] = traced
        return traced

    def tiles_of(self, scene: str) -> tuple[SceneTile, ...]:
        """The scene's grid tiles (:func:`shared.radio.scenes.scene_grid` at the set's geometry and coverage)."""
        return scene_grid(scene, geometry=self.geometry, coverage=self.coverage_window)
