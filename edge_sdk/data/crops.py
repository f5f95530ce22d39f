"""One definition of "the crop the backbone sees", shared by training and by inference.

The species head is trained on backbone embeddings of crops and used on embeddings of crops; if the two sides
crop differently (a whole frame for training, a detection box at inference) the head learns one distribution and is
asked about another. Both sides therefore go through the functions here:

1. a photo's bytes are decoded by :func:`decode_rgb` (Pillow, RGB; no EXIF rotation, no draft-mode scaling);
2. a box is a normalised Camtrap DP ``bbox`` ``(x, y, width, height)`` rounded to :data:`BBOX_DECIMALS` decimals
   (:func:`stored_bbox`), exactly as it is written to ``observations.csv``, so a box read back from the package
   gives the same pixels as the box the detector returned;
3. :func:`bbox_square` turns it into the integer pixel square of ``shared.models.backbone.square_crop``;
4. :func:`crop_record_id` names the crop in the embedding cache (:mod:`edge_sdk.data.embedding_cache`): the
   photo's media id, its content hash and the square, so the embedding the gateway computed to classify a detection
   is the one training reads once a ranger confirms that detection.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.models.backbone import square_crop

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["BBOX_DECIMALS", "Square", "decode_rgb", "stored_bbox", "bbox_square", "crop_square", "crop_record_id"]

#: Decimals of a normalised bbox as stored (1e-6 of a 10,000-px side is 0.01 px: the square never moves).
BBOX_DECIMALS = 6
Square = tuple[int, int, int, int]


def decode_rgb(data: bytes) -> "Image.Image":
    """A photo's bytes as a fully decoded Pillow RGB image.

    Raises:
        OSError: the bytes are not a complete image (a truncated JPEG raises here, not later).
        PIL.UnidentifiedImageError: not an image at all (a subclass of OSError).
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.convert("RGB")


def stored_bbox(bbox: Sequence[float]) -> tuple[float, float, float, float]:
    """A normalised ``(x, y, w, h)`` box as stored in the package: each value rounded to :data:`BBOX_DECIMALS`
    decimals and clipped to [0, 1].

    Raises:
        ValueError: not four finite numbers.
    """
    values = [float(v) for v in bbox]
    if len(values) != 4 or not all(v == v and abs(v) != float("inf") for v in values):
        raise ValueError(f"bbox must be four finite numbers (x, y, w, h), got {tuple(bbox)!r}")
    x, y, w, h = (min(max(round(v, BBOX_DECIMALS), 0.0), 1.0) for v in values)
    return x, y, w, h


def bbox_square(bbox: Sequence[float], width: int, height: int) -> Square:
    """The integer pixel square (``left, top, right, bottom``) the backbone sees for a normalised box.

    The box is first put in its stored form (:func:`stored_bbox`), then scaled to pixels and squared by
    ``shared.models.backbone.square_crop``.

    Raises:
        ValueError: a bad box or image size.
    """
    x, y, w, h = stored_bbox(bbox)
    return square_crop((x * width, y * height, (x + w) * width, (y + h) * height), width, height)


def crop_square(image: "Image.Image", square: Square) -> "Image.Image":
    """The RGB pixels of ``square`` (from :func:`bbox_square`)."""
    return image.crop(square).convert("RGB")


def crop_record_id(media_id: str, sha256: str, square: Square | None) -> str:
    """The embedding cache's record id of one crop of one photo: ``"<mediaID>#<sha256[:16]>"`` for the whole photo,
    ``"<mediaID>#<sha256[:16]>@l,t,r,b"`` for a square.

    Raises:
        ValueError: an empty media id or a digest shorter than 16 hex digits.
    """
    if not media_id or len(sha256) < 16:
        raise ValueError(f"crop_record_id needs a mediaID and a SHA-256 hex digest, got {media_id!r}, {sha256!r}")
    base = f"{media_id}#{sha256[:16]}"
    return base if square is None else f"{base}@{','.join(str(int(v)) for v in square)}"
