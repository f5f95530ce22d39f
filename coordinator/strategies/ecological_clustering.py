"""Ecological clustering of sites for NIRA (docs/nira.md, "Ecological clustering").

NIRA groups sites whose species lists overlap, keeps one classification head per group and shares the feature
extractor across groups. This module is the pure clustering part; the strategy (heads, rounds, CLI) calls it.

Pipeline (every function is pure; nothing here touches the database or the network):

1. :func:`site_species_lists`: each enrolled site's *public* species list from its registry metadata
   (``metadata["species"]``). CR/EN species are left out by default (docs/privacy.md, "Public metadata": species lists
   are declared public metadata, sensitive species are not part of them).
2. :func:`jaccard_matrix`: pairwise Jaccard similarity ``J(A, B) = |A n B| / |A u B|`` (Jaccard 1901, "Etude
   comparative de la distribution florale dans une portion des Alpes et du Jura").
3. :func:`cluster_sites`: agglomerative clustering on the distance ``1 - J`` with average linkage (UPGMA; Sokal &
   Michener 1958), ``scipy.cluster.hierarchy.linkage(method="average")`` then ``fcluster``, cut at a distance
   threshold or at a target number of clusters; operator pins override the result. Returns a
   :class:`ClusterAssignment` (JSON round trip, no pickle).
4. :func:`plot_similarity_heatmap`: the similarity matrix as a PNG, sites grouped by cluster.
5. :func:`recluster_from_updates`: dynamic re-clustering from the cosine similarity of the sites' phi-updates,
   with a hysteresis margin and a minimum number of rounds between two moves of the same site.

Privacy: steps 1-4 read only public metadata. Step 5 reads the phi-updates the coordinator already received; these
are outputs of the sites' DP mechanisms, so re-clustering is post-processing and costs no privacy budget.

Helpers for the metadata checks: :func:`pairwise_values` (upper triangle), :func:`contingency_table`,
:func:`purity` and :func:`adjusted_rand_index` (Hubert & Arabie 1985).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory, parse_category

__all__ = [
    "DEFAULT_EXCLUDED_CATEGORIES",
    "ClusteringError",
    "ClusterAssignment",
    "ClusterChange",
    "site_species_lists",
    "jaccard",
    "jaccard_matrix",
    "cluster_sites",
    "merge_small_clusters",
    "plot_similarity_heatmap",
    "recluster_from_updates",
    "pairwise_values",
    "contingency_table",
    "purity",
    "adjusted_rand_index",
]

#: Categories left out of public species lists unless the operator says otherwise (docs/privacy.md, "Public metadata").
DEFAULT_EXCLUDED_CATEGORIES: tuple[IUCNCategory, ...] = (IUCNCategory.CR, IUCNCategory.EN)

#: Version of the JSON form of :class:`ClusterAssignment`. Compatibility rules: fields are never removed and never
#: change meaning; new fields are optional with a default; a reader refuses a higher version than it knows.
ASSIGNMENT_FORMAT_VERSION = 1


class ClusteringError(ConfigError):
    """Bad input to ecological clustering (missing species list, bad matrix, bad pin or cut); names the fix."""


# ----------------------------------------------------------------------------------------------------------------
# 1. Public species lists
# ----------------------------------------------------------------------------------------------------------------

def site_species_lists(metadata: Mapping[str, Mapping[str, Any]], *,
                       exclude_categories: Iterable[IUCNCategory | str] = DEFAULT_EXCLUDED_CATEGORIES,
                       species_categories: Mapping[str, IUCNCategory | str] | None = None,
                       ) -> dict[str, frozenset[str]]:
    """Each site's public species list, sensitive categories left out.

    Args:
        metadata: ``{site_id: site metadata}`` as stored by :class:`coordinator.registry.SiteRegistry`
            (``Site.metadata``). ``metadata["species"]`` is a list whose entries are either scientific names
            (str; the registry's validated form) or objects ``{"scientific_name": str, "iucn_category": str}`` (the
            gateway's site-config form). Names are stripped of surrounding whitespace; duplicates collapse.
        exclude_categories: IUCN categories left out of the lists (default CR and EN). Pass ``()`` to keep all.
        species_categories: ``{scientific name: IUCN category}`` used for names whose entry carries no category
            (e.g. a Red List extract). An entry's own ``iucn_category`` wins over this table.

    Returns:
        ``{site_id: frozenset of names}``, keys in sorted site-id order. A species whose category is unknown (not
        in its entry nor in ``species_categories``) is kept: the registry declares ``species`` public, so the
        metadata owner is responsible for leaving sensitive species out of it (the demo does, at enrolment).

    Raises:
        ClusteringError: a site has no ``species`` key, or it is not a list of names / name objects.
        ConfigError: an unknown IUCN code in ``exclude_categories``, an entry or ``species_categories``.
    """
    excluded = frozenset(parse_category(c, field="exclude_categories") for c in exclude_categories)
    table = {str(k).strip(): parse_category(v, field="species_categories")
             for k, v in (species_categories or {}).items()}
    out: dict[str, frozenset[str]] = {}
    for site_id in sorted(metadata):
        meta = metadata[site_id]
        entries = meta.get("species") if isinstance(meta, Mapping) else None
        if not isinstance(entries, list):
            raise ClusteringError(f"site {site_id!r} has no species list in its metadata (got {entries!r})",
                                  field=f"{site_id}.metadata.species",
                                  fix="enrol the site with metadata {'species': [scientific names]}")
        names: set[str] = set()
        for entry in entries:
            if isinstance(entry, str):
                name, category = entry.strip(), None
            elif isinstance(entry, Mapping) and isinstance(entry.get("scientific_name"), str):
                name = entry["scientific_name"].strip()
                raw = entry.get("iucn_category")
                category = None if raw is None else parse_category(raw, field=f"{site_id}.species.iucn_category")
            else:
                raise ClusteringError(f"site {site_id!r}: species entry {entry!r} is neither a name nor "
                                      "{'scientific_name': ..., 'iucn_category': ...}",
                                      field=f"{site_id}.metadata.species", fix="list scientific names")
            if not name:
                continue
            if category is None:
                category = table.get(name)
            if category is not None and category in excluded:
                continue
            names.add(name)
        out[site_id] = frozenset(names)
    return out


# ----------------------------------------------------------------------------------------------------------------
# 2. Jaccard similarity
# ----------------------------------------------------------------------------------------------------------------

def jaccard(a: Iterable[str], b: Iterable[str]) -> float:
    """Jaccard similarity ``|A n B| / |A u B|`` of two species lists (Jaccard 1901), in [0, 1].

    ``J(empty, empty)`` is defined as 0.0: two sites with no public species give no evidence of being alike, and
    clustering them together would hand them one head on no grounds. (``wildfed_sim.ecology.jaccard``,
    which describes synthetic designs rather than clustering, uses 1.0 there.) A site's similarity to itself is
    still 1 on the diagonal of :func:`jaccard_matrix`.
    """
    sa, sb = set(a), set(b)
    union = len(sa | sb)
    return 0.0 if union == 0 else len(sa & sb) / union


def jaccard_matrix(species_lists: Mapping[str, Iterable[str]]) -> tuple[tuple[str, ...], np.ndarray]:
    """Pairwise Jaccard similarity of sites' species lists.

    Args:
        species_lists: ``{site_id: names}`` (e.g. the output of :func:`site_species_lists`).

    Returns:
        ``(site_ids, S)``: site ids in sorted order, and ``S`` float64 of shape (K, K), symmetric,
        ``S[i, j] = jaccard(list_i, list_j)`` (0.0 for two empty lists), ones on the diagonal.

    Raises:
        ClusteringError: no sites.
    """
    site_ids = tuple(sorted(species_lists))
    if not site_ids:
        raise ClusteringError("no sites to compare", field="species_lists", fix="enrol sites with species lists")
    sets = [frozenset(species_lists[s]) for s in site_ids]
    k = len(site_ids)
    out = np.eye(k, dtype=np.float64)
    for i in range(k):
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = jaccard(sets[i], sets[j])
    return site_ids, out


def pairwise_values(matrix: np.ndarray) -> np.ndarray:
    """The K(K-1)/2 off-diagonal entries ``matrix[i, j]``, ``i < j``, of a square matrix, as a 1-D float64 array."""
    m = np.asarray(matrix, dtype=np.float64)
    return m[np.triu_indices(m.shape[0], k=1)]


# ----------------------------------------------------------------------------------------------------------------
# 3. Hierarchical clustering and the assignment record
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ClusterAssignment:
    """Which site is in which NIRA cluster, with the similarity it came from.

    Attributes:
        site_ids: the K site ids, in the row order of ``similarity`` (sorted).
        similarity: float64 (K, K) ecological similarity (Jaccard) used for the clustering; read-only.
        clusters: ``{label: site ids (sorted)}``; labels in order of their smallest member site id. Every site is
            in exactly one cluster; no cluster is empty.
        site_cluster: ``{site_id: label}``, the inverse of ``clusters``.
        linkage: ``"average"`` (UPGMA).
        distance_threshold: the cut used (distance ``1 - J``), or None.
        num_clusters: the target number of clusters used, or None.
        pinned: ``{site_id: label}`` operator pins applied (re-clustering never moves a pinned site).

    Equality compares every field (the matrix exactly). JSON form: :meth:`to_json` / :meth:`from_json`.

    Raises:
        ClusteringError: inconsistent fields (a site in two clusters or none, empty cluster, matrix shape).
    """

    site_ids: tuple[str, ...]
    similarity: np.ndarray
    clusters: Mapping[str, tuple[str, ...]]
    site_cluster: Mapping[str, str] = field(default_factory=dict)
    linkage: str = "average"
    distance_threshold: float | None = None
    num_clusters: int | None = None
    pinned: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sim = np.array(self.similarity, dtype=np.float64, copy=True)
        sim.setflags(write=False)
        k = len(self.site_ids)
        if sim.shape != (k, k):
            raise ClusteringError(f"similarity has shape {sim.shape}, expected ({k}, {k})", field="similarity",
                                  fix="pass the matrix in the order of site_ids")
        clusters = {str(label): tuple(sorted(members)) for label, members in self.clusters.items()}
        clusters = dict(sorted(clusters.items(), key=lambda kv: (kv[1][0] if kv[1] else "", kv[0])))
        site_cluster: dict[str, str] = {}
        for label, members in clusters.items():
            if not members:
                raise ClusteringError(f"cluster {label!r} is empty", field="clusters", fix="drop empty clusters")
            for s in members:
                if s in site_cluster:
                    raise ClusteringError(f"site {s!r} is in clusters {site_cluster[s]!r} and {label!r}",
                                          field="clusters", fix="put every site in exactly one cluster")
                site_cluster[s] = label
        if set(site_cluster) != set(self.site_ids):
            missing = sorted(set(self.site_ids) - set(site_cluster))
            extra = sorted(set(site_cluster) - set(self.site_ids))
            raise ClusteringError(f"clusters do not cover the sites exactly (missing {missing}, unknown {extra})",
                                  field="clusters", fix="assign every site in site_ids to one cluster")
        if self.site_cluster and dict(self.site_cluster) != site_cluster:
            raise ClusteringError("site_cluster disagrees with clusters", field="site_cluster",
                                  fix="leave site_cluster empty; it is derived from clusters")
        object.__setattr__(self, "site_ids", tuple(self.site_ids))
        object.__setattr__(self, "similarity", sim)
        object.__setattr__(self, "clusters", clusters)
        object.__setattr__(self, "site_cluster", dict(sorted(site_cluster.items())))
        object.__setattr__(self, "pinned", dict(sorted((str(k), str(v)) for k, v in self.pinned.items())))

    @property
    def labels(self) -> tuple[str, ...]:
        """Cluster labels in order of their smallest member site id."""
        return tuple(self.clusters)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterAssignment):
            return NotImplemented
        return (self.site_ids == other.site_ids and np.array_equal(self.similarity, other.similarity)
                and self.clusters == other.clusters and self.linkage == other.linkage
                and self.distance_threshold == other.distance_threshold
                and self.num_clusters == other.num_clusters and self.pinned == other.pinned)

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (floats as Python floats, which ``json`` writes exactly)."""
        return {"format": ASSIGNMENT_FORMAT_VERSION, "site_ids": list(self.site_ids),
                "similarity": [[float(x) for x in row] for row in self.similarity],
                "clusters": {label: list(m) for label, m in self.clusters.items()},
                "linkage": self.linkage, "distance_threshold": self.distance_threshold,
                "num_clusters": self.num_clusters, "pinned": dict(self.pinned)}

    def to_json(self) -> str:
        """Compact JSON text of :meth:`to_dict` (to store in the coordinator DB)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ClusterAssignment":
        """Inverse of :meth:`to_dict`.

        Raises:
            ClusteringError: missing fields, a newer format version, or inconsistent content.
        """
        try:
            version = int(data.get("format", 1))
            if version > ASSIGNMENT_FORMAT_VERSION:
                raise ClusteringError(f"cluster assignment format {version} is newer than this coordinator "
                                      f"({ASSIGNMENT_FORMAT_VERSION})", field="format", fix="upgrade WildFed")
            threshold = data.get("distance_threshold")
            k = data.get("num_clusters")
            return cls(site_ids=tuple(data["site_ids"]), similarity=np.asarray(data["similarity"], dtype=np.float64),
                       clusters={str(lbl): tuple(m) for lbl, m in data["clusters"].items()},
                       linkage=str(data.get("linkage", "average")),
                       distance_threshold=None if threshold is None else float(threshold),
                       num_clusters=None if k is None else int(k), pinned=dict(data.get("pinned") or {}))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ClusteringError):
                raise
            raise ClusteringError(f"not a cluster assignment: {exc!r}", field="cluster_assignment",
                                  fix="store ClusterAssignment.to_json() output") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> "ClusterAssignment":
        """Parse :meth:`to_json` output. Raises :class:`ClusteringError` on bad JSON or content."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ClusteringError(f"cluster assignment is not JSON: {exc}", field="cluster_assignment",
                                  fix="store ClusterAssignment.to_json() output") from exc
        if not isinstance(data, dict):
            raise ClusteringError("cluster assignment JSON is not an object", field="cluster_assignment")
        return cls.from_dict(data)

    def with_clusters(self, clusters: Mapping[str, Sequence[str]]) -> "ClusterAssignment":
        """A copy with other cluster memberships (same matrix, cut and pins). Empty clusters are dropped."""
        return ClusterAssignment(site_ids=self.site_ids, similarity=self.similarity,
                                 clusters={lbl: tuple(m) for lbl, m in clusters.items() if m},
                                 linkage=self.linkage, distance_threshold=self.distance_threshold,
                                 num_clusters=self.num_clusters, pinned=self.pinned)


