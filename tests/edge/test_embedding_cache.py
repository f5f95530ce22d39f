"""The gateway's embedding cache (edge_sdk/data/embedding_cache.py): hits, a miss for each key component, recompute
of only what changed, safetensors on disk, and corruption handled by recomputing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from edge_sdk.data.embedding_cache import FORMAT, NUM_SHARDS, EmbeddingCache, expected_size_bytes, shard_of

DIM = 8
BACKBONE = "efficientnet-lite0@0123456789abcdef/p1"


def _cache(root: Path, *, backbone: str = BACKBONE, size: int = 112) -> EmbeddingCache:
    return EmbeddingCache(root, backbone_id=backbone, input_size=size, dim=DIM)


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


class Counter:
    """A compute function that returns fixed rows for the positions asked and records every call."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.calls: list[list[int]] = []

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        self.calls.append([int(i) for i in idx])
        return self.values[idx]

    @property
    def computed(self) -> list[int]:
        return sorted(i for call in self.calls for i in call)


IDS = ["m1", "m2", "m3", "m4"]
BOXES = [(0, 0, 10, 10), (5, 5, 25, 25), None, (1.5, 2.5, 3.5, 4.5)]


def test_first_call_computes_all_then_a_new_instance_hits_everything(tmp_path):
    values = _rows(4)
    first = Counter(values)
    out = _cache(tmp_path).get_or_compute(IDS, BOXES, first)
    assert first.computed == [0, 1, 2, 3]
    np.testing.assert_array_equal(out, values)

    again = Counter(values * 0)  # would return zeros: proves the values come from disk
    cache = _cache(tmp_path)
    out2 = cache.get_or_compute(IDS, BOXES, again)
    assert again.calls == []
    np.testing.assert_array_equal(out2, values)
    assert (cache.stats.hits, cache.stats.misses) == (4, 0)
    assert len(cache) == 4
    assert cache.get("m3") is not None and cache.get("m3", (0, 0, 1, 1)) is None


def test_a_changed_box_recomputes_only_that_record_and_replaces_it(tmp_path):
    values = _rows(4)
    _cache(tmp_path).get_or_compute(IDS, BOXES, Counter(values))
    moved = list(BOXES)
    moved[1] = (5, 5, 25, 26)      # one pixel
    moved[2] = (0, 0, 4, 4)        # whole image -> a box
    new_values = _rows(4, seed=1)
    counter = Counter(new_values)
    out = _cache(tmp_path).get_or_compute(IDS, moved, counter)
    assert counter.computed == [1, 2]
    np.testing.assert_array_equal(out[[0, 3]], values[[0, 3]])
    np.testing.assert_array_equal(out[[1, 2]], new_values[[1, 2]])
    cache = _cache(tmp_path)
    assert len(cache) == 4                       # one slot per record: replaced, not added
    assert cache.get("m2", BOXES[1]) is None     # the old box is gone
    np.testing.assert_array_equal(cache.get("m2", moved[1]), new_values[1])


def test_a_new_record_id_is_a_miss(tmp_path):
    _cache(tmp_path).put(IDS, _rows(4), BOXES)
    counter = Counter(_rows(5, seed=2))
    _cache(tmp_path).get_or_compute(IDS + ["m5"], BOXES + [None], counter)
    assert counter.computed == [4]


@pytest.mark.parametrize("change", ["input_size", "backbone_id"])
def test_another_input_size_or_backbone_misses_everything(tmp_path, change):
    _cache(tmp_path).put(IDS, _rows(4), BOXES)
    other = (_cache(tmp_path, size=128) if change == "input_size"
             else _cache(tmp_path, backbone="efficientnet-lite0@fedcba9876543210/p1"))
    counter = Counter(_rows(4, seed=3))
    other.get_or_compute(IDS, BOXES, counter)
    assert counter.computed == [0, 1, 2, 3]
    assert other.directory != _cache(tmp_path).directory
    # the old key's entries are still there until removed
    assert len(_cache(tmp_path)) == 4
    assert other.remove_other_keys() == [_cache(tmp_path).directory]
    assert len(_cache(tmp_path)) == 0 and len(other) == 4


