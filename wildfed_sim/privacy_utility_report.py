"""The privacy-utility experiment's report (:mod:`wildfed_sim.privacy_utility`): its markdown tables (accuracy per
configuration and IUCN category, the epsilon of what ran, the chosen grid points, the paired comparisons and the
mixture prediction) and its plot of each category's accuracy against that category's epsilon.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from shared.iucn import IUCNCategory

from wildfed_sim.privacy_utility_configs import PrivacyUtilityResult, PrivacyUtilitySettings

__all__ = ["markdown_tables", "plot_accuracy_by_epsilon"]


def _pct(ms: tuple[float, float]) -> str:
    return "n/a" if math.isnan(ms[0]) else f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"


def markdown_tables(result: PrivacyUtilityResult, settings: PrivacyUtilitySettings) -> str:
    """The report: accuracy per configuration (mean ± std over the reported seeds), the epsilon per IUCN category
    of what ran, the chosen grid points and the paired comparisons with 95 % intervals (percentage points; with one
    reported seed there is no interval and the std is 0)."""
    cats = [c.value for c in IUCNCategory]
    seeds, tuning = ", ".join(map(str, settings.seeds)), ", ".join(map(str, settings.tuning_seeds))
    lines = [f"Reported seeds {seeds}; tuned on {tuning}"
             f" (grid {settings.grid}); {settings.sites} sites, B = {settings.expected_batch_size}, server momentum "
             f"{settings.server_momentum:g}, delta {settings.target_delta:g}. Round 0 (zero head): overall "
             f"{100 * result.round0.get('overall', math.nan):.1f} %. Accuracy in %, mean ± std over seeds"
             + (f", of the model as served: post-hoc logit adjustment tau {settings.prediction_tau:g} with the prior "
                "from the sites' public metadata (each run's unadjusted accuracy is in the json)."
                if settings.prediction_tau > 0 else ", of the model as trained (no logit adjustment)."), "",
             "| configuration | overall | CR/EN | " + " | ".join(cats) + " | rounds, steps, C, lr, momentum |",
             "|---" + "|---:" * (3 + len(cats)) + "|"]
    for e in result.summary:
        point = result.chosen.get(e["configuration"], {}).get("point")
        shown = "" if not point else ", ".join(
            "-" if (k == 2 and not e["epsilon"]) else f"{p:g}" for k, p in enumerate(point))  # no clipping: no C
        lines.append(f"| {e['label']} | {_pct(e['overall'])} | {_pct(e['CR/EN'])} | "
                     + " | ".join(_pct(tuple(e["by_category"][c])) for c in cats) + f" | {shown} |")
    if result.site_records:
        lines += ["", "Records per IUCN category held by the sites (all sites together), per reported seed: "
                  + "; ".join(f"seed {s}: " + ", ".join(f"{c} {n}" for c, n in counts.items())
                              for s, counts in result.site_records.items()) + "."]
    lines += ["", "Epsilon per IUCN category of the mechanism that ran (max over sites and seeds; budget in "
              "brackets):", "", "| configuration | " + " | ".join(cats) + " |", "|---" + "|---:" * len(cats) + "|"]
    for e in result.summary:
        if not e["epsilon"]:
            continue
        lines.append(f"| {e['label']} | " + " | ".join(
            f"{e['epsilon'][c]:.3f} ({e['budget'].get(c, math.nan):.3f})" if c in e["budget"] else "-"
            for c in cats) + " |")
    lines += ["", "Paired differences a - b over the reported seeds (percentage points; 95 % Student-t interval):",
              "", "| a - b | what | overall | CR/EN |", "|---|---|---:|---:|"]
    for comp in result.comparisons:
        cells = []
        for group in ("overall", "CR/EN"):
            ci = comp[group]
            interval = (f"[{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]" if ci["n"] > 1
                        else "(one seed: no interval)")
            cells.append(f"{100 * ci['mean']:+.1f} {interval}")
        lines.append(f"| {comp['a']} - {comp['b']} | {comp['what']} | {cells[0]} | {cells[1]} |")
    mix = result.mixture
    if mix:
        def ci(d: Mapping[str, float]) -> str:
            tail = f" [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" if d["n"] > 1 else ""
            return f"{100 * d['mean']:+.1f}{tail}"
        lines += ["", "Mixture prediction: CCDP gamma 1 against, for each category, uniform DP at that category's "
                  f"budget (paired over seeds {', '.join(map(str, mix['seeds']))}; predicted overall "
                  f"{100 * mix['predicted_overall']:.1f} %, measured {100 * mix['actual_overall']:.1f} %, "
                  f"difference {ci(mix['overall'])} points):", "",
                  "| category | uniform reference | CCDP g1 - reference on the category |", "|---|---|---:|"]
        for c, d in mix["by_category"].items():
            lines.append(f"| {c} | {d['reference']} | {ci(d)} |")
    return "\n".join(lines) + "\n"


def plot_accuracy_by_epsilon(result: PrivacyUtilityResult, path: Path) -> None:
    """Accuracy of each IUCN category against that category's epsilon: one colour per DP configuration (a line
    through its categories where the budgets differ), one marker per category; the ceiling and round 0 dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    markers = {"CR": "v", "EN": "s", "VU": "D", "NT": "^", "LC": "o", "NE": "P"}
    fig, ax = plt.subplots(figsize=(10, 6))
    shown_configs = [e for e in result.summary if e["epsilon"]]
    # one colour per configuration: the default cycle repeats after 10, so more need tab20's 20
    colours = (plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(shown_configs) <= 10
               else [plt.get_cmap("tab20")(i) for i in range(20)])
    handles = []
    for k, e in enumerate(shown_configs):
        colour = colours[k % len(colours)]
        shown = [c for c in markers if c in e["epsilon"] and not math.isnan(e["by_category"][c][0])]
        xs, ys = [e["epsilon"][c] for c in shown], [100 * e["by_category"][c][0] for c in shown]
        if len(set(round(x, 2) for x in xs)) > 1:  # per-category budgets: a line through the categories
            ax.plot(xs, ys, color=colour, linewidth=1, alpha=0.7)
        for c, x, y in zip(shown, xs, ys):
            ax.scatter([x], [y], color=colour, marker=markers[c], s=36, zorder=3)
        handles.append(Line2D([], [], color=colour, marker="o", linewidth=1, label=e["label"]))
    for e in result.summary:
        if not e["epsilon"]:
            ax.axhline(100 * e["overall"][0], color="black", linestyle=":", linewidth=1)
            handles.append(Line2D([], [], color="black", linestyle=":",
                                  label=f"no privacy, overall {100 * e['overall'][0]:.1f} %"))
    if "overall" in result.round0:
        ax.axhline(100 * result.round0["overall"], color="grey", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="grey", linestyle="--", label="round 0 (zero head), overall"))
    handles += [Line2D([], [], color="black", marker=m, linestyle="", label=c) for c, m in markers.items()]
    ax.set_xscale("log")
    ax.set_xlabel("epsilon of the category's records (max over sites; log scale)")
    ax.set_ylabel("held-out accuracy of the category (%)")
    ax.set_title("Accuracy per IUCN category against its epsilon (mean over the reported seeds)")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
