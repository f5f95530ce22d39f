"""Where the chunks of an upload wait until the last one is in: memory first, files past a limit.

:class:`ChunkStaging` keeps the data of each transfer in progress (coordinator.inbound.transfers) either

* in memory: a transfer of at most ``spill_above_bytes`` is admitted to memory when its announced size fits in
  what is left of ``memory_limit_bytes`` (the sizes of the transfers admitted before and not yet finished are
  reserved). No file is written, listed, read back or removed per chunk, and the transfer needs no database row.
  A coordinator restart forgets it; the gateway's next resume manifest is then answered with a receipt listing
  every chunk, and it sends them again (a few MiB over a link that just carried them). Or
* on disk ("spilled"): a transfer larger than ``spill_above_bytes``, or one announced while the memory is reserved
  by others. Its manifest is recorded in the database (``transfers`` table, by the receiver), so after a restart its
  receipt lists exactly the chunks still missing. Its folder ``<data_dir>/transfers/<transfer id>/`` holds two
  files: ``chunks``, the inner envelope's payload, each chunk written in place at ``index * chunk_size`` (one
  ``pwrite``), and ``held``, an append-only log of the indices written (4 bytes each, big-endian, appended after
  the chunk's data). Nothing is fsync-ed, renamed or listed per chunk: the chunk digests of pieces staged by an
  earlier process are checked again at assembly (coordinator.inbound.transfers), so a chunk torn by a power cut, or an
  index logged before its data reached the disk, is simply asked for again; a torn last record of the log is
  ignored. Assembly reads ``chunks`` once. (A file per chunk, created, renamed, listed, read and removed, cost
  about a third of the ingest thread's time in ``benchmarks/load_200.py``, where 200 uploads arrive at once and
  most spill.)

Why reserve at the manifest rather than fill memory chunk by chunk: when many gateways upload at once (200 in
``benchmarks/load_200.py``), their chunks arrive interleaved; filled chunk by chunk, the memory would hold a few
chunks of every transfer and every transfer would end up on disk. Reserved, the first transfers stay wholly in
memory and only the rest pay for files, and the memory held never passes the limit. A transfer abandoned half way
keeps its reservation until it expires (``transfer.ttl_s``); meanwhile new transfers are staged on disk, as before
this module.

Which chunks a transfer holds is kept in memory (a set per transfer); the folder of a spilled transfer is listed
once, when a restarted process meets the transfer again, never per chunk.

Several ingest workers (``shared=True``, coordinator.inbound.workers): an MQTT shared subscription hands each message to
one member of the group, so the chunks of one transfer are spread over the workers; only the shared folder, which
every worker lists, can tell when the last one is in. Staging is then on disk for every transfer, one file per chunk
(``<transfer id>/<index>.part``, complete under its final name: temporary file + rename), and the folder is listed
at each chunk, as before this module (the guarantee of the multi-worker deployment is kept: any worker that receives
a transfer's last chunk assembles it).
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["ChunkStaging", "StagingLimits"]

log = logging.getLogger(__name__)

_DATA = "chunks"
"""A spilled transfer's data file (single process): the inner envelope's payload, chunk ``i`` at ``i * chunk_size``."""
_HELD = "held"
"""A spilled transfer's log of the chunk indices written to :data:`_DATA` (4-byte big-endian unsigned each)."""
_INDEX = struct.Struct(">I")


@dataclass(frozen=True)
class StagingLimits:
    """How much chunk data waits in memory (``transfer:`` in the coordinator config).

    Attributes:
        memory_limit_bytes: announced bytes of the transfers held in memory, all together (>= 0; 0 stages
            everything on disk).
        spill_above_bytes: a transfer announcing more bytes than this is staged on disk from its first chunk, so it
            resumes across a coordinator restart (>= 0).

    Raises:
        ConfigError: a negative or non-integer value (names ``transfer.<field>`` and the fix).
    """

    memory_limit_bytes: int = 256 << 20
    spill_above_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("memory_limit_bytes", "spill_above_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} is {value!r}", field=f"transfer.{name}",
                                  fix="give a whole number of bytes >= 0 (e.g. 268435456 for 256 MiB)")


@dataclass
class _Transfer:
    """One transfer's staged chunks: in memory (``chunks``; ``reserved`` bytes counted against the limit) or on disk
    (``files``: the indices of the chunks written; ``chunk_size``: their stride in the data file)."""

    num_chunks: int
    on_disk: bool
    chunk_size: int = 0
    total_length: int = 0
    reserved: int = 0
    chunks: dict[int, bytes] = field(default_factory=dict)
    files: set[int] = field(default_factory=set)


