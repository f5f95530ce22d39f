"""The record of a NIRA clustering: :class:`ClusterAssignment` (which site is in which cluster, with the similarity
and cut it came from), its JSON form, and :class:`ClusteringError`.

Produced by :func:`coordinator.strategies.ecological_clustering.cluster_sites`, changed by
:func:`coordinator.strategies.reclustering.recluster_from_updates`, and kept by the NIRA strategy in the
coordinator database as JSON (no pickle).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.errors import ConfigError

__all__ = ["ASSIGNMENT_FORMAT_VERSION", "ClusteringError", "ClusterAssignment"]

#: Version of the JSON form of :class:`ClusterAssignment`. Compatibility rules: fields are never removed and never
#: change meaning; new fields are optional with a default; a reader refuses a higher version than it knows.
ASSIGNMENT_FORMAT_VERSION = 1


class ClusteringError(ConfigError):
    """Bad input to ecological clustering (missing species list, bad matrix, bad pin or cut); names the fix."""


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
