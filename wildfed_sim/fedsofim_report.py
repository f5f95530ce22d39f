"""The DP-FedSOFIM experiment's summaries and outputs (:mod:`wildfed_sim.fedsofim`).

A cell's summary over its reported seeds (:func:`summarise_cell`: final and last-10 accuracy, rounds to reach
DP-FedGD's final accuracy, paired differences against :data:`BASELINE`), the Markdown tables
(:func:`markdown_tables`), the plot, and ``fedsofim.json`` / ``.md`` / ``.png`` (:func:`write_outputs`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from wildfed_sim.common.stats import mean_std, paired_interval
from wildfed_sim.fedsofim_head import CEILING, OPTIMIZERS, step_size
from wildfed_sim.fedsofim_settings import FedSofimResult, FedSofimSettings
from wildfed_sim.fedsofim_tuning import GRIDS

BASELINE = "dp-fedavgm"
"""The baseline every paired difference is taken against (the strongest fair baseline, docs/fedsofim.md)."""
LABELS = {"dp-fedgd": "DP-FedGD", "dp-fedavgm": "DP-FedAvgM", "dp-fedadam": "DP-FedAdam",
          "dp-fedsofim": "DP-FedSOFIM (G)", "dp-fedsofim-m": "DP-FedSOFIM (M)", CEILING: "non-private FedGD"}


# ------------------------------------------------------------------------------------------------ metrics
def rounds_to_reach(curve: Sequence[float], target: float) -> int | None:
    """The first round r (index into ``curve``, round 0 = initial model) with ``curve[r] >= target``; None if
    never."""
    for r, v in enumerate(curve):
        if v >= target:
            return r
    return None


def last10_mean(curve: Sequence[float]) -> float:
    return float(np.mean(curve[-10:]))


def summarise_cell(runs: Sequence[Mapping[str, Any]], tuning: Mapping[str, Any], methods: Sequence[str],
                   baseline: str = BASELINE) -> dict[str, Any]:
    """One (K, eps) cell's summary over its reported seeds.

    Args:
        runs: rows ``{"seed", "optimizer", "test": curve, "momentum_sq": [...] or None, ...}`` of one cell.
        tuning: :func:`tune_grids`' result for the cell (``{method: {"best", "tried", ...}}``).
        methods: the optimizers, in table order. baseline: the method paired differences are taken against.

    Returns:
        ``{method: {"final", "last10" (mean_std), "rounds_to_gd_final" (mean_std of the reached ones),
        "not_reached", "hp", "eta", "grid_spread", "seed_std_last10", "momentum_sq" (median over rounds and
        seeds, and at round T), "paired_final", "paired_last10" (paired_interval vs baseline; None for the
        baseline itself)}, "round0": mean test accuracy of the zero head}``.
    """
    by = {(r["optimizer"], r["seed"]): r for r in runs}
    seeds = sorted({s for _, s in by})
    out: dict[str, Any] = {"round0": mean_std([by[(methods[0], s)]["test"][0] for s in seeds
                                               if (methods[0], s) in by])}
    for m in methods:
        curves = {s: by[(m, s)]["test"] for s in seeds if (m, s) in by}
        entry: dict[str, Any] = {"final": mean_std([c[-1] for c in curves.values()]),
                                 "last10": mean_std([last10_mean(c) for c in curves.values()])}
        if "dp-fedgd" in methods:
            reached = [rounds_to_reach(c, by[("dp-fedgd", s)]["test"][-1]) for s, c in curves.items()
                       if ("dp-fedgd", s) in by]
            entry["rounds_to_gd_final"] = mean_std(reached)
            entry["not_reached"] = sum(r is None for r in reached)
        t = tuning.get(m, {})
        if t:
            entry["hp"] = t["best"]
            entry["eta"] = step_size(m, t["best"])
            finite = [x["score"] for x in t["tried"] if not math.isnan(x["score"])]
            entry["grid_spread"] = max(finite) - min(finite) if finite else None
            entry["widened"] = t["widened"]
            entry["on_edge"] = t["on_edge"]
            entry["points"] = len(t["tried"])
        entry["seed_std_last10"] = entry["last10"]["std"]
        msq = [by[(m, s)].get("momentum_sq") for s in curves]
        if msq and all(x for x in msq):
            entry["momentum_sq"] = {"median": float(np.median(np.concatenate(msq))),
                                    "final": float(np.mean([x[-1] for x in msq]))}
        if m != baseline and all((baseline, s) in by for s in curves) and len(curves) >= 1:
            base = {s: by[(baseline, s)]["test"] for s in curves}
            entry["paired_final"] = paired_interval([c[-1] for c in curves.values()],
                                                    [base[s][-1] for s in curves])
            entry["paired_last10"] = paired_interval([last10_mean(c) for c in curves.values()],
                                                     [last10_mean(base[s]) for s in curves])
        out[m] = entry
    return out


def format_pct(stat: Mapping[str, Any] | None) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    return f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}"


def _ci(iv: Mapping[str, Any] | None) -> str:
    if not iv:
        return "-"
    if not math.isfinite(iv["low"]):
        return f"{100 * iv['mean']:+.1f} (one seed)"
    return f"{100 * iv['mean']:+.1f} [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}]"


def _hp(m: str, e: Mapping[str, Any]) -> str:
    hp = e.get("hp")
    if not hp:
        return "-"
    eta = f"eta {e['eta']:.3g}"
    extra = {"dp-fedavgm": f", mu {hp.get('momentum', 0):g}", "dp-fedadam": f", tau {hp.get('tau', 0):g}",
             "dp-fedsofim": f", rho {hp.get('rho', 0):g}", "dp-fedsofim-m": f", rho {hp.get('rho', 0):g}"}
    notes = []
    if e.get("widened"):
        notes.append("widened " + ", ".join(f"{w['axis']} {w['edge']}" for w in e["widened"]))
    if e.get("on_edge"):
        notes.append("edge: " + ", ".join(e["on_edge"]))
    return eta + extra.get(m, "") + (f" ({'; '.join(notes)})" if notes else "")


def markdown_tables(cells: Sequence[Mapping[str, Any]], methods: Sequence[str],
                    ceiling: Mapping[str, Any] | None) -> str:
    """The experiment's tables (GitHub Markdown): accuracy, paired differences vs the baseline, hyper-parameters,
    rounds to reach DP-FedGD's final accuracy, and ``|M|^2`` vs rho with the grid's spread vs the seed spread.

    Args:
        cells: ``{"clients", "epsilon", "noise_multiplier", "spent_epsilon", "summary": summarise_cell(...)}``.
        methods: the optimizers in column order. ceiling: the non-private ceiling's summary entry (or None).
    """
    ceil = format_pct(ceiling["last10"]) if ceiling else "-"
    lab = [LABELS[m] for m in methods]
    out = ["**Accuracy** (test, %, mean ± sample std over the reported seeds; each cell: last-10-round mean / "
           "final round)\n", "| K | eps (target / ledger) | z | round 0 | " + " | ".join(lab)
           + " | non-private (last-10) |", "|" + "---|" * (5 + len(methods))]
    for c in cells:
        s = c["summary"]
        spent = f"{c['spent_epsilon']:.3f}" if c.get("spent_epsilon") is not None else "-"
        out.append(f"| {c['clients']} | {c['epsilon']:g} / {spent} | {c['noise_multiplier']:.2f} | "
                   f"{format_pct(s['round0'])} | " + " | ".join(f"{format_pct(s[m]['last10'])} / {format_pct(s[m]['final'])}"
                                                          for m in methods) + f" | {ceil} |")
    others = [m for m in methods if m != BASELINE]
    out += ["", f"**Paired difference against {LABELS[BASELINE]}** (points, mean [95 % t-interval] over the "
            "reported seeds; last-10-round mean, then final round)\n",
            "| K | eps | " + " | ".join(f"{LABELS[m]} last-10" for m in others) + " | "
            + " | ".join(f"{LABELS[m]} final" for m in others) + " |", "|" + "---|" * (2 + 2 * len(others))]
    for c in cells:
        s = c["summary"]
        out.append(f"| {c['clients']} | {c['epsilon']:g} | "
                   + " | ".join(_ci(s[m].get("paired_last10")) for m in others) + " | "
                   + " | ".join(_ci(s[m].get("paired_final")) for m in others) + " |")
    out += ["", "**Chosen hyper-parameters** (tuning seeds, validation last-10 mean; eta = the optimizer's own "
            "step size; widenings and points still on an edge in brackets)\n",
            "| K | eps | " + " | ".join(lab) + " |", "|" + "---|" * (2 + len(methods))]
    for c in cells:
        s = c["summary"]
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(_hp(m, s[m]) for m in methods) + " |")
    out += ["", "**Rounds to reach DP-FedGD's final accuracy** (same seed; mean ± std over the seeds that reach it, "
            "and how many never do)\n", "| K | eps | " + " | ".join(lab) + " |", "|" + "---|" * (2 + len(methods))]
    for c in cells:
        s = c["summary"]
        row = []
        for m in methods:
            r = s[m].get("rounds_to_gd_final")
            txt = "-" if not r or r["mean"] is None else f"{r['mean']:.1f} ± {r['std']:.1f}"
            row.append(txt + (f" ({s[m]['not_reached']} never)" if s[m].get("not_reached") else ""))
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(row) + " |")
    sofims = [m for m in methods if m.startswith("dp-fedsofim")]
    out += ["", "**Does the preconditioner act? Does the protocol discriminate?** |M|^2: median over rounds and "
            "seeds / at round T, at the chosen point, against its rho; spread: best minus worst grid point on "
            "validation (points) against the seed-to-seed std of the reported last-10 accuracy (points)\n",
            "| K | eps | " + " | ".join(f"{LABELS[m]} |M|^2 (rho)" for m in sofims) + " | "
            + " | ".join(f"{LABELS[m]} spread / seed std" for m in methods) + " |",
            "|" + "---|" * (2 + len(sofims) + len(methods))]
    for c in cells:
        s = c["summary"]
        msq = []
        for m in sofims:
            q = s[m].get("momentum_sq")
            msq.append("-" if not q else f"{q['median']:.2g} / {q['final']:.2g} ({s[m]['hp']['rho']:g})")
        spread = []
        for m in methods:
            g, sd = s[m].get("grid_spread"), s[m].get("seed_std_last10")
            spread.append("-" if g is None or sd is None else f"{100 * g:.1f} / {100 * sd:.1f}")
        out.append(f"| {c['clients']} | {c['epsilon']:g} | " + " | ".join(msq + spread) + " |")
    return "\n".join(out) + "\n"


def _plot(cells: Sequence[Mapping[str, Any]], methods: Sequence[str], ceiling: Mapping[str, Any] | None,
          path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({c["clients"] for c in cells})
    epss = sorted({c["epsilon"] for c in cells})
    fig, axes = plt.subplots(len(ks), len(epss), figsize=(3.2 * len(epss), 2.9 * len(ks)), squeeze=False,
                             sharey=True)
    colours = dict(zip(OPTIMIZERS, ("tab:blue", "tab:green", "tab:purple", "tab:red", "tab:orange")))
    for c in cells:
        ax = axes[ks.index(c["clients"])][epss.index(c["epsilon"])]
        for m in methods:
            m_curve = np.asarray(c["mean_curves"][m])
            if m_curve.size:
                ax.plot(np.arange(m_curve.size), 100 * m_curve, color=colours.get(m, "k"), lw=1.1, label=LABELS[m])
        if ceiling:
            ax.axhline(100 * ceiling["last10"]["mean"], color="k", ls="--", lw=0.8, label="non-private (last-10)")
        ax.set_title(f"K={c['clients']}, eps={c['epsilon']:g}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("test accuracy %", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _caption(settings: FedSofimSettings, result: FedSofimResult) -> str:
    info = next(iter(result.seeds_info.values()), {})
    pub = statistics.fmean(v["public_model_test_accuracy"] for v in result.seeds_info.values()) \
        if result.seeds_info else math.nan
    return (f"Frozen public EfficientNet-Lite0 embeddings; linear head (d = 12,810) federated from zero over "
            f"{info.get('client_pool', '?')} records in IID shards; {settings.rounds} rounds of full-batch DP "
            f"gradient descent per client (q = 1, clip C = {settings.clipping_norm:g}, z calibrated by RDP for "
            f"{settings.rounds} rounds, delta = {settings.target_delta:g}). Every optimizer tuned separately in "
            f"every cell on tuning seeds {list(settings.tuning_seeds)} by validation accuracy (last-10 mean); "
            f"reported on seeds {list(settings.seeds)} on the held-out test split ({info.get('test', '?')} "
            f"images). Round 0 = the zero head. Non-private = FedGD without noise, tuned the same way. The "
            f"public-data reference head (trained on the {info.get('public', '?')} public images, not a "
            f"federation) scores {100 * pub:.1f} % on the test split. eps ledger = the RDP spend the ledger "
            f"holds for one reported run of the cell (max over its clients).")


def write_outputs(settings: FedSofimSettings, result: FedSofimResult) -> None:
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (result.out_dir / "fedsofim.json").write_text(json.dumps(
        {"settings": settings_json, "grids": {m: [asdict(a) for a in GRIDS[m]] for m in GRIDS},
         "seeds": {str(k): v for k, v in result.seeds_info.items()}, "ceiling": result.ceiling,
         "cells": result.cells, "elapsed_s": result.elapsed_s}, indent=1))
    ceiling = result.ceiling.get("summary", {}).get(CEILING)
    (result.out_dir / "fedsofim.md").write_text(
        "# DP-FedSOFIM (on G and on M) vs DP-FedGD, DP-FedAvgM, DP-FedAdam on Animal-MNIST (frozen public "
        f"backbone, linear head)\n\n{_caption(settings, result)}\n\n"
        + markdown_tables(result.cells, settings.optimizers, ceiling)
        + f"\nWall time: {result.elapsed_s:.0f} s.\n")
    if result.cells:
        _plot(result.cells, settings.optimizers, ceiling, result.out_dir / "fedsofim.png",
              f"Animal-MNIST linear head, test accuracy per round (mean over {len(settings.seeds)} seeds)")
