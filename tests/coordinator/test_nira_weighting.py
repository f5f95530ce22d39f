"""NIRA's phi weighting, minimum cluster size and similarity SNR, against hand-worked values
and a Monte Carlo estimate."""

import math

import numpy as np
import pytest

from coordinator.strategies.base import update_noise_variance
from coordinator.strategies.cluster_assignment import ClusterAssignment
from coordinator.strategies.ecological_clustering import merge_small_clusters
from coordinator.strategies.nira import NIRA
from coordinator.strategies.reclustering import similarity_snr
from shared.errors import ConfigError
from shared.privacy.events import DPSGDEvent
from tests.coordinator.test_nira import DictStore

CUT = {"distance_threshold": 0.5, "num_clusters": None}


def _nira(meta, **kw):
    return NIRA(store=DictStore(), site_metadata=lambda: meta, cut=CUT, embedding_merging=False, **kw)


def _round(nira, updates):
    """One round: prepare, accumulate ``{site: (phi value, N, v)}``; returns the phi aggregate (a scalar)."""
    bundle = nira.prepare({"phi.w": np.zeros(1, np.float32), "psi.weight": np.zeros((2, 1), np.float32),
                           "psi.bias": np.zeros(2, np.float32)}, round=1)
    nira.begin_round(bundle)
    for site, (phi, n, v) in updates.items():
        nira.accumulate(site, {"phi.w": np.array([phi], np.float32), "psi.weight": np.zeros((2, 1), np.float32),
                               "psi.bias": np.zeros(2, np.float32)}, num_examples=n, noise_variance=v)
    return float(nira.aggregate()["phi.w"][0])


# a and b share species A (one cluster), c holds B alone (its own cluster)
META = {"a": {"species": ["A"], "capacity": 100}, "b": {"species": ["A"], "capacity": 300},
        "c": {"species": ["B"], "capacity": 50}}
UPDATES = {"a": (1.0, 100, 4.0), "b": (2.0, 300, 1.0), "c": (10.0, 50, 9.0)}
# cluster {a, b}: mean (100 * 1 + 300 * 2) / 400 = 1.75, V = (100^2 4 + 300^2 1) / 400^2 = 130000 / 160000
# cluster {c}: mean 10, V = 9


def test_phi_moves_by_records_like_fedavg_by_default():
    assert _round(_nira(META), UPDATES) == pytest.approx((100 * 1 + 300 * 2 + 50 * 10) / 450, rel=1e-6)


def test_the_seeds_cluster_count_weighting_gives_a_singleton_half_the_vote():
    # |C_m| / K: {a, b} 2/3, {c} 1/3
    assert _round(_nira(META, phi_weighting="clusters"), UPDATES) == pytest.approx(2 / 3 * 1.75 + 1 / 3 * 10,
                                                                                   rel=1e-6)


def test_inverse_variance_weights_each_cluster_mean_by_its_precision():
    v1, v2 = 130000 / 160000, 9.0
    w1 = (1 / v1) / (1 / v1 + 1 / v2)
    nira = _nira(META, phi_weighting="inverse_variance")
    assert _round(nira, UPDATES) == pytest.approx(w1 * 1.75 + (1 - w1) * 10, rel=1e-6)
    d = nira.round_diagnostics()
    # the noise std on phi: sqrt(w1^2 V1 + w2^2 V2); FedAvg's: sqrt(sum_k (N_k / N)^2 v_k)
    assert d["phi_noise_std"] == pytest.approx(math.sqrt(w1 ** 2 * v1 + (1 - w1) ** 2 * v2), rel=1e-9)
    assert d["fedavg_noise_std"] == pytest.approx(math.sqrt((100 ** 2 * 4 + 300 ** 2 + 50 ** 2 * 9) / 450 ** 2),
                                                  rel=1e-9)
    # the minimum-variance combination is never noisier than FedAvg's on the same updates
    assert d["phi_noise_std"] <= d["fedavg_noise_std"]


def test_inverse_variance_falls_back_to_records_without_noise_information():
    updates = {s: (phi, n, None) for s, (phi, n, _) in UPDATES.items()}
    assert _round(_nira(META, phi_weighting="inverse_variance"), updates) == pytest.approx(1200 / 450, rel=1e-6)


def test_bad_options_name_the_field():
    with pytest.raises(ConfigError) as err:
        _nira(META, phi_weighting="sites")
    assert err.value.field == "phi_weighting"
    with pytest.raises(ConfigError) as err:
        _nira(META, min_cluster_records=-1)
    assert err.value.field == "min_cluster_records"


def _assignment(clusters, sim):
    ids = tuple(sorted(s for m in clusters.values() for s in m))
    return ClusterAssignment(site_ids=ids, similarity=np.asarray(sim, float), clusters=clusters,
                             distance_threshold=0.5)


SIM = [[1.0, 0.6, 0.1, 0.3], [0.6, 1.0, 0.2, 0.1], [0.1, 0.2, 1.0, 0.0], [0.3, 0.1, 0.0, 1.0]]  # a b c d


