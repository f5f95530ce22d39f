"""Who a printed epsilon holds against (shared.privacy.observers): every observer's epsilon against dp-accounting and
the Skellam bound computed here, with the noise each observer does not know worked out by hand."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent, SkellamEvent
from shared.privacy.observers import markdown_table, observer_statement, observer_table

DELTA = 1e-5
CR, NE = IUCNCategory.CR, IUCNCategory.NE
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
# ten releases at the demo's scale 2^17, d = 12,810: CR clipped at 0.19, NE at 1 (about the demo's plan)
D = 12810
CR_EV = SkellamEvent(variance=(6.8 * (131072 + math.sqrt(D))) ** 2, l2_sensitivity=0.19 * 131072 + math.sqrt(D),
                     l1_sensitivity=math.sqrt(D) * (0.19 * 131072 + math.sqrt(D)), steps=10)
NE_EV = SkellamEvent(CR_EV.variance, 131072 + math.sqrt(D), math.sqrt(D) * (131072 + math.sqrt(D)), 10)


def skellam_epsilon(ev: SkellamEvent, variance: float) -> float:
    """``ev``'s releases at ``variance``: Thm 3.5 at every integer order 2..2000 (written out here), converted by
    dp-accounting's ``compute_epsilon``."""
    a = np.arange(2, 2001, dtype=np.float64)
    d2, d1 = ev.l2_sensitivity, ev.l1_sensitivity
    r = ev.steps * (a * d2 * d2 / (2 * variance)
                    + np.minimum(((2 * a - 1) * d2 * d2 + 6 * d1) / (4 * variance ** 2), 3 * d1 / (2 * variance)))
    return float(rdp.rdp_privacy_accountant.compute_epsilon(a, r, DELTA)[0])


def dpsgd_epsilon(z: float, q: float, steps: int) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return float(acc.get_epsilon(DELTA))


def test_distributed_observers_face_the_noise_they_do_not_know():
    # Prepare: t = 7 survivors, shares of mu / (t - f) with f = 1: mu is the charge's variance
    charged = {CR: [CR_EV], NE: [NE_EV]}
    # Execute
    rows = observer_table(mode="distributed", charged=charged, target_delta=DELTA, threshold=7, colluding_sites=1)
    # Assert: by hand, the variance left to an observer knowing k shares is max(7 - k, 1) mu / 6
    want = {"coordinator": (0, 7 / 6), "non-participant": (0, 7 / 6), "one participant": (1, 1.0),
            "2 colluding participants (f + 1)": (2, 5 / 6),
            "6 or more colluding participants (t - 1), with or without the coordinator": (6, 1 / 6)}
    assert [r.observer for r in rows] == list(want)
    for r in rows:
        k, fraction = want[r.observer]
        assert r.colluders == k and r.noise_fraction == pytest.approx(fraction, rel=1e-15)
        assert r.charged is (fraction >= 1.0)
        for c, ev in ((CR, CR_EV), (NE, NE_EV)):
            assert r.epsilon[c] == pytest.approx(skellam_epsilon(ev, ev.variance * fraction), rel=1e-4), (r, c)
    # the charge is what one participant faces; the coordinator faces less, f + 1 colluders more
    one = rows[2].epsilon[CR]
    assert rows[0].epsilon[CR] < one < rows[3].epsilon[CR] < rows[4].epsilon[CR]


def test_without_colluders_covered_a_participant_faces_more_than_the_charge():
    # f = 0 (shares of mu / t): a participant knows its own share and is left (t - 1)/t of the charged noise
    rows = observer_table(mode="distributed", charged={CR: [CR_EV]}, target_delta=DELTA, threshold=7,
                          colluding_sites=0)
    by = {r.observer: r for r in rows}
    assert by["coordinator"].noise_fraction == 1.0 and by["coordinator"].charged
    assert by["one participant"].noise_fraction == pytest.approx(6 / 7) and not by["one participant"].charged
    assert by["one participant"].epsilon[CR] == pytest.approx(skellam_epsilon(CR_EV, CR_EV.variance * 6 / 7),
                                                              rel=1e-4)
    assert by["one participant"].epsilon[CR] > by["coordinator"].epsilon[CR]


def test_local_and_trusted_server_modes_and_a_mixed_history():
    dp = DPSGDEvent(1.2, 0.05, 40)
    charged = {CR: [dp]}
    ccdp = observer_table(mode="ccdp", charged=charged, target_delta=DELTA)
    trusted = observer_table(mode="trusted-server", charged=charged, target_delta=DELTA)
    want = dpsgd_epsilon(1.2, 0.05, 40)
    assert [r.observer for r in ccdp] == ["coordinator", "non-participant", "one participant",
                                          "any number of colluding participants"]
    assert all(r.charged and r.epsilon[CR] == pytest.approx(want, rel=1e-12) for r in ccdp)
    assert math.isinf(trusted[0].epsilon[CR]) and not trusted[0].charged and trusted[0].noise_fraction == 0.0
    assert all(r.charged and r.epsilon[CR] == pytest.approx(want, rel=1e-12) for r in trusted[1:])
    # distributed: only the Skellam releases of a history are rescaled (a local round's noise is the site's own)
    mixed = observer_table(mode="distributed", charged={CR: [dp, CR_EV]}, target_delta=DELTA, threshold=3,
                           colluding_sites=1)
    acc = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(dp.to_dp_event())
    a = np.ceil(acc.orders)
    half = CR_EV.variance / 2  # one colluder more than f: (t - 2) / (t - f) = 1/2 of mu
    sk = 10 * (a * CR_EV.l2_sensitivity ** 2 / (2 * half)
               + np.minimum(((2 * a - 1) * CR_EV.l2_sensitivity ** 2 + 6 * CR_EV.l1_sensitivity) / (4 * half ** 2),
                            3 * CR_EV.l1_sensitivity / (2 * half)))
    ref = rdp.rdp_privacy_accountant.compute_epsilon(acc.orders, acc.rdp + sk, DELTA)[0]
    f_plus_1 = next(r for r in mixed if r.colluders == 2)
    assert f_plus_1.epsilon[CR] == pytest.approx(ref, rel=1e-12)


def test_statements_name_the_observers_and_bad_values_are_refused():
    assert "NO DP guarantee holds against it" in observer_statement("trusted-server")
    assert "any coalition of participants" in observer_statement("ccdp")
    one = observer_statement("distributed", 1, 7)
    assert "one participant (its own share is covered)" in one and "2 or more colluding participants" in one
    assert "no participant" in observer_statement("distributed", 0)
    assert "any coalition" in observer_statement("distributed", 1, 2)  # t - f = 1: every share carries mu
    with pytest.raises(ConfigError, match="colluding_sites"):
        observer_table(mode="distributed", charged={}, target_delta=DELTA, threshold=3, colluding_sites=3)
    with pytest.raises(ConfigError, match="threshold"):
        observer_table(mode="distributed", charged={}, target_delta=DELTA)
    with pytest.raises(ConfigError, match="mode"):
        observer_table(mode="local", charged={}, target_delta=DELTA)  # type: ignore[arg-type]


def test_markdown_table_has_a_line_per_observer():
    rows = observer_table(mode="trusted-server", charged={CR: [DPSGDEvent(1.2, 0.05, 40)]}, target_delta=DELTA)
    text = markdown_table(rows, [CR]).splitlines()
    assert text[0].startswith("| observer | sees |") and len(text) == 2 + len(rows)
    assert "no guarantee" in text[2] and "| NO |" in text[2]
    assert f"{dpsgd_epsilon(1.2, 0.05, 40):.3f}" in text[3]
