"""The signed header of an envelope (:class:`EnvelopeHeader`): its fields, their checks and its canonical JSON
encoding, the kinds of message (:class:`MessageKind`), the format version and the piece sizes the payload digest
may use. The envelope itself, its payload digest and its signature: :mod:`shared.envelope`, which exports all of
this as before.

Compatibility rules of the format (as in dp-accounting's event module):
1. ``format_version`` changes whenever a reader of the old version could misread a new message.
2. Within a version fields are never removed and never change meaning; new header fields are added only with a new
   version.
3. A reader rejects a version it does not know, and any unknown or missing header field.
4. A version is read whole or not at all: a retired version is refused (:class:`~shared.errors.UnsupportedVersionError`
   naming the version and the fix), never read in part.

Format 1 (header field ``payload_sha256``: one SHA-256 over the whole payload) is retired: a chunked update was
hashed three times on its way in (each chunk, the reassembled bytes, then the payload again), and SHA-256 alone
capped verification at about a sixth of the speed of a numpy add over the same bytes. Format 2 replaces
``payload_sha256`` by ``payload_digest`` and ``piece_size``, so that each payload byte is hashed once. Gateways and
the coordinator must run the same release; a format-1 envelope is refused with that fix.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from enum import Enum

from shared.errors import MalformedEnvelopeError, UnsupportedVersionError

__all__ = ["BROADCAST_SITE_ID", "DEFAULT_PIECE_SIZE", "FORMAT_VERSION", "MAX_PIECE_SIZE", "MIN_PIECE_SIZE",
           "RETIRED_VERSIONS", "EnvelopeHeader", "MessageKind", "check_piece_size", "validate_identifier"]

FORMAT_VERSION = 2
RETIRED_VERSIONS = {1: "it hashed a chunked payload three times with SHA-256; format 2 hashes each byte once with "
                       "a BLAKE3 hash list"}
"""Format versions no longer read, with why (the refusal names them)."""
DEFAULT_PIECE_SIZE = 256 * 1024
"""Piece size in bytes when the sender gives none (the default chunk size of :mod:`shared.transfer`)."""
MIN_PIECE_SIZE = 1024
MAX_PIECE_SIZE = 1 << 30
BROADCAST_SITE_ID = "all-sites"
"""The reserved ``site_id`` of an envelope addressed to every site of the federation: the MODEL envelopes published
once per model on ``shared.topics.digest_topic`` (docs/protocol.md, "Models by digest"). No site may be enrolled
under it (``coordinator.registry``); a gateway accepts it only on a digest topic, never on its own topics."""
_IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class MessageKind(str, Enum):
    """What an envelope carries: a training task (coordinator → site), a model update (site → coordinator),
    an acknowledgement of an update (coordinator → site), a detection record (site → coordinator), one stage
    of secure aggregation in Global DP mode (both directions; ``shared.protocol.SecAggMessage``), the manifest of
    a chunked transfer or a receipt listing the chunks a receiver still lacks (both directions;
    :mod:`shared.transfer`), a released global model (coordinator → site; ``shared.releases``: the model a gateway
    predicts with, published retained after each round that makes a new one), a gateway's health record (site →
    coordinator; ``shared.health``) or a new SDK version (coordinator → site; ``shared.software``). A reader that
    does not know a kind rejects the envelope (rule 3 below)."""

    TASK = "task"
    UPDATE = "update"
    ACK = "ack"
    DETECTION = "detection"
    SECAGG = "secagg"
    MANIFEST = "manifest"
    RECEIPT = "receipt"
    MODEL = "model"
    HEALTH = "health"
    SOFTWARE = "software"


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
            TASK or ACK; :data:`BROADCAST_SITE_ID` for a MODEL published once for every site.
        round: federated round number (0-based), ``int``.
        base_model_hash: hex SHA-256 (64 chars) of the global model version the message refers to, or ``""``
            when it refers to none.
        kind: :class:`MessageKind`.
        sequence: per-sender message counter (non-negative ``int``); with ``site_id`` and ``round`` it makes a
            message unique, so duplicates can be detected.
        timestamp: sender's clock, Unix time in **milliseconds** (``int``).
        payload_digest: hex (64 chars) BLAKE3 hash list of the payload in pieces of ``piece_size`` bytes
            (:func:`shared.envelope.payload_digest`; :mod:`shared.envelope`).
        piece_size: bytes per piece of the payload digest, a power of two from :data:`MIN_PIECE_SIZE` (1 KiB) to
            :data:`MAX_PIECE_SIZE` (1 GiB); a chunked transfer's chunks are these pieces (:mod:`shared.transfer`).
        payload_length: payload length in bytes.

    Raises:
        UnsupportedVersionError: ``format_version`` is not :data:`FORMAT_VERSION`.
        MalformedEnvelopeError: any other field is invalid (the message names it).
    """

    format_version: int
    federation_id: str
    site_id: str
    round: int
    base_model_hash: str
    kind: MessageKind
    sequence: int
    timestamp: int
    payload_digest: str
    piece_size: int
    payload_length: int

    def __post_init__(self) -> None:
        _check_version(self.format_version)
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
        if not isinstance(self.payload_digest, str) or not _HEX64.match(self.payload_digest):
            raise MalformedEnvelopeError("payload_digest must be 64 lowercase hex characters")
        check_piece_size(self.piece_size)

    def canonical_bytes(self) -> bytes:
        """The canonical encoding that is signed: UTF-8 JSON, keys sorted, no white space.

        Headers are immutable and hashable, so the encoding of recently seen ones is kept (:func:`_canonical_bytes`,
        keyed by the fields): an update's header is encoded for its manifest's signature, its transfer id and its
        inner signature, and ``dataclasses.asdict`` (a deep copy) each time was about a tenth of the ingest thread's
        Python time in ``benchmarks/round_mqtt.py``.
        """
        return _canonical_bytes(self)

    @classmethod
    def from_canonical_bytes(cls, data: bytes) -> "EnvelopeHeader":
        """Parse a header; reject anything that is not exactly the canonical encoding.

        The format version is checked first, so that an envelope of a retired or newer format is refused as such
        (not for the fields that format has).

        Raises:
            UnsupportedVersionError: a ``format_version`` other than :data:`FORMAT_VERSION`.
            MalformedEnvelopeError: not JSON, unknown/missing fields, bad values, or not canonical.
        """
        try:
            fields = json.loads(data.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:  # ValueError: also a JSON integer of > 4300 digits
            raise MalformedEnvelopeError(f"header is not ASCII JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise MalformedEnvelopeError("header is not a JSON object")
        _check_version(fields.get("format_version"))
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


@functools.lru_cache(maxsize=4096)
def _canonical_bytes(header: EnvelopeHeader) -> bytes:
    """:meth:`EnvelopeHeader.canonical_bytes`, computed once per distinct header (equal fields, equal bytes)."""
    fields = {name: getattr(header, name) for name in header.__dataclass_fields__}
    fields["kind"] = header.kind.value
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _check_version(version: object) -> None:
    """Refuse any format but :data:`FORMAT_VERSION`, naming the version and the fix.

    Raises:
        UnsupportedVersionError: a retired, newer or missing version.
    """
    if type(version) is int and version == FORMAT_VERSION:
        return
    if type(version) is int and version in RETIRED_VERSIONS:
        raise UnsupportedVersionError(
            f"envelope format_version {version} is retired ({RETIRED_VERSIONS[version]}); this reader reads "
            f"format_version {FORMAT_VERSION} only (fix: upgrade the sender, gateway or coordinator: both sides must "
            "run the same WildFed release)")
    if type(version) is int and version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"envelope format_version {version} is newer than this reader's {FORMAT_VERSION} (fix: upgrade this "
            "side, gateway or coordinator: both sides must run the same WildFed release)")
    raise MalformedEnvelopeError(f"format_version {version!r} is not a WildFed format version (this reader reads "
                                 f"{FORMAT_VERSION})")


def check_piece_size(piece_size: object) -> int:
    """Check a piece size: an ``int`` power of two from :data:`MIN_PIECE_SIZE` to :data:`MAX_PIECE_SIZE` bytes.

    Returns:
        ``piece_size``.

    Raises:
        MalformedEnvelopeError: it is not (the message names ``piece_size`` and the allowed values).
    """
    if (type(piece_size) is not int or not MIN_PIECE_SIZE <= piece_size <= MAX_PIECE_SIZE
            or piece_size & (piece_size - 1)):
        raise MalformedEnvelopeError(f"piece_size {piece_size!r} must be a power of two from {MIN_PIECE_SIZE} to "
                                     f"{MAX_PIECE_SIZE} bytes (e.g. {DEFAULT_PIECE_SIZE})")
    return piece_size
