"""Model releases: the global model the coordinator publishes, retained, on the site's ``model`` topics after every
round that makes a new one (``shared.releases``), kept as the gateway's global model, which ``detect`` and the field
loop predict with (:mod:`edge_sdk.global_model`). No file is copied by hand.

The gateway subscribes to ``model/#`` (``shared.topics.model_filter``). What arrives there:

- a whole MODEL envelope on ``model``, or the signed manifest of a chunked one (inner kind MODEL), checked before
  any chunk is kept: the coordinator's signature, kind, federation and addressee (:class:`AgentContext`), the inner
  envelope's signature and leaves (``shared.transfer``), a size of at most ``max_task_bytes``;
- its chunks on ``model/<i>``, each checked against its leaf. A broker delivers the retained messages of ``model/#``
  in no guaranteed order, so chunks that come before their manifest wait in a small buffer (at most
  ``max_task_bytes`` in all, oldest dropped first) and are checked when it arrives.

A complete MODEL is taken (:meth:`ModelReleases.take`) when its payload decodes, its release names the header's
federation and round, its weights hash to the model hash the coordinator signed (header and payload), and it is
newer than the model kept (:func:`edge_sdk.global_model.keep_global_model`): the same model again is a no-op
(``models_unchanged``), an older one is refused (``rejected:stale_model``), so a replayed or delayed release never
takes the gateway back. Radio base stations keep no model: their releases are ignored (the coordinator sends none).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

from shared.codec import model_hash
from shared.envelope import Envelope, MessageKind
from shared.errors import EnvelopeError
from shared.releases import decode_release
from shared.transfer import (Chunk, Reassembly, TransferError, check_manifest_header, decode_manifest, is_chunk,
                             verify_manifest)

from edge_sdk.config import global_model_path
from edge_sdk.global_model import ModelVersion, keep_global_model, kept_version
from edge_sdk.rounds.context import AgentContext, kind_of

__all__ = ["ModelReleases"]

log = logging.getLogger(__name__)

#: Chunks (of any transfers) held at most while their manifest has not come (besides the byte limit).
MAX_EARLY_CHUNKS = 4096


class ModelReleases:
    """The site's side of model releases (module docstring).

    Args:
        ctx: the agent's shared state (keys, config, statistics).
        on_kept: ``on_kept(version)`` after a new model was kept (the agent sends a health record).
    """

    def __init__(self, ctx: AgentContext, *, on_kept: Callable[[ModelVersion], None] | None = None) -> None:
        self.ctx = ctx
        self._on_kept = on_kept
        self._download: Reassembly | None = None  # the chunked release being assembled (at most one: the newest)
        self._early: OrderedDict[str, dict[int, Chunk]] = OrderedDict()  # transfer id -> chunks before a manifest
        self._early_bytes = 0
        self._settled: deque[str] = deque(maxlen=16)  # transfers taken or turned down: their chunks are dropped

    def handle(self, data: bytes) -> bool:
        """One message from the site's model topics; returns True when a new model was kept. Nothing here raises
        for bad input from the wire: every refusal is counted and logged."""
        if not data:
            return False  # an empty retained message clears a chunk topic; a broker does not deliver it
        if is_chunk(data):
            envelope = self._chunk(data)
            return envelope is not None and self._whole(envelope)
        kind = kind_of(data)
        if kind == MessageKind.MANIFEST:
            return self._manifest(data)
        envelope = self.ctx.open(data, MessageKind.MODEL, "model")
        return envelope is not None and self._whole(envelope)

    # -- chunked releases ----------------------------------------------------------------------------------------
    def _manifest(self, data: bytes) -> bool:
        ctx, config = self.ctx, self.ctx.config
        envelope = ctx.open(data, MessageKind.MANIFEST, "model manifest")
        if envelope is None:
            return False
        try:
            manifest = decode_manifest(envelope.payload)
            check_manifest_header(manifest, envelope.header)
            verify_manifest(manifest, ctx.coordinator_key)
        except EnvelopeError as exc:
            ctx.reject("model manifest", exc.reason, str(exc))
            return False
        if manifest.kind != MessageKind.MODEL or manifest.total_length > config.max_task_bytes:
            ctx.reject("model manifest", "oversized" if manifest.kind == MessageKind.MODEL else "wrong_kind",
                       f"{manifest.kind.value} of {manifest.total_length} bytes (this site takes models of at most "
                       f"{config.max_task_bytes} bytes, max_task_bytes)")
            return False
        h = envelope.header
        if not self._wanted(h.round, h.timestamp, h.base_model_hash, manifest.header.timestamp):
            self._settle(manifest.transfer_id)  # held chunks freed; its retained chunks are dropped as they come
            return False
        if self._download is not None and self._download.manifest.transfer_id == manifest.transfer_id:
            return False  # a repeat: the chunks held are kept
        self._download = Reassembly(manifest, envelope, ttl_s=config.download_ttl_s)
        log.info("site %s: model of round %d announced (%d bytes in %d chunks)", ctx.site_id, h.round,
                 manifest.total_length, manifest.num_chunks)
        early = self._early.pop(manifest.transfer_id, {})
        self._early_bytes -= sum(len(c.data) for c in early.values())
        for chunk in early.values():
            inner = self._add(chunk)
            if inner is not None:
                return self._whole(inner)
        return False

    def _chunk(self, data: bytes) -> Envelope | None:
        ctx = self.ctx
        try:
            chunk = Chunk.from_bytes(data, max_data_bytes=max(ctx.config.chunk_size_bytes, 1 << 20))
        except TransferError as exc:
            ctx.reject("model chunk", exc.reason, str(exc))
            return None
        if self._download is not None and chunk.transfer_id == self._download.manifest.transfer_id:
            return self._add(chunk)
        if chunk.transfer_id not in self._settled:
            self._hold(chunk)  # its manifest may come after it (retained messages come in no fixed order)
        return None

    def _add(self, chunk: Chunk) -> Envelope | None:
        download = self._download
        assert download is not None
        try:
            if not download.add(chunk):  # one BLAKE3 over the chunk against its signed leaf
                return None
            inner = download.assemble()
        except TransferError as exc:
            self.ctx.reject("model chunk", exc.reason, str(exc))
            return None
        self._download = None
        self._settle(chunk.transfer_id)
        return self.ctx.addressed(inner, MessageKind.MODEL, "model")

    def _settle(self, transfer_id: str) -> None:
        """A transfer taken or turned down: free the chunks held for it and drop those still to come."""
        if transfer_id not in self._settled:
            self._settled.append(transfer_id)
        dropped = self._early.pop(transfer_id, {})
        self._early_bytes -= sum(len(c.data) for c in dropped.values())

    def _hold(self, chunk: Chunk) -> None:
        held = self._early.setdefault(chunk.transfer_id, {})
        if chunk.index in held:
            return
        held[chunk.index] = chunk
        self._early_bytes += len(chunk.data)
        limit = self.ctx.config.max_task_bytes
        while self._early and (self._early_bytes > limit or sum(map(len, self._early.values())) > MAX_EARLY_CHUNKS):
            _, dropped = self._early.popitem(last=False)  # the oldest transfer: a leftover of an earlier model
            self._early_bytes -= sum(len(c.data) for c in dropped.values())

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