def _check_similarity(similarity: np.ndarray, site_ids: Sequence[str]) -> np.ndarray:
    sim = np.asarray(similarity, dtype=np.float64)
    k = len(site_ids)
    if k == 0:
        raise ClusteringError("no sites to cluster", field="site_ids", fix="enrol sites first")
    if len(set(site_ids)) != k:
        raise ClusteringError("duplicate site ids", field="site_ids", fix="pass each site once")
    if sim.shape != (k, k):
        raise ClusteringError(f"similarity has shape {sim.shape}, expected ({k}, {k})", field="similarity",
                              fix="pass a square matrix in the order of site_ids")
    if not np.all(np.isfinite(sim)) or sim.min() < 0.0 or sim.max() > 1.0:
        raise ClusteringError("similarity entries must be finite and in [0, 1]", field="similarity",
                              fix="use Jaccard similarities (jaccard_matrix)")
    if not np.allclose(sim, sim.T, rtol=0.0, atol=1e-12):
        raise ClusteringError("similarity is not symmetric", field="similarity", fix="use jaccard_matrix")
    return sim


def cluster_sites(similarity: np.ndarray, site_ids: Sequence[str], *, distance_threshold: float | None = None,
                  num_clusters: int | None = None, pinned: Mapping[str, str] | None = None) -> ClusterAssignment:
    """Average-linkage (UPGMA) hierarchical clustering of sites on the distance ``1 - similarity``.

    ``scipy.cluster.hierarchy.linkage(squareform(1 - S), method="average")`` builds the dendrogram (the distance
    between two groups is the mean pairwise distance of their members); ``fcluster`` cuts it:

    - ``distance_threshold=t``: ``criterion="distance"``; two groups end up together iff they are joined at an
      average distance ``<= t`` (i.e. mean Jaccard ``>= 1 - t``). ``t`` in [0, 1]; ``t >= 1`` would join everything.
    - ``num_clusters=k``: ``criterion="maxclust"``; the lowest cut giving at most ``k`` clusters (fewer when merge
      heights tie, e.g. identical lists).

    Labels are ``"c0", "c1", ...`` in order of each cluster's smallest member site id (string order), so the same
    inputs always give the same labels. Pins are then applied: each pinned site leaves its cluster and joins the
    cluster labelled ``pinned[site]``; a label that does not exist names a new cluster. A cluster emptied by pins
    disappears (the other labels keep their numbers, so gaps are possible). Pinned sites still take part in the
    linkage.

    Args:
        similarity: float64 (K, K), symmetric, entries in [0, 1] (from :func:`jaccard_matrix`); the diagonal is
            ignored (taken as 1).
        site_ids: the K site ids in row order.
        distance_threshold: cut height in units of ``1 - J``; exactly one of this and ``num_clusters``.
        num_clusters: target number of clusters, ``1 <= k <= K``.
        pinned: ``{site_id: cluster label}`` set by the operator.

    Returns:
        A :class:`ClusterAssignment` (site ids sorted, the matrix permuted to match).

    Raises:
        ClusteringError: both or neither cut given, cut out of range, bad matrix, pinned site unknown or empty label.
    """
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    if (distance_threshold is None) == (num_clusters is None):
        raise ClusteringError("give exactly one of distance_threshold and num_clusters", field="cut",
                              fix="e.g. distance_threshold=0.6 (sites with mean Jaccard >= 0.4 together)")
    sim = _check_similarity(similarity, list(site_ids))
    k = len(site_ids)
    if distance_threshold is not None:
        t = float(distance_threshold)
        if not (0.0 <= t <= 1.0):
            raise ClusteringError(f"distance_threshold {distance_threshold!r} is outside [0, 1]",
                                  field="distance_threshold", fix="a Jaccard distance between 0 and 1")
    else:
        if isinstance(num_clusters, bool) or not isinstance(num_clusters, (int, np.integer)) \
                or not 1 <= num_clusters <= k:
            raise ClusteringError(f"num_clusters {num_clusters!r} is not in 1..{k}", field="num_clusters",
                                  fix=f"choose between 1 and the number of sites ({k})")
    pins = dict(pinned or {})
    for s, label in pins.items():
        if s not in site_ids:
            raise ClusteringError(f"pinned site {s!r} is not among the sites", field="pinned",
                                  fix="pin an enrolled site")
        if not isinstance(label, str) or not label.strip():
            raise ClusteringError(f"pin of site {s!r} has an empty label", field="pinned", fix='e.g. "c0"')

    order = sorted(range(k), key=lambda i: site_ids[i])
    ids = tuple(site_ids[i] for i in order)
    sim = sim[np.ix_(order, order)].copy()
    np.fill_diagonal(sim, 1.0)

    if k == 1:
        raw = np.array([1])
    else:
        dist = np.clip(1.0 - sim, 0.0, 1.0)
        np.fill_diagonal(dist, 0.0)
        tree = linkage(squareform(dist, checks=False), method="average")
        if distance_threshold is not None:
            raw = fcluster(tree, t=float(distance_threshold), criterion="distance")
        else:
            raw = fcluster(tree, t=int(num_clusters), criterion="maxclust")
    groups: dict[int, list[str]] = {}
    for site, g in zip(ids, raw):
        groups.setdefault(int(g), []).append(site)
    ordered = sorted((sorted(m) for m in groups.values()), key=lambda m: m[0])
    clusters: dict[str, list[str]] = {f"c{i}": m for i, m in enumerate(ordered)}
    for s, label in sorted(pins.items()):
        for members in clusters.values():
            if s in members:
                members.remove(s)
        clusters.setdefault(label, []).append(s)
    return ClusterAssignment(site_ids=ids, similarity=sim, clusters={lbl: tuple(m) for lbl, m in clusters.items() if m},
                             linkage="average",
                             distance_threshold=None if distance_threshold is None else float(distance_threshold),
                             num_clusters=None if num_clusters is None else int(num_clusters), pinned=pins)


