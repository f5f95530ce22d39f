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
   :class:`~coordinator.strategies.cluster_assignment.ClusterAssignment` (JSON round trip, no pickle).
4. :func:`plot_similarity_heatmap`: the similarity matrix as a PNG, sites grouped by cluster.
5. :func:`coordinator.strategies.reclustering.recluster_from_updates`: dynamic re-clustering from the cosine
   similarity of the sites' phi-updates, with a hysteresis margin and a minimum number of rounds between two moves
   of the same site.

Privacy: steps 1-4 read only public metadata. Step 5 reads the phi-updates the coordinator already received; these
are outputs of the sites' DP mechanisms, so re-clustering is post-processing and costs no privacy budget.

This module holds steps 1-4 and :func:`pairwise_values` (upper triangle, for the metadata checks); the record in
:mod:`coordinator.strategies.cluster_assignment`, step 5 in :mod:`coordinator.strategies.reclustering`, and the
agreement measures of the metadata checks in :mod:`coordinator.strategies.cluster_agreement`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared.iucn import IUCNCategory, parse_category

from coordinator.strategies.cluster_assignment import ClusterAssignment, ClusteringError

__all__ = [
    "DEFAULT_EXCLUDED_CATEGORIES",
    "site_species_lists",
    "jaccard",
    "jaccard_matrix",
    "pairwise_values",
    "cluster_sites",
    "merge_small_clusters",
    "plot_similarity_heatmap",
]

#: Categories left out of public species lists unless the operator says otherwise (docs/privacy.md, "Public metadata").
DEFAULT_EXCLUDED_CATEGORIES: tuple[IUCNCategory, ...] = (IUCNCategory.CR, IUCNCategory.EN)


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
# 3. Hierarchical clustering
# ----------------------------------------------------------------------------------------------------------------

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
