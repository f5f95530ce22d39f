"""NIRA vs FedAvg on real images (docs/nira.md, "Experiment: FedAvg vs NIRA on Animal-MNIST").

``wildfed experiment nira`` runs the demo federation (:func:`wildfed_sim.demo.run_demo`:
one gateway process per site, Camtrap DP packages, MQTT, the ledger) once per configuration, privacy setting and
seed, on the same sites and held-out split for every configuration of a seed (the split, the site design and the
model initialisation follow the seed; privacy noise is never seeded):

=======================  ===========================================================================
``fedavg``               FedAvg, one global model
``nira``                 NIRA: ecological clusters, re-clustering every R rounds, embedding merging
``nira-no-recluster``    NIRA without re-clustering (clusters from the species lists only)
``nira-no-merging``      NIRA with re-clustering, without species-embedding merging
``nira-plain``           NIRA with neither (species-list clusters + per-cluster heads only); not in
                         the default grid
=======================  ===========================================================================

Privacy: ``none`` (non-private reference) and ``ccdp`` (CCDP gamma 1, anchor VU = 1).

Metrics, from each run's per-site evaluation (:func:`wildfed_sim.evaluation.evaluate_sites`): every
site's model (FedAvg: the global model; NIRA: shared phi + the head of the site's cluster) on the held-out test
images of the classes that site holds (its full species table, CR/EN included):

- ``macro``: per site, the unweighted mean of its per-class accuracies; then the mean over sites;
- ``site_mean`` / ``site_worst_decile``: per site, the per-class accuracies weighted by the site's own class
  frequencies (the accuracy on its own camera traffic); mean over sites, and mean of the worst ceil(K/10) sites
  (at K = 8: the worst site);
- ``rare``: per site, the accuracy on its rare species (those with the fewest training records at that site; all
  tied ones); mean over sites;
- ``novel``: per site, the accuracy on the species it does *not* hold (mean over those classes), mean over sites:
  what species-embedding merging is meant to buy (a cluster recognising a species none of its sites recorded);
- ``eps_cr_en`` / ``eps_lc``: epsilon spent (ledger, max over sites; CR/EN the larger of the two) for CCDP runs.

Each is reported as mean and sample std over seeds; ``delta_macro`` is the paired (same seed) difference of a
configuration's macro accuracy to FedAvg's with the same privacy.

Output (``out_dir``): ``nira.json`` (settings, every run's row, summary), ``nira.md`` (the table), ``nira.png``
(macro accuracy per configuration with error bars, and per round), one demo run folder per run under ``runs/``.
All three are rewritten after every run, so an interrupted grid keeps what finished.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

from wildfed_sim.common.runs import new_run_dir
from wildfed_sim.common.stats import mean_std

__all__ = ["NiraConfiguration", "CONFIGURATIONS", "DEFAULT_CONFIGURATIONS", "PRIVACY", "NiraSettings", "NiraResult", "run_nira_experiment",
           "row_from_report", "summarise", "markdown_table", "METRICS"]


@dataclass(frozen=True)
class NiraConfiguration:
    """One aggregation configuration of the grid."""

    name: str
    label: str
    strategy: str  # "fedavg" or "nira"
    recluster: bool = False
    embedding_merging: bool = True


CONFIGURATIONS: tuple[NiraConfiguration, ...] = (
    NiraConfiguration("fedavg", "FedAvg", "fedavg"),
    NiraConfiguration("nira", "NIRA (re-cluster + merging)", "nira", recluster=True, embedding_merging=True),
    NiraConfiguration("nira-no-recluster", "NIRA, no re-clustering", "nira", recluster=False,
                      embedding_merging=True),
    NiraConfiguration("nira-no-merging", "NIRA, no embedding merging", "nira", recluster=True,
                      embedding_merging=False),
    NiraConfiguration("nira-plain", "NIRA, neither (clusters + heads only)", "nira", recluster=False,
                      embedding_merging=False),
)
DEFAULT_CONFIGURATIONS: tuple[str, ...] = ("fedavg", "nira", "nira-no-recluster", "nira-no-merging")
"""The experiment's grid; ``nira-plain`` (per-cluster heads alone) is an extra ablation, run on request."""

PRIVACY: dict[str, dict[str, Any]] = {
    "none": {"label": "no privacy", "privacy": "none", "gamma": 1.0, "anchor_epsilon": 1.0},
    "ccdp": {"label": "CCDP gamma=1 (VU=1)", "privacy": "ccdp", "gamma": 1.0, "anchor_epsilon": 1.0},
}

