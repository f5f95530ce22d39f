"""NIRA against the baselines a reviewer would demand, on the frozen backbone's head (docs/nira.md).

``wildfed experiment nira-head`` replays the demo's federation in one process (:mod:`wildfed_sim.demo_sim`: the
demo's data, site design, gateways' training with CCDP and the coordinator's own strategy objects) and compares:

==========================  =====================================================================================
``fedavg``                  FedAvg (:class:`coordinator.strategies.fedavg.FedAvg`), the global head, 10-way argmax
``fedavg+mask``             the same model, argmax over the site's own species table only (free: the site knows it)
``fedavg+fine-tune``        the same model, then the site fine-tunes its head on its own records without noise and
                            never releases it (free; as the personalised model of Ditto, Li et al. ICML 2021)
``nira``                    :class:`coordinator.strategies.nira.NIRA`: clusters from the public species lists,
                            phi (the adapter) moved by records, one head per cluster, species-embedding merging with
                            public weights
``nira-head-only``          NIRA without an adapter: per-cluster heads on the frozen embeddings
``nira+mask``               NIRA's site model with the site's species mask
``nira-inverse-variance``   phi weighted by the inverse DP noise variance of each cluster's mean
``nira-clusters``           phi weighted by |C_m| / K (the seed's rule)
``nira-no-merging``         NIRA without species-embedding merging
``nira-min-records``        NIRA with clusters below ``MIN_CLUSTER_RECORDS`` records merged into their nearest
``nira-recluster``          NIRA re-clustering from phi-update similarity every 2 rounds (no SNR gate: to measure)
``nira-noisy-counts``       NIRA merging species embeddings weighted by per-class counts released with Gaussian
                            noise of std ``COUNT_NOISE`` each round (charged: the DP-SGD noise is calibrated so that
                            both stay within each budget), which covers CR/EN species too
==========================  =====================================================================================

Protocol. Every method is tuned over ten points (:func:`grid_for`: five learning rates times two adapter widths,
0 and 64 for FedAvg, 16 and 64 for NIRA, whose phi is the adapter; the head-only NIRA ablation has FedAvg's five
head-only points; the fine-tuned baseline also chooses its number of fine-tuning steps from
:data:`FINE_TUNE_STEPS`) on tuning seeds
that are never reported (default 101, 103), by the mean macro accuracy; methods that share a training share its
runs (a scoring is post-processing of the same models). Reported: seeds 0-9 by default, each method at its chosen
point; paired differences (same seed: same data, sites and initial model) with 95 % Student-t intervals
(:func:`wildfed_sim.common.stats.paired_interval`) of every method against the best baseline (chosen on the
tuning seeds among the three FedAvg baselines). Headroom: round 0 (the initial model) and the non-private ceiling
(the same head trained centrally on all sites' records, :func:`wildfed_sim.evaluation.train_centralised`).

Metrics, per site on the held-out test images of the classes it holds (:func:`wildfed_sim.evaluation
.evaluate_sites`), then the mean over sites: ``macro`` (mean per-class accuracy), ``site_mean`` (weighted by the
site's own class frequencies), ``rare`` (its rarest species) and ``cr_en`` (its CR/EN species; sites without any
left out). NIRA's diagnostics per round (:meth:`coordinator.strategies.nira.NIRA.round_diagnostics`): the
similarity SNR of the phi-updates and the noise std on phi against FedAvg's.

Privacy: CCDP gamma 1 (anchor VU = 1, the demo's default), "sample" variant; every method spends the same budget
(the scorings and the fine-tuning are post-processing or never released).

Output (``out_dir``): ``runs.jsonl`` (one row per run, resumable), ``nira-head.json`` (settings, choices, summary,
comparisons), ``nira-head.md`` (the tables), ``nira-head.png``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from wildfed_sim.common.federation import FederationCache
from wildfed_sim.common.runs import new_run_dir, read_runs
from wildfed_sim.common.stats import mean_and_sd, paired_interval

__all__ = ["Method", "TRAININGS", "METHODS", "BASELINES", "GRID", "NIRA_GRID", "HEAD_ONLY_GRID", "grid_for",
           "FINE_TUNE_STEPS", "MIN_CLUSTER_RECORDS",
           "NiraHeadSettings", "NiraHeadResult", "STRUCTURES", "real_structure_federation", "head_logits",
           "fine_tune_head", "score_sites",
           "run_nira_head_experiment"]

MIN_CLUSTER_RECORDS = 800
COUNT_NOISE = 100.0  # the coordinator config's default count_noise_multiplier
#: training name -> the strategy it runs (``None``: FedAvg) as keyword arguments of NIRA
TRAININGS: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "nira": {},
    "nira-head-only": {},
    "nira-inverse-variance": {"phi_weighting": "inverse_variance"},
    "nira-clusters": {"phi_weighting": "clusters"},
    "nira-no-merging": {"embedding_merging": False},
    "nira-min-records": {"min_cluster_records": MIN_CLUSTER_RECORDS},
    "nira-recluster": {"recluster_every": 2, "min_rounds_between_moves": 2, "recluster_min_snr": 0.0},
    "nira-noisy-counts": {"count_noise": COUNT_NOISE},
}
LEARNING_RATES = (1.0, 2.0, 4.0, 8.0, 16.0)
#: (learning rate, adapter width) tried for FedAvg: the head alone or with a 64-wide adapter
GRID: tuple[tuple[float, int], ...] = tuple((lr, h) for h in (0, 64) for lr in LEARNING_RATES)
#: NIRA's phi is the adapter: the same number of points, two adapter widths
NIRA_GRID: tuple[tuple[float, int], ...] = tuple((lr, h) for h in (16, 64) for lr in LEARNING_RATES)
#: the ablation without phi (per-cluster heads on the frozen embeddings): FedAvg's head-only points
HEAD_ONLY_GRID: tuple[tuple[float, int], ...] = tuple((lr, 0) for lr in LEARNING_RATES)


def grid_for(training: str, grid: Sequence[tuple[float, int]] | None = None) -> tuple[tuple[float, int], ...]:
    """The tuning grid of ``training``: ``grid`` when given (every training), else :data:`GRID` for FedAvg,
    :data:`HEAD_ONLY_GRID` for ``nira-head-only`` and :data:`NIRA_GRID` for the other NIRA trainings."""
    if grid is not None:
        return tuple(grid)
    return GRID if training == "fedavg" else HEAD_ONLY_GRID if training == "nira-head-only" else NIRA_GRID
FINE_TUNE_STEPS: tuple[int, ...] = (25, 100)


@dataclass(frozen=True)
class Method:
    """One reported method: a training (key of :data:`TRAININGS`) and how each site scores its model
    (``"plain"``: 10-way argmax; ``"mask"``: argmax over the site's species; ``"fine-tune"``: the site's
    locally fine-tuned head, plain argmax)."""

    name: str
    training: str
    scoring: str
    label: str


METHODS: tuple[Method, ...] = (
    Method("fedavg", "fedavg", "plain", "FedAvg"),
    Method("fedavg+mask", "fedavg", "mask", "FedAvg + species mask"),
    Method("fedavg+fine-tune", "fedavg", "fine-tune", "FedAvg + local fine-tuning"),
    Method("nira", "nira", "plain", "NIRA (phi by records, merging)"),
    Method("nira+mask", "nira", "mask", "NIRA + species mask"),
    Method("nira-head-only", "nira-head-only", "plain", "NIRA without phi (per-cluster heads only)"),
    Method("nira-inverse-variance", "nira-inverse-variance", "plain", "NIRA, phi by inverse noise variance"),
    Method("nira-clusters", "nira-clusters", "plain", "NIRA, phi by sites per cluster, C_m/K (seed)"),
    Method("nira-no-merging", "nira-no-merging", "plain", "NIRA, no embedding merging"),
    Method("nira-min-records", "nira-min-records", "plain", f"NIRA, clusters >= {MIN_CLUSTER_RECORDS} records"),
    Method("nira-recluster", "nira-recluster", "plain", "NIRA, re-clustering every 2 rounds"),
    Method("nira-noisy-counts", "nira-noisy-counts", "plain", "NIRA, merging by noisy counts (charged)"),
)
BASELINES = ("fedavg", "fedavg+mask", "fedavg+fine-tune")
METRICS = ("macro", "site_mean", "rare", "cr_en")


# ------------------------------------------------------------------------------------------ scoring
def _hidden(weights: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """float64 (N, H): the head model's input to psi (tanh adapter phi when present, else the embeddings)."""
    x = np.asarray(features, dtype=np.float64)
    if "phi.0.weight" in weights:
        return np.tanh(x @ np.asarray(weights["phi.0.weight"], np.float64).T
                       + np.asarray(weights["phi.0.bias"], np.float64))
    return x


