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

One module per part: :mod:`~shared.radio.sionna_maps.settings`, :mod:`~shared.radio.sionna_maps.availability`
(packages and LLVM, install steps), :mod:`~shared.radio.sionna_maps.tiles` (transmitter pixels, keys, the npz of
one tile), :mod:`~shared.radio.sionna_maps.trace` (the Sionna RT run) and :mod:`~shared.radio.sionna_maps.bank`
(the set and its manifest, written and read back). Import the names from here.
"""

from __future__ import annotations

from shared.radio.sionna_maps.availability import INSTALL_STEPS, SionnaUnavailable, check_sionna, llvm_library
from shared.radio.sionna_maps.bank import MANIFEST_FORMAT, SionnaBank, generate_sionna_set
from shared.radio.sionna_maps.settings import SionnaSettings
from shared.radio.sionna_maps.tiles import TracedTile, bank_positions, read_tile, tile_file, tile_key, write_tile
from shared.radio.sionna_maps.trace import trace_tile

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
