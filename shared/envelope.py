"""Signed envelopes: the one wire format of WildFed.

An envelope carries one message between the coordinator and a site. On the wire it is::

    b"WFE1" | header_length (uint32, big-endian) | header (canonical JSON) | signature (64 bytes) | payload

The header is canonical JSON (UTF-8, keys sorted, no white space, integers only) of the fields of
:class:`EnvelopeHeader`. The Ed25519 signature (RFC 8032) covers ``DOMAIN + header bytes``; the header holds the
payload's SHA-256 and length, so the signature binds the payload too (sign-the-digest, as DESIGN.md asks), and the
domain string keeps a WildFed signature from being valid for any other protocol.

Compatibility rules of the format (as in dp-accounting's event module):
1. ``format_version`` changes whenever a reader of the old version could misread a new message.
2. Fields are never removed and never change meaning; new header fields are added only with a new version.
3. A reader rejects a version it does not know, and any unknown or missing header field.

Nothing here unpickles anything: the header is JSON, the payload is opaque bytes (safetensors, see
:mod:`shared.codec`).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from dataclasses import asdict, dataclass
from enum import Enum

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.errors import MalformedEnvelopeError, SignatureError

__all__ = [
    "FORMAT_VERSION",
    "MessageKind",
    "EnvelopeHeader",
    "Envelope",
    "seal",
    "verify",
    "validate_identifier",
]

FORMAT_VERSION = 1
MAGIC = b"WFE1"
DOMAIN = b"wildfed-envelope-v1\x00"
SIGNATURE_LENGTH = 64
MAX_HEADER_LENGTH = 4096
_IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class MessageKind(str, Enum):
    """What an envelope carries: a training task (coordinator → site), a model update (site → coordinator),
    an acknowledgement of an update (coordinator → site), a detection record (site → coordinator), one stage
    of secure aggregation in Global DP mode (both directions; ``shared.protocol.SecAggMessage``), the manifest of
    a chunked transfer or a receipt listing the chunks a receiver still lacks (both directions;
    :mod:`shared.transfer`). A reader that does not know a kind rejects the envelope (rule 3 below)."""

    TASK = "task"
    UPDATE = "update"
    ACK = "ack"
    DETECTION = "detection"
    SECAGG = "secagg"
    MANIFEST = "manifest"
    RECEIPT = "receipt"


def validate_identifier(value: str, field: str) -> str:
    """Check that ``value`` is a safe federation or site identifier (1-64 of ``A-Za-z0-9_.-``, not starting
    with punctuation), so that it can stand in an MQTT topic level and a file name.

    Raises:
        MalformedEnvelopeError: it is not.
    """
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise MalformedEnvelopeError(
            f"{field} {value!r} is not an identifier of 1-64 characters from A-Za-z0-9_.- starting with a "
            "letter or digit")
    return value


@dataclass(frozen=True)
class EnvelopeHeader:
    """The signed header of an envelope.

    Attributes:
        format_version: wire format version (:data:`FORMAT_VERSION`).
        federation_id: the federation this message belongs to.
        site_id: the site the message concerns: the sender of an UPDATE or DETECTION, the addressee of a
            TASK or ACK.
        round: federated round number (0-based), ``int``.
        base_model_hash: hex SHA-256 (64 chars) of the global model version the message refers to, or ``""``
            when it refers to none.
        kind: :class:`MessageKind`.
        sequence: per-sender message counter (non-negative ``int``); with ``site_id`` and ``round`` it makes a
            message unique, so duplicates can be detected.
        timestamp: sender's clock, Unix time in **milliseconds** (``int``).
        payload_sha256: hex SHA-256 of the payload bytes.
        payload_length: payload length in bytes.
    """

    format_version: int
    federation_id: str
    site_id: str
    round: int
    base_model_hash: str
    kind: MessageKind
    sequence: int
    timestamp: int
    payload_sha256: str
    payload_length: int

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise MalformedEnvelopeError(f"format_version {self.format_version!r} is not supported "
                                         f"(this reader knows {FORMAT_VERSION})")
        validate_identifier(self.federation_id, "federation_id")
        validate_identifier(self.site_id, "site_id")
        for name in ("round", "sequence", "timestamp", "payload_length"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise MalformedEnvelopeError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.kind, MessageKind):
            try:
                object.__setattr__(self, "kind", MessageKind(self.kind))
            except ValueError:
                raise MalformedEnvelopeError(f"kind {self.kind!r} is not one of "
                                             f"{[k.value for k in MessageKind]}") from None
        if not isinstance(self.base_model_hash, str) or not (
                self.base_model_hash == "" or _HEX64.match(self.base_model_hash)):
            raise MalformedEnvelopeError("base_model_hash must be 64 lowercase hex characters or empty")
        if not isinstance(self.payload_sha256, str) or not _HEX64.match(self.payload_sha256):
            raise MalformedEnvelopeError("payload_sha256 must be 64 lowercase hex characters")

    def canonical_bytes(self) -> bytes:
        """The canonical encoding that is signed: UTF-8 JSON, keys sorted, no white space."""
        fields = asdict(self)
        fields["kind"] = self.kind.value
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_canonical_bytes(cls, data: bytes) -> "EnvelopeHeader":
        """Parse a header; reject anything that is not exactly the canonical encoding.

        Raises:
            MalformedEnvelopeError: not JSON, unknown/missing fields, bad values, or not canonical.
        """
        try:
            fields = json.loads(data.decode("ascii"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MalformedEnvelopeError(f"header is not ASCII JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise MalformedEnvelopeError("header is not a JSON object")
        expected = set(cls.__dataclass_fields__)
        if set(fields) != expected:
            missing, unknown = expected - set(fields), set(fields) - expected
            raise MalformedEnvelopeError(f"header fields wrong: missing {sorted(missing)}, unknown {sorted(unknown)}")
        try:
            header = cls(**fields)
        except TypeError as exc:
            raise MalformedEnvelopeError(f"header fields wrong: {exc}") from exc
        if header.canonical_bytes() != data:
            raise MalformedEnvelopeError("header is not in canonical form")
        return header


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

    def to_bytes(self) -> bytes:
        """Encode for the wire (see the module docstring for the layout)."""
        header = self.header.canonical_bytes()
        return MAGIC + struct.pack(">I", len(header)) + header + self.signature + self.payload

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
        view = _immutable_view(data)
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


def _immutable_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat, read-only byte view of ``data`` that no one can write through: of ``data`` itself where it is (or
    views) immutable ``bytes``, else of a copy."""
    if isinstance(data, bytes):
        return memoryview(data)
    if (isinstance(data, memoryview) and data.readonly and isinstance(data.obj, bytes) and data.c_contiguous
            and data.format == "B" and data.ndim == 1):
        return data
    return memoryview(bytes(data))


