"""Images the coordinator holds (operator imports, :mod:`coordinator.web.formats`): size, type, capture time, and
the metadata-free copy of an image that roles without exact locations are served (:func:`strip_metadata`).

Every image is untrusted input: it is opened with Pillow only (never unpickled or executed), fully decoded before
anything is believed about it, and refused when it is larger than ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's
decompression-bomb limit, about 89.5 megapixels by default; the warning Pillow gives above that is treated as an
error here, not only the error it raises at twice the limit).

EXIF is the Exif 2.32 / TIFF 6.0 layout that Pillow reads (``Image.getexif()``).

Why an allow-list: a camera, a cataloguing tool or a person can write a position or a place name
into almost any field: the GPS IFD, ImageDescription, Artist, XPComment, UserComment, the maker note, the JPEG
comment (COM), XMP, IPTC, PNG ``tEXt``/``iTXt``/``zTXt`` chunks, even an ICC profile's description. Removing known
fields one by one left "51.18400N 5.65900E" readable in every example image. So :func:`strip_metadata` keeps only
the pixels: it decodes the image, applies the EXIF orientation to the pixels (so no tag is needed to show it the
right way up), converts colours from an embedded ICC profile to sRGB, and encodes a brand-new image from the pixel
values alone. Nothing of the original file but its pixels can reach the output.
"""

from __future__ import annotations

import datetime as _dt
import io
import re
import warnings

from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from shared.errors import DatasetError

__all__ = ["JPEG_QUALITY", "strip_metadata", "image_info", "exif_capture_time"]

JPEG_QUALITY = 95
"""Quality every JPEG is re-encoded at by :func:`strip_metadata`, with the encoder's standard tables (ITU-T T.81
Annex K, scaled as libjpeg's ``jpeg_quality_scaling``) and 4:2:0 chroma subsampling: nothing of the original's
quantization tables or subsampling is reused, since a table's 64 values can carry text (a trial wrote
"51.18400N 5.65900E" into a luminance table and read it back from the partner's copy)."""
JPEG_SUBSAMPLING = 2
"""Pillow's code for 4:2:0 chroma subsampling, fixed for every re-encoded JPEG."""

_EXIF_IFD_TAG = 0x8769
_DATETIME = 0x0132
_DATETIME_ORIGINAL = 0x9003
_OFFSET_TIME_ORIGINAL = 0x9011
_OFFSET = re.compile(r"^([+-])(\d{2}):(\d{2})$")
_FIX = "give a JPEG, PNG or other image Pillow can read (and no larger than Image.MAX_IMAGE_PIXELS)"


