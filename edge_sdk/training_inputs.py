"""A site's records as the training steps read them: the model inputs (:func:`model_inputs`), prepared once
per site (:class:`TrainingInputs`: centred, with each input's squared norm bounded once), and which records a
task lets train (:func:`eligibility`: the active categories, the cohorts' mask, the public capacity and rate).
Shared by local CCDP training (:mod:`edge_sdk.training`) and the Global DP site step (:mod:`edge_sdk.global_dp_site`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from shared.errors import ConfigError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.distributed import site_sampling_rate
from shared.protocol import TrainingTask

from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.ccdp import active_categories
from edge_sdk.privacy.per_example import summation_error_bound

__all__ = ["model_inputs", "TrainingInputs", "eligibility", "prepared_inputs"]


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


def eligibility(dataset: LocalDataset, task: TrainingTask, site_categories: Iterable[IUCNCategory],
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


def prepared_inputs(dataset: LocalDataset, feature_centre: np.ndarray | None) -> TrainingInputs:
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
