"""Global DP mode: secure aggregation over the (in-memory) bus, the coordinator's one noise draw, and the ledger.

Fake sites here run the real site side of shared.secagg with vectors the test chooses, so the released aggregate
can be checked against a hand-computed sum (tests.coordinator.helpers.SecAggSite). Real gateway agents run the
same rounds in tests/edge/test_agent.py (the site side) and tests/test_demo.py (the whole federation, slow); the
crash case is in tests/coordinator/test_crash.py.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

import coordinator.global_dp as global_dp
import coordinator.secagg_round as secagg_round
from shared.envelope import Envelope
from shared.iucn import IUCNCategory
from shared.protocol import decode_secagg
from shared.secagg import quantise

from shared.privacy.accounting import epsilon_spent

from coordinator.global_dp import effective_sensitivity, global_events, global_noise_multiplier, secagg_settings
from tests.coordinator.helpers import FED, SecAggSite, tiny_weights

LC, CR, VU = IUCNCategory.LC, IUCNCategory.CR, IUCNCategory.VU


def rdp_eps(z: float, q: float, steps: int, delta: float = 1e-5) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


class ZeroNoise:
    """A RandomSource whose normals are 0: the released aggregate is then the exact secure sum (test only)."""

    def standard_normal(self, size):
        return np.zeros(size)

    def random(self, size):
        return np.zeros(size)


@pytest.fixture
def global_federation(federation, monkeypatch):
    def build(specs, *, zero_noise=True, **overrides):
        if zero_noise:
            monkeypatch.setattr(secagg_round, "SecureRandom", ZeroNoise)
        kw = dict(privacy="global", local_steps=1, expected_batch_size=4, learning_rate=0.5, rounds=3,
                  round_deadline_s=1.0, secagg={"stage_timeout_s": 0.5})
        kw.update(overrides)
        coord, transport, key = federation(**kw)
        sites = []
        for sid, value, n, cats, extra in specs:
            site = SecAggSite(sid, transport, key.public_key(), value=value, num_examples=n, categories=cats, **extra)
            coord.enrol(sid, site.public_pem, {"capacity": n, "categories": cats})
            sites.append(site)
        return coord, transport, sites

    return build


def test_settings_sensitivity_and_noise_are_the_documented_formulas():
    s = secagg_settings(site_ids=["b", "a", "c"], vector_length=8, clipping_norm=1.0, expected_batch_size=4)
    # B_box = C * B = 4; the largest power of two with 3 * rint(4 * scale) < 2^31 is 2^27 (3 * 2^29 < 2^31)
    assert s.site_ids == ("a", "b", "c") and s.threshold == 2 and s.max_abs_value == 4.0 and s.scale == 2.0 ** 27
    assert 3 * 4 * 2 ** 28 >= 2 ** 31  # the next power of two would wrap
    assert effective_sensitivity(1.0, 8, 2.0 ** 27) == pytest.approx(1.0 + math.sqrt(8) / 2 ** 27)


def test_distributed_shares_survive_f_colluders_in_the_plan_and_the_config(tmp_path):
    from shared.errors import ConfigError
    from shared.privacy.distributed import distributed_plan, skellam_share_variance
    from tests.coordinator.helpers import make_config

    # Prepare: 5 sites (majority t = 3), f = 1 colluder to survive
    budgets = {LC: 5 / 3, CR: 1 / 3}
    kw = dict(budgets=budgets, sampling_rates={s: 1.0 for s in "abcde"}, vector_length=8, clipping_norm=1.0,
              expected_batch_size=4, target_delta=1e-5, planned_rounds=3)
    # Execute
    settings, z = global_dp.plan_global_round(**kw, distributed=True, colluding_sites=1)
    trusted, _ = global_dp.plan_global_round(**kw, distributed=False, colluding_sites=1)
    # Assert: f rides in the distributed settings only (the trusted server's noise is no participant's)
    assert settings.threshold == 3 and settings.colluding_sites == 1 and trusted.colluding_sites == 0
    # each site's share is mu / (t - f): the t - f = 2 shares the colluder does not know carry mu, by hand
    mu = (z * (settings.scale + math.sqrt(8))) ** 2
    share = skellam_share_variance(noise_multiplier=z, clipping_norm=1.0, vector_length=8, scale=settings.scale,
                                   threshold=settings.threshold, colluding_sites=settings.colluding_sites)
    assert share == pytest.approx(mu / 2, rel=1e-12)
    # the box is the clipped sum's C B = 4 widened by 12 sd of a share: 1.1 z0 (C + 1) / sqrt(t - f), where z0
    # is the plan at the narrower grid of the box 4 alone
    z0, _ = distributed_plan(budgets=budgets, target_delta=1e-5, planned_rounds=3, clipping_norm=1.0,
                             vector_length=8, scale=secagg_settings(site_ids="abcde", vector_length=8,
                                                                    clipping_norm=1.0, expected_batch_size=4).scale)
    assert settings.max_abs_value == pytest.approx(4.0 + 12 * 1.1 * z0 * 2.0 / math.sqrt(2), rel=1e-12)
    # f must stay below t: refused with the field named, in the plan and in the config
    with pytest.raises(ConfigError, match="colluding_sites"):
        global_dp.plan_global_round(**kw, distributed=True, colluding_sites=3)
    with pytest.raises(ConfigError, match="colluding_sites"):
        make_config(tmp_path, privacy="global", local_steps=1, global_noise="distributed",
                    secagg={"threshold": 2, "colluding_sites": 2})
    assert make_config(tmp_path).secagg.colluding_sites == 1  # the default: a participant's own share is covered


def test_one_noise_multiplier_the_largest_any_site_needs_and_individual_rates():
    budgets = {LC: 5 / 3, CR: 1 / 3}
    sites = {"small": (0.5, (LC, CR)), "large": (0.05, (LC,))}
    z = global_noise_multiplier(budgets=budgets, sites=sites, target_delta=1e-5, planned_rounds=10)
    # the small site's anchor (LC at q = 0.5) needs the most noise and spends exactly its budget at z
    assert rdp_eps(z, 0.5, 10) == pytest.approx(budgets[LC], rel=2e-3)
    z_large = global_noise_multiplier(budgets=budgets, sites={"large": sites["large"]}, target_delta=1e-5,
                                      planned_rounds=10)
    assert z > z_large
    events = global_events(z, budgets=budgets, sites=sites, target_delta=1e-5, planned_rounds=10)
    assert set(events["small"]) == {LC, CR} and set(events["large"]) == {LC}
    assert events["small"][LC].sampling_rate == 0.5 and events["large"][LC].sampling_rate == 0.05
    # CR at the small site: sampled below q so that 10 rounds at z spend exactly CR's budget
    cr = events["small"][CR]
    assert cr.noise_multiplier == z and 0 < cr.sampling_rate < 0.5 and cr.steps == 1
    assert budgets[CR] * 0.99 <= rdp_eps(z, cr.sampling_rate, 10) <= budgets[CR]
    # the large site's LC is well inside its budget at the shared z (more noise than it needed)
    assert rdp_eps(z, 0.05, 10) < budgets[LC]


def test_global_round_releases_the_exact_sum_and_charges_before_unmasking(global_federation):
    # Prepare: three sites with clipped sums 0.25, 0.5, -1 everywhere, N = 8, 16, 4 -> q = 0.5, 0.25, 1
    coord, transport, sites = global_federation([("a", 0.25, 8, ["LC"], {}), ("b", 0.5, 16, ["LC", "CR"], {}),
                                                 ("c", -1.0, 4, ["LC"], {})], rounds=3)
    # Execute
    result = coord.run_round()
    # Assert: g = (0.25 + 0.5 - 1) / (0.5*8 + 0.25*16 + 1*4) = -0.25 / 12; theta <- theta - 0.5 g (zero noise)
    assert result.status == "closed" and result.accepted == ("a", "b", "c")
    _, weights = coord.rounds.current_model()
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 + 0.5 * 0.25 / 12, rtol=0, atol=1e-6)
    # each site charged one step per category at the one z, at the rate its budget allows (at most its q); CR
    # only at b
    budgets = coord.config.budgets()
    z = coord.ledger.events("a", LC)[0].noise_multiplier
    for sid, q, cats in (("a", 0.5, {LC}), ("b", 0.25, {LC, CR}), ("c", 1.0, {LC})):
        assert coord.ledger.categories(sid) == cats
        for c in cats:
            (event,) = coord.ledger.events(sid, c)
            assert event.noise_multiplier == z and event.steps == 1 and event.sampling_rate <= q
            assert rdp_eps(z, event.sampling_rate, 3) <= budgets[c] * (1 + 1e-9)
    # the sites are enrolled without a record count, so z was planned at q = 1 for the federation's largest budget
    assert rdp_eps(z, 1.0, 3) == pytest.approx(max(budgets.values()), rel=2e-3)
    assert budgets[CR] * 0.99 <= rdp_eps(z, coord.ledger.events("b", CR)[0].sampling_rate, 3) <= budgets[CR]
    assert all(site.ends == [{"status": "closed", "reason": site.ends[0]["reason"]}] for site in sites)
    row = coord.store.rounds()[-1]
    assert row.privacy == "global" and "3 of 3 sites unmasked" in row.detail
    assert coord.status().details[1] == ("global", row.detail)  # what `status` prints beside the round


def test_a_site_that_vanishes_after_sharing_is_recovered_and_not_charged(global_federation):
    # Prepare: d vanishes after sending its shares (before its masked sum); t = 3 of 4
    coord, transport, sites = global_federation([("a", 0.25, 8, ["LC"], {}), ("b", 0.5, 8, ["LC"], {}),
                                                 ("c", 1.0, 8, ["LC"], {}),
                                                 ("d", 8.0, 8, ["LC"], {"vanish_after": "shares"})])
    # Execute
    result = coord.run_round()
    # Assert: the sum over a, b, c only: (0.25 + 0.5 + 1) / (3 * 0.5 * 8)
    assert result.status == "closed" and result.accepted == ("a", "b", "c")
    _, weights = coord.rounds.current_model()
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 - 0.5 * 1.75 / 12, rtol=0, atol=1e-6)
    assert coord.ledger.categories("d") == set()
    assert "1 dropped after sharing" in coord.store.rounds()[-1].detail


def test_too_few_survivors_abandon_the_round_without_charging(global_federation):
    coord, _, _ = global_federation([("a", 0.25, 8, ["LC"], {}), ("b", 0.5, 8, ["LC"], {"vanish_after": "keys"}),
                                     ("c", 1.0, 8, ["LC"], {"vanish_after": "keys"})])
    coord.start()
    w_before = coord.rounds.current_model()[0]
    result = coord.run_round()
    assert result.status == "failed" and coord.rounds.current_model()[0] == w_before
    assert all(coord.ledger.categories(s) == set() for s in ("a", "b", "c"))
    assert "NotEnoughSharesError" in coord.store.rounds()[-1].detail


@pytest.mark.slow  # about 25 s
def test_the_coordinator_sees_only_uniform_masked_vectors(global_federation):
    # Prepare: site a sends the same constant clipped sum every round; 32 rounds of 8 coordinates
    coord, transport, sites = global_federation([("a", 0.5, 8, ["LC"], {}), ("b", 0.5, 8, ["LC"], {})], rounds=32)
    # Execute
    results = coord.run()
    # Assert: every round closed; what reached the coordinator for a is never its quantised plain vector, and
    # the bytes of its masked vectors are uniform (chi-square over the 256 byte values, 1024 bytes)
    assert [r.status for r in results] == ["closed"] * 32
    params = sites[0].task.secagg.params(FED, 1)
    plain = quantise(sites[0].plain, params)
    masked = [decode_secagg(Envelope.from_bytes(raw).payload, stages=("masked",)).masked
              for raw in sites[0].history["masked"]]
    assert len(masked) == 32 and not any(np.array_equal(m, plain) for m in masked)
    counts = np.bincount(np.frombuffer(np.concatenate(masked).astype("<u4").tobytes(), dtype=np.uint8),
                         minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-6
    # a mutation check of the test itself: the plain vectors' bytes are far from uniform
    plain_counts = np.bincount(np.frombuffer(np.tile(plain, 32).astype("<u4").tobytes(), dtype=np.uint8),
                               minlength=256)
    assert stats.chisquare(plain_counts).pvalue < 1e-6


def test_distributed_round_adds_no_noise_at_the_coordinator_and_charges_skellam_events(global_federation):
    from shared.privacy.distributed import distributed_plan, skellam_event
    from shared.privacy.events import SkellamEvent

    # Prepare: distributed noise (the sites add it; these fake sites add none, so the opened sum is exact)
    coord, transport, sites = global_federation([("a", 0.25, 8, ["LC"], {}), ("b", 0.5, 16, ["LC", "CR"], {}),
                                                 ("c", -1.0, 4, ["LC"], {})], zero_noise=False,
                                                global_noise="distributed")
    # Execute
    result = coord.run_round()
    # Assert: the released step is the exact sum (nothing added by the coordinator), as in the trusted test above,
    # normalised by every record of the three sites, 8 + 16 + 4 = 28 (distributed noise credits no subsampling, so
    # q_k = 1 at every site, where the trusted round normalises by sum_k min(1, B / N_k) N_k = 12)
    assert result.status == "closed" and result.accepted == ("a", "b", "c")
    _, weights = coord.rounds.current_model()
    for name, w0 in tiny_weights().items():
        np.testing.assert_allclose(weights[name], w0 + 0.5 * 0.25 / 28, rtol=0, atol=1e-6)
    task = sites[0].task
    assert task.distributed_noise and task.noise_multiplier > 0
    params = task.secagg
    assert params.threshold == 2 and params.colluding_sites == 1  # the config's default f rides in the task
    budgets = coord.config.budgets()
    z, norms = distributed_plan(budgets=budgets, target_delta=1e-5, planned_rounds=3, clipping_norm=1.0,
                                vector_length=params.vector_length, scale=params.scale)
    assert task.noise_multiplier == z
    for sid, cats in (("a", {LC}), ("b", {LC, CR}), ("c", {LC})):
        for c in cats:
            (event,) = coord.ledger.events(sid, c)
            assert isinstance(event, SkellamEvent) and event.steps == 1
            assert event == skellam_event(noise_multiplier=z, anchor_clipping_norm=1.0, clipping_norm=norms[c],
                                          vector_length=params.vector_length, scale=params.scale)
            assert event.l2_sensitivity == pytest.approx(norms[c] * params.scale + math.sqrt(params.vector_length))
            # three planned rounds of it stay within the category's budget, and spend it (within 1 %)
            assert budgets[c] * 0.99 <= epsilon_spent([event.with_steps(3)], target_delta=1e-5) <= budgets[c]
    assert norms[CR] < norms[LC] < 1.0  # per-category clipping ("scale"): CR's records move the sum least
    assert "distributed Skellam noise from the sites" in coord.store.rounds()[-1].detail