def head_logits(weights: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """The head model's logits, float64 (N, K), from float32 (N, 1280) embeddings (``shared.models.head``:
    ``psi(tanh(phi(x)))`` with an adapter, ``psi(x)`` without); the same as the torch model up to float
    rounding (tested)."""
    h = _hidden(weights, features)
    return h @ np.asarray(weights["psi.weight"], np.float64).T + np.asarray(weights["psi.bias"], np.float64)


def fine_tune_head(weights: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray, *, steps: int
                   ) -> dict[str, np.ndarray]:
    """The site's personalised head: ``steps`` full-batch gradient-descent steps on the mean cross-entropy of its
    own records, psi only (the adapter stays the federation's), from ``weights``. Never released, so it costs no
    privacy (the personalised-model baseline of Ditto, Li et al. ICML 2021, without the proximal term).

    The inputs of psi are centred on the site's own mean (a reparametrisation: the bias absorbs it) and the step
    is 1 / L with ``L = 0.5 * max_i (||h_i - mean||^2 + 1)``, a bound of the largest Hessian eigenvalue of the
    softmax cross-entropy (Böhning 1992, "Multinomial logistic regression algorithm", the bound (I - 11^T/K) / 2),
    so the steps descend without tuning.

    Args:
        weights: the site's model. features: float32 (N, 1280). labels: int (N,). steps: >= 0.

    Returns:
        A copy of ``weights`` with the fine-tuned ``psi.weight`` (K, H) and ``psi.bias`` (K,), float32.
    """
    h = _hidden(weights, features)
    mu = h.mean(axis=0)
    hc = h - mu
    w = np.asarray(weights["psi.weight"], np.float64).copy()
    b = np.asarray(weights["psi.bias"], np.float64) + w @ mu  # the same logits on centred inputs
    y = np.asarray(labels, dtype=np.int64)
    onehot = np.eye(w.shape[0])[y]
    step = 1.0 / (0.5 * (float(np.max(np.sum(hc * hc, axis=1))) + 1.0))
    for _ in range(int(steps)):
        z = hc @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        r = (p - onehot) / len(y)
        w -= step * (r.T @ hc)
        b -= step * r.sum(axis=0)
    out = dict(weights)
    out["psi.weight"] = w.astype(np.float32)
    out["psi.bias"] = (b - w @ mu).astype(np.float32)
    return out


def _site_summary(per_class: Mapping[int, float], counts: Mapping[int, int], sensitive: set[int]) -> dict[str, float]:
    from wildfed_sim.evaluation import rare_species

    species = sorted(counts)
    vals = [per_class[c] for c in species if not math.isnan(per_class[c])]
    weighted = [(counts[c], per_class[c]) for c in species if not math.isnan(per_class[c])]
    total = sum(n for n, _ in weighted)
    rare = [per_class[c] for c in rare_species(counts) if not math.isnan(per_class[c])]
    cr_en = [per_class[c] for c in species if c in sensitive and not math.isnan(per_class[c])]
    return {"macro": statistics.fmean(vals) if vals else math.nan,
            "site_mean": sum(n * a for n, a in weighted) / total if total else math.nan,
            "rare": statistics.fmean(rare) if rare else math.nan,
            "cr_en": statistics.fmean(cr_en) if cr_en else math.nan}


def score_sites(fed: Any, site_models: Mapping[str, Mapping[str, np.ndarray]], scoring: str,
                fine_tune_steps: int = 0) -> dict[str, float]:
    """The federation's metrics (:data:`METRICS`, fractions; mean over sites, sites without a CR/EN species left
    out of ``cr_en``) for each site's model scored as ``scoring`` (``"plain"``, ``"mask"``, ``"fine-tune"``) on
    the held-out test images of the classes it holds.

    Raises:
        ConfigError: an unknown scoring.
    """
    if scoring not in ("plain", "mask", "fine-tune"):
        raise ConfigError(f"unknown scoring {scoring!r}", field="scoring", fix="use plain, mask or fine-tune")
    labels = np.asarray(fed.test_labels)
    sensitive = {k for k, c in enumerate(fed.class_categories) if c.is_sensitive}
    per_site: list[dict[str, float]] = []
    for site in fed.sites:
        weights = site_models[site.site_id]
        if scoring == "fine-tune":
            weights = fine_tune_head(weights, site.features, site.labels, steps=fine_tune_steps)
        species = list(site.species) or sorted({int(c) for c in site.labels})
        rows = np.isin(labels, species)
        logits = head_logits(weights, fed.test_features[rows])
        if scoring == "mask":
            masked = np.full_like(logits, -np.inf)
            masked[:, species] = logits[:, species]
            logits = masked
        pred = logits.argmax(axis=1)
        y = labels[rows]
        per_class = {c: float((pred[y == c] == c).mean()) if (y == c).any() else math.nan for c in species}
        counts = {c: int((site.labels == c).sum()) for c in species}
        per_site.append(_site_summary(per_class, counts, sensitive))
    out = {}
    for m in METRICS:
        vals = [s[m] for s in per_site if not math.isnan(s[m])]
        out[m] = statistics.fmean(vals) if vals else math.nan
    return out


def _all_scorings(fed: Any, site_models: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, float]]:
    out = {"plain": score_sites(fed, site_models, "plain"), "mask": score_sites(fed, site_models, "mask")}
    for steps in FINE_TUNE_STEPS:
        out[f"fine-tune:{steps}"] = score_sites(fed, site_models, "fine-tune", steps)
    return out


