"""A camera site's round: local DP-SGD (individualized CCDP) of the head on the site's current training records.

The records are read from the site's Camtrap DP package (:class:`SiteRecords`): the photos whose current
classification is a person's verdict (or, with ``train_on: machine``, a confident machine one), each embedded as
its crops. The package grows while the gateway runs (the field loop appends photos, rangers append verdicts), so it
is read again before a round whenever its tables changed; crops already embedded come from the embedding cache, so
a reload costs reading three CSV files and embedding only the newly verified photos.

After training, the round's best-case signal against its noise is logged per category
(:mod:`edge_sdk.field.learnability`), with a warning for a category whose records cannot learn under it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from shared.errors import PayloadError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.calibration_cache import CalibrationCache
from shared.protocol import TrainingTask

from edge_sdk.config import SiteConfig
from edge_sdk.data.camtrap_dp import LocalDataset, load_camtrap_dp
from edge_sdk.data.embedding import embed_dataset
from edge_sdk.field.learnability import signal_to_noise
from edge_sdk.field.training_report import save_last_plan
from edge_sdk.rounds.backends import BackendChooser
from edge_sdk.rounds.context import AgentContext
from edge_sdk.rounds.cohorts import CohortRegistry
from edge_sdk.site_paths import cohort_registry_path, embedding_cache_dir
from edge_sdk.training import LocalTrainingResult, TrainingInputs, train_locally
from edge_sdk.uplink.uploader import Uploader

__all__ = ["SiteRecords", "CameraRound"]

log = logging.getLogger(__name__)

_TABLES = ("deployments.csv", "media.csv", "observations.csv", "datapackage.json")


class SiteRecords:
    """A camera site's training records, read from its package again whenever the package changed.

    Args:
        config: the site config.
        dataset: fixed records (tests, the laboratory); None to read ``config.dataset``.

    Raises:
        DatasetError: the package cannot be read (at construction: a gateway with a broken package does not start).
    """

    def __init__(self, config: SiteConfig, dataset: LocalDataset | None = None) -> None:
        self.config = config
        self._fixed = dataset is not None
        self._digests: dict = {}
        self._signature: tuple | None = None
        self._dataset = dataset if dataset is not None else self._load()
        self._inputs: TrainingInputs | None = None
        self._centre_id: int | None = None
        self.cohorts = CohortRegistry(cohort_registry_path(config))
        self.last_mask: np.ndarray | None = None

    def record_mask(self, task: TrainingTask) -> np.ndarray | None:
        """The records ``task``'s cohorts let train (:meth:`edge_sdk.rounds.cohorts.CohortRegistry.mask`); kept as
        :attr:`last_mask` for the round's log."""
        self.last_mask = self.cohorts.mask(self._dataset.media_ids, self._dataset.categories, task)
        return self.last_mask

    def _package_signature(self) -> tuple:
        root = Path(self.config.dataset)
        sig = []
        for name in _TABLES:
            try:
                st = (root / name).stat()
                sig.append((name, st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                sig.append((name, None, None))
        return tuple(sig)

    def _load(self) -> LocalDataset:
        self._signature = self._package_signature()
        c = self.config
        data = load_camtrap_dp(c.dataset, c.species_table, missing_media=c.missing_media, train_on=c.train_on,
                               machine_threshold=c.machine_threshold, digests=self._digests)
        data = embed_dataset(data, embedding_cache_dir(c), input_size=c.embedding_input_size, backbone=c.backbone,
                             threads=c.threads, model_dir=c.model_dir)
        counts = ", ".join(f"{cat.value} {n}" for cat, n in sorted(data.category_counts().items(),
                                                                    key=lambda kv: kv[0].rank)) or "none"
        log.info("site %s: %d training record(s) (%s; %s) from %s", c.site_id, len(data), c.train_on, counts,
                 c.dataset)
        return data

    @property
    def dataset(self) -> LocalDataset:
        """The records as last read."""
        return self._dataset

    def refresh(self) -> bool:
        """Read the package again if its tables changed since the last read; True when it was read."""
        if self._fixed or self._package_signature() == self._signature:
            return False
        self._dataset = self._load()
        self._inputs = None
        return True

    def inputs(self, feature_centre: np.ndarray | None) -> TrainingInputs:
        """The records as the training steps read them (prepared once per read of the package)."""
        if self._inputs is None or self._centre_id != id(feature_centre):
            self._inputs = TrainingInputs(self._dataset, feature_centre)
            self._centre_id = id(feature_centre)
        return self._inputs


class CameraRound:
    """Local training rounds of a camera site (module docstring).

    Args:
        ctx: the agent's shared state.
        backends: the site's training backends.
        uploader: the outbox's traffic.
        records: the site's records.
        feature_centre: the public centre of the embeddings (float32 (1280,)) or None.
        calibration_cache: the persistent cache of CCDP calibrations.
    """

    def __init__(self, ctx: AgentContext, *, backends: BackendChooser, uploader: Uploader, records: SiteRecords,
                 feature_centre: np.ndarray | None, calibration_cache: CalibrationCache) -> None:
        self.ctx = ctx
        self.backends = backends
        self.uploader = uploader
        self.records = records
        self.feature_centre = feature_centre
        self.calibration_cache = calibration_cache

    def train(self, task: TrainingTask, weights: dict[str, np.ndarray]) -> bool:
        """Train one round and send the update; False (counted, logged) when the round is refused."""
        ctx, config = self.ctx, self.ctx.config
        self.records.refresh()
        if task.capacity is None and task.privacy != "none":
            ctx.reject("task", "no_capacity", f"round {task.round}: the task names no declared capacity for this "
                       "site, so its sampling rate would have to come from its record count, which must not leave "
                       "the site (fix, at the coordinator: enrol the site with --metadata '{\"capacity\": N}')")
            return False
        if not len(self.records.dataset):  # trains anyway: whether a site trains must not tell its record count
            log.warning("site %s: round %d: no training records yet (train_on: %s); the update is noise only. "
                        "Verify photos on the review page (wildfed-edge review) or label them in the package",
                        ctx.site_id, task.round, config.train_on)
        # Record the round durably before training: after a crash the round is skipped, never trained twice.
        ctx.set_last_round(task.round)
        log.info("site %s: round %d: training %d %s step(s)", ctx.site_id, task.round, task.local_steps, task.privacy)
        started = time.monotonic()
        try:
            result = train_locally(backend=self.backends.current, dataset=self.records.inputs(self.feature_centre),
                                   task=task, global_weights=weights, site_categories=config.categories,
                                   randomness=ctx.randomness(task), num_classes=config.model_classes,
                                   class_categories=({s.class_index: s.iucn_category for s in config.species}
                                                     if config.logit_adjustment else None),
                                   calibration_cache=self.calibration_cache,
                                   record_mask=self.records.record_mask(task))
        except PrivacyBudgetError as exc:
            ctx.reject("task", "privacy_budget", str(exc))
            return False
        except (ValueError, PayloadError) as exc:  # weights that do not fit the model (ConfigError is a ValueError)
            ctx.reject("task", "model_mismatch", str(exc))
            return False
        self._log_signal(task, weights, result)
        # sealed, stored and published at the round's public time slot, not when training ended (privacy.timing)
        return ctx.pacer.release(task.round, lambda: self.uploader.send_update(
            task, result.report, result.delta, started=started,
            detail=f"N={result.report.num_examples}, base rate q={result.sampling_rate:.4g}"
            + (f", class re-weighting {task.class_reweighting:g}"
               if task.class_reweighting and result.plan is not None and config.logit_adjustment else "")))

    def _log_signal(self, task: TrainingTask, weights: dict[str, np.ndarray], result: LocalTrainingResult) -> None:
        plan = result.plan
        if plan is None:  # not private: check-config says so instead of reporting an older round's noise
            try:
                save_last_plan(self.ctx.config, round_=task.round, plan=None, steps=0, parameters=0)
            except OSError as exc:
                log.warning("site %s: could not keep the round's plan for check-config: %s", self.ctx.site_id, exc)
            return
        mask = self.records.last_mask  # the records this round could sample: retired ones teach nothing more
        ranks = self.records.dataset.categories if mask is None else self.records.dataset.categories[mask]
        counts: dict[IUCNCategory, int] = {c: int(np.sum(ranks == c.rank)) for c in IUCNCategory
                                           if np.any(ranks == c.rank)}
        steps = task.local_steps * max(1, task.planned_rounds)
        parameters = sum(int(np.asarray(w).size) for w in weights.values())
        try:
            save_last_plan(self.ctx.config, round_=task.round, plan=plan, steps=steps, parameters=parameters)
        except OSError as exc:
            log.warning("site %s: could not keep the round's plan for check-config: %s", self.ctx.site_id, exc)
        for row in signal_to_noise(counts, sampling_rates=plan.sampling_rates, clipping_norms=plan.clipping_norms,
                                   noise_std=plan.noise_std, steps=steps, parameters=parameters):
            (log.info if row.learns else log.warning)("site %s: round %d, the records it may sample, over a "
                                                      "record's training life of %d round(s): %s",
                                                      self.ctx.site_id, task.round, task.planned_rounds,
                                                      row.describe())
