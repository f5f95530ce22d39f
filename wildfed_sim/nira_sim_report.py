"""The NIRA head experiment's report (:mod:`wildfed_sim.nira_sim`): the Markdown tables (methods, headroom,
paired comparisons, NIRA's diagnostics), the per-training similarity-SNR and noise diagnostics, and the plot.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared.iucn import IUCNCategory

from wildfed_sim.common.stats import mean_and_sd
from wildfed_sim.nira_sim_settings import METRICS, NiraHeadResult, NiraHeadSettings
from wildfed_sim.nira_sim_structures import SERENGETI_SITES


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


def snr_diagnostics(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
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


def plot_summary(result: NiraHeadResult, path: Path) -> None:
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