# ------------------------------------------------------------------------------------------ one run
_FEDERATION = FederationCache()  # one federation per worker at a time (memory)


STRUCTURES = ("demo", "wildlife-insights", "serengeti")
SERENGETI_SITES = 40  # locations drawn per seed (of 223): the replay trains every site in one process


def real_structure_federation(seed: int, structure: str, *, data_root: str | Path | None = None) -> Any:
    """A federation with a real site structure from ``../shared/data``: one site per Wildlife Insights deployment
    (``"wildlife-insights"``, all 38) or per Snapshot Serengeti camera location (``"serengeti"``,
    :data:`SERENGETI_SITES` locations drawn uniformly by ``seed``), each holding its own species in its own
    proportions, with Animal-MNIST images standing in for the photos (which are not in the data).

    Classes: Wildlife Insights, its 10 most recorded species; Serengeti, its 9 most annotated species and the black
    rhinoceros (CR; 45 annotations at 17 of the 223 locations), so that the CR metric has a species. Class k takes
    the images of Animal-MNIST class k. Site d gets ``round(n_ds * s_c)`` images of class c (at least one where
    ``n_ds > 0``), ``n_ds`` its real count and ``s_c = min(1, available_c / sum_d n_ds)`` one scale per class so
    that the class fits the training images (:func:`wildfed_sim.animal_mnist.split_holdout` of ``seed``); images
    are drawn without replacement, each site's byte-identical repeats dropped as the demo drops them; sites left
    without records are dropped. Each class's IUCN category is its species' in the Mammal Diversity Database 2020
    (``iucn/mdd_2020-09.csv``); a taxon it does not list (birds, the feral pig) is ``NE`` (not evaluated by that
    source).

    Returns:
        A :class:`wildfed_sim.demo_sim.SimFederation` whose ``class_names`` are the real scientific names (the
        sites' public species lists name them).

    Raises:
        DatasetError: the data files are missing. ConfigError: an unknown ``structure``.
    """
    from shared.iucn import IUCNCategory
    from wildfed_sim.animal_mnist import fetch_animal_mnist, split_holdout
    from wildfed_sim.camtrap_writer import distinct_images
    from wildfed_sim.demo_sim import SimFederation, SimSite
    from wildfed_sim.embeddings import embed_grayscale
    from wildfed_sim import nira_metadata as meta

    root = Path(data_root) if data_root is not None else Path(meta.DEFAULT_DATA_ROOT)
    rng = np.random.default_rng(seed)
    if structure == "wildlife-insights":
        counts, forced, prefix = meta.wildlife_insights_counts(root), (), "wi"
        scientific = {t: t for per in counts.values() for t in per}
    elif structure == "serengeti":
        raw = meta.serengeti_counts(root)
        scientific = {label: meta.SERENGETI_SCIENTIFIC_NAMES[label] for per in raw.values() for label in per
                      if label in meta.SERENGETI_SCIENTIFIC_NAMES}  # animals with a binomial (not birds, humans)
        keep = sorted(rng.choice(sorted(raw), size=min(SERENGETI_SITES, len(raw)), replace=False))
        counts, forced, prefix = {loc: {lbl: n for lbl, n in raw[loc].items() if lbl in scientific}
                                  for loc in keep}, ("rhinoceros",), "se"
    else:
        raise ConfigError(f"unknown site structure {structure!r}", field="structure",
                          fix=f"use one of {STRUCTURES[1:]}")
    totals: dict[str, int] = {}
    for per in counts.values():
        for taxon, n in per.items():
            totals[taxon] = totals.get(taxon, 0) + n
    ranked = [t for t, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])) if t not in forced]
    names = ranked[:10 - len([f for f in forced if f in totals])] + [f for f in forced if f in totals]
    mdd = meta.load_mdd_categories(root / "iucn" / "mdd_2020-09.csv")
    categories = tuple(mdd.get(scientific[t]) or IUCNCategory.NE for t in names)
    train, test = split_holdout(fetch_animal_mnist(), 0.2, seed=seed)
    pools = {c: list(rng.permutation(np.flatnonzero(train.labels == c))) for c in range(len(names))}
    scale = {c: min(1.0, len(pools[c]) / totals[t]) for c, t in enumerate(names)}
    ranks = np.asarray([c.rank for c in categories], dtype=np.int8)
    sites, held = [], set()
    for k, (_, per) in enumerate(sorted(counts.items())):
        idx: list[int] = []
        for c, t in enumerate(names):
            n = per.get(t, 0)
            take = min(len(pools[c]), max(1, round(n * scale[c]))) if n else 0
            idx += [int(i) for i in pools[c][:take]]
            del pools[c][:take]
        if not idx:
            continue
        idx_arr = np.sort(np.asarray(idx, dtype=np.int64))
        idx_arr = idx_arr[distinct_images(train.images[idx_arr])]
        held.update(int(i) for i in idx_arr)
        labels = train.labels[idx_arr].astype(np.int64)
        species = tuple(sorted({int(c) for c in labels}))
        sites.append(SimSite(f"{prefix}-{k:02d}", embed_grayscale(train.images[idx_arr],
                                                                   train.source_indices[idx_arr]),
                             labels, ranks[labels], tuple(sorted({categories[c] for c in species},
                                                                 key=lambda c: c.rank)), species))
    public = np.asarray(sorted(set(range(len(train.labels))) - held), dtype=np.int64)
    public_features = embed_grayscale(train.images[public], train.source_indices[public])
    return SimFederation(tuple(sites), embed_grayscale(test.images, test.source_indices),
                         test.labels.astype(np.int64), public_features, categories,
                         tuple(scientific[t] for t in names))