METRICS = ("macro", "site_mean", "site_worst_decile", "rare", "novel", "eps_cr_en", "eps_lc", "num_clusters")


@dataclass(frozen=True)
class NiraSettings:
    """Knobs of the experiment (CLI flags of ``wildfed experiment nira``).

    ``seeds``: one grid per seed. ``configurations``: names from :data:`CONFIGURATIONS`; ``privacy``: keys of
    :data:`PRIVACY`. ``recluster_every``: R of the re-clustering configurations. ``distance_threshold``: NIRA's
    species-list cut (None = 0.7). ``broker``: ``mqtt://host:port`` or None (embedded broker per run). The rest
    goes to every demo run (:class:`~wildfed_sim.demo.DemoSettings`).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 10
    sites: int = 8
    local_steps: int = 10
    expected_batch_size: int = 128
    learning_rate: float = 0.5
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    round_deadline_s: float = 300.0
    recluster_every: int = 3
    distance_threshold: float | None = None
    broker: str | None = None
    out_dir: Path | None = None
    configurations: tuple[str, ...] = DEFAULT_CONFIGURATIONS
    privacy: tuple[str, ...] = ("none", "ccdp")

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ConfigError("at least one seed is needed", field="seeds", fix="use --seeds 0,1,2")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds repeat: {self.seeds}", field="seeds", fix="list each seed once")
        known = {c.name for c in CONFIGURATIONS}
        unknown = [c for c in self.configurations if c not in known]
        if unknown or not self.configurations:
            raise ConfigError(f"unknown configuration(s) {unknown}", field="configurations",
                              fix="use some of " + ", ".join(c.name for c in CONFIGURATIONS))
        bad = [p for p in self.privacy if p not in PRIVACY]
        if bad or not self.privacy:
            raise ConfigError(f"unknown privacy setting(s) {bad}", field="privacy", fix="use none and/or ccdp")
        if self.recluster_every < 1:
            raise ConfigError(f"recluster_every must be >= 1, got {self.recluster_every}", field="recluster_every",
                              fix="use e.g. --recluster-every 3 (the no-re-clustering row is its own configuration)")
        if self.rounds < 1 or self.sites < 2:
            raise ConfigError("rounds must be >= 1 and sites >= 2", field="rounds" if self.rounds < 1 else "sites",
                              fix="use --rounds 10 --sites 8")


@dataclass
class NiraResult:
    """Rows per run, the summary per (configuration, privacy), and where the files are."""

    out_dir: Path
    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0


# ------------------------------------------------------------------------------------------ rows and summary
def row_from_report(report: dict[str, Any], privacy: str) -> dict[str, Any]:
    """One run's metrics from its ``report.json`` content (see the module docstring)."""
    summary = report["per_site"]["summary"]
    row: dict[str, Any] = {k: summary[k] for k in ("macro", "site_mean", "site_worst_decile", "rare")}
    row["novel"] = summary.get("novel")
    eps = report.get("epsilon") or {}
    if privacy == "none":
        row.update(eps_cr_en=None, eps_lc=None)
    else:
        row["eps_cr_en"] = max(eps.get(c, {}).get("spent_max", 0.0) for c in ("CR", "EN"))
        row["eps_lc"] = eps.get("LC", {}).get("spent_max", 0.0)
    nira = report.get("nira")
    row["num_clusters"] = len(nira["clusters"]) if nira else None
    row["clusters"] = nira["clusters"] if nira else None
    # moves made by re-clustering (the log also records each site's initial cluster, with no "from")
    row["cluster_changes"] = sum(1 for c in nira["changes"] if c.get("from") is not None) if nira else None
    row["history_macro"] = [(h.get("per_site") or {}).get("macro") for h in report.get("history", [])]
    row["per_site"] = [{k: s.get(k) for k in ("site_id", "accuracy", "macro", "rare", "rare_species", "novel")}
                       for s in report["per_site"]["sites"]]
    return row


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample std (0 for one seed) over seeds of every metric, per (privacy, configuration), in the
    order of :data:`PRIVACY` and :data:`CONFIGURATIONS`; ``delta_macro``: the paired difference (same seed) of the
    macro accuracy to FedAvg's with the same privacy (None without a FedAvg run of that seed)."""
    out = []
    for privacy in PRIVACY:
        for config in CONFIGURATIONS:
            rows = [r for r in runs if r["configuration"] == config.name and r["privacy"] == privacy]
            if not rows:
                continue
            entry: dict[str, Any] = {"configuration": config.name, "label": config.label, "privacy": privacy,
                                     "seeds": sorted(r["seed"] for r in rows)}
            for metric in METRICS:
                entry[metric] = mean_std([r.get(metric) for r in rows], skip_nan=True)
            base = {r["seed"]: r["macro"] for r in runs if r["configuration"] == "fedavg" and r["privacy"] == privacy}
            entry["delta_macro"] = mean_std([r["macro"] - base[r["seed"]] for r in rows if r["seed"] in base],
                                            skip_nan=True)
            histories = [r.get("history_macro") or [] for r in rows]
            length = max((len(h) for h in histories), default=0)
            entry["history_macro"] = [mean_std([h[i] for h in histories if i < len(h)], skip_nan=True)["mean"]
                                      for i in range(length)]
            out.append(entry)
    return out


