"""Backbone embeddings of Animal-MNIST images for the laboratory (demo evaluation, experiments), computed once and
cached (docs/demo-data.md).

The coordinator-side evaluation and every experiment see exactly what a gateway sees: each 28x28 grayscale image
as the Pillow image a gateway reads back from its lossless PNG (mode ``L``, replicated to RGB), embedded whole by
the frozen EfficientNet-Lite0 (``shared.models.backbone.preprocess_image``: bicubic to S px, ``(pixel - 127) /
128``) on the gateway's embedder (``edge_sdk.data.embedding.open_embedder``: ONNX Runtime, or torch), and stored
in an :class:`~edge_sdk.data.embedding_cache.EmbeddingCache` keyed by ``animal-mnist-<source index>#<SHA-256 of
the pixels>[:16]``, the input size and the backbone id. The cache lives in ``<wildfed cache>/embeddings/
animal-mnist`` (``$WILDFED_CACHE`` or ``~/.cache/wildfed``), so the 2,000 held-out images of a demo are embedded
on the first run only (about 12 s on one core at 128 px).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, EMBEDDING_DIM

__all__ = ["default_cache_root", "image_keys", "embed_grayscale"]


def default_cache_root() -> Path:
    """``<wildfed cache>/embeddings/animal-mnist``."""
    from edge_sdk.inference.weights import cache_dir

    return cache_dir() / "embeddings" / "animal-mnist"


def image_keys(images: np.ndarray, source_indices: Sequence[int]) -> list[str]:
    """Cache keys ``animal-mnist-<index:05d>#<sha256(pixels)[:16]>`` of uint8 (N, H, W) images."""
    arr = np.ascontiguousarray(images, dtype=np.uint8)
    return [f"animal-mnist-{int(i):05d}#{hashlib.sha256(im.tobytes()).hexdigest()[:16]}"
            for i, im in zip(source_indices, arr)]


def embed_grayscale(images: np.ndarray, source_indices: Sequence[int], *, cache_root: str | Path | None = None,
                    input_size: int = DEFAULT_INPUT_SIZE, threads: int | None = None) -> np.ndarray:
    """Backbone embeddings of grayscale images, as a gateway computes them from their PNGs (module docstring).

    Args:
        images: uint8 (N, H, W). source_indices: N ids (positions in the 10,000-image array).
        cache_root: default :func:`default_cache_root`. input_size: S px. threads: embedder threads.

    Returns:
        float32 (N, 1280).

    Raises:
        ValueError: images not uint8 (N, H, W) or a length mismatch.
    """
    from PIL import Image

    from edge_sdk.data.embedding import embed_pil, open_embedder
    from edge_sdk.data.embedding_cache import EmbeddingCache
    from shared.models.backbone import backbone_id

    arr = np.asarray(images)
    if arr.ndim != 3 or arr.dtype != np.uint8 or len(source_indices) != arr.shape[0]:
        raise ValueError(f"images must be uint8 (N, H, W) with N source indices, got {arr.dtype} {arr.shape} and "
                         f"{len(source_indices)} indices")
    cache = EmbeddingCache(cache_root if cache_root is not None else default_cache_root(),
                           backbone_id=backbone_id(DEFAULT_BACKBONE, input_size), input_size=input_size,
                           dim=EMBEDDING_DIM)
    opened: list = []

    def compute(idx: np.ndarray) -> np.ndarray:
        if not opened:
            opened.append(open_embedder(input_size, threads=threads))
        return embed_pil(opened[0], [Image.fromarray(arr[int(i)], mode="L").convert("RGB") for i in idx])

    if arr.shape[0] == 0:
        return np.zeros((0, EMBEDDING_DIM), np.float32)
    return cache.get_or_compute(image_keys(arr, source_indices), None, compute, chunk=500)
