"""Models by digest, the gateway's side: a task that names its model by digest (``TrainingTask.model_digest``) trains
on the model the coordinator published once for every site (``coordinator.model_digests``); this module finds it.

Where the weights come from, in this order (:meth:`DigestModels.lookup`):

1. the cache folder ``<state>/models/<digest>.safetensors``: the models this gateway received by digest and the
   models the coordinator released to it (:mod:`edge_sdk.rounds.releases`; the release after round r is, for
   FedAvg, the model round r + 1 trains from), the newest :data:`MAX_CACHED_MODELS` kept;
2. the kept global model (``<state>/global-model.safetensors``) when it was kept without a logit adjustment and its
   weights hash to the digest.

Each is hashed (``shared.codec.model_hash``) and used only when it equals the digest: nothing is downloaded then.
Otherwise the task waits (:meth:`DigestModels.wait`; one task at most, a newer one replaces it) and the gateway
subscribes to the digest's topics (``shared.topics.digest_filter``): the retained MODEL envelope, whole or as a
signed manifest and chunks (:class:`edge_sdk.rounds.retained.RetainedDownload`, addressed to
``shared.envelope.BROADCAST_SITE_ID``, at most ``max_task_bytes``). It is taken when the coordinator's signature
verifies, its header names the digest, its release payload decodes and names the digest, and the weights hash to
it; then it is cached, the subscription is dropped (where the transport can) and the waiting task goes on. A
reconnect resubscribes, so a download cut short resumes from the broker's retained messages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.codec import decode_tensors, encode_tensors, model_hash
from shared.envelope import BROADCAST_SITE_ID, Envelope, MessageKind
from shared.errors import EnvelopeError
from shared.releases import decode_release
from shared.topics import digest_filter

from edge_sdk.config import global_model_path
from edge_sdk.rounds.context import AgentContext
from edge_sdk.rounds.retained import RetainedDownload
from edge_sdk.rounds.tasks import AcceptedTask
from edge_sdk.site_paths import state_dir
from edge_sdk.uplink.transport import Transport

__all__ = ["DigestModels", "WaitingTask", "MAX_CACHED_MODELS", "model_cache_dir"]

log = logging.getLogger(__name__)

MAX_CACHED_MODELS = 4
"""Models kept in the cache folder (the newest by modification time; older files are removed)."""


def model_cache_dir(state: Path) -> Path:
    """``<state>/models``: the models cached by digest."""
    return state / "models"


@dataclass(frozen=True)
class WaitingTask:
    """A task accepted but waiting for its model: the TASK envelope and what :func:`accept_task` made of it."""

    envelope: Envelope
    accepted: AcceptedTask


class DigestModels:
    """Finds, downloads and caches the models tasks name by digest (module docstring).

    Args:
        ctx: the agent's shared state (keys, config, statistics).
        transport: the uplink (subscriptions to digest topics).
        on_message: ``on_message(topic, payload)``, the callback the digest subscriptions deliver to (the agent
            enqueues; its loop then calls :meth:`handle`).
    """

    def __init__(self, ctx: AgentContext, transport: Transport, on_message: Callable[[str, bytes], None]) -> None:
        self.ctx = ctx
        self._transport = transport
        self._on_message = on_message
        self.folder = model_cache_dir(state_dir(ctx.config))
        self.waiting: WaitingTask | None = None
        self._subscribed: str | None = None  # the digest filter subscribed to
        self._download: RetainedDownload | None = None

    # -- what the gateway holds -----------------------------------------------------------------------------------
    def lookup(self, digest: str) -> dict[str, np.ndarray] | None:
        """The weights (float32 by name) whose hash is ``digest`` from the cache folder or the kept model; None when
        neither holds them."""
        path = self.folder / f"{digest}.safetensors"
        for candidate in (path, global_model_path(self.ctx.config)):
            try:
                tensors, metadata = decode_tensors(candidate.read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, EnvelopeError) as exc:  # PayloadError: a torn file
                log.warning("site %s: model file %s unreadable (%s); ignored", self.ctx.site_id, candidate, exc)
                continue
            if candidate != path and (metadata.get("model_hash") != digest or "prediction_offsets" in metadata):
                continue  # the kept model is another one, or adjusted for prediction (not the weights as trained)
            weights = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
            if model_hash(weights) == digest:
                self.ctx.stats["models_by_digest_held"] += 1
                return weights
            log.warning("site %s: %s does not hash to %s; ignored", self.ctx.site_id, candidate, digest[:12])
        return None

    def store(self, digest: str, weights: dict[str, np.ndarray]) -> None:
        """Cache ``weights`` (hash ``digest``) atomically and drop all but the newest :data:`MAX_CACHED_MODELS`.
        A failure to write is logged, never raised (the cache is an optimisation)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{digest}.safetensors"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(encode_tensors({k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
                                           metadata={"model_hash": digest}))
            os.replace(tmp, path)
            cached = sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
            for old in cached[MAX_CACHED_MODELS:]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("site %s: model %s not cached: %s", self.ctx.site_id, digest[:12], exc)

    # -- waiting for a download -----------------------------------------------------------------------------------
    def wait(self, waiting: WaitingTask) -> None:
        """Hold ``waiting`` (replacing an older waiting task) and subscribe to its digest's topics."""
        digest = waiting.accepted.task.model_digest
        assert digest is not None
        if self.waiting is not None and self.waiting.accepted.task.round > waiting.accepted.task.round:
            return  # a delayed older task: the newer one keeps waiting
        self.waiting = waiting
        topic_filter = digest_filter(self.ctx.config.federation_id, digest)
        if self._subscribed == topic_filter:
            return
        self._unsubscribe()
        self._download = RetainedDownload(
            self.ctx, kind=MessageKind.MODEL, what="digest model", max_bytes=self.ctx.config.max_task_bytes,
            wanted=lambda h, _inner: self.waiting is not None and h.base_model_hash == self._digest(),
            addressee=BROADCAST_SITE_ID)
        self._subscribed = topic_filter
        log.info("site %s: round %d trains model %s, which it does not hold: downloading it", self.ctx.site_id,
                 waiting.accepted.task.round, digest[:12])
        self._transport.subscribe(topic_filter, self._on_message)  # retained messages come at once

    def _digest(self) -> str | None:
        return None if self.waiting is None else self.waiting.accepted.task.model_digest

    def handle(self, data: bytes) -> tuple[WaitingTask, dict[str, np.ndarray]] | None:
        """One message from a digest topic; returns the waiting task and its model's weights once they are whole and
        verified (module docstring), else None. Nothing here raises for bad input from the wire."""
        if self._download is None or self.waiting is None:
            return None
        envelope = self._download.handle(data)
        if envelope is None:
            return None
        digest, h = self._digest(), envelope.header
        try:
            release, weights = decode_release(envelope.payload)
        except EnvelopeError as exc:  # PayloadError
            self.ctx.reject("digest model", exc.reason, str(exc))
            return None
        actual = model_hash(weights)
        if not (h.base_model_hash == release.model_hash == actual == digest
                and release.federation_id == h.federation_id):
            self.ctx.reject("digest model", "model_hash", f"weights hash {actual[:12]} is not the digest "
                            f"{str(digest)[:12]} the task and the signed header name")
            return None
        assert digest is not None
        waiting, self.waiting = self.waiting, None
        self.ctx.stats["models_by_digest_downloaded"] += 1
        self.store(digest, weights)
        self._unsubscribe()
        return waiting, weights

    def _unsubscribe(self) -> None:
        if self._subscribed is not None:
            self._transport.unsubscribe(self._subscribed)  # a transport that cannot keeps it (messages ignored)
        self._subscribed, self._download = None, None
