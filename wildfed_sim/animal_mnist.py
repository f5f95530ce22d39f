"""Animal-MNIST: the real images behind the WildFed demo, fetched safely.

Source: the PyPI distribution ``animal-mnist==0.4`` (10,000 grayscale 28x28 silhouettes cut from real photos,
10 classes, 1,000 per class). That distribution depends on TensorFlow and stores its arrays as gzipped pickles,
so WildFed never installs it. Instead, on first use:

1. ``python -m pip download --no-deps animal-mnist==0.4 -d <cache>`` fetches the wheel into the cache
   (``$WILDFED_CACHE`` if set, else ``~/.cache/wildfed/``);
2. the wheel's SHA-256 is checked against :data:`WHEEL_SHA256` (a mismatch deletes the file and raises);
3. ``animal_mnist/data/Animal_MNIST/animal_{data,label}_version_3.gz`` are read straight from the wheel zip with
   :class:`NumpyOnlyUnpickler`, which admits numpy's ndarray reconstruction and nothing else: no other global can
   be named by the pickle, so a tampered file cannot run code.

The class order (labels 0-9: bear, bird, cat, cow, dog, elephant, giraffe, horse, sheep, zebra) was confirmed by
rendering a labelled grid of the images (see ``docs/demo-data.md``). :data:`SPECIES_TABLE` maps each class to the
species it stands for in the demo and that species' IUCN Red List category (the public attribute that decides a
record's CCDP budget); it lives in :mod:`wildfed_sim.animal_species`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import WildFedError

from wildfed_sim.animal_species import CLASS_NAMES, NUM_CLASSES, SPECIES_TABLE, SpeciesEntry, SpeciesTable

__all__ = [
    "CLASS_NAMES",
    "DATA_MEMBER",
    "IMAGE_SHAPE",
    "LABEL_MEMBER",
    "NUM_CLASSES",
    "PACKAGE_SPEC",
    "SPECIES_TABLE",
    "WHEEL_FILENAME",
    "WHEEL_SHA256",
    "AnimalMNIST",
    "AnimalMNISTError",
    "DatasetFetchError",
    "DatasetIntegrityError",
    "NumpyOnlyUnpickler",
    "SpeciesEntry",
    "SpeciesTable",
    "UnsafePickleError",
    "default_cache_dir",
    "fetch_animal_mnist",
    "load_animal_mnist_wheel",
    "safe_load_numpy_pickle",
    "sha256_file",
    "split_holdout",
]

PACKAGE_SPEC = "animal-mnist==0.4"
"""The pip requirement fetched on first use."""
WHEEL_FILENAME = "animal_mnist-0.4-py3-none-any.whl"
"""The file name pip saves for :data:`PACKAGE_SPEC`."""
WHEEL_SHA256 = "aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce"
"""Hex SHA-256 of :data:`WHEEL_FILENAME` as published on PyPI."""
DATA_MEMBER = "animal_mnist/data/Animal_MNIST/animal_data_version_3.gz"
"""Zip member holding the gzipped pickle of the uint8 (10000, 28, 28) image array."""
LABEL_MEMBER = "animal_mnist/data/Animal_MNIST/animal_label_version_3.gz"
"""Zip member holding the gzipped pickle of the int64 (10000,) label array."""

IMAGE_SHAPE = (28, 28)
EXPECTED_NUM_IMAGES = 10_000


# ----------------------------------------------------------------------------------------------- errors
class AnimalMNISTError(WildFedError):
    """Base class of every error raised while fetching or reading Animal-MNIST."""


class DatasetFetchError(AnimalMNISTError, RuntimeError):
    """``pip download`` of :data:`PACKAGE_SPEC` failed (no network, no index, pip missing)."""


class DatasetIntegrityError(AnimalMNISTError, ValueError):
    """The wheel or the arrays inside it are not what WildFed expects (hash, member, shape, dtype, labels)."""


class UnsafePickleError(DatasetIntegrityError, pickle.UnpicklingError):
    """A pickle named a global other than numpy's ndarray reconstruction; it was refused, nothing was run."""


