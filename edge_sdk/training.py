"""One round of local training: Poisson-sampled DP-SGD steps with the CCDP mechanism (or non-private SGD).

This module wires the pieces and holds no maths of its own: sampling (``edge_sdk.privacy.sampling``), the
mechanism and its calibration (``edge_sdk.privacy.ccdp``), and a training backend (``edge_sdk.backends``). Per step
(Abadi et al. 2016, Alg. 1): sample a batch with rate q from the records of active categories, take per-example
gradients, privatise them (clip, per-category noisy sums, normalise by q * N_active), take one SGD step.

Sampling rate: q = min(1, B / N_active) with B the task's ``expected_batch_size`` and N_active the number of the
site's records whose category is not halted (N_active is the site's declared public metadata, the FedAvg weight,
as ``shared.protocol.UpdateReport`` states). Noise multipliers are calibrated for ``planned_rounds * local_steps``
steps at that q; the events reported are those of the steps actually run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.protocol import TrainingTask, UpdateReport

from edge_sdk.backends.base import TrainingBackend
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.ccdp import CCDPMechanism, active_categories, calibrate_category_noise, category_events
from edge_sdk.privacy.randomness import RandomSource
from edge_sdk.privacy.sampling import poisson_sample

__all__ = ["LocalTrainingResult", "local_step", "train_locally"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalTrainingResult:
    """What one round of local training produced.

    Attributes:
        delta: ``{name: float32 array}``, local minus global weights (same names and shapes as the global model).
        report: the :class:`shared.protocol.UpdateReport` (num_examples = N_active, steps, DP events).
        noise_multipliers: ``{category: z_c}`` used (empty for privacy "none").
        sampling_rate: q.
    """

    delta: dict[str, np.ndarray]
    report: UpdateReport
    noise_multipliers: dict[IUCNCategory, float]
    sampling_rate: float


def local_step(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    eligible: np.ndarray,
    sampling_rate: float,
    mechanism: CCDPMechanism | None,
    randomness: RandomSource,
    learning_rate: float,
) -> int:
    """One step of :func:`train_locally` (also what ``benchmarks/dp_step.py`` times): Poisson-sample a batch of
    eligible records at rate q, then either the CCDP step (implicit per-example gradients -> ``privatize``) or,
    with ``mechanism`` None, a non-private mean-gradient step; then the SGD update.

    Returns:
        The realised batch size (a non-private step with an empty batch is skipped).
    """
    idx = poisson_sample(eligible, sampling_rate, randomness)
    x, y = dataset.images[idx], dataset.labels[idx]
    if mechanism is not None:
        step = mechanism.privatize(backend.per_example(x, y), dataset.categories[idx])
    elif idx.size:
        step = backend.gradient(x, y)
    else:
        return 0  # non-private: an empty batch has no gradient
    backend.apply_gradient(step, learning_rate)
    return int(idx.size)


def train_locally(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    task: TrainingTask,
    global_weights: Mapping[str, np.ndarray],
    site_categories: Iterable[IUCNCategory],
    randomness: RandomSource,
) -> LocalTrainingResult:
    """Run ``task.local_steps`` steps from ``global_weights`` and return the delta and the report.

    Args:
        backend: the training backend (its weights are overwritten).
        dataset: the site's records (images uint8 (N, H, W), labels int64 (N,), categories int8 (N,)).
        task: the decoded training task.
        global_weights: ``{name: float32 array}``, the round's global model.
        site_categories: the categories of the site's species table (public configuration).
        randomness: the source of both sampling and noise (secure in production).

    Raises:
        PrivacyBudgetError: every category is halted or has no records, or an active category has no budget.
        ConfigError: the weights do not fit the backend's model.
    """
    active = active_categories(site_categories, task.halted)
    eligible = np.isin(dataset.categories.astype(np.int64), np.asarray([c.rank for c in active], dtype=np.int64))
    n_active = int(eligible.sum())
    if not active or n_active == 0:
        raise PrivacyBudgetError(
            f"round {task.round}: no record is eligible (active categories {[c.value for c in active]}, "
            f"halted {[c.value for c in task.halted]}): the site does not train"
        )
    q = min(1.0, task.expected_batch_size / n_active)
    backend.set_weights({k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()})
    start = backend.get_weights()

    z: dict[IUCNCategory, float] = {}
    mechanism: CCDPMechanism | None = None
    if task.privacy == "ccdp":
        z = calibrate_category_noise(budgets=task.budgets, active=active, target_delta=task.target_delta,
                                     sampling_rate=q, steps=task.planned_rounds * task.local_steps)
        mechanism = CCDPMechanism(clipping_norm=task.clipping_norm, noise_multipliers=z,
                                  expected_batch_size=q * n_active, noise=randomness)
        log.info("round %d: CCDP q=%.4g, C=%g, z=%s", task.round, q, task.clipping_norm,
                 {c.value: round(v, 4) for c, v in z.items()})

    for _ in range(task.local_steps):
        local_step(backend=backend, dataset=dataset, eligible=eligible, sampling_rate=q, mechanism=mechanism,
                   randomness=randomness, learning_rate=task.learning_rate)

    end = backend.get_weights()
    delta = {name: (end[name] - start[name]).astype(np.float32) for name in start}
    events = category_events(z, sampling_rate=q, steps_run=task.local_steps) if mechanism is not None else {}
    report = UpdateReport(num_examples=n_active, local_steps=task.local_steps, events=events)
    return LocalTrainingResult(delta=delta, report=report, noise_multipliers=z, sampling_rate=q)
