"""Piece and chunk sizes of a chunked transfer: the default and smallest chunk, and the piece size a sender seals
with so that its envelope's pieces are its chunks (:mod:`shared.transfer`)."""

from __future__ import annotations

from shared.envelope import DEFAULT_PIECE_SIZE, MAX_PIECE_SIZE, MIN_PIECE_SIZE
from shared.transfer.wire import TransferError

DEFAULT_CHUNK_SIZE = DEFAULT_PIECE_SIZE
"""Chunk size in bytes when the config gives none (= the envelope's default piece size, 256 KiB)."""
MIN_CHUNK_SIZE = MIN_PIECE_SIZE


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
