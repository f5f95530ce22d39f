"""NIRA as the coordinator's strategy: per-cluster heads over a shared phi, hand-computed aggregates, species-embedding
merging, re-clustering from phi-updates, and the state that survives a restart (in-memory bus, fake sites)."""

from __future__ import annotations

import numpy as np
import pytest

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.strategies.nira import BUNDLE_PREFIX, NIRA
from coordinator.strategies.reclustering import hash_sketch
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config

LC = IUCNCategory.LC
SPECIES = [{"scientific_name": n, "class_index": i, "iucn_category": "LC"} for i, n in enumerate("ABC")]


def head_model() -> dict[str, np.ndarray]:
    """phi.w (2,), psi.weight (3, 2), psi.bias (3,): three species A, B, C on two features."""
    return {"phi.w": np.array([0.5, -0.5], np.float32),
            "psi.weight": np.arange(6, dtype=np.float32).reshape(3, 2) / 10,
            "psi.bias": np.array([0.1, 0.2, 0.3], np.float32)}


@pytest.fixture
def nira_federation(tmp_path):
    made = []

    def build(specs, **strategy):
        transport, key = InMemoryTransport(), generate_signing_key()
        cfg = make_config(tmp_path, rounds=3, species=SPECIES, ship_ort_artifacts=False, num_classes=3,
                          strategy={"kind": "nira", "distance_threshold": 0.5, "embedding_merging": True, **strategy})
        coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=head_model())
        made.append(coord)
        sites = {}
        for sid, value, n, species in specs:
            site = FakeSite(sid, transport, key.public_key(), value=value, num_examples=n, events={LC: EVENT}).attach()
            coord.enrol(sid, site.public_pem, {"capacity": n, "species": species})
            sites[sid] = site
        return coord, sites

    yield build
    for c in made:
        c.close()


