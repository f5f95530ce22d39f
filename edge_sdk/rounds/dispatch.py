"""The gateway's task dispatch (:class:`TaskDispatch`, a part of :class:`edge_sdk.agent.EdgeAgent`): a message from
the task topic (whole TASK, manifest, chunk or secure-aggregation stage) or from a digest topic, through the checks
of :mod:`edge_sdk.rounds.tasks`, to the round that trains it (camera, radio or Global DP), keeping the task's model
for detect and the field loop.

A task waits instead of training when a newer round's task is already in the inbox (:mod:`edge_sdk.rounds.superseded`),
when its model is named by digest and not yet held (:mod:`edge_sdk.rounds.model_cache`), or, in buffered rounds,
while the previous update is not acknowledged (docs/transport.md, "Buffered rounds")."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from shared.envelope import Envelope, MessageKind
from shared.transfer import is_chunk

from edge_sdk.config import global_model_path
from edge_sdk.global_model import ModelVersion, keep_global_model
from edge_sdk.rounds.context import kind_of
from edge_sdk.rounds.model_cache import WaitingTask
from edge_sdk.rounds.superseded import newer_task_waiting
from edge_sdk.rounds.tasks import AcceptedTask, accept_task

__all__ = ["TaskDispatch"]

log = logging.getLogger("edge_sdk.agent")


class TaskDispatch:
    """The agent's task handling, as a base class of :class:`edge_sdk.agent.EdgeAgent`, which provides what it reads:
    ``ctx`` (:class:`~edge_sdk.rounds.context.AgentContext`), ``config``, ``downloads``, ``digests``, ``secagg``,
    ``backends``, ``camera``, ``radio``, ``records``, ``_inbox`` (the agent's queue of messages not yet handled),
    ``_deferred`` and ``_update_in_flight()``."""

    def handle_task_message(self, data: bytes) -> bool:
        """One message from the task topic: a whole TASK, the manifest or a chunk of a chunked one
        (``shared.transfer``), or a secure-aggregation stage. Returns True if the site trained."""
        if is_chunk(data):
            envelope = self.downloads.chunk(data)
            return envelope is not None and self._handle_task_envelope(envelope)
        kind = kind_of(data)
        if kind == MessageKind.MANIFEST:
            self.downloads.manifest(data)
            return False
        if kind == MessageKind.SECAGG:
            self.secagg.handle(data)
            return False
        return self.handle_task(data)

    def handle_task(self, data: bytes) -> bool:
        """Verify, train and upload for one TASK envelope; returns True if the site trained.

        Every rejection is logged with its reason and counted in :attr:`stats`; nothing here raises for bad
        input from the wire.
        """
        envelope = self.ctx.open(data, MessageKind.TASK, "task")
        return envelope is not None and self._handle_task_envelope(envelope)

    def _handle_task_envelope(self, envelope: Envelope) -> bool:
        """A verified, addressed TASK (whole, or reassembled from chunks checked against the signed manifest)."""
        self.ctx.newest_round_seen = max(self.ctx.newest_round_seen, envelope.header.round)
        accepted = accept_task(self.ctx, envelope)
        if accepted is None:
            return False
        digest = accepted.task.model_digest
        if digest is not None:  # the model was published once for every site (edge_sdk.rounds.model_cache)
            held = self.digests.lookup(digest)
            if held is None:
                self.digests.wait(WaitingTask(envelope, accepted))
                return False
            accepted = dataclasses.replace(accepted, weights=held)
        return self._train(envelope, accepted)

    def _digest_message(self, data: bytes) -> bool:
        """One message from a digest topic: train the waiting task once its model is whole (if it is still new)."""
        ready = self.digests.handle(data)
        if ready is None:
            return False
        waiting, weights = ready
        if waiting.accepted.task.round <= self.ctx.last_round():
            self.ctx.reject("task", "stale_round", f"round {waiting.accepted.task.round}'s model came after a newer "
                            "round was trained")
            return False
        return self._train(waiting.envelope, dataclasses.replace(waiting.accepted, weights=weights))

    def _train(self, envelope: Envelope, accepted: AcceptedTask) -> bool:
        """Train an accepted task whose weights are in hand, unless a newer round's task waits in the inbox
        (:mod:`edge_sdk.rounds.superseded`)."""
        task, weights = accepted.task, accepted.weights
        with self._inbox.mutex:
            waiting = list(self._inbox.queue)
        newer = newer_task_waiting(self.ctx, waiting, task.round)
        if newer is not None:
            self.ctx.reject("task", "superseded", f"round {task.round}'s task is not trained: round {newer}'s waits")
            return False
        if task.max_staleness is not None and self._update_in_flight():
            # buffered rounds: at most one trained update not yet charged (docs/transport.md, "Buffered rounds")
            log.info("site %s: round %d's task waits until the previous update is acknowledged", self.config.site_id,
                     task.round)
            self._deferred = (envelope, accepted)  # a newer task replaces it
            return False
        self.ctx.pacer.begin(task.round, task.round_duration_s)  # its replies leave at a public time slot
        if self.radio is not None:
            return self.radio.train(task, weights, accepted.artifacts)
        if self.backends.select(task, accepted.artifacts, weights) is None:
            return False
        self._keep_model(task, weights, accepted.model_hash, envelope.header.timestamp)
        if task.privacy == "global":
            assert self.records is not None
            return self.secagg.start(task, weights, self.records)
        assert self.camera is not None
        return self.camera.train(task, weights)

    def _keep_model(self, task: object, weights: dict[str, np.ndarray], model_hash: str, timestamp: int) -> None:
        """Keep the task's model for detect and the field loop unless a newer one is kept (a released model of the
        same round or later: :func:`edge_sdk.global_model.keep_global_model`); a failure here must not cost the
        round."""
        try:
            keep_global_model(global_model_path(self.config), weights,
                              ModelVersion(task.round, "task", timestamp, model_hash),  # type: ignore[attr-defined]
                              prediction_offsets=task.prediction_offsets,  # type: ignore[attr-defined]
                              backbone_id=self.config.backbone_id)
        except (OSError, ValueError) as exc:
            log.warning("site %s: could not keep the global model of round %d for detect: %s", self.config.site_id,
                        task.round, exc)  # type: ignore[attr-defined]