def _federation(seed: int, sites: int, structure: str = "demo") -> Any:
    from wildfed_sim.demo_sim import load_federation

    return _FEDERATION.get((seed, sites, structure),
                           lambda: (load_federation(seed, num_sites=sites) if structure == "demo"
                                    else real_structure_federation(seed, structure)))


class _MemoryStore:
    """The two methods NIRA needs from ``coordinator.storage.Store`` (JSON round trip, as the database does)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def get_state(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set_state(self, key: str, value: Any) -> None:
        self.values[key] = json.loads(json.dumps(value))


def _strategy(fed: Any, options: Mapping[str, Any] | None) -> Any:
    """None (FedAvg) or the coordinator's NIRA over the sites' public metadata (as the demo enrols them)."""
    if options is None:
        return None
    from coordinator.strategies.nira import NIRA
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    names = list(fed.class_names) or [SPECIES_TABLE[k].scientific_name for k in range(len(fed.class_categories))]
    meta = {s.site_id: s.public_metadata(names, fed.class_categories) for s in fed.sites}
    return NIRA(store=_MemoryStore(), site_metadata=lambda: meta, cut={"distance_threshold": 0.7, "num_clusters": None},
                species_classes={n: k for k, n in enumerate(names)},
                species_categories={n: fed.class_categories[k].value for k, n in enumerate(names)}, **options)


def _run(training: str, seed: int, point: tuple[float, int], settings: "NiraHeadSettings") -> dict[str, Any]:
    from shared.iucn import CCDPBudget
    from wildfed_sim.demo_sim import SimConfig, simulate

    lr, width = point
    fed = _federation(seed, settings.sites, settings.structure)
    strategy = _strategy(fed, TRAININGS[training])
    config = SimConfig(privacy="ccdp", budgets=CCDPBudget.from_anchor("VU", 1.0, 1.0).table(),
                       rounds=settings.rounds, local_steps=settings.local_steps,
                       expected_batch_size=settings.expected_batch_size, learning_rate=float(lr),
                       clipping_norm=settings.clipping_norm, target_delta=settings.target_delta,
                       server_momentum=settings.server_momentum, adapter_width=int(width))
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = simulate(fed, config, seed=seed, strategy=strategy)
    row: dict[str, Any] = {"training": training, "seed": seed, "point": [float(lr), int(width)],
                           "scores": _all_scorings(fed, out["site_models"]), "seconds": 0.0,
                           "epsilon": _epsilon(out["events"], out.get("count_events", {}), settings.target_delta)}
    if strategy is not None:
        state = strategy.state()
        row["diagnostics"] = state.get("diagnostics", [])
        row["clusters"] = {k: list(v) for k, v in strategy.assignment().clusters.items()}
        row["moves"] = len([c for c in state.get("changes", []) if c["from"] is not None])
    row["seconds"] = time.monotonic() - t0
    return row


def _epsilon(events: Mapping[str, Mapping[Any, Any]], count_events: Mapping[str, Mapping[Any, Any]],
             target_delta: float) -> dict[str, float]:
    """``{category code: epsilon}``, the largest over sites of the epsilon of everything its records went through
    (the DP-SGD steps and, with noisy counts, the count releases; dp-accounting's RDP via
    :func:`shared.privacy.accounting.epsilon_spent`)."""
    out: dict[str, float] = {}
    for site, per in events.items():
        for cat, ev in per.items():
            extra = count_events.get(site, {}).get(cat)
            eps = _composed_epsilon((ev,) if extra is None else (ev, extra), float(target_delta))
            out[cat.value] = max(out.get(cat.value, 0.0), eps)
    return out


@lru_cache(maxsize=4096)
def _composed_epsilon(events: tuple[Any, ...], target_delta: float) -> float:
    from shared.privacy.accounting import epsilon_spent

    return epsilon_spent(list(events), target_delta=target_delta)


def _reference(seed: int, settings: "NiraHeadSettings") -> dict[str, Any]:
    """Round 0 (the initial model) and the non-private ceiling (central training on the pooled sites)."""
    from shared.models.kinds import model_spec
    from wildfed_sim.evaluation import train_centralised

    fed = _federation(seed, settings.sites, settings.structure)
    k = len(fed.class_categories)
    initial = model_spec("head", k).initial_weights(seed)
    x = np.concatenate([s.features for s in fed.sites])
    y = np.concatenate([s.labels for s in fed.sites])
    ceiling = train_centralised(x, y, num_classes=k, epochs=settings.ceiling_epochs, batch_size=128,
                                learning_rate=settings.ceiling_learning_rate, seed=seed)
    return {"seed": seed,
            "round0": {sc: score_sites(fed, {s.site_id: initial for s in fed.sites}, sc) for sc in ("plain", "mask")},
            "ceiling": {sc: score_sites(fed, {s.site_id: ceiling for s in fed.sites}, sc) for sc in ("plain", "mask")}}


def _score(row: Mapping[str, Any], method: Method, fine_tune_steps: int | None) -> dict[str, float]:
    if method.scoring == "fine-tune":
        return row["scores"][f"fine-tune:{fine_tune_steps}"]
    return row["scores"][method.scoring]


# ------------------------------------------------------------------------------------------ the experiment
@dataclass
class NiraHeadSettings:
    """The experiment's settings (module docstring). The federation's hyper-parameters not in :data:`GRID` are
    the demo's tuned CCDP defaults (:data:`wildfed_sim.demo.DP_DEFAULTS`)."""

    seeds: tuple[int, ...] = tuple(range(10))
    tuning_seeds: tuple[int, ...] = (101, 103)
    methods: tuple[str, ...] = tuple(m.name for m in METHODS)
    sites: int = 8
    structure: str = "demo"
    rounds: int = 10
    local_steps: int = 1
    expected_batch_size: int = 1024
    clipping_norm: float = 1.0
    server_momentum: float = 0.5
    target_delta: float = 1e-5
    grid: tuple[tuple[float, int], ...] | None = None
    ceiling_epochs: int = 30
    ceiling_learning_rate: float = 0.5
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        known = {m.name for m in METHODS}
        checks = [("seeds", bool(self.seeds), "e.g. --seeds 0,1,2,3,4"),
                  ("tuning_seeds", bool(self.tuning_seeds) and not set(self.tuning_seeds) & set(self.seeds),
                   "tuning seeds must be given and must not be reported seeds, e.g. --tuning-seeds 101,103"),
                  ("methods", bool(self.methods) and set(self.methods) <= known,
                   f"a subset of {sorted(known)}"),
                  ("sites", self.sites >= 2, "e.g. --sites 8"),
                  ("structure", self.structure in STRUCTURES, f"one of {STRUCTURES}"),
                  ("rounds", self.rounds >= 1, "e.g. --rounds 10"),
                  ("grid", self.grid is None or bool(self.grid), "at least one (learning rate, adapter width) point")]
        for name, ok, fix in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is not valid", field=name, fix=fix)