def test_small_clusters_join_their_most_similar_cluster():
    a = _assignment({"c0": ("a", "b"), "c2": ("c",), "c3": ("d",)}, SIM)
    # c (10 records) is below 100: mean Jaccard to {a, b} (0.1 + 0.2) / 2 = 0.15 > to {d} 0.0 -> joins c0;
    # then d (2000) is not below the minimum
    out = merge_small_clusters(a, {"a": 1000, "b": 1000, "c": 10, "d": 2000}, 100)
    assert out.clusters == {"c0": ("a", "b", "c"), "c3": ("d",)}
    # at 2500, d (2000) is the smallest below it and joins c0 (mean (0.3 + 0.1 + 0.0) / 3 = 0.133, the only one)
    out = merge_small_clusters(a, {"a": 1000, "b": 1000, "c": 10, "d": 2000}, 2500)
    assert out.clusters == {"c0": ("a", "b", "c", "d")}
    assert merge_small_clusters(a, {"a": 1000, "b": 1000, "c": 10, "d": 2000}, 0) == a


def test_a_pinned_small_cluster_stays():
    a = ClusterAssignment(site_ids=("a", "b", "c", "d"), similarity=np.asarray(SIM), distance_threshold=0.5,
                          clusters={"c0": ("a", "b"), "c2": ("c",), "c3": ("d",)}, pinned={"c": "c2"})
    out = merge_small_clusters(a, {"a": 1000, "b": 1000, "c": 10, "d": 20}, 100)
    assert out.clusters == {"c0": ("a", "b", "d"), "c2": ("c",)}  # d (mean 0.2 with c0, 0.0 with c) moves


def test_nira_applies_the_minimum_when_clustering_from_species_lists():
    nira = _nira(META, min_cluster_records=60)
    nira.prepare({"psi.weight": np.zeros((2, 1), np.float32), "psi.bias": np.zeros(2, np.float32)}, round=1)
    assert nira.assignment().clusters == {"c0": ("a", "b", "c")}


def test_update_noise_variance_is_steps_times_lr_sigma_over_the_normaliser_squared():
    ev = {"LC": DPSGDEvent(2.0, 0.5, 3), "CR": DPSGDEvent(5.0, 0.1, 3)}  # sigma = C min z = 0.5 * 2
    v = update_noise_variance(ev, clipping_norm=0.5, learning_rate=4.0, expected_batch_size=1024, num_examples=500,
                              local_steps=3)
    assert v == pytest.approx(3 * (4.0 * 1.0 / 500) ** 2, rel=1e-12)  # min(B, N) = 500
    v = update_noise_variance(ev, clipping_norm=0.5, learning_rate=4.0, expected_batch_size=64, num_examples=500,
                              local_steps=1)
    assert v == pytest.approx((4.0 / 64) ** 2, rel=1e-12)
    assert update_noise_variance({}, clipping_norm=1, learning_rate=1, expected_batch_size=1, num_examples=1,
                                 local_steps=1) == 0.0


def test_similarity_snr_matches_a_monte_carlo_estimate_of_the_inner_products_noise():
    rng = np.random.default_rng(0)
    d, trials = 400, 3000
    s1, s2 = rng.normal(size=d), rng.normal(size=d)
    s1 *= 0.3 / np.sqrt(s1 @ s1 / d)  # signal power per coordinate 0.09 and 0.25 against noise variances 1 and 0.5
    s2 *= 0.5 / np.sqrt(s2 @ s2 / d)
    v1, v2 = 1.0, 0.5
    inner = np.empty(trials)
    norms1, norms2 = np.empty(trials), np.empty(trials)
    for t in range(trials):
        u1 = s1 + rng.normal(scale=math.sqrt(v1), size=d)
        u2 = s2 + rng.normal(scale=math.sqrt(v2), size=d)
        inner[t], norms1[t], norms2[t] = u1 @ u2, u1 @ u1, u2 @ u2
    empirical = math.sqrt(s1 @ s1) * math.sqrt(s2 @ s2) / inner.std()  # the signal bound over the noise's std
    estimated = np.median([similarity_snr({"a": norms1[t], "b": norms2[t]}, {"a": v1, "b": v2}, d)
                           for t in range(trials)])
    assert estimated == pytest.approx(empirical, rel=0.1)
    assert similarity_snr({"a": 1.0}, {"a": 1.0}, d) is None
    assert similarity_snr({"a": 1.0, "b": 2.0}, {"a": 0.0, "b": 0.0}, d) == math.inf


def test_re_clustering_waits_for_a_similarity_snr_above_the_minimum():
    meta = {s: {"species": ["A"] if s < "c" else ["B"], "capacity": 100} for s in "abcd"}
    nira = NIRA(store=DictStore(), site_metadata=lambda: meta, cut=CUT, embedding_merging=False,
                recluster_every=1, min_rounds_between_moves=1, recluster_min_snr=5.0)
    bundle = nira.prepare({"phi.w": np.zeros(8, np.float32), "psi.weight": np.zeros((2, 1), np.float32),
                           "psi.bias": np.zeros(2, np.float32)}, round=1)
    before = nira.assignment().clusters
    nira.begin_round(bundle)
    direction = {"a": 1.0, "b": -1.0, "c": 1.0, "d": -1.0}  # a and c agree, b and d agree: clean signal...
    for s, sign in direction.items():
        nira.accumulate(s, {"phi.w": np.full(8, sign, np.float32), "psi.weight": np.zeros((2, 1), np.float32),
                            "psi.bias": np.zeros(2, np.float32)}, num_examples=100, noise_variance=1.0)
    # ...but each update's squared norm 8 equals d v = 8: no signal above the noise, SNR 0 < 5
    lines = nira.end_round(1)
    assert lines and "below recluster_min_snr" in lines[0]
    assert nira.assignment().clusters == before
    assert nira.state()["diagnostics"][-1]["similarity_snr"] == 0.0
