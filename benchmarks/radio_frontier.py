"""The radio-map frontier from several ``wildfed experiment radiomap`` runs: utility against the template attacker's
RMSE, per defence and epsilon, with differences paired by seed against uniform noise at the same epsilon.

Run by hand (reads the runs' ``radiomap.json``; a few seconds)::

    .venv/bin/python benchmarks/radio_frontier.py RUN_DIR [RUN_DIR ...] [--plot FRONTIER.png]

Each run directory holds one noise multiplier z (``--noise-multiplier``) and any defences and seeds. Rows: defence
and privacy level, the per-upload noise multiplier of the ledger's event z_eff (z / 2 for uniform and
grouped-clipping, sqrt(phi) z / 2 for adaptive). Every defence of a seed has the same schedule, so equal z_eff is
equal epsilon per site; the epsilon column is the ledger's (max over sites, delta 1e-5), mean over seeds. Defences
without a guarantee get their own rows. Columns, mean ± sample std over seeds: the template attacker's RMSE in
metres at its last attack round (over every site it has observed, the evidence summed over that site's uploads),
the validation MSE in dB at the last round on the held-out tiles and on the other city, and the round-0 value (the
pretrained model, the same for every defence of a seed). Then, for each defence at a privacy level uniform has, the
per-seed differences defence - uniform (RMSE, held-out MSE, other-city MSE), their mean and a 95 % t-interval over
seeds (Student's t with n - 1 degrees of freedom). ``--plot``: attacker RMSE against the change of validation MSE
from the seed's round 0 (mean ± std over seeds), so that the seeds' cities, which differ by several dB, do not
swamp the defences' differences.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def _t95(n: int) -> float:
    """Two-sided 95 % Student t quantile with n - 1 degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) if n > 1 else math.nan


