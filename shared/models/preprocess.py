"""The backbone's input, in numpy and Pillow (no torch, so a gateway running the exported ONNX file needs neither):
RGB pixels to float32 (N, 3, S, S) ``(pixel - 127) / 128`` (:func:`normalise`: the "inception-style" mean and
standard deviation the EfficientNet-Lite ImageNet checkpoints were trained with; see :mod:`shared.models.backbone`),
the square around a detection the backbone sees (:func:`square_crop`), one image or crop resized bicubically
(:func:`preprocess_image`), and grayscale images upscaled (:func:`preprocess_grayscale`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["TRAINING_INPUT_SIZE", "MEAN_RGB", "STD_RGB", "PREPROCESS_VERSION", "normalise", "square_crop",
           "preprocess_image", "preprocess_grayscale"]

#: Lite0's training input size (each variant's is ``BackboneVariant.native_size``).
TRAINING_INPUT_SIZE = 224
MEAN_RGB = (127.0, 127.0, 127.0)
STD_RGB = (128.0, 128.0, 128.0)
#: Bumped whenever :func:`normalise` / :func:`preprocess_image` change what pixels reach the network, so that
#: caches keyed by :func:`shared.models.backbone.backbone_id` are invalidated.
PREPROCESS_VERSION = 1


def normalise(pixels: np.ndarray) -> np.ndarray:
    """Network input from RGB pixels: ``(pixels - 127) / 128``.

    Args:
        pixels: (N, S, S, 3) or (S, S, 3) channels-last, uint8 or float in 0..255.

    Returns:
        float32 (N, 3, S, S) (or (3, S, S)), channels first, values in [-0.9921875, 1.0].

    Raises:
        ValueError: the last axis is not 3 channels.
    """
    arr = np.asarray(pixels)
    if arr.ndim not in (3, 4) or arr.shape[-1] != 3:
        raise ValueError(f"pixels must be (N, S, S, 3) or (S, S, 3) RGB, got shape {arr.shape}")
    mean = np.asarray(MEAN_RGB, dtype=np.float32)
    std = np.asarray(STD_RGB, dtype=np.float32)
    out = (arr.astype(np.float32) - mean) / std
    out = np.moveaxis(out, -1, -3)
    return np.ascontiguousarray(out, dtype=np.float32)


def square_crop(box: Sequence[float], width: int, height: int) -> tuple[int, int, int, int]:
    """The integer pixel square around a detection that the backbone sees.

    Side ``max(w, h)`` of the box, centred on the box, moved (not shrunk) to lie inside the image, and cut by the
    image only where the side exceeds the image's width or height. Keeping the square (rather than stretching a
    tight box) preserves the animal's shape and adds some context: on the three ENA24 black-bear photos, with the
    project's detector's top box, the ImageNet head names class 295 (American black bear) for 2 of these squares
    against 1 of 3 for the tight boxes centre-cropped (``tests/shared/test_backbone.py`` checks the squares).

    Args:
        box: ``(x1, y1, x2, y2)`` in image pixels, x1 <= x2 and y1 <= y2.
        width, height: the image's size in pixels.

    Returns:
        ``(left, top, right, bottom)`` integers for ``PIL.Image.crop``: 0 <= left < right <= width and
        0 <= top < bottom <= height.

    Raises:
        ValueError: a box with non-finite or reversed corners, or an empty image.
    """
    x1, y1, x2, y2 = (float(v) for v in box)
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if not all(np.isfinite([x1, y1, x2, y2])) or x2 < x1 or y2 < y1:
        raise ValueError(f"box must be finite (x1, y1, x2, y2) with x1 <= x2, y1 <= y2, got {tuple(box)}")
    side = max(x2 - x1, y2 - y1, 1.0)

    def axis(lo: float, hi: float, limit: int) -> tuple[int, int]:
        span = min(int(round(side)), limit)
        start = int(round((lo + hi) / 2 - span / 2))
        start = min(max(start, 0), limit - span)
        return start, start + span

    left, right = axis(x1, x2, int(width))
    top, bottom = axis(y1, y2, int(height))
    return left, top, right, bottom


def preprocess_image(image: "Image.Image", input_size: int = TRAINING_INPUT_SIZE) -> np.ndarray:
    """One image (a crop from :func:`square_crop`, or a whole already-cropped image) as network input: RGB,
    resized to ``input_size`` x ``input_size`` with bicubic resampling (a non-square image is stretched, so crop
    a square first), :func:`normalise`.

    Returns:
        float32 (3, input_size, input_size).
    """
    from PIL import Image

    size = int(input_size)
    rgb = image.convert("RGB")
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
    return normalise(np.asarray(rgb))


def preprocess_grayscale(images: np.ndarray, input_size: int) -> np.ndarray:
    """Grayscale images (e.g. Animal-MNIST's 28x28 crops) as network input: each image upscaled to
    ``input_size`` x ``input_size`` with bilinear resampling (Pillow), the channel replicated to RGB,
    :func:`normalise`.

    Args:
        images: uint8 (N, H, W) in 0..255.

    Returns:
        float32 (N, 3, input_size, input_size).

    Raises:
        ValueError: not a uint8 (N, H, W) array.
    """
    from PIL import Image

    arr = np.asarray(images)
    if arr.ndim != 3 or arr.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, H, W), got {arr.dtype} {arr.shape}")
    size = int(input_size)
    out = np.empty((arr.shape[0], 3, size, size), dtype=np.float32)
    for i, im in enumerate(arr):
        up = np.asarray(Image.fromarray(im, mode="L").resize((size, size), Image.Resampling.BILINEAR),
                        dtype=np.float32)
        out[i] = (up - MEAN_RGB[0]) / STD_RGB[0]
    return out
