"""Global DP mode, the site's part of a step: a Poisson batch's per-example gradients clipped and summed, no noise
(:func:`clipped_sum_locally`); the noise is added once at the coordinator, on the sum over sites, after secure
aggregation (:mod:`coordinator.global_dp`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from shared.errors import ConfigError, PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.distributed import distributed_plan
from shared.privacy.individualized import individual_sampling_rates
from shared.privacy.sum_rounding import secagg_clipping_norms
from shared.protocol import TrainingTask

from edge_sdk.backends.base import TrainingBackend, unflatten
from edge_sdk.data.camtrap_dp import LocalDataset
from shared.models.feature_centre import centred_weights
from edge_sdk.privacy.ccdp import clip_factors_from_norms, rank_table
from edge_sdk.privacy.randomness import RandomSource
from edge_sdk.privacy.sampling import sample_at_rates
from edge_sdk.training_inputs import TrainingInputs, eligibility

__all__ = ["ClippedSum", "clipped_sum_locally", "MAX_SUMMED_RECORDS"]

log = logging.getLogger(__name__)

#: The most records a Global DP site sums in one round; the float64 rounding margin of its clipping norms is proven
#: for this public bound (about 2.2e-4 C at the demo's settings), so the norms never depend on the site's count.
MAX_SUMMED_RECORDS = 1_000_000


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
    active, eligible, n_site, q = eligibility(dataset, task, site_categories, record_mask)
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
