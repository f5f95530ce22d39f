"""What the NIRA head experiment (:mod:`wildfed_sim.nira_sim`) compares and how it is set: the trainings and
reported methods (:data:`TRAININGS`, :data:`METHODS`, :data:`BASELINES`), the tuning grids (:func:`grid_for`), the
metrics, and the experiment's settings and result record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

from wildfed_sim.nira_sim_structures import STRUCTURES

MIN_CLUSTER_RECORDS = 800
COUNT_NOISE = 100.0  # the coordinator config's default count_noise_multiplier
#: training name -> the strategy it runs (``None``: FedAvg) as keyword arguments of NIRA
TRAININGS: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "nira": {},
    "nira-head-only": {},
    "nira-inverse-variance": {"phi_weighting": "inverse_variance"},
    "nira-clusters": {"phi_weighting": "clusters"},
    "nira-no-merging": {"embedding_merging": False},
    "nira-min-records": {"min_cluster_records": MIN_CLUSTER_RECORDS},
    "nira-recluster": {"recluster_every": 2, "min_rounds_between_moves": 2, "recluster_min_snr": 0.0},
    "nira-noisy-counts": {"count_noise": COUNT_NOISE},
}
LEARNING_RATES = (1.0, 2.0, 4.0, 8.0, 16.0)
#: (learning rate, adapter width) tried for FedAvg: the head alone or with a 64-wide adapter
GRID: tuple[tuple[float, int], ...] = tuple((lr, h) for h in (0, 64) for lr in LEARNING_RATES)
#: NIRA's phi is the adapter: the same number of points, two adapter widths
NIRA_GRID: tuple[tuple[float, int], ...] = tuple((lr, h) for h in (16, 64) for lr in LEARNING_RATES)
#: the ablation without phi (per-cluster heads on the frozen embeddings): FedAvg's head-only points
HEAD_ONLY_GRID: tuple[tuple[float, int], ...] = tuple((lr, 0) for lr in LEARNING_RATES)


def grid_for(training: str, grid: Sequence[tuple[float, int]] | None = None) -> tuple[tuple[float, int], ...]:
    """The tuning grid of ``training``: ``grid`` when given (every training), else :data:`GRID` for FedAvg,
    :data:`HEAD_ONLY_GRID` for ``nira-head-only`` and :data:`NIRA_GRID` for the other NIRA trainings."""
    if grid is not None:
        return tuple(grid)
    return GRID if training == "fedavg" else HEAD_ONLY_GRID if training == "nira-head-only" else NIRA_GRID
FINE_TUNE_STEPS: tuple[int, ...] = (25, 100)


@dataclass(frozen=True)
class Method:
    """One reported method: a training (key of :data:`TRAININGS`) and how each site scores its model
    (``"plain"``: 10-way argmax; ``"mask"``: argmax over the site's species; ``"fine-tune"``: the site's
    locally fine-tuned head, plain argmax)."""

    name: str
    training: str
    scoring: str
    label: str


METHODS: tuple[Method, ...] = (
    Method("fedavg", "fedavg", "plain", "FedAvg"),
    Method("fedavg+mask", "fedavg", "mask", "FedAvg + species mask"),
    Method("fedavg+fine-tune", "fedavg", "fine-tune", "FedAvg + local fine-tuning"),
    Method("nira", "nira", "plain", "NIRA (phi by records, merging)"),
    Method("nira+mask", "nira", "mask", "NIRA + species mask"),
    Method("nira-head-only", "nira-head-only", "plain", "NIRA without phi (per-cluster heads only)"),
    Method("nira-inverse-variance", "nira-inverse-variance", "plain", "NIRA, phi by inverse noise variance"),
    Method("nira-clusters", "nira-clusters", "plain", "NIRA, phi by sites per cluster, C_m/K (seed)"),
    Method("nira-no-merging", "nira-no-merging", "plain", "NIRA, no embedding merging"),
    Method("nira-min-records", "nira-min-records", "plain", f"NIRA, clusters >= {MIN_CLUSTER_RECORDS} records"),
    Method("nira-recluster", "nira-recluster", "plain", "NIRA, re-clustering every 2 rounds"),
    Method("nira-noisy-counts", "nira-noisy-counts", "plain", "NIRA, merging by noisy counts (charged)"),
)
BASELINES = ("fedavg", "fedavg+mask", "fedavg+fine-tune")
METRICS = ("macro", "site_mean", "rare", "cr_en")


@dataclass
class NiraHeadSettings:
    """The experiment's settings (module docstring). The federation's hyper-parameters not in :data:`GRID` are
    the demo's tuned CCDP defaults (:data:`wildfed_sim.demo.DP_DEFAULTS`)."""

    seeds: tuple[int, ...] = tuple(range(10))
    tuning_seeds: tuple[int, ...] = (101, 103)
    methods: tuple[str, ...] = tuple(m.name for m in METHODS)
    sites: int = 8
    structure: str = "demo"
    rounds: int = 10
    local_steps: int = 1
    expected_batch_size: int = 1024
    clipping_norm: float = 1.0
    server_momentum: float = 0.5
    target_delta: float = 1e-5
    grid: tuple[tuple[float, int], ...] | None = None
    ceiling_epochs: int = 30
    ceiling_learning_rate: float = 0.5
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        known = {m.name for m in METHODS}
        checks = [("seeds", bool(self.seeds), "e.g. --seeds 0,1,2,3,4"),
                  ("tuning_seeds", bool(self.tuning_seeds) and not set(self.tuning_seeds) & set(self.seeds),
                   "tuning seeds must be given and must not be reported seeds, e.g. --tuning-seeds 101,103"),
                  ("methods", bool(self.methods) and set(self.methods) <= known,
                   f"a subset of {sorted(known)}"),
                  ("sites", self.sites >= 2, "e.g. --sites 8"),
                  ("structure", self.structure in STRUCTURES, f"one of {STRUCTURES}"),
                  ("rounds", self.rounds >= 1, "e.g. --rounds 10"),
                  ("grid", self.grid is None or bool(self.grid), "at least one (learning rate, adapter width) point")]
        for name, ok, fix in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is not valid", field=name, fix=fix)


@dataclass
class NiraHeadResult:
    """What :func:`run_nira_head_experiment` produced (fractions)."""

    out_dir: Path
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
