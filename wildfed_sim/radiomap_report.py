"""The radio-map experiment's summary (:mod:`wildfed_sim.radiomap`): per defence, the final validation MSE and
the attackers' RMSE, mean ± std over seeds, as a Markdown table, and the plot of both per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wildfed_sim.common.stats import mean_std
from wildfed_sim.radiomap_settings import RadioMapSettings


def _overall_rmse(attacks: Sequence[dict[str, Any]], key: str = "errors_m") -> float:
    errors = np.concatenate([np.asarray(a[key]) for a in attacks])
    return float(np.sqrt(np.mean(errors ** 2)))


def summarise(runs: Sequence[dict[str, Any]], settings: RadioMapSettings) -> list[dict[str, Any]]:
    """One entry per defence: final validation MSE (dB) on the held-out tiles and on the other city, attacker RMSE at the last attack round and over all attack
    rounds (metres), the naive baseline, and the ledger's epsilon (max over clients), mean ± std over seeds."""
    out = []
    for defence in settings.defences:
        mine = [r for r in runs if r["defence"] == defence]
        out.append({
            "defence": defence,
            "val_mse_db": mean_std([r["val_mse_db"][-1] for r in mine]),
            "val_other_mse_db": mean_std([r["val_other_mse_db"][-1] if r.get("val_other_mse_db") else None
                                          for r in mine]),
            "rmse_final_m": mean_std([r["attack"][-1]["rmse_m"] if r["attack"] else None for r in mine]),
            "rmse_all_m": mean_std([_overall_rmse(r["attack"]) if r["attack"] else None for r in mine]),
            "naive_rmse_all_m": mean_std([_overall_rmse(r["attack"], "naive_errors_m") if r["attack"] else None
                                          for r in mine]),
            "template_rmse_final_m": mean_std([r["template_attack"][-1]["rmse_m"] if r.get("template_attack")
                                               else None for r in mine]),
            "epsilon": mean_std([r.get("epsilon") for r in mine]),
            "seeds": [r["seed"] for r in mine],
        })
    return out


HEADERS = ["defence", "validation MSE (dB), held-out tiles, final", "validation MSE (dB), other city, final",
           "attacker RMSE (m), final round", "attacker RMSE (m), all rounds",
           "naive RMSE (m)", "template attacker RMSE (m), all uploads", "eps per site (ledger, max)"]


def _fmt(stat: dict[str, Any], digits: int = 2) -> str:
    if stat["mean"] is None:
        return "none"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def table_row(entry: dict[str, Any]) -> list[str]:
    eps = _fmt(entry["epsilon"]) if entry["epsilon"]["n"] else "no guarantee"
    return [entry["defence"], _fmt(entry["val_mse_db"]),
            _fmt(entry.get("val_other_mse_db", {"mean": None})), _fmt(entry["rmse_final_m"], 1),
            _fmt(entry["rmse_all_m"], 1), _fmt(entry["naive_rmse_all_m"], 1),
            _fmt(entry.get("template_rmse_final_m", {"mean": None}), 1), eps]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table (mean ± sample std over seeds)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(table_row(entry)) + " |" for entry in summary]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], settings: RadioMapSettings, path: Path) -> None:
    """Validation MSE per round (solid: held-out tiles of the city; dashed: the other city) and attacker RMSE per
    attack round (circles: ridge; squares, dotted: template), seed means, one colour per defence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for defence in settings.defences:
        mine = [r for r in runs if r["defence"] == defence]
        if not mine:
            continue
        line, = left.plot(np.mean([r["val_mse_db"] for r in mine], axis=0), label=f"{defence}, held-out tiles")
        if all(r.get("val_other_mse_db") for r in mine):
            left.plot(np.mean([r["val_other_mse_db"] for r in mine], axis=0), linestyle="--", color=line.get_color(),
                      label=f"{defence}, other city")
        if mine[0]["attack"]:
            rounds = [a["round"] for a in mine[0]["attack"]]
            right.plot(rounds, np.mean([[a["rmse_m"] for a in r["attack"]] for r in mine], axis=0), marker="o",
                       color=line.get_color(), label=f"{defence}, ridge")
        if mine[0].get("template_attack"):
            rounds = [a["round"] for a in mine[0]["template_attack"]]
            right.plot(rounds, np.mean([[a["rmse_m"] for a in r["template_attack"]] for r in mine], axis=0),
                       marker="s", linestyle=":", color=line.get_color(), label=f"{defence}, template")
    if runs and runs[0]["attack"]:
        naive = np.mean([[a["naive_rmse_m"] for a in r["attack"]] for r in runs], axis=0)
        right.plot([a["round"] for a in runs[0]["attack"]], naive, "k--", label="naive (shadow mean)")
    left.set(xlabel="round", ylabel="validation MSE (dB)", title="utility (lower is better)")
    right.set(xlabel="round", ylabel="attacker RMSE (m)", title="privacy (higher is better)")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
