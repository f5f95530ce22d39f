"""NIRA as the coordinator's strategy: per-cluster heads over a shared phi, hand-computed aggregates, species-embedding
merging, re-clustering from phi-updates, and the state that survives a restart (in-memory bus, fake sites)."""

from __future__ import annotations

import numpy as np
import pytest

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.strategies.nira import BUNDLE_PREFIX, NIRA, hash_sketch
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
                          strategy={"kind": "nira", "distance_threshold": 0.5, **strategy})
        coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=head_model())
        made.append(coord)
        sites = {}
        for sid, value, n, species in specs:
            site = FakeSite(sid, transport, key.public_key(), value=value, num_examples=n, events={LC: EVENT}).attach()
            coord.enrol(sid, site.public_pem, {"num_examples": n, "species": species})
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
    # c0 trained A, B (+3.25) and lacks C: row C is the merged embedding of C, from c only (init + 2)
    np.testing.assert_allclose(head["c0"][0][:2], w0["psi.weight"][:2] + 3.25, rtol=1e-6)
    np.testing.assert_allclose(head["c0"][0][2], w0["psi.weight"][2] + 2.0, rtol=1e-6)
    np.testing.assert_allclose(head["c0"][1], w0["psi.bias"] + [3.25, 3.25, 2.0], rtol=1e-6)
    # c1 trained C (+2) and lacks A, B: rows A, B are the N_k-weighted mean of a's and b's (init + 3.25)
    np.testing.assert_allclose(head["c1"][0], w0["psi.weight"] + [[3.25], [3.25], [2.0]], rtol=1e-6)
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
    from coordinator.strategies.nira import match_labels

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
    # each site's embedding is its own trained head row: init + its delta (a +1, b +4, c +2)
    # c0 = {a, b}: its noisy C total is -5 + 3 = -2 <= 3 * 20 * sqrt(2): it lacks C; merged e_C weights
    # max(0, count): a 0, b 3, c 200 -> (3 * (init + 4) + 200 * (init + 2)) / 203
    e_c = w0["psi.weight"][2] + (3 * 4.0 + 200 * 2.0) / 203
    np.testing.assert_allclose(bundle["nira/c0/psi.weight"][2], e_c, rtol=1e-5)
    # c1 = {c}: A total 1 <= 60 and B total -8: it lacks both; e_A = (100 (+1) + 300 (+4) + 1 (+2)) / 401
    e_a = w0["psi.weight"][0] + (100 * 1.0 + 300 * 4.0 + 1 * 2.0) / 401
    np.testing.assert_allclose(bundle["nira/c1/psi.weight"][0], e_a, rtol=1e-5)
    # ... and keeps its own row C (total 200 > 60): trained by c alone (+2)
    np.testing.assert_allclose(bundle["nira/c1/psi.weight"][2], w0["psi.weight"][2] + 2.0, rtol=1e-6)


def test_an_update_without_the_asked_counts_is_refused(nira_federation):
    coord, sites = nira_federation([("a", 1.0, 10, ["A"]), ("b", 1.0, 10, ["A"])],
                                   embedding_weights="noisy_counts", count_noise_multiplier=20.0)
    sites["a"].counts = {0: 1.0, 1: 2.0}  # class 2 missing
    sites["b"].counts = {0: 1.0, 1: 2.0, 2: 3.0}
    result = coord.run_round()
    assert result.accepted == ("b",) and coord.status().rejections == {"bad_report": 1}
