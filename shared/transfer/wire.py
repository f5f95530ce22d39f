"""The wire formats of a chunked transfer: the chunk (``WFC2``), the manifest and the receipt (payloads of signed
MANIFEST and RECEIPT envelopes), the transfer id, and the error every refusal raises (:mod:`shared.transfer`)."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field, replace

from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import envelope as _envelope
from shared.codec import decode_tensors, encode_tensors
from shared.envelope import (LEAF_LENGTH, SIGNATURE_LENGTH, Envelope, EnvelopeHeader, MessageKind,
                             payload_digest_from_leaves, seal)
from shared.errors import EnvelopeError, MalformedEnvelopeError, PayloadError

CHUNK_MAGIC = b"WFC2"
RETIRED_CHUNK_MAGICS = {b"WFC1": "transfer format 1 (chunks of the inner envelope's wire bytes, SHA-256 per chunk "
                                 "and again over the whole), retired with envelope format 1"}
"""Chunk magics no longer read, with why (the refusal names them)."""
CHUNK_HEADER_LENGTH = 4 + 32 + 4
"""Bytes before a chunk's data: magic, raw transfer id, index."""
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


def _transfer_id(header: EnvelopeHeader, signature: bytes) -> str:
    return blake3(header.canonical_bytes() + bytes(signature), derive_key_context=TRANSFER_ID_CONTEXT).hexdigest()


def transfer_id_of(inner: Envelope | bytes | memoryview) -> str:
    """The transfer id of an inner envelope: ``BLAKE3-derive_key(TRANSFER_ID_CONTEXT, header bytes || signature)``,
    64 lowercase hex characters (:mod:`shared.transfer`). The payload is not hashed: the header names its digest.

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
