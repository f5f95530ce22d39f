"""Chunked task downloads: a task over the chunk size arrives as a signed manifest and chunks
(:mod:`shared.transfer`); the gateway reassembles it, verifying each chunk against its signed leaf, and asks for
what is missing.

Asking for the open round's task (a gateway that was away when the round opened: the broker keeps nothing for a
clean session): after every (re)connect, whatever the outbox holds, and again each time the outbox drains,
:meth:`TaskDownloads.request` sends a "no transfer" receipt and the coordinator resends the open round's task if
the site was selected and has not delivered yet.

Chunks that never arrive: a chunk of a task download still missing after ``max_chunk_requests`` requests for a
stalled download (no new chunk for ``resend_interval_s``; requests made on reconnecting do not count) is being
dropped on the way, typically by a broker whose message limit is below the chunk size. The download is then given
up with an error naming the coordinator's ``transfer.chunk_size_bytes`` instead of being retried forever.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from shared.envelope import Envelope, MessageKind, seal
from shared.errors import EnvelopeError
from shared.topics import update_topic
from shared.transfer import (NO_TRANSFER, Chunk, Reassembly, Receipt, TransferError, check_manifest_header,
                             decode_manifest, encode_receipt, verify_manifest)

from edge_sdk.rounds.context import AgentContext
from edge_sdk.uplink.transport import TransportError

__all__ = ["TaskDownloads"]

log = logging.getLogger(__name__)


class TaskDownloads:
    """The site's chunked task downloads in progress (module docstring).

    Args:
        ctx: the agent's shared state.
        busy: True while a secure-aggregation round runs (the open round's task is not asked for then).
    """

    def __init__(self, ctx: AgentContext, *, busy: Callable[[], bool]) -> None:
        self.ctx = ctx
        self._busy = busy
        self.active: dict[str, Reassembly] = {}  # transfer id -> download in progress
        self._completed: deque[str] = deque(maxlen=16)  # recent transfer ids (repeats are ignored)
        self._requests: dict[str, Counter[int]] = {}  # stalled download -> requests per missing chunk

    def manifest(self, data: bytes) -> None:
        """A task's signed manifest: start (or keep) its download."""
        ctx, config = self.ctx, self.ctx.config
        envelope = ctx.open(data, MessageKind.MANIFEST, "manifest")
        if envelope is None:
            return
        try:
            manifest = decode_manifest(envelope.payload)
        except TransferError as exc:
            ctx.reject("manifest", exc.reason, str(exc))
            return
        try:  # the inner task: announced by this manifest's header, signed by the coordinator (before any chunk)
            check_manifest_header(manifest, envelope.header)
            verify_manifest(manifest, ctx.coordinator_key)
        except EnvelopeError as exc:
            ctx.reject("manifest", exc.reason, str(exc))
            return
        if manifest.kind != MessageKind.TASK or manifest.total_length > config.max_task_bytes:
            ctx.reject("manifest", "oversized" if manifest.kind == MessageKind.TASK else "wrong_kind",
                       f"{manifest.kind.value} of {manifest.total_length} bytes (this site takes tasks of at most "
                       f"{config.max_task_bytes} bytes)")
            return
        last = ctx.last_round()
        if envelope.header.round <= last:
            ctx.reject("manifest", "stale_round", f"round {envelope.header.round} <= last trained round {last}")
            return
        for tid in [t for t, r in self.active.items() if r.expired()]:
            del self.active[tid]
            ctx.stats["downloads_expired"] += 1
        if manifest.transfer_id in self.active or manifest.transfer_id in self._completed:
            return  # a repeat: the chunks held are kept
        self.active[manifest.transfer_id] = Reassembly(manifest, envelope, ttl_s=config.download_ttl_s)
        log.info("site %s: round %d task announced (%d bytes in %d chunks)", ctx.site_id, envelope.header.round,
                 manifest.total_length, manifest.num_chunks)

    def chunk(self, data: bytes) -> Envelope | None:
        """One chunk; returns the reassembled, verified, addressed TASK envelope when it completes a download."""
        ctx = self.ctx
        try:
            chunk = Chunk.from_bytes(data, max_data_bytes=max(ctx.config.chunk_size_bytes, 1 << 20))
            reassembly = self.active.get(chunk.transfer_id)
            if reassembly is None:
                if chunk.transfer_id not in self._completed:
                    ctx.reject("chunk", "unknown_transfer", f"chunk {chunk.index} of {chunk.transfer_id[:12]}")
                return None
            if not reassembly.add(chunk):  # one BLAKE3 over the chunk against its signed leaf
                return None
            inner = reassembly.assemble()  # verified piece by piece: not hashed again
        except TransferError as exc:
            ctx.reject("chunk", exc.reason, str(exc))
            return None
        del self.active[chunk.transfer_id]
        self._requests.pop(chunk.transfer_id, None)
        self._completed.append(chunk.transfer_id)
        return ctx.addressed(inner, MessageKind.TASK, "task")

    def stalled(self) -> list[str]:
        """Unexpired downloads with no new chunk for ``resend_interval_s`` (their transfer ids)."""
        now = time.monotonic()
        return [t for t, r in self.active.items()
                if not r.expired() and now - r.last_progress > self.ctx.config.resend_interval_s]

    def _abandon(self, transfer_id: str, index: int, times: int) -> None:
        """Give up a task download whose chunk ``index`` never arrives although asked for ``times`` times."""
        r = self.active.pop(transfer_id)
        self._requests.pop(transfer_id, None)
        self._completed.append(transfer_id)  # repeats of its manifest and chunks are ignored
        self.ctx.stats["downloads_abandoned"] += 1
        log.error("site %s: round %d task download given up: chunk %d (%d bytes + 40 of header) was asked for %d "
                  "times and never arrived; the broker drops it, most likely because the coordinator's "
                  "transfer.chunk_size_bytes (%d) is above the broker's message size limit (fix: lower "
                  "transfer.chunk_size_bytes and set broker_max_packet_bytes to the broker's limit in the coordinator "
                  "config)", self.ctx.site_id, r.envelope.header.round, index, r.manifest.chunk_size, times,
                  r.manifest.chunk_size)

    def request(self, *, open_round: bool = True, only_stalled: bool = False) -> int:
        """Ask the coordinator for the missing chunks of every unfinished download (``only_stalled``: of those
        with no new chunk for ``resend_interval_s``), and, when none is in progress and no secure-aggregation round
        runs, for the open round's task (``open_round``). Requests for a stalled download are counted per missing
        chunk; one asked for ``max_chunk_requests`` times gives the download up instead. Returns the number of
        receipts sent."""
        ctx = self.ctx
        stalled = set(self.stalled()) if only_stalled else None
        receipts = []
        for tid, r in list(self.active.items()):
            if r.expired() or (stalled is not None and tid not in stalled):
                continue
            missing = r.missing()
            if stalled is not None:  # nothing came for a whole interval: this request is evidence, count it
                counts = self._requests.setdefault(tid, Counter())
                counts.update(missing)
                index, times = max(counts.items(), key=lambda kv: (kv[1], -kv[0]), default=(0, 0))
                if times >= ctx.config.max_chunk_requests:
                    self._abandon(tid, index, times)
                    continue
            receipts.append((r.envelope.header.round, r.envelope.header.base_model_hash, Receipt(tid, missing)))
        if open_round and not self.active and not self._busy():
            receipts.append((ctx.last_round() + 1, "", Receipt(NO_TRANSFER, ())))
        topic = update_topic(ctx.config.federation_id, ctx.site_id)
        sent = 0
        for round_, base_hash, receipt in receipts:
            envelope = seal(private_key=ctx.signing_key, federation_id=ctx.config.federation_id, site_id=ctx.site_id,
                            round=round_, base_model_hash=base_hash, kind=MessageKind.RECEIPT,
                            sequence=ctx.next_sequence(), payload=encode_receipt(receipt))
            try:
                ctx.transport.publish(topic, envelope.to_bytes(), qos=1)
                sent += 1
            except TransportError as exc:
                log.warning("site %s: receipt not sent (%s); asked again at the next reconnect", ctx.site_id, exc)
        return sent
