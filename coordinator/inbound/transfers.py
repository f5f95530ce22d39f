"""Chunked uploads on the coordinator: staging, resume, expiry, and hand-over to ingest (:mod:`shared.transfer`).

Everything a site publishes on its update topic comes through :class:`TransferReceiver` first:

* a message longer than the limit is refused before any parsing (``oversized``);
* every other message is parsed once, here, and the parsed envelope is handed on (never parsed again);
* a plain UPDATE envelope (small enough to travel whole) goes straight to ingest
  (:meth:`coordinator.inbound.ingest.Ingestor.handle_envelope`);
* a MANIFEST envelope is checked like an update (topic, federation, site, signature with one of the site's valid
  keys, replay window) and against the open round before any chunk is kept (:meth:`Ingestor.precheck`); so is the
  inner envelope it announces: its header must name what the manifest's does (site, round, sequence, base model
  hash), its signature must verify with one of the site's valid keys, and the piece digests (leaves) must derive its
  signed payload digest (:mod:`shared.transfer`). A new transfer is recorded (``transfers`` table). A manifest
  marked ``resume`` (the site reconnected or timed out) is answered with a signed RECEIPT listing the chunks still
  missing, and the site sends only those. A manifest for an update that is already stored gets its positive ACK
  again;
* a chunk is checked against its transfer's manifest (index, length, one BLAKE3 over its data against its leaf: the
  only pass over the payload's bytes) and staged (:class:`coordinator.inbound.staging.ChunkStaging`: in memory, or past
  a limit in ``<data_dir>/transfers/<transfer id>/``); when the last one is in, the inner envelope is the
  manifest's header and signature with the pieces joined, verified already, and goes to ingest with the fingerprint
  of the key that verified it (:meth:`Ingestor.handle_envelope`), which checks that key is still valid, hashes
  nothing, stores the update durably, ACKs it and aggregates it; the staging is then deleted;
* a RECEIPT from a site asks for the missing chunks of a *download* (a task); it goes to the round manager.

Chunk data waits in memory for a transfer of at most ``spill_above_bytes`` whose announced size fits in what is
left of ``memory_limit_bytes`` (defaults 64 MiB and 256 MiB; sizes are reserved at the manifest); such a transfer
has no database row, and a coordinator restart forgets it (the gateway's resume manifest then gets a receipt listing
every chunk). Any other transfer is staged on disk and its manifest recorded (``transfers`` table), so a restarted
coordinator answers its resume manifest with exactly the chunks still missing. Chunk files are not fsync-ed: a piece
this process did not check and write itself (staged before a restart, or by another worker) is checked against its
leaf again at assembly, so a chunk torn by a power cut is simply asked for again; a piece it checked is not hashed
twice.

Several ingest workers (``shared_staging=True``, coordinator.inbound.workers): the broker spreads one transfer's chunks
over the workers of the shared subscription, so every transfer is staged on disk in the shared ``data_dir`` and recorded
in the shared database (PostgreSQL), and whichever worker receives the last chunk assembles it (the behaviour before
in-memory staging, kept for this deployment).

Transfers not completed within ``ttl_s`` (default 48 h) expire: :meth:`TransferReceiver.sweep` deletes them, and
a site whose transfer expired starts over (its next manifest is new again).

A chunk that a broker drops (the site's ``chunk_size_bytes`` above the broker's message size limit) is listed in
every receipt. The gateway, which knows what it sent before each resume probe, notices and gives the upload up
(shared.transfer.ResendTracker, edge_sdk.agent); the receiver only answers, so it never stops a transfer that may
still be making its way over a poor link (an unfinished one expires after ``ttl_s``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import delete, select, tuple_
from sqlalchemy.exc import IntegrityError

from shared.envelope import Envelope, EnvelopeHeader, MessageKind
from shared.errors import ConfigError, EnvelopeError, MalformedEnvelopeError
from shared.transfer import (CHUNK_HEADER_LENGTH, Chunk, Manifest, Receipt, TransferError, assemble, check_chunk,
                             check_manifest_header, decode_manifest, decode_receipt, encode_receipt, is_chunk)

from coordinator.inbound.context import Accepted, Pending
from coordinator.inbound.ingest import Ingestor
from coordinator.inbound.reject import Reject, RejectReason
from coordinator.inbound.replies import send_to_site
from coordinator.inbound.site_checks import (check_header_ranges, check_site_topic, parse_site_topic,
                                             verify_site_envelope, verify_site_signature)
from coordinator.registry import SiteRegistry
from coordinator.inbound.staging import ChunkStaging, StagingLimits
from coordinator.storage import Store, TransferRow, UpdateRow
from coordinator.transport import Transport, TransportError

__all__ = ["TransferLimits", "TransferReceiver", "SWEEP_INTERVAL_S"]

SWEEP_INTERVAL_S = 60.0
"""Seconds between expiry sweeps triggered by incoming manifests (the coordinator also sweeps at start)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferLimits:
    """Size and time limits of uploads (``transfer:`` in the coordinator config).

    Attributes:
        max_chunk_bytes: largest chunk data accepted, bytes (the sender's chunk size must not exceed it).
        max_update_bytes: largest inner envelope a manifest may announce, bytes.
        max_message_bytes: largest MQTT payload looked at, bytes; checked before any parsing. A whole (unchunked)
            envelope must fit in it; anything larger must be chunked.
        ttl_s: seconds after which an incomplete transfer expires.
        memory_limit_bytes: announced bytes of the transfers staged in memory, together (coordinator.inbound.staging; an
            upload is admitted to memory at its manifest if its size fits; 0: all on disk).
        spill_above_bytes: a transfer larger than this is staged on disk (it resumes across a restart).

    Raises:
        ConfigError: a value out of range (names ``transfer.<field>`` and the fix).
    """

    max_chunk_bytes: int = 1 << 20
    max_update_bytes: int = 256 << 20
    max_message_bytes: int = (1 << 20) + 65536
    ttl_s: float = 48 * 3600.0
    memory_limit_bytes: int = StagingLimits.memory_limit_bytes
    spill_above_bytes: int = StagingLimits.spill_above_bytes

    @property
    def staging(self) -> StagingLimits:
        """The staging part of these limits."""
        return StagingLimits(memory_limit_bytes=self.memory_limit_bytes, spill_above_bytes=self.spill_above_bytes)

    def __post_init__(self) -> None:
        self.staging  # noqa: B018 - validates memory_limit_bytes and spill_above_bytes (ConfigError)
        for name in ("max_chunk_bytes", "max_update_bytes", "max_message_bytes"):
            if int(getattr(self, name)) < 1024:
                raise ConfigError(f"{name} is {getattr(self, name)}", field=f"transfer.{name}",
                                  fix="give at least 1024 bytes")
        if self.max_message_bytes < self.max_chunk_bytes + CHUNK_HEADER_LENGTH:
            raise ConfigError("max_message_bytes is smaller than a full chunk", field="transfer.max_message_bytes",
                              fix="make it at least max_chunk_bytes + 40")
        if not self.ttl_s > 0:
            raise ConfigError(f"ttl_s is {self.ttl_s}", field="transfer.ttl_s", fix="give a positive number of seconds")


