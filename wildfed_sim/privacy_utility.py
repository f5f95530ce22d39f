"""The privacy-utility table (docs/results/privacy-utility.md): per-category budgets against uniform DP, local against
distributed noise, each configuration tuned on its own on seeds that are never reported.

``wildfed experiment privacy-utility`` runs the demo's learning problem (8 non-IID sites on Animal-MNIST, the
frozen ImageNet EfficientNet-Lite0 backbone, a linear head psi trained from zero by the sites; public pretraining
is the backbone only) through the in-process replay of the federation (:mod:`wildfed_sim.demo_sim`: the
gateways' own ``train_locally`` / ``clipped_sum_locally``, the coordinator's round plan, secure-aggregation
quantisation, FedAvg and server SGD; only the transport is left out). One run per configuration and seed:

==================================  ===========================================================================
``none``                            no privacy: the non-private ceiling
``uniform-eps0.33``                 local DP-SGD, every category eps = 1/3 (CR's protection for every record)
``uniform-eps1`` / ``uniform-eps2`` local DP-SGD, every category eps = 1 / 2 (eps 2: CCDP gamma 1's upper end)
``ccdp-g1-sample`` / ``-scale``     local CCDP gamma 1 (VU = 1: CR 0.33, EN 0.67, VU 1, NT 1.33, LC 1.67, NE 2),
                                    individualized DP-SGD "Sample" / "Scale" (Boenisch et al., NeurIPS 2023)
``ccdp-g2-sample`` / ``-scale``     gamma 2 (CR 0.11, EN 0.44, VU 1, NT 1.78, LC 2.78, NE 4)
``global-ccdp-g1-trusted``          Global DP (secure aggregation, one step per round), CCDP gamma 1, the
                                    coordinator adds the noise (trusted server)
``global-ccdp-g1-distributed``      the same, each site adds its Skellam share before masking
``global-uniform-eps0.33-dist.``    distributed Global DP, uniform eps = 1/3 (the fair rival there)
==================================  ===========================================================================

Protocol (a reviewer's, README "Privacy-utility"):

1. **Tuning.** Stage 1: every configuration gets the same grid (:data:`DP_GRID`: learning rate x {local steps,
   clipping norm, rounds}, 25 points; Global DP runs one step per round, so its grid swaps local steps for more clipping
   norms; the non-private run has :data:`NON_PRIVATE_GRID`, 25 points without clipping) on the tuning seeds
   (default 101 and 103: their own split, site design and noise). The point with the best mean overall accuracy
   is kept for that configuration. Stage 2: the server momentum (:data:`MOMENTA`; stage 1 runs at the fixed 0.5)
   at that point, and the best of all of the configuration's points is kept. The tuning seeds are never
   reported.
2. **Reporting.** Each configuration's chosen point runs on the reported seeds (default 0-4). A seed fixes the
   data split, the site design, the initial model and the noise, so two configurations of one seed are paired.
3. **Statistics.** Mean and sample std over seeds per configuration; for each comparison
   (:data:`COMPARISONS`) the paired differences, their mean and the 95 % Student-t interval (n - 1 degrees of
   freedom). Round-0 accuracy (the zero head: every logit equal) and the non-private ceiling are in the table.
4. **Epsilon.** Per IUCN category, the epsilon of the mechanism its records went through: each site's events
   (what the ledger charges: ``DPSGDEvent(sigma/C_c, q_c, steps)`` locally, ``DPSGDEvent(z, q_kc, rounds)`` for
   trusted Global DP, the Skellam event for distributed), composed by dp-accounting's RDP accountant
   (:func:`shared.privacy.accounting.epsilon_spent`), the maximum over sites.

Outputs (``--out``): ``privacy_utility.json`` (settings, every tuning and reported run, the chosen points, the
summary and the comparisons), ``privacy_utility.md`` (the tables), ``privacy_utility.png`` (accuracy per IUCN
category against that category's epsilon, one line per configuration, the ceiling and round 0 as references) and
``runs.jsonl`` (every run as it finished: an interrupted experiment resumes from it).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from functools import lru_cache
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from wildfed_sim.common.federation import FederationCache
from wildfed_sim.common.runs import new_run_dir, read_runs
from wildfed_sim.common.stats import mean_and_sd, paired_interval
from wildfed_sim.privacy_utility_configs import (COMPARISONS, CONFIGURATIONS, DP_GRID, GLOBAL_GRID,
                                                 MIXTURE_REFERENCE, MOMENTA, NON_PRIVATE_GRID, Configuration,
                                                 PrivacyUtilityResult, PrivacyUtilitySettings, grid_for)
from wildfed_sim.privacy_utility_report import markdown_tables, plot_accuracy_by_epsilon

__all__ = ["Configuration", "CONFIGURATIONS", "COMPARISONS", "DP_GRID", "GLOBAL_GRID", "NON_PRIVATE_GRID",
           "PrivacyUtilitySettings", "PrivacyUtilityResult", "run_privacy_utility", "mixture_prediction",
           "MIXTURE_REFERENCE", "epsilon_by_category", "choose", "markdown_tables"]


def epsilon_by_category(events: Mapping[str, Mapping[IUCNCategory, Any]], target_delta: float
                        ) -> dict[str, float]:
    """``{category code: epsilon}``: for each category the largest over sites of the epsilon of the events its
    records went through (dp-accounting's RDP accountant via :func:`shared.privacy.accounting.epsilon_spent`)."""
    out: dict[str, float] = {}
    for per_site in events.values():
        for cat, event in per_site.items():
            eps = _event_epsilon(event, float(target_delta))
            out[cat.value] = max(out.get(cat.value, 0.0), eps)
    return out


@lru_cache(maxsize=4096)
def _event_epsilon(event: Any, target_delta: float) -> float:
    """:func:`shared.privacy.accounting.epsilon_spent` of one (hashable, immutable) event: sites and runs of one
    configuration share most events, and each costs a full RDP composition."""
    from shared.privacy.accounting import epsilon_spent

    return epsilon_spent([event], target_delta=target_delta)


def mixture_prediction(runs: Sequence[dict[str, Any]], test_weights: Mapping[str, Mapping[str, float]],
                       ccdp: str = "ccdp-g1-sample") -> dict[str, Any] | None:
    """Does CCDP give each category the accuracy that its budget buys under uniform DP? For every reported seed
    with a run of ``ccdp`` and of every configuration of :data:`MIXTURE_REFERENCE`, the *predicted* accuracy of
    category c is the accuracy on c of the uniform run at c's budget (same seed, so paired), and the predicted
    overall accuracy is ``sum_c w_c acc_c`` with ``w_c`` the fraction of the seed's held-out records in c.

    Args:
        runs: reported runs (rows of :func:`_run`). test_weights: ``{seed (str): {category code: w_c}}``.
        ccdp: the configuration predicted.

    Returns:
        None when no seed has every run; else ``{"seeds": [...], "overall": paired_interval(actual, predicted),
        "predicted_overall": mean, "by_category": {code: paired_interval(ccdp on c, reference on c)}}``
        (fractions).
    """
    by = {(r["configuration"], r["seed"]): r for r in runs}
    seeds = sorted(s for (c, s) in by if c == ccdp
                   and all((ref, s) in by for ref in MIXTURE_REFERENCE.values()) and str(s) in test_weights)
    if not seeds:
        return None
    actual, predicted = [], []
    for s in seeds:
        w = test_weights[str(s)]
        actual.append(by[(ccdp, s)]["groups"]["overall"])
        predicted.append(sum(w.get(c, 0.0) * by[(ref, s)]["by_category"][c]
                             for c, ref in MIXTURE_REFERENCE.items() if w.get(c, 0.0) > 0))
    cats = {}
    for c, ref in MIXTURE_REFERENCE.items():
        pairs = [(by[(ccdp, s)]["by_category"][c], by[(ref, s)]["by_category"][c]) for s in seeds]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None and not (math.isnan(a) or math.isnan(b))]
        if pairs:
            cats[c] = {"reference": ref, **paired_interval([a for a, _ in pairs], [b for _, b in pairs])}
    return {"seeds": seeds, "overall": paired_interval(actual, predicted),
            "predicted_overall": statistics.fmean(predicted), "actual_overall": statistics.fmean(actual),
            "by_category": cats}


