"""The template-likelihood attacker on hand-made cases: the candidate grid, the profile
log-likelihood against its formula worked by hand, and evidence that accumulates over uploads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wildfed_sim.radio_attack import TemplateAttacker, candidate_grid, profile_log_likelihood


def test_candidate_grid_keeps_the_outdoor_pixels_of_the_grid():
    tile = np.zeros((6, 6), bool)
    tile[1, 1] = True  # a building on the grid point (1, 1)
    # step 2: offset 1, points at rows/cols 1, 3, 5 -> 9 points, minus the building
    pts = candidate_grid(tile, 2)
    assert len(pts) == 8 and [1.0, 1.0] not in pts.tolist() and [5.0, 3.0] in pts.tolist()
    with pytest.raises(ValueError):
        candidate_grid(np.ones((4, 4), bool), 2)


def test_profile_log_likelihood_is_the_groupwise_formula():
    u = np.array([1.0, 2.0, 0.0, 4.0])
    t = np.array([[1.0, 1.0, 1.0, 2.0], [0.0, 2.0, 0.0, 4.5]])
    g = np.array([0, 0, 1, 1])
    # template 0: group 0 squared residuals 0 + 1 = 1 (d=2), group 1: 1 + 4 = 5 (d=2)
    # l = -(2/2) log(1/2) - (2/2) log(5/2)
    # template 1: group 0: 1 + 0 = 1, group 1: 0 + 0.25 = 0.25 -> -(log(1/2) + log(0.125))
    expected = [-(math.log(0.5) + math.log(2.5)), -(math.log(0.5) + math.log(0.125))]
    np.testing.assert_allclose(profile_log_likelihood(u, t, g), expected, rtol=1e-12)


def test_evidence_summed_over_uploads_finds_a_centre_one_upload_cannot():
    rng = np.random.default_rng(0)
    candidates = np.array([[float(r), float(c)] for r in range(0, 40, 4) for c in range(0, 40, 4)])
    d = 600
    basis = rng.normal(size=(4, d))

    def template(c):  # a smooth function of the position, like a site's gradient
        r, k = c / 40.0
        return np.cos(np.pi * r) * basis[0] + np.sin(np.pi * k) * basis[1] + r * k * basis[2] + 0.1 * basis[3]

    group = np.repeat([0, 1, 2], d // 3)
    attacker = TemplateAttacker(candidates, group)
    templates = attacker.templates(template)
    truth = np.array([16.0, 24.0])
    noise = 4.0  # per coordinate: far above the templates' differences between neighbouring candidates
    one = TemplateAttacker(candidates, group)
    one.observe("site", template(truth) + noise * rng.normal(size=d), templates)
    for _ in range(60):
        attacker.observe("site", template(truth) + noise * rng.normal(size=d), templates)
    assert attacker.uploads["site"] == 60
    assert np.array_equal(attacker.estimate("site"), truth)
    assert not np.array_equal(one.estimate("site"), truth)
    errors = attacker.errors_m({"site": truth}, metres_per_pixel=4.0)
    assert errors == {"site": 0.0}


def test_site_maps_at_a_given_centre_put_every_transmitter_within_the_radius():
    from shared.radio import PathLossModel, RadioMapGeometry, city_tiles, site_maps

    geometry = RadioMapGeometry(size_px=32, metres_per_pixel=4.0)
    tiles = city_tiles(np.random.default_rng(1), 1, geometry=geometry)
    free = np.argwhere(~tiles[0])
    centre = free[len(free) // 2].astype(float)
    maps, got = site_maps(tiles, 0, 5, radius_m=20.0, rng=np.random.default_rng(2), model=PathLossModel(max_walls=4),
                          geometry=geometry, centre=centre)
    assert np.array_equal(got, centre)
    assert np.all(np.linalg.norm(maps.transmitters - centre, axis=1) <= 20.0 / 4.0 + 1e-9)
