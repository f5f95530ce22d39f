"""The receiving side of a chunked transfer: check a manifest against its envelope and signer, check each chunk
against its signed leaf, and join the pieces into the inner envelope (:class:`Reassembly` in memory; the coordinator
stages uploads durably, ``coordinator.inbound.transfers``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared import envelope as _envelope
from shared.envelope import Envelope, EnvelopeHeader, verify_signature
from shared.transfer.wire import Chunk, Manifest, TransferError


def check_manifest_header(manifest: Manifest, outer: EnvelopeHeader) -> None:
    """Check that the manifest envelope's header ``outer`` names the inner envelope's federation, site, round, base
    model hash and sequence (what the receiver checked against the open round is what the inner envelope says).

    Raises:
        TransferError: a field differs (``bad_manifest``; the message names it).
    """
    for name in ("federation_id", "site_id", "round", "base_model_hash", "sequence"):
        if getattr(outer, name) != getattr(manifest.header, name):
            raise TransferError(f"manifest envelope's {name} {getattr(outer, name)!r} differs from the inner "
                                f"envelope's {getattr(manifest.header, name)!r}", "bad_manifest")


def verify_manifest(manifest: Manifest, public_key: Ed25519PublicKey) -> None:
    """Verify the inner envelope's Ed25519 signature over its header with ``public_key``; with the leaves already
    checked against the header's payload digest (:class:`Manifest`), every chunk that matches its leaf is then a
    verified piece of the signed payload.

    Raises:
        SignatureError: the inner signature does not verify under ``public_key``.
    """
    verify_signature(manifest.header, manifest.signature, public_key)


def check_chunk(manifest: Manifest, chunk: Chunk) -> None:
    """Check a chunk against its (verified) manifest: same transfer, index in range, exact length, and one BLAKE3
    over its data (``shared.envelope.hash_piece``) equal to its leaf.

    Raises:
        TransferError: reason ``bad_chunk`` (transfer, index or length) or ``chunk_digest`` (data altered).
    """
    if chunk.transfer_id != manifest.transfer_id:
        raise TransferError(f"chunk of transfer {chunk.transfer_id[:12]} checked against {manifest.transfer_id[:12]}")
    if not 0 <= chunk.index < manifest.num_chunks:
        raise TransferError(f"chunk index {chunk.index} outside 0..{manifest.num_chunks - 1}")
    if len(chunk.data) != manifest.chunk_length(chunk.index):
        raise TransferError(f"chunk {chunk.index} has {len(chunk.data)} bytes, the manifest says "
                            f"{manifest.chunk_length(chunk.index)}")
    if _envelope.hash_piece(chunk.data) != manifest.leaves[chunk.index]:
        raise TransferError(f"chunk {chunk.index} does not match its digest in the signed manifest", "chunk_digest")


def assemble(manifest: Manifest, pieces: Sequence[bytes]) -> Envelope:
    """The inner envelope: the manifest's header and signature with the pieces' data joined (in index order) as its
    payload. Nothing is hashed: each piece must have passed :func:`check_chunk` against this manifest (whose leaves
    derive the signed payload digest), so the envelope is verified once the manifest's signature is.

    Raises:
        TransferError: wrong number of pieces (``incomplete``) or of bytes (``bad_chunk``).
    """
    if len(pieces) != manifest.num_chunks:
        raise TransferError(f"{len(pieces)} of {manifest.num_chunks} chunks to assemble", "incomplete")
    payload = b"".join(pieces)
    if len(payload) != manifest.total_length:
        raise TransferError(f"the pieces hold {len(payload)} bytes, the manifest says {manifest.total_length}")
    return Envelope(header=manifest.header, signature=manifest.signature, payload=payload)


@dataclass
class Reassembly:
    """An in-memory reassembly (the gateway's side of a download; the coordinator stages uploads durably).

    Args:
        manifest: the verified manifest (:func:`verify_manifest`, :func:`check_manifest_header`). envelope: the
            MANIFEST envelope it came in (header: round, site, ...).
        ttl_s: seconds after ``started`` at which the transfer expires. clock: wall clock in seconds.
    """

    manifest: Manifest
    envelope: Envelope
    ttl_s: float
    started: float = field(default_factory=time.time)
    pieces: dict[int, bytes] = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the manifest or the latest new chunk arrived (a stalled download is asked for)."""

    def add(self, chunk: Chunk) -> bool:
        """Check and keep a chunk (a duplicate is ignored); returns whether the transfer is now complete.

        Raises:
            TransferError: the chunk does not belong to the manifest (see :func:`check_chunk`).
        """
        check_chunk(self.manifest, chunk)
        if chunk.index not in self.pieces:
            self.pieces[chunk.index] = chunk.data
            self.last_progress = time.monotonic()
        return self.complete

    @property
    def complete(self) -> bool:
        """Whether every chunk is held."""
        return len(self.pieces) == self.manifest.num_chunks

    def missing(self) -> tuple[int, ...]:
        """Indices not yet held, ascending."""
        return tuple(i for i in range(self.manifest.num_chunks) if i not in self.pieces)

    def expired(self, now: float | None = None) -> bool:
        """Whether ``ttl_s`` has passed since the transfer started."""
        return (time.time() if now is None else now) - self.started > self.ttl_s

    def assemble(self) -> Envelope:
        """The inner envelope, verified piece by piece (see :func:`assemble`; no second pass over the payload)."""
        return assemble(self.manifest, [self.pieces[i] for i in range(self.manifest.num_chunks)])
