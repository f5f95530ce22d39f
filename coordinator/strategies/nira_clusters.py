"""NIRA's clusters and their persistent state: :class:`NiraClusters`, a base class of
:class:`coordinator.strategies.nira.NIRA`.

The clusters come from the enrolled sites' public species lists (registry metadata; sensitive categories left
out: :mod:`coordinator.strategies.ecological_clustering`); a site enrolled after clustering joins the cluster whose
members' lists it shares most (mean Jaccard); operators pin sites and request re-clustering
(``wildfed-coordinator clusters``). The state (clusters, pins, last moves, change log, diagnostics, merged rows) is
one JSON value in the coordinator database (``Store.get_state``), so a restarted coordinator continues with the
same clusters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from coordinator.strategies.cluster_assignment import ClusterAssignment
from coordinator.strategies.ecological_clustering import (cluster_sites, jaccard_matrix, merge_small_clusters,
                                                          site_species_lists)
from coordinator.strategies.reclustering import match_labels

__all__ = ["NiraClusters"]

log = logging.getLogger("coordinator.strategies.nira")  # the strategy's log: cluster changes are its decisions

_STATE_KEY = "nira"


class NiraClusters:
    """The cluster bookkeeping of NIRA: state in the store, clustering from species lists, late enrolments, pins.

    The NIRA constructor sets the attributes this reads: ``_store`` (``get_state``/``set_state``),
    ``_site_metadata`` (returns ``{site_id: public metadata}``), ``_cut`` (the dendrogram cut), ``_exclude`` (IUCN
    codes left out), ``_categories`` (``{scientific name: IUCN code}``) and ``min_cluster_records``.
    """

    _store: Any
    _site_metadata: Callable[[], Mapping[str, Mapping[str, Any]]]
    _cut: dict[str, Any]
    _exclude: tuple[str, ...]
    _categories: dict[str, str]
    min_cluster_records: float

    def state(self) -> dict[str, Any]:
        """``{"assignment": ClusterAssignment JSON or None, "pins": {site: cluster}, "last_moved": {site: round},
        "changes": [{round, site, from, to, reason}], "recluster_requested": bool}``."""
        return self._store.get_state(_STATE_KEY, None) or {"assignment": None, "pins": {}, "last_moved": {},
                                                           "changes": [], "recluster_requested": False}

    def _save(self, state: Mapping[str, Any]) -> None:
        self._store.set_state(_STATE_KEY, dict(state))

    def assignment(self) -> ClusterAssignment | None:
        """The current clusters, or None before the first round."""
        raw = self.state()["assignment"]
        return ClusterAssignment.from_json(raw) if raw is not None else None

    def pin(self, site_id: str, cluster: str) -> None:
        """Pin ``site_id`` to ``cluster`` (applied at the next re-cluster, which this requests)."""
        state = self.state()
        state["pins"][site_id] = cluster
        state["recluster_requested"] = True
        self._save(state)

    def request_recluster(self) -> None:
        """Re-cluster from the species lists (and pins) before the next round."""
        state = self.state()
        state["recluster_requested"] = True
        self._save(state)

    def species_lists(self) -> dict[str, Any]:
        """Each enrolled site's public species list used for clustering (sensitive categories left out)."""
        return site_species_lists(self._site_metadata(), exclude_categories=self._exclude,
                                  species_categories=self._categories or None)

    def cluster_from_species(self, pins: Mapping[str, str] | None = None) -> ClusterAssignment:
        """Jaccard similarity of the species lists -> average-linkage clusters (pins applied), then clusters below
        ``min_cluster_records`` declared records merged into their most similar one."""
        site_ids, similarity = jaccard_matrix(self.species_lists())
        assignment = cluster_sites(similarity, site_ids, pinned=dict(pins or {}), **self._cut)
        if self.min_cluster_records > 0:
            records = {s: float(m.get("capacity", m.get("num_examples")) or 0)
                       for s, m in self._site_metadata().items()}
            assignment = merge_small_clusters(assignment, records, self.min_cluster_records)
        return assignment

    def _log_change(self, state: dict[str, Any], round: int, site: str, old: str | None, new: str,
                    reason: str) -> None:
        state["changes"].append({"round": round, "site": site, "from": old, "to": new, "reason": reason})
        log.info("nira: round %d: site %s %s -> %s: %s", round, site, old, new, reason)

    def _ensure_assignment(self, round: int) -> ClusterAssignment:
        state = self.state()
        current = self.assignment()
        enrolled = set(self._site_metadata())
        if current is None or state.get("recluster_requested"):
            new = self.cluster_from_species(state["pins"])
            if current is not None:
                new = match_labels(new, current, state["pins"])
            for site in sorted(new.site_cluster):
                old = current.site_cluster.get(site) if current is not None else None
                if old != new.site_cluster[site]:
                    why = "initial clustering from species lists" if current is None else "operator re-cluster"
                    self._log_change(state, round, site, old, new.site_cluster[site], why)
            state["assignment"], state["recluster_requested"] = new.to_json(), False
            self._save(state)
            return new
        missing = sorted(enrolled - set(current.site_cluster))
        if missing:
            lists = self.species_lists()
            clusters = {label: list(members) for label, members in current.clusters.items()}
            for site in missing:
                cluster, score = self._closest_cluster(current, lists, site)
                clusters[cluster].append(site)
                self._log_change(state, round, site, None, cluster,
                                 f"enrolled after clustering; mean Jaccard {score:.3f} with this cluster's lists")
            site_ids, similarity = jaccard_matrix({s: lists[s] for s in sorted({*current.site_ids, *missing})})
            current = ClusterAssignment(site_ids=site_ids, similarity=similarity, clusters=clusters,
                                        linkage=current.linkage, distance_threshold=current.distance_threshold,
                                        num_clusters=current.num_clusters, pinned=current.pinned)
            state["assignment"] = current.to_json()
            self._save(state)
        return current

    @staticmethod
    def _closest_cluster(assignment: ClusterAssignment, lists: Mapping[str, Any], site: str) -> tuple[str, float]:
        mine = set(lists.get(site, ()))
        best, best_score = sorted(assignment.clusters)[0], -1.0
        for label, members in sorted(assignment.clusters.items()):
            scores = []
            for other in members:
                theirs = set(lists.get(other, ()))
                union = mine | theirs
                scores.append(len(mine & theirs) / len(union) if union else 0.0)
            score = float(np.mean(scores)) if scores else 0.0
            if score > best_score:
                best, best_score = label, score
        return best, best_score