def merge_small_clusters(assignment: ClusterAssignment, records: Mapping[str, float], min_records: float
                         ) -> ClusterAssignment:
    """Merge every cluster holding fewer than ``min_records`` records into its most similar cluster (a
    per-cluster head trained on a few dozen records is mostly DP noise).

    Repeatedly, the cluster with the fewest records (ties: smallest label) that is below ``min_records`` and has no
    pinned member joins the other cluster with the highest average-linkage similarity to it (the mean Jaccard over
    all cross pairs, UPGMA's own criterion; ties: the larger cluster, then the smaller label), keeping the receiving
    cluster's label (so its head). Stops when no unpinned cluster is below the minimum or one cluster is left.
    Operator pins win: a cluster with a pinned site is never merged away (it may receive others).

    Args:
        assignment: the clusters (from :func:`cluster_sites`).
        records: ``{site_id: N_k}`` the sites' declared public record counts (a missing site counts 0).
        min_records: the minimum records per cluster (>= 0; 0 changes nothing).

    Returns:
        A new :class:`ClusterAssignment` (same matrix, cut and pins).

    Raises:
        ClusteringError: ``min_records`` negative or not finite.
    """
    if not (isinstance(min_records, (int, float)) and math.isfinite(min_records) and min_records >= 0):
        raise ClusteringError(f"min_cluster_records must be a finite number >= 0, got {min_records!r}",
                              field="min_cluster_records", fix="use 0 (off) or e.g. 500")
    clusters = {label: list(members) for label, members in assignment.clusters.items()}
    index = {s: i for i, s in enumerate(assignment.site_ids)}
    sim = assignment.similarity

    def size(label: str) -> float:
        return float(sum(float(records.get(s, 0)) for s in clusters[label]))

    def link(a: str, b: str) -> float:
        return float(np.mean([sim[index[x], index[y]] for x in clusters[a] for y in clusters[b]]))

    while len(clusters) > 1:
        small = sorted((size(lbl), lbl) for lbl, m in clusters.items()
                       if size(lbl) < min_records and not any(s in assignment.pinned for s in m))
        if not small:
            break
        _, label = small[0]
        target = min((lbl for lbl in clusters if lbl != label), key=lambda lbl: (-link(label, lbl), -size(lbl), lbl))
        clusters[target].extend(clusters.pop(label))
    return assignment.with_clusters(clusters)


