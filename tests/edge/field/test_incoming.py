"""The incoming folder: a file is read only once it has stopped changing for the settle time (a fake clock: no
sleeps); temporary and hidden names are never read; a file that never decodes is moved aside after give_up_s."""

from __future__ import annotations

import os
from pathlib import Path

from edge_sdk.field.incoming import IncomingFolder


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_half_written_file_is_read_only_when_complete(tmp_path: Path) -> None:
    clock = Clock()
    folder = IncomingFolder(tmp_path / "in", settle_s=5, clock=clock)
    photo = folder.root / "cam1" / "IMG_0001.JPG"
    photo.parent.mkdir()
    photo.write_bytes(b"x" * 100)  # the first half
    assert folder.scan() == []  # first seen
    clock.now = 4.9
    assert folder.scan() == []  # not yet settled
    with photo.open("ab") as f:  # the second half arrives
        f.write(b"y" * 100)
    os.utime(photo, ns=(photo.stat().st_atime_ns, photo.stat().st_mtime_ns + 1))
    clock.now = 6.0
    assert folder.scan() == []  # it changed: the settle time starts again
    clock.now = 10.9
    assert folder.scan() == []
    clock.now = 11.0
    assert folder.scan() == [photo]
    folder.done(photo)
    photo.unlink()
    assert folder.scan() == [] and folder.pending() == 0


def test_temporary_and_hidden_names_are_never_read(tmp_path: Path) -> None:
    clock = Clock()
    folder = IncomingFolder(tmp_path / "in", settle_s=0, clock=clock)
    for name in ("a.jpg.part", ".b.jpg", "~c.jpg", "d.txt", ".hidden/e.jpg", "f.JPG"):
        (folder.root / name).parent.mkdir(parents=True, exist_ok=True)
        (folder.root / name).write_bytes(b"z")
    folder.scan()
    assert folder.scan() == [folder.root / "f.JPG"]


def test_a_file_that_never_decodes_is_moved_aside(tmp_path: Path) -> None:
    clock = Clock()
    folder = IncomingFolder(tmp_path / "in", settle_s=1, give_up_s=100, clock=clock)
    bad = folder.root / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    folder.scan()
    clock.now = 1.0
    assert folder.scan() == [bad]
    assert folder.defer(bad, "cannot identify image") is False  # deferred: tried again after a settle time
    assert folder.scan() == []
    clock.now = 2.0
    assert folder.scan() == [bad]
    clock.now = 100.0
    assert folder.defer(bad, "cannot identify image") is True
    assert not bad.exists() and (folder.root / ".failed" / "bad.jpg").read_bytes() == b"not a jpeg"
    assert folder.scan() == []


def test_a_file_that_is_not_a_photo_is_reported_once_and_left_alone(tmp_path: Path, caplog) -> None:
    import logging

    folder = IncomingFolder(tmp_path / "in", settle_s=0, clock=Clock())
    (folder.root / "clip.mp4").write_bytes(b"video")
    with caplog.at_level(logging.WARNING, logger="edge_sdk.field.incoming"):
        folder.scan()
        folder.scan()
    lines = [r.getMessage() for r in caplog.records if "clip.mp4" in r.getMessage()]
    assert len(lines) == 1 and "not a photo" in lines[0] and (folder.root / "clip.mp4").exists()
