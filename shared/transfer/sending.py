"""The sending side of a chunked transfer: split an envelope into its manifest and chunks, publish them (or only
the chunks a receipt lists as missing), and notice a chunk that keeps not getting through (:class:`ResendTracker`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import envelope as _envelope
from shared.envelope import Envelope, payload_leaves
from shared.transfer.pieces import DEFAULT_CHUNK_SIZE, piece_size_for
from shared.transfer.wire import MAX_CHUNKS, Chunk, Manifest, TransferError, seal_manifest


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
