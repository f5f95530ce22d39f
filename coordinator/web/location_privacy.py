"""Sensitive-species location protection for viewers without the ranger role (docs/location-privacy.md).

A deployment that recorded a species of a sensitive IUCN category (CR, EN, VU by default: the same table that sets
privacy budgets, :mod:`shared.iucn`) is shown to partners and the public either

* **displaced** to a random point within ``radius_m`` (default 1 km) of its true position, drawn uniformly by area
  in the disc and *fixed per place* (coordinator.web.places: one point per camera station, however often it is
  re-deployed). The point is derived from HMAC-SHA256 of the place's key under the federation's secret key, so
  repeated views return the same point and cannot be averaged back to the truth (as Wildlife Insights does); or
* **coarsened** to the centre of a grid cell of ``cell_m`` metres (the stronger option: random displacement can be
  undone in part with habitat rasters. Beery and Bondi (2021) cut the search area by 87 % that way; a cell gives
  the same answer for every deployment in it).

Whoever holds the secret key can undo the displacement: it is kept 0600 in the coordinator's data folder and never
shown. Distances use a spherical Earth of radius 6,371,008.8 m (the IUGG mean radius); the destination point for a
distance and bearing is the standard great-circle formula (Snyder 1987, "Map Projections: A Working Manual",
USGS PP 1395, eq. 5-5 and 5-6). At 1 km the spherical error is below a metre.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import write_file_atomic

__all__ = ["EARTH_RADIUS_M", "DEFAULT_SENSITIVE", "PLACE_JOIN_FRACTION", "LocationPolicy", "ProtectedLocation", "destination_point",
           "haversine_m", "displace", "coarsen_to_grid", "protect", "load_or_create_secret"]

EARTH_RADIUS_M = 6_371_008.8
"""Mean Earth radius in metres (IUGG)."""
DEFAULT_SENSITIVE = frozenset({IUCNCategory.CR, IUCNCategory.EN, IUCNCategory.VU})
"""IUCN categories whose deployments are protected by default."""
PLACE_JOIN_FRACTION = 0.5
"""A protected deployment within this fraction of the radius of a protected place's anchor joins that place and
shares its one shown point (coordinator.web.places): 500 m for the default 1 km. Why so large? A shown
point is the anchor plus one fixed offset, so every member of a place gets the *same* point
and averaging members gains nothing; only deployments that fall outside the join distance get a second,
independent point. At 100 m, a station re-deployed with 60 m of GPS jitter got 4 points whose mean was 75 m
from the truth. At R/2, jitter would have to reach 500 m (eight standard deviations of that trial), and two
places of one station are then at least R/2 apart. The price is the bound: a member is at most J from the
anchor, so it is shown within R + J of its truth (:attr:`LocationPolicy.shown_within_m` adds R for neighbours)."""


@dataclass(frozen=True)
class LocationPolicy:
    """How deployments that recorded sensitive species are shown to viewers without the ranger role.

    Attributes:
        method: ``"displace"`` (random point within ``radius_m``, fixed per deployment) or ``"grid"`` (centre of a
            cell of ``cell_m`` metres).
        radius_m: displacement radius in metres (> 0), default 1,000.
        cell_m: grid cell side in metres (> 0), default 10,000.
        categories: the sensitive IUCN categories (default CR, EN, VU).
        protect_unknown: treat a species the species table does not list as sensitive (default True: a table
            that lags behind the species a camera records must not expose their places).

    Raises:
        ConfigError: a radius or cell size that is not a positive finite number, or an unknown method.
    """

    method: Literal["displace", "grid"] = "displace"
    radius_m: float = 1000.0
    cell_m: float = 10_000.0
    categories: frozenset[IUCNCategory] = field(default_factory=lambda: DEFAULT_SENSITIVE)
    protect_unknown: bool = True

    @property
    def join_m(self) -> float:
        """Metres within which a protected deployment joins a protected place's anchor (and shares its point):
        ``PLACE_JOIN_FRACTION * radius_m``, J = R/2."""
        return PLACE_JOIN_FRACTION * self.radius_m

    @property
    def shown_within_m(self) -> float:
        """The most any protected deployment's shown point can be from its true position, metres: the spread of the
        anchor's point (the radius R, or half a grid cell's diagonal) + J (:attr:`join_m`, a sensitive member's
        distance from the anchor) + R (a neighbour is protected, and shown at the place's point, because it lies
        within R of a sensitive member or the anchor). One number for every protected deployment, so the stated
        uncertainty does not tell a neighbour from a sensitive one: 2,500 m for the default 1 km radius."""
        spread = self.radius_m if self.method == "displace" else self.cell_m * math.sqrt(2.0) / 2.0
        return spread + self.join_m + self.radius_m

    def __post_init__(self) -> None:
        if self.method not in ("displace", "grid"):
            raise ConfigError(f"location method {self.method!r} is unknown", field="location_privacy.method",
                              fix="use displace or grid")
        for name in ("radius_m", "cell_m"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} is {value!r}", field=f"location_privacy.{name}",
                                  fix="give a positive number of metres")


@dataclass(frozen=True)
class ProtectedLocation:
    """What a viewer is shown: ``latitude``/``longitude`` in decimal degrees (WGS 84), ``fuzzed`` when they are not
    the true position, and ``method`` (``"exact"``, ``"displace"`` or ``"grid"``)."""

    latitude: float
    longitude: float
    fuzzed: bool
    method: str


def _check(lat: float, lon: float) -> None:
    if not (math.isfinite(lat) and math.isfinite(lon) and -90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0):
        raise ConfigError(f"coordinates ({lat!r}, {lon!r}) are not WGS 84 degrees", field="latitude/longitude",
                          fix="give latitude in [-90, 90] and longitude in [-180, 180]")


def haversine_m(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance in metres between two points in decimal degrees (haversine formula, sphere of radius
    :data:`EARTH_RADIUS_M`)."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_M * math.asin(min(1.0, math.sqrt(a)))


def destination_point(lat: float, lon: float, distance_m: float, bearing_rad: float) -> tuple[float, float]:
    """The point ``distance_m`` metres from (lat, lon) along the initial bearing ``bearing_rad`` (radians clockwise
    from north), on the sphere (Snyder 1987, eq. 5-5, 5-6). Longitude is wrapped to [-180, 180).

    Raises:
        ConfigError: coordinates out of range.
    """
    _check(lat, lon)
    d = distance_m / EARTH_RADIUS_M
    p1, l1 = math.radians(lat), math.radians(lon)
    p2 = math.asin(math.sin(p1) * math.cos(d) + math.cos(p1) * math.sin(d) * math.cos(bearing_rad))
    l2 = l1 + math.atan2(math.sin(bearing_rad) * math.sin(d) * math.cos(p1),
                         math.cos(d) - math.sin(p1) * math.sin(p2))
    return math.degrees(p2), (math.degrees(l2) + 540.0) % 360.0 - 180.0


def _unit_pair(secret: bytes, deployment_id: str) -> tuple[float, float]:
    """Two numbers in [0, 1) from HMAC-SHA256(secret, deployment id): fixed per deployment, unpredictable without
    the secret."""
    digest = hmac.new(secret, f"wildfed-location-v1\x00{deployment_id}".encode(), hashlib.sha256).digest()
    a = int.from_bytes(digest[:8], "big") / 2.0 ** 64
    b = int.from_bytes(digest[8:16], "big") / 2.0 ** 64
    return a, b


def displace(lat: float, lon: float, *, deployment_id: str, secret: bytes, radius_m: float) -> tuple[float, float]:
    """A point uniform by area in the disc of ``radius_m`` metres around (lat, lon), the same for every call with
    the same deployment id and secret: distance ``radius_m * sqrt(u)``, bearing ``2 pi v``, (u, v) from
    HMAC-SHA256.

    Raises:
        ConfigError: coordinates out of range, an empty secret or a non-positive radius.
    """
    if not secret:
        raise ConfigError("the location secret is empty", field="location_secret", fix="let the coordinator create it")
    if not radius_m > 0:
        raise ConfigError(f"radius {radius_m!r} m", field="location_privacy.radius_m", fix="give a positive radius")
    u, v = _unit_pair(secret, deployment_id)
    return destination_point(lat, lon, radius_m * math.sqrt(u), 2.0 * math.pi * v)


def coarsen_to_grid(lat: float, lon: float, *, cell_m: float) -> tuple[float, float]:
    """The centre of the grid cell holding (lat, lon): rows of ``cell_m`` metres of latitude, and in each row cells
    of ``cell_m`` metres of longitude measured at the row's centre latitude (so cells stay about square).

    Raises:
        ConfigError: coordinates out of range or a non-positive cell size.
    """
    _check(lat, lon)
    if not cell_m > 0:
        raise ConfigError(f"cell size {cell_m!r} m", field="location_privacy.cell_m", fix="give a positive size")
    dlat = math.degrees(cell_m / EARTH_RADIUS_M)
    row = math.floor((lat + 90.0) / dlat)
    centre_lat = min(90.0, -90.0 + (row + 0.5) * dlat)
    metres_per_degree_lon = max(EARTH_RADIUS_M * math.cos(math.radians(centre_lat)) * math.pi / 180.0, 1e-9)
    dlon = min(360.0, cell_m / metres_per_degree_lon)
    col = math.floor((lon + 180.0) / dlon)
    centre_lon = min(180.0, -180.0 + (col + 0.5) * dlon)
    return centre_lat, centre_lon


def protect(lat: float, lon: float, *, deployment_id: str, recorded: Iterable[IUCNCategory], exact_allowed: bool,
            policy: LocationPolicy, secret: bytes) -> ProtectedLocation:
    """What one viewer is shown of one deployment.

    Args:
        lat, lon: true position, decimal degrees. deployment_id: stable id (the displacement is keyed on it).
        recorded: IUCN categories of the species the deployment recorded.
        exact_allowed: the viewer may see exact positions (the ranger and operator roles).
        policy: :class:`LocationPolicy`. secret: the federation's location secret.

    Raises:
        ConfigError: coordinates out of range.
    """
    _check(lat, lon)
    if exact_allowed or not (set(recorded) & set(policy.categories)):
        return ProtectedLocation(lat, lon, fuzzed=False, method="exact")
    if policy.method == "grid":
        glat, glon = coarsen_to_grid(lat, lon, cell_m=policy.cell_m)
        return ProtectedLocation(glat, glon, fuzzed=True, method="grid")
    dlat, dlon = displace(lat, lon, deployment_id=deployment_id, secret=secret, radius_m=policy.radius_m)
    return ProtectedLocation(dlat, dlon, fuzzed=True, method="displace")


def load_or_create_secret(path: str | Path) -> bytes:
    """The federation's location secret (32 random bytes, hex in a 0600 file), created on first use.

    Raises:
        ConfigError: the file exists but is not 64 hex characters, or is readable by group/others.
    """
    path = Path(path)
    if not path.exists():
        write_file_atomic(path, (secrets.token_hex(32) + "\n").encode("ascii"), mode=0o600)
    if path.stat().st_mode & 0o077:
        raise ConfigError("the location secret is readable by group/others", source=path, field="location_secret",
                          fix=f"run `chmod 600 {path}`")
    text = path.read_text(encoding="ascii").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError("the location secret is not 64 hex characters", source=path, field="location_secret",
                          fix="restore it from backup (a new one moves every displaced deployment)")
    return key
