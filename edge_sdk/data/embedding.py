"""The gateway's training inputs: each record embedded once by the frozen backbone, through the embedding cache
(issue 18, item 2; DESIGN.md "The camera model").

A record of a Camtrap DP package is one image (already a crop, as in Animal-MNIST and most classifier training
sets, so the whole image is embedded: box ``None``). Its embedding is computed once and stored in an
:class:`~edge_sdk.data.embedding_cache.EmbeddingCache`, keyed by

- the record: :func:`record_key`, the ``mediaID`` **and** the first 16 hex digits of the SHA-256 of the file's
  bytes (already computed by the loader, so it costs nothing): a file replaced under the same ``mediaID`` is
  re-embedded, never served a stale embedding;
- the crop box (``None``: the whole image), the input size S and the backbone id
  (``shared.models.backbone.backbone_id(backbone, S)``: variant, weights hash, preprocessing version and input
  size), which select the cache's folder and entry.

Training then reads float32 (N, 1280) embeddings from memory (:attr:`LocalDataset.features`); a gateway with
10,000 photos embeds them once (about a minute at 128 px on one core) and reads them back in well under a second
on every later start (``benchmarks/embed.py``). Preprocessing is ``shared.models.backbone.preprocess_image``
(RGB, bicubic resize to S, ``(pixel - 127) / 128``): a grayscale image is replicated to RGB by Pillow.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["record_key", "open_embedder", "load_rgb", "embed_pil", "embed_dataset"]

log = logging.getLogger(__name__)


def record_key(media_id: str, sha256: str) -> str:
    """The cache key of one record: ``"<mediaID>#<sha256[:16]>"`` (the record and its content).

    Raises:
        ValueError: an empty media id or a digest shorter than 16 hex digits.
    """
    if not media_id or len(sha256) < 16:
        raise ValueError(f"record_key needs a mediaID and a SHA-256 hex digest, got {media_id!r}, {sha256!r}")
    return f"{media_id}#{sha256[:16]}"


def open_embedder(input_size: int = DEFAULT_INPUT_SIZE, *, backbone: str = DEFAULT_BACKBONE,
                  threads: int | None = None) -> "Embedder":
    """The backbone embedder a gateway uses for ``backbone`` (a variant name, e.g. ``efficientnet-lite0``) at
    ``input_size``: the exported ONNX graph on TensorRT FP16 or ONNX Runtime
    (``edge_sdk.inference.embedder.OnnxEmbedder``), or the torch module where no inference engine opens.

    Raises:
        ConfigError: an unknown backbone (before anything is opened).
    """
    from shared.models.backbone import get_variant

    from edge_sdk.inference.embedder import OnnxEmbedder, TorchEmbedder

    get_variant(backbone)
    try:
        return OnnxEmbedder.open(input_size, backbone=backbone, threads=threads)
    except Exception as exc:  # noqa: BLE001 - no ONNX Runtime / exporter here: torch computes the same function
        log.warning("ONNX embedder unavailable (%s: %s); embedding with torch", type(exc).__name__, exc)
        return TorchEmbedder(input_size, backbone=backbone, threads=threads)


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


def embed_dataset(dataset: LocalDataset, cache_root: str | Path, *, input_size: int = DEFAULT_INPUT_SIZE,
                  backbone: str = DEFAULT_BACKBONE, embedder: "Embedder | None" = None, threads: int | None = None,
                  chunk: int = 256) -> LocalDataset:
    """``dataset`` with :attr:`~LocalDataset.features` filled: the backbone embedding of every record, read from
    the cache under ``cache_root`` where present and computed (then stored) where not.

    Args:
        dataset: loaded by :func:`~edge_sdk.data.camtrap_dp.load_camtrap_dp` (it records each image's file and
            SHA-256).
        cache_root: the cache's root folder (the site config's ``embedding_cache``).
        input_size: S in pixels (``shared.models.backbone.DEFAULT_INPUT_SIZE``, 128, chosen by measurement).
        backbone: the backbone variant (the site config's ``backbone``; default ``efficientnet-lite0``).
        embedder: what computes misses (default :func:`open_embedder`, opened only if something is missing).
        threads: threads of the default embedder.
        chunk: records per embedder call (each chunk is stored before the next, so an interrupted run keeps it).

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

    cache = EmbeddingCache(cache_root, backbone_id=backbone_id(backbone, input_size), input_size=input_size,
                           dim=EMBEDDING_DIM)
    keys = [record_key(m, h) for m, h in zip(dataset.media_ids, dataset.sha256)]
    opened: list["Embedder"] = [embedder] if embedder is not None else []
    computed = [0]

    def compute(idx: np.ndarray) -> np.ndarray:
        if not opened:
            opened.append(open_embedder(input_size, backbone=backbone, threads=threads))
        emb = opened[0]
        if emb.input_size != input_size or emb.backbone_id != cache.backbone_id:
            raise ValueError(f"embedder {emb.backbone_id} at {emb.input_size} px does not match the cache "
                             f"({cache.backbone_id} at {input_size} px)")
        values = embed_pil(emb, [load_rgb(dataset.files[int(i)]) for i in idx])
        computed[0] += len(idx)
        # progress in the log: a first run embeds for minutes, and whoever waits on the gateway sees it move
        log.info("embeddings: %d computed so far (%d records in all)", computed[0], n)
        return values

    features = cache.get_or_compute(keys, None, compute, chunk=chunk) if n else np.zeros((0, EMBEDDING_DIM),
                                                                                       np.float32)
    log.info("embeddings: %d records, %d from the cache, %d computed (%d px, %s)", n, cache.stats.hits,
             cache.stats.written, input_size, cache.backbone_id)
    return dataclasses.replace(dataset, features=np.ascontiguousarray(features, dtype=np.float32))