@dataclass
class NiraHeadResult:
    """What :func:`run_nira_head_experiment` produced (fractions)."""

    out_dir: Path
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


def _key(training: str, seed: int, point: Sequence[float]) -> str:
    return json.dumps([training, int(seed), [float(point[0]), int(point[1])]])


def _choose(rows: Sequence[Mapping[str, Any]], method: Method) -> dict[str, Any]:
    """The point (and fine-tuning steps) with the best mean macro accuracy over the tuning runs of ``method``."""
    candidates: dict[tuple, list[float]] = {}
    steps_options = FINE_TUNE_STEPS if method.scoring == "fine-tune" else (None,)
    for r in rows:
        if r["training"] != method.training:
            continue
        for steps in steps_options:
            candidates.setdefault((*r["point"], steps), []).append(_score(r, method, steps)["macro"])
    best = max(candidates, key=lambda p: statistics.fmean(candidates[p]))
    return {"point": [best[0], best[1]], "fine_tune_steps": best[2], "tuning_macro": statistics.fmean(candidates[best]),
            "candidates": len(candidates)}


def _pct(ms: Sequence[float]) -> str:
    return "n/a" if math.isnan(ms[0]) else f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"


def _interval(c: Mapping[str, float]) -> str:
    if not c.get("n") or math.isnan(c["mean"]):
        return "n/a"
    return f"{100 * c['mean']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"


