"""Chunked, resumable transfer of large envelopes (model updates up, tasks down) over MQTT.

A signed envelope larger than the chunk size (default 256 KiB, well under EMQX's 1 MB default packet limit and
Mosquitto's ``message_size_limit``) does not travel as one MQTT message. The sender splits the envelope's wire
bytes (the *inner* envelope, signature included) into chunks and publishes, on the same topic:

1. a **manifest**: an envelope of kind ``MANIFEST`` signed by the sender, with the inner envelope's federation,
   site, round, base model hash and sequence in its header and, as payload, :class:`Manifest`: the transfer id
   (SHA-256 of the inner bytes), the total length, the chunk size and the SHA-256 of every chunk;
2. the chunks, each ``b"WFC1" | transfer id (32 raw bytes) | index (uint32 BE) | data``.

A chunk is not signed by itself: it is authenticated by its digest in the signed manifest, and the reassembled
bytes by the transfer id, so nothing unauthenticated is ever parsed beyond the fixed 40-byte chunk header. The
receiver keeps the chunks it has (the coordinator durably, :mod:`coordinator.transfers`), answers a repeated
manifest with a signed ``RECEIPT`` that lists the chunks still missing, and the sender then sends only those: a
transfer resumes after a reconnect instead of starting over. Transfers not completed within their time to live
expire (receiver side).

The pattern is that of resumable uploads with a signed manifest of per-part digests (e.g. BitTorrent's piece
hashes in a signed metainfo, BEP 3; tus.io's offset-based resume), reduced to what an MQTT QoS 1 link needs.

Size limits are checked before anything is parsed: a chunk longer than the manifest's chunk size plus its header,
a manifest announcing more than the receiver's limit, or more than :data:`MAX_CHUNKS` chunks is refused.

A broker drops a message over its size limit, and a QoS 1 publisher may never learn it (Mosquitto's
``message_size_limit`` acknowledges and drops; EMQX drops; Mosquitto's ``max_packet_size`` disconnects the sender,
which reconnects and sends the same chunk again). The chunk size is therefore checked against the broker's limit
when a config is loaded (``shared.broker.check_chunk_fits``), :func:`send` refuses a message over
``max_message_bytes`` before publishing anything, and a chunk the receiver keeps asking for after it was sent
(:class:`ResendTracker` for uploads; stalled downloads are counted by the gateway agent) makes the gateway give the
transfer up with an error naming the chunk size instead of retrying forever.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.codec import decode_tensors, encode_tensors
from shared.envelope import Envelope, EnvelopeHeader, MessageKind, seal
from shared.errors import EnvelopeError, PayloadError

__all__ = [
    "CHUNK_MAGIC",
    "CHUNK_HEADER_LENGTH",
    "DEFAULT_CHUNK_SIZE",
    "MAX_CHUNKS",
    "TransferError",
    "Manifest",
    "Chunk",
    "Receipt",
    "is_chunk",
    "split",
    "seal_manifest",
    "encode_manifest",
    "decode_manifest",
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

CHUNK_MAGIC = b"WFC1"
CHUNK_HEADER_LENGTH = 4 + 32 + 4
"""Bytes before a chunk's data: magic, raw transfer id, index."""
DEFAULT_CHUNK_SIZE = 256 * 1024
"""Chunk size in bytes when the config gives none."""
MIN_CHUNK_SIZE = 1024
MAX_CHUNKS = 1 << 16
"""At most 65,536 chunks per transfer (16 GiB at the default chunk size)."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_METADATA_KEY = "wildfed"


class TransferError(EnvelopeError):
    """A manifest, chunk or receipt that must be refused; ``reason`` is a short tag for counts and logs."""

    def __init__(self, message: str, reason: str = "bad_chunk") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Manifest:
    """What a MANIFEST envelope promises about the transfer that follows.

    Attributes:
        transfer_id: hex SHA-256 (64 chars) of the inner envelope's wire bytes.
        kind: the inner envelope's kind (``update`` upstream, ``task`` downstream).
        total_length: inner envelope length in bytes (>= 1).
        chunk_size: bytes per chunk (every chunk but the last has exactly this many).
        chunk_sha256: hex SHA-256 of each chunk's data, in index order; ``ceil(total_length / chunk_size)`` of them.
        resume: False when the chunks follow the manifest at once (first send); True when the sender asks where to
            resume (after a reconnect or a timeout): the receiver then always answers with a :class:`Receipt`.

    Raises:
        TransferError: inconsistent or out-of-range fields (reason ``bad_manifest``).
    """

    transfer_id: str
    kind: MessageKind
    total_length: int
    chunk_size: int
    chunk_sha256: tuple[str, ...]
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.resume, bool):
            raise TransferError("manifest resume must be true or false", "bad_manifest")
        if not isinstance(self.transfer_id, str) or not _HEX64.match(self.transfer_id):
            raise TransferError("manifest transfer_id must be 64 lowercase hex characters", "bad_manifest")
        try:
            object.__setattr__(self, "kind", MessageKind(self.kind))
        except ValueError:
            raise TransferError(f"manifest kind {self.kind!r} is not a message kind", "bad_manifest") from None
        for name in ("total_length", "chunk_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise TransferError(f"manifest {name} must be a positive integer, got {value!r}", "bad_manifest")
        if self.chunk_size < MIN_CHUNK_SIZE:
            raise TransferError(f"manifest chunk_size {self.chunk_size} is below {MIN_CHUNK_SIZE} bytes",
                                "bad_manifest")
        digests = tuple(self.chunk_sha256) if isinstance(self.chunk_sha256, (list, tuple)) else None
        if digests is None or not all(isinstance(d, str) and _HEX64.match(d) for d in digests):
            raise TransferError("manifest chunk_sha256 must be a list of 64-hex digests", "bad_manifest")
        object.__setattr__(self, "chunk_sha256", digests)
        if len(digests) != self.num_chunks:
            raise TransferError(f"manifest lists {len(digests)} chunk digests, {self.total_length} bytes in "
                                f"chunks of {self.chunk_size} make {self.num_chunks}", "bad_manifest")
        if self.num_chunks > MAX_CHUNKS:
            raise TransferError(f"manifest announces {self.num_chunks} chunks, more than {MAX_CHUNKS}", "oversized")

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
    """One piece of a transfer: ``data`` is bytes ``[index * chunk_size, ...)`` of the inner envelope."""

    transfer_id: str
    index: int
    data: bytes

    def to_bytes(self) -> bytes:
        """Wire form: ``b"WFC1" | transfer id (32 raw bytes) | index (uint32 BE) | data``."""
        return CHUNK_MAGIC + bytes.fromhex(self.transfer_id) + struct.pack(">I", self.index) + self.data

    @classmethod
    def from_bytes(cls, raw: bytes, *, max_data_bytes: int) -> "Chunk":
        """Parse a chunk; the length is checked before anything else.

        Args:
            raw: the MQTT payload. max_data_bytes: the largest chunk data the receiver accepts.

        Raises:
            TransferError: too long (``oversized``), too short or bad magic (``bad_chunk``).
        """
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise TransferError(f"chunk must be bytes, got {type(raw).__name__}")
        if len(raw) > CHUNK_HEADER_LENGTH + max_data_bytes:
            raise TransferError(f"chunk of {len(raw)} bytes exceeds the limit of {max_data_bytes} data bytes",
                                "oversized")
        if len(raw) <= CHUNK_HEADER_LENGTH or bytes(raw[:4]) != CHUNK_MAGIC:
            raise TransferError("not a WildFed chunk (bad magic or no data)")
        raw = bytes(raw)
        (index,) = struct.unpack(">I", raw[36:40])
        return cls(transfer_id=raw[4:36].hex(), index=index, data=raw[CHUNK_HEADER_LENGTH:])


@dataclass(frozen=True)
class Receipt:
    """A receiver's signed answer to a repeated manifest: which chunks of ``transfer_id`` it still lacks.

    Attributes:
        transfer_id: hex SHA-256 of the inner envelope.
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
    """Whether an MQTT payload claims to be a chunk (its first four bytes are :data:`CHUNK_MAGIC`)."""
    return len(raw) >= 4 and bytes(raw[:4]) == CHUNK_MAGIC


