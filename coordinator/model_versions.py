"""The federation's global model as the round manager keeps it: the current version (the new model of the last
closed round, else the round-0 model), the model served for prediction (the post-hoc logit adjustment taken off the
head's bias, from the sites' public metadata), and the server optimizer's state stored with each version.

:class:`coordinator.rounds.RoundManager` owns one (``RoundManager.models``) and delegates its model queries to it;
rounds read the current model here before they open and commit new versions through
:mod:`coordinator.round_record`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from sqlalchemy import select

from shared.codec import decode_tensors
from shared.models.logit_adjustment import adjusted_for_prediction, metadata_offsets

from coordinator.config import CoordinatorConfig
from coordinator.optimizers.base import ServerOptimizer
from coordinator.registry import SiteRegistry
from coordinator.round_record import save_optimizer_state
from coordinator.storage import Store
from coordinator.tables import ModelVersionRow, RoundRow

__all__ = ["GlobalModel"]

log = logging.getLogger("coordinator.rounds")  # a part of the round manager: logged under its name


class GlobalModel:
    """The current and served global model and the optimizer state stored with it (module docstring).

    Args:
        config: the coordinator config (posthoc_logit_adjustment, model, species, num_classes).
        store: model files, round rows, state blobs. registry: the sites' public metadata (the prior).
        optimizer: the server optimizer whose state is saved and restored per model version.
    """

    def __init__(self, config: CoordinatorConfig, store: Store, registry: SiteRegistry,
                 optimizer: ServerOptimizer) -> None:
        self.config = config
        self._store = store
        self._registry = registry
        self._optimizer = optimizer
        self._offsets: tuple[int, tuple[float, ...] | None] | None = None  # (round, offsets) of prediction_offsets

    def current_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """``(hash, weights)`` of the current global model: the new model of the last closed round, else the
        round-0 model.

        Raises:
            LookupError: no model stored yet (the service stores the initial one at start).
        """
        with self._store.session() as s:
            h = s.scalars(select(RoundRow.new_model_hash).where(RoundRow.status == "closed")
                          .order_by(RoundRow.round.desc())).first()
            if h is None:
                h = s.scalars(select(ModelVersionRow.model_hash).where(ModelVersionRow.round == 0)
                              .order_by(ModelVersionRow.created_at)).first()
        if h is None:
            raise LookupError("no global model stored yet: start the Coordinator (it stores the initial model)")
        weights, _ = decode_tensors(self._store.get_model(h))
        return h, weights

    def prediction_offsets(self, round: int | None = None) -> tuple[float, ...] | None:
        """The post-hoc logit adjustment of the federation's head (``config.posthoc_logit_adjustment`` = tau > 0): float
        offsets (K,) ``tau (log pi - mean log pi)``, pi estimated from the enrolled sites' public metadata
        (:func:`shared.models.logit_adjustment.registry_log_prior`); None when tau is 0, the model is not a head or
        no site lists a species of the table (logged). Computed once per ``round`` (None: recomputed) from the
        registry as it is then; public values only, nothing is charged.
        """
        cfg = self.config
        if not cfg.posthoc_logit_adjustment > 0 or cfg.model != "head" or not cfg.species:
            return None
        if round is not None and self._offsets is not None and self._offsets[0] == round:
            return self._offsets[1]
        metadata = {site.site_id: site.metadata for site in self._registry.list()}
        index = {e.scientific_name: int(e.class_index) for e in cfg.species}
        try:
            offsets: tuple[float, ...] | None = tuple(
                float(v) for v in metadata_offsets(metadata, index, int(cfg.num_classes),
                                                   float(cfg.posthoc_logit_adjustment)))
        except ValueError as exc:
            log.warning("rounds: no logit adjustment: %s", exc)
            offsets = None
        if round is not None:
            self._offsets = (round, offsets)
        return offsets

    def inference_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """``(hash, weights)`` of the model to predict with: :meth:`current_model` (its hash: the stored version's)
        with the logit adjustment of :meth:`prediction_offsets` taken off ``psi.bias`` when there is one, the same
        model the sites keep for ``detect``.

        Raises:
            LookupError: no model stored yet.
        """
        h, weights = self.current_model()
        return h, self.served_model(weights)

    def served_model(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``weights`` (a global model, e.g. from :meth:`current_model`) as predicted with: ``psi.bias`` less the
        offsets of :meth:`prediction_offsets` when there are some, else the same tensors (a new dict)."""
        offsets = self.prediction_offsets()
        return dict(weights) if offsets is None else adjusted_for_prediction(weights, offsets)

    def save_optimizer_state(self, model_hash_: str) -> None:
        """Store the server optimizer's state (if any) for the model version ``model_hash_`` (a blob, named in the
        strategy-state table), so that a restart from that version continues with the same state."""
        save_optimizer_state(self._store, self._optimizer, model_hash_)

    def restore_optimizer_state(self) -> bool:
        """Load the optimizer state stored with the current model version; returns whether there was one."""
        try:
            h, _ = self.current_model()
        except LookupError:
            return False
        digest = self._store.get_state(f"optimizer/{h}")
        if digest is None:
            return False
        state, _ = decode_tensors(self._store.get_blob(digest))
        self._optimizer.load_state_tensors(state)
        log.info("rounds: server optimizer state restored for model %s", h[:12])
        return True
