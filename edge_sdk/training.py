"""One round of local training: Poisson-sampled DP-SGD steps with the CCDP mechanism (or non-private SGD), or, in
Global DP mode, the clipped gradient sum of one Poisson-sampled batch (:func:`clipped_sum_locally`).

This module wires the pieces and holds no maths of its own: sampling (``edge_sdk.privacy.sampling``), the
mechanism and its calibration (``edge_sdk.privacy.ccdp``), and a training backend (``edge_sdk.backends``). Per step
(Abadi et al. 2016, Alg. 1): sample a batch with rate q from the records of active categories, take per-example
gradients, privatise them (clip, per-category noisy sums, normalise by q * N_site), take one SGD step.

Sampling rate and normaliser (docs/privacy.md "What halting reveals"): q = min(1, B / N_site) with B the task's
``expected_batch_size`` and N_site the number of the site's records, all categories together (the site's declared
public count, the FedAvg weight reported as ``UpdateReport.num_examples``). Records of a halted category are simply
not sampled, and each step is normalised by q * N_site, so neither q, nor the normaliser, nor ``num_examples``
changes when a category halts: nothing that leaves the gateway is a function of a per-category count (only the noisy
class counts NIRA may ask for, which are noised and charged). Noise multipliers are calibrated for
``planned_rounds * local_steps`` steps at that q; the events reported are those of the steps actually run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError, PayloadError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import TrainingTask, UpdateReport

from edge_sdk.backends.base import TrainingBackend, unflatten
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.data.feature_centre import centred_weights, uncentred_weights
from edge_sdk.privacy.ccdp import (CCDPMechanism, active_categories, calibrate_category_noise, category_events,
                                   clip_factors_from_norms)
from edge_sdk.privacy.per_example import summation_error_bound
from edge_sdk.privacy.randomness import RandomSource
from edge_sdk.privacy.sampling import poisson_sample

__all__ = ["LocalTrainingResult", "model_inputs", "TrainingInputs", "local_step", "train_locally", "ClippedSum",
           "clipped_sum_locally", "noisy_class_counts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalTrainingResult:
    """What one round of local training produced.

    Attributes:
        delta: ``{name: float32 array}``, local minus global weights (same names and shapes as the global model).
        report: the :class:`shared.protocol.UpdateReport` (num_examples = N_site, the public count; steps; DP
            events).
        noise_multipliers: ``{category: z_c}`` used (empty for privacy "none").
        sampling_rate: q = min(1, B / N_site).
    """

    delta: dict[str, np.ndarray]
    report: UpdateReport
    noise_multipliers: dict[IUCNCategory, float]
    sampling_rate: float


def noisy_class_counts(labels: np.ndarray, eligible: np.ndarray, *, num_classes: int, noise_std: float,
                       randomness: RandomSource) -> dict[int, float]:
    """Record counts per class over the eligible records, with Gaussian noise (the Gaussian mechanism, Dwork & Roth
    2014, Thm A.1 / Mironov 2017 for its RDP): one record changes one count by 1, so the L2 sensitivity is 1 and
    ``noise_std`` is the noise multiplier. Every class of the model is released, so which species a site holds
    is hidden by the same noise.

    Args:
        labels: int64 (N,) class indices. eligible: bool (N,) records of active categories.
        num_classes: length of the count vector. noise_std: sigma (0 = exact counts, non-private runs only).

    Returns:
        ``{class index: noisy count}`` for every class in ``range(num_classes)`` (floats, may be negative).
    """
    exact = np.bincount(np.asarray(labels)[np.asarray(eligible, dtype=bool)].astype(np.int64),
                        minlength=num_classes)[:num_classes].astype(np.float64)
    noise = noise_std * randomness.standard_normal(num_classes) if noise_std > 0 else np.zeros(num_classes)
    return {int(c): float(v) for c, v in enumerate(exact + noise)}


def model_inputs(dataset: LocalDataset) -> np.ndarray:
    """What the model trains on: ``dataset.features`` (float32 (N, 1280) backbone embeddings, filled by
    ``edge_sdk.data.embedding.embed_dataset``) when present, else ``dataset.images`` (anything with ``images``,
    ``labels`` and ``categories`` works, e.g. a benchmark's namespace of embeddings in ``images``)."""
    features = getattr(dataset, "features", None)
    return features if features is not None else dataset.images


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
    x, y = model_inputs(dataset)[idx], dataset.labels[idx]
    if mechanism is not None:
        sq = getattr(dataset, "input_sq_norms", None)  # TrainingInputs: computed once per record, not per step
        # an empty batch is a noise-only step (its (0, d) gradients need no backend call)
        grads = ((backend.per_example(x, y, input_sq_norms=sq[idx]) if sq is not None else backend.per_example(x, y))
                 if idx.size else np.zeros((0, backend.num_parameters), dtype=np.float32))
        step = mechanism.privatize(grads, dataset.categories[idx])
    elif idx.size:
        step = backend.gradient(x, y)
    else:
        return 0  # non-private: an empty batch has no gradient
    backend.apply_gradient(step, learning_rate)
    return int(idx.size)


class TrainingInputs:
    """A site's records as the training steps read them, prepared once and reused every round: the model inputs
    (``model_inputs(dataset)``, centred by ``feature_centre`` when one is given:
    :mod:`edge_sdk.data.feature_centre`) and, for embeddings, an upper bound of each input's squared L2 norm, which
    the per-example gradient norms of the layer reading the input need at every step (computing it once per record
    instead of once per sampled record per step is what keeps the DP step near the non-private one).

    Attributes:
        features: float32 (N, E) inputs (centred when ``centre`` is not None), or the dataset's images.
        labels: int64 (N,). categories: int8 (N,) IUCN ranks.
        input_sq_norms: float64 (N,) upper bounds of ``||features_i||^2`` (float64 sums raised by the float64
            summation bound), or None for inputs that are not 2-D float arrays.
        centre: the float32 (E,) centre used, or None.

    Raises:
        ConfigError (field ``feature_centre``): a centre whose length is not the inputs' width.
    """

    def __init__(self, dataset: LocalDataset, feature_centre: np.ndarray | None = None) -> None:
        x = model_inputs(dataset)
        self.centre = None if feature_centre is None else np.asarray(feature_centre, dtype=np.float32)
        if self.centre is not None:
            if x.ndim != 2 or x.shape[1] != self.centre.shape[0]:
                raise ConfigError(f"feature_centre has {self.centre.shape[0]} values but the model inputs are "
                                  f"{x.shape}", field="feature_centre",
                                  fix="use a centre of the backbone's embedding size")
            x = x - self.centre
        self.features = x
        self.labels = dataset.labels
        self.categories = dataset.categories
        self.input_sq_norms = None
        if x.ndim == 2 and np.issubdtype(x.dtype, np.floating):
            bound = 1.0 + summation_error_bound(int(x.shape[1]), 2.0 ** -53)
            self.input_sq_norms = np.einsum("ij,ij->i", x, x, dtype=np.float64) * bound  # float64 accumulation
        self._n = len(dataset)

    def __len__(self) -> int:
        return self._n


def _eligibility(dataset: LocalDataset, task: TrainingTask, site_categories: Iterable[IUCNCategory]
                 ) -> tuple[tuple[IUCNCategory, ...], np.ndarray, int, float]:
    """``(active categories, eligible mask bool (N,), N_site, q = min(1, B / N_site))``.

    ``N_site = len(dataset)`` is the site's public record count (every category, halted or not); the mask marks the
    records of active categories, the only ones ever sampled. q and N_site depend only on public values (B, the
    site's public count), never on how many records a category holds: a halt changes neither (docs/privacy.md).
    An active category with no records still trains (noise only), so whether the site trains is decided by public
    facts alone (its species table and the halted list).

    Raises:
        PrivacyBudgetError: every category of the site's species table is halted, or the site has no records.
    """
    active = active_categories(site_categories, task.halted)
    if not active:
        raise PrivacyBudgetError(
            f"round {task.round}: every category is halted (halted {[c.value for c in task.halted]}): "
            "the site does not train"
        )
    n_site = len(dataset)
    if n_site == 0:
        raise PrivacyBudgetError(f"round {task.round}: the site has no records: the site does not train")
    eligible = np.isin(dataset.categories.astype(np.int64), np.asarray([c.rank for c in active], dtype=np.int64))
    return active, eligible, n_site, min(1.0, task.expected_batch_size / n_site)


def train_locally(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    task: TrainingTask,
    global_weights: Mapping[str, np.ndarray],
    site_categories: Iterable[IUCNCategory],
    randomness: RandomSource,
    num_classes: int | None = None,
    feature_centre: np.ndarray | None = None,
) -> LocalTrainingResult:
    """Run ``task.local_steps`` steps from ``global_weights`` and return the delta and the report.

    Args:
        backend: the training backend (its weights are overwritten).
        dataset: the site's records (labels int64 (N,), categories int8 (N,)); the model trains on
            :func:`model_inputs`: the backbone embeddings float32 (N, 1280) once ``embed_dataset`` filled them. A
            :class:`TrainingInputs` prepared once (the agent keeps one) saves re-centring and re-measuring the
            inputs every round.
        task: the decoded training task.
        global_weights: ``{name: float32 array}``, the round's global model.
        site_categories: the categories of the site's species table (public configuration).
        randomness: the source of both sampling and noise (secure in production).
        num_classes: length of the count vector when the task asks for counts (default: from ``psi.bias``).
        feature_centre: float32 (E,) public centre ``c`` of the embeddings, or None: the steps then run on
            ``x - c`` with the first layer's bias unfolded to ``b' + W c`` and folded back before the delta is
            taken (:mod:`edge_sdk.data.feature_centre`; the delta is in the plain form the federation stores).

    Raises:
        PrivacyBudgetError: every category is halted or the site has no records, an active category has no
            budget, or the count releases alone would exceed a budget.
        ConfigError: the weights do not fit the backend's model.
        PayloadError: counts asked for and the number of classes unknown.
    """
    active, eligible, n_site, q = _eligibility(dataset, task, site_categories)
    plain = {k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()}
    if isinstance(dataset, TrainingInputs):
        if feature_centre is not None and (dataset.centre is None
                                           or not np.array_equal(dataset.centre, feature_centre)):
            raise ConfigError("the prepared training inputs were centred by another feature centre",
                              field="feature_centre", fix="prepare TrainingInputs with the same centre")
        train_on = dataset
    else:
        train_on = TrainingInputs(dataset, feature_centre)
    centre = train_on.centre
    if centre is None:
        backend.set_weights(plain)
        start = backend.get_weights()
    else:  # train the same function on x - c; the delta is taken in the plain form (module feature_centre)
        backend.set_weights(centred_weights(plain, centre))
        start = plain

    z: dict[IUCNCategory, float] = {}
    mechanism: CCDPMechanism | None = None
    z_count = task.count_noise_multiplier
    # the count releases of every planned round are fixed in advance: calibrate the steps around them
    fixed = (DPSGDEvent(float(z_count), 1.0, task.planned_rounds),) if z_count else ()
    if task.privacy == "ccdp":
        try:
            z = calibrate_category_noise(budgets=task.budgets, active=active, target_delta=task.target_delta,
                                         sampling_rate=q, steps=task.planned_rounds * task.local_steps,
                                         fixed_events=fixed)
        except ConfigError as exc:
            if getattr(exc, "field", None) != "count_noise_multiplier":
                raise
            raise PrivacyBudgetError(f"round {task.round}: {exc}; the site does not train") from None
        mechanism = CCDPMechanism(clipping_norm=task.clipping_norm, noise_multipliers=z,
                                  expected_batch_size=q * n_site, noise=randomness)
        log.info("round %d: CCDP q=%.4g, C=%g, z=%s", task.round, q, task.clipping_norm,
                 {c.value: round(v, 4) for c, v in z.items()})

    for _ in range(task.local_steps):
        local_step(backend=backend, dataset=train_on, eligible=eligible, sampling_rate=q, mechanism=mechanism,
                   randomness=randomness, learning_rate=task.learning_rate)

    end = backend.get_weights()
    if centre is not None:
        end = uncentred_weights(end, centre)  # post-processing with a public c
    delta = {name: (end[name] - start[name]).astype(np.float32) for name in start}
    events = category_events(z, sampling_rate=q, steps_run=task.local_steps) if mechanism is not None else {}
    counts: dict[int, float] = {}
    count_events: dict[IUCNCategory, DPSGDEvent] = {}
    if z_count is not None:
        if num_classes is None:
            if "psi.bias" not in global_weights:
                raise PayloadError("the task asks for class counts but the number of classes is unknown: pass "
                                   "num_classes (the site's model_classes)")
            num_classes = int(np.asarray(global_weights["psi.bias"]).shape[0])
        counts = noisy_class_counts(dataset.labels, eligible, num_classes=num_classes, noise_std=float(z_count),
                                    randomness=randomness)
        if z_count > 0:
            count_events = {c: DPSGDEvent(float(z_count), 1.0, 1) for c in active}
    report = UpdateReport(num_examples=n_site, local_steps=task.local_steps, events=events,
                          species_counts=counts, count_events=count_events)
    return LocalTrainingResult(delta=delta, report=report, noise_multipliers=z, sampling_rate=q)


@dataclass(frozen=True)
class ClippedSum:
    """A site's contribution to a Global DP round (unnoised: it travels only under secure aggregation).

    Attributes:
        gradient_sum: ``{name: float32 array}``, sum over one Poisson-sampled batch of the per-example gradients,
            each clipped to L2 norm C (same names and shapes as the global model).
        num_examples: N_site, the site's public record count (every category; unchanged by a halt).
        categories: the active categories (public: species table minus halted ones), IUCN rank order.
        sampling_rate: q = min(1, B / N_site).
        batch_size: the realised batch size (stays on the gateway: it is data-dependent).
    """

    gradient_sum: dict[str, np.ndarray]
    num_examples: int
    categories: tuple[IUCNCategory, ...]
    sampling_rate: float
    batch_size: int


def clipped_sum_locally(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    task: TrainingTask,
    global_weights: Mapping[str, np.ndarray],
    site_categories: Iterable[IUCNCategory],
    randomness: RandomSource,
) -> ClippedSum:
    """Global DP mode, the site's part of one DP-SGD step (Abadi et al. 2016, Alg. 1, lines "sample", "compute
    gradient", "clip gradient"; the "add noise" line runs at the coordinator, once, on the sum over sites, in the
    clear only after secure aggregation): Poisson-sample a batch at rate q from the eligible records, take per-example
    gradients at ``global_weights``, clip each to L2 norm ``task.clipping_norm`` and sum them. No noise is added
    here and the model is not stepped.

    Args: as :func:`train_locally`.

    Raises:
        PrivacyBudgetError: every category is halted or the site has no records.
        ConfigError: the weights do not fit the backend's model.
    """
    active, eligible, n_site, q = _eligibility(dataset, task, site_categories)
    backend.set_weights({k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()})
    idx = poisson_sample(eligible, q, randomness)
    flat = np.zeros(backend.num_parameters, dtype=np.float64)
    if idx.size:
        grads = backend.per_example(model_inputs(dataset)[idx], dataset.labels[idx])
        factors = clip_factors_from_norms(grads.norms, task.clipping_norm)
        flat = np.asarray(grads.weighted_sum(factors[None, :]), dtype=np.float64).reshape(-1)
    log.info("round %d: global DP: clipped sum of a Poisson batch at q=%.4g (C=%g), no local noise", task.round, q,
             task.clipping_norm)
    return ClippedSum(gradient_sum=unflatten(flat.astype(np.float32), backend.parameter_layout),
                      num_examples=n_site, categories=active, sampling_rate=q, batch_size=int(idx.size))
