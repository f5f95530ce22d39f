"""The gateway's training inputs: each record's crops embedded once by the frozen backbone, through the embedding
cache (docs/demo-data.md, section 4; :mod:`edge_sdk.data.crops` for what "the crop" is).

A record of a Camtrap DP package is one photo with the boxes of its current classification
(:attr:`~edge_sdk.data.camtrap_dp.LocalDataset.boxes`). Each box is embedded as the square the backbone sees
(:func:`edge_sdk.data.crops.bbox_square` of the stored bbox, pixels from :func:`edge_sdk.data.crops.decode_rgb`),
exactly what ``wildfed-edge detect`` and the gateway service embed to classify a detection, so the head trains on the
distribution it is used on. A record with several boxes (several animals of its one species) trains on the mean of
its crops' embeddings: one record, one feature vector, one unit of privacy. A record without boxes (a dataset of
crops already, as Animal-MNIST, or a label that applies to the whole photo) is embedded whole.

Each crop's embedding is computed once and stored in an :class:`~edge_sdk.data.embedding_cache.EmbeddingCache`
under :func:`edge_sdk.data.crops.crop_record_id`: the ``mediaID``, the first 16 hex digits of the file's SHA-256
(a file replaced under the same ``mediaID`` is re-embedded, never served a stale embedding) and the square, with the
square as the cache's box; the backbone id (``shared.models.backbone.backbone_id(backbone, S)``: variant, weights hash, preprocessing
version and input size S) selects the cache's folder. Training then reads
float32 (N, 1280) embeddings from memory (:attr:`LocalDataset.features`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared.errors import DatasetError
from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, EMBEDDING_DIM

from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.data.embedding_cache import EmbeddingCache

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

    from edge_sdk.inference.embedder import Embedder

__all__ = ["open_embedder", "load_rgb", "embed_pil", "embed_dataset"]

log = logging.getLogger(__name__)


def open_embedder(input_size: int = DEFAULT_INPUT_SIZE, *, backbone: str = DEFAULT_BACKBONE,
                  threads: int | None = None, model_dir: str | Path | None = None) -> "Embedder":
    """The backbone embedder a gateway uses for ``backbone`` (a variant name, e.g. ``efficientnet-lite0``) at
    ``input_size``: the exported ONNX graph (the site's ``model_dir`` first: its bundle's graph) on TensorRT FP16 or
    ONNX Runtime (``edge_sdk.inference.embedder.OnnxEmbedder``), or the torch module where no inference engine opens
    and torch is installed.

    Raises:
        ConfigError: an unknown backbone (before anything is opened); no graph opens and torch is not installed
            (the ONNX side's error, which names ``model_dir`` and the fix).
    """
    from shared.models.backbone import get_variant

    from edge_sdk.inference.embedder import OnnxEmbedder, TorchEmbedder

    get_variant(backbone)
    try:
        return OnnxEmbedder.open(input_size, backbone=backbone, threads=threads, model_dir=model_dir)
    except Exception as exc:  # noqa: BLE001 - no ONNX Runtime / exporter here: torch computes the same function
        if not _torch_installed():
            raise  # nothing to fall back to: the ONNX error says what is missing
        log.warning("ONNX embedder unavailable (%s: %s); embedding with torch", type(exc).__name__, exc)
        return TorchEmbedder(input_size, backbone=backbone, threads=threads)


def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module marked absent
        return False


def load_rgb(path: str | Path) -> "Image.Image":
    """The image at ``path`` as a Pillow RGB image (the whole image: datasets of crops).

    Raises:
        DatasetError: the file cannot be read as an image (names the file and the fix).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DatasetError(f"image cannot be read: {exc}", source=str(path),
                           fix="replace the file with a readable image (JPEG/PNG) or remove its rows from media.csv"
                           ) from exc


def embed_pil(embedder: "Embedder", images: list["Image.Image"]) -> np.ndarray:
    """Embeddings float32 (N, 1280) of Pillow images (each embedded whole, as :func:`embed_dataset` does)."""
    if not images:
        return np.zeros((0, EMBEDDING_DIM), np.float32)
    return np.asarray(embedder.embed_images(images), dtype=np.float32)


def _crop_keys(dataset: LocalDataset, sizes: dict[int, tuple[int, int]]) -> tuple[list[str], list, list[int]]:
    """Flat lists over every crop of every record: cache record ids, squares (None: whole image), record index."""
    from edge_sdk.data.crops import bbox_square, crop_record_id

    ids, squares, owner = [], [], []
    for i, (mid, digest) in enumerate(zip(dataset.media_ids, dataset.sha256)):
        boxes = dataset.boxes[i] if dataset.boxes else ()
        if not boxes:
            ids.append(crop_record_id(mid, digest, None))
            squares.append(None)
            owner.append(i)
            continue
        width, height = sizes[i]
        for box in boxes:
            square = bbox_square(box, width, height)
            ids.append(crop_record_id(mid, digest, square))
            squares.append(square)
            owner.append(i)
    return ids, squares, owner


def _image_sizes(dataset: LocalDataset) -> dict[int, tuple[int, int]]:
    """Width and height of every record with boxes (read from the file header only)."""
    from PIL import Image, UnidentifiedImageError

    sizes = {}
    for i, boxes in enumerate(dataset.boxes):
        if boxes:
            try:
                with Image.open(dataset.files[i]) as image:
                    sizes[i] = image.size
            except (UnidentifiedImageError, OSError) as exc:
                raise DatasetError(f"image cannot be read: {exc}", source=dataset.files[i],
                                   fix="replace the file with a readable image or remove its rows") from exc
    return sizes


def embed_dataset(dataset: LocalDataset, cache_root: str | Path, *, input_size: int = DEFAULT_INPUT_SIZE,
                  backbone: str = DEFAULT_BACKBONE, embedder: "Embedder | None" = None, threads: int | None = None,
                  chunk: int = 256, cache: EmbeddingCache | None = None,
                  model_dir: str | Path | None = None) -> LocalDataset:
    """``dataset`` with :attr:`~LocalDataset.features` filled: every record's embedding (the mean over its crops),
    each crop read from the cache under ``cache_root`` where present and computed (then stored) where not.

    Args:
        dataset: loaded by :func:`~edge_sdk.data.camtrap_dp.load_camtrap_dp` (it records each image's file,
            SHA-256 and boxes).
        cache_root: the cache's root folder (the site config's ``embedding_cache``).
        input_size: S in pixels (``shared.models.backbone.DEFAULT_INPUT_SIZE``, 128, chosen by measurement).
        backbone: the backbone variant (the site config's ``backbone``; default ``efficientnet-lite0``).
        embedder: what computes misses (default :func:`open_embedder`, opened only if something is missing).
        threads: threads of the default embedder.
        chunk: crops per embedder call (each chunk is stored before the next, so an interrupted run keeps it).
        cache: an open cache to use instead of opening one under ``cache_root`` (one process, one cache object).
        model_dir: the site's graph folder (site.yaml ``model_dir``), where the default embedder looks first.

    Returns:
        A new :class:`LocalDataset` (same records, same order) with ``features`` float32 (N, 1280).

    Raises:
        DatasetError: the dataset does not record its files (build it with ``load_camtrap_dp``), or an image is
            unreadable.
        ValueError: the embedder's input size or backbone differs from the cache's.
        ConfigError: an unknown backbone.
    """
    n = len(dataset)
    if len(dataset.files) != n or len(dataset.sha256) != n:
        raise DatasetError("the dataset does not record its image files and their SHA-256, so it cannot be embedded",
                           field="dataset", fix="load it with edge_sdk.data.camtrap_dp.load_camtrap_dp")
    from shared.models.backbone import backbone_id

    from edge_sdk.data.crops import crop_square, decode_rgb

    if cache is None:
        cache = EmbeddingCache(cache_root, backbone_id=backbone_id(backbone, input_size), input_size=input_size,
                               dim=EMBEDDING_DIM)
    ids, squares, owner = _crop_keys(dataset, _image_sizes(dataset))
    opened: list["Embedder"] = [embedder] if embedder is not None else []
    computed = [0]

    def compute(idx: np.ndarray) -> np.ndarray:
        if not opened:
            opened.append(open_embedder(input_size, backbone=backbone, threads=threads, model_dir=model_dir))
        emb = opened[0]
        if emb.input_size != input_size or emb.backbone_id != cache.backbone_id:
            raise ValueError(f"embedder {emb.backbone_id} at {emb.input_size} px does not match the cache "
                             f"({cache.backbone_id} at {input_size} px)")
        images: dict[int, "Image.Image"] = {}
        crops = []
        for k in idx:
            record = owner[int(k)]
            if record not in images:
                images[record] = _decode(dataset.files[record], decode_rgb)
            square = squares[int(k)]
            crops.append(images[record] if square is None else crop_square(images[record], square))
        values = embed_pil(emb, crops)
        computed[0] += len(idx)
        # progress in the log: a first run embeds for minutes, and whoever waits on the gateway sees it move
        log.info("embeddings: %d crops computed so far (%d crops of %d records in all)", computed[0], len(ids), n)
        return values

    if not ids:
        features = np.zeros((0, EMBEDDING_DIM), np.float32)
    else:
        crops = cache.get_or_compute(ids, squares, compute, chunk=chunk)
        features = np.zeros((n, EMBEDDING_DIM), np.float64)
        counts = np.zeros(n)
        np.add.at(features, owner, crops)
        np.add.at(counts, owner, 1.0)
        features = (features / counts[:, None]).astype(np.float32)
    log.info("embeddings: %d records (%d crops), %d from the cache, %d computed (%d px, %s)", n, len(ids),
             cache.stats.hits, cache.stats.written, input_size, cache.backbone_id)
    return dataclasses.replace(dataset, features=np.ascontiguousarray(features, dtype=np.float32))


def _decode(path: str, decode: object) -> "Image.Image":
    try:
        return decode(Path(path).read_bytes())  # type: ignore[operator]
    except OSError as exc:
        raise DatasetError(f"image cannot be read: {exc}", source=str(path),
                           fix="replace the file with a readable image (JPEG/PNG) or remove its rows from media.csv"
                           ) from exc
