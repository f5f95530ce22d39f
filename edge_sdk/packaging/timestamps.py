"""A photo's capture time for ``media.timestamp``, and where it came from.

In order (``shared.camtrap_dp.TIMESTAMP_SOURCES``): the photo's EXIF ``DateTimeOriginal`` (else ``DateTime``,
read by :func:`edge_sdk.inference.records.read_timestamp`, with ``OffsetTimeOriginal`` when the camera wrote one),
else the input table's time, else the file's modification time. Camtrap DP wants ISO 8601 with a zone; a time
without one is taken in ``utc_offset`` (the camera clock's zone, ``--utc-offset``).

Table times are read in the forms camera-trap tools write: ISO 8601 with ``T`` or a space, with or without a zone
(``Z``, ``+hh:mm``) or fractional seconds; EXIF's ``YYYY:MM:DD hh:mm:ss``; Timelapse's ``DD-Mon-YYYY hh:mm:ss``
(its separate ``Date`` and ``Time`` columns joined by a space). Timelapse may put a space before a date so that
spreadsheets leave it alone: leading and trailing spaces are ignored.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from PIL import Image

from shared.camtrap_dp import parse_datetime
from shared.errors import DatasetError

from edge_sdk.inference.records import read_timestamp

__all__ = ["parse_table_time", "capture_time"]

_FORMATS = ("%Y:%m:%d %H:%M:%S", "%d-%b-%Y %H:%M:%S", "%d-%b-%Y %H:%M", "%Y-%m-%d %H:%M", "%Y/%m/%d %H:%M:%S",
            "%Y/%m/%d %H:%M")


def parse_table_time(text: str, *, utc_offset: _dt.timezone, origin: str = "") -> str:
    """``text`` as ISO 8601 to the second with a zone (``2009-04-21T00:40:00+08:00``).

    Raises:
        DatasetError: not a date and time in one of the forms of the module docstring.
    """
    value = text.strip()
    moment: _dt.datetime | None = None
    try:
        moment = parse_datetime(value)
    except ValueError:
        for fmt in _FORMATS:
            try:
                moment = _dt.datetime.strptime(value, fmt)
                break
            except ValueError:
                continue
    if moment is None or (moment.hour, moment.minute, moment.second) == (0, 0, 0) and len(value) <= 10:
        raise DatasetError(f"capture time {text!r} is not a date and time", source=origin or None, field="timestamp",
                           fix="write it as YYYY-MM-DD hh:mm:ss (ISO 8601, optionally with a zone), or leave it "
                               "empty to use the photo's EXIF or file time")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=utc_offset)
    return moment.replace(microsecond=0).isoformat()


def capture_time(path: Path, image: Image.Image | None, table_time: str | None, *, utc_offset: _dt.timezone,
                 origin: str = "") -> tuple[str, str]:
    """``(timestamp, source)`` of a photo, source ``exif``, ``table`` or ``mtime`` (see the module docstring).

    Args:
        path: the image file.
        image: the opened image (its EXIF is read), or None.
        table_time: the input table's time for it, or None / ``""``.
        utc_offset: zone of times written without one.
        origin: where ``table_time`` was read, for the error message.

    Raises:
        DatasetError: ``table_time`` is given, is needed (no EXIF time) and does not parse.
    """
    timestamp, source = read_timestamp(path, image, utc_offset=utc_offset)
    if source == "exif":
        return timestamp, "exif"
    if table_time and table_time.strip():
        return parse_table_time(table_time, utc_offset=utc_offset, origin=origin), "table"
    return timestamp, "mtime"
