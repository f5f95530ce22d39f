"""NIRA: non-IID robust aggregation with ecological clusters (docs/nira.md).

The stored global model (the *bundle*, see :class:`coordinator.strategies.base.Strategy`) holds the shared feature
extractor phi under its own names (``phi.*``) and one classification head per cluster under
``nira/<cluster>/<head name>`` (``nira/c0/psi.weight``, ...). Site k of cluster m trains from phi + psi_m under the
plain model names, so gateways see an ordinary model.

Aggregation of one round (streaming: one running weighted sum per cluster, never the K updates):

- intra-cluster FedAvg weighted by N_k: ``delta_m = sum_{k in m} N_k delta_k / sum_{k in m} N_k`` (phi and psi);
- phi: an inter-cluster average ``delta_phi = sum_m w_m delta_m,phi`` with weights summing to 1 over the clusters
  that sent updates this round (``phi_weighting``):

  - ``records`` (default): ``w_m = N_m / N``, the clusters' declared record counts, so phi moves exactly as FedAvg
    over all sites would move it;
  - ``inverse_variance``: ``w_m proportional to 1 / V_m``, with ``V_m = sum_{k in m} N_k^2 v_k / N_m^2`` the variance
    per coordinate of the DP noise in cluster m's mean (``v_k`` from the site's reported events and the task:
    :func:`coordinator.strategies.base.update_noise_variance`); the minimum-variance unbiased combination of the
    cluster means (Cochran 1954, "The combination of estimates from different experiments"). Without noise
    information it falls back to records;
  - ``clusters``: ``w_m = |C_m| / K`` (the seed's rule): a singleton cluster of a 55-record site weighs as much as a
    cluster of thousands, which multiplied the noise on phi by 1.2-2.9x FedAvg's under CCDP (docs/nira.md);
- psi_m: ``delta_m,psi`` for each cluster with an update this round; other clusters' heads are unchanged.

Clusters come from the sites' public species lists (Jaccard similarity, average-linkage hierarchical clustering:
:mod:`coordinator.strategies.ecological_clustering`), with sensitive categories (CR, EN by default) left out; a
cluster with fewer than ``min_cluster_records`` declared records joins its most similar cluster
(:func:`~coordinator.strategies.ecological_clustering.merge_small_clusters`). A
site enrolled after clustering joins the cluster whose members' lists it shares most (mean Jaccard). Operators can
pin a site to a cluster and force a re-cluster (``wildfed-coordinator clusters``).

Dynamic re-clustering (every ``recluster_every`` rounds): from the cosine similarity of the sites' phi-updates of
that round, which the coordinator receives anyway (post-processing of DP outputs: no privacy cost). To keep
memory independent of the model size, each phi-update is kept as a 4,096-dimensional signed feature-hashing
sketch (Weinberger et al. 2009, "Feature Hashing for Large Scale Multitask Learning", §2: inner products are
preserved in expectation). A site moves only when another cluster beats its own by a margin, and not more often
than every ``min_rounds_between_moves`` rounds, so clusters do not flap. Every change is logged with its reason
and kept in the strategy state. Re-clustering acts only when the round's similarity signal-to-noise ratio is at
least ``recluster_min_snr`` (:func:`~coordinator.strategies.reclustering.similarity_snr`, estimated from the updates
and their known DP noise variance); each round's ratio is kept in the state (``diagnostics``) with the noise std on
phi against FedAvg's, so an operator sees whether the similarities carry signal above the DP noise.

Species-embedding merging (rare-species transfer): the embedding of species s at site k is row s of its trained
head, ``e_s^(k) = (psi_m + delta_k,psi)[s]`` (weight row and bias). The merged embedding is
``e_s = sum_k w_ks e_s^(k) / sum_k w_ks`` over the sites that saw s. Two choices of weights:

- ``public`` (default): a site saw s if s is on its public species list, and ``w_ks = N_k``, its declared public
  record count. No per-species count leaves a site, so nothing is charged. A cluster lacks s when no member lists
  it. Species left out of the public lists (CR/EN by default) are never merged this way.
- ``noisy_counts``: every round each site releases its record count of every class of the model with Gaussian
  noise of std ``count_noise`` (sensitivity 1: one record changes one count by one; all classes, so the noise also
  hides which species a site holds). The release is charged to every active category of the site
  (``DPSGDEvent(count_noise, 1, 1)``, ledger mechanism ``counts``), and the gateway calibrates its DP-SGD noise so
  that both together stay within each budget. Then ``w_ks = max(0, noisy count)``. A cluster lacks s when the
  noisy total of its members' counts is at most ``3 * count_noise * sqrt(members reporting)``: it is then
  consistent with no record at all. This covers CR/EN species too.

After a step, the weight row of every species that a cluster lacks is initialised from e_s, once per (cluster,
species), and then left to training. Three adjustments make a row trained elsewhere fit the receiving head:
- A softmax head is unchanged by adding one vector to all its rows, so heads trained apart sit at different
  offsets. e_s is centred on the contributing heads' mean row and moved to the receiving head's mean row.
- A head trained on many records has larger rows than one trained on few. The weight direction is shrunk to at most
  the mean norm of the receiving head's centred rows for the species it has. It is never enlarged, which would
  amplify a direction that carries no signal.
- The bias, the cluster's prior for s, stays the cluster's own. A cluster that never sees s keeps a low prior for
  it. Pasting the bias made clusters predict species their sites do not hold.
Earlier forms were measured as harmful (docs/nira.md): overwriting after every step, and once but without norm
matching or with the bias. The current form, over 3 seeds without privacy, lifted NIRA from +6.6 ± 32.9 to
+22.2 ± 11.1 points of macro accuracy over FedAvg; under CCDP it changed nothing (10 seeds: 66.5 against
66.4 % macro, docs/nira.md, where most of that old gain turns out to be label masking). It is on by default.

State (clusters, pins, last moves, change log) is JSON in the coordinator database (``Store.get_state``), so a
restarted coordinator continues with the same clusters (:mod:`coordinator.strategies.nira_clusters`). The
re-clustering maths (sketches, similarity SNR, label matching, the move rule) is in
:mod:`coordinator.strategies.reclustering`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from shared.errors import ConfigError

from coordinator.strategies.base import Strategy, Tensors
from coordinator.strategies.cluster_assignment import ClusterAssignment
from coordinator.strategies.fedavg import RunningWeightedSum, add_weighted, new_running_sum
from coordinator.strategies.nira_clusters import NiraClusters
from coordinator.strategies.reclustering import hash_sketch, recluster_from_updates, similarity_snr

__all__ = ["NIRA", "BUNDLE_PREFIX", "PHI_WEIGHTINGS"]

log = logging.getLogger(__name__)

BUNDLE_PREFIX = "nira/"
PHI_WEIGHTINGS = ("records", "inverse_variance", "clusters")
_DIAGNOSTICS_KEPT = 200  # rounds of diagnostics kept in the state


class NIRA(NiraClusters, Strategy):
    """The NIRA strategy (see the module docstring).

    Args:
        store: anything with ``get_state(key, default)`` / ``set_state(key, value)`` (``coordinator.storage.Store``).
        site_metadata: returns ``{site_id: public metadata}`` of the enrolled sites (``"species"``: scientific names,
            ``"capacity"``: N_k, the declared capacity).
        cut: ``{"distance_threshold": float | None, "num_clusters": int | None}`` of the dendrogram.
        exclude_categories: IUCN categories left out of the species lists (codes, e.g. ``["CR", "EN"]``).
        species_classes: ``{scientific name: class index}`` of the model's head rows (merging needs it; None turns
            merging off). species_categories: ``{scientific name: IUCN code}`` (to leave out sensitive species).
        recluster_every, recluster_margin, min_rounds_between_moves: re-clustering (0 = never re-cluster).
        embedding_merging: whether to merge species embeddings. head_prefix: names of the head tensors.
        count_noise: with a value, merging is weighted by the sites' noisy per-class counts released with this
            noise std (the ``noisy_counts`` choice of the module docstring); None: public N_k weights.
        phi_weighting: ``"records"`` (default), ``"inverse_variance"`` or ``"clusters"`` (module docstring).
        min_cluster_records: clusters with fewer declared records join their most similar cluster (0: off).
        recluster_min_snr: re-cluster only in rounds whose similarity SNR
            (:func:`~coordinator.strategies.reclustering.similarity_snr`) is at least this (0: always).

    Raises:
        ConfigError: an unknown ``phi_weighting`` or a negative ``min_cluster_records`` / ``recluster_min_snr``.
    """

    def __init__(self, *, store: Any, site_metadata: Callable[[], Mapping[str, Mapping[str, Any]]],
                 cut: Mapping[str, Any], exclude_categories: tuple[str, ...] = ("CR", "EN"),
                 species_classes: Mapping[str, int] | None = None,
                 species_categories: Mapping[str, str] | None = None, recluster_every: int = 0,
                 recluster_margin: float = 0.1, min_rounds_between_moves: int = 3, embedding_merging: bool = True,
                 head_prefix: str = "psi.", count_noise: float | None = None, phi_weighting: str = "records",
                 min_cluster_records: float = 0, recluster_min_snr: float = 0.0) -> None:
        if phi_weighting not in PHI_WEIGHTINGS:
            raise ConfigError(f"phi_weighting must be one of {PHI_WEIGHTINGS}, got {phi_weighting!r}",
                              field="phi_weighting", fix="use records (FedAvg's weights) or inverse_variance")
        for name, value in (("min_cluster_records", min_cluster_records), ("recluster_min_snr", recluster_min_snr)):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}", field=name, fix="use 0 (off)")
        self.phi_weighting = phi_weighting
        self.min_cluster_records = float(min_cluster_records)
        self.recluster_min_snr = float(recluster_min_snr)
        self._store = store
        self._site_metadata = site_metadata
        self._cut = dict(cut)
        self._exclude = tuple(exclude_categories)
        self._classes = dict(species_classes or {})
        self._categories = dict(species_categories or {})
        self.recluster_every = recluster_every
        self.margin = recluster_margin
        self.min_rounds_between_moves = min_rounds_between_moves
        self.embedding_merging = embedding_merging and (bool(self._classes) or count_noise is not None)
        self.head_prefix = head_prefix
        self.count_noise = count_noise
        self._cluster_counts: dict[str, np.ndarray] = {}
        self._cluster_reports: dict[str, int] = {}
        self._bundle: dict[str, np.ndarray] | None = None
        self._acc: dict[str, RunningWeightedSum] = {}
        self._sketches: dict[str, np.ndarray] = {}
        self._emb_sum: dict[int, np.ndarray] = {}
        self._emb_offset: dict[int, np.ndarray] = {}
        self._emb_weight: dict[int, float] = {}
        self._round: int | None = None

    def count_noise_multiplier(self) -> float | None:
        """The count release the tasks ask for: ``count_noise`` when merging by noisy counts, else None."""
        return self.count_noise if (self.embedding_merging and self.count_noise is not None) else None

    # ---- bundle <-> site weights ------------------------------------------------------------------------------
    def _head_names(self, bundle: Tensors) -> list[str]:
        return sorted(n for n in bundle if n.startswith(self.head_prefix))

    def prepare(self, bundle: Tensors, *, round: int) -> dict[str, np.ndarray]:
        """Cluster (or update the clusters) and give every cluster a head: a new cluster's head starts from the
        mean of the existing heads (or from the plain model's head in round 1)."""
        assignment = self._ensure_assignment(round)
        out = {k: np.asarray(v) for k, v in bundle.items()}
        plain_heads = {n: out.pop(n) for n in self._head_names(out)}
        existing = sorted({n.split("/")[1] for n in out if n.startswith(BUNDLE_PREFIX)})
        head_names = sorted(plain_heads) or sorted({n.split("/", 2)[2] for n in out if n.startswith(BUNDLE_PREFIX)})
        for cluster in sorted(assignment.clusters):
            for name in head_names:
                key = f"{BUNDLE_PREFIX}{cluster}/{name}"
                if key in out:
                    continue
                if name in plain_heads:
                    out[key] = plain_heads[name].copy()
                else:
                    out[key] = np.mean([out[f"{BUNDLE_PREFIX}{c}/{name}"] for c in existing], axis=0).astype(
                        next(iter(out[f"{BUNDLE_PREFIX}{c}/{name}"] for c in existing)).dtype)
        # heads of clusters that no longer exist are dropped
        for key in [k for k in out if k.startswith(BUNDLE_PREFIX) and k.split("/")[1] not in assignment.clusters]:
            del out[key]
        return out

    def site_weights(self, bundle: Tensors, site_id: str) -> dict[str, np.ndarray]:
        """phi (shared) + the head of the site's cluster, under the plain model names."""
        assignment = self.assignment()
        if assignment is None or site_id not in assignment.site_cluster:
            raise KeyError(f"site {site_id!r} has no cluster yet (prepare() assigns every enrolled site)")
        cluster = assignment.site_cluster[site_id]
        prefix = f"{BUNDLE_PREFIX}{cluster}/"
        out = {k: v for k, v in bundle.items() if not k.startswith(BUNDLE_PREFIX)}
        out.update({k[len(prefix):]: v for k, v in bundle.items() if k.startswith(prefix)})
        return out

    # ---- one round ---------------------------------------------------------------------------------------------
    def begin_round(self, template: Tensors) -> None:
        """Zero one running sum per cluster (site-weights shaped) for the round that trains from ``template``."""
        self._bundle = {k: np.asarray(v) for k, v in template.items()}
        assignment = self.assignment()
        if assignment is None:
            raise ValueError("NIRA.begin_round before prepare(): no clusters")
        self._assignment = assignment
        site_template = self.site_weights(self._bundle, next(iter(assignment.site_cluster)))
        self._acc = {c: new_running_sum(site_template) for c in assignment.clusters}
        self._sketches, self._emb_sum, self._emb_weight, self._emb_offset = {}, {}, {}, {}
        self._cluster_counts, self._cluster_reports = {}, {}
        self._variance_sum: dict[str, float | None] = {c: 0.0 for c in assignment.clusters}  # sum N_k^2 v_k
        self._phi_norms: dict[str, float] = {}
        self._variances: dict[str, float | None] = {}
        self._phi_dim = 0

    def accumulate(self, site_id: str, delta: Tensors, *, num_examples: int,
                   species_counts: Mapping[int, float] | None = None, noise_variance: float | None = None) -> None:
        """Add ``N_k * delta_k`` to the running sum of the site's cluster; keep a sketch of its phi-update (on
        re-clustering rounds) and its species embeddings (for merging).

        ``noise_variance``: v_k, the variance per coordinate of the DP noise in ``delta``
        (:func:`coordinator.strategies.base.update_noise_variance`; 0 without privacy, None unknown), for
        ``inverse_variance`` weighting and the similarity SNR."""
        if self._bundle is None:
            raise ValueError("NIRA.accumulate called before begin_round")
        cluster = self._assignment.site_cluster.get(site_id)
        if cluster is None:
            raise ValueError(f"site {site_id!r} is in no cluster")
        add_weighted(self._acc[cluster], delta, float(num_examples))
        self._acc[cluster].contributors.append(site_id)
        prev = self._variance_sum[cluster]
        self._variance_sum[cluster] = (None if prev is None or noise_variance is None
                                       else prev + float(num_examples) ** 2 * float(noise_variance))
        self._variances[site_id] = noise_variance
        names = [n for n in sorted(delta) if not n.startswith(self.head_prefix)]
        if names:  # a head-only model has no phi: nothing to re-cluster on
            phi = np.concatenate([np.asarray(delta[n], dtype=np.float64).reshape(-1) for n in names])
            self._sketches[site_id] = hash_sketch(phi)
            # the SNR's norms leave the biases out: a gateway that trains on centred inputs folds its public centre
            # into the first layer's bias (shared.models.feature_centre), which adds noise there that v_k omits
            weights = [np.asarray(delta[n], dtype=np.float64).reshape(-1) for n in names if not n.endswith("bias")]
            if weights:
                w = np.concatenate(weights)
                self._phi_dim = int(w.size)
                self._phi_norms[site_id] = float(w @ w)
        if self.embedding_merging and self.count_noise_multiplier() is not None:
            if not species_counts:
                raise ValueError(f"site {site_id!r} sent no species counts though the round asked for them")
            self._accumulate_counted_embeddings(cluster, delta, species_counts)
        elif self.embedding_merging:
            self._accumulate_embeddings(site_id, cluster, delta, float(num_examples))

    def _head_rows(self, cluster: str, delta: Tensors | None) -> np.ndarray:
        """The cluster's head (+ delta) as rows: float64 (num_classes, features + 1) (weight row, then bias)."""
        w = self._bundle[f"{BUNDLE_PREFIX}{cluster}/{self.head_prefix}weight"].astype(np.float64)
        b = self._bundle[f"{BUNDLE_PREFIX}{cluster}/{self.head_prefix}bias"].astype(np.float64)
        if delta is not None:
            w = w + np.asarray(delta[f"{self.head_prefix}weight"], dtype=np.float64)
            b = b + np.asarray(delta[f"{self.head_prefix}bias"], dtype=np.float64)
        return np.concatenate([w, b[:, None]], axis=1)

    def _accumulate_embeddings(self, site_id: str, cluster: str, delta: Tensors, weight: float) -> None:
        rows = self._head_rows(cluster, delta)
        for name in self.species_lists().get(site_id, ()):
            s = self._classes.get(name)
            if s is None:
                continue
            self._add_embedding(s, weight, rows)

    def _add_embedding(self, s: int, weight: float, rows: np.ndarray) -> None:
        """Add ``weight * row s`` and ``weight * (mean of all rows)`` (the head's offset, for alignment)."""
        self._emb_sum[s] = self._emb_sum.get(s, 0.0) + weight * rows[s]
        self._emb_offset[s] = self._emb_offset.get(s, 0.0) + weight * rows.mean(axis=0)
        self._emb_weight[s] = self._emb_weight.get(s, 0.0) + weight

    def _accumulate_counted_embeddings(self, cluster: str, delta: Tensors, counts: Mapping[int, float]) -> None:
        rows = self._head_rows(cluster, delta)
        totals = self._cluster_counts.setdefault(cluster, np.zeros(rows.shape[0]))
        self._cluster_reports[cluster] = self._cluster_reports.get(cluster, 0) + 1
        for s, noisy in counts.items():
            if not 0 <= s < rows.shape[0]:
                continue
            totals[s] += noisy
            weight = max(0.0, float(noisy))
            if weight > 0:
                self._add_embedding(s, weight, rows)

    def _lacking(self, cluster: str, members: tuple[str, ...], lists: Mapping[str, Any]) -> set[int]:
        """Head rows the cluster lacks (see the module docstring): by the public lists, or by noisy counts."""
        num_rows = self._head_rows(cluster, None).shape[0]
        if self.count_noise_multiplier() is None:
            seen = {self._classes[n] for m in members for n in lists.get(m, ()) if n in self._classes}
            return set(range(num_rows)) - seen
        reports = self._cluster_reports.get(cluster, 0)
        if reports == 0:
            return set()  # no evidence this round: leave the cluster's rows alone
        threshold = 3.0 * float(self.count_noise_multiplier()) * np.sqrt(reports)
        totals = self._cluster_counts[cluster]
        return {s for s in range(num_rows) if totals[s] <= threshold}

    def aggregate(self) -> dict[str, np.ndarray]:
        """The bundle delta: phi from the size-weighted mean of the clusters' FedAvg deltas, each head from its own
        cluster's (zero for a cluster without updates).

        Raises:
            ValueError: nothing was accumulated this round.
        """
        if self._bundle is None or self.count == 0:
            raise ValueError("no update was accumulated: nothing to aggregate")
        shares = self.phi_weights()
        out = {k: np.zeros(np.shape(v), dtype=np.float64) for k, v in self._bundle.items()}
        for cluster, acc in self._acc.items():
            if acc.count == 0:
                continue
            share = shares[cluster]
            for name, summed in acc.sums.items():
                mean = summed / acc.total_weight  # intra-cluster FedAvg, weighted by N_k
                if name.startswith(self.head_prefix):
                    out[f"{BUNDLE_PREFIX}{cluster}/{name}"] += mean
                else:
                    out[name] += share * mean
        return {k: v.astype(np.asarray(self._bundle[k]).dtype) for k, v in out.items()}

    def _cluster_variances(self) -> dict[str, float | None]:
        """V_m = sum_k N_k^2 v_k / N_m^2: the noise variance per coordinate of cluster m's mean delta this round."""
        return {c: (None if self._variance_sum[c] is None else self._variance_sum[c] / acc.total_weight ** 2)
                for c, acc in self._acc.items() if acc.count > 0}

    def phi_weights(self) -> dict[str, float]:
        """``{cluster: w_m}`` of this round's phi average (module docstring, ``phi_weighting``), over the clusters
        with updates; they sum to 1. ``inverse_variance`` falls back to records when a variance is unknown or
        zero (no privacy: equal precision per record)."""
        active = {c: acc for c, acc in self._acc.items() if acc.count > 0}
        if self.phi_weighting == "clusters":
            total = sum(acc.count for acc in active.values())
            return {c: acc.count / total for c, acc in active.items()}  # |C_m| / K over this round's sites
        if self.phi_weighting == "inverse_variance":
            variances = self._cluster_variances()
            if all(v is not None and v > 0 for v in variances.values()):
                precision = {c: 1.0 / float(v) for c, v in variances.items()}  # type: ignore[arg-type]
                total = sum(precision.values())
                return {c: p / total for c, p in precision.items()}
            log.info("nira: inverse_variance weighting without every update's noise variance: records this round")
        total = sum(acc.total_weight for acc in active.values())
        return {c: acc.total_weight / total for c, acc in active.items()}

    def round_diagnostics(self) -> dict[str, Any]:
        """This round's ``{"similarity_snr": float | None, "phi_noise_std": float | None, "fedavg_noise_std":
        float | None, "phi_weights": {cluster: w_m}, "head_noise_std": {cluster: sqrt(V_m)},
        "cluster_records": {cluster: N_m}}``: the SNR of re-clustering's similarities
        (:func:`~coordinator.strategies.reclustering.similarity_snr`, over phi's weight tensors: a gateway's
        centring fold adds noise to biases), and the noise std per coordinate on the phi average against the one
        FedAvg over the same updates would have (``sqrt(sum_k (N_k / N)^2 v_k)``); None where a variance is
        unknown."""
        weights = self.phi_weights()
        variances = self._cluster_variances()
        phi_var = (None if any(variances[c] is None for c in weights)
                   else sum(w * w * float(variances[c]) for c, w in weights.items()))  # type: ignore[arg-type]
        n = sum(acc.total_weight for acc in self._acc.values())
        sums = [self._variance_sum[c] for c, acc in self._acc.items() if acc.count > 0]
        fedavg_var = None if any(v is None for v in sums) else sum(sums) / n ** 2  # type: ignore[arg-type]
        snr = similarity_snr(self._phi_norms, self._variances, self._phi_dim) if self._phi_norms else None
        return {"similarity_snr": snr, "phi_noise_std": None if phi_var is None else math.sqrt(phi_var),
                "fedavg_noise_std": None if fedavg_var is None else math.sqrt(fedavg_var), "phi_weights": weights,
                "head_noise_std": {c: None if v is None else math.sqrt(v) for c, v in variances.items()},
                "cluster_records": {c: float(acc.total_weight) for c, acc in self._acc.items() if acc.count > 0}}

    def after_step(self, bundle: Tensors) -> dict[str, np.ndarray]:
        """Species-embedding merging: in each cluster, the head row of every species it lacks is initialised, once
        per (cluster, species), with the merged embedding of that species, aligned to the cluster's head (see the
        module docstring). Rows merged before are left to training."""
        out = {k: np.array(v, copy=True) for k, v in bundle.items()}
        if not self.embedding_merging or not self._emb_sum:
            return out
        state = self.state()
        done = {c: set(v) for c, v in state.get("merged", {}).items()}
        lists = self.species_lists() if self.count_noise_multiplier() is None else {}
        merged = {s: (self._emb_sum[s] - self._emb_offset[s]) / self._emb_weight[s] for s in self._emb_sum
                  if self._emb_weight[s] > 0}
        changed = False
        for cluster, members in self._assignment.clusters.items():
            lacking = self._lacking(cluster, members, lists)
            w_key, b_key = (f"{BUNDLE_PREFIX}{cluster}/{self.head_prefix}weight",
                            f"{BUNDLE_PREFIX}{cluster}/{self.head_prefix}bias")
            rows = np.concatenate([out[w_key].astype(np.float64), out[b_key].astype(np.float64)[:, None]], axis=1)
            offset = rows.mean(axis=0)
            own = [np.linalg.norm((rows[i] - offset)[:-1]) for i in range(rows.shape[0]) if i not in lacking]
            own_norm = float(np.mean(own)) if own else 0.0
            for s, centred in sorted(merged.items()):
                if s not in lacking or s in done.get(cluster, set()):
                    continue
                # the weight part only, shrunk to at most this head's typical row (mean norm of its centred rows for
                # the species it has), then moved to this head's mean row; the bias (the cluster's prior) stays its own
                direction = centred[:-1]
                norm = float(np.linalg.norm(direction))
                if norm > own_norm > 0:
                    direction = direction * (own_norm / norm)
                out[w_key][s] = (direction + offset[:-1]).astype(out[w_key].dtype)
                done.setdefault(cluster, set()).add(s)
                changed = True
        if changed:
            state["merged"] = {c: sorted(v) for c, v in done.items()}
            self._save(state)
        return out

    def end_round(self, round: int) -> list[str]:
        """Every ``recluster_every`` rounds: move sites whose phi-updates align with another cluster (margin and
        anti-flapping rules of :func:`~coordinator.strategies.reclustering.recluster_from_updates`)."""
        lines: list[str] = []
        state = self.state()
        diagnostics = {"round": round, **self.round_diagnostics()}
        state["diagnostics"] = (list(state.get("diagnostics", [])) + [_json_ready(diagnostics)])[-_DIAGNOSTICS_KEPT:]
        self._save(state)
        if self.recluster_every <= 0 or round % self.recluster_every != 0 or len(self._sketches) < 2:
            return lines
        snr = diagnostics["similarity_snr"]
        if self.recluster_min_snr > 0 and (snr is None or snr < self.recluster_min_snr):
            shown = "unknown" if snr is None else format(snr, ".3g")
            lines.append(f"no re-clustering: similarity SNR {shown} is below "
                         f"recluster_min_snr {self.recluster_min_snr:g} (the similarities are DP noise)")
            return lines
        current = ClusterAssignment.from_json(state["assignment"])
        # pinned sites never move (assignment.pinned), but their updates still count for the others
        new, changes = recluster_from_updates(dict(self._sketches), current, margin=self.margin,
                                              min_rounds_between_moves=self.min_rounds_between_moves, round=round,
                                              last_moved={k: int(v) for k, v in state["last_moved"].items()})
        for change in changes:
            self._log_change(state, round, change.site, change.from_cluster, change.to_cluster, change.reason)
            state["last_moved"][change.site] = round
            lines.append(f"site {change.site}: {change.from_cluster} -> {change.to_cluster} ({change.reason})")
        state["assignment"] = new.to_json()
        self._save(state)
        return lines

    @property
    def count(self) -> int:
        """Updates accumulated this round (all clusters)."""
        return sum(acc.count for acc in self._acc.values())


def _json_ready(value: Any) -> Any:
    """Floats that JSON can hold (inf and nan as strings), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    return value
