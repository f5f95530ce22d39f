"""Model releases: the global model the coordinator publishes, retained, on the site's ``model`` topics after every
round that makes a new one (``shared.releases``), kept as the gateway's global model, which ``detect`` and the field
loop predict with (:mod:`edge_sdk.global_model`). No file is copied by hand.

The gateway subscribes to ``model/#`` (``shared.topics.model_filter``): a whole MODEL envelope on ``model``, or the
signed manifest of a chunked one and its chunks on ``model/<i>``, all checked as
:class:`edge_sdk.rounds.retained.RetainedDownload` says (at most ``max_task_bytes``).

A complete MODEL is taken (:meth:`ModelReleases.take`) when its payload decodes, its release names the header's
federation and round, its weights hash to the model hash the coordinator signed (header and payload), and it is
newer than the model kept (:func:`edge_sdk.global_model.keep_global_model`): the same model again is a no-op
(``models_unchanged``), an older one is refused (``rejected:stale_model``), so a replayed or delayed release never
takes the gateway back. Radio base stations keep no model: their releases are ignored (the coordinator sends none).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind
from shared.errors import EnvelopeError
from shared.releases import decode_release

from edge_sdk.config import global_model_path
from edge_sdk.global_model import ModelVersion, keep_global_model, kept_version
from edge_sdk.rounds.context import AgentContext
from edge_sdk.rounds.retained import RetainedDownload

__all__ = ["ModelReleases"]

log = logging.getLogger(__name__)

class ModelReleases:
    """The site's side of model releases (module docstring).

    Args:
        ctx: the agent's shared state (keys, config, statistics).
        on_kept: ``on_kept(version)`` after a new model was kept (the agent sends a health record).
        cache: ``cache(model hash, weights)``: also keep a released model's weights as trained by their hash, for
            tasks that name their model by digest (``edge_sdk.rounds.model_cache.DigestModels.store``).
    """

    def __init__(self, ctx: AgentContext, *, on_kept: Callable[[ModelVersion], None] | None = None,
                 cache: Callable[[str, dict[str, np.ndarray]], None] | None = None) -> None:
        self.ctx = ctx
        self._on_kept = on_kept
        self._cache = cache
        self._download = RetainedDownload(
            ctx, kind=MessageKind.MODEL, what="model", max_bytes=ctx.config.max_task_bytes,
            wanted=lambda h, inner: self._wanted(h.round, h.timestamp, h.base_model_hash, inner),
            announced=lambda h, size, chunks: log.info("site %s: model of round %d announced (%d bytes in %d "
                                                       "chunks)", ctx.site_id, h.round, size, chunks))

    def handle(self, data: bytes) -> bool:
        """One message from the site's model topics; returns True when a new model was kept. Nothing here raises
        for bad input from the wire: every refusal is counted and logged."""
        envelope = self._download.handle(data)
        return envelope is not None and self._whole(envelope)

    # -- the model -----------------------------------------------------------------------------------------------
    def _wanted(self, round_: int, timestamp: int, model_hash_: str, inner_timestamp: int | None = None) -> bool:
        """Whether a release of ``round_`` (model ``model_hash_``) could be newer than the kept model; counts and
        logs why not."""
        ctx = self.ctx
        if ctx.config.task != "camera":
            ctx.stats["models_ignored"] += 1
            return False
        kept = kept_version(global_model_path(ctx.config))
        if kept is not None and kept.model_hash == model_hash_:
            ctx.stats["models_unchanged"] += 1
            return False
        stamp = inner_timestamp if inner_timestamp is not None else timestamp
        if kept is not None and kept.order >= ModelVersion(round_, "release", stamp, model_hash_).order:
            ctx.reject("model", "stale_model", f"round {round_} model {model_hash_[:12]} is older than the kept "
                       f"{kept.source} model of round {kept.round} ({kept.model_hash[:12]})")
            return False
        return True

    def _whole(self, envelope: Envelope) -> bool:
        """A verified, addressed MODEL envelope (whole, or reassembled from chunks checked against its manifest)."""
        ctx, h = self.ctx, envelope.header
        if not self._wanted(h.round, h.timestamp, h.base_model_hash):
            return False
        try:
            release, weights = decode_release(envelope.payload)
        except EnvelopeError as exc:  # PayloadError
            ctx.reject("model", exc.reason, str(exc))
            return False
        if release.round != h.round or release.federation_id != h.federation_id:
            ctx.reject("model", "header_mismatch", "the release's round/federation differ from the envelope header")
            return False
        actual = model_hash(weights)
        if not (release.model_hash == h.base_model_hash == actual):
            ctx.reject("model", "model_hash", f"weights hash {actual[:12]} does not match the signed model hash "
                       f"{h.base_model_hash[:12]}")
            return False
        if self._cache is not None:
            self._cache(actual, weights)
        return self.take(ModelVersion(h.round, "release", h.timestamp, actual), weights,
                         release.prediction_offsets)

    def take(self, version: ModelVersion, weights: dict[str, np.ndarray],
             offsets: tuple[float, ...] | None) -> bool:
        """Keep ``weights`` as the site's global model if newer (:func:`edge_sdk.global_model.keep_global_model`);
        returns True when it was written."""
        ctx = self.ctx
        try:
            outcome = keep_global_model(global_model_path(ctx.config), weights, version, prediction_offsets=offsets,
                                        backbone_id=ctx.config.backbone_id)
        except (OSError, ValueError) as exc:
            ctx.reject("model", "not_kept", f"the model of round {version.round} could not be kept: {exc}")
            return False
        if outcome == "unchanged":
            ctx.stats["models_unchanged"] += 1
            return False
        if outcome == "older":
            ctx.reject("model", "stale_model", f"round {version.round} model is older than the kept one")
            return False
        ctx.stats["models_kept"] += 1
        log.info("site %s: kept the global model of round %d (%s) for detect and the field loop", ctx.site_id,
                 version.round, version.model_hash[:12])
        if self._on_kept is not None:
            self._on_kept(version)
        return True