def _pct(stat: dict[str, Any], signed: bool = False) -> str:
    if stat["mean"] is None:
        return "n/a"
    sign = "+" if signed and stat["mean"] >= 0 else ""
    return f"{sign}{100 * stat['mean']:.1f} ± {100 * (stat['std'] or 0):.1f}"


def _eps(stat: dict[str, Any]) -> str:
    return "-" if stat["mean"] is None else f"{stat['mean']:.2f}"


HEADERS = ("configuration", "privacy", "seeds", "macro acc (%)", "Δ macro vs FedAvg (pts)", "site acc mean (%)",
           "site acc worst decile (%)", "rare-species acc (%)", "novel-species acc (%)", "clusters", "eps CR/EN",
           "eps LC")


def _cells(e: dict[str, Any]) -> list[str]:
    clusters = "-" if e["num_clusters"]["mean"] is None else f"{e['num_clusters']['mean']:.1f}"
    delta = "-" if e["configuration"] == "fedavg" else _pct(e["delta_macro"], signed=True)
    return [e["label"], PRIVACY[e["privacy"]]["label"], str(len(e["seeds"])), _pct(e["macro"]), delta,
            _pct(e["site_mean"]), _pct(e["site_worst_decile"]), _pct(e["rare"]), _pct(e["novel"]), clusters,
            _eps(e["eps_cr_en"]),
            _eps(e["eps_lc"])]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a GitHub markdown table (mean ± sample std over seeds)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|---|---" + "|---:" * (len(HEADERS) - 2) + "|"]
    lines += ["| " + " | ".join(_cells(e)) + " |" for e in summary]
    return "\n".join(lines) + "\n"


