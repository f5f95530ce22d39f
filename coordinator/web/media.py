"""Images the coordinator holds (operator imports, :mod:`coordinator.web.formats`): size, type, capture time, and
removal of the EXIF GPS block before an image is shown to a role that must not see exact locations.

Every image is untrusted input: it is opened with Pillow only (never unpickled or executed), fully decoded before
anything is believed about it, and refused when it is larger than ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's
decompression-bomb limit, about 89.5 megapixels by default; the warning Pillow gives above that is treated as an
error here, not only the error it raises at twice the limit).

EXIF is the Exif 2.32 / TIFF 6.0 layout that Pillow reads (``Image.getexif()``); the GPS block is the sub-IFD that
tag ``0x8825`` (GPSInfo) points to.
"""

from __future__ import annotations

import datetime as _dt
import io
import re
import warnings

from PIL import Image, UnidentifiedImageError

from shared.errors import DatasetError

__all__ = ["GPS_IFD_TAG", "JPEG_QUALITY", "strip_gps", "image_info", "exif_capture_time"]

GPS_IFD_TAG = 0x8825
"""EXIF tag of the GPS IFD pointer (GPSInfo)."""
JPEG_QUALITY = 95
"""Quality a JPEG is re-encoded at by :func:`strip_gps`."""

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


#: EXIF tags of capture time: DateTime (IFD0); DateTimeOriginal, DateTimeDigitized, OffsetTime*, SubSecTime* and
#: MakerNote (vendor blocks can hold anything, times and positions included) in the Exif sub-IFD (EXIF 2.32).
_TIME_TAGS_IFD0 = (0x0132,)
_TIME_TAGS_EXIF = (0x9003, 0x9004, 0x9010, 0x9011, 0x9012, 0x9290, 0x9291, 0x9292, 0x927C)


def strip_gps(data: bytes, *, times: bool = False) -> bytes:
    """The image with its EXIF GPS IFD (tag ``0x8825``) removed, in the same format; with ``times`` also its
    capture-time tags (DateTime, DateTimeOriginal, DateTimeDigitized, the offset and sub-second tags) and the
    maker note (for a record whose time is withheld from the viewer, coordinator.web.views).

    The image is re-encoded with Pillow (JPEG at quality :data:`JPEG_QUALITY` with the original chroma
    subsampling), keeping every other EXIF tag (camera, time, orientation, the Exif sub-IFD) and the ICC colour
    profile. XMP packets are dropped too, because XMP can repeat the position (``exif:GPSLatitude``); IPTC blocks
    and JPEG comments are not carried over by Pillow either. An image with neither a GPS IFD nor XMP is returned
    unchanged (byte for byte, no second lossy encoding).

    Args:
        data: the encoded image (JPEG, PNG, TIFF, WebP, ...).

    Returns:
        The encoded image without location metadata.

    Raises:
        DatasetError: the bytes are not a readable image, or it exceeds the decompression-bomb limit.
    """
    img = _open(data)
    exif = img.getexif()
    has_xmp = any(k in img.info for k in ("xmp", "XML:com.adobe.xmp"))
    sub = exif.get_ifd(_EXIF_IFD_TAG) if _EXIF_IFD_TAG in exif else {}
    has_times = times and (any(k in exif for k in _TIME_TAGS_IFD0) or any(k in sub for k in _TIME_TAGS_EXIF))
    if GPS_IFD_TAG not in exif and not has_xmp and not has_times:
        return bytes(data)
    fmt = img.format or "PNG"
    if GPS_IFD_TAG in exif:
        del exif[GPS_IFD_TAG]
    if times:
        for k in _TIME_TAGS_IFD0:
            exif.pop(k, None)
        for k in _TIME_TAGS_EXIF:
            sub.pop(k, None)
    kwargs: dict[str, object] = {"format": fmt}
    if len(exif):
        kwargs["exif"] = exif.tobytes()
    if img.info.get("icc_profile"):
        kwargs["icc_profile"] = img.info["icc_profile"]
    if fmt == "JPEG":
        kwargs["quality"] = JPEG_QUALITY
        kwargs["subsampling"] = "keep"
    if getattr(img, "n_frames", 1) > 1:
        kwargs["save_all"] = True
    out = io.BytesIO()
    try:
        img.save(out, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise DatasetError(f"cannot re-encode the {fmt} image without its GPS tags: {exc}", field="image",
                           fix="convert it to JPEG or PNG first") from None
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