# --------------------------------------------------------------------------------- restricted unpickler
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)
"""The only globals a dataset pickle may name: numpy's ndarray reconstruction."""


class NumpyOnlyUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` that resolves only numpy's ndarray reconstruction globals.

    Admitted: ``numpy.core.multiarray._reconstruct`` / ``numpy._core.multiarray._reconstruct``, ``numpy.ndarray``,
    ``numpy.dtype``. Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``...) raises
    :class:`UnsafePickleError` before it is imported, so nothing it names is ever called. Persistent ids are
    refused as well (the default :class:`pickle.Unpickler` behaviour).

    Consequence: numpy arrays pickled with protocols 3 and 4 load (the dataset's files are protocol 4);
    protocol 2 (which carries the bytes through ``_codecs.encode``) and protocol 5 (which rebuilds through
    ``numpy._core.numeric._frombuffer``) are refused.
    """

    def find_class(self, module: str, name: str) -> object:
        """Resolve ``module.name`` if admitted, else raise :class:`UnsafePickleError`."""
        if (module, name) not in _ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"refused pickle global {module}.{name}: dataset pickles may only hold numpy arrays "
                f"(admitted: {sorted(f'{m}.{n}' for m, n in _ALLOWED_GLOBALS)})"
            )
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray" if _has_numpy_underscore_core() else module
        return super().find_class(module, name)


def _has_numpy_underscore_core() -> bool:
    """True on numpy >= 2, where ``numpy.core`` is a deprecated alias of ``numpy._core``."""
    try:
        import numpy._core.multiarray  # noqa: F401
    except ImportError:  # numpy 1.x
        return False
    return True


def safe_load_numpy_pickle(data: bytes) -> np.ndarray:
    """Unpickle ``data`` with :class:`NumpyOnlyUnpickler` and return the ndarray it holds.

    Args:
        data: raw (already decompressed) pickle bytes.

    Returns:
        The array (any numeric shape and dtype; object arrays are refused).

    Raises:
        UnsafePickleError: the pickle names any global besides numpy's ndarray reconstruction.
        DatasetIntegrityError: the pickle is malformed, or holds something other than a non-object ndarray.
    """
    try:
        obj = NumpyOnlyUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # truncated / corrupt stream: any of a dozen exception types
        raise DatasetIntegrityError(f"pickle does not parse: {type(exc).__name__}: {exc}") from exc
    if type(obj) is not np.ndarray:
        raise DatasetIntegrityError(f"pickle holds a {type(obj).__name__}, expected a numpy.ndarray")
    if obj.dtype.hasobject:
        raise DatasetIntegrityError("pickle holds an object-dtype array; only numeric arrays are admitted")
    return obj


# -------------------------------------------------------------------------------------------- the data
@dataclass(frozen=True, slots=True, eq=False)
class AnimalMNIST:
    """Animal-MNIST images and labels (the whole set or one split of it).

    Attributes:
        images: uint8 array, shape (N, 28, 28), grey levels 0-255 (0 = background).
        labels: int64 array, shape (N,), values 0-9 indexing :data:`CLASS_NAMES`.
        source_indices: int64 array, shape (N,): position of each image in the original 10,000-image array,
            so every split and site stays traceable to the published data.
        class_names: names of labels 0-9.
        wheel_path: the verified wheel the arrays were read from (``None`` for derived in-memory sets).

    Raises:
        DatasetIntegrityError: on construction, if shapes, dtypes or label values are off.
    """

    images: np.ndarray
    labels: np.ndarray
    source_indices: np.ndarray
    class_names: tuple[str, ...] = CLASS_NAMES
    wheel_path: Path | None = None

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.ndim == 1 else -1
        if self.images.dtype != np.uint8 or self.images.ndim != 3 or self.images.shape[1:] != IMAGE_SHAPE:
            raise DatasetIntegrityError(
                f"images must be uint8 (N, 28, 28), got {self.images.dtype} {self.images.shape}"
            )
        if self.labels.dtype != np.int64 or self.labels.ndim != 1 or n != self.images.shape[0]:
            raise DatasetIntegrityError(
                f"labels must be int64 ({self.images.shape[0]},), got {self.labels.dtype} {self.labels.shape}"
            )
        if n and (self.labels.min() < 0 or self.labels.max() >= len(self.class_names)):
            raise DatasetIntegrityError(
                f"labels must lie in 0..{len(self.class_names) - 1}, got {self.labels.min()}..{self.labels.max()}"
            )
        if self.source_indices.dtype != np.int64 or self.source_indices.shape != (n,):
            raise DatasetIntegrityError(
                f"source_indices must be int64 ({n},), got {self.source_indices.dtype} {self.source_indices.shape}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, indices: np.ndarray) -> AnimalMNIST:
        """The images at positions ``indices`` (int array into *this* set), keeping source indices."""
        idx = np.asarray(indices, dtype=np.int64)
        return AnimalMNIST(
            images=self.images[idx],
            labels=self.labels[idx],
            source_indices=self.source_indices[idx],
            class_names=self.class_names,
            wheel_path=self.wheel_path,
        )

    def class_counts(self) -> np.ndarray:
        """int64 array, shape (num_classes,): images per class."""
        return np.bincount(self.labels, minlength=len(self.class_names)).astype(np.int64)


def default_cache_dir() -> Path:
    """``$WILDFED_CACHE`` if set and non-empty, else ``~/.cache/wildfed``."""
    env = os.environ.get("WILDFED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "wildfed"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_wheel(path: Path, expected_sha256: str) -> None:
    """Check the wheel hash; on mismatch delete the file and raise :class:`DatasetIntegrityError`."""
    actual = sha256_file(path)
    if actual != expected_sha256:
        path.unlink(missing_ok=True)
        raise DatasetIntegrityError(
            f"{path} has SHA-256 {actual}, expected {expected_sha256}; the file was deleted. "
            f"Fix: rerun to download {PACKAGE_SPEC} again; if it fails again, the index serves a different "
            "file and the data cannot be trusted"
        )


def _pip_download(cache_dir: Path) -> None:
    """Run ``python -m pip download --no-deps animal-mnist==0.4 -d cache_dir`` with this interpreter."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           PACKAGE_SPEC, "-d", str(cache_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DatasetFetchError(f"could not run {' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise DatasetFetchError(
            f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}\n"
            f"Fix: check network access to the package index, or place {WHEEL_FILENAME} in {cache_dir} "
            "(WILDFED_CACHE overrides the cache folder)"
        )


def load_animal_mnist_wheel(wheel_path: Path) -> AnimalMNIST:
    """Read and validate the arrays from an (already verified) Animal-MNIST wheel.

    Args:
        wheel_path: the ``animal_mnist-0.4`` wheel.

    Returns:
        The full 10,000-image set, ``source_indices = arange(10000)``.

    Raises:
        DatasetIntegrityError: not a zip, a member missing, gzip or pickle corrupt, or arrays not uint8
            (10000, 28, 28) / int64 (10000,) with labels 0-9.
        UnsafePickleError: a member's pickle names a global other than numpy's ndarray reconstruction.
    """
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            for key, member in (("images", DATA_MEMBER), ("labels", LABEL_MEMBER)):
                try:
                    raw = zf.read(member)
                except KeyError:
                    raise DatasetIntegrityError(f"{wheel_path} has no member {member}") from None
                try:
                    payload = gzip.decompress(raw)
                except (OSError, EOFError) as exc:
                    raise DatasetIntegrityError(f"{wheel_path}:{member} is not valid gzip: {exc}") from exc
                try:
                    arrays[key] = safe_load_numpy_pickle(payload)
                except DatasetIntegrityError as exc:
                    raise type(exc)(f"{wheel_path}:{member}: {exc}") from exc
    except zipfile.BadZipFile as exc:
        raise DatasetIntegrityError(f"{wheel_path} is not a valid wheel (zip): {exc}") from exc
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.shape != (EXPECTED_NUM_IMAGES, *IMAGE_SHAPE):
        raise DatasetIntegrityError(
            f"{DATA_MEMBER}: expected uint8 (10000, 28, 28), got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.int64 or labels.shape != (EXPECTED_NUM_IMAGES,):
        raise DatasetIntegrityError(f"{LABEL_MEMBER}: expected int64 (10000,), got {labels.dtype} {labels.shape}")
    if labels.min() < 0 or labels.max() > NUM_CLASSES - 1:
        raise DatasetIntegrityError(f"{LABEL_MEMBER}: labels must be 0-9, got {labels.min()}..{labels.max()}")
    return AnimalMNIST(
        images=np.ascontiguousarray(images),
        labels=np.ascontiguousarray(labels),
        source_indices=np.arange(EXPECTED_NUM_IMAGES, dtype=np.int64),
        wheel_path=wheel_path,
    )


def fetch_animal_mnist(cache_dir: str | os.PathLike[str] | None = None, *,
                       expected_sha256: str = WHEEL_SHA256) -> AnimalMNIST:
    """Fetch (first use only), verify and load Animal-MNIST.

    Args:
        cache_dir: folder holding the wheel; default :func:`default_cache_dir` (``$WILDFED_CACHE`` or
            ``~/.cache/wildfed``). Created if absent.
        expected_sha256: hex SHA-256 the wheel must have (default: the published wheel's,
            :data:`WHEEL_SHA256`); exposed for tests.

    Returns:
        The full set: images uint8 (10000, 28, 28), labels int64 (10000,) in 0-9, 1,000 per class.

    Raises:
        DatasetFetchError: ``pip download`` failed or produced no wheel.
        DatasetIntegrityError: hash mismatch (the wheel is deleted), or bad members / arrays.
        UnsafePickleError: a data pickle names anything but numpy's ndarray reconstruction.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL_FILENAME
    if not wheel.is_file():
        _pip_download(cache)
        if not wheel.is_file():
            raise DatasetFetchError(
                f"pip download of {PACKAGE_SPEC} succeeded but {wheel} is missing; "
                f"found {sorted(p.name for p in cache.iterdir())}"
            )
    _verify_wheel(wheel, expected_sha256)
    return load_animal_mnist_wheel(wheel)


def split_holdout(data: AnimalMNIST, test_fraction: float = 0.2, *,
                  seed: int) -> tuple[AnimalMNIST, AnimalMNIST]:
    """Stratified train / held-out test split.

    Each class c with n_c images contributes ``round(test_fraction * n_c)`` images to the test split, chosen
    uniformly at random by ``numpy.random.default_rng(seed)``; the rest go to train. Both splits are sorted by
    source index, so the result depends only on (data, test_fraction, seed).

    Args:
        data: the set to split.
        test_fraction: share of each class held out, strictly between 0 and 1.
        seed: seed of the permutation.

    Returns:
        ``(train, test)``, disjoint, together covering ``data``.

    Raises:
        ValueError: ``test_fraction`` not in (0, 1), or it leaves some non-empty class with no train or no
            test image.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    test_parts: list[np.ndarray] = []
    for c in range(len(data.class_names)):
        members = np.flatnonzero(data.labels == c)
        if members.size == 0:
            continue
        n_test = int(round(test_fraction * members.size))
        if n_test == 0 or n_test == members.size:
            raise ValueError(
                f"test_fraction={test_fraction} leaves class {data.class_names[c]!r} ({members.size} images) "
                "with an empty train or test part"
            )
        test_parts.append(rng.choice(members, size=n_test, replace=False))
    test_mask = np.zeros(len(data), dtype=bool)
    test_mask[np.concatenate(test_parts)] = True
    return data.subset(np.flatnonzero(~test_mask)), data.subset(np.flatnonzero(test_mask))
