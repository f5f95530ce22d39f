"""What a site can train on, in numbers: records per species and IUCN category, and whether each category's
records can learn under the noise of the federation's plan (:mod:`edge_sdk.field.learnability`).

The noise comes from the latest round this gateway trained (the plan it ran is kept in ``<state>/last-plan.json``:
public values only) or, before any round, from a plan calibrated here with the real accountant for stated
the coordinator's plan written into ``site.yaml`` at provisioning (``federation_plan``, :mod:`edge_sdk.federation_plan`)
or, without one, stated assumptions: :data:`ASSUMED` (the demo's defaults: 10 rounds of one local step, expected
batch 1024, CCDP gamma 1 with VU at epsilon 1, delta 1e-5, clipping norm 1); ``wildfed-edge check-config`` prints
which.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.iucn import CCDPBudget, IUCNCategory

from edge_sdk.config import SiteConfig
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.field.learnability import CategorySignal, signal_to_noise
from edge_sdk.site_paths import state_dir

__all__ = ["ASSUMED", "SpeciesCount", "last_plan_path", "save_last_plan", "species_counts", "category_signals"]

#: The plan assumed before the first round (the demo's defaults; docs/privacy.md).
ASSUMED = {"rounds": 10, "local_steps": 1, "expected_batch": 1024, "anchor_epsilon": 1.0, "gamma": 1.0,
           "target_delta": 1e-5, "clipping_norm": 1.0, "variant": "sample"}


@dataclass(frozen=True)
class SpeciesCount:
    """A species of the site's table: its category, its training records and its photos labelled by the machine
    only (not training unless ``train_on: machine``)."""

    scientific_name: str
    category: IUCNCategory
    records: int


def last_plan_path(config: SiteConfig) -> Path:
    """``<state>/last-plan.json``."""
    return state_dir(config) / "last-plan.json"


def save_last_plan(config: SiteConfig, *, round_: int, plan: object | None, steps: int, parameters: int) -> None:
    """Keep the public values of the plan a round ran (noise, rates, norms, the federation's planned steps, the
    model size), for ``check-config``; ``plan`` None: the round was not private (no noise)."""
    body: dict[str, object] = {"round": int(round_), "privacy": "none"}
    if plan is not None:
        p: Any = plan
        body = {"round": int(round_), "noise_std": float(p.noise_std), "steps": int(steps),
                "parameters": int(parameters),
                "sampling_rates": {c.value: float(v) for c, v in p.sampling_rates.items()},
                "clipping_norms": {c.value: float(v) for c, v in p.clipping_norms.items()}}
    path = last_plan_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2), encoding="utf-8")
    tmp.replace(path)


def species_counts(config: SiteConfig, dataset: LocalDataset) -> list[SpeciesCount]:
    """Training records per species of the site's table (zeros included), in table order."""
    by_class = Counter(int(label) for label in dataset.labels)
    return [SpeciesCount(s.scientific_name, s.iucn_category, by_class.get(s.class_index, 0)) for s in config.species]


def category_signals(config: SiteConfig, dataset: LocalDataset) -> tuple[list[CategorySignal], str]:
    """Each category's best-case signal against its noise, and where the noise came from (a sentence).

    Raises:
        ConfigError: the assumed plan cannot be calibrated (from ``edge_sdk.privacy.ccdp.plan_ccdp``).
    """
    counts = dataset.category_counts()
    path = last_plan_path(config)
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        rates = {IUCNCategory(k): v for k, v in saved["sampling_rates"].items()}
        norms = {IUCNCategory(k): v for k, v in saved["clipping_norms"].items()}
        rows = signal_to_noise(counts, sampling_rates=rates, clipping_norms=norms, noise_std=saved["noise_std"],
                               steps=saved["steps"], parameters=saved["parameters"])
        return rows, f"the plan of round {saved['round']}, the latest this gateway trained ({path})"
    from edge_sdk.privacy.ccdp import plan_ccdp

    fp = config.federation_plan
    a = ASSUMED if fp is None else {"rounds": fp.rounds, "local_steps": fp.local_steps,
                                    "expected_batch": fp.expected_batch, "target_delta": fp.target_delta,
                                    "clipping_norm": fp.clipping_norm, "variant": fp.variant}
    n = fp.capacity if fp is not None and fp.capacity is not None else max(1, len(dataset))  # as the rounds divide
    steps = a["rounds"] * a["local_steps"]
    budgets = (CCDPBudget.from_anchor(IUCNCategory.VU, a["anchor_epsilon"], gamma=a["gamma"]).table() if fp is None
               else {IUCNCategory(code): eps for code, eps in fp.budgets.items()})
    plan = plan_ccdp(variant=a["variant"], budgets=budgets, active=config.categories,
                     target_delta=a["target_delta"], sampling_rate=min(1.0, a["expected_batch"] / n), steps=steps,
                     clipping_norm=a["clipping_norm"], site_categories=config.categories)
    parameters = 1280 * config.model_classes + config.model_classes
    rows = signal_to_noise(counts, sampling_rates=plan.sampling_rates, clipping_norms=plan.clipping_norms,
                           noise_std=plan.noise_std, steps=steps, parameters=parameters)
    if fp is not None:
        return rows, ("no round trained yet: the coordinator's plan written at provisioning, {rounds} rounds x "
                      "{local_steps} steps, expected batch {expected_batch} of {n} ({of}), delta {target_delta:g}, "
                      "the head only ({p} parameters); the report after the first round uses the plan that ran"
                      ).format(**a, p=parameters, n=n, of="the declared capacity" if fp.capacity is not None
                               else "the records held: the site declared no capacity")
    return rows, ("no round trained yet: an assumed plan of {rounds} rounds x {local_steps} step, expected batch "
                  "{expected_batch}, CCDP gamma {gamma:g} with VU at epsilon {anchor_epsilon:g}, delta "
                  "{target_delta:g}, the head only ({p} parameters); your coordinator's plan may differ, and the "
                  "report after the first round uses the plan that ran").format(**a, p=parameters)