def split(inner: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE, *, kind: MessageKind | str) -> tuple[Manifest, list[Chunk]]:
    """Split an inner envelope's wire bytes into a manifest and its chunks.

    Args:
        inner: the signed envelope bytes (``Envelope.to_bytes()``). chunk_size: bytes per chunk (>= 1024).
        kind: the inner envelope's kind.

    Raises:
        TransferError: empty input, chunk size below 1 KiB or more than :data:`MAX_CHUNKS` chunks.
    """
    inner = bytes(inner)
    if not inner:
        raise TransferError("nothing to transfer", "bad_manifest")
    pieces = [inner[i:i + chunk_size] for i in range(0, len(inner), max(int(chunk_size), 1))]
    transfer_id = hashlib.sha256(inner).hexdigest()
    manifest = Manifest(transfer_id=transfer_id, kind=MessageKind(kind), total_length=len(inner),
                        chunk_size=int(chunk_size), chunk_sha256=tuple(hashlib.sha256(p).hexdigest() for p in pieces))
    return manifest, [Chunk(transfer_id, i, p) for i, p in enumerate(pieces)]


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
    """Payload of a MANIFEST envelope (safetensors with the manifest as JSON metadata, like every payload)."""
    return _metadata_payload({"transfer_id": manifest.transfer_id, "kind": manifest.kind.value,
                              "total_length": manifest.total_length, "chunk_size": manifest.chunk_size,
                              "chunk_sha256": list(manifest.chunk_sha256), "resume": manifest.resume})


