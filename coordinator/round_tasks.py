"""A round's TASK envelopes: what each selected site is asked to train, signed by the coordinator and sent.

:class:`TaskPublisher` builds a site's :class:`shared.protocol.TrainingTask` from the coordinator config and the
round's per-site values (halted categories, cohorts, capacity, Global DP settings), seals it with the global weights
(and, where shipped, the ONNX Runtime training artifacts or a radio task's city raster) on
``shared.topics.task_topic``, keeps it for resends (:mod:`coordinator.outgoing`) and sends it. A payload is encoded
and hashed once per distinct task content in a round; every further site with the same content gets a readdressed
header.

With ``transfer.models_by_digest`` a camera task carries no weights: the model goes out once per distinct model
(:class:`coordinator.model_digests.ModelDigests`, before the first task that names it) and each site's task names
its digest (``TrainingTask.model_digest``). Radio tasks always carry their weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope, MessageKind, readdress, seal
from shared.iucn import IUCNCategory
from shared.protocol import SecAggSettings, TrainingTask, encode_task
from shared.transfer import Receipt, piece_size_for

from coordinator.artifacts import ArtifactStore, artifact_digests, ort_training_available
from coordinator.config import CoordinatorConfig
from coordinator.inbound.context import RoundContext
from coordinator.model_digests import ModelDigests
from coordinator.outgoing import answer_download_receipt, send_task_bytes, store_outgoing_task
from coordinator.radio import city_artifact, radio_task
from coordinator.registry import SiteRegistry, UnknownSiteError
from coordinator.storage import Store
from coordinator.transport import Transport

__all__ = ["TaskPublisher"]

log = logging.getLogger("coordinator.rounds")  # a step of the round manager: logged under its name


class TaskPublisher:
    """Builds, seals, keeps and sends a round's tasks (module docstring).

    Args:
        config: the coordinator config (federation, hyper-parameters, privacy, budgets, transfer chunk size).
        registry: the enrolled sites (a camera task carries the site's declared capacity).
        transport: where tasks go. signing_key: the coordinator's Ed25519 key.
        artifacts: the ORT training-artifact cache.
        store: coordinator state; required for ``transfer.models_by_digest`` (records what is published by digest).
    """

    def __init__(self, *, config: CoordinatorConfig, registry: SiteRegistry, transport: Transport,
                 signing_key: Ed25519PrivateKey, artifacts: ArtifactStore, store: Store | None = None) -> None:
        self.config = config
        self._registry = registry
        self._transport = transport
        self._key = signing_key
        self._artifacts = artifacts
        self._artifacts_failed = False
        # the open round's sealed tasks, one per distinct content (payload encoded and hashed once for its sites)
        self._payloads: dict[tuple[str, str, tuple[str, ...]], Envelope] = {}
        self.digests = (ModelDigests(config=config, store=store, transport=transport, signing_key=signing_key)
                        if store is not None else None)
        """Publishes models once by digest (None without a store: every task carries its weights)."""
        self._expired_for: int | None = None  # the round whose old digests were cleared

    # ---- ORT training artifacts --------------------------------------------------------------------------------
    def ships_artifacts(self) -> bool:
        """Whether tasks carry ONNX Runtime training artifacts: ``config.ship_ort_artifacts``, or (None) whether
        ``onnxruntime.training`` imports here."""
        ship = self.config.ship_ort_artifacts
        return ort_training_available() if ship is None else bool(ship)

    def task_artifacts(self, model_hash_: str, weights: Mapping[str, np.ndarray]) -> dict[str, bytes]:
        """The artifact files of the model version (``coordinator.artifacts``), or ``{}`` when not shipped or when
        making them fails (logged; gateways on ``auto`` then train with torch). Radio tasks carry the public city
        raster instead (``coordinator.radio.city_artifact``)."""
        if self.config.model == "radio_unet" and self.config.radio is not None:
            return city_artifact(self.config.radio)
        if not self.ships_artifacts() or self._artifacts_failed:
            return {}
        try:
            return self._artifacts.get(model_hash_, weights, self.config.num_classes)
        except Exception as exc:  # noqa: BLE001 - artifacts are an optimisation; the torch path must go on
            self._artifacts_failed = True  # same architecture every round: do not retry (and log) each round
            log.error("rounds: ORT training artifacts for model %s could not be made (%s: %s); tasks go without "
                      "them from now on", model_hash_[:12], type(exc).__name__, exc)
            return {}

    # ---- building and sending ----------------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Forget the previous round's sealed tasks (call before a round's first :meth:`publish`)."""
        self._payloads = {}

    def publish(self, r: int, site_id: str, model_hash_: str, weights: Mapping[str, np.ndarray],
                halted: frozenset[IUCNCategory], artifacts: Mapping[str, bytes] | None = None, *,
                secagg: SecAggSettings | None = None, noise_multiplier: float | None = None,
                distributed_noise: bool = False, feature_centre: str | None = None,
                count_noise_multiplier: float | None = None, prediction_offsets: tuple[float, ...] | None = None,
                cohorts: dict[int, tuple[IUCNCategory, ...]] | None = None) -> None:
        """Build round ``r``'s task for ``site_id`` (trained from ``weights``, hash ``model_hash_``, without the
        ``halted`` categories), seal it with ``artifacts``, keep it for resends and send it. A radio federation's
        task reads its generic fields as epochs, maps per Adam step, Adam step size and C of the whole update; the
        keyword values are camera-task fields (:class:`shared.protocol.TrainingTask`).

        Raises:
            PayloadError: a task field out of range (``TrainingTask``). TransportError: sending failed.
        """
        cfg = self.config
        radio = cfg.radio if cfg.model == "radio_unet" else None
        if radio is not None:
            task = TrainingTask(federation_id=cfg.federation_id, round=r, model_hash=model_hash_,
                                local_steps=radio.local_epochs, expected_batch_size=radio.batch_size,
                                learning_rate=float(radio.learning_rate), clipping_norm=float(radio.clipping_norm),
                                target_delta=float(cfg.target_delta), planned_rounds=cfg.rounds,
                                privacy=cfg.privacy, budgets=cfg.budgets() if cfg.privacy != "none" else {},
                                halted=tuple(halted), seed=cfg.task_seed, artifacts=artifact_digests(artifacts or {}),
                                radio=radio_task(radio), round_duration_s=float(cfg.round_duration_s))
            self._send_task(r, site_id, model_hash_, task, weights, artifacts)
            return
        camera = TrainingTask(federation_id=cfg.federation_id, round=r, model_hash=model_hash_,
                            local_steps=cfg.local_steps, expected_batch_size=cfg.expected_batch_size,
                            learning_rate=float(cfg.learning_rate), clipping_norm=float(cfg.clipping_norm),
                            target_delta=float(cfg.target_delta), planned_rounds=cfg.planned_updates(),
                            privacy=cfg.privacy,
                            budgets=cfg.budgets(), halted=tuple(halted), seed=cfg.task_seed,
                            artifacts=artifact_digests(artifacts or {}), secagg=secagg,
                            count_noise_multiplier=None if secagg is not None else count_noise_multiplier,
                            ccdp_variant=cfg.ccdp_variant, noise_multiplier=noise_multiplier,
                            distributed_noise=distributed_noise, feature_centre=feature_centre,
                            class_reweighting=float(cfg.class_reweighting) if cfg.privacy == "ccdp" else 0.0,
                            prediction_offsets=prediction_offsets, capacity=self._capacity(site_id),
                            round_duration_s=float(cfg.round_duration_s), cohorts=cohorts,
                            max_staleness=cfg.buffered.max_staleness if cfg.buffered is not None else None)
        if self.by_digest():
            assert self.digests is not None
            self.digests.publish(r, model_hash_, weights)  # once per distinct model; retained before any task
            if self._expired_for != r:
                self._expired_for = r
                self.digests.expire(r)
            camera, weights = dataclasses.replace(camera, model_digest=model_hash_), {}
        self._send_task(r, site_id, model_hash_, camera, weights, artifacts)

    def by_digest(self) -> bool:
        """Whether camera tasks name their model by digest instead of carrying it (``transfer.models_by_digest``).

        Raises:
            ValueError: it is configured but this publisher was built without a store.
        """
        if not self.config.transfer.models_by_digest:
            return False
        if self.digests is None:
            raise ValueError("transfer.models_by_digest needs the coordinator's store (TaskPublisher(store=...))")
        return True

    def _capacity(self, site_id: str) -> int | None:
        """The site's declared capacity (enrolment metadata), sent in its camera tasks; None when it declared none
        (its gateway then refuses the task, naming the fix)."""
        try:
            return self._registry.get(site_id).capacity
        except UnknownSiteError:
            return None

    def _send_task(self, r: int, site_id: str, model_hash_: str, task: TrainingTask,
                   weights: Mapping[str, np.ndarray], artifacts: Mapping[str, bytes] | None) -> None:
        cfg = self.config
        memo = self._payloads
        key = (model_hash_, json.dumps(task.to_json(), sort_keys=True),
               tuple(sorted(artifact_digests(artifacts or {}).values())))
        sealed = memo.get(key)
        if sealed is None:  # encoded and hashed once per distinct task content; each further site is a new header
            env = memo[key] = seal(private_key=self._key, federation_id=cfg.federation_id, site_id=site_id, round=r,
                                   base_model_hash=model_hash_, kind=MessageKind.TASK, sequence=r,
                                   payload=encode_task(task, weights, artifacts),
                                   piece_size=piece_size_for(cfg.transfer.chunk_size_bytes))  # chunks = pieces
        else:
            env = readdress(sealed, private_key=self._key, site_id=site_id)
        store_outgoing_task(cfg, r, site_id, env)  # for resends while the round is open
        send_task_bytes(cfg, self._transport, self._key, site_id, env)

    def resend(self, context: RoundContext | None, site_id: str, round: int, receipt: Receipt) -> None:
        """Answer a site's download receipt for the open round ``context`` (see
        :func:`coordinator.outgoing.answer_download_receipt`)."""
        answer_download_receipt(self.config, self._transport, self._key, context, site_id, round, receipt)
