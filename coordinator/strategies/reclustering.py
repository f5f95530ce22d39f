"""Dynamic re-clustering of NIRA's sites from their phi-updates (docs/nira.md, "Ecological clustering").

- :func:`recluster_from_updates`: move sites to the cluster whose members' updates point the same way (cosine
  similarity), with a hysteresis margin and a minimum number of rounds between two moves of the same site.
- :func:`hash_sketch`: the fixed-size signed feature-hashing sketch each phi-update is kept as (Weinberger et al.
  2009, "Feature Hashing for Large Scale Multitask Learning", §2: inner products are preserved in expectation).
- :func:`similarity_snr`: whether a round's similarities carry signal above the DP noise.
- :func:`match_labels`: labels of a fresh clustering matched to the old one, so heads stay with their sites.

Privacy: the phi-updates are the updates the coordinator already received, outputs of the sites' DP mechanisms;
everything here is post-processing and costs no privacy budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.strategies.cluster_assignment import ClusterAssignment, ClusteringError

__all__ = ["ClusterChange", "recluster_from_updates", "SKETCH_DIM", "hash_sketch", "similarity_snr", "match_labels"]

#: Size of the sketch each phi-update is kept as (memory independent of the model size).
SKETCH_DIM = 4096


@dataclass(frozen=True)
class ClusterChange:
    """One site moved between clusters by :func:`recluster_from_updates`.

    Attributes:
        site: the site id.
        from_cluster, to_cluster: labels before and after.
        round: the round at which the move was decided.
        reason: human-readable: both mean cosine similarities, the gain, the margin, and the last move.
        similarity_from, similarity_to: the two mean cosine similarities (float, in [-1, 1]).
    """

    site: str
    from_cluster: str
    to_cluster: str
    round: int
    reason: str
    similarity_from: float = float("nan")
    similarity_to: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (for the coordinator's log / audit table)."""
        return {"site": self.site, "from_cluster": self.from_cluster, "to_cluster": self.to_cluster,
                "round": self.round, "reason": self.reason, "similarity_from": self.similarity_from,
                "similarity_to": self.similarity_to}