def _structure_label(settings: NiraHeadSettings) -> str:
    if settings.structure == "demo":
        return f"the demo's design with {settings.sites} sites"
    if settings.structure == "serengeti":
        return f"{SERENGETI_SITES} Snapshot Serengeti locations per seed"
    return "the 38 Wildlife Insights deployments"


def markdown_tables(result: NiraHeadResult, settings: NiraHeadSettings) -> str:
    """The experiment's tables (markdown): the methods, the paired comparisons, the headroom, NIRA's diagnostics."""
    lines = [f"Reported seeds {', '.join(map(str, settings.seeds))}; tuned on seeds "
             f"{', '.join(map(str, settings.tuning_seeds))}; CCDP gamma 1 (VU = 1), {_structure_label(settings)}, "
             f"{settings.rounds} rounds. Accuracies in % (mean ± sd over seeds).", "",
             "| method | chosen point | macro | site mean | rare | CR/EN | epsilon spent "
             "(max over sites and seeds) |",
             "|---|---|---|---|---|---|---|"]
    for e in result.summary:
        ch = result.choices[e["method"]]
        chosen = f"lr {ch['point'][0]:g}, adapter {ch['point'][1]}" + (
            f", {ch['fine_tune_steps']} fine-tune steps" if ch["fine_tune_steps"] else "")
        order = {c.value: c.rank for c in IUCNCategory}
        spent = ", ".join(f"{c} {v:.2f}" for c, v in sorted(e.get("epsilon", {}).items(), key=lambda kv: order[kv[0]]))
        lines.append(f"| {e['label']} | {chosen} | " + " | ".join(_pct(e[m]) for m in METRICS) + f" | {spent} |")
    lines += ["", "| headroom | macro | site mean | rare | CR/EN |", "|---|---|---|---|---|"]
    for name, key, sc in (("round 0", "round0", "plain"), ("non-private ceiling (central)", "ceiling", "plain"),
                          ("non-private ceiling + mask", "ceiling", "mask")):
        lines.append(f"| {name} | " + " | ".join(_pct(mean_and_sd([r[key][sc][m] for r in result.references]))
                                                for m in METRICS) + " |")
    if len(settings.seeds) < 2:
        lines += ["", "One reported seed: no spread (± 0.0) and no interval ([-inf, +inf]); report at least five."]
    lines += ["", f"Paired differences against the best baseline on the tuning seeds "
              f"(**{result.diagnostics.get('best_baseline')}**), points, 95 % t-interval:", "",
              "| method | macro | CR/EN | interval above 0 |", "|---|---|---|---|"]
    for c in result.comparisons:
        lines.append(f"| {c['method']} | {_interval(c['macro'])} | {_interval(c['cr_en'])} | "
                     f"{'yes' if c['macro']['low'] > 0 else 'no'} |")
    d = result.diagnostics
    if d.get("snr"):
        lines += ["", "NIRA's similarity SNR per round (median over the reported seeds of the per-round median over "
                  "site pairs; 0: the updates' squared norms are what the DP noise alone gives, so the similarities "
                  "are noise; n/a: no phi) and the noise std on phi relative to FedAvg's over the same updates:", "",
                  "| training | SNR round 1 | SNR last | phi noise / FedAvg's | head noise / FedAvg's | "
                  "re-cluster moves |", "|---|---|---|---|---|---|"]
        for training, v in d["snr"].items():
            lines.append(f"| {training} | {v['first']} | {v['last']} | {v['noise_ratio']} | {v.get('head_ratio')} | "
                         f"{v['moves']} |")
    return "\n".join(lines) + "\n"


