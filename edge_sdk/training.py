"""One round of local training: Poisson-sampled DP-SGD steps with the CCDP mechanism (or non-private SGD), or, in
Global DP mode, the clipped gradient sum of one Poisson-sampled batch (:func:`clipped_sum_locally`, in
:mod:`edge_sdk.global_dp_site`; the site's prepared records in :mod:`edge_sdk.training_inputs`).

This module wires the pieces and holds no maths of its own: sampling (``edge_sdk.privacy.sampling``), the
mechanism and its calibration (``edge_sdk.privacy.ccdp``: individualized DP-SGD), and a training backend
(``edge_sdk.backends``). Per step (Abadi et al. 2016, Alg. 1): sample a batch, each record of an active category at
its category's rate q_c, take per-example gradients, privatise them (clip at the category's C_c, one Gaussian draw,
normalise by q * N_site), take one SGD step.

Sampling rate and normaliser (docs/privacy.md "No uncharged counts"): q = min(1, B / N_k) with B the task's
``expected_batch_size`` and N_k the site's declared capacity (``TrainingTask.capacity``: a public constant the
operator declared at enrolment, never the number of records; the FedAvg weight reported as
``UpdateReport.num_examples``). q is the anchor category's rate (the "Sample" variant samples the other categories at
calibrated q_c <= q). Records of a halted category are simply not sampled, every record present is sampled at its
category's rate whatever the number of records, and each step is normalised by the constant q * N_k: so neither q,
nor the normaliser, nor ``num_examples`` depends on the site's data, and adding or removing one record changes the
released sum by that record's clipped gradient alone (add/remove-one neighbours). Nothing that leaves the gateway is
a function of a count (only the noisy class counts NIRA may ask for, which are noised and charged). A task without a
capacity (in-process simulations) uses the dataset's size in its place. The plan is calibrated for
``planned_rounds * local_steps`` steps; the events reported are those of the steps actually run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from shared.errors import ConfigError, PayloadError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.calibration_cache import CalibrationCache
from shared.privacy.events import DPSGDEvent
from shared.privacy.noise_prefetch import PrefetchedNormals, worth_prefetching
from shared.protocol import TrainingTask, UpdateReport

from edge_sdk.backends.base import TrainingBackend
from edge_sdk.data.camtrap_dp import LocalDataset
from shared.models.feature_centre import centred_weights, uncentred_weights
from edge_sdk.privacy.ccdp import CCDPMechanism, CCDPPlan, plan_ccdp
from edge_sdk.privacy.randomness import RandomSource
from edge_sdk.privacy.sampling import sample_at_rates
from edge_sdk.training_inputs import TrainingInputs, eligibility, model_inputs, prepared_inputs
from edge_sdk.global_dp_site import MAX_SUMMED_RECORDS, ClippedSum, clipped_sum_locally

__all__ = ["LocalTrainingResult", "model_inputs", "TrainingInputs", "local_step", "train_locally", "ClippedSum",
           "clipped_sum_locally", "noisy_class_counts", "reweight_class_rows", "MAX_SUMMED_RECORDS"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class LocalTrainingResult:
    """What one round of local training produced.

    Attributes:
        delta: ``{name: float32 array}``, local minus global weights (same names and shapes as the global model).
        report: the :class:`shared.protocol.UpdateReport` (num_examples = N_site, the public count; steps; DP
            events).
        plan: the :class:`~edge_sdk.privacy.ccdp.CCDPPlan` that ran (None for privacy "none").
        sampling_rate: q = min(1, B / N_site), the anchor category's rate.
    """

    delta: dict[str, np.ndarray]
    report: UpdateReport
    plan: CCDPPlan | None
    sampling_rate: float

    @property
    def noise_multipliers(self) -> dict[IUCNCategory, float]:
        """``{category: sigma / C_c}``, the noise multiplier each active category's records saw (empty for
        privacy "none")."""
        return self.plan.noise_multipliers() if self.plan is not None else {}

    @property
    def sampling_rates(self) -> dict[IUCNCategory, float]:
        """``{category: q_c}``, each active category's Poisson rate (empty for privacy "none")."""
        return dict(self.plan.sampling_rates) if self.plan is not None else {}


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


def local_step(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    inclusion_rates: np.ndarray,
    mechanism: CCDPMechanism | None,
    randomness: RandomSource,
    learning_rate: float,
) -> int:
    """One step of :func:`train_locally` (also what ``benchmarks/dp_step.py`` times): Poisson-sample a batch, record
    i with probability ``inclusion_rates[i]`` (float (N,); 0 for records that must not be sampled), then either the
    CCDP step (implicit per-example gradients -> ``privatize``) or, with ``mechanism`` None, a non-private
    mean-gradient step; then the SGD update.

    Returns:
        The realised batch size (a non-private step with an empty batch is skipped).
    """
    idx = sample_at_rates(inclusion_rates, randomness)
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


