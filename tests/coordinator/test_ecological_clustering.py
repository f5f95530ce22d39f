"""NIRA ecological clustering: Jaccard, average-linkage clusters, pins, JSON, heatmap, re-clustering (the real
metadata checks are lab work: tests/sim/test_nira_metadata.py).

Hand-made federation used throughout (species letters are stand-ins for scientific names):

    a = {A, B, C, D}   b = {A, B, C, E}   c = {X, Y}   d = {X, Y, Z}   f = {A, X}

Jaccard by hand:
    J(a, b) = |{A,B,C}| / |{A,B,C,D,E}| = 3/5       J(c, d) = |{X,Y}| / |{X,Y,Z}| = 2/3
    J(a, f) = |{A}| / |{A,B,C,D,X}| = 1/5           J(b, f) = |{A}| / |{A,B,C,E,X}| = 1/5
    J(c, f) = |{X}| / |{X,Y,A}| = 1/3               J(d, f) = |{X}| / |{X,Y,Z,A}| = 1/4
    J(a or b, c or d) = 0 (disjoint)
UPGMA on distance 1 - J:
    1. {c,d} at 1/3;  2. {a,b} at 2/5;
    3. f with {c,d}: (2/3 + 3/4)/2 = 17/24 ~ 0.708  (f with {a,b}: (4/5 + 4/5)/2 = 0.8, later)
    4. {a,b} with {c,d,f}: (1+1+4/5+1+1+4/5)/6 = 5.6/6 ~ 0.933
So: cut 0.5 -> {a,b} {c,d} {f};  cut 0.75 -> {a,b} {c,d,f};  cut 0.95 -> one cluster; k=2 as cut 0.75.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.iucn import IUCNCategory

from coordinator.strategies.cluster_agreement import adjusted_rand_index, contingency_table, purity
from coordinator.strategies.cluster_assignment import ClusterAssignment, ClusteringError
from coordinator.strategies.ecological_clustering import (
    cluster_sites,
    jaccard,
    jaccard_matrix,
    plot_similarity_heatmap,
    site_species_lists,
)
from coordinator.strategies.reclustering import recluster_from_updates

LISTS = {"a": {"A", "B", "C", "D"}, "b": {"A", "B", "C", "E"}, "c": {"X", "Y"}, "d": {"X", "Y", "Z"},
         "f": {"A", "X"}}


@pytest.fixture(scope="module")
def matrix() -> tuple[tuple[str, ...], np.ndarray]:
    return jaccard_matrix(LISTS)


# ---------------------------------------------------------------------------------------------------- species lists

def test_species_lists_leave_out_cr_en_by_default_and_on_request_keep_them() -> None:
    metadata = {
        "s2": {"species": ["Panthera leo", "Diceros bicornis", " Lycaon pictus "]},
        "s1": {"species": [{"scientific_name": "Gorilla gorilla", "iucn_category": "CR"},
                           {"scientific_name": "Loxodonta africana", "iucn_category": "vu"}, "Equus quagga"]},
    }
    table = {"Diceros bicornis": IUCNCategory.CR, "Lycaon pictus": "EN", "Panthera leo": "VU",
             "Gorilla gorilla": "LC"}  # the entry's own CR wins over this table's LC
    lists = site_species_lists(metadata, species_categories=table)
    assert list(lists) == ["s1", "s2"]
    assert lists == {"s1": frozenset({"Loxodonta africana", "Equus quagga"}), "s2": frozenset({"Panthera leo"})}
    everything = site_species_lists(metadata, species_categories=table, exclude_categories=())
    assert everything["s2"] == {"Panthera leo", "Diceros bicornis", "Lycaon pictus"}
    assert everything["s1"] == {"Gorilla gorilla", "Loxodonta africana", "Equus quagga"}
    only_vu = site_species_lists(metadata, species_categories=table, exclude_categories=["VU"])
    assert only_vu["s2"] == {"Diceros bicornis", "Lycaon pictus"}


def test_species_lists_reject_missing_list() -> None:
    with pytest.raises(ClusteringError, match="no species list"):
        site_species_lists({"s1": {"capacity": 3}})
    with pytest.raises(ClusteringError, match="neither a name"):
        site_species_lists({"s1": {"species": [3]}})


# ---------------------------------------------------------------------------------------------------------- Jaccard

def test_jaccard_hand_values(matrix) -> None:
    ids, sim = matrix
    assert ids == ("a", "b", "c", "d", "f")
    assert sim.dtype == np.float64 and sim.shape == (5, 5)
    i = {s: k for k, s in enumerate(ids)}
    expected = {("a", "b"): 3 / 5, ("c", "d"): 2 / 3, ("a", "f"): 1 / 5, ("b", "f"): 1 / 5, ("c", "f"): 1 / 3,
                ("d", "f"): 1 / 4, ("a", "c"): 0.0, ("a", "d"): 0.0, ("b", "c"): 0.0, ("b", "d"): 0.0}
    for (x, y), value in expected.items():
        assert sim[i[x], i[y]] == pytest.approx(value, abs=1e-15)
        assert sim[i[y], i[x]] == sim[i[x], i[y]]
    assert np.all(np.diag(sim) == 1.0)


def test_jaccard_of_two_empty_lists_is_zero() -> None:
    assert jaccard([], []) == 0.0
    ids, sim = jaccard_matrix({"e1": [], "e2": [], "x": ["A"]})
    # off-diagonal 0 (no evidence of similarity), the diagonal stays 1
    assert sim.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


# ------------------------------------------------------------------------------------------------------- clustering

@pytest.mark.parametrize(("cut", "expected"), [
    ({"distance_threshold": 0.5}, {"c0": ("a", "b"), "c1": ("c", "d"), "c2": ("f",)}),
    ({"distance_threshold": 0.75}, {"c0": ("a", "b"), "c1": ("c", "d", "f")}),
    ({"distance_threshold": 0.95}, {"c0": ("a", "b", "c", "d", "f")}),
    ({"num_clusters": 2}, {"c0": ("a", "b"), "c1": ("c", "d", "f")}),
    ({"num_clusters": 3}, {"c0": ("a", "b"), "c1": ("c", "d"), "c2": ("f",)}),
    ({"num_clusters": 5}, {"c0": ("a",), "c1": ("b",), "c2": ("c",), "c3": ("d",), "c4": ("f",)}),
])
def test_clusters_at_threshold_and_k(matrix, cut, expected) -> None:
    ids, sim = matrix
    result = cluster_sites(sim, ids, **cut)
    assert dict(result.clusters) == expected
    assert result.site_cluster["f"] == next(lbl for lbl, m in expected.items() if "f" in m)


def test_labels_do_not_depend_on_input_order(matrix) -> None:
    ids, sim = matrix
    perm = [4, 2, 0, 3, 1]  # f, c, a, d, b
    shuffled = cluster_sites(sim[np.ix_(perm, perm)], [ids[p] for p in perm], distance_threshold=0.5)
    assert shuffled == cluster_sites(sim, ids, distance_threshold=0.5)
    assert shuffled.site_ids == ids and shuffled.labels == ("c0", "c1", "c2")


def test_cut_arguments_are_validated(matrix) -> None:
    ids, sim = matrix
    with pytest.raises(ClusteringError, match="exactly one"):
        cluster_sites(sim, ids)
    with pytest.raises(ClusteringError, match="exactly one"):
        cluster_sites(sim, ids, distance_threshold=0.5, num_clusters=2)
    with pytest.raises(ClusteringError, match="num_clusters"):
        cluster_sites(sim, ids, num_clusters=6)
    with pytest.raises(ClusteringError, match="symmetric"):
        bad = sim.copy()
        bad[0, 1] = 0.9
        cluster_sites(bad, ids, num_clusters=2)
    single = cluster_sites(np.ones((1, 1)), ["only"], num_clusters=1)
    assert dict(single.clusters) == {"c0": ("only",)}


def test_pinning(matrix) -> None:
    ids, sim = matrix
    # cut 0.75 gives c0={a,b}, c1={c,d,f}; the operator pins f to c0
    pinned = cluster_sites(sim, ids, distance_threshold=0.75, pinned={"f": "c0"})
    assert dict(pinned.clusters) == {"c0": ("a", "b", "f"), "c1": ("c", "d")}
    assert pinned.pinned == {"f": "c0"}
    # an unknown label makes a new, operator-named cluster
    named = cluster_sites(sim, ids, distance_threshold=0.75, pinned={"f": "rare"})
    assert dict(named.clusters) == {"c0": ("a", "b"), "c1": ("c", "d"), "rare": ("f",)}
    # a cluster emptied by pins disappears; the others keep their labels
    emptied = cluster_sites(sim, ids, distance_threshold=0.75, pinned={"a": "c1", "b": "c1"})
    assert dict(emptied.clusters) == {"c1": ("a", "b", "c", "d", "f")}
    with pytest.raises(ClusteringError, match="not among the sites"):
        cluster_sites(sim, ids, distance_threshold=0.75, pinned={"zz": "c0"})


def test_json_round_trip(matrix) -> None:
    ids, sim = matrix
    original = cluster_sites(sim, ids, distance_threshold=0.75, pinned={"f": "rare"})
    text = original.to_json()
    data = json.loads(text)
    assert data["clusters"] == {"c0": ["a", "b"], "c1": ["c", "d"], "rare": ["f"]}
    restored = ClusterAssignment.from_json(text)
    assert restored == original
    assert np.array_equal(restored.similarity, sim)  # exact floats (1/3, 2/3 ...) survive JSON
    assert restored.pinned == {"f": "rare"} and restored.distance_threshold == 0.75
    with pytest.raises(ClusteringError):
        ClusterAssignment.from_json("{\"site_ids\": [\"a\"]}")
    with pytest.raises(ClusteringError, match="newer"):
        ClusterAssignment.from_json(json.dumps({**data, "format": 99}))


def test_assignment_rejects_inconsistent_clusters(matrix) -> None:
    ids, sim = matrix
    with pytest.raises(ClusteringError, match="missing"):
        ClusterAssignment(site_ids=ids, similarity=sim, clusters={"c0": ("a", "b")})
    with pytest.raises(ClusteringError, match="in clusters"):
        ClusterAssignment(site_ids=ids, similarity=sim, clusters={"c0": ("a", "b", "c"), "c1": ("c", "d", "f")})


def test_heatmap_written(matrix, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    ids, sim = matrix
    path = plot_similarity_heatmap(cluster_sites(sim, ids, distance_threshold=0.5), tmp_path / "sub" / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)
    assert img.shape[0] >= 400 and img.shape[1] >= 400
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20  # not a blank canvas: several matrix colours, text, boundaries


# -------------------------------------------------------------------------------------------------- re-clustering

def _updates(**vectors: list[float]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in vectors.items()}


# c0={a,b}, c1={c,d}, c2={f} (cut 0.5). Vectors (f sends nothing):
#   u_a = (1,0,0), u_b = (0,0,1), u_c = (0,0,1), u_d = (0,0.6,0.8) (unit vectors, so cos = dot product)
#   b: own = cos(b,a) = 0; c1 = (cos(b,c) + cos(b,d))/2 = (1 + 0.8)/2 = 0.9 -> gain 0.9
#   a: own = 0; c1 = (0 + 0)/2 = 0 -> gain 0 (stays)
#   c: own = cos(c,d) = 0.8; c0 = (cos(c,a) + cos(c,b))/2 = (0 + 1)/2 = 0.5 -> gain -0.3 (stays)
#   d: own = 0.8; c0 = (0 + 0.8)/2 = 0.4 -> stays
ALIGNED = _updates(a=[1, 0, 0], b=[0, 0, 1], c=[0, 0, 1], d=[0, 0.6, 0.8])


@pytest.fixture
def three(matrix) -> ClusterAssignment:
    ids, sim = matrix
    return cluster_sites(sim, ids, distance_threshold=0.5)


def test_recluster_moves_site_aligned_with_other_cluster(three) -> None:
    new, changes = recluster_from_updates(ALIGNED, three, round=10, margin=0.1, min_rounds_between_moves=3)
    assert [(c.site, c.from_cluster, c.to_cluster, c.round) for c in changes] == [("b", "c0", "c1", 10)]
    assert changes[0].similarity_to == pytest.approx(0.9) and changes[0].similarity_from == pytest.approx(0.0)
    assert "0.900" in changes[0].reason and "0.000" in changes[0].reason and "margin 0.100" in changes[0].reason
    assert dict(new.clusters) == {"c0": ("a",), "c1": ("b", "c", "d"), "c2": ("f",)}
    assert np.array_equal(new.similarity, three.similarity)  # ecological matrix kept; labels kept


def test_recluster_respects_margin(three) -> None:
    # gain of b is 0.9 (see above): a margin of 0.95 keeps it where it is
    new, changes = recluster_from_updates(ALIGNED, three, round=10, margin=0.95)
    assert changes == [] and new == three


def test_recluster_respects_min_rounds_between_moves(three) -> None:
    # b moved at round 8; with 3 rounds between moves it may move again at round 11, not at 10
    _, early = recluster_from_updates(ALIGNED, three, round=10, min_rounds_between_moves=3, last_moved={"b": 8})
    assert early == []
    _, later = recluster_from_updates(ALIGNED, three, round=11, min_rounds_between_moves=3, last_moved={"b": 8})
    assert [c.site for c in later] == ["b"] and "last moved in round 8" in later[0].reason


def test_recluster_never_moves_pinned_site(matrix) -> None:
    ids, sim = matrix
    pinned = cluster_sites(sim, ids, distance_threshold=0.5, pinned={"b": "c0"})
    new, changes = recluster_from_updates(ALIGNED, pinned, round=10)
    assert changes == [] and new == pinned


def test_recluster_does_not_empty_a_cluster_unless_allowed(three) -> None:
    # f alone in c2, aligned with c1: u_f = (0,0,1); a, b send nothing.
    #   f: own = 0 (no other member); c1 = (cos(f,c) + cos(f,d))/2 = (1 + 0.8)/2 = 0.9 -> gain 0.9
    #   c: own = 0.8; c2 = cos(c,f) = 1 -> gain 0.2;  d: own 0.8, c2 = 0.8 -> gain 0. Margin 0.3 stops c.
    updates = _updates(c=[0, 0, 1], d=[0, 0.6, 0.8], f=[0, 0, 1])
    kept, none = recluster_from_updates(updates, three, round=5, margin=0.3)
    assert none == [] and kept == three
    new, changes = recluster_from_updates(updates, three, round=5, margin=0.3, allow_empty_clusters=True)
    assert [(c.site, c.from_cluster, c.to_cluster) for c in changes] == [("f", "c2", "c1")]
    assert dict(new.clusters) == {"c0": ("a", "b"), "c1": ("c", "d", "f")}
    assert "no other member reported" in changes[0].reason


def test_recluster_validates_updates(three) -> None:
    with pytest.raises(ClusteringError, match="not in the assignment"):
        recluster_from_updates(_updates(zz=[1, 0]), three, round=1)
    with pytest.raises(ClusteringError, match="entries"):
        recluster_from_updates(_updates(a=[1, 0], b=[1, 0, 0]), three, round=1)
    # a zero update carries no direction: ignored, nothing moves
    assert recluster_from_updates(_updates(a=[0, 0], b=[0, 0]), three, round=1)[1] == []


# ------------------------------------------------------------------------------------------- agreement measures

def test_ari_and_purity_hand_worked() -> None:
    # truth x x x y y y, predicted p p q q r r -> table [[2,1,0],[0,1,2]]
    # sum_ij C(n_ij,2) = 1 + 1 = 2; rows (3,3): 3 + 3 = 6; cols (2,2,2): 1+1+1 = 3; C(6,2) = 15
    # E = 6*3/15 = 1.2; max = (6+3)/2 = 4.5; ARI = (2 - 1.2)/(4.5 - 1.2) = 0.8/3.3 = 8/33
    truth = dict(zip("123456", "xxxyyy"))
    predicted = dict(zip("123456", "ppqqrr"))
    rows, cols, table = contingency_table(truth, predicted)
    assert rows == ("x", "y") and cols == ("p", "q", "r") and table.tolist() == [[2, 1, 0], [0, 1, 2]]
    assert adjusted_rand_index(table) == pytest.approx(8 / 33, abs=1e-12)
    assert purity(table) == pytest.approx(5 / 6)  # (2 + 1 + 2) / 6
    assert adjusted_rand_index(np.array([[3, 0], [0, 3]])) == 1.0
    # both partitions trivial (one group, one cluster): agreement, 1.0 by convention
    assert adjusted_rand_index(np.array([[4]])) == 1.0


# ------------------------------------------------------------------------------------------------ real metadata