def recluster_from_updates(phi_updates: Mapping[str, np.ndarray], assignment: ClusterAssignment, *,
                           round: int, margin: float = 0.1, min_rounds_between_moves: int = 3,
                           last_moved: Mapping[str, int] | None = None, allow_empty_clusters: bool = False,
                           ) -> tuple[ClusterAssignment, list[ClusterChange]]:
    """Move sites to the cluster whose members' phi-updates point the same way as theirs (NIRA dynamic step).

    Rule, for every site ``s`` with a usable update (finite, nonzero norm) that is not pinned:

    - ``own = mean_{m in C(s), m != s} cos(u_s, u_m)`` over the other members of its cluster that sent a usable
      update; 0.0 when there is none (no evidence of alignment with its own cluster);
    - ``best = max over other clusters C of mean_{m in C} cos(u_s, u_m)`` over members that sent a usable update
      (clusters with none are not candidates; ties go to the first label);
    - ``s`` moves iff ``best - own >= margin`` (hysteresis: a small gain never moves a site) **and** it has not
      moved in the last ``min_rounds_between_moves`` rounds, i.e. ``round - last_moved[s] >=
      min_rounds_between_moves`` (anti-flapping).

    All decisions are taken against the *old* assignment (order-independent); moves are then applied in order of
    decreasing gain (ties by site id), and a move from A to B is skipped when a site already moved from B to A
    in the same call (no exchanges: two sites trading places is flapping in one round). By default a move that
    would leave its source cluster empty is not made: the cluster keeps its head and its label, and a single-site
    cluster is what the operator or the ecological clustering created. With ``allow_empty_clusters=True`` such
    moves are made and the emptied cluster is dropped from the assignment (its head becomes orphaned; the
    strategy decides what to do with it). Labels are never renumbered here, so per-cluster heads stay attached to
    their label. Sites without an update this round stay where they are.

    Privacy: ``phi_updates`` are the updates the coordinator already received, i.e. outputs of the sites' DP
    mechanisms (clipped and noised; or sums released by secure aggregation). Computing cosine similarities from
    them is post-processing and costs no privacy budget.

    Args:
        phi_updates: ``{site_id: u}``, u a 1-D float array (float32 in practice) of shape (d,), the flattened
            feature-extractor (phi) update of that site this round; all the same d.
        assignment: current clusters.
        round: current round index (>= 0).
        margin: minimum gain in mean cosine similarity to move (>= 0; cosine is in [-1, 1]).
        min_rounds_between_moves: a site moved at round r may move again at round ``r + min_rounds_between_moves``
            at the earliest (>= 0; 0 or 1 lets it move every round).
        last_moved: ``{site_id: round of its last move}``; sites absent never moved. The caller keeps it up to date
            from the returned changes (``last_moved[c.site] = c.round``).
        allow_empty_clusters: let a move empty its source cluster (see above).

    Returns:
        ``(new_assignment, changes)``: the assignment after the moves (same matrix, cut, pins, labels) and one
        :class:`ClusterChange` per move, in the order applied. ``changes`` is empty when nothing moved (then
        ``new_assignment == assignment``).

    Raises:
        ClusteringError: unknown site in ``phi_updates``, updates not 1-D or of different sizes, bad margin, round
            or ``min_rounds_between_moves``.
    """
    _check_recluster_arguments(round, margin, min_rounds_between_moves)
    last = dict(last_moved or {})
    unknown = sorted(set(phi_updates) - set(assignment.site_ids))
    if unknown:
        raise ClusteringError(f"updates from sites not in the assignment: {unknown}", field="phi_updates",
                              fix="cluster every enrolled site first (cluster_sites)")
    units = _unit_updates(phi_updates)
    if not units:
        return assignment, []
    proposals = _propose_moves(units, assignment, round=round, margin=margin,
                               min_rounds_between_moves=min_rounds_between_moves, last=last)
    clusters, changes = _apply_moves(proposals, assignment, round=round, margin=margin,
                                     min_rounds_between_moves=min_rounds_between_moves, last=last,
                                     allow_empty_clusters=allow_empty_clusters)
    if not changes:
        return assignment, []
    return assignment.with_clusters(clusters), changes


#: A proposed move: ``(gain, site, from label, to label, own mean cosine, best mean cosine, own reporting members,
#: best reporting members)``.
_Proposal = tuple[float, str, str, str, float, float, int, int]


def _check_recluster_arguments(round: int, margin: float, min_rounds_between_moves: int) -> None:
    """Raise :class:`ClusteringError` for a bad ``round``, ``margin`` or ``min_rounds_between_moves``."""
    if isinstance(round, bool) or not isinstance(round, (int, np.integer)) or round < 0:
        raise ClusteringError(f"round {round!r} must be an integer >= 0", field="round")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
        raise ClusteringError(f"margin {margin!r} must be a finite number >= 0", field="margin",
                              fix="e.g. 0.1 (a move needs 0.1 more mean cosine similarity)")
    if isinstance(min_rounds_between_moves, bool) or not isinstance(min_rounds_between_moves, (int, np.integer)) \
            or min_rounds_between_moves < 0:
        raise ClusteringError(f"min_rounds_between_moves {min_rounds_between_moves!r} must be an integer >= 0",
                              field="min_rounds_between_moves", fix="e.g. 3")