# ----------------------------------------------------------------------------------------------------------------
# 4. Heatmap
# ----------------------------------------------------------------------------------------------------------------

def plot_similarity_heatmap(assignment: ClusterAssignment, path: str | Path, *, title: str | None = None,
                            max_tick_labels: int = 60) -> Path:
    """Write the similarity matrix as a PNG heatmap, sites grouped by cluster, cluster boundaries drawn.

    Rows/columns run cluster by cluster (in ``assignment.labels`` order), sites sorted inside each cluster; white
    lines separate clusters and each cluster's label is written on the top axis. Colour scale 0..1 (viridis).
    Uses matplotlib's Agg canvas directly (no pyplot, no display, safe in threads).

    Args:
        assignment: the clusters and their similarity matrix.
        path: PNG file to write (parent folders are created).
        title: figure title (default: number of sites and clusters).
        max_tick_labels: site ids are written on the axes up to this many sites.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    index = {s: i for i, s in enumerate(assignment.site_ids)}
    order = [index[s] for label in assignment.labels for s in assignment.clusters[label]]
    mat = assignment.similarity[np.ix_(order, order)]
    k = len(order)
    size = min(max(5.0, 0.18 * k + 2.5), 24.0)
    fig = Figure(figsize=(size + 1.2, size))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    cbar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cbar.set_label("Jaccard similarity of public species lists")
    start, centres = 0, []
    for label in assignment.labels:
        n = len(assignment.clusters[label])
        centres.append(start + (n - 1) / 2)
        if start > 0:
            ax.axhline(start - 0.5, color="white", linewidth=1.5)
            ax.axvline(start - 0.5, color="white", linewidth=1.5)
        start += n
    if k <= max_tick_labels:
        names = [assignment.site_ids[i] for i in order]
        ax.set_xticks(range(k))
        ax.set_xticklabels(names, rotation=90, fontsize=6)
        ax.set_yticks(range(k))
        ax.set_yticklabels(names, fontsize=6)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    top = ax.secondary_xaxis("top")
    top.set_xticks(centres)
    top.set_xticklabels(list(assignment.labels), fontsize=7)
    ax.set_title(title or f"{k} sites, {len(assignment.labels)} clusters (average linkage on 1 - Jaccard)",
                 fontsize=9, pad=18)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


# ----------------------------------------------------------------------------------------------------------------
# 5. Dynamic re-clustering from phi-updates
# ----------------------------------------------------------------------------------------------------------------

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
    if isinstance(round, bool) or not isinstance(round, (int, np.integer)) or round < 0:
        raise ClusteringError(f"round {round!r} must be an integer >= 0", field="round")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
        raise ClusteringError(f"margin {margin!r} must be a finite number >= 0", field="margin",
                              fix="e.g. 0.1 (a move needs 0.1 more mean cosine similarity)")
    if isinstance(min_rounds_between_moves, bool) or not isinstance(min_rounds_between_moves, (int, np.integer)) \
            or min_rounds_between_moves < 0:
        raise ClusteringError(f"min_rounds_between_moves {min_rounds_between_moves!r} must be an integer >= 0",
                              field="min_rounds_between_moves", fix="e.g. 3")
    last = dict(last_moved or {})
    unknown = sorted(set(phi_updates) - set(assignment.site_ids))
    if unknown:
        raise ClusteringError(f"updates from sites not in the assignment: {unknown}", field="phi_updates",
                              fix="cluster every enrolled site first (cluster_sites)")

    # Unit vectors of the usable updates, in float64.
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

    reporters = sorted(units)
    if not reporters:
        return assignment, []
    mat = np.stack([units[s] for s in reporters])
    cos = np.clip(mat @ mat.T, -1.0, 1.0)
    row = {s: i for i, s in enumerate(reporters)}

    def mean_cos(s: str, members: Sequence[str]) -> tuple[float, int]:
        idx = [row[m] for m in members if m != s and m in row]
        return (float(np.mean(cos[row[s], idx])), len(idx)) if idx else (float("nan"), 0)

    proposals: list[tuple[float, str, str, str, float, float, int, int]] = []
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
    if not changes:
        return assignment, []
    return assignment.with_clusters(clusters), changes


# ----------------------------------------------------------------------------------------------------------------
# Agreement of a clustering with known groups (for the metadata checks)
# ----------------------------------------------------------------------------------------------------------------

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