def test_phi_is_shared_heads_stay_per_cluster_and_missing_species_are_merged(nira_federation):
    # Prepare: a and b list {A, B} (Jaccard 1), c lists {C} (Jaccard 0 with both) -> clusters {a, b} and {c}
    coord, sites = nira_federation([("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]), ("c", 2.0, 20, ["C"])])
    w0 = head_model()
    # Execute
    result = coord.run_round()
    # Assert
    assert result.status == "closed" and result.accepted == ("a", "b", "c")
    assignment = coord.rounds._strategy.assignment()
    assert assignment.clusters == {"c0": ("a", "b"), "c1": ("c",)}
    _, bundle = coord.rounds.current_model()
    # intra-cluster FedAvg: c0 = (10*1 + 30*4)/40 = 3.25, c1 = 2; phi = 2/3 * 3.25 + 1/3 * 2 = 17/6
    np.testing.assert_allclose(bundle["phi.w"], w0["phi.w"] + 17 / 6, rtol=1e-6)
    head = {c: (bundle[f"{BUNDLE_PREFIX}{c}/psi.weight"], bundle[f"{BUNDLE_PREFIX}{c}/psi.bias"]) for c in ("c0", "c1")}
    # c0 trained A, B (+3.25) and lacks C. Rows as (w0, w1, b): c0's rows after the step are init + 3.25, mean row
    # (3.45, 3.55, 3.45); its own rows A, B centred: (-0.2, -0.2, -0.1) and 0, weight norms 0.2828 and 0, mean 0.1414.
    # C's embedding from c (init + 2, mean row (2.2, 2.3, 2.2)): centred (0.2, 0.2, 0.1); weight part (0.2, 0.2),
    # norm 0.2828, shrunk to 0.1414 -> (0.1, 0.1); moved to c0's mean row -> (3.55, 3.65). c0's bias for C is its own.
    np.testing.assert_allclose(head["c0"][0][:2], w0["psi.weight"][:2] + 3.25, rtol=1e-6)
    np.testing.assert_allclose(head["c0"][0][2], [3.55, 3.65], rtol=1e-6)
    np.testing.assert_allclose(head["c0"][1], w0["psi.bias"] + 3.25, rtol=1e-6)
    # c1 trained C (+2) and lacks A, B: centred merged rows of a and b (uniform shifts) are init_s - mean init row,
    # with C's own centred norm as the target (0.2828, the same as A's): they land at init + 2
    np.testing.assert_allclose(head["c1"][0], w0["psi.weight"] + 2.0, rtol=1e-6)
    np.testing.assert_allclose(head["c1"][1], w0["psi.bias"] + 2.0, rtol=1e-6)
    # merging happens once per (cluster, species)
    assert coord.rounds._strategy.state()["merged"] == {"c0": [2], "c1": [0, 1]}
    assert "psi.weight" not in bundle  # the plain head became one head per cluster
    # Round 2: each site is sent the shared phi and its own cluster's head, under the plain names
    coord.run_round()
    for sid, cluster in (("a", "c0"), ("c", "c1")):
        task_weights = sites[sid].last_weights
        np.testing.assert_array_equal(task_weights["phi.w"], bundle["phi.w"])
        np.testing.assert_array_equal(task_weights["psi.weight"], head[cluster][0])


def test_without_merging_a_cluster_keeps_its_own_rows(nira_federation):
    coord, _ = nira_federation([("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]), ("c", 2.0, 20, ["C"])],
                               embedding_merging=False)
    coord.run_round()
    _, bundle = coord.rounds.current_model()
    # every row of c0's head moved by c0's own FedAvg delta (3.25), none was replaced
    np.testing.assert_allclose(bundle["nira/c0/psi.weight"], head_model()["psi.weight"] + 3.25, rtol=1e-6)


def test_reclustering_moves_a_site_whose_phi_updates_align_with_another_cluster(nira_federation):
    # Prepare: species put c with d ({C}); but c's updates point like a's and b's (+), d's the other way (-)
    coord, sites = nira_federation([("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]),
                                    ("c", 2.0, 20, ["C"]), ("d", -1.0, 20, ["C"])],
                                   recluster_every=1, recluster_margin=0.5, min_rounds_between_moves=2)
    # Execute: round 1 re-clusters at its end; round 2 trains with the new clusters
    coord.run_round()
    strategy = coord.rounds._strategy
    # Assert: cos(c, a) = cos(c, b) = 1, cos(c, d) = -1: gain 2 >= 0.5, c moves to {a, b}; d would empty c1: stays
    assert strategy.assignment().clusters == {"c0": ("a", "b", "c"), "c1": ("d",)}
    change = strategy.state()["changes"][-1]
    assert (change["round"], change["site"], change["from"], change["to"]) == (1, "c", "c1", "c0")
    assert "cosine" in change["reason"] or "cos" in change["reason"]
    # anti-flapping: c moved in round 1, so at the end of round 2 (< 2 rounds later) it cannot move back, even
    # though its round-2 update now points like d's
    sites["c"].value = -1.0
    coord.run_round()
    np.testing.assert_array_equal(sites["c"].last_weights["psi.weight"], sites["a"].last_weights["psi.weight"])
    assert strategy.assignment().site_cluster["c"] == "c0"
    # one round later the rule allows it: c's update still points like d's, so it moves back
    coord.run_round()
    assert strategy.assignment().site_cluster["c"] == "c1"


def test_state_survives_a_restart_and_operators_can_pin(nira_federation, tmp_path):
    coord, _ = nira_federation([("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]), ("c", 2.0, 20, ["C"])])
    coord.run_round()
    strategy = coord.rounds._strategy
    strategy.pin("c", "c0")
    again = NIRA(store=coord.store, site_metadata=lambda: {s.site_id: s.metadata for s in coord.registry.list()},
                 cut={"distance_threshold": 0.5, "num_clusters": None})
    assert again.assignment() == strategy.assignment() and again.state()["recluster_requested"] is True
    coord.run_round()  # the pin is applied before round 2
    assert strategy.assignment().site_cluster["c"] == "c0"
    assert strategy.state()["changes"][-1]["reason"] == "operator re-cluster"


def test_hash_sketch_preserves_inner_products_in_expectation():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(20_000), rng.standard_normal(20_000)
    y = 0.6 * x + 0.8 * y  # cos(x, y) about 0.6
    sx, sy = hash_sketch(x), hash_sketch(y)
    cos = float(sx @ sy / np.linalg.norm(sx) / np.linalg.norm(sy))
    exact = float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))
    assert abs(cos - exact) < 0.05  # error ~ 1/sqrt(4096) per unit norm
    np.testing.assert_array_equal(hash_sketch(x), sx)  # the same hash for every site


def test_a_fresh_clustering_keeps_heads_with_the_sites_that_trained_them():
    from coordinator.strategies.ecological_clustering import cluster_sites, jaccard_matrix
    from coordinator.strategies.reclustering import match_labels

    ids, sim = jaccard_matrix({"a": {"A"}, "b": {"A"}, "c": {"C"}, "d": {"C"}})
    old = cluster_sites(sim, ids, num_clusters=2)  # c0 = {a, b}, c1 = {c, d}
    swapped = old.with_clusters({"c1": ("a", "b"), "c0": ("c", "d")})
    # by overlap: {a, b} keeps the label it had in `old`
    assert match_labels(swapped, old, {}).clusters == {"c0": ("a", "b"), "c1": ("c", "d")}
    # a pin wins over overlap; the displaced cluster takes a fresh label
    assert match_labels(old, old, {"c": "c7"}).clusters == {"c0": ("a", "b"), "c7": ("c", "d")}


def test_noisy_counts_weight_the_merge_and_are_charged_to_the_ledger(nira_federation):
    # Prepare: merging weighted by counts each site releases with noise std 20 (here the fake sites report fixed
    # "noisy" counts, so the merged rows can be computed by hand)
    import dp_accounting
    from dp_accounting import rdp

    coord, sites = nira_federation([("a", 1.0, 10, ["A", "B"]), ("b", 4.0, 30, ["A", "B"]), ("c", 2.0, 20, ["C"])],
                                   embedding_weights="noisy_counts", count_noise_multiplier=20.0)
    sites["a"].counts = {0: 100.0, 1: 30.0, 2: -5.0}
    sites["b"].counts = {0: 300.0, 1: 10.0, 2: 3.0}
    sites["c"].counts = {0: 1.0, 1: -8.0, 2: 200.0}
    w0 = head_model()
    # Execute
    result = coord.run_round()
    # Assert: every task asked for counts with noise 20
    assert result.status == "closed" and all(s.tasks[-1].count_noise_multiplier == 20.0 for s in sites.values())
    # the count release is charged beside the DP-SGD steps: two ledger events per round, composed together
    from tests.coordinator.helpers import EVENT
    for sid in ("a", "b", "c"):
        assert coord.ledger.events(sid, LC) == [EVENT, type(EVENT)(20.0, 1.0, 1)]
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(EVENT.sampling_rate, dp_accounting.GaussianDpEvent(1.2)), 5))
        acc.compose(dp_accounting.GaussianDpEvent(20.0))
        assert coord.ledger.spent(sid, LC) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    _, bundle = coord.rounds.current_model()
    # each site's embedding is its own trained head row, centred on that head's mean row: every site's head moved
    # uniformly (a +1, b +4, c +2), so each centred row is init_s - mean(init), whatever the weights.
    # c0 = {a, b}: its noisy C total is -5 + 3 = -2 <= 3 * 20 * sqrt(2): it lacks C (weights max(0, count): b 3,
    # c 200, a 0). By the counts it also lacks B (30 + 10 = 40 <= 84.9), so its only own row is A (centred weight
    # norm 0.2828, the same as C's): nothing to shrink, C lands at c0's mean row + (0.2, 0.2) = init_C + 3.25
    np.testing.assert_allclose(bundle["nira/c0/psi.weight"][2], w0["psi.weight"][2] + 3.25, rtol=1e-6)
    # c1 = {c}: A total 1 <= 60 and B total -8: it lacks both; A lands at init + 2 (see the public case)
    np.testing.assert_allclose(bundle["nira/c1/psi.weight"][0], w0["psi.weight"][0] + 2.0, rtol=1e-6)
    # ... and keeps its own row C (total 200 > 60): trained by c alone (+2)
    np.testing.assert_allclose(bundle["nira/c1/psi.weight"][2], w0["psi.weight"][2] + 2.0, rtol=1e-6)


def test_an_update_without_the_asked_counts_is_refused(nira_federation):
    coord, sites = nira_federation([("a", 1.0, 10, ["A"]), ("b", 1.0, 10, ["A"])],
                                   embedding_weights="noisy_counts", count_noise_multiplier=20.0)
    sites["a"].counts = {0: 1.0, 1: 2.0}  # class 2 missing
    sites["b"].counts = {0: 1.0, 1: 2.0, 2: 3.0}
    result = coord.run_round()
    assert result.accepted == ("b",) and coord.status().rejections == {"bad_report": 1}


class DictStore:
    """The two methods NIRA needs from coordinator.storage.Store, in memory."""

    def __init__(self):
        self.values = {}

    def get_state(self, key, default=None):
        return self.values.get(key, default)

    def set_state(self, key, value):
        import json

        self.values[key] = json.loads(json.dumps(value))


def test_merged_rows_are_count_weighted_rescaled_and_moved_to_the_receiving_heads_offset():
    # Prepare: a in cluster {a} (species A), b and c in cluster {b, c} (species C); merging by noisy counts
    meta = {"a": {"species": ["A"]}, "b": {"species": ["C"]}, "c": {"species": ["C"]}}
    nira = NIRA(store=DictStore(), site_metadata=lambda: meta, cut={"distance_threshold": 0.5, "num_clusters": None},
                count_noise=1.0)
    bundle = nira.prepare({"phi.w": np.zeros(1, np.float32), "psi.weight": np.zeros((2, 1), np.float32),
                           "psi.bias": np.zeros(2, np.float32)}, round=1)
    assert nira.assignment().clusters == {"c0": ("a",), "c1": ("b", "c")}
    nira.begin_round(bundle)

    def delta(w_rows, b_rows):
        return {"phi.w": np.zeros(1, np.float32), "psi.weight": np.array(w_rows, np.float32).reshape(2, 1),
                "psi.bias": np.array(b_rows, np.float32)}

    # rows are (weight, bias) per class 0 (A), 1 (C)
    nira.accumulate("a", delta([0.0, 0.0], [0.0, 0.0]), num_examples=5, species_counts={0: 50.0, 1: -1.0})
    nira.accumulate("b", delta([0.0, 2.0], [0.0, 0.0]), num_examples=5, species_counts={0: 0.0, 1: 30.0})
    nira.accumulate("c", delta([0.0, 6.0], [0.0, 4.0]), num_examples=5, species_counts={0: 0.5, 1: 10.0})
    new = nira.after_step({k: v + d for (k, v), d in zip(bundle.items(), nira.aggregate().values())})
    # Assert: cluster c0 lacks C (its noisy C total -1 <= 3): e_C from b (weight 30) and c (weight 10).
    #   b's head rows: A (0, 0), C (2, 0), mean (1, 0)  -> centred C = (1, 0)
    #   c's head rows: A (0, 0), C (6, 4), mean (3, 2)  -> centred C = (3, 2)
    #   weighted: (30 (1, 0) + 10 (3, 2)) / 40 = (1.5, 0.5); a's weight for C is max(0, -1) = 0
    #   c0's head after the step is a's (all zero), mean row (0, 0), own row A centred 0 (no norm to match): the
    #   weight of row C becomes 1.5; its bias stays c0's own, 0
    np.testing.assert_allclose([new["nira/c0/psi.weight"][1, 0], new["nira/c0/psi.bias"][1]], [1.5, 0.0], rtol=1e-6)
    # cluster c1 has A's total 0.5 <= 3 * sqrt(2): it lacks A; e_A from a (weight 50, centred A (0, 0)) and c
    #   (weight 0.5, centred A = (0, 0) - (3, 2) = (-3, -2)): weight part 0.5 * -3 / 50.5 < 0. c1's head after the
    #   step is the FedAvg of b and c (equal N): A (0, 0), C (4, 2), mean row (2, 1); its own row C centred (2, 1)
    #   has weight norm 2 >= 1.5/50.5, so the direction is kept (never enlarged) and moved to the mean weight 2:
    #   2 - 1.5/50.5; the bias stays c1's own, 0
    np.testing.assert_allclose([new["nira/c1/psi.weight"][0, 0], new["nira/c1/psi.bias"][0]], [2 - 1.5 / 50.5, 0.0],
                               rtol=1e-6, atol=1e-7)
    # its own row C is untouched by merging
    np.testing.assert_allclose([new["nira/c1/psi.weight"][1, 0], new["nira/c1/psi.bias"][1]], [4.0, 2.0], rtol=1e-6)