def test_shards_are_safetensors_with_the_documented_layout(tmp_path):
    values = _rows(4)
    cache = _cache(tmp_path)
    cache.put(IDS, values, BOXES)
    files = sorted(cache.directory.glob("shard-*.safetensors"))
    assert {f.name for f in files} == {f"shard-{shard_of(i):02x}.safetensors" for i in IDS}
    # read back with safetensors itself, and the header by hand (8-byte little-endian length + JSON)
    for f in files:
        tensors = load_file(str(f))
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        meta = header["__metadata__"]
        assert meta["format"] == FORMAT and meta["backbone_id"] == BACKBONE and meta["input_size"] == "112"
        ids = json.loads(meta["record_ids"])
        for row, rid in enumerate(ids):
            k = IDS.index(rid)
            np.testing.assert_array_equal(tensors["embeddings"][row], values[k])
            expected_box = np.full(4, np.nan) if BOXES[k] is None else np.asarray(BOXES[k], float)
            np.testing.assert_array_equal(tensors["boxes"][row], expected_box)
    assert cache.size_bytes() >= expected_size_bytes(4, DIM)


def test_shard_of_is_sha256_based_and_in_range():
    # int(first 8 hex digits, 16) % 256 is the 4th byte of the digest; and 5000 ids reach every shard
    import hashlib

    digest = hashlib.sha256(b"m1").digest()
    assert shard_of("m1") == digest[3]
    assert {shard_of(f"r{i}") for i in range(5000)} == set(range(NUM_SHARDS))


def _corrupt_variants(path: Path, how: str) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif how == "garbage":
        path.write_bytes(b"\x80\x04not safetensors at all" * 10)
    elif how == "nan":
        t = load_file(str(path))
        t["embeddings"][0, 0] = np.nan
        save_file(t, str(path), metadata=_meta(path))
    elif how == "wrong_backbone":
        meta = _meta(path)
        meta["backbone_id"] = "something-else"
        save_file(load_file(str(path)), str(path), metadata=meta)
    elif how == "wrong_shape":
        t = load_file(str(path))
        t["embeddings"] = t["embeddings"][:, :3].copy()
        save_file(t, str(path), metadata=_meta(path))


def _meta(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]


@pytest.mark.parametrize("how", ["truncated", "garbage", "nan", "wrong_backbone", "wrong_shape"])
def test_a_corrupt_shard_is_set_aside_and_only_its_records_recomputed(tmp_path, how, caplog):
    values = _rows(4)
    _cache(tmp_path).put(IDS, values, BOXES)
    victim = "m2"
    path = _cache(tmp_path).shard_path(shard_of(victim))
    _corrupt_variants(path, how)
    in_shard = [k for k, rid in enumerate(IDS) if shard_of(rid) == shard_of(victim)]

    cache = _cache(tmp_path)
    counter = Counter(values)
    with caplog.at_level(logging.WARNING, logger="edge_sdk.data.embedding_cache"):
        out = cache.get_or_compute(IDS, BOXES, counter)
    assert counter.computed == in_shard
    np.testing.assert_array_equal(out, values)
    assert cache.stats.corrupt_shards == 1
    assert any(path.name in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    assert path.with_name(path.name + ".corrupt").is_file()
    # rewritten cleanly: a fresh instance hits everything
    fresh = Counter(values)
    _cache(tmp_path).get_or_compute(IDS, BOXES, fresh)
    assert fresh.calls == []


def test_bad_input_is_refused_and_nothing_stored_is_lost(tmp_path):
    cache = _cache(tmp_path)
    cache.put(IDS, _rows(4), BOXES)
    before = {p.name: p.read_bytes() for p in cache.directory.iterdir()}
    with pytest.raises(ValueError, match="embeddings hold NaN"):
        bad = _rows(1)
        bad[0, 0] = np.inf
        cache.put(["m9"], bad)
    with pytest.raises(ValueError, match=r"boxes\[0\]"):
        cache.put(["m9"], _rows(1), [(10, 0, 5, 5)])
    with pytest.raises(ValueError, match=r"record_ids\[0\]"):
        cache.put([""], _rows(1))
    with pytest.raises(ValueError, match=r"embeddings must be \(1, 8\)"):
        cache.put(["m9"], _rows(2))
    with pytest.raises(ValueError, match="compute returned"):
        cache.get_or_compute(["m9"], None, lambda idx: np.zeros((len(idx), 3)))
    assert {p.name: p.read_bytes() for p in cache.directory.iterdir()} == before
    with pytest.raises(ValueError, match="backbone_id"):
        EmbeddingCache(tmp_path, backbone_id="", input_size=112)