def _plot(summary: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [c.name for c in CONFIGURATIONS if any(e["configuration"] == c.name for e in summary)]
    labels = [c.label for c in CONFIGURATIONS if c.name in names]
    privacies = [p for p in PRIVACY if any(e["privacy"] == p for e in summary)]
    x = np.arange(len(names))
    width = 0.8 / max(1, len(privacies))
    for i, privacy in enumerate(privacies):
        entries = {e["configuration"]: e for e in summary if e["privacy"] == privacy}
        means = [100 * (entries[n]["macro"]["mean"] if n in entries and entries[n]["macro"]["mean"] is not None
                        else math.nan) for n in names]
        stds = [100 * ((entries[n]["macro"]["std"] or 0.0) if n in entries else 0.0) for n in names]
        ax1.bar(x + (i - (len(privacies) - 1) / 2) * width, means, width, yerr=stds, capsize=3,
                label=PRIVACY[privacy]["label"])
    ax1.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    ax1.set_ylabel("macro accuracy over sites (%)")
    ax1.set_title("Final macro accuracy (mean ± std over seeds)")
    ax1.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=8)
    styles = {"none": "-", "ccdp": "--"}
    for e in summary:
        hist = [math.nan if v is None else 100 * v for v in e["history_macro"]]
        ax2.plot(range(1, len(hist) + 1), hist, styles.get(e["privacy"], "-"), marker="o", markersize=3,
                 label=f"{e['label']}, {e['privacy']}")
    ax2.set_xlabel("round")
    ax2.set_ylabel("macro accuracy over sites (%)")
    ax2.set_title("Per round (mean over seeds)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _caption(settings: NiraSettings) -> str:
    cut = settings.distance_threshold if settings.distance_threshold is not None else 0.7
    return (f"{settings.sites} sites, {settings.rounds} rounds, {settings.local_steps} local steps, expected batch "
            f"{settings.expected_batch_size}, local lr {settings.learning_rate:g}, clipping norm "
            f"{settings.clipping_norm:g}, from scratch; NIRA cut at Jaccard distance {cut:g} of the public species "
            f"lists (CR/EN left out), re-clustering every {settings.recluster_every} rounds where on. Per site: its "
            f"model on the held-out test images of its own classes. macro = mean over sites of the per-class mean "
            f"accuracy; site acc = per-class accuracy weighted by the site's class frequencies (mean over sites, "
            f"and mean of the worst ceil(K/10) sites); rare = accuracy on each site's least-recorded species, mean "
            f"over sites; novel = accuracy on the species a site does not hold, mean over sites. Mean ± sample "
            f"std over seeds; Δ = paired difference to FedAvg with the same privacy. "
            f"eps: ledger RDP spend, max over sites, delta {settings.target_delta:g}.")


def _write(settings: NiraSettings, result: NiraResult, configs: Sequence[NiraConfiguration]) -> None:
    result.summary = summarise(result.runs)
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (result.out_dir / "nira.json").write_text(json.dumps(
        {"settings": settings_json, "configurations": [asdict(c) for c in configs], "runs": result.runs,
         "summary": result.summary, "elapsed_s": result.elapsed_s}, indent=2))
    (result.out_dir / "nira.md").write_text(f"# FedAvg vs NIRA on Animal-MNIST\n\n{_caption(settings)}\n\n"
                                            + markdown_table(result.summary))
    if result.summary:
        _plot(result.summary, result.out_dir / "nira.png",
              f"FedAvg vs NIRA: {settings.sites} sites, {settings.rounds} rounds")


# ------------------------------------------------------------------------------------------ the experiment
def run_nira_experiment(settings: NiraSettings, console: Any = None) -> NiraResult:
    """Run the grid (seed-major: every configuration and privacy setting of a seed before the next seed); write
    ``nira.json``, ``nira.md`` and ``nira.png`` after every run."""
    from rich.console import Console
    from rich.table import Table

    from wildfed_sim.demo import DemoSettings, run_demo

    console = console or Console()
    t0 = time.monotonic()
    out_dir = new_run_dir(settings.out_dir, "nira")
    configs = [c for c in CONFIGURATIONS if c.name in settings.configurations]
    privacies = [p for p in PRIVACY if p in settings.privacy]
    result = NiraResult(out_dir=out_dir)
    total = len(configs) * len(privacies) * len(settings.seeds)
    done = 0
    for seed in settings.seeds:
        for privacy in privacies:
            p = PRIVACY[privacy]
            for config in configs:
                done += 1
                console.rule(f"[{done}/{total}] seed {seed}: {config.label}, {p['label']}")
                run_dir = out_dir / "runs" / f"{config.name}-{privacy}-seed{seed}"
                demo = DemoSettings(sites=settings.sites, rounds=settings.rounds, privacy=p["privacy"],
                                    gamma=p["gamma"], anchor_category="VU", anchor_epsilon=p["anchor_epsilon"],
                                    local_steps=settings.local_steps, expected_batch_size=settings.expected_batch_size,
                                    learning_rate=settings.learning_rate, clipping_norm=settings.clipping_norm,
                                    target_delta=settings.target_delta, round_deadline_s=settings.round_deadline_s,
                                    seed=seed, broker=settings.broker, out_dir=run_dir, strategy=config.strategy,
                                    nira_recluster_every=settings.recluster_every if config.recluster else 0,
                                    nira_embedding_merging=config.embedding_merging,
                                    nira_distance_threshold=settings.distance_threshold)
                run_t0 = time.monotonic()
                run_demo(demo, console=console)
                report = json.loads((run_dir / "report.json").read_text())
                row = {"configuration": config.name, "privacy": privacy, "seed": seed,
                       "report": str(run_dir / "report.json"), "elapsed_s": time.monotonic() - run_t0,
                       **row_from_report(report, privacy)}
                result.runs.append(row)
                result.elapsed_s = time.monotonic() - t0
                _write(settings, result, configs)

    result.elapsed_s = time.monotonic() - t0
    _write(settings, result, configs)
    table = Table(title="FedAvg vs NIRA (mean ± std over seeds)", caption=_caption(settings))
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="left" if i < 2 else "right")
    for entry in result.summary:
        table.add_row(*_cells(entry))
    console.print(table)
    console.log(f"written {out_dir / 'nira.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result
