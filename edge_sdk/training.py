"""One round of local training: Poisson-sampled DP-SGD steps with the CCDP mechanism (or non-private SGD), or, in
Global DP mode, the clipped gradient sum of one Poisson-sampled batch (:func:`clipped_sum_locally`).

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
from dataclasses import dataclass, field

import numpy as np

from shared.errors import ConfigError, PayloadError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.calibration_cache import CalibrationCache
from shared.privacy.events import DPSGDEvent
from shared.privacy.distributed import distributed_plan, site_sampling_rate
from shared.privacy.individualized import individual_sampling_rates
from shared.privacy.sum_rounding import secagg_clipping_norms
from shared.protocol import TrainingTask, UpdateReport

from edge_sdk.backends.base import TrainingBackend, unflatten
from edge_sdk.data.camtrap_dp import LocalDataset
from shared.models.feature_centre import centred_weights, uncentred_weights
from edge_sdk.privacy.ccdp import (CCDPMechanism, CCDPPlan, active_categories, clip_factors_from_norms, plan_ccdp,
                                   rank_table)
from edge_sdk.privacy.per_example import summation_error_bound
from edge_sdk.privacy.randomness import RandomSource
from edge_sdk.privacy.sampling import sample_at_rates

__all__ = ["LocalTrainingResult", "model_inputs", "TrainingInputs", "local_step", "train_locally", "ClippedSum",
           "clipped_sum_locally", "noisy_class_counts", "reweight_class_rows"]

log = logging.getLogger(__name__)

#: The most records a Global DP site sums in one round; the float64 rounding margin of its clipping norms is proven
#: for this public bound (about 2.2e-4 C at the demo's settings), so the norms never depend on the site's count.
MAX_SUMMED_RECORDS = 1_000_000


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


def model_inputs(dataset: LocalDataset) -> np.ndarray:
    """What the model trains on: ``dataset.features`` (float32 (N, 1280) backbone embeddings, filled by
    ``edge_sdk.data.embedding.embed_dataset``) when present, else ``dataset.images`` (anything with ``images``,
    ``labels`` and ``categories`` works, e.g. a benchmark's namespace of embeddings in ``images``).

    Raises:
        ValueError: the dataset holds neither (embed it first).
    """
    features = getattr(dataset, "features", None)
    inputs = features if features is not None else getattr(dataset, "images", None)
    if inputs is None:
        raise ValueError("the dataset holds neither backbone embeddings nor images: embed it first "
                         "(edge_sdk.data.embedding.embed_dataset)")
    return inputs


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


class TrainingInputs:
    """A site's records as the training steps read them, prepared once and reused every round: the model inputs
    (``model_inputs(dataset)``, centred by ``feature_centre`` when one is given:
    :mod:`shared.models.feature_centre`) and, for embeddings, an upper bound of each input's squared L2 norm, which
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


def _eligibility(dataset: LocalDataset, task: TrainingTask, site_categories: Iterable[IUCNCategory],
                 record_mask: np.ndarray | None = None) -> tuple[tuple[IUCNCategory, ...], np.ndarray, int, float]:
    """``(active categories, eligible mask bool (N,), N_k, q)`` with q = min(1, B / N_k), or 1 for a
    distributed-noise Global DP task (:func:`shared.privacy.distributed.site_sampling_rate`).

    ``record_mask`` (bool (N,), or None for all): the records the task's cohorts let train
    (:mod:`edge_sdk.rounds.cohorts`); the mask is its AND with the active categories'.

    ``N_k`` is the site's declared capacity (``task.capacity``; the dataset's size for a task without one, in
    in-process simulations); the mask marks the records of active categories, the only ones ever sampled. q and N_k
    depend only on public values, never on how many records the site or a category holds (docs/privacy.md). A site
    or an active category with no records still trains (noise only), so whether the site trains is decided by
    public facts alone (its species table and the halted list).

    Raises:
        PrivacyBudgetError: every category of the site's species table is halted, or a task without a capacity
            meets an empty dataset.
    """
    active = active_categories(site_categories, task.halted)
    if not active:
        raise PrivacyBudgetError(
            f"round {task.round}: every category is halted (halted {[c.value for c in task.halted]}): "
            "the site does not train"
        )
    n_site = len(dataset) if task.capacity is None else int(task.capacity)
    if n_site == 0:
        raise PrivacyBudgetError(f"round {task.round}: the site has no records: the site does not train")
    eligible = np.isin(dataset.categories.astype(np.int64), np.asarray([c.rank for c in active], dtype=np.int64))
    if record_mask is not None:
        record_mask = np.asarray(record_mask)
        if record_mask.dtype != np.bool_ or record_mask.shape != eligible.shape:
            raise ValueError(f"record_mask must be bool {eligible.shape}, got {record_mask.dtype} {record_mask.shape}")
        eligible &= record_mask
    return active, eligible, n_site, site_sampling_rate(task.expected_batch_size, n_site,
                                                        distributed=bool(task.distributed_noise))


def _training_inputs(dataset: LocalDataset, feature_centre: np.ndarray | None) -> TrainingInputs:
    """The inputs the steps run on: ``dataset`` itself when it is a prepared :class:`TrainingInputs` (checked to be
    centred by ``feature_centre``), else prepared here.

    Raises:
        ConfigError: prepared inputs centred by another centre (field ``feature_centre``).
    """
    if isinstance(dataset, TrainingInputs):
        if feature_centre is not None and (dataset.centre is None
                                           or not np.array_equal(dataset.centre, feature_centre)):
            raise ConfigError("the prepared training inputs were centred by another feature centre",
                              field="feature_centre", fix="prepare TrainingInputs with the same centre")
        return dataset
    return TrainingInputs(dataset, feature_centre)


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
    active, eligible, n_site, q = _eligibility(dataset, task, site_categories, record_mask)
    plain = {k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()}
    train_on = _training_inputs(dataset, feature_centre)
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

    for _ in range(task.local_steps):
        local_step(backend=backend, dataset=train_on, inclusion_rates=rates, mechanism=mechanism,
                   randomness=randomness, learning_rate=task.learning_rate)

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


@dataclass(frozen=True)
class ClippedSum:
    """A site's contribution to a Global DP round (unnoised: it travels only under secure aggregation).

    Attributes:
        gradient_sum: ``{name: float64 array}``, sum over one Poisson-sampled batch of the per-example gradients,
            each clipped to L2 norm C less the float64 rounding margin (same names and shapes as the global model;
            accumulated and kept in float64 until it is quantised: ``shared.privacy.sum_rounding``).
        num_examples: N_k, the site's declared capacity (``TrainingTask.capacity``; public, unchanged by the data).
        categories: the active categories (public: species table minus halted ones), IUCN rank order.
        sampling_rate: q = min(1, B / N_k).
        batch_size: the realised batch size (stays on the gateway: it is data-dependent).
        sampling_rates: ``{category: q_c}``, each active category's rate (individualized DP-SGD "Sample" at the
            task's noise multiplier; the coordinator computes the same values to charge the ledger).
    """

    gradient_sum: dict[str, np.ndarray]
    num_examples: int
    categories: tuple[IUCNCategory, ...]
    sampling_rate: float
    batch_size: int
    sampling_rates: Mapping[IUCNCategory, float] = field(default_factory=dict)


def clipped_sum_locally(
    *,
    backend: TrainingBackend,
    dataset: LocalDataset,
    task: TrainingTask,
    global_weights: Mapping[str, np.ndarray],
    site_categories: Iterable[IUCNCategory],
    randomness: RandomSource,
    feature_centre: np.ndarray | None = None,
    record_mask: np.ndarray | None = None,
) -> ClippedSum:
    """Global DP mode, the site's part of one DP-SGD step (Abadi et al. 2016, Alg. 1, lines "sample", "compute
    gradient", "clip gradient"; the "add noise" line runs at the coordinator, once, on the sum over sites, in the
    clear only after secure aggregation): Poisson-sample a batch, each active category c's records at its rate q_c
    (individualized DP-SGD "Sample" at the task's ``noise_multiplier``:
    :func:`shared.privacy.individualized.individual_sampling_rates`, at most q = min(1, B / N_site)), take
    per-example gradients at ``global_weights``, clip each to L2 norm ``task.clipping_norm`` and sum them. No noise
    is added here and the model is not stepped.

    Args: as :func:`train_locally`; ``dataset`` may be prepared :class:`TrainingInputs`. ``feature_centre``:
        float32 (E,), the public centre the task names (``task.feature_centre``): the gradients are taken of the
        same function on ``x - c`` (:func:`shared.models.feature_centre.centred_weights`), so the sum is in the
        centred form and the coordinator folds the noisy sum back with
        :func:`shared.models.feature_centre.uncentred_gradient` (post-processing with a public c). None: plain.

    Raises:
        PrivacyBudgetError: every category is halted or the site has no records.
        ConfigError: the weights do not fit the backend's model, or the prepared inputs were centred by another
            centre than ``feature_centre``.
    """
    active, eligible, n_site, q = _eligibility(dataset, task, site_categories, record_mask)
    if task.noise_multiplier is None:
        raise PayloadError("a global task must carry the coordinator's noise_multiplier")
    plain = {k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()}
    if isinstance(dataset, TrainingInputs):
        same = (dataset.centre is None if feature_centre is None
                else dataset.centre is not None and np.array_equal(dataset.centre, feature_centre))
        if not same:
            raise ConfigError("the prepared training inputs were centred by another feature centre",
                              field="feature_centre", fix="prepare TrainingInputs with the task's centre")
        inputs = dataset
    else:
        inputs = TrainingInputs(dataset, feature_centre)
    backend.set_weights(plain if feature_centre is None else centred_weights(plain, feature_centre))
    norms = {c: float(task.clipping_norm) for c in active}
    if task.distributed_noise:  # "scale": every category at q, clipped at its C_c (shared.privacy.distributed)
        assert task.secagg is not None  # a global task carries it (TrainingTask checks)
        _, planned = distributed_plan(budgets=task.budgets, target_delta=task.target_delta,
                                      planned_rounds=task.planned_rounds, clipping_norm=task.clipping_norm,
                                      vector_length=task.secagg.vector_length, scale=task.secagg.scale)
        rates = {c: q for c in active}
        norms = {c: planned[c] for c in active}
    else:  # "sample": one z, each category at its own rate
        rates = individual_sampling_rates(noise_multiplier=float(task.noise_multiplier), budgets=task.budgets,
                                          categories=active, target_delta=task.target_delta, max_rate=q,
                                          steps=task.planned_rounds)
    assert task.secagg is not None  # a global task carries it (TrainingTask checks)
    if len(dataset) > MAX_SUMMED_RECORDS:
        raise ConfigError(f"a Global DP site sums at most {MAX_SUMMED_RECORDS} records (the float64 rounding margin "
                          f"is proven for that many), this site holds {len(dataset)}", field="dataset",
                          fix="split the site's records over several sites, or use local CCDP")
    # the float64 rounding margin for a public bound on the terms summed, never the site's own count: the clipping
    # norm stays a public constant (shared.privacy.sum_rounding)
    norms = secagg_clipping_norms(norms, num_records=MAX_SUMMED_RECORDS, clipping_norm=task.clipping_norm,
                                  vector_length=task.secagg.vector_length, scale=task.secagg.scale,
                                  max_abs_value=task.secagg.max_abs_value)
    ranks = dataset.categories.astype(np.int64)
    rate_table, norm_table = rank_table(rates), rank_table(norms, default=1.0)  # inactive: rate 0, never clipped
    idx = sample_at_rates(rate_table[ranks], randomness)
    flat = np.zeros(backend.num_parameters, dtype=np.float64)
    if idx.size:
        grads = backend.per_example(inputs.features[idx], dataset.labels[idx])
        factors = clip_factors_from_norms(grads.norms, norm_table[ranks[idx]])
        flat = grads.weighted_sum(factors[None, :], dtype=np.float64).reshape(-1)
    log.info("round %d: global DP: clipped sum of %s at q=%s (C=%s), %s", task.round,
             "every record (distributed noise credits no subsampling)" if task.distributed_noise else "a Poisson batch",
             {c.value: round(v, 4) for c, v in rates.items()}, {c.value: round(v, 4) for c, v in norms.items()},
             "its share of the noise added before masking" if task.distributed_noise else "no local noise")
    return ClippedSum(gradient_sum=unflatten(flat, backend.parameter_layout, dtype=np.float64),
                      num_examples=n_site, categories=active, sampling_rate=q, batch_size=int(idx.size),
                      sampling_rates=rates)