def decode_manifest(payload: bytes) -> Manifest:
    """Inverse of :func:`encode_manifest`.

    Raises:
        TransferError: malformed payload or inconsistent fields (``bad_manifest``, ``oversized``).
    """
    body = _read_body(payload, {"transfer_id", "kind", "total_length", "chunk_size", "chunk_sha256", "resume"},
                      "manifest")
    if not isinstance(body["chunk_sha256"], list):
        raise TransferError("manifest chunk_sha256 must be a list", "bad_manifest")
    return Manifest(transfer_id=body["transfer_id"], kind=body["kind"], total_length=body["total_length"],
                    chunk_size=body["chunk_size"], chunk_sha256=tuple(body["chunk_sha256"]), resume=body["resume"])


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


def seal_manifest(*, private_key: Ed25519PrivateKey, inner: EnvelopeHeader, manifest: Manifest,
                  resume: bool = False) -> Envelope:
    """Sign a MANIFEST envelope for the inner envelope ``inner``: same federation, site, round, base model hash
    and sequence (so the manifest alone can be checked against the open round before any chunk is stored).

    Raises:
        MalformedEnvelopeError: a header field is invalid.
    """
    return seal(private_key=private_key, federation_id=inner.federation_id, site_id=inner.site_id, round=inner.round,
                base_model_hash=inner.base_model_hash, kind=MessageKind.MANIFEST, sequence=inner.sequence,
                payload=encode_manifest(replace(manifest, resume=resume)))


def check_chunk(manifest: Manifest, chunk: Chunk) -> None:
    """Check a chunk against its (verified) manifest: same transfer, index in range, exact length, digest.

    Raises:
        TransferError: reason ``bad_chunk`` (index or length) or ``chunk_digest`` (data altered).
    """
    if chunk.transfer_id != manifest.transfer_id:
        raise TransferError(f"chunk of transfer {chunk.transfer_id[:12]} checked against {manifest.transfer_id[:12]}")
    if not 0 <= chunk.index < manifest.num_chunks:
        raise TransferError(f"chunk index {chunk.index} outside 0..{manifest.num_chunks - 1}")
    if len(chunk.data) != manifest.chunk_length(chunk.index):
        raise TransferError(f"chunk {chunk.index} has {len(chunk.data)} bytes, the manifest says "
                            f"{manifest.chunk_length(chunk.index)}")
    if hashlib.sha256(chunk.data).hexdigest() != manifest.chunk_sha256[chunk.index]:
        raise TransferError(f"chunk {chunk.index} does not match its digest in the signed manifest", "chunk_digest")


