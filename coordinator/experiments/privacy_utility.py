"""Privacy-utility on real images: the seed's table, measured on the demo federation.

``wildfed-coordinator experiment privacy-utility`` runs the demo federation (:func:`coordinator.experiments.demo.
run_demo`: embedded broker, one gateway process per site, Camtrap DP packages, the ledger) once per configuration
and seed, on the same sites and the same held-out split for every configuration of a seed:

==================  ============================================================
``none``            no privacy (non-private reference)
``uniform-eps1``    uniform DP: every IUCN category eps = 1 (gamma 0, anchor VU = 1)
``uniform-eps2``    uniform DP: every category eps = 2 (gamma 0, anchor VU = 2)
``ccdp-gamma1``     CCDP gamma 1, anchor VU = 1: CR 0.33, EN 0.67, ..., LC 1.67, NE 2.00
``ccdp-gamma2``     CCDP gamma 2, anchor VU = 1: CR 0.11, EN 0.44, ..., LC 2.78, NE 4.00
==================  ============================================================

Columns, all read back from each run's ``report.json``: CR/EN, LC and overall accuracy on the held-out test split;
the epsilon actually spent (ledger, RDP composition of every step) for CR/EN -- the larger of the CR and EN spends,
each the largest over sites -- and for LC. Mean and sample standard deviation over seeds.

Public pretraining (DP transfer learning): ``design_sites`` places only part of the 8,000 Animal-MNIST training
images at sites (4,373 at K=8, seed 0); the rest -- about 3,600 images, the *training images that no site holds*,
disjoint from every site and from the 2,000-image held-out test split -- is treated as a public split. With
``pretrain_epochs > 0`` the camera CNN (phi and psi) is trained on it centrally, without privacy, once per seed,
and every configuration of that seed starts its federation from those weights; the private sites' records are
only ever touched by DP-SGD. ``pretrain_epochs = 0`` starts from the seeded random initialisation instead.
The public split is not class-balanced: the site design takes every image of the species it places most, so at
K=8, seed 0 it holds 3,627 images but none of bird and cat (both LC), cow or sheep (NE); its class counts are
recorded in ``privacy_utility.json`` (``pretraining.<seed>.class_counts``). Measured at K=8, seed 0, 5 epochs:
50.2 % overall, 83 % CR/EN, 0 % LC on the held-out split before round 1.

Output (``out_dir``): ``privacy_utility.json`` (settings, pretraining, every run's row, the summary),
``privacy_utility.md`` (the table), ``privacy_utility.png`` (accuracy and epsilon per configuration, error bars =
std over seeds), and one demo run folder per configuration and seed under ``runs/``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

__all__ = ["Configuration", "CONFIGURATIONS", "PrivacyUtilitySettings", "run_privacy_utility", "row_from_report",
           "summarise", "markdown_table", "expected_budgets"]


@dataclass(frozen=True)
class Configuration:
    """One row of the table: how the demo federation is privatised."""

    name: str
    label: str
    privacy: str  # "none" or "ccdp"
    gamma: float = 1.0
    anchor_epsilon: float = 1.0


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("none", "no privacy", "none"),
    Configuration("uniform-eps1", "uniform DP eps=1", "ccdp", gamma=0.0, anchor_epsilon=1.0),
    Configuration("uniform-eps2", "uniform DP eps=2", "ccdp", gamma=0.0, anchor_epsilon=2.0),
    Configuration("ccdp-gamma1", "CCDP gamma=1 (VU=1)", "ccdp", gamma=1.0, anchor_epsilon=1.0),
    Configuration("ccdp-gamma2", "CCDP gamma=2 (VU=1)", "ccdp", gamma=2.0, anchor_epsilon=1.0),
)

METRICS = ("acc_cr_en", "acc_lc", "acc_overall", "eps_cr_en", "eps_lc")
"""Columns of the table (accuracies are fractions in [0, 1]; epsilons are None for the non-private run)."""


def expected_budgets(config: Configuration) -> dict[str, float] | None:
    """Budgets of CR/EN (the larger, EN's) and LC, from the seed's formula eps_c = eps_VU * (rank(c)/3)^gamma.

    Computed here from the ranks (CR 1, EN 2, VU 3, LC 5), independently of :mod:`shared.iucn`."""
    if config.privacy == "none":
        return None
    return {"eps_cr_en": config.anchor_epsilon * (2 / 3) ** config.gamma,
            "eps_lc": config.anchor_epsilon * (5 / 3) ** config.gamma}


@dataclass(frozen=True)
class PrivacyUtilitySettings:
    """Knobs of the experiment (CLI flags of ``wildfed-coordinator experiment privacy-utility``).

    ``seeds``: one full grid per seed (data split, site design, initialisation; privacy noise stays random).
    ``pretrain_epochs``: epochs on the public split (0 = from scratch), with SGD at ``pretrain_batch_size`` and
    ``pretrain_learning_rate``. ``configurations``: names from
    :data:`CONFIGURATIONS` (default all). The rest is passed to every demo run (see
    :class:`~coordinator.experiments.demo.DemoSettings`).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 10
    sites: int = 8
    pretrain_epochs: int = 5
    pretrain_batch_size: int = 64
    pretrain_learning_rate: float = 0.1
    local_steps: int = 10
    expected_batch_size: int = 128
    learning_rate: float = 0.5
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    round_deadline_s: float = 300.0
    out_dir: Path | None = None
    configurations: tuple[str, ...] = tuple(c.name for c in CONFIGURATIONS)

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ConfigError("at least one seed is needed", field="seeds", fix="use --seeds 0,1,2")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds repeat: {self.seeds}", field="seeds", fix="list each seed once")
        if self.pretrain_epochs < 0:
            raise ConfigError("pretrain_epochs must be >= 0", field="pretrain_epochs", fix="use 0 for no pretraining")
        known = {c.name for c in CONFIGURATIONS}
        unknown = [c for c in self.configurations if c not in known]
        if unknown or not self.configurations:
            raise ConfigError(f"unknown configuration(s) {unknown}", field="configurations",
                              fix="use some of " + ", ".join(sorted(known)))


@dataclass
class PrivacyUtilityResult:
    """Rows per run, the summary per configuration, and where the files are."""

    out_dir: Path
    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    pretraining: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


# ------------------------------------------------------------------------------------------ rows and summary
def row_from_report(report: dict[str, Any], config: Configuration) -> dict[str, Any]:
    """The table's columns for one run, read from its ``report.json`` content."""
    acc = report["final_accuracy"]
    row: dict[str, Any] = {"acc_cr_en": acc["CR/EN"], "acc_lc": acc["LC"], "acc_overall": acc["overall"]}
    eps = report.get("epsilon") or {}
    if config.privacy == "none":
        row.update(eps_cr_en=None, eps_lc=None, budget_cr_en=None, budget_lc=None)
    else:
        row["eps_cr_en"] = max(eps.get(c, {}).get("spent_max", 0.0) for c in ("CR", "EN"))
        row["eps_lc"] = eps.get("LC", {}).get("spent_max", 0.0)
        row["budget_cr_en"] = max(eps.get(c, {}).get("budget", 0.0) for c in ("CR", "EN"))
        row["budget_lc"] = eps.get("LC", {}).get("budget", 0.0)
    return row


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def summarise(runs: Sequence[dict[str, Any]], configurations: Sequence[Configuration]) -> list[dict[str, Any]]:
    """Mean and sample std (0 for one seed) of every metric over the seeds, per configuration, in order."""
    out = []
    for config in configurations:
        rows = [r for r in runs if r["configuration"] == config.name]
        entry: dict[str, Any] = {"configuration": config.name, "label": config.label, "seeds": len(rows)}
        for metric in METRICS:
            mean, std = _mean_std([r[metric] for r in rows])
            entry[metric] = {"mean": mean, "std": std}
        out.append(entry)
    return out


def _fmt(stat: dict[str, float | None], percent: bool) -> str:
    if stat["mean"] is None:
        return "- (no DP)" if not percent else "n/a"
    if percent:
        return f"{100 * stat['mean']:.1f} ± {100 * (stat['std'] or 0):.1f} %"
    return f"{stat['mean']:.3f} ± {stat['std'] or 0:.3f}"


HEADERS = ("configuration", "CR/EN acc", "LC acc", "overall acc", "eps spent CR/EN", "eps spent LC")


def _cells(entry: dict[str, Any]) -> list[str]:
    return [entry["label"], _fmt(entry["acc_cr_en"], True), _fmt(entry["acc_lc"], True),
            _fmt(entry["acc_overall"], True), _fmt(entry["eps_cr_en"], False), _fmt(entry["eps_lc"], False)]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a GitHub markdown table (mean ± std over seeds)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|---" + "|---:" * (len(HEADERS) - 1) + "|"]
    lines += ["| " + " | ".join(_cells(e)) + " |" for e in summary]
    return "\n".join(lines) + "\n"


def _plot(summary: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [e["label"] for e in summary]
    x = np.arange(len(summary))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.27
    for i, (metric, name) in enumerate((("acc_cr_en", "CR/EN"), ("acc_lc", "LC"), ("acc_overall", "overall"))):
        means = [100 * (e[metric]["mean"] if e[metric]["mean"] is not None else math.nan) for e in summary]
        stds = [100 * (e[metric]["std"] or 0.0) for e in summary]
        ax1.bar(x + (i - 1) * width, means, width, yerr=stds, capsize=3, label=name)
    ax1.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    ax1.set_ylabel("held-out test accuracy (%)")
    ax1.set_title("Accuracy (mean ± std over seeds)")
    ax1.grid(axis="y", alpha=0.3)
    ax1.legend()
    for i, (metric, name) in enumerate((("eps_cr_en", "CR/EN"), ("eps_lc", "LC"))):
        means = [e[metric]["mean"] if e[metric]["mean"] is not None else math.nan for e in summary]
        stds = [e[metric]["std"] or 0.0 for e in summary]
        ax2.bar(x + (i - 0.5) * 0.38, means, 0.38, yerr=stds, capsize=3, label=name)
    ax2.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    ax2.set_ylabel("epsilon spent (ledger, max over sites)")
    ax2.set_title("Privacy spent (no bar: no DP)")
    ax2.grid(axis="y", alpha=0.3)
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the experiment
def _pretrain(settings: PrivacyUtilitySettings, seed: int, out_dir: Path, console: Any) -> dict[str, Any]:
    """Pretrain on the public split of ``seed`` (the same split and sites run_demo will build) and save."""
    from coordinator.experiments.animal_mnist import fetch_animal_mnist, split_holdout
    import numpy as np

    from coordinator.experiments.animal_mnist import SPECIES_TABLE
    from coordinator.experiments.demo import pretrain_on_public_split, public_split_indices, save_weights
    from coordinator.experiments.ecology import design_sites

    data = fetch_animal_mnist()
    train, _ = split_holdout(data, 0.2, seed=seed)
    specs = design_sites(train.labels, settings.sites, seed=seed)
    t0 = time.monotonic()
    weights, n_public = pretrain_on_public_split(train, specs, epochs=settings.pretrain_epochs,
                                                 batch_size=settings.pretrain_batch_size,
                                                 learning_rate=settings.pretrain_learning_rate, seed=seed)
    path = save_weights(weights, out_dir / "pretrained" / f"seed-{seed}.safetensors")
    public = public_split_indices(len(train.labels), specs)
    class_counts = [int(c) for c in np.bincount(train.labels[public], minlength=len(SPECIES_TABLE))]
    console.log(f"seed {seed}: pretrained on the public split ({n_public} of {len(train)} training images, held by "
                f"no site), {settings.pretrain_epochs} epochs, {time.monotonic() - t0:.0f} s -> {path}")
    return {"path": str(path), "num_images": n_public, "num_train": len(train),
            "num_site_images": int(sum(s.num_images for s in specs)), "epochs": settings.pretrain_epochs,
            "batch_size": settings.pretrain_batch_size, "learning_rate": settings.pretrain_learning_rate,
            "class_counts": class_counts}


def run_privacy_utility(settings: PrivacyUtilitySettings, *, console: Any = None) -> PrivacyUtilityResult:
    """Run every configuration for every seed (see the module docstring); write JSON, markdown and PNG."""
    from rich.console import Console
    from rich.table import Table

    from coordinator.experiments.demo import DemoSettings, new_run_dir, run_demo

    console = console or Console()
    t0 = time.monotonic()
    out_dir = new_run_dir(settings.out_dir, "privacy-utility")
    configs = [c for c in CONFIGURATIONS if c.name in settings.configurations]
    result = PrivacyUtilityResult(out_dir=out_dir)
    total = len(configs) * len(settings.seeds)
    done = 0
    for seed in settings.seeds:
        weights_path = None
        if settings.pretrain_epochs > 0:
            result.pretraining[str(seed)] = _pretrain(settings, seed, out_dir, console)
            weights_path = Path(result.pretraining[str(seed)]["path"])
        for config in configs:
            done += 1
            console.rule(f"[{done}/{total}] seed {seed}: {config.label}")
            run_dir = out_dir / "runs" / f"{config.name}-seed{seed}"
            demo = DemoSettings(sites=settings.sites, rounds=settings.rounds, privacy=config.privacy,
                                gamma=config.gamma, anchor_category="VU", anchor_epsilon=config.anchor_epsilon,
                                local_steps=settings.local_steps, expected_batch_size=settings.expected_batch_size,
                                learning_rate=settings.learning_rate, clipping_norm=settings.clipping_norm,
                                target_delta=settings.target_delta, round_deadline_s=settings.round_deadline_s,
                                seed=seed, out_dir=run_dir, initial_weights_path=weights_path)
            run_demo(demo, console=console)
            report = json.loads((run_dir / "report.json").read_text())
            row = {"configuration": config.name, "label": config.label, "seed": seed,
                   "report": str(run_dir / "report.json"), **row_from_report(report, config)}
            result.runs.append(row)

    result.summary = summarise(result.runs, configs)
    result.elapsed_s = time.monotonic() - t0
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (out_dir / "privacy_utility.json").write_text(json.dumps(
        {"settings": settings_json, "configurations": [asdict(c) for c in configs],
         "pretraining": result.pretraining, "runs": result.runs, "summary": result.summary,
         "elapsed_s": result.elapsed_s}, indent=2))
    pre = (f"pretrained {settings.pretrain_epochs} epochs on the public split (training images no site holds)"
           if settings.pretrain_epochs > 0 else "from scratch (no pretraining)")
    caption = (f"{settings.sites} sites, {settings.rounds} rounds, {settings.local_steps} local steps, seeds "
               f"{', '.join(map(str, settings.seeds))}; {pre}. Mean ± std over seeds. Epsilon: ledger RDP spend, "
               f"max over sites (CR/EN: the larger of CR and EN), delta {settings.target_delta:g}.")
    (out_dir / "privacy_utility.md").write_text(f"# Privacy-utility on Animal-MNIST\n\n{caption}\n\n"
                                                + markdown_table(result.summary))
    _plot(result.summary, out_dir / "privacy_utility.png",
          f"WildFed privacy-utility: {settings.sites} sites, {settings.rounds} rounds, {len(settings.seeds)} seed(s), "
          + ("pretrained on the public split" if settings.pretrain_epochs > 0 else "from scratch"))

    table = Table(title="privacy-utility (mean ± std over seeds)", caption=caption)
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="left" if i == 0 else "right")
    for entry in result.summary:
        table.add_row(*_cells(entry))
    console.print(table)
    console.log(f"written {out_dir / 'privacy_utility.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result
