"""``wildfed experiment real-photos``: the leave-one-site-out experiment of :mod:`wildfed_sim.real_photos`, every
fold of every reserve, with a table per reserve and a JSON record of every prediction.

    wildfed experiment real-photos --reserves ena24,camtrapr --dp-seeds 5 --out runs/real-photos
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from wildfed_sim.real_photo_sites import Reserve, reserve as build_reserve
from wildfed_sim.real_photos import (DP_GRID, GD_GRID, SiteCrops, scored_mask, central_head, inner_choice, predict,
                                     run_federation, site_crops)

__all__ = ["dp_choice", "run_experiment"]

_TUNING_DRAWS = (101, 102)


def dp_choice(train: list[SiteCrops], reserve: Reserve) -> tuple[float, int]:
    """The DP grid point with the most correct inner held-out crops, by the in-process replay of the federation
    (:func:`wildfed_sim.demo_sim.simulate`: the gateways' own training, FedAvg, server SGD) over an inner
    leave-one-site-out on ``train`` and the tuning noise draws (never the reported runs' draws)."""
    from shared.iucn import IUCNCategory
    from wildfed_sim.demo_sim import SimConfig, SimFederation, SimSite, simulate

    cats = tuple(IUCNCategory(e["iucn_category"]) for e in reserve.species_table())
    ranks = np.array([c.rank for c in cats], np.int8)
    best, best_score = DP_GRID[0], -1.0
    for lr, rounds in DP_GRID:
        score = 0.0
        for i, inner in enumerate(train):
            rest = [s for j, s in enumerate(train) if j != i]
            sites = tuple(SimSite(s.site_id, s.features, s.labels, ranks[s.labels],
                                  tuple(sorted({cats[int(y)] for y in s.labels}, key=lambda c: c.rank)),
                                  tuple(sorted({int(y) for y in s.labels}))) for s in rest)
            mask = scored_mask(inner, rest)
            fed = SimFederation(sites, inner.features[mask], inner.labels[mask],
                                np.zeros((0, inner.features.shape[1]), np.float32), cats)
            config = SimConfig(rounds=rounds, local_steps=1, expected_batch_size=64, learning_rate=lr, centre=False)
            for draw in _TUNING_DRAWS:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = simulate(fed, config, seed=0, noise_seed=draw)
                score += out["final"]["overall"] * int(mask.sum())
        if score > best_score:
            best, best_score = (lr, rounds), score
    return best


def _counts(pred: np.ndarray, test: SiteCrops, mask: np.ndarray, classes: tuple[str, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for y, p, m in zip(test.labels, pred, mask):
        if m:
            entry = out.setdefault(classes[int(y)], [0, 0])
            entry[0] += int(p == y)
            entry[1] += 1
    return out


def _fold(res: Reserve, h: int, crops: list[SiteCrops], *, dp_seeds: int, broker: str | None, out: Path,
          cache: Path, console: Any) -> dict[str, Any]:
    test = crops[h]
    train_sources = [s for j, s in enumerate(res.sites) if j != h]
    train = [c for j, c in enumerate(crops) if j != h]
    mask = scored_mask(test, train)
    k = len(res.classes)
    lr, steps = inner_choice(train, k, GD_GRID)
    central = central_head(np.concatenate([c.features for c in train]), np.concatenate([c.labels for c in train]),
                           num_classes=k, learning_rate=lr, steps=steps)
    fold: dict[str, Any] = {"held_out": test.site_id, "scored": int(mask.sum()), "gd": {"lr": lr, "steps": steps}}
    fold["central"] = _counts(predict(central, test.features), test, mask, res.classes)
    fed = run_federation(train_sources, train, res, work=out / res.name / test.site_id / "none", cache=cache,
                         privacy="none", learning_rate=lr, rounds=steps, broker_url=broker, seed=0, console=console)
    fold["federated"] = _counts(predict(fed, test.features), test, mask, res.classes)
    fold["max_abs_weight_gap"] = float(max(np.max(np.abs(fed[n] - central[n])) for n in central))
    dp_lr, dp_rounds = dp_choice(train, res)
    fold["dp"] = {"lr": dp_lr, "rounds": dp_rounds, "runs": []}
    for seed in range(dp_seeds):
        w = run_federation(train_sources, train, res, work=out / res.name / test.site_id / f"ccdp-{seed}",
                           cache=cache, privacy="ccdp", learning_rate=dp_lr, rounds=dp_rounds, broker_url=broker,
                           seed=seed, console=console)
        fold["dp"]["runs"].append(_counts(predict(w, test.features), test, mask, res.classes))
    return fold


def _total(counts: dict[str, list[int]]) -> tuple[int, int]:
    return sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())


def _mean_ci(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.1f}" if values else "-"
    from scipy import stats

    m, s = statistics.mean(values), statistics.stdev(values)
    half = stats.t.ppf(0.975, len(values) - 1) * s / math.sqrt(len(values))
    return f"{m:.1f} [{m - half:.1f}, {m + half:.1f}]"


def run_experiment(reserves: list[str], *, dp_seeds: int, broker: str | None, out: Path, console: Any
                   ) -> dict[str, Any]:
    """Every fold of every reserve (module docstring of :mod:`wildfed_sim.real_photos`); writes ``out/results.json``
    after every fold (a rerun with the same ``out`` resumes: folds already there are not run again) and prints a
    table per reserve. Returns the results."""
    from rich.table import Table

    out.mkdir(parents=True, exist_ok=True)
    cache = out / "embeddings"
    path = out / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}  # resume a stopped run
    for name in reserves:
        res = build_reserve(name, out / "sites")
        crops = [site_crops(s, res, cache) for s in res.sites]
        done = {f["held_out"]: f for f in results.get(name, {}).get("folds", []) if len(f["dp"]["runs"]) == dp_seeds}
        folds = []
        for h in range(len(res.sites)):
            fold = done.get(res.sites[h].site_id) or _fold(res, h, crops, dp_seeds=dp_seeds, broker=broker, out=out,
                                                           cache=cache, console=console)
            folds.append(fold)
            results[name] = {"classes": list(res.classes), "folds": folds}
            path.write_text(json.dumps(results, indent=2))  # after every fold: a stopped run resumes
        table = Table(title=f"{name}: leave-one-site-out, correct / scored crops")
        for col in ("held-out site", "scored", "central head", "federated, no privacy",
                    "federated, CCDP (mean [95% CI])"):
            table.add_column(col)
        for f in folds:
            dp = [_total(r)[0] for r in f["dp"]["runs"]]
            table.add_row(f["held_out"], str(f["scored"]), str(_total(f["central"])[0]), str(_total(f["federated"])[0]),
                          _mean_ci([float(v) for v in dp]))
        console.print(table)
    return results
