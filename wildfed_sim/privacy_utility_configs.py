"""The privacy-utility experiment's configurations (:class:`Configuration`: privacy mode, budgets, clipping and
sampling variants), the paired comparisons it reports, the uniform references of the mixture prediction, and the
tuning grids every configuration is tuned on with the same effort (:func:`grid_for`), and the experiment's
settings (:class:`PrivacyUtilitySettings`, the CLI's flags) and result (:class:`PrivacyUtilityResult`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory

__all__ = ["Configuration", "CONFIGURATIONS", "COMPARISONS", "MIXTURE_REFERENCE", "DP_GRID", "GLOBAL_GRID",
           "NON_PRIVATE_GRID", "TINY_GRID", "LEARNING_RATES", "MOMENTA", "grid_for", "PrivacyUtilitySettings",
           "PrivacyUtilityResult"]


@dataclass(frozen=True)
class Configuration:
    """One row of the table.

    Attributes:
        name, label: identifier and display name.
        privacy: ``"none"``, ``"ccdp"`` (local DP at each gateway) or ``"global"`` (secure aggregation).
        gamma: CCDP exponent (0 = uniform DP), with ``epsilon`` the budget of VU (uniform: every category's).
        variant: individualized DP-SGD ``"sample"`` or ``"scale"`` (local CCDP).
        global_noise: ``"trusted-server"`` or ``"distributed"`` (Global DP).
        tolerated_dropouts: distributed Global DP: the secure-aggregation threshold is ``sites - tolerated_dropouts``
            and the Skellam shares are calibrated for it (None: the coordinator's default threshold
            ``floor(sites / 2) + 1``, :func:`coordinator.global_dp.secagg_settings`).
        class_reweighting: local CCDP: the exponent of the class-row re-weighting after training
            (``TrainingTask.class_reweighting``; 0 = off).
    """

    name: str
    label: str
    privacy: str
    gamma: float = 0.0
    epsilon: float = 1.0
    variant: str = "sample"
    global_noise: str = "trusted-server"
    tolerated_dropouts: int | None = None
    class_reweighting: float = 0.0

    def threshold(self, sites: int) -> int | None:
        """The secure-aggregation threshold t for ``sites`` sites (None: the coordinator's default)."""
        return None if self.tolerated_dropouts is None else max(2, int(sites) - int(self.tolerated_dropouts))

    def budgets(self) -> dict[IUCNCategory, float]:
        """Epsilon per category (:meth:`shared.iucn.CCDPBudget.from_anchor` at VU; uniform for gamma 0)."""
        return CCDPBudget.from_anchor("VU", self.epsilon, self.gamma).table()


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("none", "no privacy (ceiling)", "none"),
    Configuration("uniform-eps0.33", "uniform eps 0.33", "ccdp", 0.0, 1 / 3),
    Configuration("uniform-eps1", "uniform eps 1", "ccdp", 0.0, 1.0),
    Configuration("uniform-eps2", "uniform eps 2", "ccdp", 0.0, 2.0),
    # uniform DP at CCDP gamma 1's other budgets (EN, NT, LC): with the three above, the per-category reference
    # of the mixture prediction (:func:`mixture_prediction`)
    Configuration("uniform-eps0.67", "uniform eps 0.67", "ccdp", 0.0, 2 / 3),
    Configuration("uniform-eps1.33", "uniform eps 1.33", "ccdp", 0.0, 4 / 3),
    Configuration("uniform-eps1.67", "uniform eps 1.67", "ccdp", 0.0, 5 / 3),
    Configuration("ccdp-g1-sample", "CCDP g1 sample", "ccdp", 1.0, 1.0, "sample"),
    Configuration("ccdp-g1-scale", "CCDP g1 scale", "ccdp", 1.0, 1.0, "scale"),
    Configuration("ccdp-g1-sample-rw", "CCDP g1 sample, class re-weighting 0.5", "ccdp", 1.0, 1.0, "sample",
                  class_reweighting=0.5),
    Configuration("ccdp-g2-sample", "CCDP g2 sample", "ccdp", 2.0, 1.0, "sample"),
    Configuration("ccdp-g2-sample-rw", "CCDP g2 sample, class re-weighting 0.5", "ccdp", 2.0, 1.0, "sample",
                  class_reweighting=0.5),
    Configuration("ccdp-g2-scale", "CCDP g2 scale", "ccdp", 2.0, 1.0, "scale"),
    Configuration("global-ccdp-g1-trusted", "Global CCDP g1 trusted", "global", 1.0, 1.0),
    Configuration("global-ccdp-g1-distributed", "Global CCDP g1 distributed", "global", 1.0, 1.0,
                  global_noise="distributed"),
    Configuration("global-uniform-eps0.33-distributed", "Global uniform 0.33 distributed", "global", 0.0, 1 / 3,
                  global_noise="distributed"),
    Configuration("global-ccdp-g1-distributed-1dropout", "Global CCDP g1 distributed, 1 dropout tolerated", "global",
                  1.0, 1.0, global_noise="distributed", tolerated_dropouts=1),
)

#: CCDP gamma 1's budget per category and the uniform configuration that gives every record that budget (the
#: mixture prediction's reference)
MIXTURE_REFERENCE: dict[str, str] = {"CR": "uniform-eps0.33", "EN": "uniform-eps0.67", "VU": "uniform-eps1",
                                     "NT": "uniform-eps1.33", "LC": "uniform-eps1.67", "NE": "uniform-eps2"}

#: (a, b, what it tests): paired differences a - b reported with 95 % intervals (the experiment's acceptance)
COMPARISONS: tuple[tuple[str, str, str], ...] = (
    ("ccdp-g1-sample", "uniform-eps0.33", "CCDP g1 vs CR's protection for all (>= +15 points)"),
    ("ccdp-g1-sample", "uniform-eps2", "CCDP g1 vs its upper end (within 3 points)"),
    ("ccdp-g1-sample", "ccdp-g1-scale", "Sample vs Scale (picks the default variant)"),
    ("ccdp-g2-sample", "ccdp-g2-scale", "Sample vs Scale at gamma 2"),
    ("global-ccdp-g1-distributed", "global-ccdp-g1-trusted", "distributed vs trusted server (within 2)"),
    ("global-ccdp-g1-distributed", "ccdp-g1-sample", "distributed Global vs local DP (>= +5)"),
    ("global-ccdp-g1-distributed", "global-uniform-eps0.33-distributed", "CCDP vs uniform 0.33, distributed"),
    ("ccdp-g1-sample-rw", "ccdp-g1-sample", "square-root class re-weighting (post-processing) at gamma 1"),
    ("ccdp-g2-sample-rw", "ccdp-g2-sample", "square-root class re-weighting at gamma 2"),
    ("ccdp-g1-sample-rw", "uniform-eps0.33", "CCDP g1 re-weighted vs CR's protection for all (>= +15)"),
    ("ccdp-g1-sample-rw", "uniform-eps2", "CCDP g1 re-weighted vs its upper end (within 3)"),
    ("global-ccdp-g1-distributed", "ccdp-g1-sample-rw", "distributed Global vs re-weighted local DP (>= +5)"),
    ("global-ccdp-g1-distributed-1dropout", "global-ccdp-g1-trusted",
     "distributed calibrated for n - 1 survivors vs trusted server"),
)

#: the learning rates of every grid: a first run with 2-8 chose 2 or 8 for three configurations, so 1 and 16 were
#: added for all (the same effort for every configuration)
LEARNING_RATES = (1.0, 2.0, 4.0, 8.0, 16.0)
#: (rounds, local_steps, clipping_norm, learning_rate) for local DP; 25 points
DP_GRID: tuple[tuple[int, int, float, float], ...] = tuple(
    (r, s, c, lr) for (r, s, c) in ((10, 1, 1.0), (10, 2, 1.0), (10, 1, 0.5), (10, 1, 2.0), (20, 1, 1.0))
    for lr in LEARNING_RATES)
#: Global DP: one step per round, so the local-steps axis becomes another clipping norm; 25 points
GLOBAL_GRID: tuple[tuple[int, int, float, float], ...] = tuple(
    (r, 1, c, lr) for (r, c) in ((10, 1.0), (10, 0.25), (10, 0.5), (10, 2.0), (20, 1.0)) for lr in LEARNING_RATES)
#: no privacy (no clipping: the mean gradient's norm is ~20, hence the larger steps); 25 points
NON_PRIVATE_GRID: tuple[tuple[int, int, float, float], ...] = tuple(
    (r, s, 1.0, lr) for (r, s) in ((10, 10), (10, 30), (10, 60), (20, 30), (20, 60))
    for lr in (0.3, 1.0, 3.0, 10.0, 30.0))
#: stage 2 of the tuning (grid "full"): these server momenta besides the fixed one, at each configuration's best
#: point of stage 1 (2 more points for every configuration)
MOMENTA = (0.0, 0.5, 0.8)
#: a one-point grid (tests and smoke runs: ``--grid tiny``)
TINY_GRID: tuple[tuple[int, int, float, float], ...] = ((2, 1, 1.0, 4.0),)


def grid_for(config: Configuration, grid: str) -> tuple[tuple[int, int, float, float], ...]:
    """The tuning grid of ``config``: ``grid`` ``"full"`` (the module's grids) or ``"tiny"`` (one point)."""
    if grid == "tiny":
        return TINY_GRID if config.privacy != "none" else ((2, 10, 1.0, 3.0),)
    return {"none": NON_PRIVATE_GRID, "global": GLOBAL_GRID}.get(config.privacy, DP_GRID)


@dataclass(frozen=True)
class PrivacyUtilitySettings:
    """Knobs of the experiment (the CLI's flags).

    ``seeds``: reported seeds (at least 1; the protocol asks for 5); ``tuning_seeds``: the seeds the grid is run
    on (disjoint from ``seeds``); ``configurations``: names from :data:`CONFIGURATIONS`; ``grid``: ``"full"`` or
    ``"tiny"``; ``processes``: worker processes; ``sites``: sites of the demo design; ``expected_batch_size`` B,
    ``target_delta``: fixed for every configuration (the demo's); ``server_momentum``: the momentum of the tuning's
    stage 1 (stage 2 tries :data:`MOMENTA` at each configuration's best point).

    Raises:
        ConfigError: no seed, repeated seeds, a tuning seed among the reported ones, unknown configuration or grid.
    """

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    tuning_seeds: tuple[int, ...] = (101, 103)
    configurations: tuple[str, ...] = tuple(c.name for c in CONFIGURATIONS)
    grid: str = "full"
    processes: int = 2
    sites: int = 8
    expected_batch_size: int = 1024
    server_momentum: float = 0.5
    target_delta: float = 1e-5
    prediction_tau: float = 1.0
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prediction_tau) and self.prediction_tau >= 0):
            raise ConfigError(f"prediction_tau must be a finite number >= 0, got {self.prediction_tau!r}",
                              field="prediction_tau", fix="use 1 (the balanced-error rule) or 0 (as trained)")
        for name in ("seeds", "tuning_seeds"):
            seeds = getattr(self, name)
            if not seeds:
                raise ConfigError(f"{name} is empty", field=name, fix="give at least one seed, e.g. 0,1,2,3,4")
            if len(set(seeds)) != len(seeds):
                raise ConfigError(f"{name} repeat: {seeds}", field=name, fix="list each seed once")
        if set(self.seeds) & set(self.tuning_seeds):
            raise ConfigError(f"seeds {sorted(set(self.seeds) & set(self.tuning_seeds))} are both tuned on and "
                              "reported", field="tuning_seeds", fix="tune on seeds that are not reported")
        known = {c.name for c in CONFIGURATIONS}
        unknown = [c for c in self.configurations if c not in known]
        if unknown or not self.configurations:
            raise ConfigError(f"unknown configuration(s) {unknown}", field="configurations",
                              fix="use some of " + ", ".join(c.name for c in CONFIGURATIONS))
        if self.grid not in ("full", "tiny"):
            raise ConfigError(f"unknown grid {self.grid!r}", field="grid", fix="use full or tiny")
        if self.processes < 1:
            raise ConfigError("processes must be >= 1", field="processes", fix="use 1 or more")


@dataclass
class PrivacyUtilityResult:
    """Everything the experiment measured (also in ``privacy_utility.json``)."""

    out_dir: Path
    tuning: list[dict[str, Any]] = field(default_factory=list)
    chosen: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    round0: dict[str, float] = field(default_factory=dict)
    site_records: dict[str, dict[str, int]] = field(default_factory=dict)
    test_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    mixture: dict[str, Any] | None = None
    elapsed_s: float = 0.0


# ------------------------------------------------------------------------------------------ statistics
