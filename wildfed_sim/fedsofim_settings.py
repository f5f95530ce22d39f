"""What the DP-FedSOFIM experiment (:mod:`wildfed_sim.fedsofim`) runs on: its settings, its result record, and
each seed's prepared data (splits, the public-split reference head, the frozen backbone's embeddings).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError

from wildfed_sim.common.demo_data import balanced_public_split
from wildfed_sim.fedsofim_head import BIAS, OPTIMIZERS, WEIGHT, HeadData, accuracy


@dataclass
class FedSofimSettings:
    """The experiment's settings (module docstring).

    ``seeds``: reported seeds (the protocol asks for at least 5); ``tuning_seeds``: the seeds the grids are run on
    (disjoint from ``seeds``); ``optimizers``: a subset of :data:`OPTIMIZERS`; ``max_widenings``: grid widenings
    per edge of an axis; ``ledger``: record one reported run per cell in ``ledger.db``.

    Raises:
        ConfigError: a value out of range (names the field and the fix).
    """

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    tuning_seeds: tuple[int, ...] = (101, 103)
    clients: tuple[int, ...] = (20, 100)
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0)
    optimizers: tuple[str, ...] = OPTIMIZERS
    rounds: int = 100
    max_widenings: int = 2
    target_delta: float = 1e-5
    clipping_norm: float = 1.0
    public_per_class: int = 100
    val_per_class: int = 70
    test_fraction: float = 0.2
    pretrain_epochs: int = 30
    pretrain_batch_size: int = 64
    pretrain_learning_rate: float = 0.1
    ledger: bool = True
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        checks = [("seeds", bool(self.seeds), "e.g. --seeds 0,1,2,3,4"),
                  ("tuning_seeds", bool(self.tuning_seeds) and not set(self.seeds) & set(self.tuning_seeds),
                   "seeds to tune on that are not reported, e.g. --tuning-seeds 101,103"),
                  ("clients", bool(self.clients) and all(isinstance(k, int) and k >= 1 for k in self.clients),
                   "positive integers, e.g. --clients 20,100"),
                  ("epsilons", bool(self.epsilons) and all(0 < e < math.inf for e in self.epsilons),
                   "positive numbers, e.g. --epsilons 0.5,1,2,5,10"),
                  ("optimizers", bool(self.optimizers) and set(self.optimizers) <= set(OPTIMIZERS),
                   f"some of {','.join(OPTIMIZERS)}"),
                  ("rounds", isinstance(self.rounds, int) and self.rounds >= 1, "e.g. --rounds 100"),
                  ("max_widenings", isinstance(self.max_widenings, int) and self.max_widenings >= 0, "e.g. 2"),
                  ("target_delta", 0 < self.target_delta < 1, "e.g. 1e-5"),
                  ("clipping_norm", self.clipping_norm > 0, "e.g. 1.0"),
                  ("public_per_class", self.public_per_class >= 1, "e.g. 100"),
                  ("val_per_class", self.val_per_class >= 1, "e.g. 70"),
                  ("pretrain_epochs", self.pretrain_epochs >= 1, "e.g. 30")]
        for name, ok, fix in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is out of range", field=name, fix=fix)
        self.optimizers = tuple(m for m in OPTIMIZERS if m in self.optimizers)


@dataclass
class FedSofimResult:
    """What :func:`run_fedsofim_experiment` produced (``cells`` as :func:`markdown_tables` takes them)."""

    out_dir: Path
    cells: list[dict[str, Any]] = field(default_factory=list)
    ceiling: dict[str, Any] = field(default_factory=dict)
    seeds_info: dict[int, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass(frozen=True, eq=False)
class SeedData:
    """One seed's frozen features: the client pool, the validation and the test split, and facts about them."""

    pool: HeadData
    val: HeadData
    test: HeadData
    info: dict[str, Any]

    def clients(self, k: int, seed: int) -> list[HeadData]:
        """The pool shuffled (``default_rng([seed, k, 0x434C49])``) and cut into ``k`` near-equal IID shards."""
        if k > len(self.pool):
            raise ConfigError(f"{k} clients for {len(self.pool)} records", field="clients",
                              fix="use fewer clients")
        order = np.random.default_rng([seed, k, 0x434C49]).permutation(len(self.pool))
        return [HeadData(self.pool.features[i], self.pool.labels[i]) for i in np.array_split(order, k)]


def prepare_seed(settings: FedSofimSettings, seed: int) -> SeedData:
    """Steps 1-5 of the protocol for one seed: splits, the public-split reference head, backbone embeddings."""
    from wildfed_sim.animal_mnist import NUM_CLASSES, fetch_animal_mnist, split_holdout
    from wildfed_sim.evaluation import train_centralised

    t0 = time.monotonic()
    train, test = split_holdout(fetch_animal_mnist(), settings.test_fraction, seed=seed)
    public = balanced_public_split(train.labels, settings.public_per_class, seed=seed)
    rest = np.setdiff1d(np.arange(len(train)), public)
    rng = np.random.default_rng([seed, 0x56414C])
    val = np.sort(np.concatenate([rng.choice(rest[train.labels[rest] == c], settings.val_per_class, replace=False)
                                  for c in range(NUM_CLASSES)]))
    pool = np.setdiff1d(rest, val)
    from wildfed_sim.embeddings import embed_grayscale

    features = embed_grayscale(train.images, train.source_indices)  # the frozen public backbone, cached
    weights = train_centralised(features[public], train.labels[public], num_classes=NUM_CLASSES,
                                epochs=settings.pretrain_epochs, batch_size=settings.pretrain_batch_size,
                                learning_rate=settings.pretrain_learning_rate, seed=seed)

    def data(images: np.ndarray, labels: np.ndarray, sources: np.ndarray) -> HeadData:
        return HeadData(embed_grayscale(images, sources), np.asarray(labels, np.int64))

    test_data = data(test.images, test.labels, test.source_indices)
    info = {"train": len(train), "test": len(test), "public": int(len(public)), "val": int(len(val)),
            "client_pool": int(len(pool)),
            "public_model_test_accuracy": accuracy({WEIGHT: weights["psi.weight"], BIAS: weights["psi.bias"]},
                                                   test_data),
            "prepare_s": time.monotonic() - t0}
    return SeedData(pool=HeadData(features[pool], np.asarray(train.labels[pool], np.int64)),
                    val=HeadData(features[val], np.asarray(train.labels[val], np.int64)), test=test_data, info=info)

