"""Sensitive-species location protection (coordinator.web.location_privacy), against closed forms: a bearing of 0
moves the latitude by exactly d / R radians; distances come back through the independent haversine formula; the
displacement is uniform by area (Kolmogorov-Smirnov on (r/R)^2 and the bearing); grid cells by hand. Real Wildlife
Insights deployment coordinates are used where ../shared/data is present."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
from scipy import stats

from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat

from coordinator.web.location_privacy import (EARTH_RADIUS_M, LocationPolicy, coarsen_to_grid, destination_point,
                                              displace, haversine_m, load_or_create_secret, protect)
from tests.support import SHARED_DATA

SECRET = bytes(range(32))
DATA_ROOT = SHARED_DATA


def test_destination_point_closed_forms() -> None:
    lat, lon = destination_point(3.5, -77.3, 1000.0, 0.0)  # due north: latitude + d/R radians, same longitude
    assert lat == pytest.approx(3.5 + math.degrees(1000.0 / EARTH_RADIUS_M), abs=1e-12)
    assert lon == pytest.approx(-77.3, abs=1e-12)
    lat, lon = destination_point(0.0, 10.0, 5000.0, math.pi / 2)  # due east on the equator: longitude + d/R
    assert lat == pytest.approx(0.0, abs=1e-12) and lon == pytest.approx(10.0 + math.degrees(5000.0 / EARTH_RADIUS_M))
    for bearing in (0.3, 1.9, 4.0, 5.9):  # any bearing: the haversine distance back is the distance asked for
        lat2, lon2 = destination_point(-33.9, 18.4, 750.0, bearing)
        assert haversine_m(-33.9, 18.4, lat2, lon2) == pytest.approx(750.0, rel=1e-9)
    assert destination_point(0.0, 179.999, 1000.0, math.pi / 2)[1] < -179.99  # wraps past the antimeridian


def test_displacement_is_fixed_per_deployment_within_the_radius_and_uniform_by_area() -> None:
    lat, lon = 3.526149, -77.272572
    first = displace(lat, lon, deployment_id="CTCAJ103744", secret=SECRET, radius_m=1000.0)
    assert displace(lat, lon, deployment_id="CTCAJ103744", secret=SECRET, radius_m=1000.0) == first  # repeat views
    assert displace(lat, lon, deployment_id="CTCAJ103745", secret=SECRET, radius_m=1000.0) != first
    assert displace(lat, lon, deployment_id="CTCAJ103744", secret=bytes(32), radius_m=1000.0) != first
    r2, bearings = [], []
    for i in range(3000):
        dlat, dlon = displace(lat, lon, deployment_id=f"dep-{i}", secret=SECRET, radius_m=1000.0)
        d = haversine_m(lat, lon, dlat, dlon)
        assert d <= 1000.0 * (1 + 1e-9)
        r2.append((d / 1000.0) ** 2)
        bearings.append(math.atan2(math.radians(dlon - lon) * math.cos(math.radians(lat)),
                                   math.radians(dlat - lat)) % (2 * math.pi) / (2 * math.pi))
    # uniform by area: (r/R)^2 ~ U(0, 1); the bearing ~ U(0, 2 pi). Deterministic here (fixed secret and ids).
    assert stats.kstest(r2, "uniform").pvalue > 0.01
    assert stats.kstest(bearings, "uniform").pvalue > 0.01


def test_grid_cells_by_hand() -> None:
    one_degree_m = EARTH_RADIUS_M * math.pi / 180.0  # a cell of exactly one degree of latitude
    lat, _ = coarsen_to_grid(0.3, 10.2, cell_m=one_degree_m)
    assert lat == pytest.approx(0.5, abs=1e-9)  # row floor(90.3) = 90 -> centre -90 + 90.5
    a = coarsen_to_grid(3.526149, -77.272572, cell_m=10_000.0)
    b = coarsen_to_grid(3.526149 + 0.001, -77.272572 + 0.001, cell_m=10_000.0)  # about 150 m away: same cell
    assert a == b
    assert haversine_m(3.526149, -77.272572, *a) <= 10_000.0 * math.sqrt(2) / 2 * 1.001  # within half a diagonal


def test_protect_by_role_and_category() -> None:
    policy = LocationPolicy()
    kw = dict(deployment_id="d1", policy=policy, secret=SECRET)
    exact = protect(1.0, 2.0, recorded=[Cat.EN, Cat.LC], exact_allowed=True, **kw)  # a ranger
    assert (exact.latitude, exact.longitude, exact.fuzzed, exact.method) == (1.0, 2.0, False, "exact")
    lc_only = protect(1.0, 2.0, recorded=[Cat.LC, Cat.NT], exact_allowed=False, **kw)  # nothing sensitive
    assert (lc_only.latitude, lc_only.longitude, lc_only.fuzzed) == (1.0, 2.0, False)
    shown = protect(1.0, 2.0, recorded=[Cat.EN], exact_allowed=False, **kw)  # a partner, an endangered species
    assert shown.fuzzed and shown.method == "displace" and (shown.latitude, shown.longitude) != (1.0, 2.0)
    assert haversine_m(1.0, 2.0, shown.latitude, shown.longitude) <= 1000.0
    grid = protect(1.0, 2.0, recorded=[Cat.VU], exact_allowed=False, deployment_id="d1", secret=SECRET,
                   policy=LocationPolicy(method="grid", cell_m=5000.0))
    assert grid.fuzzed and (grid.latitude, grid.longitude) == coarsen_to_grid(1.0, 2.0, cell_m=5000.0)
    only_cr = LocationPolicy(categories=frozenset({Cat.CR}))
    assert not protect(1.0, 2.0, recorded=[Cat.EN], exact_allowed=False, deployment_id="d1", secret=SECRET,
                       policy=only_cr).fuzzed
    with pytest.raises(ConfigError, match="radius_m"):
        LocationPolicy(radius_m=0)
    with pytest.raises(ConfigError, match="latitude"):
        protect(91.0, 0.0, recorded=[], exact_allowed=True, **kw)


def test_secret_is_created_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "location.secret"
    key = load_or_create_secret(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_or_create_secret(path) == key
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_or_create_secret(path)
    os.chmod(path, 0o600)
    path.write_text("not hex\n")
    with pytest.raises(ConfigError, match="64 hex"):
        load_or_create_secret(path)


def test_real_wildlife_insights_deployments_stay_within_the_radius() -> None:
    path = DATA_ROOT / "wildlife-insights" / "cajambre" / "deployments.csv"
    if not path.exists():
        pytest.skip(f"real data not present at {path}"
                    " (set WILDFED_SHARED_DATA to the data folder; a fresh clone has no ../shared/data)")
    with path.open(newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["latitude"] and r["longitude"]]
    assert rows
    for r in rows:
        lat, lon = float(r["latitude"]), float(r["longitude"])
        shown = protect(lat, lon, deployment_id=r["deployment_id"], recorded=[Cat.EN], exact_allowed=False,
                        policy=LocationPolicy(), secret=SECRET)
        assert shown.fuzzed and 0 < haversine_m(lat, lon, shown.latitude, shown.longitude) <= 1000.0
