"""Photos for the review page (edge_sdk.review.media) on hand-made files: the sizes of each rendering worked out by
hand, no EXIF in what is served, paths that leave the package refused; and `wildfed-edge review`'s start-up: the
plain-HTTP warning beyond loopback, TLS options handed to uvicorn, and refused half-given TLS options."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from edge_sdk.cli import app as cli
from edge_sdk.review.media import OutsidePackageError, PhotoRenderer, photo_file


def _jpeg(path: Path, size: tuple[int, int]) -> Path:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW on display; the served copy must not carry it
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (30, 140, 60)).save(path, "JPEG", exif=exif)
    return path


def test_renderings_keep_the_stored_frame_and_drop_exif(tmp_path: Path) -> None:
    path = _jpeg(tmp_path / "pkg" / "media" / "ab" / "abc.jpg", (2000, 1500))
    renderer = PhotoRenderer()
    sizes = {}
    for name in ("thumb", "view", "full"):
        image = Image.open(io.BytesIO(renderer.render("abc", path, name)))
        assert image.format == "JPEG" and not image.getexif(), name  # no Orientation: no turn under the boxes
        sizes[name] = image.size
    # longest side 320 and 1280 (4:3 kept), the stored size for "full"
    assert sizes == {"thumb": (320, 240), "view": (1280, 960), "full": (2000, 1500)}
    path.unlink()
    assert Image.open(io.BytesIO(renderer.render("abc", path, "thumb"))).size == (320, 240)  # from the cache
    with pytest.raises(KeyError):
        renderer.render("abc", path, "poster")


def test_the_cache_stays_within_its_size(tmp_path: Path) -> None:
    renderer = PhotoRenderer(max_cache_bytes=40_000)
    for i in range(20):
        path = _jpeg(tmp_path / f"p{i}.jpg", (400 + i, 300))
        renderer.render(f"m{i}", path, "thumb")
        assert renderer._bytes <= 40_000 and renderer._bytes == sum(len(v) for v in renderer._cache.values())


def test_photo_file_stays_inside_the_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    inside = _jpeg(pkg / "media" / "ab" / "abc.jpg", (10, 10))
    (tmp_path / "secret.txt").write_text("not a photo")
    (pkg / "media" / "ab" / "escape.jpg").symlink_to(tmp_path / "secret.txt")
    (pkg / "media" / "inner.jpg").symlink_to(inside)  # a link that stays inside is fine
    assert photo_file(pkg, "media/ab/abc.jpg") == inside.resolve()
    assert photo_file(pkg, "media/inner.jpg") == inside.resolve()
    for bad in ("../secret.txt", "media/../../secret.txt", str(tmp_path / "secret.txt"), "/etc/passwd",
                "media/ab/escape.jpg", "", ".", "media/.."):
        with pytest.raises(OutsidePackageError):
            photo_file(pkg, bad)
    with pytest.raises(FileNotFoundError):
        photo_file(pkg, "media/ab/none.jpg")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Calls of uvicorn.run (nothing is served)."""
    import uvicorn

    calls: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append({"app": app, **kw}))
    return calls


def test_review_command_warns_beyond_loopback_and_passes_tls(site_config: Path, served: list[dict],
                                                             tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["review", "--config", str(site_config)])
    assert res.exit_code == 0, res.output
    assert "plain HTTP" not in res.output and "http://127.0.0.1:8081/" in res.output
    assert served[-1]["host"] == "127.0.0.1" and served[-1]["port"] == 8081 and "ssl_certfile" not in served[-1]
    assert served[-1]["app"].state.review.secure_cookies is False

    res = runner.invoke(cli, ["review", "-c", str(site_config), "--host", "0.0.0.0", "--port", "9000"])
    assert res.exit_code == 0 and "warning: serving plain HTTP on 0.0.0.0" in " ".join(res.output.split())

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("certificate"), key.write_text("key")
    res = runner.invoke(cli, ["review", "-c", str(site_config), "--host", "0.0.0.0", "--tls-cert", str(cert),
                              "--tls-key", str(key)])
    assert res.exit_code == 0 and "plain HTTP" not in res.output and "https://0.0.0.0:8081/" in res.output
    assert served[-1]["ssl_certfile"] == str(cert) and served[-1]["ssl_keyfile"] == str(key)
    assert served[-1]["app"].state.review.secure_cookies is True

    n = len(served)
    res = runner.invoke(cli, ["review", "-c", str(site_config), "--tls-cert", str(cert)])
    assert res.exit_code == 2 and "--tls-key" in res.output
    res = runner.invoke(cli, ["review", "-c", str(site_config), "--tls-cert", str(cert), "--tls-key",
                              str(tmp_path / "none.pem")])
    assert res.exit_code == 2 and "not a file" in res.output
    res = runner.invoke(cli, ["review", "-c", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2
    assert len(served) == n  # nothing was served
