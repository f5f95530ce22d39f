"""Which photos in the incoming folder are complete: a file is read only once its size and modification time have
not changed for ``settle_s`` seconds.

Photos reach a gateway by an SD card copied into the folder, or by a cellular camera uploading into it over FTP or
SFTP: either way a file exists, half-written, for a while before it is whole. Polling with a settle time works on
every filesystem (inotify does not see writes over NFS or some FUSE mounts, and reports a close-after-write only
for writers on this machine); a file whose size and mtime are unchanged across polls ``settle_s`` apart is taken as
complete. Its decoder is the second check: a JPEG that still fails to decode is put back (:meth:`IncomingFolder.defer`)
and tried again after another settle time, and only one that stays undecodable for ``give_up_s`` is moved aside
into ``.failed/`` (logged, counted: never dropped silently).

Names starting with ``.`` or ``~`` and names ending in ``.part``, ``.tmp``, ``.crdownload`` or ``.filepart`` (the
temporary names of rsync, browsers, WinSCP and FileZilla) are never read; nor is anything under a folder whose name
starts with ``.``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["IMAGE_SUFFIXES", "TEMPORARY_SUFFIXES", "FAILED_FOLDER", "IncomingFolder"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp"})
TEMPORARY_SUFFIXES = (".part", ".tmp", ".crdownload", ".filepart")
#: Folder (inside the incoming folder) where files that never decode are moved.
FAILED_FOLDER = ".failed"


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    changed_at: float  # when its size or mtime was last seen to change
    next_try: float  # not returned before this time (a deferred file waits a settle time)


class IncomingFolder:
    """Polls a folder for complete photos (module docstring).

    Args:
        root: the incoming folder (created if absent).
        settle_s: seconds a file's size and mtime must stay unchanged before it is read (>= 0).
        give_up_s: seconds after which a file that is unchanged but still does not decode is moved to ``.failed/``.
        clock: monotonic clock in seconds (tests pass their own).

    Raises:
        ValueError: negative times.
    """

    def __init__(self, root: str | Path, *, settle_s: float = 5.0, give_up_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if settle_s < 0 or give_up_s < 0:
            raise ValueError(f"settle_s and give_up_s must be >= 0, got {settle_s!r}, {give_up_s!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.settle_s = float(settle_s)
        self.give_up_s = float(give_up_s)
        self._clock = clock
        self._seen: dict[Path, _Seen] = {}
        self._ignored: set[Path] = set()  # files that are not photos, reported once each

    @staticmethod
    def candidate(path: Path, root: Path) -> bool:
        """Whether ``path`` (under ``root``) is a photo this folder reads: an image suffix, not a temporary name,
        not hidden, not under a hidden folder."""
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts[:-1]):
            return False
        name = rel.name
        if name.startswith((".", "~")) or name.lower().endswith(TEMPORARY_SUFFIXES):
            return False
        return path.suffix.lower() in IMAGE_SUFFIXES

    def _files(self) -> list[Path]:
        found = []
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = Path(folder) / name
                if self.candidate(path, self.root):
                    found.append(path)
                elif (not name.startswith((".", "~")) and not name.lower().endswith(TEMPORARY_SUFFIXES)
                      and path not in self._ignored):
                    self._ignored.add(path)  # a video, a text file: said once, left where it is
                    log.warning("incoming: %s is not a photo the gateway reads (%s); it stays where it is", path,
                                ", ".join(sorted(IMAGE_SUFFIXES)))
        return found

    def pending(self) -> int:
        """Photos seen and not yet read (complete or not)."""
        return len(self._seen)

    def scan(self) -> list[Path]:
        """One poll: the files that are complete now (unchanged for ``settle_s``), in name order.

        A file that disappeared is forgotten. A file is returned again at every scan until :meth:`done` or
        :meth:`defer` is called for it.
        """
        now = self._clock()
        present = set()
        ready = []
        for path in self._files():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            present.add(path)
            seen = self._seen.get(path)
            if seen is None or (seen.size, seen.mtime_ns) != (st.st_size, st.st_mtime_ns):
                self._seen[path] = _Seen(st.st_size, st.st_mtime_ns, now, now)
                continue
            if st.st_size > 0 and now - seen.changed_at >= self.settle_s and now >= seen.next_try:
                ready.append(path)
        for gone in set(self._seen) - present:
            del self._seen[gone]
        return ready

    def done(self, path: Path) -> None:
        """``path`` was read (and removed or moved by the caller): forget it."""
        self._seen.pop(path, None)

    def defer(self, path: Path, reason: str) -> bool:
        """``path`` looked complete but did not decode: wait another settle time, or, once it has been unchanged
        and undecodable for ``give_up_s``, move it to ``.failed/`` (logged). Returns True when it was moved."""
        seen = self._seen.get(path)
        now = self._clock()
        if seen is None:
            return False
        if now - seen.changed_at < self.give_up_s:
            seen.next_try = now + self.settle_s  # read again after another settle time (it may still be arriving)
            return False
        target = self.root / FAILED_FOLDER / path.relative_to(self.root)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        self._seen.pop(path, None)
        log.error("incoming: %s does not decode (%s) and has not changed for %.0f s; moved to %s", path, reason,
                  now - seen.changed_at, target)
        return True