def _median_text(values: Sequence[float | None]) -> str:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return "n/a" if not vals else f"{statistics.median(vals):.3g}"


def _snr(d: Mapping[str, Any]) -> float | None:
    v = d.get("similarity_snr")  # a float, or "inf" (JSON cannot hold inf)
    return None if v is None else float(v)


def _diagnostics(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    out = {}
    for training in sorted({r["training"] for r in rows if r.get("diagnostics")}):
        mine = [r for r in rows if r["training"] == training]
        ratios = [d["phi_noise_std"] / d["fedavg_noise_std"] for r in mine for d in r["diagnostics"]
                  if d.get("phi_noise_std") and d.get("fedavg_noise_std")]
        heads = []  # each cluster's head noise std over FedAvg's, averaged over the clusters by their records
        for r in mine:
            for d in r["diagnostics"]:
                h, f, n = d.get("head_noise_std") or {}, d.get("fedavg_noise_std"), d.get("cluster_records") or {}
                if f and h and n and all(v is not None for v in h.values()):
                    heads.append(sum(n[c] * float(v) for c, v in h.items()) / sum(n.values()) / f)
        out[training] = {"first": _median_text([_snr(r["diagnostics"][0]) for r in mine if r["diagnostics"]]),
                         "last": _median_text([_snr(r["diagnostics"][-1]) for r in mine if r["diagnostics"]]),
                         "noise_ratio": _median_text(ratios), "head_ratio": _median_text(heads),
                         "moves": str(sum(r.get("moves", 0) for r in mine))}
    return out


def _plot(result: NiraHeadResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [e["label"] for e in result.summary]
    for i, metric in enumerate(("macro", "cr_en")):
        means = [100 * e[metric][0] for e in result.summary]
        sds = [100 * e[metric][1] for e in result.summary]
        ax.bar(np.arange(len(labels)) + 0.4 * i - 0.2, means, 0.4, yerr=sds, capsize=2,
               label={"macro": "macro", "cr_en": "CR/EN"}[metric])
    for name, key in (("round 0", "round0"), ("ceiling", "ceiling")):
        level = 100 * statistics.fmean(r[key]["plain"]["macro"] for r in result.references)
        ax.axhline(level, ls="--", lw=1, color="grey")
        ax.text(len(labels) - 0.5, level, name, fontsize=7, va="bottom", ha="right")
    ax.set_xticks(np.arange(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("accuracy per site (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_nira_head_experiment(settings: NiraHeadSettings, *, console: Any = None) -> NiraHeadResult:
    """Run the experiment (module docstring): tuning runs, reported runs, references, tables and plot.

    Resumable: the runs already in ``out_dir/runs.jsonl`` (same training, seed and point) are not run again.

    Raises:
        ConfigError: bad settings (:class:`NiraHeadSettings`).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


    t0 = time.monotonic()
    resume = settings.out_dir is not None and (Path(settings.out_dir) / "runs.jsonl").is_file()
    out_dir = Path(settings.out_dir).resolve() if resume else new_run_dir(settings.out_dir, "nira-head")
    log_path = out_dir / "runs.jsonl"
    done = {_key(r["training"], r["seed"], r["point"]): r for r in read_runs(log_path)}
    methods = [m for m in METHODS if m.name in settings.methods]
    baselines = [m for m in methods if m.name in BASELINES]
    trainings = sorted({m.training for m in methods})

    def run_jobs(jobs: list[tuple[str, int, tuple[float, int]]], what: str) -> list[dict[str, Any]]:
        todo = [j for j in jobs if _key(*j) not in done]
        with Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar, open(log_path, "a") as log:
            task = bar.add_task(what, total=len(todo))
            for training, seed, point in todo:
                row = _run(training, seed, point, settings)
                done[_key(training, seed, point)] = row
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.advance(task)
        return [done[_key(*j)] for j in jobs]

    tuning = run_jobs([(t, s, p) for s in settings.tuning_seeds for t in trainings for p in grid_for(t, settings.grid)],
                      "tuning")
    result = NiraHeadResult(out_dir=out_dir)
    result.choices = {m.name: _choose(tuning, m) for m in methods}
    jobs = sorted({(m.training, s, tuple(result.choices[m.name]["point"])) for m in methods for s in settings.seeds})
    reported = run_jobs([(t, s, (float(p[0]), int(p[1]))) for t, s, p in jobs], "reported seeds")
    by_key = {_key(r["training"], r["seed"], r["point"]): r for r in reported}

    def scores(m: Method) -> list[dict[str, float]]:
        ch = result.choices[m.name]
        return [_score(by_key[_key(m.training, s, ch["point"])], m, ch["fine_tune_steps"]) for s in settings.seeds]

    for m in methods:
        vals = scores(m)
        rows_m = [by_key[_key(m.training, s, result.choices[m.name]["point"])] for s in settings.seeds]
        eps: dict[str, float] = {}
        for r in rows_m:
            for c, e in r.get("epsilon", {}).items():
                eps[c] = max(eps.get(c, 0.0), e)
        result.summary.append({"method": m.name, "label": m.label, "seeds": len(vals), "epsilon": eps,
                               **{k: mean_and_sd([v[k] for v in vals]) for k in METRICS}})
    best = max(baselines, key=lambda m: result.choices[m.name]["tuning_macro"]) if baselines else None
    if best is not None:
        base = scores(best)
        result.diagnostics["best_baseline"] = best.name
        for m in methods:
            if m.name == best.name:
                continue
            mine = scores(m)
            cr = [(a["cr_en"], b["cr_en"]) for a, b in zip(mine, base)
                  if not (math.isnan(a["cr_en"]) or math.isnan(b["cr_en"]))]
            result.comparisons.append({"method": m.name, "against": best.name,
                                       "macro": paired_interval([a["macro"] for a in mine], [b["macro"] for b in base]),
                                       "cr_en": paired_interval([a for a, _ in cr], [b for _, b in cr]) if cr
                                       else {"n": 0, "mean": math.nan, "low": math.nan, "high": math.nan}})
    result.references = [_reference(s, settings) for s in settings.seeds]
    result.diagnostics["snr"] = _diagnostics(reported)
    result.elapsed_s = time.monotonic() - t0
    (out_dir / "nira-head.md").write_text(markdown_tables(result, settings))
    payload = {"settings": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                            for k, v in asdict(settings).items()},
               "choices": result.choices, "summary": result.summary, "comparisons": result.comparisons,
               "references": result.references, "diagnostics": result.diagnostics, "elapsed_s": result.elapsed_s}
    (out_dir / "nira-head.json").write_text(json.dumps(payload, indent=1, default=str))
    _plot(result, out_dir / "nira-head.png")
    return result
