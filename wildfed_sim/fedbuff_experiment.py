"""The measurement: synchronous rounds with a deadline vs buffered asynchronous aggregation (FedBuff) under each
link model, on the demo's federation replayed by :mod:`wildfed_sim.fedbuff_sim` (CCDP gamma 1, VU = 1, local DP).

Protocol. Every arm gets the same number of configurations (the ``large`` grid: 3 x 3 = 9, ``small``: 2 x 2), all
tuned on tuning seeds that are never reported: sync over its deadline and server learning rate, each FedBuff arm
over K and its server learning rate (staleness 1/sqrt(1+t), ``max_staleness`` 10, server momentum 0.5 everywhere,
the local settings the demo's tuned DP defaults). The tuning score is the mean over tuning seeds of the three
reported accuracies (at 6 h, at 24 h, and once the budget is spent), so each arm is tuned for what is reported. The
best configuration of each arm then runs on the reported seeds, which fix data, site design, initial model, noise
and link draws alike for every arm (paired runs). Reported: accuracy at equal simulated wall-clock (6 h, 24 h),
at equal budget (the last model released while every site had sent at most half of its planned updates; the
model once every site's budget is spent), the hours to spend the budget and the fraction of the charged budget
that was discarded; FedBuff minus sync as the mean paired difference with its 95 % Student-t interval
(:func:`wildfed_sim.common.stats.paired_interval`). Headroom: the non-private federation on always-on links with
the demo's non-private defaults.

Arms: ``sync``; ``fedbuff`` (fixed denominator, :mod:`coordinator.buffered`); ``fedbuff-paper`` (FedBuff's own
``/ K`` with every update weighted alike); ``fedbuff-examples`` (n_i / sum n_i inside the buffer).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wildfed_sim.common.stats import mean_sd, paired_interval

__all__ = ["FedBuffSettings", "ARMS", "GRIDS", "run_fedbuff_experiment"]

ARMS = ("sync", "fedbuff", "fedbuff-paper", "fedbuff-examples")
#: per grid: the sync configurations (deadline minutes, server lr) and the FedBuff ones (K, server lr)
GRIDS = {"large": {"sync": list(itertools.product((60.0, 180.0, 540.0), (0.5, 1.0, 2.0))),
                   "fedbuff": list(itertools.product((2, 4, 8), (0.5, 1.0, 2.0)))},
         "small": {"sync": list(itertools.product((180.0, 540.0), (1.0, 2.0))),
                   "fedbuff": list(itertools.product((4, 8), (1.0, 2.0)))}}
HOURS = (6.0, 24.0)
CURVE_HOURS = tuple(h / 2 for h in range(0, 97))  # 0 .. 48 h


@dataclass(frozen=True)
class FedBuffSettings:
    """``wildfed experiment fedbuff``'s options (module docstring). Seeds: the demo's data seeds; the tuning seeds
    must not be reported ones."""

    seeds: tuple[int, ...] = tuple(range(10))
    tuning_seeds: tuple[int, ...] = (101, 103, 104, 105)
    links: tuple[str, ...] = ("always-on", "satellite", "solar-night", "cellular")
    arms: tuple[str, ...] = ARMS
    grid: str = "large"
    training_minutes: float = 20.0
    out_dir: Path | None = None


def _config(link: str, arm: str, point: tuple[float, float], training_minutes: float) -> Any:
    from wildfed_sim.fedbuff_sim import AsyncConfig

    if arm == "sync":
        return AsyncConfig(mode="sync", link=link, deadline_minutes=point[0], server_learning_rate=point[1],
                           training_minutes=training_minutes)
    weighting = {"fedbuff": "fixed", "fedbuff-paper": "uniform", "fedbuff-examples": "examples"}[arm]
    return AsyncConfig(mode="fedbuff", link=link, buffer_size=int(point[0]), server_learning_rate=point[1],
                       weighting=weighting, training_minutes=training_minutes)


def summarise(out: dict[str, Any], planned: int) -> dict[str, Any]:
    """The reported measures of one :func:`~wildfed_sim.fedbuff_sim.run_async` result (module docstring)."""
    points = out["points"]

    def at_minutes(m: float) -> float:
        return [p for p in points if p["minutes"] <= m][-1]["accuracy"]

    def at_budget(fraction: float) -> dict[str, Any]:
        return [p for p in points if max(p["sent"]) <= fraction * planned][-1]

    half = at_budget(0.5)
    spent = out["budget_spent_minutes"]
    return {"acc_6h": at_minutes(360.0), "acc_24h": at_minutes(1440.0), "acc_half": half["accuracy"],
            "eps_half": half["epsilon"], "acc_budget": points[-1]["accuracy"], "eps_budget": points[-1]["epsilon"],
            "groups_budget": points[-1]["by_group"], "hours_to_budget": None if spent is None else spent / 60,
            "discarded_fraction": out["discarded"] / out["charged"] if out["charged"] else 0.0,
            "charged": out["charged"], "discarded": out["discarded"], "dropped_unsent": out["dropped_unsent"],
            "pending": out["pending"], "versions": out["versions"],
            "curve": [at_minutes(60 * h) for h in CURVE_HOURS]}


def _score(rows: list[dict[str, Any]]) -> float:
    return sum(r["acc_6h"] + r["acc_24h"] + r["acc_budget"] for r in rows) / (3 * len(rows))


def run_fedbuff_experiment(settings: FedBuffSettings, *, console: Any = None) -> Path:
    """Tune, run, and write ``fedbuff.md``, ``fedbuff.json``, ``fedbuff.png`` and ``runs.jsonl`` (resumable: an
    existing folder's runs are reused) to the run folder, which is returned.

    Raises:
        ConfigError: a tuning seed is also reported, an unknown link, arm or grid, or a non-empty new folder.
    """
    import warnings

    from shared.errors import ConfigError
    from wildfed_sim.common.runs import new_run_dir, read_runs
    from wildfed_sim.demo_sim import load_federation
    from wildfed_sim.fedbuff_sim import AsyncConfig, run_async
    from wildfed_sim.link_models import link_model

    if set(settings.seeds) & set(settings.tuning_seeds):
        raise ConfigError("a tuning seed is also reported", field="tuning_seeds", fix="tune on other seeds")
    if settings.grid not in GRIDS or not set(settings.arms) <= set(ARMS):
        raise ConfigError(f"grid {settings.grid!r} / arms {settings.arms!r}", field="grid",
                          fix=f"grids {', '.join(GRIDS)}; arms {', '.join(ARMS)}")
    for link in settings.links:
        link_model(link)
    out_dir = (Path(settings.out_dir).resolve() if settings.out_dir and Path(settings.out_dir).exists()
               else new_run_dir(settings.out_dir, "fedbuff"))
    log_path = out_dir / "runs.jsonl"
    done = {(r["phase"], r["seed"], r["link"], r["arm"], tuple(r["point"])): r for r in read_runs(log_path)}
    started = time.monotonic()
    warnings.simplefilter("ignore")

    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    def run_all(phase: str, seed: int, jobs: list[tuple[str, str, tuple]]) -> None:
        fed = None
        with log_path.open("a") as log:
            for link, arm, point in jobs:
                key = (phase, seed, link, arm, tuple(point))
                if key in done:
                    continue
                fed = fed or load_federation(seed)
                config = (AsyncConfig(mode="sync", link=link, privacy="none", local_steps=60, expected_batch_size=128,
                                      learning_rate=10.0, class_reweighting=0.0,
                                      training_minutes=settings.training_minutes)
                          if arm == "non-private" else _config(link, arm, point, settings.training_minutes))
                row = {"phase": phase, "seed": seed, "link": link, "arm": arm, "point": list(point),
                       **summarise(run_async(fed, config, seed=seed), config.planned_updates)}
                done[key] = row
                log.write(json.dumps(row) + "\n")
                log.flush()
        say(f"{phase} seed {seed}: done ({(time.monotonic() - started) / 60:.1f} min)")

    grid = GRIDS[settings.grid]
    tuning_jobs = [(link, arm, p) for link in settings.links for arm in settings.arms
                   for p in grid["sync" if arm == "sync" else "fedbuff"]]
    for seed in settings.tuning_seeds:
        run_all("tune", seed, tuning_jobs)
    best: dict[tuple[str, str], tuple] = {}
    for link, arm in itertools.product(settings.links, settings.arms):
        points = grid["sync" if arm == "sync" else "fedbuff"]
        scored = [(_score([done[("tune", s, link, arm, tuple(p))] for s in settings.tuning_seeds]), tuple(p))
                  for p in points]
        best[(link, arm)] = max(scored)[1]
    report_jobs = [(link, arm, best[(link, arm)]) for link in settings.links for arm in settings.arms]
    report_jobs.append(("always-on", "non-private", (0.0, 1.0)))
    for seed in settings.seeds:
        run_all("report", seed, report_jobs)
    rows = [r for r in done.values() if r["phase"] == "report"]
    result = {"settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()
                           if k != "out_dir"},
              "best": {f"{link}/{arm}": list(p) for (link, arm), p in best.items()}, "runs": rows,
              "elapsed_min": (time.monotonic() - started) / 60}
    (out_dir / "fedbuff.json").write_text(json.dumps(result, indent=1))
    tuning = [r for r in done.values() if r["phase"] == "tune"]
    (out_dir / "fedbuff.md").write_text(markdown(rows, best, settings, tuning))
    _plot(rows, settings, out_dir / "fedbuff.png")
    say(f"wrote {out_dir}")
    return out_dir


def _cell(values: list[float | None], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± sd`` of the values present, ``(n of N)`` added when some are missing (e.g. a budget not spent
    within the horizon)."""
    stat = mean_sd(values)
    if stat is None:
        return "n/a"
    text = f"{scale * stat[0]:.{digits}f} ± {scale * stat[1]:.{digits}f}"
    return text if stat[2] == len(values) else f"{text} ({stat[2]} of {len(values)})"


def _diff(a: list[float | None], b: list[float | None], scale: float = 100.0, digits: int = 1) -> str:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 2:
        return "n/a"
    d = paired_interval([x for x, _ in pairs], [y for _, y in pairs])
    return f"{scale * d['mean']:+.{digits}f} [{scale * d['low']:+.{digits}f}, {scale * d['high']:+.{digits}f}]"


MEASURES = (("acc_6h", "accuracy at 6 h (%)", 100.0), ("acc_24h", "accuracy at 24 h (%)", 100.0),
            ("acc_half", "accuracy at half budget (%)", 100.0), ("acc_budget", "accuracy, budget spent (%)", 100.0),
            ("hours_to_budget", "hours to spend the budget", 1.0),
            ("discarded_fraction", "charged budget discarded (%)", 100.0))


def markdown(rows: list[dict[str, Any]], best: dict[tuple[str, str], tuple], settings: FedBuffSettings,
             tuning: list[dict[str, Any]]) -> str:
    """The tables: per link model, each arm's mean ± sd over the reported seeds and each FedBuff arm minus sync
    (paired, 95 % t-interval); the chosen configurations; what sync's deadlines discarded in the tuning runs
    (``tuning``: their rows); accuracy per IUCN group and epsilon per category, with the headroom."""
    deadlines = sorted({r["point"][0] for r in tuning if r["arm"] == "sync"})
    tuning = [r for r in tuning if r["arm"] == "sync"]

    def values(link: str, arm: str, key: str) -> list[Any]:
        by_seed = {r["seed"]: r[key] for r in rows if r["link"] == link and r["arm"] == arm}
        return [by_seed.get(s) for s in settings.seeds]

    seeds, tuning_seeds = ", ".join(map(str, settings.seeds)), ", ".join(map(str, settings.tuning_seeds))
    lines = [f"Reported seeds {seeds}; tuned on {tuning_seeds} (grid {settings.grid}); CCDP gamma 1, VU = 1, "
             f"10 planned updates per site; training {settings.training_minutes:g} min per update; horizon 7 days; "
             "mean ± sd over seeds, differences paired.", ""]
    for link in settings.links:
        lines += [f"### {link}", "", "| measure | " + " | ".join(settings.arms) + " | "
                  + " | ".join(f"{a} − sync [95 % CI]" for a in settings.arms if a != "sync") + " |",
                  "|---" * (1 + 2 * len(settings.arms) - ("sync" in settings.arms)) + "|"]
        for key, label, scale in MEASURES:
            cells = [_cell(values(link, a, key), scale, 1 if scale > 1 else 2)
                     for a in settings.arms]
            diffs = [_diff(values(link, a, key), values(link, "sync", key), scale, 1 if scale > 1 else 2)
                     for a in settings.arms if a != "sync" and "sync" in settings.arms]
            lines.append(f"| {label} | " + " | ".join(cells + diffs) + " |")
        lines.append("")
    lines += ["Chosen configurations (sync: deadline minutes, server lr; FedBuff: K, server lr):", ""]
    lines += [f"- {link} / {arm}: {best[(link, arm)]}" for link, arm in best]
    lines += ["", "Sync's deadline on the tuning seeds: charged budget discarded (%, mean over seeds and server "
              "learning rates):", "", "| link | " + " | ".join(f"{d:g} min" for d in deadlines) + " |",
              "|---" * (len(deadlines) + 1) + "|"]
    for link in settings.links:
        lines.append(f"| {link} | " + " | ".join(
            _cell([r["discarded_fraction"] for r in tuning if r["link"] == link and r["point"][0] == d])
            for d in deadlines) + " |")
    groups = ("CR/EN", "VU/NT", "LC", "NE")
    lines += ["", "Accuracy per IUCN group once the budget is spent (%), and epsilon per category then (the largest "
              "over sites and seeds):", "", "| link / arm | " + " | ".join(groups) + " | epsilon |",
              "|---" * (len(groups) + 2) + "|"]
    for link, arm in list(best) + [("always-on", "non-private")]:
        rs = [r for r in rows if r["link"] == link and r["arm"] == arm]
        if not rs:
            continue
        eps: dict[str, float] = {}
        for r in rs:
            for c, e in r["eps_budget"].items():
                eps[c] = max(eps.get(c, 0.0), e)
        lines.append(f"| {link} / {arm} | " + " | ".join(_cell([r["groups_budget"][g] for r in rs]) for g in groups)
                     + " | " + (", ".join(f"{c} {e:.2f}" for c, e in eps.items()) or "∞ (no privacy)") + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], settings: FedBuffSettings, path: Path) -> None:
    """Accuracy against wall-clock hours (mean over the reported seeds), one panel per link model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings.links), figsize=(4 * len(settings.links), 3.2), squeeze=False)
    for ax, link in zip(axes[0], settings.links):
        for arm in settings.arms + ("non-private",):
            rs = [r["curve"] for r in rows if r["link"] == link and r["arm"] == arm]
            if rs:
                ax.plot(CURVE_HOURS, [sum(c[i] for c in rs) / len(rs) for i in range(len(CURVE_HOURS))], label=arm)
        ax.set(title=link, xlabel="simulated hours", ylabel="held-out accuracy", ylim=(0, 1))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