def _unit_updates(phi_updates: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Unit vectors (float64) of the usable updates (finite, nonzero norm), by site id in sorted order.

    Raises:
        ClusteringError: an update that is not 1-D, or updates of different sizes.
    """
    units: dict[str, np.ndarray] = {}
    dim = None
    for s in sorted(phi_updates):
        u = np.asarray(phi_updates[s], dtype=np.float64)
        if u.ndim != 1:
            raise ClusteringError(f"phi-update of site {s!r} has shape {u.shape}, expected (d,)",
                                  field="phi_updates", fix="flatten the phi tensors into one vector")
        if dim is None:
            dim = u.shape[0]
        elif u.shape[0] != dim:
            raise ClusteringError(f"phi-update of site {s!r} has {u.shape[0]} entries, others {dim}",
                                  field="phi_updates", fix="flatten the same phi tensors for every site")
        norm = float(np.linalg.norm(u))
        if math.isfinite(norm) and norm > 0.0:
            units[s] = u / norm
    return units


def _propose_moves(units: Mapping[str, np.ndarray], assignment: ClusterAssignment, *, round: int, margin: float,
                   min_rounds_between_moves: int, last: Mapping[str, int]) -> list[_Proposal]:
    """The moves the rule allows (:func:`recluster_from_updates`), each decided against the old assignment, in
    order of decreasing gain (ties by site id)."""
    reporters = sorted(units)
    mat = np.stack([units[s] for s in reporters])
    cos = np.clip(mat @ mat.T, -1.0, 1.0)
    row = {s: i for i, s in enumerate(reporters)}

    def mean_cos(s: str, members: Sequence[str]) -> tuple[float, int]:
        idx = [row[m] for m in members if m != s and m in row]
        return (float(np.mean(cos[row[s], idx])), len(idx)) if idx else (float("nan"), 0)

    proposals: list[_Proposal] = []
    for s in reporters:
        if s in assignment.pinned:
            continue
        own_label = assignment.site_cluster[s]
        own, n_own = mean_cos(s, assignment.clusters[own_label])
        own_value = 0.0 if n_own == 0 else own
        best_label, best, n_best = None, -math.inf, 0
        for label in assignment.labels:
            if label == own_label:
                continue
            value, n = mean_cos(s, assignment.clusters[label])
            if n and value > best:
                best_label, best, n_best = label, value, n
        if best_label is None:
            continue
        gain = best - own_value
        if gain < margin:
            continue
        if s in last and round - int(last[s]) < min_rounds_between_moves:
            continue
        proposals.append((gain, s, own_label, best_label, own_value, best, n_own, n_best))
    proposals.sort(key=lambda p: (-p[0], p[1]))
    return proposals


def _apply_moves(proposals: Sequence[_Proposal], assignment: ClusterAssignment, *, round: int, margin: float,
                 min_rounds_between_moves: int, last: Mapping[str, int], allow_empty_clusters: bool,
                 ) -> tuple[dict[str, list[str]], list[ClusterChange]]:
    """Apply the proposed moves in order, skipping exchanges and (unless allowed) moves that empty a cluster;
    returns the new ``{label: members}`` and one :class:`ClusterChange` per move made."""
    clusters = {label: list(m) for label, m in assignment.clusters.items()}
    changes: list[ClusterChange] = []
    moved_between: set[tuple[str, str]] = set()
    for gain, s, src, dst, own_value, best, n_own, n_best in proposals:
        if len(clusters[src]) == 1 and not allow_empty_clusters:
            continue
        if (dst, src) in moved_between:
            continue
        moved_between.add((src, dst))
        clusters[src].remove(s)
        clusters[dst].append(s)
        own_text = (f"{own_value:.3f} with own cluster {src} ({n_own} reporting member{'s' if n_own != 1 else ''})"
                    if n_own else f"0.000 assumed for own cluster {src} (no other member reported)")
        previous = f"last moved in round {last[s]}" if s in last else "never moved before"
        reason = (f"mean cosine similarity of phi-updates {best:.3f} with cluster {dst} ({n_best} reporting "
                  f"member{'s' if n_best != 1 else ''}) vs {own_text}; gain {gain:.3f} >= margin {float(margin):.3f};"
                  f" {previous}, min {int(min_rounds_between_moves)} rounds between moves")
        changes.append(ClusterChange(site=s, from_cluster=src, to_cluster=dst, round=int(round), reason=reason,
                                     similarity_from=own_value, similarity_to=best))
    return clusters, changes


def similarity_snr(squared_norms: Mapping[str, float], variances: Mapping[str, float | None], dim: int
                   ) -> float | None:
    """The signal-to-noise ratio of the pairwise inner products that re-clustering compares (median over pairs).

    For a received update ``u_k = s_k + n_k`` (signal s_k, DP noise n_k with variance v_k per coordinate, d
    coordinates), ``E||u_k||^2 = ||s_k||^2 + d v_k``, so ``r_k = max(0, ||u_k||^2 / (d v_k) - 1)`` estimates the
    signal-to-noise power per coordinate. For a pair, ``<u_i, u_j>`` has signal at most ``||s_i|| ||s_j||`` and
    noise variance ``||s_i||^2 v_j + ||s_j||^2 v_i + d v_i v_j``, so
    ``SNR_ij = sqrt(d) sqrt(r_i r_j) / sqrt(r_i + r_j + 1)``: an upper bound of what the similarities can resolve
    (two updates that differ in direction carry less). Below about 1, cosine similarities are noise.

    Args:
        squared_norms: ``{site: ||u_k||^2}`` of the received updates (phi part). variances: ``{site: v_k}``
            (:func:`coordinator.strategies.base.update_noise_variance`). dim: d, the number of coordinates.

    Returns:
        The median SNR over the pairs (``inf`` when no site's update carries noise), or None with fewer than two
        sites or a site of unknown variance.
    """
    sites = sorted(squared_norms)
    if len(sites) < 2 or dim <= 0 or any(variances.get(s) is None for s in sites):
        return None
    if all(variances[s] == 0 for s in sites):
        return math.inf
    r = {s: (math.inf if variances[s] == 0 else max(0.0, squared_norms[s] / (dim * variances[s]) - 1.0))
         for s in sites}
    def pair(ra: float, rb: float) -> float:
        if math.isinf(ra) and math.isinf(rb):
            return math.inf
        if math.isinf(ra) or math.isinf(rb):  # one noise-free update: the limit sqrt(d r) of the other
            return math.sqrt(dim * min(ra, rb))
        return math.sqrt(dim) * math.sqrt(ra * rb) / math.sqrt(ra + rb + 1.0)

    values = [pair(r[a], r[b]) for i, a in enumerate(sites) for b in sites[i + 1:]]
    return float(np.median(values))


def hash_sketch(vector: np.ndarray, dim: int = SKETCH_DIM, *, seed: int = 0) -> np.ndarray:
    """Signed feature-hashing sketch of a float vector (Weinberger et al. 2009, §2): coordinate i is added, with
    sign s(i) in {-1, +1}, to bucket h(i) in [0, dim). ``E[<sk(x), sk(y)>] = <x, y>``; the hash and sign are fixed
    by ``seed`` (public: the sketch is post-processing, not a privacy mechanism).

    Args:
        vector: float (d,). dim: sketch size. Returns: float64 (dim,).
    """
    x = np.asarray(vector, dtype=np.float64).reshape(-1)
    rng = np.random.default_rng(seed + x.shape[0])  # same hash for every site (it depends only on d and seed)
    buckets = rng.integers(0, dim, size=x.shape[0])
    signs = rng.choice(np.array([-1.0, 1.0]), size=x.shape[0])
    out = np.zeros(dim, dtype=np.float64)
    np.add.at(out, buckets, signs * x)
    return out


def match_labels(new: ClusterAssignment, old: ClusterAssignment, pins: Mapping[str, str]) -> ClusterAssignment:
    """Relabel a fresh clustering so that heads stay with the sites that trained them: a new cluster holding sites
    pinned to label L (and no other pin) is L; the others take the old label they share most members with
    (largest overlap first, each old label once); the rest get the smallest unused ``c<n>``."""
    mapping: dict[str, str] = {}
    for label, members in new.clusters.items():
        pinned = {pins[s] for s in members if s in pins}
        if len(pinned) == 1:
            mapping[label] = pinned.pop()
    used = set(mapping.values())
    pairs = sorted(((len(set(members) & set(old.clusters[o])), label, o) for label, members in new.clusters.items()
                    if label not in mapping for o in old.clusters), key=lambda t: (-t[0], t[1], t[2]))
    for overlap, label, o in pairs:
        if overlap > 0 and label not in mapping and o not in used:
            mapping[label] = o
            used.add(o)
    n = 0
    for label in new.clusters:
        if label not in mapping:
            while f"c{n}" in used:
                n += 1
            mapping[label] = f"c{n}"
            used.add(mapping[label])
    return new.with_clusters({mapping[label]: members for label, members in new.clusters.items()})
