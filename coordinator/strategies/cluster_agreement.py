"""Agreement of a clustering with known groups, for the metadata checks (wildfed_sim.nira_metadata):
:func:`contingency_table`, :func:`purity` and :func:`adjusted_rand_index` (Hubert & Arabie 1985).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coordinator.strategies.cluster_assignment import ClusteringError

__all__ = ["contingency_table", "purity", "adjusted_rand_index"]


def contingency_table(truth: Mapping[str, str], predicted: Mapping[str, str],
                      ) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray]:
    """Counts ``n[i, j]`` of items in true group i and predicted cluster j.

    Args:
        truth, predicted: ``{item: label}`` over the same items.

    Returns:
        ``(true_labels, predicted_labels, table)``: sorted labels and an int64 array of shape (len(true),
        len(predicted)).

    Raises:
        ClusteringError: the two mappings cover different items.
    """
    if set(truth) != set(predicted):
        raise ClusteringError("truth and predicted cover different items", field="predicted",
                              fix="label the same items in both")
    rows = tuple(sorted(set(truth.values())))
    cols = tuple(sorted(set(predicted.values())))
    ri, ci = {r: i for i, r in enumerate(rows)}, {c: j for j, c in enumerate(cols)}
    table = np.zeros((len(rows), len(cols)), dtype=np.int64)
    for item, r in truth.items():
        table[ri[r], ci[predicted[item]]] += 1
    return rows, cols, table


def purity(table: np.ndarray) -> float:
    """Cluster purity ``sum_j max_i n[i, j] / n`` of a contingency table (rows: true groups, columns: clusters).

    1.0 when every cluster holds one true group only (singletons score 1 too; read it with the cluster count).
    """
    t = np.asarray(table, dtype=np.int64)
    n = int(t.sum())
    if n == 0:
        raise ClusteringError("empty contingency table", field="table")
    return float(t.max(axis=0).sum()) / n


def adjusted_rand_index(table: np.ndarray) -> float:
    """Adjusted Rand index of a contingency table (Hubert & Arabie 1985, "Comparing partitions", eq. 5).

    ``ARI = (sum_ij C(n_ij, 2) - E) / (0.5 * (sum_i C(a_i, 2) + sum_j C(b_j, 2)) - E)`` with
    ``E = sum_i C(a_i, 2) * sum_j C(b_j, 2) / C(n, 2)``, ``a`` the row sums, ``b`` the column sums and ``C`` the
    binomial coefficient (``scipy.special.comb`` with ``exact=True``). 1.0 for identical partitions, about 0 for
    chance agreement, can be negative. When both partitions are trivial (denominator 0: one group and one
    cluster, or all singletons on both sides) the partitions agree and 1.0 is returned (sklearn's convention).

    Args:
        table: non-negative integer counts, shape (groups, clusters).

    Raises:
        ClusteringError: fewer than 2 items, or negative counts.
    """
    from scipy.special import comb

    t = np.asarray(table, dtype=np.int64)
    if t.ndim != 2 or (t < 0).any():
        raise ClusteringError("contingency table must be a 2-D array of non-negative counts", field="table")
    n = int(t.sum())
    if n < 2:
        raise ClusteringError(f"ARI needs at least 2 items, got {n}", field="table")
    sum_ij = sum(int(comb(int(x), 2, exact=True)) for x in t.ravel())
    sum_a = sum(int(comb(int(x), 2, exact=True)) for x in t.sum(axis=1))
    sum_b = sum(int(comb(int(x), 2, exact=True)) for x in t.sum(axis=0))
    expected = sum_a * sum_b / int(comb(n, 2, exact=True))
    maximum = 0.5 * (sum_a + sum_b)
    if maximum == expected:
        return 1.0
    return float((sum_ij - expected) / (maximum - expected))