class ChunkStaging:
    """The chunks of transfers in progress (see the module docstring). Not thread-safe: the receiver's lock guards
    it.

    Args:
        folder: the staging folder (``<data_dir>/transfers``).
        limits: :class:`StagingLimits`.
        shared: several ingest workers share ``folder``: every transfer on disk, held chunks listed from it.
    """

    def __init__(self, folder: Path, limits: StagingLimits | None = None, *, shared: bool = False) -> None:
        self.folder = Path(folder)
        self.limits = limits or StagingLimits()
        self.shared = shared
        self._transfers: dict[str, _Transfer] = {}
        self.memory_bytes = 0
        """Chunk bytes held in memory now, over all transfers."""
        self.reserved_bytes = 0
        """Announced bytes of the transfers admitted to memory and not finished (<= ``memory_limit_bytes``)."""
        self.spills = 0
        """Transfers of at most ``spill_above_bytes`` staged on disk because the memory was reserved by others."""

    # ---- transfers ---------------------------------------------------------------------------------------------
    def begin(self, transfer_id: str, *, total_length: int, num_chunks: int, chunk_size: int,
              known_on_disk: bool = False) -> bool:
        """Track a transfer (no-op if tracked already), in memory if its size fits what is left unreserved.

        Args:
            transfer_id: the transfer id (64 hex digits). total_length: its announced bytes. num_chunks: its chunk
                count. chunk_size: bytes per chunk but the last (the manifest's; where chunk ``i`` starts is
                ``i * chunk_size``).
            known_on_disk: the transfer has a database row from an earlier process or another worker: its chunks may
                be in its folder already (listed once now); it stays on disk.

        Returns:
            whether the transfer is staged on disk (then its manifest must be recorded in the database).
        """
        t = self._transfers.get(transfer_id)
        if t is not None:
            return t.on_disk
        memory = (not self.shared and not known_on_disk and total_length <= self.limits.spill_above_bytes
                  and self.reserved_bytes + total_length <= self.limits.memory_limit_bytes)
        if memory:
            t = _Transfer(num_chunks=num_chunks, on_disk=False, reserved=total_length)
            self.reserved_bytes += total_length
        else:
            t = _Transfer(num_chunks=num_chunks, on_disk=True, chunk_size=chunk_size, total_length=total_length)
            if not self.shared and not known_on_disk and total_length <= self.limits.spill_above_bytes:
                self.spills += 1
                log.info("staging: %d of %d bytes of memory reserved: transfer %s (%d bytes) is staged on disk",
                         self.reserved_bytes, self.limits.memory_limit_bytes, transfer_id[:12], total_length)
        self._transfers[transfer_id] = t
        if t.on_disk and not self.shared:
            t.files = self._list(transfer_id)
        return t.on_disk

    def tracks(self, transfer_id: str) -> bool:
        """Whether this process stages ``transfer_id``."""
        return transfer_id in self._transfers

    def on_disk(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` is staged on disk (False also when it is not tracked)."""
        t = self._transfers.get(transfer_id)
        return t is not None and t.on_disk

    def transfer_ids(self) -> list[str]:
        """The tracked transfers."""
        return list(self._transfers)

    # ---- chunks ------------------------------------------------------------------------------------------------
    def put(self, transfer_id: str, index: int, data: bytes) -> None:
        """Keep chunk ``index`` (already checked against its manifest: its length is the announced one, so a
        transfer in memory never holds more than it reserved); a chunk held already is not written again.

        Raises:
            KeyError: the transfer is not tracked (:meth:`begin` first).
            OSError: a chunk file could not be written.
        """
        t = self._transfers[transfer_id]
        if not t.on_disk:
            if index not in t.chunks:
                t.chunks[index] = data
                self.memory_bytes += len(data)
            return
        if self.shared or index not in t.files:
            self._write(transfer_id, index, data)
            t.files.add(index)

    def held(self, transfer_id: str) -> set[int]:
        """Indices of the chunks held (a new set; empty for an untracked transfer). Shared staging lists the
        folder (other workers add to it); otherwise no file system call."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return set()
        if not t.on_disk:
            return set(t.chunks)
        if self.shared:
            t.files = self._list(transfer_id)
        return set(t.files)

    def count(self, transfer_id: str) -> int:
        """Number of chunks held (see :meth:`held`)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return 0
        if not t.on_disk:
            return len(t.chunks)
        if self.shared:
            t.files = self._list(transfer_id)
        return len(t.files)

    def pieces(self, transfer_id: str) -> list[bytes] | None:
        """Every chunk's data in index order, or None when one is missing (e.g. another worker assembled the
        transfer and removed its folder)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return None
        if not t.on_disk:
            if len(t.chunks) < t.num_chunks:
                return None
            return [t.chunks[i] for i in range(t.num_chunks)]
        folder = self.folder / transfer_id
        if not self.shared:
            if len(t.files) < t.num_chunks:
                return None
            try:
                with open(folder / _DATA, "rb") as fh:
                    data = memoryview(fh.read())
            except FileNotFoundError:
                return None
            if len(data) != t.total_length:  # cut short (a power cut): every piece is checked again at assembly
                data = memoryview(bytes(data[:t.total_length]).ljust(t.total_length, b"\0"))
            return [data[i * t.chunk_size:min((i + 1) * t.chunk_size, t.total_length)] for i in range(t.num_chunks)]
        try:
            return [(folder / f"{i}.part").read_bytes() for i in range(t.num_chunks)]
        except FileNotFoundError:
            return None

    def discard(self, transfer_id: str, index: int) -> None:
        """Forget one chunk (it did not match its digest at assembly: the site sends it again)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        data = t.chunks.pop(index, None)
        if data is not None:
            self.memory_bytes -= len(data)
        if index in t.files:
            t.files.discard(index)
            if t.on_disk and not self.shared:  # the log is rewritten without it (rare: a torn chunk)
                self._rewrite_held(transfer_id, t.files)
        if self.shared:
            (self.folder / transfer_id / f"{index}.part").unlink(missing_ok=True)

    def drop(self, transfer_id: str) -> None:
        """Forget a transfer: its memory and reservation are freed and its folder removed (also for an untracked
        id's folder)."""
        t = self._transfers.pop(transfer_id, None)
        if t is not None:
            self.memory_bytes -= sum(len(d) for d in t.chunks.values())
            self.reserved_bytes -= t.reserved
            if not t.on_disk:
                return
        shutil.rmtree(self.folder / transfer_id, ignore_errors=True)

    # ---- files -------------------------------------------------------------------------------------------------
    def _write(self, transfer_id: str, index: int, data: bytes) -> None:
        folder = self.folder / transfer_id
        if not self.shared:  # the chunk in place in the data file, then its index in the log
            t = self._transfers[transfer_id]
            try:
                fd = os.open(folder / _DATA, os.O_WRONLY | os.O_CREAT, 0o600)
            except FileNotFoundError:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(folder / _DATA, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                view, offset = memoryview(data), index * t.chunk_size
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            finally:
                os.close(fd)
            fd = os.open(folder / _HELD, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, _INDEX.pack(index))
            finally:
                os.close(fd)
            return
        path = folder / f"{index}.part"
        if self.shared and path.exists():
            return
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _rewrite_held(self, transfer_id: str, held: set[int]) -> None:
        folder = self.folder / transfer_id
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"".join(_INDEX.pack(i) for i in sorted(held)))
        os.replace(tmp, folder / _HELD)

    def _list(self, transfer_id: str) -> set[int]:
        """The chunks held on disk in this staging's layout (see :meth:`on_disk_chunks`)."""
        t = self._transfers.get(transfer_id)
        return self.on_disk_chunks(transfer_id, shared=self.shared, num_chunks=t.num_chunks if t else None)

    def on_disk_chunks(self, transfer_id: str, *, shared: bool | None = None,
                       num_chunks: int | None = None) -> set[int]:
        """Indices of the chunks of ``transfer_id`` found on disk, without tracking it (e.g. for a status listing
        of transfers recorded by another process).

        Args:
            shared: which layout to read: ``False`` the index log of a single process's spilled transfer (a torn
                last record ignored), ``True`` the chunk files of shared staging; ``None`` (default) the log where
                one exists, else the chunk files.
            num_chunks: indices at or above it are ignored (``None``: none are).
        """
        folder = self.folder / transfer_id
        if shared is None:
            shared = not (folder / _HELD).exists()
        if not shared:
            try:
                log_bytes = (folder / _HELD).read_bytes()
            except FileNotFoundError:
                return set()
            n = len(log_bytes) // _INDEX.size
            limit = num_chunks if num_chunks is not None else 1 << 32
            return {i for (i,) in _INDEX.iter_unpack(log_bytes[:n * _INDEX.size]) if i < limit}
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return set()
        return {i for i in (int(n[:-5]) for n in names if n.endswith(".part") and n[:-5].isdigit())
                if num_chunks is None or i < num_chunks}
