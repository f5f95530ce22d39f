"""What the demo prints and writes at the end of a run: the summary table, ``report.json``, ``report.png`` and the
web view's commands (:mod:`wildfed_sim.demo` runs the federation)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from shared.iucn import IUCNCategory

from wildfed_sim.demo_links import print_links_summary
from wildfed_sim.demo_settings import DemoResult, DemoSettings, header_label

__all__ = ["epsilon_by_category", "plot", "print_summary", "write_report", "print_web_commands"]


def epsilon_by_category(coordinator: Any) -> dict[str, dict[str, float]]:
    """Per IUCN category: the largest spend over sites (the worst-off record's epsilon) and the budget."""
    out: dict[str, dict[str, float]] = {}
    for row in coordinator.budget_rows():
        entry = out.setdefault(row.category.value, {"spent_max": 0.0, "budget": row.budget, "halted_sites": 0})
        entry["spent_max"] = max(entry["spent_max"], row.spent)
        entry["halted_sites"] += int(row.halted)
    return out


def plot(history: list[dict[str, Any]], budgets: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for group, style in (("overall", "-o"), ("CR/EN", "-s"), ("LC", "-^")):
        ax1.plot(rounds, [100 * h["accuracy"][group] for h in history], style, label=group)
    ax1.set_xlabel("round")
    ax1.set_ylabel("held-out test accuracy (%)")
    ax1.set_title("Accuracy of the global model")
    ax1.grid(alpha=0.3)
    ax1.legend()
    colours = plt.get_cmap("viridis")
    for i, cat in enumerate(c.value for c in IUCNCategory):
        colour = colours(i / 5)
        ax2.plot(rounds, [h["epsilon"].get(cat, {}).get("spent_max", 0.0) for h in history], "-o",
                 color=colour, label=cat)
        if cat in budgets:
            ax2.axhline(budgets[cat], color=colour, linestyle="--", linewidth=0.8)
    ax2.set_xlabel("round")
    ax2.set_ylabel("epsilon spent (max over sites; dashed: budget)")
    ax2.set_title("Privacy ledger (RDP, delta per config)")
    ax2.grid(alpha=0.3)
    ax2.legend(ncol=2, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(settings: DemoSettings, result: DemoResult, budgets: Any, held: set[IUCNCategory],
                   console: Any) -> None:
    """The final table (accuracy and epsilon per IUCN category), the rejections and the gaps between rounds."""
    from rich.table import Table

    table = Table(title=f"WildFed demo: {settings.sites} sites, {len(result.history)} "
                        f"round{'s' * (len(result.history) != 1)}, {header_label(settings)}, "
                        f"strategy {settings.strategy}"
                        + (" (accuracy: each site's own model on the classes it holds, pooled; per-site macro "
                           "accuracy and the clusters are in report.json)" if settings.strategy == "nira" else ""))
    table.add_column("IUCN category")
    table.add_column("test accuracy", justify="right")
    table.add_column("epsilon spent (max over sites)", justify="right")
    table.add_column("budget", justify="right")
    for cat in IUCNCategory:
        e = result.epsilon.get(cat.value, {"spent_max": 0.0, "budget": budgets[cat]})
        spent = (("- (no DP)" if settings.privacy == "none" else f"{e['spent_max']:.3f}") if cat in held
                 else "- (no site holds it)")
        acc = result.final_accuracy.get(cat.value, math.nan)
        table.add_row(cat.value, "n/a" if math.isnan(acc) else f"{100 * acc:.1f}%", spent,
                      f"{budgets[cat]:.2f}" if settings.privacy != "none" else "-")
    for group in ("overall", "CR/EN", "VU/NT"):
        table.add_row(f"[bold]{group}", f"[bold]{100 * result.final_accuracy[group]:.1f}%", "", "")
    if result.final_accuracy_unadjusted:
        table.add_row("overall as trained", f"{100 * result.final_accuracy_unadjusted['overall']:.1f}%", "", "")
    if result.centralised_accuracy:
        table.add_row("centralised (pooled, non-private)", f"{100 * result.centralised_accuracy['overall']:.1f}%",
                      "", "")
    console.print(table)
    if result.final_accuracy_unadjusted:
        console.log(f"accuracy is the served model's: the head's logits less tau log(prior), tau "
                    f"{settings.posthoc_logit_adjustment:g}, the prior from the sites' public metadata (no privacy "
                    f"cost); 'overall as trained' is the same model without it")
    console.log(f"rejected updates by reason: {result.rejections or 'none'}")
    print_links_summary(result.links, console)
    gaps = [h["gap_s"] for h in result.history if h.get("gap_s") is not None]
    if gaps:
        console.log(f"gaps between rounds (from the end of one round until every task of the next is sent, this "
                    f"demo's evaluation of each round included): median {statistics.median(gaps):.2f} s, "
                    f"max {max(gaps):.2f} s")


def write_report(settings: DemoSettings, result: DemoResult, design: Any, specs: Any, budgets: Any, run_dir: Path,
                  console: Any) -> None:
    """``report.json`` (settings, sites, per-round history, final table) and ``report.png`` in the run folder."""
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.__dict__.items()},
        "design": dataclasses.asdict(design),
        "sites": [{"site_id": s.site_id, "biome": s.biome, "num_images": s.num_images,
                   "species": list(s.species_names()), "monitoring_months": s.monitoring_months} for s in specs],
        "history": result.history, "final_accuracy": result.final_accuracy, "epsilon": result.epsilon,
        "centralised_accuracy": result.centralised_accuracy, "rejections": result.rejections,
        "pretraining": result.pretraining, "elapsed_s": result.elapsed_s,
        "strategy": settings.strategy, "per_site": result.per_site, "nira": result.nira,
        "final_accuracy_unadjusted": result.final_accuracy_unadjusted,
        "prediction_offsets": result.prediction_offsets, "final_models": result.final_models,
        "links": result.links,
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, default=float))
    plot(result.history, {c.value: b for c, b in budgets.items()} if settings.privacy != "none" else {},
          run_dir / "report.png", f"WildFed demo, {settings.sites} sites, privacy {settings.privacy}")
    console.log(f"report: {run_dir / 'report.json'}, plot: {run_dir / 'report.png'} "
                f"({result.elapsed_s:.0f} s in all)")


def print_web_commands(coord_dir: Path, console: Any) -> None:
    """The two commands that open this run's web view (one per line, never wrapped, so each copies whole)."""
    import shlex

    coord_yaml = shlex.quote(str(coord_dir / "coordinator.yaml"))
    # the operator's commands of this run are wildfed-coordinator's: the one beside this `wildfed`, when known
    here = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    exe = shlex.quote(str(here.with_name("wildfed-coordinator")) if here is not None and here.name == "wildfed"
                      else "wildfed-coordinator")
    console.log("web view of this run (map of the sites' deployments, budgets, rounds): make an account, serve, "
                "then open http://127.0.0.1:8080/")
    # one command per line, never wrapped, so that each can be copied whole
    console.print(f"{exe} user add me --role operator --config {coord_yaml}", soft_wrap=True, markup=False,
                  highlight=False)
    console.print(f"{exe} serve --config {coord_yaml}", soft_wrap=True, markup=False, highlight=False)