def assemble(manifest: Manifest, pieces: Sequence[bytes]) -> bytes:
    """Join the chunks' data (in index order) and check the whole against the transfer id.

    Raises:
        TransferError: wrong number of pieces or the joined bytes differ from what the manifest names.
    """
    if len(pieces) != manifest.num_chunks:
        raise TransferError(f"{len(pieces)} of {manifest.num_chunks} chunks to assemble", "incomplete")
    inner = b"".join(pieces)
    if len(inner) != manifest.total_length or hashlib.sha256(inner).hexdigest() != manifest.transfer_id:
        raise TransferError("reassembled bytes differ from the signed transfer id", "chunk_digest")
    return inner


@dataclass
class Reassembly:
    """An in-memory reassembly (the gateway's side of a download; the coordinator stages uploads durably).

    Args:
        manifest: the verified manifest. envelope: the MANIFEST envelope it came in (header: round, site, ...).
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

    def assemble(self) -> bytes:
        """The inner envelope bytes (see :func:`assemble`)."""
        return assemble(self.manifest, [self.pieces[i] for i in range(self.manifest.num_chunks)])


def chunks_to_send(chunks: Iterable[Chunk], missing: Iterable[int] | None) -> list[Chunk]:
    """The chunks a sender (re)sends: all of them, or those whose index is in ``missing``."""
    if missing is None:
        return list(chunks)
    wanted = set(missing)
    return [c for c in chunks if c.index in wanted]


def send(publish: Callable[[str, bytes], None], topic: str, inner: bytes, *, private_key: Ed25519PrivateKey,
         chunk_size: int = DEFAULT_CHUNK_SIZE, resume: bool = False, missing: Iterable[int] | None = None,
         max_message_bytes: int | None = None, on_chunk: Callable[[str, int], None] | None = None,
         on_probe: Callable[[str], None] | None = None) -> int:
    """Publish a signed envelope whole when it fits in one chunk, else as a manifest and its chunks.

    Args:
        publish: ``publish(topic, payload)``; raises the transport's error when the broker does not take it.
        topic: where to publish. inner: the signed envelope's wire bytes. private_key: the sender's key (signs the
            manifest). chunk_size: bytes per chunk.
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
        TransferError: bad chunk size, or a manifest or chunk over ``max_message_bytes`` (reason ``oversized``;
            the message names ``chunk_size_bytes``). Whatever ``publish`` raises.
    """
    def check(payload: bytes, what: str) -> bytes:
        if max_message_bytes is not None and len(payload) > max_message_bytes:
            raise TransferError(f"{what} of {len(payload)} bytes exceeds the broker's limit of {max_message_bytes} "
                                f"bytes: the broker would drop it; change chunk_size_bytes (now {chunk_size}) so "
                                "that chunks, and the manifest listing one digest per chunk, fit", "oversized")
        return payload

    if len(inner) <= chunk_size and not resume and missing is None:
        publish(topic, check(inner, "message"))
        return 1
    header = Envelope.from_bytes(inner).header
    manifest, chunks = split(inner, chunk_size, kind=header.kind)
    if max_message_bytes is not None and chunks:
        check(chunks[0].to_bytes(), "a chunk")
    sent = 0
    if missing is None:
        publish(topic, check(seal_manifest(private_key=private_key, inner=header, manifest=manifest,
                                           resume=resume).to_bytes(), f"the manifest of {manifest.num_chunks} chunks"))
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
