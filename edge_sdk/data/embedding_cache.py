"""The gateway's cache of backbone embeddings: each record's crop is embedded once, not every round.

An entry is keyed by four things, and is recomputed only when one of them changes:

- the **record id** (a Camtrap DP ``mediaID``, or any non-empty string that names the record at this site);
- the **crop box** ``(left, top, right, bottom)`` in image pixels that was embedded (use the integer square of
  ``shared.models.backbone.square_crop``), or None for the whole image (datasets that are already cropped);
  boxes compare exactly, as float64;
- the **input size** S of the backbone (pixels);
- the **backbone id** (``shared.models.backbone.backbone_id(backbone, S)``: the variant (Lite0, Lite1, Lite2), its
  weights' hash, the preprocessing version and the input size).

A record has one slot: putting it again with another box replaces its embedding. A different input size or
backbone id is a different directory, so changing either makes every record a miss (and
:meth:`EmbeddingCache.remove_other_keys` frees the old directories: gateway disks are small).

Layout (``root`` is typically ``<wildfed cache>/embeddings``)::

    <root>/<sha256(backbone id)[:16]>-<S>px/shard-XX.safetensors     XX = 00..ff

A record lives in shard ``int(sha256(record id)[:8], 16) % 256``, so training reads at most 256 files for any
number of records, and a write rewrites only the shards it touches. Each shard is a safetensors file (never pickle:
nothing in it can run code) holding ``embeddings`` float32 (n, D) and ``boxes`` float64 (n, 4) (a row of NaN for
"whole image"), with header metadata ``format`` (:data:`FORMAT`), ``backbone_id``, ``input_size``, ``dim`` and
``record_ids`` (a JSON list of the n ids, in row order). Shards are written to a temporary file and renamed, so a
crash never leaves a half-written shard.

Corruption: a shard that does not parse, whose metadata does not match this cache's key, whose arrays have the
wrong shape or non-finite values, or that lists a record belonging to another shard, is renamed to
``shard-XX.safetensors.corrupt`` (replacing an older one, kept for inspection), logged as one WARNING line naming
the file and the reason, and treated as empty: its records are misses and are recomputed; no other shard is lost.

One process writes a cache directory at a time (the gateway agent); readers see either the old or the new shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

__all__ = ["FORMAT", "NUM_SHARDS", "Box", "CacheStats", "EmbeddingCache", "shard_of", "expected_size_bytes"]

log = logging.getLogger(__name__)

FORMAT = "wildfed-embedding-cache/1"
NUM_SHARDS = 256
Box = tuple[float, float, float, float]


def shard_of(record_id: str) -> int:
    """The shard (0..255) that holds ``record_id``: the first 32 bits of its UTF-8 SHA-256, modulo 256."""
    return int(hashlib.sha256(record_id.encode("utf-8")).hexdigest()[:8], 16) % NUM_SHARDS


@dataclass
class CacheStats:
    """Counters since the cache was opened: ``hits`` and ``misses`` of lookups, ``written`` entries,
    ``corrupt_shards`` set aside."""

    hits: int = 0
    misses: int = 0
    written: int = 0
    corrupt_shards: int = 0


class _Corrupt(Exception):
    pass


def _box_row(box: Sequence[float] | None, field: str) -> np.ndarray:
    if box is None:
        return np.full(4, np.nan)
    row = np.asarray(box, dtype=np.float64).reshape(-1)
    if row.shape != (4,) or not np.all(np.isfinite(row)) or row[2] < row[0] or row[3] < row[1]:
        raise ValueError(f"{field} must be None (whole image) or (left, top, right, bottom) finite pixels with "
                         f"left <= right and top <= bottom, got {box!r}")
    return row


def _same_box(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b, equal_nan=True))


class EmbeddingCache:
    """Embeddings of one site's records for one backbone and input size (see the module docstring).

    Args:
        root: the cache's root folder (created on first write).
        backbone_id: ``shared.models.backbone.backbone_id(backbone, input_size)`` (or the embedder's
            ``backbone_id``).
        input_size: S in pixels.
        dim: embedding width D (1280 for every EfficientNet-Lite variant).

    Raises:
        ValueError: an empty backbone id, or a non-positive input size or dim.
    """

    def __init__(self, root: str | Path, *, backbone_id: str, input_size: int, dim: int = 1280) -> None:
        if not isinstance(backbone_id, str) or not backbone_id:
            raise ValueError("backbone_id must be a non-empty string "
                             "(shared.models.backbone.backbone_id(backbone, input_size))")
        if int(input_size) != input_size or input_size < 1 or int(dim) != dim or dim < 1:
            raise ValueError(f"input_size and dim must be positive integers, got {input_size!r} and {dim!r}")
        self.root = Path(root)
        self.backbone_id = backbone_id
        self.input_size = int(input_size)
        self.dim = int(dim)
        slug = hashlib.sha256(backbone_id.encode("utf-8")).hexdigest()[:16]
        self.directory = self.root / f"{slug}-{self.input_size}px"
        self.stats = CacheStats()
        self._shards: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}

    # ---- shards ----------------------------------------------------------------------------------------------

    def shard_path(self, shard: int) -> Path:
        """File of shard ``shard`` (0..255)."""
        return self.directory / f"shard-{shard:02x}.safetensors"

    def _read(self, shard: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        path = self.shard_path(shard)
        try:
            with safe_open(str(path), framework="np") as fh:
                meta = fh.metadata() or {}
                names = set(fh.keys())
                if names != {"embeddings", "boxes"}:
                    raise _Corrupt(f"tensors {sorted(names)}, expected ['boxes', 'embeddings']")
                embeddings = fh.get_tensor("embeddings")
                boxes = fh.get_tensor("boxes")
        except (SafetensorError, OSError, ValueError) as exc:
            raise _Corrupt(f"not a readable safetensors file ({exc})") from exc
        expected = {"format": FORMAT, "backbone_id": self.backbone_id, "input_size": str(self.input_size),
                    "dim": str(self.dim)}
        wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
        if wrong:
            raise _Corrupt(f"metadata {wrong} does not match this cache's {expected}")
        try:
            ids = json.loads(meta.get("record_ids", ""))
        except ValueError as exc:
            raise _Corrupt(f"record_ids is not JSON ({exc})") from exc
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
            raise _Corrupt("record_ids is not a list of distinct non-empty strings")
        n = len(ids)
        if embeddings.dtype != np.float32 or embeddings.shape != (n, self.dim):
            raise _Corrupt(f"embeddings {embeddings.dtype} {embeddings.shape}, expected float32 ({n}, {self.dim})")
        if boxes.dtype != np.float64 or boxes.shape != (n, 4):
            raise _Corrupt(f"boxes {boxes.dtype} {boxes.shape}, expected float64 ({n}, 4)")
        if not np.all(np.isfinite(embeddings)):
            raise _Corrupt("embeddings hold NaN or infinity")
        misplaced = [i for i in ids if shard_of(i) != shard]
        if misplaced:
            raise _Corrupt(f"records {misplaced[:3]} belong to other shards")
        return {rid: (boxes[k].copy(), embeddings[k].copy()) for k, rid in enumerate(ids)}

    def _load(self, shard: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if shard in self._shards:
            return self._shards[shard]
        path = self.shard_path(shard)
        entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if path.is_file():
            try:
                entries = self._read(shard)
            except _Corrupt as exc:
                self.stats.corrupt_shards += 1
                aside = path.with_name(path.name + ".corrupt")
                try:
                    os.replace(path, aside)
                except OSError:
                    aside = path
                log.warning("embedding cache: %s is corrupt (%s); set aside as %s, its records will be "
                            "recomputed", path, exc, aside.name)
        self._shards[shard] = entries
        return entries

    def _write(self, shard: int) -> None:
        entries = self._shards[shard]
        ids = sorted(entries)
        embeddings = (np.stack([entries[i][1] for i in ids]).astype(np.float32) if ids
                      else np.zeros((0, self.dim), np.float32))
        boxes = np.stack([entries[i][0] for i in ids]) if ids else np.zeros((0, 4), np.float64)
        meta = {"format": FORMAT, "backbone_id": self.backbone_id, "input_size": str(self.input_size),
                "dim": str(self.dim), "record_ids": json.dumps(ids)}
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".shard-{shard:02x}-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({"embeddings": np.ascontiguousarray(embeddings), "boxes": np.ascontiguousarray(boxes)}, tmp,
                      metadata=meta)
            os.replace(tmp, self.shard_path(shard))
        finally:
            Path(tmp).unlink(missing_ok=True)

    # ---- lookups ---------------------------------------------------------------------------------------------

    @staticmethod
    def _keys(record_ids: Sequence[str],
              boxes: Sequence[Sequence[float] | None] | None) -> list[tuple[str, np.ndarray]]:
        ids = list(record_ids)
        if boxes is None:
            boxes = [None] * len(ids)
        if len(boxes) != len(ids):
            raise ValueError(f"boxes has {len(boxes)} entries for {len(ids)} record_ids; give one box (or None) "
                             "per record")
        keys = []
        for k, (rid, box) in enumerate(zip(ids, boxes)):
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"record_ids[{k}] must be a non-empty string, got {rid!r}")
            keys.append((rid, _box_row(box, f"boxes[{k}]")))
        return keys

    def lookup(self, record_ids: Sequence[str],
               boxes: Sequence[Sequence[float] | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Cached embeddings of many records.

        Args:
            record_ids: N record ids.
            boxes: N crop boxes (None entries: whole image), or None for all whole images.

        Returns:
            ``(embeddings, hit)``: float32 (N, D) (rows of zeros where missing) and bool (N,) (True where the
            record is cached with the same box).

        Raises:
            ValueError: an empty or non-string id, a malformed box, or a length mismatch.
        """
        keys = self._keys(record_ids, boxes)
        out = np.zeros((len(keys), self.dim), np.float32)
        hit = np.zeros(len(keys), bool)
        for k, (rid, box) in enumerate(keys):
            entry = self._load(shard_of(rid)).get(rid)
            if entry is not None and _same_box(entry[0], box):
                out[k] = entry[1]
                hit[k] = True
        self.stats.hits += int(hit.sum())
        self.stats.misses += int((~hit).sum())
        return out, hit

    def get(self, record_id: str, box: Sequence[float] | None = None) -> np.ndarray | None:
        """The cached float32 (D,) embedding of one record with this box, or None."""
        emb, hit = self.lookup([record_id], [box])
        return emb[0] if hit[0] else None

    def put(self, record_ids: Sequence[str], embeddings: np.ndarray,
            boxes: Sequence[Sequence[float] | None] | None = None) -> None:
        """Store (or replace) the embeddings of records; writes each touched shard once.

        Args:
            record_ids: N ids (a repeated id keeps its last row).
            embeddings: float (N, D), finite.
            boxes: as in :meth:`lookup`.

        Raises:
            ValueError: wrong shape, non-finite values, or bad ids/boxes (nothing is written then).
        """
        keys = self._keys(record_ids, boxes)
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.shape != (len(keys), self.dim):
            raise ValueError(f"embeddings must be ({len(keys)}, {self.dim}), got {emb.shape}")
        if not np.all(np.isfinite(emb)):
            raise ValueError("embeddings hold NaN or infinity; nothing was stored")
        touched = set()
        for (rid, box), row in zip(keys, emb):
            shard = shard_of(rid)
            self._load(shard)[rid] = (box, row.copy())
            touched.add(shard)
        for shard in sorted(touched):
            self._write(shard)
        self.stats.written += len(keys)

    def get_or_compute(self, record_ids: Sequence[str], boxes: Sequence[Sequence[float] | None] | None,
                       compute: Callable[[np.ndarray], np.ndarray], *, chunk: int = 256) -> np.ndarray:
        """Embeddings of every record, computing only the misses and caching them.

        Args:
            record_ids, boxes: as in :meth:`lookup`.
            compute: given int64 positions into ``record_ids`` (at most ``chunk`` at a time), returns their
                embeddings float (len, D) in that order.
            chunk: misses per ``compute`` call (each chunk is stored before the next is computed, so an
                interrupted run keeps what it finished).

        Returns:
            float32 (N, D).

        Raises:
            ValueError: as :meth:`lookup`, or ``compute`` returned the wrong shape.
        """
        ids = list(record_ids)
        box_list = list(boxes) if boxes is not None else [None] * len(ids)
        out, hit = self.lookup(ids, box_list)
        missing = np.flatnonzero(~hit)
        for start in range(0, missing.size, max(1, int(chunk))):
            idx = missing[start:start + max(1, int(chunk))]
            values = np.asarray(compute(idx), dtype=np.float32)
            if values.shape != (idx.size, self.dim):
                raise ValueError(f"compute returned {values.shape} for {idx.size} records, expected "
                                 f"({idx.size}, {self.dim})")
            self.put([ids[i] for i in idx], values, [box_list[i] for i in idx])
            out[idx] = values
        return out

    # ---- housekeeping ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of cached records (reads every shard)."""
        return sum(len(self._load(s)) for s in range(NUM_SHARDS))

    def size_bytes(self) -> int:
        """Bytes on disk of this key's shard files."""
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.glob("shard-*.safetensors"))

    def remove_other_keys(self) -> list[Path]:
        """Delete the directories of other backbone ids or input sizes under ``root``; returns what was removed."""
        removed = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.is_dir() and path != self.directory and path.name.endswith("px"):
                    shutil.rmtree(path)
                    removed.append(path)
        return removed


def expected_size_bytes(records: int, dim: int = 1280) -> int:
    """Lower bound of the cache's size on disk for ``records`` entries: float32 embeddings plus float64 boxes
    (``records * (4 * dim + 32)`` bytes), without the headers' record-id lists."""
    return int(records) * (4 * int(dim) + 32)