def _ms(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def load(dirs: list[Path]) -> list[dict]:
    """One dict per (run directory, seed, defence): z, epsilon, template RMSE at the last attack, the MSEs."""
    rows = []
    for d in dirs:
        payload = json.loads((d / "radiomap.json").read_text())
        z = float(payload["settings"]["noise_multiplier"])
        phi = float(payload["settings"]["floor_fraction"])
        for run in payload["runs"]:
            attack = run.get("template_attack") or []
            z_eff = {"uniform": z / 2, "grouped-clipping": z / 2,
                     "adaptive": math.sqrt(phi) * z / 2}.get(run["defence"])
            rows.append({"dir": str(d), "z": z, "defence": run["defence"], "seed": run["seed"],
                         "level": None if z_eff is None else round(z_eff, 3),
                         "epsilon": run.get("epsilon"), "rmse_m": attack[-1]["rmse_m"] if attack else math.nan,
                         "sites": len(attack[-1]["errors_m"]) if attack else 0,
                         "val": run["val_mse_db"][-1], "val_other": run["val_other_mse_db"][-1],
                         "val0": run["val_mse_db"][0], "val0_other": run["val_other_mse_db"][0],
                         "rounds": len(run["val_mse_db"]) - 1})
    return rows


def _group(row: dict) -> tuple:
    """A row's group: (defence, z_eff) for the defences with an epsilon; steered-uniform, which states none, by its
    noise multiplier z (the same noise budget as uniform at that z); none and clip-only alone."""
    if row["level"] is not None:
        return (row["defence"], row["level"])
    return (row["defence"], None if row["defence"] != "steered-uniform" else -row["z"])


def _level(key: tuple) -> str:
    lev = key[1]
    return "-" if lev is None or lev < 0 else f"{lev:g}"


def _paired(groups: dict[tuple, list[dict]], key: tuple, base_key: tuple, label: str) -> None:
    """Print defence - base per seed (RMSE, held-out MSE, other-city MSE): mean [95 % t-interval] (per seed)."""
    base = {r["seed"]: r for r in groups.get(base_key, [])}
    pairs = [(r, base[r["seed"]]) for r in groups[key] if r["seed"] in base]
    if not pairs:
        return
    for field, unit in (("rmse_m", "m"), ("val", "dB held-out"), ("val_other", "dB other city")):
        diff = np.array([a[field] - b[field] for a, b in pairs])
        per_seed = ", ".join(f"{x:+.2f}" for x in diff)
        if len(diff) < 2:
            print(f"  {key[0]} - uniform, {label}: {diff.mean():+.2f} (one seed: no interval) {unit}")
            continue
        half = _t95(len(diff)) * diff.std(ddof=1) / math.sqrt(len(diff))
        print(f"  {key[0]} - uniform, {label}: {diff.mean():+.2f} [{diff.mean() - half:+.2f}, "
              f"{diff.mean() + half:+.2f}] {unit} ({per_seed})")


def main() -> None:
    """Parse the options, print the table and the paired differences, draw the plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    rows = load(args.dirs)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group(r), []).append(r)
    print("| defence | z | z_eff | eps per site | seeds | template RMSE (m), last attack | sites | held-out MSE (dB) | "
          "other city MSE (dB) | round 0: held-out / other (dB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (defence, lev), rs in sorted(groups.items(), key=lambda kv: (kv[0][1] is not None and kv[0][1] >= 0,
                                                                     abs(kv[0][1] or 0), kv[0][0])):
        rs.sort(key=lambda r: r["seed"])
        guaranteed = lev is not None and lev >= 0
        eps = f"{np.mean([r['epsilon'] for r in rs]):.1f}" if guaranteed else "none"
        z = f"{rs[0]['z']:g}" if lev is not None else "-"
        print(f"| {defence} | {z} | {_level((defence, lev))} | {eps} | {len(rs)} | "
              f"{_ms([r['rmse_m'] for r in rs])} | {sum(r['sites'] for r in rs) / len(rs):.1f} | "
              f"{_ms([r['val'] for r in rs])} | {_ms([r['val_other'] for r in rs])} | "
              f"{_ms([r['val0'] for r in rs])} / {_ms([r['val0_other'] for r in rs])} |")
    print("\nPaired by seed, defence - uniform at the same epsilon (steered-uniform: at the same z, the same noise "
          "budget; it states no epsilon): mean [95 % t-interval] (per seed)")
    uniform_at_z = {rs[0]["z"]: key for key, rs in groups.items() if key[0] == "uniform"}
    for key in sorted(groups, key=lambda k: (abs(k[1] or 0), k[0])):
        defence, lev = key
        if defence == "uniform" or lev is None:
            continue
        if lev >= 0:
            _paired(groups, key, ("uniform", lev), f"z_eff {lev:g}")
        elif -lev in uniform_at_z:
            _paired(groups, key, uniform_at_z[-lev], f"z {-lev:g}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
        defences = sorted({d for d, _ in groups})
        colour = {d: plt.get_cmap("tab10")(i) for i, d in enumerate(defences)}  # one colour per defence
        noise = sorted({abs(lev) for _, lev in groups if lev is not None})
        marker = {n: m for n, m in zip(noise, "osD^v<>")}  # one marker per noise level (z_eff, or z for steered)
        for (defence, lev), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            x = np.array([r["rmse_m"] for r in rs])
            for ax, key, start in zip(axes, ("val", "val_other"), ("val0", "val0_other")):
                y = np.array([r[key] - r[start] for r in rs])   # paired with the seed's round 0: no city spread
                ax.errorbar(x.mean(), y.mean(), xerr=x.std(ddof=1) if len(x) > 1 else None,
                            yerr=y.std(ddof=1) if len(y) > 1 else None, capsize=3, color=colour[defence],
                            marker=marker.get(abs(lev), "o") if lev is not None else "*", markersize=8,
                            label=f"{defence}, {'z' if lev is not None and lev < 0 else 'z_eff'} "
                                  f"{_level((defence, lev)) if lev is None or lev >= 0 else f'{-lev:g}'}")
        for ax, title in zip(axes, ("held-out tiles", "other city")):
            ax.set(xlabel="template attacker RMSE (m), higher is more private",
                   ylabel="validation MSE minus round 0's (dB), lower is better", title=title)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
