"""Images served to roles without exact locations carry no metadata, through the real HTTP app.

Each test image carries the position "51.18400N 5.65900E" in every place a camera or a cataloguing tool writes
text: the EXIF GPS IFD, ImageDescription, Artist, XPComment (UTF-16LE), UserComment, the maker note, a JPEG COM
segment, an XMP packet (APP1), an IPTC block (APP13), and for PNG ``tEXt``, ``zTXt``, ``iTXt`` and an XMP ``iTXt``
chunk. Before the fix all of these but the GPS IFD (and everything, for an image without a GPS block) reached a
partner. The checks are independent of the code under test: the JPEG markers and PNG chunks of the served file are
listed by a parser written here (JPEG: ITU-T T.81 Annex B; PNG: ISO/IEC 15948), the raw bytes are searched for the
text in UTF-8, UTF-16LE and UTF-16BE, and Pillow's parsed metadata of the served image is read back. The upright
pixels are computed with numpy (EXIF Orientation 6 means "rotate 90 degrees clockwise to display").
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from coordinator.storage import DetectionRow
from coordinator.web.app import create_app
from coordinator.web.formats import import_megadetector
from coordinator.web.media import strip_metadata
from tests.coordinator.test_web_app import login
from tests.coordinator.web_fixtures import HASHER, seed

POSITION = "51.18400N 5.65900E"
NEEDLES = [POSITION.encode(enc) for enc in ("utf-8", "utf-16-le", "utf-16-be")] + [b"51.184", b"5.659",
                                                                                     b"51,184"]
GPS = {1: "N", 2: (51.0, 11.0, 2.4), 3: "E", 4: (5.0, 39.0, 32.4)}  # 51 deg 11' 2.4" = 51.184, 5 deg 39' 32.4" = 5.659
XMP = (b'<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
       b'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description xmlns:exif='
       b'"http://ns.adobe.com/exif/1.0/" exif:GPSLatitude="51,11.04N" exif:GPSLongitude="5,39.54E" '
       b'xmlns:dc="http://purl.org/dc/elements/1.1/" dc:description="' + POSITION.encode() + b'"/></rdf:RDF>'
       b'</x:xmpmeta><?xpacket end="w"?>')
W, H = 64, 48


def _exif(orientation: int | None) -> Image.Exif:
    exif = Image.Exif()
    exif[0x010E] = f"camera at {POSITION}"  # ImageDescription
    exif[0x013B] = f"ranger station {POSITION}"  # Artist
    exif[0x9C9C] = f"{POSITION}\x00".encode("utf-16-le")  # XPComment (Windows, UTF-16LE)
    exif[0x010F] = "Reconyx"  # Make
    if orientation is not None:
        exif[0x0112] = orientation
    exif.get_ifd(0x8825).update(GPS)
    sub = exif.get_ifd(0x8769)
    sub[0x9286] = b"ASCII\x00\x00\x00" + POSITION.encode()  # UserComment with its character-code prefix
    sub[0x927C] = b"VENDOR\x00" + POSITION.encode()  # MakerNote
    sub[0x9003] = "2024:05:01 06:12:33"  # DateTimeOriginal
    return exif


def _picture() -> Image.Image:
    """64 x 48 RGB, a smooth gradient with a red 16 x 16 block at the stored top-left corner."""
    yy, xx = np.mgrid[0:H, 0:W]
    arr = np.stack([(xx * 3) % 256, (yy * 5) % 256, np.full_like(xx, 90)], axis=-1).astype(np.uint8)
    arr[0:16, 0:16] = (230, 20, 20)
    return Image.fromarray(arr, "RGB")


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def jpeg_with_everything() -> bytes:
    """A JPEG with the position in EXIF (GPS and text tags), COM, XMP (APP1) and IPTC (APP13); Orientation 6."""
    buf = io.BytesIO()
    _picture().save(buf, "JPEG", exif=_exif(6), comment=f"shot at {POSITION}".encode(), quality=90)
    data = buf.getvalue()
    iptc = b"\x1c\x02\x78" + struct.pack(">H", len(POSITION)) + POSITION.encode()  # IPTC 2:120 Caption
    app13 = b"Photoshop 3.0\x00" + b"8BIM\x04\x04\x00\x00" + struct.pack(">I", len(iptc)) + iptc
    extra = _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\x00" + XMP) + _segment(0xED, app13)
    return data[:2] + extra + data[2:]


def png_with_everything() -> bytes:
    """A PNG with the position in an eXIf chunk (GPS and text tags), tEXt, zTXt, iTXt and XMP iTXt; Orientation 6."""
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", f"tEXt {POSITION}")
    info.add_text("Description", f"zTXt {POSITION}", zip=True)
    info.add_itxt("Location", f"iTXt {POSITION}", lang="en", tkey="Ort")
    info.add_itxt("XML:com.adobe.xmp", XMP.decode())
    buf = io.BytesIO()
    _picture().save(buf, "PNG", pnginfo=info, exif=_exif(6).tobytes())
    return buf.getvalue()


def jpeg_without_gps() -> bytes:
    """The case that was served byte for byte: no GPS IFD, the position in ImageDescription and COM only."""
    exif = Image.Exif()
    exif[0x010E] = POSITION
    buf = io.BytesIO()
    _picture().save(buf, "JPEG", exif=exif, comment=POSITION.encode(), quality=90)
    return buf.getvalue()


def tiff_with_text() -> bytes:
    """A TIFF whose own tags (ImageDescription, Artist) carry the position."""
    buf = io.BytesIO()
    _picture().save(buf, "TIFF", tiffinfo={0x010E: POSITION, 0x013B: POSITION})
    return buf.getvalue()


# ---- independent parsers -------------------------------------------------------------------------------------------
def jpeg_markers(data: bytes) -> list[int]:
    """Marker codes of a baseline/progressive JPEG up to and including SOS, then EOI (T.81 Annex B)."""
    assert data[:2] == b"\xff\xd8"
    out, i = [0xD8], 2
    while i < len(data):
        assert data[i] == 0xFF, f"no marker at {i}"
        marker = data[i + 1]
        out.append(marker)
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker == 0xDA:  # start of scan: entropy-coded data follows up to EOI
            assert data.rstrip(b"\x00")[-2:] == b"\xff\xd9"
            out.append(0xD9)
            return out
        i += 2 + length
    raise AssertionError("no SOS")


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk of a PNG (ISO/IEC 15948 5.3), CRCs checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = [], 8
    while i < len(data):
        n = struct.unpack(">I", data[i:i + 4])[0]
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        assert struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0] == zlib.crc32(kind + body)
        out.append((kind, body))
        i += 12 + n
    return out


def carries_position(data: bytes) -> bool:
    return any(n in data for n in NEEDLES)


def assert_clean(served: bytes) -> Image.Image:
    """Assert the served image has no metadata at all, by structure, raw bytes and Pillow's parse."""
    assert not carries_position(served)
    img = Image.open(io.BytesIO(served))
    if served[:2] == b"\xff\xd8":
        # SOI, APP0 (JFIF), DQT, SOF0/SOF2, DHT, SOS, EOI; no APP1..APP15 (EXIF, XMP, IPTC, ICC) and no COM
        assert set(jpeg_markers(served)) <= {0xD8, 0xE0, 0xDB, 0xC0, 0xC2, 0xC4, 0xDD, 0xDA, 0xD9}
        assert served.count(b"JFIF\x00") == 1
    else:
        kinds = [k for k, _ in png_chunks(served)]
        assert set(kinds) <= {b"IHDR", b"PLTE", b"tRNS", b"IDAT", b"IEND"}, kinds
        raw = zlib.decompress(b"".join(b for k, b in png_chunks(served) if k == b"IDAT"))
        assert not carries_position(raw)
    assert not dict(img.getexif()) and not img.getexif().get_ifd(0x8825)
    assert not (set(img.info) - {"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "transparency"}), img.info
    assert not getattr(img, "text", {})
    return img


def upright(data: bytes) -> np.ndarray:
    """The stored pixels turned as EXIF Orientation 6 says (90 degrees clockwise), by numpy."""
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return np.rot90(stored, k=-1)


# ---- tests ---------------------------------------------------------------------------------------------------------
def test_the_fixtures_really_carry_the_position_everywhere() -> None:
    jpeg, png = jpeg_with_everything(), png_with_everything()
    img = Image.open(io.BytesIO(jpeg))
    exif = img.getexif()
    assert POSITION in exif[0x010E] and POSITION in exif[0x013B] and exif.get_ifd(0x8825)[1] == "N"
    assert POSITION.encode() in exif.get_ifd(0x8769)[0x9286]
    assert POSITION.encode() in img.info["comment"] and b"xap/1.0" in jpeg and b"Photoshop 3.0" in jpeg
    assert 0xFE in jpeg_markers(jpeg) and 0xED in jpeg_markers(jpeg)
    text = Image.open(io.BytesIO(png)).text
    assert all(POSITION in text[k] for k in ("Comment", "Description", "Location"))
    assert {b"tEXt", b"zTXt", b"iTXt", b"eXIf"} <= {k for k, _ in png_chunks(png)}
    assert POSITION.encode() not in b"".join(b for k, b in png_chunks(png) if k == b"zTXt")  # compressed there
    assert POSITION in Image.open(io.BytesIO(tiff_with_text())).getexif()[0x010E]


@pytest.mark.parametrize("make", [jpeg_with_everything, png_with_everything, jpeg_without_gps, tiff_with_text])
def test_strip_metadata_keeps_the_pixels_and_nothing_else(make) -> None:
    original = make()
    served = strip_metadata(original)
    img = assert_clean(served)
    oriented = make in (jpeg_with_everything, png_with_everything)
    want = upright(original) if oriented else np.asarray(Image.open(io.BytesIO(original)).convert("RGB"))
    got = np.asarray(img.convert("RGB"))
    assert got.shape == want.shape == ((W, H, 3) if oriented else (H, W, 3))
    if img.format == "PNG":
        assert np.array_equal(got, want)  # lossless
    else:
        assert img.format == "JPEG"
        assert np.abs(got.astype(int) - want.astype(int)).mean() < 3.0  # one more generation, its own tables
    if oriented:  # the red block of the stored top-left corner is now at the top right (x 32..47, y 0..15)
        assert got[2:14, 34:46, 0].mean() > 200
        assert got[2:14, 2:14, 0].mean() < 200


def test_partners_and_public_are_served_images_with_no_metadata(tmp_path) -> None:
    st = seed(tmp_path, real_data=False)
    images = tmp_path / "images"
    images.mkdir()
    files = {"IMG_0001.JPG": jpeg_with_everything(), "IMG_0002.PNG": png_with_everything(),
             "IMG_0003.JPG": jpeg_without_gps(), "IMG_0004.TIF": tiff_with_text()}
    for name, data in files.items():
        (images / name).write_bytes(data)
    batch = {"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal"},
             "images": [{"file": name, "detections": [{"category": "1", "conf": 0.9, "bbox": [0.1, 0.2, 0.3, 0.4]}]}
                        for name in files]}
    (tmp_path / "md.json").write_text(json.dumps(batch))
    # dep-ridge: a deployment that is not protected, so the image is served to partners with its time: the
    # metadata must go whatever the place
    for dep in ("dep-ridge",):
        import_megadetector(st.store, tmp_path / "md.json", site_id="site-a", deployment_id=dep, images_dir=images)
    with st.store.session() as s:
        by_file = {r.file: r.media_id for r in s.query(DetectionRow).filter(DetectionRow.source.like("import:%"))}
    assert set(by_file) == set(files)
    app = create_app(st.config, store=st.store, hasher=HASHER)
    for user in ("rita", "olga", "paul", "pia"):
        c, _ = login(app, user)
        items = c.get("/api/detections", params={"limit": 500}).json()["items"]
        refs = {i["media_id"]: i["id"] for i in items if i["has_image"]}
        for name, original in files.items():
            r = c.get(f"/detections/{refs[by_file[name]]}/image")
            assert r.status_code == 200, (user, name, r.text)
            if user in ("rita", "olga"):  # exact-location roles get the stored file
                assert r.content == original
                continue
            img = assert_clean(r.content)
            assert r.headers["content-type"] == ("image/jpeg" if name.endswith(".JPG") else "image/png")
            assert r.headers["content-type"] == Image.MIME[img.format]


# ---- pixels only, not the encoder's tables; every pixel mode ------------------------------------------------------
# ITU-T T.81 Annex K, tables K.1 (luminance) and K.2 (chrominance), row-major
K1 = [16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
      14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
      49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99]
K2 = [17, 18, 24, 47] + [99] * 4 + [18, 21, 26, 66] + [99] * 4 + [24, 26, 56] + [99] * 5 + [47, 66] + [99] * 6 \
    + [99] * 32


def standard_table(table: list[int], quality: int) -> list[int]:
    """libjpeg's jpeg_quality_scaling + jpeg_add_quant_table (baseline: clamped to 1..255)."""
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    return [min(255, max(1, (q * scale + 50) // 100)) for q in table]


def jpeg_with_text_in_its_tables() -> bytes:
    """A JPEG whose luminance quantization table holds the position as ASCII codes (the trial's crafted file)."""
    text = list(POSITION.encode())
    lum = (text + [1] * 64)[:64]
    buf = io.BytesIO()
    _picture().save(buf, "JPEG", qtables=[lum, lum], subsampling=0)
    data = buf.getvalue()
    assert bytes(list(Image.open(io.BytesIO(data)).quantization[0])[:len(text)]) == POSITION.encode()
    return data


def float_tiff() -> bytes:
    """A 32-bit float TIFF (mode F), values -3.5 .. 12.25: a gradient the partner must see scaled to 0..255."""
    yy, xx = np.mgrid[0:H, 0:W]
    arr = (xx * 0.25 - 3.5 + yy * 0.0).astype(np.float32)
    arr[0, 0] = 12.25
    buf = io.BytesIO()
    Image.fromarray(arr, "F").save(buf, "TIFF")
    return buf.getvalue()


def sixteen_bit_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.arange(W * H).reshape(H, W) * 20).astype(np.uint16)).save(buf, "PNG")
    return buf.getvalue()


def cmyk_tiff() -> bytes:
    buf = io.BytesIO()
    _picture().convert("CMYK").save(buf, "TIFF")
    return buf.getvalue()


def test_partners_get_standard_jpeg_tables_and_every_pixel_mode_re_encoded(tmp_path) -> None:
    from coordinator.web.media import JPEG_QUALITY

    st = seed(tmp_path, real_data=False)
    images = tmp_path / "images"
    images.mkdir()
    files = {"Q.JPG": jpeg_with_text_in_its_tables(), "F.TIF": float_tiff(), "I16.PNG": sixteen_bit_png(),
             "CMYK.TIF": cmyk_tiff()}
    for name, data in files.items():
        (images / name).write_bytes(data)
    batch = {"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal"},
             "images": [{"file": name, "detections": [{"category": "1", "conf": 0.9, "bbox": [0.1, 0.2, 0.3, 0.4]}]}
                        for name in files]}
    (tmp_path / "md.json").write_text(json.dumps(batch))
    import_megadetector(st.store, tmp_path / "md.json", site_id="site-a", deployment_id="dep-ridge", images_dir=images)
    with st.store.session() as s:
        by_file = {r.file: r.media_id for r in s.query(DetectionRow).filter(DetectionRow.source.like("import:%"))}
    app = create_app(st.config, store=st.store, hasher=HASHER)
    for user in ("paul", "pia"):
        c, _ = login(app, user)
        refs = {i["media_id"]: i["id"] for i in c.get("/api/detections", params={"limit": 500}).json()["items"]}
        served = {}
        for name in files:
            r = c.get(f"/detections/{refs[by_file[name]]}/image")
            assert r.status_code == 200, (user, name, r.status_code, r.text)
            served[name] = Image.open(io.BytesIO(r.content))
            assert_clean(r.content)
        q = served["Q.JPG"].quantization
        assert list(q[0]) == standard_table(K1, JPEG_QUALITY)
        assert list(q[1]) == standard_table(K2, JPEG_QUALITY)
        assert POSITION.encode() not in bytes(min(255, v) for v in q[0])
        f = np.asarray(served["F.TIF"])
        assert served["F.TIF"].mode == "L" and f.shape == (H, W)
        # -3.5 .. 12.25 scaled to 0 .. 255: x * 0.25 - 3.5 -> (x * 0.25) * 255 / 15.75
        want = np.rint(np.arange(W) * 0.25 * 255 / 15.75)
        assert np.array_equal(f[1], want) and f[0, 0] == 255
        i16 = np.asarray(served["I16.PNG"])
        assert i16.dtype == np.uint8 and i16[0, 0] == 0 and i16[-1, -1] == 255
        assert served["CMYK.TIF"].mode == "RGB"
