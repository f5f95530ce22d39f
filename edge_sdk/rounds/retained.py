"""Receiving one signed envelope the coordinator keeps retained on a site topic: whole, or as a manifest and chunks.

Model releases (:mod:`edge_sdk.rounds.releases`) and SDK versions (:mod:`edge_sdk.updates.receiver`) come the same
way (the coordinator's side: ``coordinator.retained``): the gateway subscribes to ``<topic>/#`` and gets

- a whole envelope of the expected kind on ``<topic>``, or the signed manifest of a chunked one, checked before any
  chunk is kept: the coordinator's signature, kind, federation and addressee (:class:`AgentContext`), the inner
  envelope's signature and leaves (``shared.transfer``), a size of at most ``max_bytes``;
- its chunks on ``<topic>/<i>``, each checked against its leaf. A broker delivers the retained messages of
  ``<topic>/#`` in no guaranteed order, so chunks that come before their manifest wait in a small buffer (at most
  ``max_bytes`` in all and :data:`MAX_EARLY_CHUNKS` chunks, oldest dropped first) and are checked when it arrives.

Whether an announced envelope is wanted at all (a model older than the one kept, a version already running) is the
caller's ``wanted(header, inner_timestamp)``: an unwanted transfer's chunks are dropped as they come.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from shared.envelope import Envelope, EnvelopeHeader, MessageKind
from shared.errors import EnvelopeError
from shared.transfer import (Chunk, Reassembly, TransferError, check_manifest_header, decode_manifest, is_chunk,
                             verify_manifest)

from edge_sdk.rounds.context import AgentContext, kind_of

__all__ = ["RetainedDownload", "MAX_EARLY_CHUNKS"]

#: Chunks (of any transfers) held at most while their manifest has not come (besides the byte limit).
MAX_EARLY_CHUNKS = 4096


class RetainedDownload:
    """One site topic's retained envelope, reassembled and verified (module docstring).

    Args:
        ctx: the agent's shared state (keys, config, statistics, ``reject``).
        kind: the envelope kind expected (``MODEL``, ``SOFTWARE``).
        what: its name in logs and rejection counters (``"model"``, ``"software"``).
        max_bytes: the largest envelope accepted (checked on its manifest, before any chunk is kept).
        wanted: ``wanted(header, inner_timestamp)`` -> whether an announced envelope is worth receiving; the
            header is the outer one (of the manifest when chunked, whose inner timestamp is passed too).
        announced: ``announced(header, total_length, num_chunks)``, called once per new chunked transfer (logging).
        addressee: the header ``site_id`` expected (default: this site's; ``shared.envelope.BROADCAST_SITE_ID`` for
            the models published once by digest).
    """

    def __init__(self, ctx: AgentContext, *, kind: MessageKind, what: str, max_bytes: int,
                 wanted: Callable[[EnvelopeHeader, int | None], bool],
                 announced: Callable[[EnvelopeHeader, int, int], None] = lambda *_: None,
                 addressee: str | None = None) -> None:
        self.ctx = ctx
        self._addressee = addressee
        self._kind, self._what, self._max_bytes = kind, what, max_bytes
        self._wanted, self._announced = wanted, announced
        self._download: Reassembly | None = None  # the chunked transfer being assembled (at most one: the newest)
        self._early: OrderedDict[str, dict[int, Chunk]] = OrderedDict()  # transfer id -> chunks before a manifest
        self._early_bytes = 0
        self._settled: deque[str] = deque(maxlen=16)  # transfers taken or turned down: their chunks are dropped

    def handle(self, data: bytes) -> Envelope | None:
        """One message from the topic; returns the complete, verified, addressed envelope when one is whole (and
        wanted, for a chunked one). Nothing here raises for bad input from the wire: every refusal is counted and
        logged (``ctx.reject``)."""
        if not data:
            return None  # an empty retained message clears a chunk topic; a broker does not deliver it
        if is_chunk(data):
            return self._chunk(data)
        if kind_of(data) == MessageKind.MANIFEST:
            return self._manifest(data)
        return self.ctx.open(data, self._kind, self._what, addressee=self._addressee)

    def _manifest(self, data: bytes) -> Envelope | None:
        ctx, what = self.ctx, self._what
        envelope = ctx.open(data, MessageKind.MANIFEST, f"{what} manifest", addressee=self._addressee)
        if envelope is None:
            return None
        try:
            manifest = decode_manifest(envelope.payload)
            check_manifest_header(manifest, envelope.header)
            verify_manifest(manifest, ctx.coordinator_key)
        except EnvelopeError as exc:
            ctx.reject(f"{what} manifest", exc.reason, str(exc))
            return None
        if manifest.kind != self._kind or manifest.total_length > self._max_bytes:
            ctx.reject(f"{what} manifest", "oversized" if manifest.kind == self._kind else "wrong_kind",
                       f"{manifest.kind.value} of {manifest.total_length} bytes (this site takes at most "
                       f"{self._max_bytes} bytes, max_task_bytes)")
            return None
        if not self._wanted(envelope.header, manifest.header.timestamp):
            self._settle(manifest.transfer_id)  # held chunks freed; its retained chunks are dropped as they come
            return None
        if self._download is not None and self._download.manifest.transfer_id == manifest.transfer_id:
            return None  # a repeat: the chunks held are kept
        self._download = Reassembly(manifest, envelope, ttl_s=ctx.config.download_ttl_s)
        self._announced(envelope.header, manifest.total_length, manifest.num_chunks)
        early = self._early.pop(manifest.transfer_id, {})
        self._early_bytes -= sum(len(c.data) for c in early.values())
        for chunk in early.values():
            inner = self._add(chunk)
            if inner is not None:
                return inner
        return None

    def _chunk(self, data: bytes) -> Envelope | None:
        ctx = self.ctx
        try:
            chunk = Chunk.from_bytes(data, max_data_bytes=max(ctx.config.chunk_size_bytes, 1 << 20))
        except TransferError as exc:
            ctx.reject(f"{self._what} chunk", exc.reason, str(exc))
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
            self.ctx.reject(f"{self._what} chunk", exc.reason, str(exc))
            return None
        self._download = None
        self._settle(chunk.transfer_id)
        return self.ctx.addressed(inner, self._kind, self._what, addressee=self._addressee)

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
        while self._early and (self._early_bytes > self._max_bytes
                               or sum(map(len, self._early.values())) > MAX_EARLY_CHUNKS):
            _, dropped = self._early.popitem(last=False)  # the oldest transfer: a leftover of an earlier one
            self._early_bytes -= sum(len(c.data) for c in dropped.values())
