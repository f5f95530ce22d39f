"""Decoding a photo at the size the detector needs (JPEG DCT scaling), and the full-size decode the crops need.

A camera trap writes 2048 x 1536 to 2592 x 1944 px JPEGs; the detector sees them padded to 640 x 640. libjpeg can
decode at 1/2, 1/4 or 1/8 of the size directly in the inverse DCT (Pillow's ``Image.draft``), which skips most of
the decode and most of the resize. :func:`draft_factor` picks the largest reduction whose long side still has at
least ``target`` pixels (the detector's input size, so the resize to 640 still only shrinks); the detector then
resizes as before (``edge_sdk.inference.detector.preprocess``) and maps its boxes back to the original pixels.

The crops the backbone embeds are not drafted: they come from the full decode (``edge_sdk.data.crops.decode_rgb``),
the very pixels training embeds once a ranger confirms a box (docs/field-loop.md, "Verified records train"), and
only photos with a box are decoded a second time.

Non-JPEG images (PNG, TIFF, BMP) ignore the draft request and decode at full size; everything else is unchanged.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from shared.models.yolox_tiny import INPUT_SIZE

__all__ = ["DRAFT_FACTORS", "draft_factor", "DetectorDecode", "open_for_detection", "decode_for_detection"]

#: The reductions libjpeg's scaled IDCT offers, largest first.
DRAFT_FACTORS = (8, 4, 2)


def draft_factor(width: int, height: int, target: int = INPUT_SIZE) -> int:
    """The largest reduction ``k`` in 8, 4, 2 (else 1) with ``max(width, height) // k >= target``.

    Args:
        width, height: the photo's size in pixels (>= 1).
        target: the smallest long side wanted after the reduction (pixels, >= 1); the detector's input size.

    Raises:
        ValueError: a size or target below 1.
    """
    if width < 1 or height < 1 or target < 1:
        raise ValueError(f"width, height and target must be >= 1 pixel, got {width}, {height}, {target}")
    long_side = max(width, height)
    return next((k for k in DRAFT_FACTORS if long_side // k >= target), 1)


@dataclass(frozen=True)
class DetectorDecode:
    """One photo decoded for the detector.

    Attributes:
        image: RGB, the photo at ``1/factor`` of its size (rounded up, as libjpeg does), or at full size.
        size: the photo's own ``(width, height)`` in pixels (what records and boxes are in).
        factor: the reduction libjpeg applied (1, 2, 4 or 8).
    """

    image: Image.Image
    size: tuple[int, int]
    factor: int


def open_for_detection(image: Image.Image, *, target: int = INPUT_SIZE, draft: bool = False) -> DetectorDecode:
    """Decode an opened, not yet loaded ``image`` (``PIL.Image.open``) for the detector.

    Args:
        image: as returned by ``Image.open`` (nothing read beyond the header yet); read EXIF before or after.
        target: the detector's input size (long side kept >= this).
        draft: decode a large JPEG at 1/2..1/8 in the DCT (opt-in: it cost one ENA24 photo of the leave-one-out
            count, docs/inference.md); False (default) decodes at full size.

    Raises:
        OSError: the image does not decode (truncated, not an image).
    """
    size = (int(image.width), int(image.height))
    factor = draft_factor(*size, target=target) if draft else 1
    if factor > 1 and image.format == "JPEG":
        image.draft("RGB", (size[0] // factor, size[1] // factor))
    rgb = image.convert("RGB")
    applied = max(1, round(size[0] / rgb.width)) if rgb.size != size else 1
    return DetectorDecode(rgb, size, applied)


def decode_for_detection(data: bytes, *, target: int = INPUT_SIZE, draft: bool = False) -> DetectorDecode:
    """:func:`open_for_detection` of a photo's bytes (raises OSError as it does)."""
    with Image.open(io.BytesIO(data)) as image:
        return open_for_detection(image, target=target, draft=draft)