def _open(data: bytes) -> Image.Image:
    """Open and fully decode ``data``; decompression-bomb warnings are errors.

    Raises:
        DatasetError: not bytes, not an image Pillow can read, truncated, or too many pixels.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise DatasetError("the image is empty or not bytes", field="image", fix=_FIX)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(bytes(data)))
            img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DatasetError(f"the image has too many pixels: {exc}", field="image", fix=_FIX) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise DatasetError(f"the data is not a readable image: {exc}", field="image", fix=_FIX) from None
    return img


def image_info(data: bytes) -> tuple[int, int, str]:
    """``(width, height, mime type)`` of an image, e.g. ``(2048, 1536, "image/jpeg")``; width and height in pixels.

    Raises:
        DatasetError: the bytes are not an image Pillow can decode, or it exceeds the decompression-bomb limit.
    """
    img = _open(data)
    width, height = img.size
    return int(width), int(height), Image.MIME.get(img.format or "", "application/octet-stream")


def _to_8bit(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit ``L``, ``LA``, ``RGB`` or ``RGBA``, deterministically from its pixel values alone.

    ``1`` becomes ``L`` (0/255); integer and float single-band modes (``I``, ``I;16``, ``F``, ...) are scaled
    linearly from their own [min, max] to [0, 255] (a constant image becomes 0), since their values have no fixed
    range; palettes are expanded; CMYK, YCbCr, LAB, HSV and the like are converted by Pillow to RGB (RGBA when
    they have an alpha band)."""
    if img.mode in ("L", "LA", "RGB", "RGBA"):
        return img
    if img.mode == "1":
        return img.convert("L")
    if img.mode in ("P", "PA"):
        return img.convert("RGBA" if img.mode == "PA" or "transparency" in img.info else "RGB")
    if len(img.getbands()) == 1:  # I, I;16*, F: scale the image's own range
        import numpy as np

        arr = np.asarray(img.convert("F") if img.mode != "F" else img, dtype=np.float64)
        finite = arr[np.isfinite(arr)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        arr = np.where(np.isfinite(arr), arr, lo)
        scaled = np.zeros(arr.shape) if hi <= lo else (arr - lo) * (255.0 / (hi - lo))
        return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")
    return img.convert("RGBA" if "A" in img.getbands() else "RGB")


def _pixels_only(img: Image.Image) -> Image.Image:
    """A new 8-bit image (``L``, ``LA``, ``RGB`` or ``RGBA``, :func:`_to_8bit`) with ``img``'s pixels (oriented,
    in sRGB where a profile said otherwise) and no ``info`` at all: built with ``Image.frombytes`` from the raw
    pixel values, so no metadata of the original object can follow."""
    try:
        img = ImageOps.exif_transpose(img)
    except (ValueError, OSError, KeyError, TypeError, SyntaxError):
        pass  # an unreadable orientation tag: the pixels as stored
    icc = img.info.get("icc_profile")
    if icc and img.mode in ("RGB", "RGBA", "L", "CMYK"):
        try:
            out_mode = "RGBA" if img.mode == "RGBA" else "RGB"
            img = ImageCms.profileToProfile(img, ImageCms.ImageCmsProfile(io.BytesIO(icc)),
                                            ImageCms.createProfile("sRGB"), outputMode=out_mode)
        except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
            pass  # a profile LittleCMS cannot read: the pixels as stored (colours may be a little off)
    transparency = img.info.get("transparency") if img.mode in ("L", "RGB") else None
    img = _to_8bit(img)
    clean = Image.frombytes(img.mode, img.size, img.tobytes())
    if isinstance(transparency, (int, tuple)):  # a colour key is part of the pixels' meaning, not metadata
        clean.info["transparency"] = transparency
    return clean


def strip_metadata(data: bytes) -> bytes:
    """The image re-encoded from its pixels alone: no EXIF (GPS, ImageDescription, Artist, XPComment, UserComment,
    maker note, capture times), no XMP, IPTC, JPEG comment, PNG text chunk or ICC profile (module docstring).

    An allow-list: what is kept is the first frame's pixels, turned upright by the EXIF Orientation tag (the tag
    itself is then dropped) and converted to sRGB when the image carried an ICC profile. A JPEG (or MPO) stays a
    JPEG, re-encoded at quality :data:`JPEG_QUALITY` with the encoder's standard tables and 4:2:0 subsampling
    (never the original's tables: they can carry text); every other format becomes an 8-bit PNG (lossless for 8-bit
    images; 16-bit and float images are scaled from their own range, :func:`_to_8bit`).
    Used for every image shown to a role without exact locations (coordinator.web.app); rangers and operators get
    the stored bytes.

    Args:
        data: the encoded image (JPEG, PNG, TIFF, WebP, GIF, ...).

    Returns:
        The encoded image (JPEG or PNG) with no metadata.

    Raises:
        DatasetError: the bytes are not a readable image, it exceeds the decompression-bomb limit, or its pixels
            cannot be encoded (the web app answers 415 then).
    """
    img = _open(data)
    jpeg = img.format in ("JPEG", "MPO")
    try:
        clean = _pixels_only(img)
        out = io.BytesIO()
        if jpeg:
            if clean.mode not in ("L", "RGB"):
                clean = clean.convert("RGB")
            clean.save(out, format="JPEG", quality=JPEG_QUALITY, subsampling=JPEG_SUBSAMPLING)
        else:
            clean.save(out, format="PNG")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"cannot re-encode the image without its metadata: {exc}", field="image",
                           fix="convert it to an 8-bit JPEG or PNG first") from None
    return out.getvalue()


def exif_capture_time(data: bytes, *, utc_offset: _dt.timezone = _dt.timezone.utc) -> str | None:
    """The capture time written in the image's EXIF, ISO 8601 with a UTC offset, or None when there is none.

    EXIF ``DateTimeOriginal`` (else ``DateTime``), with the offset of ``OffsetTimeOriginal`` when the camera wrote
    one and otherwise ``utc_offset`` (the camera clock's zone): the gateway's rule (edge_sdk.inference.records), so
    an imported image and a gateway record of the same photo get the same time.

    Raises:
        DatasetError: the bytes are not a readable image.
    """
    img = _open(data)
    try:
        exif = img.getexif()
        sub = exif.get_ifd(_EXIF_IFD_TAG)
        raw = sub.get(_DATETIME_ORIGINAL) or exif.get(_DATETIME)
        if not raw:
            return None
        moment = _dt.datetime.strptime(str(raw).strip("\x00 ").strip(), "%Y:%m:%d %H:%M:%S")
    except (ValueError, OSError, AttributeError, KeyError):
        return None  # malformed EXIF: no time from it
    zone = utc_offset
    m = _OFFSET.match(str(sub.get(_OFFSET_TIME_ORIGINAL) or "").strip("\x00 "))
    if m:
        delta = _dt.timedelta(hours=int(m.group(2)), minutes=int(m.group(3)))
        zone = _dt.timezone(-delta if m.group(1) == "-" else delta)
    return moment.replace(tzinfo=zone).isoformat()
