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
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from wildfed_sim.common.federation import FederationCache
from wildfed_sim.common.runs import new_run_dir, read_runs
from wildfed_sim.common.stats import mean_and_sd, paired_interval
from wildfed_sim.nira_sim_report import markdown_tables, plot_summary, snr_diagnostics
from wildfed_sim.nira_sim_scoring import fine_tune_head, head_logits, score_sites
from wildfed_sim.nira_sim_settings import (BASELINES, FINE_TUNE_STEPS, GRID, HEAD_ONLY_GRID, METHODS, METRICS,
                                           MIN_CLUSTER_RECORDS, NIRA_GRID, TRAININGS, Method, NiraHeadResult,
                                           NiraHeadSettings, grid_for)
from wildfed_sim.nira_sim_structures import STRUCTURES, real_structure_federation

__all__ = ["Method", "TRAININGS", "METHODS", "BASELINES", "GRID", "NIRA_GRID", "HEAD_ONLY_GRID", "grid_for",
           "FINE_TUNE_STEPS", "MIN_CLUSTER_RECORDS",
           "NiraHeadSettings", "NiraHeadResult", "STRUCTURES", "real_structure_federation", "head_logits",
           "fine_tune_head", "score_sites",
           "run_nira_head_experiment"]


# ------------------------------------------------------------------------------------------ one run
_FEDERATION = FederationCache()  # one federation per worker at a time (memory)


def _all_scorings(fed: Any, site_models: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, float]]:
    out = {"plain": score_sites(fed, site_models, "plain"), "mask": score_sites(fed, site_models, "mask")}
    for steps in FINE_TUNE_STEPS:
        out[f"fine-tune:{steps}"] = score_sites(fed, site_models, "fine-tune", steps)
    return out


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
    result.diagnostics["snr"] = snr_diagnostics(reported)
    result.elapsed_s = time.monotonic() - t0
    (out_dir / "nira-head.md").write_text(markdown_tables(result, settings))
    payload = {"settings": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                            for k, v in asdict(settings).items()},
               "choices": result.choices, "summary": result.summary, "comparisons": result.comparisons,
               "references": result.references, "diagnostics": result.diagnostics, "elapsed_s": result.elapsed_s}
    (out_dir / "nira-head.json").write_text(json.dumps(payload, indent=1, default=str))
    plot_summary(result, out_dir / "nira-head.png")
    return result