def choose(tuning: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The grid point of configuration ``name`` with the best mean overall accuracy over the tuning seeds (ties:
    the first in grid order). Raises ValueError when it has no tuning run."""
    rows = [r for r in tuning if r["configuration"] == name]
    if not rows:
        raise ValueError(f"no tuning run of {name}")
    points: dict[tuple, list[float]] = {}
    for r in rows:
        points.setdefault(tuple(r["point"]), []).append(r["overall"])
    best = max(points, key=lambda p: statistics.fmean(points[p]))
    return {"point": list(best), "tuning_mean": statistics.fmean(points[best]), "tuning_runs": len(points[best]),
            "grid_points": len(points)}


# ------------------------------------------------------------------------------------------ one run
_FEDERATIONS = FederationCache()  # one federation per worker at a time (memory)


def _run(job: tuple[str, int, tuple[int, int, float, float], dict[str, Any]]) -> dict[str, Any]:
    """One simulated federation (worker process): ``(configuration name, seed, point, fixed settings)``."""
    from wildfed_sim.demo_sim import SimConfig, load_federation, simulate

    name, seed, (rounds, steps, clip, lr, momentum), fixed = job
    warnings.simplefilter("ignore")
    config = next(c for c in CONFIGURATIONS if c.name == name)
    fed = _FEDERATIONS.get((seed, fixed["sites"]), lambda: load_federation(seed, num_sites=fixed["sites"]))
    privacy = "none" if config.privacy == "none" else config.privacy
    sim = SimConfig(privacy=privacy, budgets=config.budgets(), rounds=rounds, local_steps=steps,
                    expected_batch_size=fixed["expected_batch_size"] if privacy != "none" else 128,
                    learning_rate=lr, clipping_norm=clip, target_delta=fixed["target_delta"],
                    server_momentum=momentum, ccdp_variant=config.variant,
                    global_noise=config.global_noise, secagg_threshold=config.threshold(fixed["sites"]),
                    class_reweighting=config.class_reweighting, prediction_tau=fixed.get("prediction_tau", 0.0))
    t0 = time.monotonic()
    out = simulate(fed, sim, seed=seed)
    eps = epsilon_by_category(out.get("events", {}), fixed["target_delta"]) if privacy != "none" else {}
    return {"configuration": name, "seed": seed, "point": [rounds, steps, clip, lr, momentum],
            "overall": out["final"]["overall"], "groups": out["final"], "by_category": out["final_by_category"],
            "overall_unadjusted": out["final_unadjusted"]["overall"], "groups_unadjusted": out["final_unadjusted"],
            "prediction_tau": fixed.get("prediction_tau", 0.0),
            "round0": out["round0"]["overall"], "epsilon": eps,
            "budget": {c.value: e for c, e in config.budgets().items()} if privacy != "none" else {},
            "events": {site: {c.value: ev.to_json() for c, ev in evs.items()}
                       for site, evs in out.get("events", {}).items()},
            "seconds": time.monotonic() - t0}


def _job_key(name: str, seed: int, point: Sequence[float]) -> str:
    return json.dumps([name, seed, [float(p) for p in point]])


def _with_momentum(point: Sequence[float], momentum: float) -> tuple[float, ...]:
    """A grid point (rounds, local steps, C, lr) with its server momentum appended; a point that has one already
    (a run of the momentum stage, or a row of runs.jsonl) is returned unchanged."""
    return tuple(point) if len(point) == 5 else (*point, float(momentum))


def _run_all(jobs: list[tuple], done: dict[str, dict[str, Any]], log_path: Path, processes: int,
             console: Any, what: str) -> list[dict[str, Any]]:
    """Run the jobs not in ``done`` (resuming from ``runs.jsonl``), with a progress bar; returns every job's row."""
    from multiprocessing import get_context

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    todo = [j for j in jobs if _job_key(j[0], j[1], j[2]) not in done]
    if todo:
        with Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar, open(log_path, "a") as log, \
                ExitStack() as stack:
            task = bar.add_task(what, total=len(todo))
            if processes == 1:  # in this process: no worker start-up, the loaded federations are kept
                rows = map(_run, todo)
            else:  # "spawn": workers must not inherit torch's threads or the parent's open files
                rows = stack.enter_context(get_context("spawn").Pool(processes)).imap_unordered(_run, todo)
            for row in rows:
                done[_job_key(row["configuration"], row["seed"], row["point"])] = row
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.advance(task)
    return [done[_job_key(j[0], j[1], j[2])] for j in jobs]


# ------------------------------------------------------------------------------------------ tables and plot
def _summarise(runs: Sequence[dict[str, Any]], configs: Sequence[Configuration]) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        rows = [r for r in runs if r["configuration"] == config.name]
        entry: dict[str, Any] = {"configuration": config.name, "label": config.label, "seeds": len(rows)}
        for group in ("overall", "CR/EN"):
            entry[group] = mean_and_sd([r["groups"][group] for r in rows])
        entry["by_category"] = {c.value: mean_and_sd([r["by_category"][c.value] for r in rows]) for c in IUCNCategory}
        entry["epsilon"] = {c.value: max((r["epsilon"].get(c.value, 0.0) for r in rows), default=0.0)
                            for c in IUCNCategory} if config.privacy != "none" else {}
        entry["budget"] = rows[0]["budget"] if rows else {}
        out.append(entry)
    return out


def _site_records(settings: PrivacyUtilitySettings) -> dict[str, dict[str, int]]:
    """``{seed: {category: records held by all sites}}`` of the reported seeds: a category no site holds cannot
    be learned by any configuration (its ceiling is the non-private row's)."""
    import numpy as np

    from wildfed_sim.demo_sim import load_federation

    out = {}
    for seed in settings.seeds:
        warnings.simplefilter("ignore")
        fed = _FEDERATIONS.held((seed, settings.sites)) or load_federation(seed, num_sites=settings.sites)
        ranks = np.concatenate([s.categories for s in fed.sites]).astype(np.int64)
        out[str(seed)] = {c.value: int((ranks == c.rank).sum()) for c in IUCNCategory}
    return out


def _test_weights(settings: PrivacyUtilitySettings) -> dict[str, dict[str, float]]:
    """``{seed: {category: fraction of the held-out records}}`` of the reported seeds (the weights of
    :func:`mixture_prediction`)."""
    import numpy as np

    from wildfed_sim.demo_sim import load_federation

    out = {}
    for seed in settings.seeds:
        warnings.simplefilter("ignore")
        fed = _FEDERATIONS.held((seed, settings.sites)) or load_federation(seed, num_sites=settings.sites)
        ranks = np.asarray([fed.class_categories[int(y)].rank for y in fed.test_labels], dtype=np.int64)
        out[str(seed)] = {c.value: float((ranks == c.rank).mean()) for c in IUCNCategory}
    return out


# ------------------------------------------------------------------------------------------ the experiment
def run_privacy_utility(settings: PrivacyUtilitySettings, *, console: Any = None) -> PrivacyUtilityResult:
    """Tune every configuration on the tuning seeds, run its chosen point on the reported seeds, and write the
    tables, the plot and every run (module docstring). Resumes from ``<out>/runs.jsonl`` when it exists.

    Raises:
        ConfigError: from the settings or a run's configuration.
    """
    from rich.console import Console


    console = console or Console()
    t0 = time.monotonic()
    resume = settings.out_dir is not None and (Path(settings.out_dir) / "runs.jsonl").is_file()
    out_dir = Path(settings.out_dir).resolve() if resume else new_run_dir(settings.out_dir, "privacy-utility")
    log_path = out_dir / "runs.jsonl"
    done: dict[str, dict[str, Any]] = {}
    for row in read_runs(log_path):
        if float(row.get("prediction_tau", 0.0)) != settings.prediction_tau:
            raise ConfigError(f"{log_path} holds runs evaluated with logit adjustment tau "
                              f"{row.get('prediction_tau', 0.0)}, not {settings.prediction_tau}",
                              field="prediction_tau", fix="resume with the same --posthoc-logit-adjustment, or use a new --out")
        # rows written before the momentum stage ran at the fixed momentum
        row["point"] = list(_with_momentum(row["point"], settings.server_momentum))
        done[_job_key(row["configuration"], row["seed"], row["point"])] = row
    configs = [c for c in CONFIGURATIONS if c.name in settings.configurations]
    fixed = {"sites": settings.sites, "expected_batch_size": settings.expected_batch_size,
             "target_delta": settings.target_delta, "server_momentum": settings.server_momentum,
             "prediction_tau": settings.prediction_tau}
    result = PrivacyUtilityResult(out_dir=out_dir)
    m0 = settings.server_momentum
    jobs = [(c.name, s, _with_momentum(p, m0), fixed) for s in settings.tuning_seeds for c in configs
            for p in grid_for(c, settings.grid)]
    result.tuning = _run_all(jobs, done, log_path, settings.processes, console, "tuning")
    result.chosen = {c.name: choose(result.tuning, c.name) for c in configs}
    if settings.grid == "full":  # stage 2: the server momentum at each configuration's chosen point
        jobs = [(c.name, s, (*result.chosen[c.name]["point"][:4], m), fixed) for s in settings.tuning_seeds
                for c in configs for m in MOMENTA if m != m0]
        result.tuning += _run_all(jobs, done, log_path, settings.processes, console, "tuning: server momentum")
        result.chosen = {c.name: choose(result.tuning, c.name) for c in configs}
    jobs = [(c.name, s, tuple(result.chosen[c.name]["point"]), fixed) for s in settings.seeds for c in configs]
    result.runs = _run_all(jobs, done, log_path, settings.processes, console, "reported seeds")
    result.round0 = {"overall": statistics.fmean(r["round0"] for r in result.runs)}
    result.site_records = _site_records(settings)
    result.summary = _summarise(result.runs, configs)
    if {"ccdp-g1-sample", *MIXTURE_REFERENCE.values()} <= {c.name for c in configs}:
        result.test_weights = _test_weights(settings)
        result.mixture = mixture_prediction(result.runs, result.test_weights)
    names = {c.name for c in configs}
    for a, b, what in COMPARISONS:
        if a in names and b in names:
            ra = {r["seed"]: r for r in result.runs if r["configuration"] == a}
            rb = {r["seed"]: r for r in result.runs if r["configuration"] == b}
            seeds = sorted(ra)
            result.comparisons.append({"a": a, "b": b, "what": what, **{
                g: paired_interval([ra[s]["groups"][g] for s in seeds], [rb[s]["groups"][g] for s in seeds])
                for g in ("overall", "CR/EN")}})
    result.elapsed_s = time.monotonic() - t0
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (out_dir / "privacy_utility.json").write_text(json.dumps(
        {"settings": settings_json, "configurations": [asdict(c) for c in configs], "chosen": result.chosen,
         "round0": result.round0, "site_records": result.site_records, "summary": result.summary,
         "comparisons": result.comparisons, "mixture": result.mixture,
         "runs": result.runs, "tuning": result.tuning, "elapsed_s": result.elapsed_s}, indent=1))
    md = markdown_tables(result, settings)
    (out_dir / "privacy_utility.md").write_text("# Privacy-utility\n\n" + md)
    plot_accuracy_by_epsilon(result, out_dir / "privacy_utility.png")
    console.print(md, soft_wrap=True, markup=False, highlight=False)
    console.log(f"written {out_dir / 'privacy_utility.md'}, .json, .png ({result.elapsed_s:.0f} s)")
    return result