class TransferReceiver:
    """The coordinator's entry point for site uploads (see the module docstring).

    Args:
        federation_id: ours. store, registry: coordinator state. ingestor: where reassembled updates go.
        transport: where receipts are published. signing_key: signs receipts.
        limits: :class:`TransferLimits`.
        on_download_receipt: ``callback(site_id, round, receipt)`` for a site asking for the missing chunks of a
            task (the round manager re-publishes them); None: ignored.
        clock: wall clock, seconds since the epoch (tests inject one).
        shared_staging: several ingest workers share the data folder and database (coordinator.inbound.workers): every
            transfer is staged on disk and recorded, so any worker can finish it (module docstring).

    Thread-safe (one lock); call it as a transport callback: ``receiver(topic, payload)``.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry, ingestor: Ingestor,
                 transport: Transport, signing_key: Ed25519PrivateKey, limits: TransferLimits | None = None,
                 on_download_receipt: Callable[[str, int, Receipt], None] | None = None,
                 clock: Callable[[], float] = time.time, shared_staging: bool = False) -> None:
        self.federation_id = federation_id
        self._store = store
        self._registry = registry
        self._ingestor = ingestor
        self._transport = transport
        self._key = signing_key
        self.limits = limits or TransferLimits()
        self._on_download_receipt = on_download_receipt
        self._clock = clock
        self._lock = threading.RLock()
        self.staging_dir = store.data_dir / "transfers"
        self._receipt_floor: dict[str, int] = {}  # per site, the sequence of its last receipt (replays refused)
        # Verified manifests of transfers in progress (the table is the truth; this saves a query and a decode per
        # chunk). An entry of a transfer another worker finished is harmless: its chunks land in a folder that
        # the sweep removes.
        self._manifests: dict[str, tuple[str, Manifest]] = {}
        # Per transfer, the fingerprint of the site key that verified its inner envelope's signature (a transfer
        # recorded by another worker or before a restart has none here: its signature is checked at assembly), and
        # the chunks this process checked and wrote (not hashed again at assembly).
        self._verified_by: dict[str, str] = {}
        self._fresh: dict[str, set[int]] = {}
        self.staging = ChunkStaging(self.staging_dir, self.limits.staging, shared=shared_staging)
        # Transfers staged in memory (no row): transfer id -> (round, created, expires); times in seconds since the
        # epoch.
        self._memory: dict[str, tuple[int, float, float]] = {}
        # Single process: the ids of the transfers that have a row (site id as value), read once from the table and
        # kept up to date here, so a new transfer costs no query. None: not read yet (or shared staging: always ask).
        self._rows: dict[str, str] | None = None
        self._last_sweep = float("-inf")

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    # ---- entry point -------------------------------------------------------------------------------------------
    def handle(self, topic: str, raw: bytes) -> object:
        """Route one message from a site's update topic. Never raises for bad input.

        Returns:
            what ingest returned for a whole or reassembled update (:class:`~coordinator.inbound.context.Accepted` or
            :class:`~coordinator.inbound.reject.Rejected`), a :class:`~coordinator.inbound.reject.Rejected` for a
            refused manifest/chunk/receipt, or None for a message that was kept and needs nothing else yet.
        """
        with self._lock:
            try:
                if len(raw) > self.limits.max_message_bytes:
                    raise Reject(RejectReason.OVERSIZED, f"message of {len(raw)} bytes exceeds the limit of "
                                 f"{self.limits.max_message_bytes} (larger uploads must be chunked)")
                if is_chunk(raw):
                    return self._chunk(topic, raw)
                try:
                    env = Envelope.from_bytes(raw)  # the only parse: the envelope is handed on
                except MalformedEnvelopeError as exc:
                    raise Reject(RejectReason.MALFORMED_ENVELOPE, str(exc), exc) from exc
                if env.header.kind == MessageKind.MANIFEST:
                    return self._manifest(topic, env)
                if env.header.kind == MessageKind.RECEIPT:
                    return self._receipt(topic, env)
                return self._ingestor.handle_envelope(topic, env)
            except Reject as rej:
                return self._ingestor.record_rejection(topic, rej)

    # ---- manifests ---------------------------------------------------------------------------------------------
    def _open_site_envelope(self, topic: str, env: Envelope, kind: MessageKind) -> tuple[Envelope, str]:
        """Check a parsed site envelope of ``kind`` sent on its update topic: topic/federation/site, header ranges and
        signature."""
        check_site_topic(topic, env, federation_id=self.federation_id, kind=kind, channel=MessageKind.UPDATE.value)
        check_header_ranges(env)
        verify_site_envelope(env, self._registry)
        return env, env.header.site_id

    def _manifest(self, topic: str, env: Envelope) -> object:
        env, site_id = self._open_site_envelope(topic, env, MessageKind.MANIFEST)
        h = env.header
        try:  # the sender is authenticated from here on: a refusal is NACKed, so the gateway stops resending
            self._ingestor.check_replay(env)
            try:
                manifest = decode_manifest(env.payload)
            except TransferError as exc:
                raise Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
            if manifest.kind != MessageKind.UPDATE:
                raise Reject(RejectReason.BAD_TRANSFER, f"a site may only upload updates, not {manifest.kind.value}")
            if manifest.total_length > self.limits.max_update_bytes:
                raise Reject(RejectReason.OVERSIZED, f"transfer of {manifest.total_length} bytes exceeds the limit "
                             f"of {self.limits.max_update_bytes}")
            if manifest.chunk_size > self.limits.max_chunk_bytes:
                raise Reject(RejectReason.OVERSIZED, f"chunk size {manifest.chunk_size} exceeds the limit of "
                             f"{self.limits.max_chunk_bytes} bytes")
            try:  # the inner envelope is the one the manifest's header announced, signed by the same site
                check_manifest_header(manifest, h)
            except TransferError as exc:
                raise Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
            verified_by = verify_site_signature(manifest.header, manifest.signature, self._registry)
        except Reject as rej:
            return self._ingestor.refuse_verified(topic, rej, env)
        verdict = self._ingestor.precheck(env)  # round, selection, model version, duplicate (ACKs/NACKs itself)
        if verdict is not None:
            return verdict
        if self._clock() - self._last_sweep > SWEEP_INTERVAL_S:
            self.sweep()
        tid = manifest.transfer_id
        known = self._manifests.get(tid)
        if known is not None and known[0] != site_id:
            raise Reject(RejectReason.TOPIC_MISMATCH, "transfer id already belongs to another site")
        if known is None or not self.staging.tracks(tid):
            owner = self._row_owner(tid)
            if owner is not None and owner != site_id:
                raise Reject(RejectReason.TOPIC_MISMATCH, "transfer id already belongs to another site")
            on_disk = self.staging.begin(tid, total_length=manifest.total_length, num_chunks=manifest.num_chunks,
                                         chunk_size=manifest.chunk_size, known_on_disk=owner is not None)
            self._manifests[tid] = (site_id, manifest)
            if on_disk and owner is None:
                self._record(tid, site_id, h.round, h.sequence, bytes(env.payload), manifest.num_chunks)
            elif not on_disk:
                created = self._clock()
                self._memory[tid] = (h.round, created, created + self.limits.ttl_s)
            if owner is None:
                log.info("transfers: %s announced round %d update %s (%d bytes in %d chunks, staged %s)", site_id,
                         h.round, tid[:12], manifest.total_length, manifest.num_chunks,
                         "on disk" if on_disk else "in memory")
        self._verified_by[tid] = verified_by
        if not manifest.resume:
            return None  # the chunks follow the manifest
        # A resume probe: the site reconnected (or timed out) and asks where to resume.
        held = self.staging.held(tid)
        if len(held) == manifest.num_chunks:
            return self._complete(topic, manifest)
        missing = tuple(i for i in range(manifest.num_chunks) if i not in held)
        self._send_receipt(site_id, h, Receipt(manifest.transfer_id, missing))
        self._ingestor.counts["resumed"] += 1
        log.info("transfers: %s resumes %s: %d of %d chunks missing", site_id, manifest.transfer_id[:12],
                 len(missing), manifest.num_chunks)
        return None

    def _row_owner(self, transfer_id: str) -> str | None:
        """The site whose manifest row ``transfer_id`` has, or None when it has none (no query in a single process
        once the ids were read)."""
        if self.staging.shared:
            with self._store.session() as s:
                row = s.get(TransferRow, transfer_id)
                return None if row is None else row.site_id
        return self._row_ids().get(transfer_id)

    def _row_ids(self) -> dict[str, str]:
        if self._rows is None:
            with self._store.session() as s:
                self._rows = dict(s.execute(select(TransferRow.transfer_id, TransferRow.site_id)).all())
        return self._rows

    def _record(self, transfer_id: str, site_id: str, round: int, sequence: int, manifest_payload: bytes,
                num_chunks: int) -> None:
        """Record the manifest of a transfer staged on disk, so that it resumes after a restart."""
        now = self._now()
        try:
            with self._store.session() as s:
                s.add(TransferRow(transfer_id=transfer_id, site_id=site_id, round=round, sequence=sequence,
                                  manifest_payload=manifest_payload, num_chunks=num_chunks, created_at=now,
                                  expires_at=now + _dt.timedelta(seconds=self.limits.ttl_s)))
        except IntegrityError:  # another worker recorded the same manifest first
            pass
        if self._rows is not None:
            self._rows[transfer_id] = site_id
        self._memory.pop(transfer_id, None)

    def _send_receipt(self, site_id: str, h: EnvelopeHeader, receipt: Receipt) -> None:
        try:
            send_to_site(self._transport, self._key, self.federation_id, h, MessageKind.RECEIPT,
                         encode_receipt(receipt))
        except (TransportError, EnvelopeError) as exc:
            log.error("transfers: could not send a receipt to %s: %s", site_id, exc)

    # ---- chunks ------------------------------------------------------------------------------------------------
    def _chunk(self, topic: str, raw: bytes) -> object:
        try:
            chunk = Chunk.from_bytes(raw, max_data_bytes=self.limits.max_chunk_bytes)
        except TransferError as exc:
            reason = RejectReason.OVERSIZED if exc.reason == "oversized" else RejectReason.BAD_TRANSFER
            raise Reject(reason, str(exc), exc) from exc
        _, t_site, channel = parse_site_topic(topic)
        known = self._manifests.get(chunk.transfer_id)
        if known is None and (self.staging.shared or chunk.transfer_id in self._row_ids()):
            with self._store.session() as s:  # a transfer staged on disk by an earlier process or another worker
                row = s.get(TransferRow, chunk.transfer_id)
                if row is not None:
                    known = (row.site_id, decode_manifest(row.manifest_payload))
            if known is not None:
                self._manifests[chunk.transfer_id] = known
                self.staging.begin(chunk.transfer_id, total_length=known[1].total_length,
                                   num_chunks=known[1].num_chunks, chunk_size=known[1].chunk_size,
                                   known_on_disk=True)
        if known is None or channel != "update":
            raise Reject(RejectReason.UNKNOWN_TRANSFER, f"chunk {chunk.index} of transfer {chunk.transfer_id[:12]}, "
                         "which has no (unexpired) manifest; the site resends after its manifest is answered")
        owner, manifest = known
        if owner != t_site:
            raise Reject(RejectReason.TOPIC_MISMATCH, f"chunk of {owner!r}'s transfer on {t_site!r}'s topic")
        try:
            check_chunk(manifest, chunk)
        except TransferError as exc:
            raise Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
        tid = manifest.transfer_id
        if not self.staging.tracks(tid):  # a manifest this process saw, of a transfer another worker finished
            self.staging.begin(tid, total_length=manifest.total_length, num_chunks=manifest.num_chunks,
                               chunk_size=manifest.chunk_size, known_on_disk=True)
        self.staging.put(tid, chunk.index, chunk.data)
        self._fresh.setdefault(tid, set()).add(chunk.index)  # checked here: not hashed again
        if self.staging.count(tid) < manifest.num_chunks:
            return None
        return self._complete(topic, manifest)

    def _complete(self, topic: str, manifest: Manifest) -> object:
        tid = manifest.transfer_id
        pieces = self.staging.pieces(tid)
        if pieces is None:  # another worker assembled it and cleaned up
            return None
        fresh = self._fresh.get(manifest.transfer_id, set())
        damaged = 0
        for i, piece in enumerate(pieces):  # pieces staged before a restart or by another worker: a torn file?
            if i not in fresh:
                try:
                    check_chunk(manifest, Chunk(manifest.transfer_id, i, piece))
                except TransferError:
                    self.staging.discard(tid, i)
                    damaged += 1
        if damaged:  # the site resends them
            raise Reject(RejectReason.BAD_TRANSFER, f"reassembly failed: {damaged} damaged chunk(s) dropped")
        env = assemble(manifest, pieces)  # verified piece by piece: nothing is hashed again
        verified_by = self._verified_by.get(manifest.transfer_id)
        if verified_by is None:  # recorded before a restart or by another worker: its signature, not its payload
            try:
                verified_by = verify_site_signature(manifest.header, manifest.signature, self._registry)
            except Reject:
                self._drop(manifest.transfer_id)
                raise
        result = self._ingestor.handle_envelope(topic, env, verified_by=verified_by)
        # An update that went to the commit group has its manifest row deleted in the group's transaction.
        self._drop(manifest.transfer_id, row=not isinstance(result, (Accepted, Pending)))
        return result

    def _drop(self, transfer_id: str, *, row: bool = True) -> None:
        """Forget a transfer: its staging, and (``row``) its manifest row if it has one."""
        self._manifests.pop(transfer_id, None)
        self._memory.pop(transfer_id, None)
        self._verified_by.pop(transfer_id, None)
        self._fresh.pop(transfer_id, None)
        has_row = self.staging.shared or self._rows is None or transfer_id in self._rows
        if self._rows is not None:
            self._rows.pop(transfer_id, None)
        self.staging.drop(transfer_id)
        if row and has_row:
            with self._store.session() as s:
                s.execute(delete(TransferRow).where(TransferRow.transfer_id == transfer_id))

    # ---- download receipts -------------------------------------------------------------------------------------
    def _receipt(self, topic: str, env: Envelope) -> object:
        env, site_id = self._open_site_envelope(topic, env, MessageKind.RECEIPT)
        self._ingestor.check_replay(env)
        floor = self._receipt_floor.get(site_id)
        if floor is not None and env.header.sequence <= floor:
            raise Reject(RejectReason.REPLAYED, f"receipt sequence {env.header.sequence} is not above {floor}, the "
                         "site's last one: a replay")
        try:
            receipt = decode_receipt(env.payload)
        except TransferError as exc:
            raise Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
        self._receipt_floor[site_id] = env.header.sequence  # only a well-formed receipt moves the floor
        if self._on_download_receipt is not None:
            self._on_download_receipt(site_id, env.header.round, receipt)
        return None

    # ---- expiry ------------------------------------------------------------------------------------------------
    def _now(self) -> _dt.datetime:
        """The clock as a naive UTC datetime (the tables' convention, ``coordinator.storage.utcnow``)."""
        return _dt.datetime.fromtimestamp(self._clock(), tz=_dt.timezone.utc).replace(tzinfo=None)

    def sweep(self) -> list[str]:
        """Delete transfers past their expiry (recorded ones and those staged in memory), and staging left for an
        update that is already stored (a process killed between storing a reassembled update and deleting its
        chunks); returns the expired ids."""
        now = self._now()
        self._last_sweep = self._clock()
        in_memory = {(r, self._manifests[tid][0]): tid for tid, (r, _, _) in self._memory.items()
                     if tid in self._manifests}
        with self._store.session() as s:
            rows = dict(s.execute(select(TransferRow.transfer_id, TransferRow.site_id)).all())
            expired = list(s.scalars(select(TransferRow.transfer_id).where(TransferRow.expires_at < now)))
            done = list(s.scalars(select(TransferRow.transfer_id).join(
                UpdateRow, (UpdateRow.round == TransferRow.round) & (UpdateRow.site_id == TransferRow.site_id))))
            if in_memory:
                stored = s.execute(select(UpdateRow.round, UpdateRow.site_id).where(
                    tuple_(UpdateRow.round, UpdateRow.site_id).in_(sorted(in_memory))))
                done += [in_memory[tuple(pair)] for pair in stored]
        live = set(rows)
        if not self.staging.shared:
            self._rows = rows  # the table is the truth; from here on kept up to date in memory
        expired += [tid for tid, (_, _, expires) in self._memory.items() if expires < self._last_sweep]
        for tid in expired:
            self._drop(tid)
            self._ingestor.counts["expired"] += 1
            log.warning("transfers: transfer %s expired incomplete", tid[:12])
        for tid in set(done) - set(expired):
            self._drop(tid)
            log.info("transfers: staging of %s dropped: its update is stored", tid[:12])
        try:  # chunk folders without a manifest row (another worker finished or expired that transfer)
            orphans = [n for n in os.listdir(self.staging_dir) if len(n) == 64 and n not in live]
        except FileNotFoundError:
            orphans = []
        for tid in orphans:
            if self.staging.on_disk(tid) and not self.staging.shared:
                continue  # recorded by this process after the query above
            self._manifests.pop(tid, None)
            self._verified_by.pop(tid, None)
            self._fresh.pop(tid, None)
            self.staging.drop(tid)
        return expired

    def pending(self) -> list[tuple[str, str, int, int]]:
        """Incomplete transfers, oldest first: ``(transfer id, site id, chunks held, chunks announced)``; those
        recorded in the database (staged on disk, by this or an earlier process) and those staged in memory."""
        with self._store.session() as s:
            rows = list(s.scalars(select(TransferRow).order_by(TransferRow.created_at)))
        out = [(_epoch(r.created_at), r.transfer_id, r.site_id, self._held_count(r.transfer_id), r.num_chunks)
               for r in rows]
        recorded = {r.transfer_id for r in rows}
        for tid, (_, created, _) in self._memory.items():
            known = self._manifests.get(tid)
            if tid not in recorded and known is not None:
                out.append((created, tid, known[0], self.staging.count(tid), known[1].num_chunks))
        return [entry[1:] for entry in sorted(out, key=lambda e: e[0])]

    def _held_count(self, transfer_id: str) -> int:
        """Chunks held of a recorded transfer (read from its folder if this process has not met it yet)."""
        if self.staging.tracks(transfer_id):
            return self.staging.count(transfer_id)
        return len(self.staging.on_disk_chunks(transfer_id))


def _epoch(naive_utc: _dt.datetime) -> float:
    """Seconds since the epoch of a naive UTC datetime (the tables' convention)."""
    return naive_utc.replace(tzinfo=_dt.timezone.utc).timestamp()