def reweight_class_rows(delta: Mapping[str, np.ndarray], relative_weights: Mapping[IUCNCategory, float],
                        class_categories: Mapping[int, IUCNCategory], power: float) -> dict[str, np.ndarray]:
    """Scale each class row of the head's delta by ``w_c^-power`` (class k's IUCN category c; 1 for a class whose
    category is not in ``relative_weights``): square-root (power 0.5) or full (1) inverse re-weighting of the
    per-class signal that individualized DP-SGD thins out for the categories it samples or clips less
    (class-frequency re-weighting as in Mahajan et al. 2018, Sec. 3.2, and Cui et al., CVPR 2019, applied to the
    released delta instead of the loss, so that clipping and noise are untouched). The rows of ``psi.weight``
    ((classes, H) float32) and the entries of ``psi.bias`` ((classes,) float32) are scaled; every other tensor is
    returned unchanged. Post-processing of a DP output with public constants: no privacy cost.

    Args:
        delta: ``{name: float32 array}``, the model delta. relative_weights: ``{category: w_c in (0, 1]}``
            (:meth:`~edge_sdk.privacy.ccdp.CCDPPlan.relative_weights`). class_categories: ``{class index:
            category}``. power: p in [0, 1].

    Raises:
        ValueError: power outside [0, 1], a weight not in (0, 1], or no ``psi.weight`` / ``psi.bias`` in ``delta``.
    """
    if not 0.0 <= float(power) <= 1.0:
        raise ValueError(f"power must be in [0, 1], got {power}")
    if "psi.weight" not in delta or "psi.bias" not in delta:
        raise ValueError("class-row re-weighting needs the head's psi.weight and psi.bias")
    bias = np.asarray(delta["psi.bias"])
    factors = np.ones(bias.shape[0], dtype=np.float64)
    for k, c in class_categories.items():
        if 0 <= int(k) < factors.shape[0] and c in relative_weights:
            w = float(relative_weights[c])
            if not 0.0 < w <= 1.0:
                raise ValueError(f"relative weight of {c.value} must be in (0, 1], got {w}")
            factors[int(k)] = w ** -float(power)
    out = dict(delta)
    out["psi.weight"] = (np.asarray(delta["psi.weight"], dtype=np.float64) * factors[:, None]).astype(np.float32)
    out["psi.bias"] = (bias.astype(np.float64) * factors).astype(np.float32)
    return out


