"""Photos for the review page: read from the site's package on disk, never from outside it, downscaled and
re-encoded.

A photo's file is the ``filePath`` the field loop stored for it (``edge_sdk.field.store.FieldStore.photo``, e.g.
``media/ab/<mediaID>.jpg``) under the package root. :func:`photo_file` resolves it (symlinks and ``..`` included)
and refuses anything that does not end up inside the package: an absolute path, ``../``, or a link out of the
folder raise :class:`OutsidePackageError`, so a tampered index cannot make the page serve other files of the
gateway.

:class:`PhotoRenderer` re-encodes each photo as a JPEG of at most :data:`SIZES` pixels on its long side. The
pixels are the stored frame exactly as the field loop decoded it (``edge_sdk.data.crops.decode_rgb``: no EXIF
rotation), and the re-encoded file carries no EXIF, so a browser shows the same frame the detection boxes were
measured in (a browser applies EXIF orientation to an original file, which would turn the photo under its boxes).
Re-encoding also drops the camera's metadata, and a thumbnail of a 12-megapixel photo is some 20 KB instead of
several MB on a field network. JPEG decoding uses Pillow's draft mode (DCT scaling by 1/2, 1/4 or 1/8), so a
thumbnail costs a fraction of a full decode; results are kept in a small in-memory LRU cache (media ids are content
hashes, so a cached rendering never goes stale).
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from pathlib import Path

__all__ = ["SIZES", "OutsidePackageError", "photo_file", "PhotoRenderer"]

#: Rendering name -> longest side in pixels (None: the stored size).
SIZES: dict[str, int | None] = {"thumb": 320, "view": 1280, "full": None}


class OutsidePackageError(PermissionError):
    """A photo's stored path leads outside the package folder."""


def photo_file(package_root: Path, file_path: str) -> Path:
    """The file of a photo whose package ``filePath`` is ``file_path``, resolved.

    Raises:
        OutsidePackageError: the path is absolute, or resolves (through ``..`` or a symbolic link) outside
            ``package_root``.
        FileNotFoundError: it is inside but absent.
    """
    root = Path(package_root).resolve()
    relative = Path(file_path)
    if not file_path or relative.is_absolute() or file_path.startswith(("/", "\\")):
        raise OutsidePackageError(f"photo path {file_path!r} is not a path inside the package")
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or target == root:
        raise OutsidePackageError(f"photo path {file_path!r} leads outside the package ({root})")
    if not target.is_file():
        raise FileNotFoundError(str(target))
    return target


class PhotoRenderer:
    """Downscaled JPEG renderings of photos with an LRU cache (module docstring).

    Args:
        max_cache_bytes: the cache's size limit in bytes (default 64 MiB).
        quality: JPEG quality of the renderings (1-95).
    """

    def __init__(self, *, max_cache_bytes: int = 64 << 20, quality: int = 85) -> None:
        self.max_cache_bytes = int(max_cache_bytes)
        self.quality = int(quality)
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def render(self, key: str, path: Path, size: str) -> bytes:
        """The JPEG bytes of ``path`` at rendering ``size`` (a key of :data:`SIZES`); ``key`` names the photo in
        the cache (its media id).

        Raises:
            KeyError: an unknown size.
            OSError: the file does not decode.
        """
        longest = SIZES[size]
        with self._lock:
            cached = self._cache.get((key, size))
            if cached is not None:
                self._cache.move_to_end((key, size))
                return cached
        data = self._encode(path, longest)
        with self._lock:
            if len(data) <= self.max_cache_bytes // 4:
                self._cache[(key, size)] = data
                self._bytes += len(data)
                while self._bytes > self.max_cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._bytes -= len(old)
        return data

    def _encode(self, path: Path, longest: int | None) -> bytes:
        from PIL import Image

        with Image.open(path) as image:
            if longest is not None and max(image.size) > longest:
                scale = longest / max(image.size)
                image.draft("RGB", (max(1, int(image.width * scale)), max(1, int(image.height * scale))))
            rgb = image.convert("RGB")
        if longest is not None and max(rgb.size) > longest:
            rgb.thumbnail((longest, longest), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        rgb.save(out, "JPEG", quality=self.quality, optimize=True)
        return out.getvalue()
