"""Path loss on a building raster: free space plus the COST 231 multi-wall term along the direct ray.

The model (COST 231 Final Report, "Digital mobile radio towards future generation systems", 1999, ch. 4,
the multi-wall model of indoor propagation)::

    L(d) = FSPL(d) + k_w * L_w                                               [dB]

with ``FSPL`` the Friis free-space loss (ITU-R P.525-4, written for metres and hertz), ``k_w`` the number of
building-boundary crossings of the straight segment from transmitter to receiver on the raster, and ``L_w`` one
wall's loss (:attr:`PathLossModel.wall_loss_db`). The COST 231 constant ``L_c`` is taken as 0 (it is an empirical
fit to indoor measurements) and the model has no floors (a 2-D raster). Outdoors, a ray through a building
crosses its facade twice (entry and exit), so a receiver behind one building pays ``2 * L_w``.

Gains are normalised to ``[0, 1]`` as RadioMapSeer's maps are (Levie et al. 2021, "RadioUNet: Fast radio map
estimation with convolutional neural networks", IEEE Trans. Wireless Commun. 20(6), the RadioMapSeer dataset
description): path gain ``-L`` in dB mapped linearly from ``[gain_min_db, gain_max_db]`` to ``[0, 1]``, clipped,
building pixels set to 0.

Geometry: pixel ``(row, col)`` has its centre at ``(row, col)`` in pixel units; the raster spacing is
``metres_per_pixel`` on both axes. Not modelled: diffraction over roofs and around corners, reflections, ground,
antenna patterns and heights (docs/radiomap-data.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

__all__ = [
    "PathLossModel",
    "SPEED_OF_LIGHT_M_PER_S",
    "FSPL_CONSTANT_DB",
    "RAY_SAMPLE_SPACING_PX",
    "free_space_path_loss_db",
    "count_wall_crossings",
    "path_loss_db",
    "normalise_gain",
    "denormalise_gain",
]

SPEED_OF_LIGHT_M_PER_S = 299_792_458.0
#: ``20 log10(4 pi / c)`` = -147.55 dB: the constant of Friis' formula for d in metres and f in hertz.
FSPL_CONSTANT_DB = 20.0 * math.log10(4.0 * math.pi / SPEED_OF_LIGHT_M_PER_S)
#: Largest spacing (in pixels) of the points sampled along a ray by :func:`count_wall_crossings`.
RAY_SAMPLE_SPACING_PX = 0.5


@dataclass(frozen=True)
class PathLossModel:
    """Parameters of the free-space + multi-wall path loss and of the gain normalisation.

    Attributes:
        frequency_hz: carrier frequency in Hz. Default 3.5 GHz, the centre of 5G NR band n78 (3.3-3.8 GHz,
            3GPP TS 38.104 Table 5.2-1), the band of urban macro and small cells in Europe.
        wall_loss_db: loss ``L_w`` in dB of one building-boundary crossing (entry or exit). Default 12 dB, a
            concrete/brick facade at 3.5 GHz: between the COST 231 outdoor-to-indoor perpendicular external-wall
            loss ``W_e`` of about 7 dB at 0.9-1.8 GHz (Final Report ch. 4, building penetration) and the median
            building entry loss of ITU-R P.2109-1 for "traditional" buildings at 3.5 GHz, about 16 dB
            (thermally efficient buildings, with metallised glass, reach 30 dB and more). One building on the ray
            costs ``2 * wall_loss_db``.
        max_walls: cap on the number of crossings that are charged, or ``None`` (default) for none. The COST 231
            multi-wall model is linear in the wall count (only its floor term saturates), so no cap is the
            standard; a cap stands in for the diffracted path that dominates behind many buildings. Deep shadow
            is clipped by ``gain_min_db`` in the normalisation either way.
        min_distance_m: distance floor in metres so the transmitter pixel (d = 0) has finite loss. Default 2 m,
            half a pixel at 4 m/px (the mean distance from a pixel centre to points of that pixel is 0.38 px).
        gain_min_db: path gain in dB (``-L``) mapped to 0; lower gains clip to 0. Default -147 dB.
        gain_max_db: path gain in dB mapped to 1; higher gains clip to 1. Default -47 dB, just above the gain
            at ``min_distance_m`` (-49.4 dB at 2 m, 3.5 GHz). The 100 dB window is like RadioMapSeer's truncation
            (Levie et al. 2021, dataset description): free space over a 256 m tile spans 49-95 dB, four
            buildings add 96 dB.

    Raises:
        ConfigError (a ValueError): a non-positive frequency or distance floor, a negative wall loss or cap, or
            ``gain_min_db >= gain_max_db``; the message names the field.
    """

    frequency_hz: float = 3.5e9
    wall_loss_db: float = 12.0
    max_walls: int | None = None
    min_distance_m: float = 2.0
    gain_min_db: float = -147.0
    gain_max_db: float = -47.0

    def __post_init__(self) -> None:
        _check_positive(self.frequency_hz, "frequency_hz", "use the carrier in Hz, e.g. 3.5e9")
        _check_positive(self.min_distance_m, "min_distance_m", "use about half a pixel in metres, e.g. 2.0")
        if not _is_real(self.wall_loss_db) or self.wall_loss_db < 0:
            raise ConfigError(f"must be a finite number >= 0, got {self.wall_loss_db!r}", field="wall_loss_db",
                              fix="use a per-crossing loss in dB, e.g. 12.0")
        if self.max_walls is not None and (isinstance(self.max_walls, bool)
                                           or not isinstance(self.max_walls, (int, np.integer))
                                           or self.max_walls < 0):
            raise ConfigError(f"must be None or an int >= 0, got {self.max_walls!r}", field="max_walls",
                              fix="leave it None (no cap, as COST 231) or give a wall count")
        for name in ("gain_min_db", "gain_max_db"):
            if not _is_real(getattr(self, name)):
                raise ConfigError(f"must be a finite number, got {getattr(self, name)!r}", field=name,
                                  fix="give a path gain in dB, e.g. -147.0 / -47.0")
        if self.gain_min_db >= self.gain_max_db:
            raise ConfigError(f"gain_min_db {self.gain_min_db} must be below gain_max_db {self.gain_max_db}",
                              field="gain_min_db", fix="swap them or widen the window")


def _is_real(value: object) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _check_positive(value: object, field: str, fix: str) -> None:
    if not _is_real(value) or float(value) <= 0:
        raise ConfigError(f"must be a finite number > 0, got {value!r}", field=field, fix=fix)


def free_space_path_loss_db(distance_m: np.ndarray | float, frequency_hz: float) -> np.ndarray:
    """Friis free-space path loss ``20 log10(d) + 20 log10(f) - 147.55`` dB (ITU-R P.525-4).

    Args:
        distance_m: distance(s) in metres, any shape, all > 0.
        frequency_hz: carrier frequency in Hz, > 0.

    Returns:
        float64 array of the shape of ``distance_m``, loss in dB (83.33 dB at 100 m and 3.5 GHz).

    Raises:
        ConfigError (a ValueError): ``frequency_hz`` not > 0 (field ``frequency_hz``), or a distance not > 0
            (field ``distance_m``).
    """
    _check_positive(frequency_hz, "frequency_hz", "use the carrier in Hz, e.g. 3.5e9")
    d = np.asarray(distance_m, dtype=np.float64)
    if not np.all(np.isfinite(d)) or np.any(d <= 0):
        raise ConfigError("every distance must be finite and > 0", field="distance_m",
                          fix="floor distances, e.g. at PathLossModel.min_distance_m")
    return 20.0 * np.log10(d) + 20.0 * math.log10(float(frequency_hz)) + FSPL_CONSTANT_DB


def _check_buildings(buildings: object) -> np.ndarray:
    if not isinstance(buildings, np.ndarray) or buildings.dtype != np.bool_ or buildings.ndim != 2:
        got = (f"{buildings.dtype} array of shape {buildings.shape}" if isinstance(buildings, np.ndarray)
               else type(buildings).__name__)
        raise ConfigError(f"must be a 2-D bool numpy array (True inside buildings), got {got}", field="buildings",
                          fix="pass mask.astype(bool) of shape (H, W)")
    if buildings.shape[0] < 1 or buildings.shape[1] < 1:
        raise ConfigError(f"must not be empty, got shape {buildings.shape}", field="buildings",
                          fix="pass a raster of at least 1 x 1 pixels")
    return buildings


def _check_tx(tx: object, buildings: np.ndarray) -> tuple[int, int]:
    ok = (isinstance(tx, (tuple, list, np.ndarray)) and len(tx) == 2
          and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in tx))
    if not ok:
        raise ConfigError(f"must be (row, col) integers, got {tx!r}", field="tx",
                          fix="give the transmitter pixel as (row, col), e.g. outdoor_position(...)")
    row, col = int(tx[0]), int(tx[1])
    height, width = buildings.shape
    if not (0 <= row < height and 0 <= col < width):
        raise ConfigError(f"({row}, {col}) is outside the {height} x {width} raster", field="tx",
                          fix=f"use 0 <= row < {height} and 0 <= col < {width}")
    if buildings[row, col]:
        raise ConfigError(f"({row}, {col}) is inside a building", field="tx",
                          fix="place the transmitter on an outdoor pixel (outdoor_position)")
    return row, col


def count_wall_crossings(buildings: np.ndarray, tx: tuple[int, int]) -> np.ndarray:
    """Number of building-boundary crossings on the straight segment from the transmitter to every pixel.

    For each receiver pixel, ``S`` points are sampled uniformly on the segment from the transmitter pixel centre
    to the receiver pixel centre (both ends included), with ``S`` chosen from the farthest receiver so that the
    spacing is at most :data:`RAY_SAMPLE_SPACING_PX` (half a pixel) for every receiver. Each point takes the
    mask value of the pixel it falls in (nearest pixel centre, ties rounded up), and the crossings are the
    inside/outside changes of that sequence. The sequence starts outdoors (the transmitter pixel), so a receiver
    inside a building counts its entry crossing (an odd count), an outdoor receiver an even one.

    Sampling is an approximation of the exact grid traversal: a ray that only clips the corner of a pixel over
    less than the spacing may miss it (at most half a pixel of building along the ray). Cost: ``S * H * W``
    samples, about ``9 * S * H * W`` bytes at once (S <= 180 and about 7 MB for 64 x 64; mind it above
    256 x 256).

    Args:
        buildings: bool (H, W), True inside buildings.
        tx: transmitter pixel ``(row, col)``, outdoors.

    Returns:
        int64 (H, W) crossing counts; 0 at the transmitter.

    Raises:
        ConfigError (a ValueError): ``buildings`` not a 2-D bool array (field ``buildings``); ``tx`` not two
            integers, outside the raster or inside a building (field ``tx``).
    """
    buildings = _check_buildings(buildings)
    row, col = _check_tx(tx, buildings)
    height, width = buildings.shape
    d_row = (np.arange(height, dtype=np.float32) - row)[:, None]
    d_col = (np.arange(width, dtype=np.float32) - col)[None, :]
    longest = math.hypot(max(row, height - 1 - row), max(col, width - 1 - col))
    samples = max(2, int(math.ceil(longest / RAY_SAMPLE_SPACING_PX)) + 1)
    t = np.linspace(0.0, 1.0, samples, dtype=np.float32)[:, None, None]
    # nearest pixel centre of every sample point: floor(x + 0.5); both ends land exactly on integers
    rows = np.floor(row + 0.5 + t * d_row).astype(np.int32)
    cols = np.floor(col + 0.5 + t * d_col).astype(np.int32)
    np.clip(rows, 0, height - 1, out=rows)
    np.clip(cols, 0, width - 1, out=cols)
    inside = buildings.ravel()[rows * width + cols]  # (S, H, W) bool
    changes = inside[1:] != inside[:-1]
    return changes.sum(axis=0, dtype=np.int64)


def path_loss_db(buildings: np.ndarray, tx: tuple[int, int], *, model: PathLossModel,
                 metres_per_pixel: float) -> np.ndarray:
    """COST 231 multi-wall path loss from ``tx`` to every pixel: ``FSPL(d) + k_w * wall_loss_db`` (``L_c = 0``).

    ``d`` is the distance between pixel centres in metres, floored at ``model.min_distance_m``; ``k_w`` is
    :func:`count_wall_crossings`, capped at ``model.max_walls`` when set. Source: COST 231 Final Report
    ch. 4 (multi-wall model); FSPL per ITU-R P.525-4.

    Args:
        buildings: bool (H, W), True inside buildings.
        tx: transmitter pixel ``(row, col)``, outdoors.
        model: the path loss parameters.
        metres_per_pixel: raster spacing in metres, > 0.

    Returns:
        float32 (H, W) path loss in dB (positive; larger is weaker), building pixels included.

    Raises:
        ConfigError (a ValueError): bad ``buildings`` or ``tx`` (as :func:`count_wall_crossings`),
            ``metres_per_pixel`` not > 0, or ``model`` not a :class:`PathLossModel`.
    """
    if not isinstance(model, PathLossModel):
        raise ConfigError(f"must be a PathLossModel, got {type(model).__name__}", field="model",
                          fix="pass model=PathLossModel()")
    _check_positive(metres_per_pixel, "metres_per_pixel", "give the raster spacing in metres, e.g. 4.0")
    walls = count_wall_crossings(buildings, tx)
    if model.max_walls is not None:
        walls = np.minimum(walls, model.max_walls)
    height, width = buildings.shape
    d_row = (np.arange(height, dtype=np.float64) - tx[0])[:, None]
    d_col = (np.arange(width, dtype=np.float64) - tx[1])[None, :]
    distance_m = np.maximum(np.hypot(d_row, d_col) * float(metres_per_pixel), model.min_distance_m)
    loss = free_space_path_loss_db(distance_m, model.frequency_hz) + walls * float(model.wall_loss_db)
    return loss.astype(np.float32)


def normalise_gain(path_loss_db: np.ndarray, buildings: np.ndarray, model: PathLossModel) -> np.ndarray:
    """Path loss in dB -> RadioMapSeer-style gray level in ``[0, 1]`` (Levie et al. 2021, RadioMapSeer).

    ``g = clip((-L - gain_min_db) / (gain_max_db - gain_min_db), 0, 1)``, and ``g = 0`` on building pixels (the
    maps of RadioMapSeer are 0 inside buildings).

    Args:
        path_loss_db: float (H, W) path loss in dB.
        buildings: bool (H, W), True inside buildings.
        model: gives ``gain_min_db`` and ``gain_max_db``.

    Returns:
        float32 (H, W) in ``[0, 1]``.

    Raises:
        ConfigError (a ValueError): ``path_loss_db`` not a 2-D real array of the shape of ``buildings``
            (field ``path_loss_db``), bad ``buildings``, or ``model`` not a :class:`PathLossModel`.
    """
    buildings = _check_buildings(buildings)
    if not isinstance(model, PathLossModel):
        raise ConfigError(f"must be a PathLossModel, got {type(model).__name__}", field="model",
                          fix="pass the PathLossModel the maps were made with")
    loss = np.asarray(path_loss_db)
    if loss.shape != buildings.shape or not np.issubdtype(loss.dtype, np.number):
        raise ConfigError(f"must be a real array of shape {buildings.shape}, got {loss.dtype} {loss.shape}",
                          field="path_loss_db", fix="pass path_loss_db(buildings, tx, ...)")
    span = model.gain_max_db - model.gain_min_db
    gain = (-loss.astype(np.float64) - model.gain_min_db) / span
    gain = np.clip(gain, 0.0, 1.0)
    gain[buildings] = 0.0
    return gain.astype(np.float32)


def denormalise_gain(normalised: np.ndarray, model: PathLossModel) -> np.ndarray:
    """Gray level in ``[0, 1]`` -> path gain in dB: ``gain_min_db + g * (gain_max_db - gain_min_db)``.

    The inverse of :func:`normalise_gain` for values that were not clipped (and not on buildings); use it to
    report errors in dB (an RMSE in gray levels times the 100 dB window is the RMSE in dB).

    Args:
        normalised: float array, any shape (values outside ``[0, 1]`` are extrapolated, not clipped).
        model: gives ``gain_min_db`` and ``gain_max_db``.

    Returns:
        float64 array of the same shape: path gain in dB (``-path loss``; e.g. -147 for 0).

    Raises:
        ConfigError (a ValueError): ``model`` not a :class:`PathLossModel`, or ``normalised`` not real.
    """
    if not isinstance(model, PathLossModel):
        raise ConfigError(f"must be a PathLossModel, got {type(model).__name__}", field="model",
                          fix="pass the PathLossModel the maps were made with")
    values = np.asarray(normalised)
    if not np.issubdtype(values.dtype, np.number):
        raise ConfigError(f"must be a real array, got {values.dtype}", field="normalised",
                          fix="pass the gray-level map as floats")
    return model.gain_min_db + values.astype(np.float64) * (model.gain_max_db - model.gain_min_db)