def _logit_offsets(plan: CCDPPlan, class_categories: Mapping[int, IUCNCategory] | None,
                   weights: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """float32 (classes,) ``log w_{cat(y)}`` per class (0 for a class whose category is not active or not in the
    table), or None when there is nothing to adjust (no table, no ``psi.bias``, or every weight 1)."""
    if not class_categories or "psi.bias" not in weights:
        return None
    weight = plan.relative_weights()
    offsets = np.zeros(np.asarray(weights["psi.bias"]).shape[0], dtype=np.float64)
    for k, c in class_categories.items():
        if 0 <= int(k) < offsets.shape[0] and c in weight:
            offsets[int(k)] = np.log(weight[c])
    return offsets.astype(np.float32) if np.any(offsets != 0) else None


def _count_release(task: TrainingTask, dataset: LocalDataset, eligible: np.ndarray, active: Iterable[IUCNCategory],
                   global_weights: Mapping[str, np.ndarray], randomness: RandomSource, num_classes: int | None
                   ) -> tuple[dict[int, float], dict[IUCNCategory, DPSGDEvent]]:
    """The noisy class counts the task asks for (``task.count_noise_multiplier``; none when it is None) and their
    privacy events, one Gaussian release per active category when the noise is > 0.

    Raises:
        PayloadError: counts asked for, ``num_classes`` None and no ``psi.bias`` in ``global_weights``.
    """
    z_count = task.count_noise_multiplier
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
    return counts, count_events


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
    class_categories: Mapping[int, IUCNCategory] | None = None,
    calibration_cache: CalibrationCache | None = None,
    record_mask: np.ndarray | None = None,
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
            taken (:mod:`shared.models.feature_centre`; the delta is in the plain form the federation stores).
        class_categories: ``{class index: IUCN category}`` of the site's species table (public configuration), or
            None. Under CCDP each category's records weigh ``w_c = (q_c / q)(C_c / C)`` in a step
            (:meth:`~edge_sdk.privacy.ccdp.CCDPPlan.relative_weights`), so the classifier would learn a prior
            skewed against the threatened species. Given the table, the steps run with the head's bias shifted by
            ``log w_c`` for each class of category c and the shift is taken off before the delta: the logit-adjusted
            loss (Menon et al., "Long-tail learning via logit adjustment", ICLR 2021, Sec. 4), which makes the
            model fit the unskewed posterior. The shift is a public constant (it changes the loss, not the
            clipping or the noise: the privacy events are unchanged). Given the table and a task with
            ``class_reweighting`` p > 0, each class row of the head's delta is then scaled by ``w_c^-p``
            (:func:`reweight_class_rows`, post-processing with public constants).
        calibration_cache: where the CCDP plan's calibration is kept across processes (the agent's
            ``<wildfed cache>/calibration``; :func:`~edge_sdk.privacy.ccdp.plan_ccdp`), or None: memoised in this
            process only. The plan is bit-identical either way.
        record_mask: bool (N,): the records the task's cohorts let train (record-level budgets,
            :meth:`edge_sdk.rounds.cohorts.CohortRegistry.mask`), or None: every record of an active category.

    Raises:
        PrivacyBudgetError: every category is halted or the site has no records, an active category has no
            budget, or the count releases alone would exceed a budget.
        ConfigError: the weights do not fit the backend's model.
        PayloadError: counts asked for and the number of classes unknown.
    """
    site_categories = tuple(site_categories)
    active, eligible, n_site, q = eligibility(dataset, task, site_categories, record_mask)
    plain = {k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()}
    train_on = prepared_inputs(dataset, feature_centre)
    centre = train_on.centre
    if centre is None:
        backend.set_weights(plain)
        start = backend.get_weights()
    else:  # train the same function on x - c; the delta is taken in the plain form (module feature_centre)
        backend.set_weights(centred_weights(plain, centre))
        start = plain

    plan: CCDPPlan | None = None
    mechanism: CCDPMechanism | None = None
    offsets: np.ndarray | None = None
    rates = np.where(eligible, q, 0.0)
    z_count = task.count_noise_multiplier
    # the count releases of every planned round are fixed in advance: calibrate the steps around them
    fixed = (DPSGDEvent(float(z_count), 1.0, task.planned_rounds),) if z_count else ()
    if task.privacy == "ccdp":
        try:
            plan = plan_ccdp(variant=task.ccdp_variant, budgets=task.budgets, active=active,
                             target_delta=task.target_delta, sampling_rate=q,
                             steps=task.planned_rounds * task.local_steps, clipping_norm=task.clipping_norm,
                             fixed_events=fixed, site_categories=site_categories, cache=calibration_cache)
        except ConfigError as exc:
            if getattr(exc, "field", None) != "count_noise_multiplier":
                raise
            raise PrivacyBudgetError(f"round {task.round}: {exc}; the site does not train") from None
        mechanism = CCDPMechanism.from_plan(plan, expected_batch_size=q * n_site, noise=randomness)
        offsets = _logit_offsets(plan, class_categories, start)
        if offsets is not None:  # the logit-adjusted loss: train with b + log w, hand back the plain delta
            w = backend.get_weights()
            backend.set_weights({**w, "psi.bias": (w["psi.bias"] + offsets).astype(np.float32)})
        rates = plan.inclusion_rates(train_on.categories)
        log.info("round %d: CCDP (%s) sigma=%.4g, q=%s, C=%s", task.round, plan.variant, plan.noise_std,
                 {c.value: round(v, 4) for c, v in plan.sampling_rates.items()},
                 {c.value: round(v, 4) for c, v in plan.clipping_norms.items()})

    # a large model's noise is drawn one step ahead on a second thread (shared.privacy.noise_prefetch)
    prefetch = (PrefetchedNormals(randomness, size=backend.num_parameters, count=task.local_steps)
                if mechanism is not None and worth_prefetching(backend.num_parameters) else None)
    try:
        if prefetch is not None:
            mechanism = replace(mechanism, noise=prefetch)
        for _ in range(task.local_steps):
            local_step(backend=backend, dataset=train_on, inclusion_rates=rates, mechanism=mechanism,
                       randomness=randomness, learning_rate=task.learning_rate)
    finally:
        if prefetch is not None:
            prefetch.close()

    end = backend.get_weights()
    if offsets is not None:
        end = {**end, "psi.bias": (end["psi.bias"] - offsets).astype(np.float32)}
    if centre is not None:
        end = uncentred_weights(end, centre)  # post-processing with a public c
    delta = {name: (end[name] - start[name]).astype(np.float32) for name in start}
    if plan is not None and task.class_reweighting and class_categories:
        delta = reweight_class_rows(delta, plan.relative_weights(), class_categories, task.class_reweighting)
    events = plan.events(task.local_steps) if plan is not None else {}
    counts, count_events = _count_release(task, dataset, eligible, active, global_weights, randomness, num_classes)
    report = UpdateReport(num_examples=n_site, local_steps=task.local_steps, events=events,
                          species_counts=counts, count_events=count_events)
    return LocalTrainingResult(delta=delta, report=report, plan=plan, sampling_rate=q)