def seal(*, private_key: Ed25519PrivateKey, federation_id: str, site_id: str, round: int,
         base_model_hash: str, kind: MessageKind | str, sequence: int, payload: bytes,
         timestamp: int | None = None) -> Envelope:
    """Build and sign an envelope.

    Args:
        private_key: the sender's Ed25519 key (the coordinator's for TASK/ACK, the site's for UPDATE/DETECTION).
        timestamp: Unix time in milliseconds; defaults to now.
        (other fields: see :class:`EnvelopeHeader`.)

    Raises:
        MalformedEnvelopeError: a header field is invalid.
    """
    header = EnvelopeHeader(
        format_version=FORMAT_VERSION, federation_id=federation_id, site_id=site_id, round=round,
        base_model_hash=base_model_hash, kind=MessageKind(kind), sequence=sequence,
        timestamp=int(time.time() * 1000) if timestamp is None else timestamp,
        payload_sha256=hashlib.sha256(payload).hexdigest(), payload_length=len(payload))
    signature = private_key.sign(DOMAIN + header.canonical_bytes())
    return Envelope(header=header, signature=signature, payload=bytes(payload))


def verify(envelope: Envelope, public_key: Ed25519PublicKey) -> None:
    """Verify the signature over the header, then that the payload matches the signed length and SHA-256.

    Raises:
        SignatureError: the signature does not verify under ``public_key`` or the payload was altered.
    """
    try:
        public_key.verify(envelope.signature, DOMAIN + envelope.header.canonical_bytes())
    except InvalidSignature:
        raise SignatureError(f"signature of {envelope.header.kind.value} from/for site "
                             f"{envelope.header.site_id!r} does not verify") from None
    if len(envelope.payload) != envelope.header.payload_length:
        raise SignatureError("payload length differs from the signed header")
    if hashlib.sha256(envelope.payload).hexdigest() != envelope.header.payload_sha256:
        raise SignatureError("payload SHA-256 differs from the signed header")
