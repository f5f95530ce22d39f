"""Chunked uploads on the coordinator: staging, resume, expiry, and hand-over to ingest (:mod:`shared.transfer`).

Everything a site publishes on its update topic comes through :class:`TransferReceiver` first:

* a message longer than the limit is refused before any parsing (``oversized``);
* every other message is parsed once, here, and the parsed envelope is handed on (never parsed again);
* a plain UPDATE envelope (small enough to travel whole) goes straight to ingest
  (:meth:`coordinator.ingest.Ingestor.handle_envelope`);
* a MANIFEST envelope is checked like an update (topic, federation, site, signature with one of the site's valid
  keys, replay window) and against the open round before any chunk is kept (:meth:`Ingestor.precheck`); so is the
  inner envelope it announces: its header must name what the manifest's does (site, round, sequence, base model
  hash), its signature must verify with one of the site's valid keys, and the piece digests (leaves) must derive its
  signed payload digest (:mod:`shared.transfer`). A new transfer is recorded (``transfers`` table). A manifest
  marked ``resume`` (the site reconnected or timed out) is answered with a signed RECEIPT listing the chunks still
  missing, and the site sends only those. A manifest for an update that is already stored gets its positive ACK
  again;
* a chunk is checked against its transfer's manifest (index, length, one BLAKE3 over its data against its leaf: the
  only pass over the payload's bytes) and written to ``<data_dir>/transfers/<transfer id>/<index>.part``; when the
  last one is in, the inner envelope is the manifest's header and signature with the pieces joined, verified already,
  and goes to ingest with the fingerprint of the key that verified it (:meth:`Ingestor.handle_envelope`), which
  checks that key is still valid, hashes nothing, stores the update durably, ACKs it and aggregates it; the staging
  is then deleted;
* a RECEIPT from a site asks for the missing chunks of a *download* (a task); it goes to the round manager.

Why files for chunk data and a table for manifests: the manifest rows are the state several ingest workers share
(PostgreSQL), and a chunk file that exists under its final name is complete (temporary file + rename). Chunk files
are not fsync-ed: a piece this process did not check and write itself (staged before a restart, or by another
worker) is checked against its leaf again at assembly, so a chunk torn by a power cut is simply asked for again; a
piece it wrote is not hashed twice. The blob directory (``data_dir``) is shared by every worker already (accepted
payloads live there).

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
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from shared.envelope import Envelope, MessageKind, seal
from shared.errors import ConfigError, EnvelopeError, MalformedEnvelopeError
from shared.topics import ack_topic, parse_topic
from shared.transfer import (CHUNK_HEADER_LENGTH, Chunk, Manifest, Receipt, TransferError, assemble, check_chunk,
                             check_manifest_header, decode_manifest, decode_receipt, encode_receipt, is_chunk)

from coordinator.ingest import (Ingestor, RejectReason, _Reject, check_header_ranges, verify_site_envelope,
                                verify_site_signature)
from coordinator.registry import SiteRegistry
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
    """

    max_chunk_bytes: int = 1 << 20
    max_update_bytes: int = 256 << 20
    max_message_bytes: int = (1 << 20) + 65536
    ttl_s: float = 48 * 3600.0

    def __post_init__(self) -> None:
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

    Thread-safe (one lock); call it as a transport callback: ``receiver(topic, payload)``.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry, ingestor: Ingestor,
                 transport: Transport, signing_key: Ed25519PrivateKey, limits: TransferLimits | None = None,
                 on_download_receipt: Callable[[str, int, Receipt], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
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
        self._last_sweep = float("-inf")

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    # ---- entry point -------------------------------------------------------------------------------------------
    def handle(self, topic: str, raw: bytes) -> object:
        """Route one message from a site's update topic. Never raises for bad input.

        Returns:
            what ingest returned for a whole or reassembled update (:class:`~coordinator.ingest.Accepted` or
            :class:`~coordinator.ingest.Rejected`), a :class:`~coordinator.ingest.Rejected` for a refused
            manifest/chunk/receipt, or None for a message that was kept and needs nothing else yet.
        """
        with self._lock:
            try:
                if len(raw) > self.limits.max_message_bytes:
                    raise _Reject(RejectReason.OVERSIZED, f"message of {len(raw)} bytes exceeds the limit of "
                                  f"{self.limits.max_message_bytes} (larger uploads must be chunked)")
                if is_chunk(raw):
                    return self._chunk(topic, raw)
                try:
                    env = Envelope.from_bytes(raw)  # the only parse: the envelope is handed on
                except MalformedEnvelopeError as exc:
                    raise _Reject(RejectReason.MALFORMED_ENVELOPE, str(exc), exc) from exc
                if env.header.kind == MessageKind.MANIFEST:
                    return self._manifest(topic, env)
                if env.header.kind == MessageKind.RECEIPT:
                    return self._receipt(topic, env)
                return self._ingestor.handle_envelope(topic, env)
            except _Reject as rej:
                return self._ingestor.record_rejection(topic, rej)

    # ---- manifests ---------------------------------------------------------------------------------------------
    def _open_site_envelope(self, topic: str, env: Envelope, kind: MessageKind) -> tuple[Envelope, str]:
        """Check a parsed site envelope of ``kind`` sent on its update topic: topic/federation/site and signature."""
        try:
            t_fed, t_site, channel = parse_topic(topic)
        except (MalformedEnvelopeError, ConfigError) as exc:
            raise _Reject(RejectReason.BAD_TOPIC, str(exc), exc) from exc
        h = env.header
        if channel != "update" or h.kind != kind:
            raise _Reject(RejectReason.WRONG_KIND, f"{h.kind.value} on channel {channel!r}")
        if h.federation_id != self.federation_id or t_fed != self.federation_id:
            raise _Reject(RejectReason.WRONG_FEDERATION, f"federation {h.federation_id!r} (topic {t_fed!r})")
        if t_site != h.site_id:
            raise _Reject(RejectReason.TOPIC_MISMATCH, f"topic names site {t_site!r}, header names {h.site_id!r}")
        check_header_ranges(env)
        verify_site_envelope(env, self._registry)
        return env, h.site_id

    def _manifest(self, topic: str, env: Envelope) -> object:
        env, site_id = self._open_site_envelope(topic, env, MessageKind.MANIFEST)
        h = env.header
        try:  # the sender is authenticated from here on: a refusal is NACKed, so the gateway stops resending
            self._ingestor.check_replay(env)
            try:
                manifest = decode_manifest(env.payload)
            except TransferError as exc:
                raise _Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
            if manifest.kind != MessageKind.UPDATE:
                raise _Reject(RejectReason.BAD_TRANSFER, f"a site may only upload updates, not {manifest.kind.value}")
            if manifest.total_length > self.limits.max_update_bytes:
                raise _Reject(RejectReason.OVERSIZED, f"transfer of {manifest.total_length} bytes exceeds the limit "
                              f"of {self.limits.max_update_bytes}")
            if manifest.chunk_size > self.limits.max_chunk_bytes:
                raise _Reject(RejectReason.OVERSIZED, f"chunk size {manifest.chunk_size} exceeds the limit of "
                              f"{self.limits.max_chunk_bytes} bytes")
            try:  # the inner envelope is the one the manifest's header announced, signed by the same site
                check_manifest_header(manifest, h)
            except TransferError as exc:
                raise _Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
            verified_by = verify_site_signature(manifest.header, manifest.signature, self._registry)
        except _Reject as rej:
            return self._ingestor.refuse_verified(topic, rej, env)
        verdict = self._ingestor.precheck(env)  # round, selection, model version, duplicate (ACKs/NACKs itself)
        if verdict is not None:
            return verdict
        if self._clock() - self._last_sweep > SWEEP_INTERVAL_S:
            self.sweep()
        now = self._now()
        try:
            with self._store.session() as s:
                row = s.get(TransferRow, manifest.transfer_id)
                if row is not None and row.site_id != site_id:
                    raise _Reject(RejectReason.TOPIC_MISMATCH, "transfer id already belongs to another site")
                if row is None:
                    s.add(TransferRow(transfer_id=manifest.transfer_id, site_id=site_id, round=h.round,
                                      sequence=h.sequence, manifest_payload=bytes(env.payload),
                                      num_chunks=manifest.num_chunks, created_at=now,
                                      expires_at=now + _dt.timedelta(seconds=self.limits.ttl_s)))
        except IntegrityError:  # another worker recorded the same manifest first
            row = True
        self._verified_by[manifest.transfer_id] = verified_by
        if row is None:
            self._manifests[manifest.transfer_id] = (site_id, manifest)
            log.info("transfers: %s announced round %d update %s (%d bytes in %d chunks)", site_id, h.round,
                     manifest.transfer_id[:12], manifest.total_length, manifest.num_chunks)
        if not manifest.resume:
            return None  # the chunks follow the manifest
        # A resume probe: the site reconnected (or timed out) and asks where to resume.
        held = self._held(manifest.transfer_id)
        if len(held) == manifest.num_chunks:
            return self._complete(topic, manifest)
        missing = tuple(i for i in range(manifest.num_chunks) if i not in held)
        self._send_receipt(site_id, h, Receipt(manifest.transfer_id, missing))
        self._ingestor.counts["resumed"] += 1
        log.info("transfers: %s resumes %s: %d of %d chunks missing", site_id, manifest.transfer_id[:12],
                 len(missing), manifest.num_chunks)
        return None

    def _send_receipt(self, site_id: str, h, receipt: Receipt) -> None:  # noqa: ANN001 - an EnvelopeHeader
        try:
            out = seal(private_key=self._key, federation_id=self.federation_id, site_id=site_id, round=h.round,
                       base_model_hash=h.base_model_hash, kind=MessageKind.RECEIPT, sequence=h.sequence,
                       payload=encode_receipt(receipt))
            self._transport.publish(ack_topic(self.federation_id, site_id), out.to_bytes(), qos=1)
        except (TransportError, EnvelopeError) as exc:
            log.error("transfers: could not send a receipt to %s: %s", site_id, exc)

    # ---- chunks ------------------------------------------------------------------------------------------------
    def _chunk(self, topic: str, raw: bytes) -> object:
        try:
            chunk = Chunk.from_bytes(raw, max_data_bytes=self.limits.max_chunk_bytes)
        except TransferError as exc:
            reason = RejectReason.OVERSIZED if exc.reason == "oversized" else RejectReason.BAD_TRANSFER
            raise _Reject(reason, str(exc), exc) from exc
        try:
            _, t_site, channel = parse_topic(topic)
        except (MalformedEnvelopeError, ConfigError) as exc:
            raise _Reject(RejectReason.BAD_TOPIC, str(exc), exc) from exc
        known = self._manifests.get(chunk.transfer_id)
        if known is None:
            with self._store.session() as s:
                row = s.get(TransferRow, chunk.transfer_id)
                if row is not None:
                    known = (row.site_id, decode_manifest(row.manifest_payload))
            if known is not None:
                self._manifests[chunk.transfer_id] = known
        if known is None or channel != "update":
            raise _Reject(RejectReason.UNKNOWN_TRANSFER, f"chunk {chunk.index} of transfer {chunk.transfer_id[:12]}, "
                          "which has no (unexpired) manifest; the site resends after its manifest is answered")
        owner, manifest = known
        if owner != t_site:
            raise _Reject(RejectReason.TOPIC_MISMATCH, f"chunk of {owner!r}'s transfer on {t_site!r}'s topic")
        try:
            check_chunk(manifest, chunk)
        except TransferError as exc:
            raise _Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
        folder = self.staging_dir / manifest.transfer_id
        path = folder / f"{chunk.index}.part"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(chunk.data)
            os.replace(tmp, path)
            self._fresh.setdefault(manifest.transfer_id, set()).add(chunk.index)
        if len(self._held(manifest.transfer_id)) < manifest.num_chunks:
            return None
        return self._complete(topic, manifest)

    def _held(self, transfer_id: str) -> set[int]:
        folder = self.staging_dir / transfer_id
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return set()
        return {int(n[:-5]) for n in names if n.endswith(".part") and n[:-5].isdigit()}

    def _complete(self, topic: str, manifest: Manifest) -> object:
        folder = self.staging_dir / manifest.transfer_id
        try:
            pieces = [(folder / f"{i}.part").read_bytes() for i in range(manifest.num_chunks)]
        except FileNotFoundError:  # another worker assembled it and cleaned up
            return None
        fresh = self._fresh.get(manifest.transfer_id, set())
        damaged = 0
        for i, piece in enumerate(pieces):  # pieces staged before a restart or by another worker: a torn file?
            if i not in fresh:
                try:
                    check_chunk(manifest, Chunk(manifest.transfer_id, i, piece))
                except TransferError:
                    (folder / f"{i}.part").unlink(missing_ok=True)
                    damaged += 1
        if damaged:  # the site resends them
            raise _Reject(RejectReason.BAD_TRANSFER, f"reassembly failed: {damaged} damaged chunk(s) dropped")
        env = assemble(manifest, pieces)  # verified piece by piece: nothing is hashed again
        verified_by = self._verified_by.get(manifest.transfer_id)
        if verified_by is None:  # recorded before a restart or by another worker: its signature, not its payload
            try:
                verified_by = verify_site_signature(manifest.header, manifest.signature, self._registry)
            except _Reject:
                self._drop(manifest.transfer_id)
                raise
        result = self._ingestor.handle_envelope(topic, env, verified_by=verified_by)
        self._drop(manifest.transfer_id)
        return result

    def _drop(self, transfer_id: str) -> None:
        self._manifests.pop(transfer_id, None)
        self._verified_by.pop(transfer_id, None)
        self._fresh.pop(transfer_id, None)
        with self._store.session() as s:
            s.execute(delete(TransferRow).where(TransferRow.transfer_id == transfer_id))
        shutil.rmtree(self.staging_dir / transfer_id, ignore_errors=True)

    # ---- download receipts -------------------------------------------------------------------------------------
    def _receipt(self, topic: str, env: Envelope) -> object:
        env, site_id = self._open_site_envelope(topic, env, MessageKind.RECEIPT)
        self._ingestor.check_replay(env)
        floor = self._receipt_floor.get(site_id)
        if floor is not None and env.header.sequence <= floor:
            raise _Reject(RejectReason.REPLAYED, f"receipt sequence {env.header.sequence} is not above {floor}, the "
                          "site's last one: a replay")
        try:
            receipt = decode_receipt(env.payload)
        except TransferError as exc:
            raise _Reject(RejectReason.BAD_TRANSFER, str(exc), exc) from exc
        self._receipt_floor[site_id] = env.header.sequence  # only a well-formed receipt moves the floor
        if self._on_download_receipt is not None:
            self._on_download_receipt(site_id, env.header.round, receipt)
        return None

    # ---- expiry ------------------------------------------------------------------------------------------------
    def _now(self) -> _dt.datetime:
        """The clock as a naive UTC datetime (the tables' convention, ``coordinator.storage.utcnow``)."""
        return _dt.datetime.fromtimestamp(self._clock(), tz=_dt.timezone.utc).replace(tzinfo=None)

    def sweep(self) -> list[str]:
        """Delete transfers past their expiry, and staging left for an update that is already stored (a process
        killed between storing a reassembled update and deleting its chunks); returns the expired ids."""
        now = self._now()
        self._last_sweep = self._clock()
        with self._store.session() as s:
            live = set(s.scalars(select(TransferRow.transfer_id)))
            expired = list(s.scalars(select(TransferRow.transfer_id).where(TransferRow.expires_at < now)))
            done = list(s.scalars(select(TransferRow.transfer_id).join(
                UpdateRow, (UpdateRow.round == TransferRow.round) & (UpdateRow.site_id == TransferRow.site_id))))
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
            self._manifests.pop(tid, None)
            self._verified_by.pop(tid, None)
            self._fresh.pop(tid, None)
            shutil.rmtree(self.staging_dir / tid, ignore_errors=True)
        return expired

    def pending(self) -> list[tuple[str, str, int, int]]:
        """Incomplete transfers: ``(transfer id, site id, chunks held, chunks announced)``."""
        with self._store.session() as s:
            rows = list(s.scalars(select(TransferRow).order_by(TransferRow.created_at)))
        return [(r.transfer_id, r.site_id, len(self._held(r.transfer_id)), r.num_chunks) for r in rows]

