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

One module per part: :mod:`~shared.transfer.wire` (chunk, manifest and receipt formats, transfer ids,
:class:`TransferError`), :mod:`~shared.transfer.pieces` (chunk and piece sizes), :mod:`~shared.transfer.sending`
(split, send, :class:`ResendTracker`), :mod:`~shared.transfer.receiving` (chunk checks and reassembly). Import the
names from here.
"""

from __future__ import annotations

from shared.transfer.pieces import DEFAULT_CHUNK_SIZE, piece_size_for
from shared.transfer.receiving import Reassembly, assemble, check_chunk, check_manifest_header, verify_manifest
from shared.transfer.sending import ResendTracker, chunks_to_send, send, split
from shared.transfer.wire import (CHUNK_HEADER_LENGTH, CHUNK_MAGIC, MAX_CHUNKS, NO_TRANSFER, TRANSFER_ID_CONTEXT, Chunk,
                                  Manifest, Receipt, TransferError, decode_manifest, decode_receipt, encode_manifest,
                                  encode_receipt, is_chunk, seal_manifest, transfer_id_of)

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
