"""Signed envelopes: the one wire format of WildFed.

An envelope carries one message between the coordinator and a site. On the wire it is::

    b"WFE1" | header_length (uint32, big-endian) | header (canonical JSON) | signature (64 bytes) | payload

The header is canonical JSON (UTF-8, keys sorted, no white space, integers only) of the fields of
:class:`EnvelopeHeader`. The Ed25519 signature (RFC 8032) covers ``DOMAIN + header bytes``; the header holds the
payload's digest and length, so the signature binds the payload too (sign-the-digest), and the
domain string keeps a WildFed signature from being valid for any other protocol (or for format 1, whose domain
string differed). The magic ``WFE1`` names the framing above, which format 2 did not change; the format version is
the header's ``format_version``.

The payload digest (format 2) is a hash list over fixed-size pieces of the payload, as BitTorrent's piece hashes
(BEP 3; BEP 52 for the power-of-two piece size), with BLAKE3 (O'Connor, Aumasson, Neves, Wilcox-O'Hearn, "BLAKE3:
one function, fast everywhere", 2020) as the hash::

    P        = piece_size                          (bytes; a power of two, 1 KiB .. 1 GiB; default 256 KiB)
    piece_i  = payload[i * P : (i + 1) * P]        (i = 0 .. ceil(payload_length / P) - 1; the last may be short)
    leaf_i   = BLAKE3(piece_i)                     (32 bytes, the plain hash mode)
    digest   = BLAKE3-derive_key(PAYLOAD_DIGEST_CONTEXT, P as uint64 big-endian || leaf_0 || leaf_1 || ...)

The digest uses BLAKE3's key-derivation mode (``derive_key``, one of the three modes of the BLAKE3 paper) with the
hard-coded context string :data:`PAYLOAD_DIGEST_CONTEXT`, so a payload digest can never equal a leaf or any plain
BLAKE3 hash, and ``P`` is hashed in, so the same bytes under two piece sizes have two digests. An empty payload has
no pieces: its digest is the derive-key hash of the 8 bytes of ``P`` alone. The piece is the unit a chunked transfer
(:mod:`shared.transfer`) carries and checks: a receiver that got the leaves in a signed manifest checks each chunk
with one BLAKE3 over its bytes, and the whole payload is then verified without a second pass. Every BLAKE3 call over
payload bytes goes through :func:`hash_piece` (tests count the bytes hashed through it).

The header (:mod:`shared.envelope_header`, exported here as before) holds the format version; the compatibility
rules of the format, and why format 1 was retired, are in its module docstring.

Nothing here unpickles anything: the header is JSON, the payload is opaque bytes (safetensors, see
:mod:`shared.codec`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from blake3 import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.envelope_header import (BROADCAST_SITE_ID, DEFAULT_PIECE_SIZE, FORMAT_VERSION, MAX_PIECE_SIZE,
                                    MIN_PIECE_SIZE, EnvelopeHeader, MessageKind, check_piece_size,
                                    validate_identifier)
from shared.errors import MalformedEnvelopeError, SignatureError

__all__ = [
    "FORMAT_VERSION",
    "DEFAULT_PIECE_SIZE",
    "MIN_PIECE_SIZE",
    "MAX_PIECE_SIZE",
    "PAYLOAD_DIGEST_CONTEXT",
    "MessageKind",
    "EnvelopeHeader",
    "Envelope",
    "hash_piece",
    "check_piece_size",
    "payload_leaves",
    "payload_digest_from_leaves",
    "payload_digest",
    "seal",
    "readdress",
    "immutable_view",
    "verify",
    "verify_signature",
    "verify_payload",
    "validate_identifier",
    "BROADCAST_SITE_ID",
]

MAGIC = b"WFE1"
DOMAIN = b"wildfed-envelope-v2\x00"
SIGNATURE_LENGTH = 64
PAYLOAD_DIGEST_CONTEXT = "WildFed 2025-06-01 12:00:00 envelope payload digest v2"
"""The BLAKE3 ``derive_key`` context of the payload digest (hard-coded, globally unique, as BLAKE3 asks)."""
LEAF_LENGTH = 32
"""Bytes of one piece digest (BLAKE3's default output length)."""
MAX_HEADER_LENGTH = 4096


@dataclass(frozen=True)
class Envelope:
    """A header, its Ed25519 signature (64 bytes) and the payload (opaque bytes, usually safetensors).

    ``payload`` is read-only bytes-like: ``bytes`` where the envelope was sealed here, a read-only ``memoryview``
    into the wire bytes where it was parsed by :meth:`from_bytes` (no copy of a multi-MiB update). Both compare
    equal to ``bytes`` of the same content, hash alike and go wherever a buffer goes (``hashlib``, ``len``, file
    writes, the decoders of :mod:`shared.protocol`); a caller that needs ``bytes`` itself (``.decode()``,
    ``json.loads``, a database driver) calls ``bytes(payload)``.
    """

    header: EnvelopeHeader
    signature: bytes
    payload: bytes | memoryview
    leaves: tuple[bytes, ...] | None = field(default=None, compare=False, repr=False)
    """The payload's piece digests (:func:`payload_leaves`) where the sender computed them (:func:`seal`,
    :func:`readdress`), so that chunking (``shared.transfer.split``) does not hash the payload again; None where the
    envelope was parsed. A cache only: a receiver never trusts it (it checks the manifest's leaves against the signed
    digest, ``shared.transfer.check_manifest_header``)."""

    def head_bytes(self) -> bytes:
        """The wire form without the payload bytes (magic, header length, header, signature): ``to_bytes()`` is
        ``head_bytes() + payload``."""
        header = self.header.canonical_bytes()
        return MAGIC + struct.pack(">I", len(header)) + header + self.signature

    @property
    def wire_length(self) -> int:
        """``len(to_bytes())``, bytes, without building the wire form."""
        return len(MAGIC) + 4 + len(self.header.canonical_bytes()) + SIGNATURE_LENGTH + len(self.payload)

    def to_bytes(self) -> bytes:
        """Encode for the wire (see the module docstring for the layout)."""
        return self.head_bytes() + self.payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Envelope":
        """Decode wire bytes. Parsing does **not** verify the signature: call :func:`verify`.

        The payload is a read-only ``memoryview`` of ``data`` (zero copy) when ``data`` is ``bytes`` or a read-only
        byte view of ``bytes``, which nothing can change; anything mutable (``bytearray``, a writable view) is
        copied first, so that the envelope never aliases a buffer its owner may still write.

        Raises:
            MalformedEnvelopeError: bad magic, truncated data, oversized or malformed header.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedEnvelopeError(f"expected bytes, got {type(data).__name__}")
        view = immutable_view(data)
        if len(view) < len(MAGIC) + 4 or view[:4] != MAGIC:
            raise MalformedEnvelopeError("not a WildFed envelope (bad magic)")
        (header_length,) = struct.unpack(">I", view[4:8])
        if header_length > MAX_HEADER_LENGTH:
            raise MalformedEnvelopeError(f"header length {header_length} exceeds {MAX_HEADER_LENGTH} bytes")
        end = 8 + header_length
        if len(view) < end + SIGNATURE_LENGTH:
            raise MalformedEnvelopeError("envelope truncated")
        header = EnvelopeHeader.from_canonical_bytes(bytes(view[8:end]))
        signature = bytes(view[end:end + SIGNATURE_LENGTH])
        payload = view[end + SIGNATURE_LENGTH:]
        return cls(header=header, signature=signature, payload=payload)


def hash_piece(piece: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3 (plain hash mode, 32-byte output) of one piece of a payload: the only function that hashes payload
    bytes, here and in :mod:`shared.transfer` (each calls it through this module, so that a test can count the
    bytes hashed by replacing it).

    Args:
        piece: any C-contiguous bytes-like object (a ``memoryview`` slice is hashed without a copy).

    Returns:
        the 32-byte digest.

    Source: BLAKE3 (O'Connor et al. 2020), through the ``blake3`` package, one thread.
    """
    return blake3(piece).digest()


def payload_leaves(payload: bytes | bytearray | memoryview, piece_size: int = DEFAULT_PIECE_SIZE) -> list[bytes]:
    """The leaves of the payload digest: BLAKE3 of each ``piece_size``-byte piece, in order, in one pass.

    Args:
        payload: the payload bytes (any C-contiguous bytes-like object; pieces are views, never copies).
        piece_size: bytes per piece (:func:`check_piece_size`); the last piece may be shorter.

    Returns:
        ``ceil(len(payload) / piece_size)`` digests of 32 bytes (none for an empty payload).

    Raises:
        MalformedEnvelopeError: bad ``piece_size``.

    Source: the piece hashes of BitTorrent (BEP 3, BEP 52), with BLAKE3 (:func:`hash_piece`).
    """
    check_piece_size(piece_size)
    view = memoryview(payload).cast("B")
    return [hash_piece(view[i:i + piece_size]) for i in range(0, len(view), piece_size)]


def payload_digest_from_leaves(leaves: Sequence[bytes], piece_size: int) -> str:
    """The payload digest from its leaves: ``BLAKE3-derive_key(PAYLOAD_DIGEST_CONTEXT, P as uint64 BE || leaves)``.

    Args:
        leaves: the 32-byte piece digests in order (:func:`payload_leaves`; empty for an empty payload).
        piece_size: the piece size ``P`` they were computed with, bytes.

    Returns:
        64 lowercase hex characters (the header's ``payload_digest``).

    Raises:
        MalformedEnvelopeError: bad ``piece_size``, or a leaf that is not 32 bytes.

    Source: a hash list (BEP 3's ``pieces``) closed by BLAKE3's ``derive_key`` mode for domain separation.
    """
    check_piece_size(piece_size)
    hasher = blake3(struct.pack(">Q", piece_size), derive_key_context=PAYLOAD_DIGEST_CONTEXT)
    for leaf in leaves:
        if not isinstance(leaf, (bytes, bytearray)) or len(leaf) != LEAF_LENGTH:
            raise MalformedEnvelopeError(f"a payload leaf must be {LEAF_LENGTH} bytes, got {leaf!r:.80}")
        hasher.update(leaf)
    return hasher.hexdigest()


def payload_digest(payload: bytes | bytearray | memoryview, piece_size: int = DEFAULT_PIECE_SIZE) -> str:
    """The payload digest of ``payload`` in pieces of ``piece_size`` bytes (module docstring), hex; one pass.

    Raises:
        MalformedEnvelopeError: bad ``piece_size``.
    """
    return payload_digest_from_leaves(payload_leaves(payload, piece_size), piece_size)


def immutable_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat, read-only byte view (format ``"B"``, 1-D) of ``data`` that no one can write through: of ``data``
    itself where it is (or views) immutable ``bytes`` (zero copy), else of a copy (``bytearray``, a writable or
    strided view). Slices of the result are zero-copy views that keep the bytes alive."""
    if isinstance(data, bytes):
        return memoryview(data)
    if (isinstance(data, memoryview) and data.readonly and isinstance(data.obj, bytes) and data.c_contiguous
            and data.format == "B" and data.ndim == 1):
        return data
    return memoryview(bytes(data))


def seal(*, private_key: Ed25519PrivateKey, federation_id: str, site_id: str, round: int,
         base_model_hash: str, kind: MessageKind | str, sequence: int, payload: bytes,
         timestamp: int | None = None, piece_size: int = DEFAULT_PIECE_SIZE) -> Envelope:
    """Build and sign an envelope; the payload is hashed once (its leaves, :func:`payload_leaves`).

    Args:
        private_key: the sender's Ed25519 key (the coordinator's for TASK/ACK, the site's for UPDATE/DETECTION).
        timestamp: Unix time in milliseconds; defaults to now.
        piece_size: bytes per piece of the payload digest; an envelope sent chunked travels in chunks of this size
            (:func:`shared.transfer.piece_size_for` turns a configured chunk size into one).
        (other fields: see :class:`EnvelopeHeader`.)

    Raises:
        MalformedEnvelopeError: a header field is invalid (including ``piece_size``).
    """
    check_piece_size(piece_size)
    payload = payload if type(payload) is bytes else bytes(payload)  # immutable: the leaves stay its digests
    leaves = tuple(payload_leaves(payload, piece_size))
    header = EnvelopeHeader(
        format_version=FORMAT_VERSION, federation_id=federation_id, site_id=site_id, round=round,
        base_model_hash=base_model_hash, kind=MessageKind(kind), sequence=sequence,
        timestamp=int(time.time() * 1000) if timestamp is None else timestamp,
        payload_digest=payload_digest_from_leaves(leaves, piece_size), piece_size=piece_size,
        payload_length=len(payload))
    signature = private_key.sign(DOMAIN + header.canonical_bytes())
    return Envelope(header=header, signature=signature, payload=payload, leaves=leaves)


def readdress(envelope: Envelope, *, private_key: Ed25519PrivateKey, site_id: str,
              timestamp: int | None = None) -> Envelope:
    """The same payload sealed for another site: a new header (``site_id``, ``timestamp``; every other field,
    the payload digest included, kept) signed with ``private_key``. The payload is not hashed again: it is the same
    immutable object whose digest the header already names (the coordinator sends one task payload to many sites).

    Args:
        envelope: an envelope sealed by this process (:func:`seal`), whose payload is immutable.
        private_key: the sender's Ed25519 key. site_id: the new addressee. timestamp: Unix ms; defaults to now.

    Raises:
        MalformedEnvelopeError: a bad ``site_id``.

    Source: Ed25519 (RFC 8032) over ``DOMAIN + canonical header``, as :func:`seal`.
    """
    header = replace(envelope.header, site_id=site_id,
                     timestamp=int(time.time() * 1000) if timestamp is None else timestamp)
    signature = private_key.sign(DOMAIN + header.canonical_bytes())
    leaves = envelope.leaves if envelope.leaves is not None else tuple(
        payload_leaves(envelope.payload, header.piece_size))
    return Envelope(header=header, signature=signature, payload=envelope.payload, leaves=leaves)


def verify_signature(header: EnvelopeHeader, signature: bytes, public_key: Ed25519PublicKey) -> None:
    """Verify the Ed25519 signature (RFC 8032) over ``DOMAIN + header.canonical_bytes()``; the payload is not
    looked at (:func:`verify_payload` checks it against the header).

    Raises:
        SignatureError: the signature does not verify under ``public_key``.
    """
    try:
        public_key.verify(signature, DOMAIN + header.canonical_bytes())
    except InvalidSignature:
        raise SignatureError(f"signature of {header.kind.value} from/for site {header.site_id!r} does not verify"
                             ) from None


def verify_payload(envelope: Envelope) -> None:
    """Check that the payload has the header's length and payload digest (one BLAKE3 pass over the payload).

    Raises:
        SignatureError: the payload differs from what the header names.
    """
    h = envelope.header
    if len(envelope.payload) != h.payload_length:
        raise SignatureError("payload length differs from the signed header")
    if payload_digest(envelope.payload, h.piece_size) != h.payload_digest:
        raise SignatureError("payload digest (BLAKE3 hash list) differs from the signed header")


def verify(envelope: Envelope, public_key: Ed25519PublicKey) -> None:
    """Verify the signature over the header (:func:`verify_signature`), then that the payload matches the signed
    length and payload digest (:func:`verify_payload`).

    Raises:
        SignatureError: the signature does not verify under ``public_key`` or the payload was altered.
    """
    verify_signature(envelope.header, envelope.signature, public_key)
    verify_payload(envelope)
