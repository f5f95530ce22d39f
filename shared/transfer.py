"""Chunked, resumable transfer of large envelopes (model updates up, tasks down) over MQTT.

A signed envelope larger than the chunk size (default 256 KiB, well under EMQX's 1 MB default packet limit and
Mosquitto's ``message_size_limit``) does not travel as one MQTT message. Its payload is sent in the pieces its
payload digest is computed over (:mod:`shared.envelope`, format 2: a BLAKE3 hash list, pieces of ``piece_size``
bytes), so a chunk is a piece, and the sender publishes, on the same topic:

1. a **manifest**: an envelope of kind ``MANIFEST`` signed by the sender, with the inner envelope's federation,
   site, round, base model hash and sequence in its header and, as payload, :class:`Manifest`: the inner
   envelope's canonical header and its 64-byte signature, and the digest (leaf) of every piece, in order;
2. the chunks, each ``b"WFC2" | transfer id (32 raw bytes) | index (uint32 BE) | data`` where ``data`` is piece
   ``index`` of the inner payload (``piece_size`` bytes, the last one shorter).

The transfer id is ``BLAKE3-derive_key(TRANSFER_ID_CONTEXT, inner header bytes || inner signature)``: it binds the
signed payload digest, and costs a hash of a few hundred bytes. A receiver checks a manifest before it keeps any
chunk: the manifest envelope's signature, the inner envelope's Ed25519 signature over its header (with the same
sender's key), that the inner header names what the manifest envelope's header does (:func:`check_manifest_header`),
and that the leaves hash to the inner header's signed ``payload_digest`` with as many leaves as the payload length
makes pieces (:class:`Manifest` checks the last two when it is built). Each chunk is then checked with one BLAKE3 over
its data against its leaf (:func:`check_chunk`), the only pass over the payload bytes; the joined pieces are the
inner envelope's payload, already verified (:func:`assemble` hashes nothing). Each payload byte is hashed once.

A chunk is not signed by itself: it is authenticated by its leaf in the signed manifest, so nothing unauthenticated
is ever parsed beyond the fixed 40-byte chunk header. The receiver keeps the chunks it has (the coordinator durably,
:mod:`coordinator.inbound.transfers`), answers a repeated manifest with a signed ``RECEIPT`` that lists the chunks still
missing, and the sender then sends only those: a transfer resumes after a reconnect instead of starting over.
Transfers not completed within their time to live expire (receiver side).

The pattern is that of resumable uploads with a signed manifest of per-part digests (BitTorrent's piece hashes in a
signed metainfo, BEP 3 and BEP 52; tus.io's offset-based resume), reduced to what an MQTT QoS 1 link needs.

Versions: chunks of transfer format 1 (``b"WFC1"``: chunks of the inner envelope's wire bytes, SHA-256 per chunk and
again over the whole) are retired with envelope format 1; such a chunk is refused with reason
``unsupported_version`` and a message naming the fix (run the same release on both sides).

Size limits are checked before anything is parsed: a chunk longer than the manifest's chunk size plus its header,
a manifest announcing more than the receiver's limit, or more than :data:`MAX_CHUNKS` chunks is refused.

A broker drops a message over its size limit, and a QoS 1 publisher may never learn it (Mosquitto's
``message_size_limit`` acknowledges and drops; EMQX drops; Mosquitto's ``max_packet_size`` disconnects the sender,
which reconnects and sends the same chunk again). The chunk size is therefore checked against the broker's limit
when a config is loaded (``shared.broker.check_chunk_fits``), senders seal envelopes with the piece size
:func:`piece_size_for` gives for their chunk size, :func:`send` refuses a message over ``max_message_bytes`` (or an
envelope sealed with pieces larger than the chunk size) before publishing anything, and a chunk the receiver keeps
asking for after it was sent (:class:`ResendTracker` for uploads; stalled downloads are counted by the gateway
agent) makes the gateway give the transfer up with an error naming the chunk size instead of retrying forever.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared import envelope as _envelope
from shared.codec import decode_tensors, encode_tensors
from shared.envelope import (DEFAULT_PIECE_SIZE, LEAF_LENGTH, MAX_PIECE_SIZE, MIN_PIECE_SIZE, SIGNATURE_LENGTH,
                             Envelope, EnvelopeHeader, MessageKind, payload_digest_from_leaves, payload_leaves, seal,
                             verify_signature)
from shared.errors import EnvelopeError, MalformedEnvelopeError, PayloadError

__all__ = [
    "CHUNK_MAGIC",
    "CHUNK_HEADER_LENGTH",
    "DEFAULT_CHUNK_SIZE",
    "MAX_CHUNKS",
    "TRANSFER_ID_CONTEXT",
    "TransferError",
    "Manifest",
    "Chunk",
    "Receipt",
    "piece_size_for",
    "transfer_id_of",
    "is_chunk",
    "split",
    "seal_manifest",
    "encode_manifest",
    "decode_manifest",
    "check_manifest_header",
    "verify_manifest",
    "encode_receipt",
    "decode_receipt",
    "check_chunk",
    "assemble",
    "Reassembly",
    "NO_TRANSFER",
    "chunks_to_send",
    "send",
    "ResendTracker",
]

CHUNK_MAGIC = b"WFC2"
RETIRED_CHUNK_MAGICS = {b"WFC1": "transfer format 1 (chunks of the inner envelope's wire bytes, SHA-256 per chunk "
                                 "and again over the whole), retired with envelope format 1"}
"""Chunk magics no longer read, with why (the refusal names them)."""
CHUNK_HEADER_LENGTH = 4 + 32 + 4
"""Bytes before a chunk's data: magic, raw transfer id, index."""
DEFAULT_CHUNK_SIZE = DEFAULT_PIECE_SIZE
"""Chunk size in bytes when the config gives none (= the envelope's default piece size, 256 KiB)."""
MIN_CHUNK_SIZE = MIN_PIECE_SIZE
MAX_CHUNKS = 1 << 16
"""At most 65,536 chunks per transfer (16 GiB at the default chunk size)."""
TRANSFER_ID_CONTEXT = "WildFed 2025-06-01 12:00:00 chunked transfer id v2"
"""The BLAKE3 ``derive_key`` context of transfer ids."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX128 = re.compile(r"^[0-9a-f]{128}$")
_METADATA_KEY = "wildfed"


class TransferError(EnvelopeError):
    """A manifest, chunk or receipt that must be refused; ``reason`` is a short tag for counts and logs."""

    def __init__(self, message: str, reason: str = "bad_chunk") -> None:
        super().__init__(message)
        self.reason = reason


def piece_size_for(chunk_size: int) -> int:
    """The piece size a sender seals with (``shared.envelope.seal(piece_size=...)``) so that its envelope travels in
    chunks of at most ``chunk_size`` bytes: the largest power of two not above it (pieces are powers of two, as in
    BEP 52), at most :data:`shared.envelope.MAX_PIECE_SIZE`.

    Args:
        chunk_size: the configured chunk size, bytes (``chunk_size_bytes``, ``transfer.chunk_size_bytes``).

    Returns:
        the piece size in bytes (e.g. 262,144 for 262,144; 524,288 for 999,704).

    Raises:
        TransferError: ``chunk_size`` below 1 KiB (reason ``bad_chunk_size``; the message names the fix).
    """
    if type(chunk_size) is not int or chunk_size < MIN_CHUNK_SIZE:
        raise TransferError(f"chunk size {chunk_size!r} is below {MIN_CHUNK_SIZE} bytes (fix: give chunk_size_bytes "
                            f"of at least {MIN_CHUNK_SIZE})", "bad_chunk_size")
    return min(1 << (chunk_size.bit_length() - 1), MAX_PIECE_SIZE)


def _transfer_id(header: EnvelopeHeader, signature: bytes) -> str:
    return blake3(header.canonical_bytes() + bytes(signature), derive_key_context=TRANSFER_ID_CONTEXT).hexdigest()


def transfer_id_of(inner: Envelope | bytes | memoryview) -> str:
    """The transfer id of an inner envelope: ``BLAKE3-derive_key(TRANSFER_ID_CONTEXT, header bytes || signature)``,
    64 lowercase hex characters (module docstring). The payload is not hashed: the header names its digest.

    Args:
        inner: the envelope, or its wire bytes.

    Raises:
        MalformedEnvelopeError: ``inner`` is bytes that do not parse as an envelope.
    """
    env = inner if isinstance(inner, Envelope) else Envelope.from_bytes(inner)
    return _transfer_id(env.header, env.signature)


@dataclass(frozen=True)
class Manifest:
    """What a MANIFEST envelope promises about the transfer that follows: the inner envelope but its payload.

    Attributes:
        header: the inner envelope's header (its kind, ``payload_length``, ``piece_size``, ``payload_digest``).
        signature: the inner envelope's Ed25519 signature over its header, 64 bytes (checked by the receiver with
            :func:`verify_manifest` or the sender's keys; not here).
        leaves: the 32-byte BLAKE3 digest of each piece of the inner payload, in index order;
            ``ceil(payload_length / piece_size)`` of them, whose :func:`~shared.envelope.payload_digest_from_leaves`
            is the header's ``payload_digest`` (checked here).
        resume: False when the chunks follow the manifest at once (first send); True when the sender asks where to
            resume (after a reconnect or a timeout): the receiver then always answers with a :class:`Receipt`.
        transfer_id: derived, :func:`transfer_id_of` the inner envelope (not a constructor argument).

    Raises:
        TransferError: more than :data:`MAX_CHUNKS` chunks (reason ``oversized``); an empty payload, a signature
            that is not 64 bytes, a wrong number of leaves, or leaves that do not derive the signed payload digest
            (reason ``bad_manifest``).
    """

    header: EnvelopeHeader
    signature: bytes
    leaves: tuple[bytes, ...]
    resume: bool = False
    transfer_id: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.resume, bool):
            raise TransferError("manifest resume must be true or false", "bad_manifest")
        if not isinstance(self.header, EnvelopeHeader):
            raise TransferError("manifest header must be an envelope header", "bad_manifest")
        if not isinstance(self.signature, bytes) or len(self.signature) != SIGNATURE_LENGTH:
            raise TransferError(f"manifest signature must be {SIGNATURE_LENGTH} bytes", "bad_manifest")
        if self.header.payload_length < 1:
            raise TransferError("manifest announces an empty payload: nothing to transfer (an envelope with an "
                                "empty payload travels whole)", "bad_manifest")
        if self.num_chunks > MAX_CHUNKS:
            raise TransferError(f"manifest announces {self.num_chunks} chunks, more than {MAX_CHUNKS}", "oversized")
        leaves = tuple(self.leaves) if isinstance(self.leaves, (list, tuple)) else None
        if leaves is None or not all(isinstance(x, bytes) and len(x) == LEAF_LENGTH for x in leaves):
            raise TransferError(f"manifest leaves must be a list of {LEAF_LENGTH}-byte digests", "bad_manifest")
        object.__setattr__(self, "leaves", leaves)
        if len(leaves) != self.num_chunks:
            raise TransferError(f"manifest lists {len(leaves)} piece digests, {self.total_length} bytes in pieces of "
                                f"{self.chunk_size} make {self.num_chunks}", "bad_manifest")
        if payload_digest_from_leaves(leaves, self.chunk_size) != self.header.payload_digest:
            raise TransferError("manifest piece digests do not derive the inner envelope's signed payload_digest",
                                "bad_manifest")
        object.__setattr__(self, "transfer_id", _transfer_id(self.header, self.signature))

    @property
    def kind(self) -> MessageKind:
        """The inner envelope's kind (``update`` upstream, ``task`` downstream)."""
        return self.header.kind

    @property
    def total_length(self) -> int:
        """The inner payload's length in bytes (>= 1)."""
        return self.header.payload_length

    @property
    def chunk_size(self) -> int:
        """Bytes per chunk: the inner envelope's ``piece_size`` (every chunk but the last has exactly this many)."""
        return self.header.piece_size

    @property
    def num_chunks(self) -> int:
        """``ceil(total_length / chunk_size)``."""
        return -(-self.total_length // self.chunk_size)  # exact: a float quotient overflows for huge lengths

    def chunk_length(self, index: int) -> int:
        """Data length in bytes of chunk ``index`` (the last one may be shorter)."""
        if index < self.num_chunks - 1:
            return self.chunk_size
        return self.total_length - self.chunk_size * (self.num_chunks - 1)


@dataclass(frozen=True)
class Chunk:
    """One piece of a transfer: ``data`` is bytes ``[index * chunk_size, ...)`` of the inner envelope's payload.

    ``data`` is ``bytes`` or a read-only ``memoryview`` of immutable bytes (a slice of the MQTT message in
    :meth:`from_bytes`, of the payload in :func:`split`): never copied on the way, never writable.
    """

    transfer_id: str
    index: int
    data: bytes | memoryview

    def to_bytes(self) -> bytes:
        """Wire form: ``b"WFC2" | transfer id (32 raw bytes) | index (uint32 BE) | data``."""
        return CHUNK_MAGIC + bytes.fromhex(self.transfer_id) + struct.pack(">I", self.index) + self.data

    @classmethod
    def from_bytes(cls, raw: bytes, *, max_data_bytes: int) -> "Chunk":
        """Parse a chunk; the length is checked before anything else.

        Args:
            raw: the MQTT payload. max_data_bytes: the largest chunk data the receiver accepts.

        Raises:
            TransferError: too long (``oversized``), a retired chunk format such as ``WFC1``
                (``unsupported_version``; the message names the fix), too short or bad magic (``bad_chunk``).
        """
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise TransferError(f"chunk must be bytes, got {type(raw).__name__}")
        if len(raw) > CHUNK_HEADER_LENGTH + max_data_bytes:
            raise TransferError(f"chunk of {len(raw)} bytes exceeds the limit of {max_data_bytes} data bytes",
                                "oversized")
        magic = bytes(raw[:4])
        if magic in RETIRED_CHUNK_MAGICS:
            raise TransferError(f"chunk of {RETIRED_CHUNK_MAGICS[magic]}: this receiver reads {CHUNK_MAGIC!r} chunks "
                                f"only (fix: upgrade the sender, gateway or coordinator: both sides must run the same "
                                "WildFed release)", "unsupported_version")
        if len(raw) <= CHUNK_HEADER_LENGTH or magic != CHUNK_MAGIC:
            raise TransferError("not a WildFed chunk (bad magic or no data)")
        view = _envelope.immutable_view(raw)  # the data is a view of the message, not a copy
        (index,) = struct.unpack(">I", view[36:40])
        return cls(transfer_id=view[4:36].hex(), index=index, data=view[CHUNK_HEADER_LENGTH:])


@dataclass(frozen=True)
class Receipt:
    """A receiver's signed answer to a repeated manifest: which chunks of ``transfer_id`` it still lacks.

    Attributes:
        transfer_id: the transfer's id (:func:`transfer_id_of`), 64 hex.
        missing: sorted chunk indices the receiver does not hold (empty when it holds them all).
        detail: free text (e.g. why a transfer is refused); empty normally.
    """

    transfer_id: str
    missing: tuple[int, ...]
    detail: str = ""


NO_TRANSFER = "0" * 64
"""The transfer id of a site's receipt that holds nothing yet: "send me the open round's task" (a gateway that was
offline when the round opened asks for it after reconnecting)."""


def is_chunk(raw: bytes) -> bool:
    """Whether an MQTT payload claims to be a chunk of some transfer format (it starts with ``b"WFC"``; a retired
    format is then refused by :meth:`Chunk.from_bytes` with a message that says so)."""
    return len(raw) >= 4 and bytes(raw[:3]) == CHUNK_MAGIC[:3]


def split(inner: Envelope | bytes | memoryview) -> tuple[Manifest, list[Chunk]]:
    """Split an inner envelope into its manifest (leaves computed in one pass over the payload) and its chunks (the
    payload's pieces of the envelope's ``piece_size``).

    Args:
        inner: the signed envelope, or its wire bytes (``Envelope.to_bytes()``).

    Raises:
        TransferError: an empty payload (``bad_manifest``: it travels whole), more than :data:`MAX_CHUNKS` chunks
            (``oversized``), or a payload that does not match its header's digest (``bad_manifest``).
        MalformedEnvelopeError: ``inner`` is bytes that do not parse as an envelope.
    """
    env = inner if isinstance(inner, Envelope) else Envelope.from_bytes(inner)
    h = env.header
    if len(env.payload) != h.payload_length:
        raise TransferError("payload length differs from the inner envelope's header", "bad_manifest")
    if h.payload_length > MAX_CHUNKS * h.piece_size:
        raise TransferError(f"a payload of {h.payload_length} bytes in pieces of {h.piece_size} makes more than "
                            f"{MAX_CHUNKS} chunks", "oversized")
    leaves = env.leaves if env.leaves is not None else tuple(payload_leaves(env.payload, h.piece_size))
    manifest = Manifest(header=h, signature=env.signature, leaves=leaves)
    view = _envelope.immutable_view(env.payload)
    p = h.piece_size
    return manifest, [Chunk(manifest.transfer_id, i, view[i * p:(i + 1) * p]) for i in range(manifest.num_chunks)]


def _metadata_payload(body: dict) -> bytes:
    return encode_tensors({}, {_METADATA_KEY: json.dumps(body, sort_keys=True, separators=(",", ":"))})


def _read_body(payload: bytes, fields: set[str], what: str) -> dict:
    try:
        tensors, metadata = decode_tensors(payload)
    except (PayloadError, ValueError) as exc:  # ValueError: a JSON integer of > 4300 digits in the header
        raise TransferError(f"{what} payload: {exc}", f"bad_{what}") from exc
    if tensors or set(metadata) != {_METADATA_KEY}:
        raise TransferError(f"{what} payload must carry only its JSON metadata", f"bad_{what}")
    try:
        body = json.loads(metadata[_METADATA_KEY])
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise TransferError(f"{what} metadata is not JSON: {exc}", f"bad_{what}") from exc
    if not isinstance(body, dict) or set(body) != fields:
        raise TransferError(f"{what} fields must be exactly {sorted(fields)}", f"bad_{what}")
    return body


def encode_manifest(manifest: Manifest) -> bytes:
    """Payload of a MANIFEST envelope: safetensors with, as JSON metadata, ``header`` (the inner header's canonical
    JSON, as a string), ``signature`` (128 hex), ``leaves`` (64 hex each) and ``resume``."""
    return _metadata_payload({"header": manifest.header.canonical_bytes().decode("ascii"),
                              "signature": manifest.signature.hex(), "leaves": [x.hex() for x in manifest.leaves],
                              "resume": manifest.resume})


def decode_manifest(payload: bytes) -> Manifest:
    """Inverse of :func:`encode_manifest`; the leaves are checked against the inner header's payload digest.

    Raises:
        TransferError: malformed payload, an inner header of a retired format (``unsupported_version``) or otherwise
            malformed (``bad_manifest``), inconsistent fields (``bad_manifest``, ``oversized``).
    """
    body = _read_body(payload, {"header", "signature", "leaves", "resume"}, "manifest")
    if not isinstance(body["header"], str):
        raise TransferError("manifest header must be the inner envelope's canonical header as a string", "bad_manifest")
    try:
        header = EnvelopeHeader.from_canonical_bytes(body["header"].encode("utf-8"))
    except MalformedEnvelopeError as exc:
        raise TransferError(f"manifest inner header: {exc}", exc.reason if exc.reason == "unsupported_version"
                            else "bad_manifest") from exc
    if not isinstance(body["signature"], str) or not _HEX128.match(body["signature"]):
        raise TransferError("manifest signature must be 128 lowercase hex characters", "bad_manifest")
    leaves = body["leaves"]
    chunks = -(-header.payload_length // header.piece_size)
    if chunks > MAX_CHUNKS:
        raise TransferError(f"manifest announces {chunks} chunks, more than {MAX_CHUNKS}", "oversized")
    if not isinstance(leaves, list) or len(leaves) > MAX_CHUNKS or not all(
            isinstance(x, str) and _HEX64.match(x) for x in leaves):
        raise TransferError("manifest leaves must be a list of 64-hex digests", "bad_manifest")
    return Manifest(header=header, signature=bytes.fromhex(body["signature"]),
                    leaves=tuple(bytes.fromhex(x) for x in leaves), resume=body["resume"])


def encode_receipt(receipt: Receipt) -> bytes:
    """Payload of a RECEIPT envelope."""
    return _metadata_payload({"transfer_id": receipt.transfer_id, "missing": list(receipt.missing),
                              "detail": receipt.detail})


def decode_receipt(payload: bytes) -> Receipt:
    """Inverse of :func:`encode_receipt`.

    Raises:
        TransferError: malformed payload (``bad_receipt``).
    """
    body = _read_body(payload, {"transfer_id", "missing", "detail"}, "receipt")
    missing = body["missing"]
    if (not isinstance(body["transfer_id"], str) or not _HEX64.match(body["transfer_id"])
            or not isinstance(missing, list) or len(missing) > MAX_CHUNKS
            or not all(type(i) is int and 0 <= i < MAX_CHUNKS for i in missing)
            or not isinstance(body["detail"], str)):
        raise TransferError("receipt needs a 64-hex transfer_id, a list of chunk indices and a detail string",
                            "bad_receipt")
    return Receipt(transfer_id=body["transfer_id"], missing=tuple(sorted(set(missing))), detail=body["detail"])


def seal_manifest(*, private_key: Ed25519PrivateKey, manifest: Manifest, resume: bool = False) -> Envelope:
    """Sign a MANIFEST envelope for ``manifest``: its header names the inner envelope's federation, site, round,
    base model hash and sequence (so the manifest alone can be checked against the open round before any chunk is
    stored; receivers check the two agree, :func:`check_manifest_header`).

    Raises:
        MalformedEnvelopeError: a header field is invalid.
    """
    inner = manifest.header
    return seal(private_key=private_key, federation_id=inner.federation_id, site_id=inner.site_id, round=inner.round,
                base_model_hash=inner.base_model_hash, kind=MessageKind.MANIFEST, sequence=inner.sequence,
                payload=encode_manifest(replace(manifest, resume=resume)))


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


def chunks_to_send(chunks: Iterable[Chunk], missing: Iterable[int] | None) -> list[Chunk]:
    """The chunks a sender (re)sends: all of them, or those whose index is in ``missing``."""
    if missing is None:
        return list(chunks)
    wanted = set(missing)
    return [c for c in chunks if c.index in wanted]


def send(publish: Callable[[str, bytes], None], topic: str, inner: bytes | Envelope, *, private_key: Ed25519PrivateKey,
         chunk_size: int = DEFAULT_CHUNK_SIZE, resume: bool = False, missing: Iterable[int] | None = None,
         max_message_bytes: int | None = None, on_chunk: Callable[[str, int], None] | None = None,
         on_probe: Callable[[str], None] | None = None) -> int:
    """Publish a signed envelope whole when it fits in one chunk, else as a manifest and its chunks (the payload's
    pieces, of the envelope's ``piece_size``).

    Args:
        publish: ``publish(topic, payload)``; raises the transport's error when the broker does not take it.
        topic: where to publish. inner: the signed envelope, or its wire bytes, sealed with a ``piece_size`` of at
            most ``chunk_size`` (:func:`piece_size_for`); an :class:`Envelope` from :func:`shared.envelope.seal`
            carries its leaves, so that its payload is not hashed again here. private_key: the sender's key (signs
            the manifest).
        chunk_size: the largest chunk the sender publishes, bytes; an envelope of at most this many bytes goes whole.
        resume: send only the manifest, marked ``resume`` (the receiver answers with a :class:`Receipt`).
        missing: send the manifest's chunks with these indices only, without the manifest (the answer to a
            receipt); None: the manifest and every chunk.
        max_message_bytes: the largest MQTT payload the broker passes (its packet limit less the MQTT header);
            a message over it is refused before anything is published. None: no check.
        on_chunk: ``on_chunk(transfer_id, index)`` just before each chunk is published (:class:`ResendTracker`).
        on_probe: ``on_probe(transfer_id)`` once a resume manifest was published (:class:`ResendTracker`).

    Returns:
        number of MQTT messages published.

    Raises:
        TransferError: an envelope sealed with pieces larger than ``chunk_size``, or a manifest or chunk over
            ``max_message_bytes`` (reason ``oversized``; the message names ``chunk_size_bytes``); an empty payload
            asked to resume (``bad_manifest``). Whatever ``publish`` raises.
    """
    def check(payload: bytes, what: str) -> bytes:
        if max_message_bytes is not None and len(payload) > max_message_bytes:
            raise TransferError(f"{what} of {len(payload)} bytes exceeds the broker's limit of {max_message_bytes} "
                                f"bytes: the broker would drop it; change chunk_size_bytes (now {chunk_size}) so "
                                "that chunks, and the manifest listing one digest per chunk, fit", "oversized")
        return payload

    env = inner if isinstance(inner, Envelope) else None
    size = len(inner) if env is None else env.wire_length
    if size <= chunk_size and not resume and missing is None:
        publish(topic, check(inner if env is None else env.to_bytes(), "message"))
        return 1
    env = env if env is not None else Envelope.from_bytes(inner)
    if env.header.piece_size > chunk_size:
        raise TransferError(f"the envelope was sealed with pieces of {env.header.piece_size} bytes, larger than the "
                            f"chunk size {chunk_size}: it cannot travel in chunks of that size (fix: seal with "
                            f"piece_size=piece_size_for(chunk_size_bytes), i.e. {piece_size_for(chunk_size)}; an "
                            "envelope sealed before chunk_size_bytes was lowered cannot be sent)", "oversized")
    manifest, chunks = split(env)
    if max_message_bytes is not None and chunks:
        check(chunks[0].to_bytes(), "a chunk")
    sent = 0
    if missing is None:
        publish(topic, check(seal_manifest(private_key=private_key, manifest=manifest, resume=resume).to_bytes(),
                             f"the manifest of {manifest.num_chunks} chunks"))
        sent += 1
        if resume:
            if on_probe is not None:
                on_probe(manifest.transfer_id)
            return sent
    for chunk in chunks_to_send(chunks, missing):
        if on_chunk is not None:
            on_chunk(chunk.transfer_id, chunk.index)
        publish(topic, chunk.to_bytes())
        sent += 1
    return sent


class ResendTracker:
    """The sender's evidence that a chunk is not getting through (typically a broker's message size limit below the
    chunk size): it counts, per chunk, the receipts that still list it although it was sent before the resume
    probe the receipt answers; a chunk counted ``limit`` times means the transfer should be given up with an error,
    not retried forever.

    The receiver answers each resume probe (a manifest marked ``resume``) with one receipt, in order, and MQTT keeps
    the order of one client's messages: so a chunk published before a probe has reached the receiver before that
    probe, and a receipt answering the probe that still lists it shows the chunk was lost on the way. Receipts are
    matched to probes first in, first out; a burst of probes (reconnects in quick succession) with no chunk sent in
    between counts once, not once per probe. Memory only: a restart starts the count again. Not thread-safe (the
    agent calls it from its own thread).

    Args:
        limit: receipts listing one sent chunk at which :meth:`answered` reports it, >= 2.

    Raises:
        ValueError: ``limit`` below 2.
    """

    _MAX_PROBES = 64  # probes awaiting a receipt kept per transfer (the oldest are merged into the next)

    def __init__(self, limit: int) -> None:
        if int(limit) < 2:
            raise ValueError(f"resend limit {limit} is below 2")
        self.limit = int(limit)
        self._counts: dict[str, dict[int, int]] = {}
        self._unprobed: dict[str, set[int]] = {}  # chunks sent since the last probe
        self._probes: dict[str, list[set[int]]] = {}  # per probe awaiting its receipt: the chunks sent before it

    def sent(self, transfer_id: str, indices: Iterable[int]) -> None:
        """Chunks ``indices`` of ``transfer_id`` are being published."""
        self._unprobed.setdefault(transfer_id, set()).update(int(i) for i in indices)

    def probed(self, transfer_id: str) -> None:
        """A resume probe of ``transfer_id`` was published (the receiver answers it with a receipt)."""
        probes = self._probes.setdefault(transfer_id, [])
        probes.append(self._unprobed.pop(transfer_id, set()))
        if len(probes) > self._MAX_PROBES:
            oldest = probes.pop(0)
            probes[0] |= oldest

    def answered(self, transfer_id: str, missing: Iterable[int]) -> tuple[int, int] | None:
        """A receipt of ``transfer_id`` lists ``missing``: each of them sent before the probe it answers counts.

        Returns:
            ``(index, receipts)`` of the most-counted chunk once some chunk reached ``limit``, else None.
        """
        probes = self._probes.get(transfer_id)
        before = probes.pop(0) if probes else set()
        counts = self._counts.setdefault(transfer_id, {})
        for i in missing:
            if i in before:
                counts[i] = counts.get(i, 0) + 1
        if not counts:
            return None
        index, n = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        return (index, n) if n >= self.limit else None

    def receipts(self, transfer_id: str, index: int) -> int:
        """Receipts counted so far for chunk ``index`` of ``transfer_id``."""
        return self._counts.get(transfer_id, {}).get(index, 0)

    def forget(self, transfer_id: str) -> None:
        """Drop what is kept about a finished or abandoned transfer."""
        for table in (self._counts, self._unprobed, self._probes):
            table.pop(transfer_id, None)
