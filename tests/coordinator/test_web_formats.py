"""Exchange formats of the web view (coordinator.web.formats, coordinator.web.media): MegaDetector batch output in,
Camtrap DP 1.0 out, and the metadata-free copies of images served to partners.

Real photos are those of the Camtrap DP example package in ``../shared/data`` (tests that need them skip when it is
absent). Expected values are computed independently: media ids and blob names by hashing the files, image sizes from
the EXIF PixelXDimension/PixelYDimension tags, records written out by hand, distances by the haversine formula, and
the Camtrap DP column names typed from the Camtrap DP 1.0 table schemas (https://camtrap-dp.tdwg.org/data/)."""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image, ImageChops, ImageStat

from shared.errors import ConfigError, DatasetError

from coordinator.storage import DeploymentRow, DetectionRow, SiteRow, Store
from coordinator.web.auth import Role
from coordinator.web.deployments import species_table_categories
from coordinator.web.formats import export_camtrap_dp, export_camtrap_dp_zip, import_megadetector
from coordinator.web.location_privacy import LocationPolicy, haversine_m
from coordinator.web.media import exif_capture_time, image_info, strip_metadata
from coordinator.web.views import Viewer
from tests.support import SHARED_DATA

DATA_ROOT = SHARED_DATA
MEDIA = DATA_ROOT / "camtrap-dp-example" / "media"
SECRET = bytes(range(32))
TABLE = species_table_categories([SimpleNamespace(scientific_name="Tapirus bairdii", iucn_category="EN"),
                                  SimpleNamespace(scientific_name="Panthera onca", iucn_category="NT")])
GPS = 0x8825

# Camtrap DP 1.0 table schemas, field names in order (deployments, media, observations)
CAMTRAP_DEPLOYMENTS = ["deploymentID", "locationID", "locationName", "latitude", "longitude",
                       "coordinateUncertainty", "deploymentStart", "deploymentEnd", "setupBy", "cameraID",
                       "cameraModel", "cameraDelay", "cameraHeight", "cameraDepth", "cameraTilt", "cameraHeading",
                       "detectionDistance", "timestampIssues", "baitUse", "featureType", "habitat",
                       "deploymentGroups", "deploymentTags", "deploymentComments"]
CAMTRAP_MEDIA = ["mediaID", "deploymentID", "captureMethod", "timestamp", "filePath", "filePublic", "fileName",
                 "fileMediatype", "exifData", "favorite", "mediaComments"]
CAMTRAP_OBSERVATIONS = ["observationID", "deploymentID", "mediaID", "eventID", "eventStart", "eventEnd",
                        "observationLevel", "observationType", "cameraSetupType", "scientificName", "count",
                        "lifeStage", "sex", "behavior", "individualID", "individualPositionRadius",
                        "individualPositionAngle", "individualSpeed", "bboxX", "bboxY", "bboxWidth", "bboxHeight",
                        "classificationMethod", "classifiedBy", "classificationTimestamp",
                        "classificationProbability", "observationTags", "observationComments"]
OBSERVATION_TYPES = {"animal", "human", "vehicle", "blank", "unknown", "unclassified"}


def _need_media() -> list[Path]:
    files = sorted(MEDIA.glob("*.JPG")) if MEDIA.is_dir() else []
    if len(files) < 2:
        pytest.skip(f"real data not present at {MEDIA}"
                    " (set WILDFED_SHARED_DATA to the data folder; a fresh clone has no ../shared/data)")
    return files


def _store(tmp_path: Path, *sites: str) -> Store:
    store = Store("sqlite://", tmp_path / "data")
    with store.session() as s:
        for site in sites:
            s.add(SiteRow(site_id=site, public_key_pem="-", metadata_json="{}"))
    return store


def _rows(store: Store) -> list[DetectionRow]:
    with store.session() as s:
        return list(s.query(DetectionRow).order_by(DetectionRow.id))


def _blobs(store: Store) -> list[Path]:
    return sorted(p for p in store.blob_dir.rglob("*.bin")) if store.blob_dir.exists() else []


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _with_gps(src: bytes) -> bytes:
    img = Image.open(io.BytesIO(src))
    exif = img.getexif()
    exif.get_ifd(GPS).update({1: "N", 2: (51.0, 29.0, 45.6), 3: "E", 4: (4.0, 46.0, 26.4)})
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=95, exif=exif.tobytes())
    return out.getvalue()


# ---- media -----------------------------------------------------------------------------------------------------

def test_strip_metadata_of_a_real_photo_keeps_only_its_pixels() -> None:
    original = _need_media()[0].read_bytes()
    tagged = _with_gps(original)
    assert GPS in Image.open(io.BytesIO(tagged)).getexif()  # the fixture really carries a position
    assert Image.open(io.BytesIO(original)).getexif()[271] == "RECONYX"  # and the camera its own tags
    for source in (tagged, original):  # with or without a GPS block: the same treatment
        stripped = strip_metadata(source)
        out = Image.open(io.BytesIO(stripped))
        assert out.format == "JPEG" and not dict(out.getexif())
        assert set(out.info) <= {"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi"}
        assert b"RECONYX" not in stripped and b"Exif" not in stripped
        a, b = Image.open(io.BytesIO(source)).convert("RGB"), out.convert("RGB")
        assert a.size == b.size
        assert max(ImageStat.Stat(ImageChops.difference(a, b)).mean) < 2.0  # one generation, its own tables


def test_strip_metadata_png_is_lossless_and_non_images_are_refused() -> None:
    img = Image.new("RGB", (40, 30), (10, 200, 30))
    img.putpixel((3, 4), (255, 0, 0))
    exif = Image.Exif()
    exif[271] = "TestCam"
    exif.get_ifd(GPS).update({1: "S", 2: (3.0, 30.0, 0.0)})
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=exif.tobytes())
    stripped = strip_metadata(buf.getvalue())
    out = Image.open(io.BytesIO(stripped))
    assert out.format == "PNG" and not dict(out.getexif()) and b"TestCam" not in stripped
    assert out.convert("RGB").tobytes() == img.tobytes()
    assert image_info(stripped) == (40, 30, "image/png")
    for bad in (b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20):
        with pytest.raises(DatasetError, match="image"):
            strip_metadata(bad)
        with pytest.raises(DatasetError):
            image_info(bad)


def test_image_info_and_capture_time_of_real_photos() -> None:
    for path in _need_media():
        data = path.read_bytes()
        exif = Image.open(io.BytesIO(data)).getexif().get_ifd(0x8769)
        assert image_info(data) == (exif[40962], exif[40963], "image/jpeg")
        raw = str(exif[36867])  # "YYYY:MM:DD HH:MM:SS"
        expected = raw[:4] + "-" + raw[5:7] + "-" + raw[8:10] + "T" + raw[11:] + "+00:00"
        assert exif_capture_time(data) == expected


# ---- MegaDetector import ---------------------------------------------------------------------------------------

def _results() -> dict:
    return {
        "info": {"format_version": "1.4", "detector": "md_v5a.0.0.pt"},
        "detection_categories": {"1": "animal", "2": "person", "3": "vehicle"},
        "classification_categories": {"0": "Tapirus bairdii", "1": "Panthera onca"},
        "images": [
            {"file": "cam/a.JPG", "detections": [
                {"category": "1", "conf": 0.6, "bbox": [0.1, 0.2, 0.3, 0.4],
                 "classifications": [["1", 0.3], ["0", 0.7]]},
                {"category": "1", "conf": 0.9, "bbox": [0.5, 0.5, 0.2, 0.2], "classifications": [["1", 0.8]]}]},
            {"file": "cam/b.JPG", "detections": [{"category": "2", "conf": 0.95, "bbox": [0.0, 0.0, 0.5, 1.0]}]},
            {"file": "cam/blank.JPG", "detections": [], "width": 640, "height": 480,
             "datetime": "2020-05-30 04:57:37"},
            {"file": "cam/broken.JPG", "detections": None, "failure": "Failure image access"},
        ]}


def _images(tmp_path: Path, files: list[Path]) -> Path:
    root = tmp_path / "images"
    (root / "cam").mkdir(parents=True)
    shutil.copy(files[0], root / "cam" / "a.JPG")
    shutil.copy(files[1], root / "cam" / "b.JPG")
    return root


def test_import_megadetector_values(tmp_path: Path) -> None:
    files = _need_media()
    store = _store(tmp_path, "site-a")
    root = _images(tmp_path, files)
    md = _write(tmp_path / "md.json", _results())
    summary = import_megadetector(store, md, site_id="site-a", deployment_id="dep1", images_dir=root,
                                  category_of=TABLE)
    assert (summary.images, summary.stored, summary.failures, summary.boxes) == (4, 4, 1, 3)
    assert (summary.images_stored, summary.images_withheld, summary.images_missing) == (1, 1, 2)
    assert summary.categories == {"EN": 1, "NT": 1}  # box 1 tapir (EN), box 2 jaguar (NT)
    rows = {r.file: r for r in _rows(store)}
    a_bytes, b_bytes = files[0].read_bytes(), files[1].read_bytes()
    a = rows["cam/a.JPG"]
    sub = Image.open(io.BytesIO(a_bytes)).getexif().get_ifd(0x8769)
    raw = str(sub[36867])
    expected = {
        "media_id": _sha(a_bytes)[:32], "file": "cam/a.JPG", "deployment_id": "dep1",
        "timestamp": f"{raw[:4]}-{raw[5:7]}-{raw[8:10]}T{raw[11:]}+00:00", "timestamp_source": "exif",
        "width": sub[40962], "height": sub[40963], "detector": "md_v5a.0.0.pt", "classifier_hash": "",
        "failure": None,
        "detections": [  # most confident first
            {"category": "animal", "confidence": 0.9, "bbox": [0.5, 0.5, 0.2, 0.2], "species": "Panthera onca",
             "species_index": 1, "species_confidence": 0.8},
            {"category": "animal", "confidence": 0.6, "bbox": [0.1, 0.2, 0.3, 0.4], "species": "Tapirus bairdii",
             "species_index": 0, "species_confidence": 0.7}]}
    assert json.loads(a.record_json) == expected
    assert a.payload_sha256 == _sha(json.dumps(expected, sort_keys=True, separators=(",", ":")).encode())
    assert (a.site_id, a.media_id, a.source, a.sequence) == ("site-a", _sha(a_bytes)[:32], "import:md.json", 0)
    assert (a.num_detections, a.max_confidence, a.top_species, a.top_species_confidence) == (2, 0.9,
                                                                                           "Panthera onca", 0.8)
    assert json.loads(a.species_json) == ["Panthera onca", "Tapirus bairdii"]
    assert a.image_sha256 == _sha(a_bytes) and store.get_blob(a.image_sha256) == a_bytes
    assert abs((a.sent_at - _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None)).total_seconds()) < 60
    # a person in the frame: the row is kept, the image is not
    b = rows["cam/b.JPG"]
    assert b.media_id == _sha(b_bytes)[:32] and b.image_sha256 is None and b.num_detections == 1
    assert json.loads(b.record_json)["detections"][0]["category"] == "person"
    assert _blobs(store) == [store.blob_path(_sha(a_bytes))]
    # no image file: id from "<deployment>/<file>", size and time from the JSON
    blank = rows["cam/blank.JPG"]
    assert blank.media_id == _sha(b"dep1/cam/blank.JPG")[:32] and blank.image_sha256 is None
    assert blank.captured_at == "2020-05-30T04:57:37+00:00" and blank.num_detections == 0
    assert (json.loads(blank.record_json)["width"], json.loads(blank.record_json)["height"]) == (640, 480)
    broken = rows["cam/broken.JPG"]
    assert broken.failure == "Failure image access" and broken.max_confidence is None


def _corrupt(path: list, value: object) -> dict:
    results = _results()
    target = results
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return results


@pytest.mark.parametrize("path, value, field", [
    (["info", "format_version"], KeyError, "info.format_version"),
    (["info", "format_version"], "2.0", "info.format_version"),
    (["detection_categories"], KeyError, "detection_categories"),
    (["detection_categories"], {"animal": "1"}, "detection_categories['animal']"),
    (["images"], {"file": "x"}, "images"),
    (["images", 1, "file"], "", "images[1].file"),
    (["images", 0, "detections", 1, "category"], "9", "images[0].detections[1].category"),
    (["images", 0, "detections", 1, "conf"], "0.9", "images[0].detections[1].conf"),
    (["images", 0, "detections", 1, "conf"], 1.5, "images[0].detections[1].conf"),
    (["images", 0, "detections", 1, "bbox"], [0.5, 0.5, 0.6, 0.2], "images[0].detections[1].bbox"),
    (["images", 0, "detections", 1, "bbox"], [0.5, 0.5, 0.2], "images[0].detections[1].bbox"),
    (["images", 0, "detections", 0, "classifications"], [["7", 0.5]], "images[0].detections[0].classifications[0]"),
    (["images", 3, "failure"], 5, "images[3].failure"),
    (["images", 2, "detections"], None, "images[2].detections"),
    (["images", 2, "width"], -3, "images[2].width"),
    (["images", 2, "datetime"], "yesterday", "images[2].datetime"),
])
def test_invalid_files_are_rejected_whole(tmp_path: Path, path: list, value: object, field: str) -> None:
    files = _need_media()
    store = _store(tmp_path, "site-a")
    root = _images(tmp_path, files)
    md = _write(tmp_path / "md.json", _corrupt(path, value))
    with pytest.raises(DatasetError) as info:
        import_megadetector(store, md, site_id="site-a", deployment_id="dep1", images_dir=root)
    assert info.value.field == field and info.value.fix and "md.json" in str(info.value)
    assert _rows(store) == [] and _blobs(store) == []  # the valid images before the bad field were not written


def test_unreadable_files_sites_and_deployments(tmp_path: Path) -> None:
    store = _store(tmp_path, "site-a")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DatasetError, match="not JSON"):
        import_megadetector(store, tmp_path / "bad.json", site_id="site-a", deployment_id="dep1")
    with pytest.raises(DatasetError, match="not found"):
        import_megadetector(store, tmp_path / "missing.json", site_id="site-a", deployment_id="dep1")
    md = _write(tmp_path / "md.json", _results())
    with pytest.raises(ConfigError, match="not enrolled") as info:
        import_megadetector(store, md, site_id="nobody", deployment_id="dep1")
    assert "enrol nobody" in str(info.value)
    with pytest.raises(ConfigError, match="deployment"):
        import_megadetector(store, md, site_id="site-a")
    with pytest.raises(DatasetError, match="images folder"):
        import_megadetector(store, md, site_id="site-a", deployment_id="dep1", images_dir=tmp_path / "nowhere")
    assert _rows(store) == []


def test_reimport_is_idempotent_and_replaces_only_imports(tmp_path: Path) -> None:
    files = _need_media()
    store = _store(tmp_path, "site-a")
    root = _images(tmp_path, files)
    md = _write(tmp_path / "md.json", _results())
    import_megadetector(store, md, site_id="site-a", deployment_id="dep1", images_dir=root)
    before = [(r.id, r.media_id, r.payload_sha256, r.image_sha256) for r in _rows(store)]
    again = import_megadetector(store, md, site_id="site-a", deployment_id="dep1", images_dir=root)
    assert (again.stored, again.unchanged, again.replaced) == (0, 4, 0)
    assert [(r.id, r.media_id, r.payload_sha256, r.image_sha256) for r in _rows(store)] == before
    changed = _results()
    changed["images"][2]["detections"] = [{"category": "1", "conf": 0.5, "bbox": [0.2, 0.2, 0.1, 0.1]}]
    third = import_megadetector(store, _write(tmp_path / "md.json", changed), site_id="site-a",
                                deployment_id="dep1", images_dir=root)
    assert (third.stored, third.unchanged, third.replaced) == (0, 3, 1)
    blank = {r.file: r for r in _rows(store)}["cam/blank.JPG"]
    assert (blank.num_detections, blank.max_confidence, len(_rows(store))) == (1, 0.5, 4)


def test_gateway_rows_are_never_overwritten(tmp_path: Path) -> None:
    store = _store(tmp_path, "site-a")
    media_id = _sha(b"dep1/cam/blank.JPG")[:32]
    gateway = dict(site_id="site-a", media_id=media_id, deployment_id="dep1", file="cam/blank.JPG",
                   captured_at="2020-01-01T00:00:00+00:00", num_detections=0, record_json="{}", sequence=7,
                   payload_sha256="ab" * 32, sent_at=_dt.datetime(2020, 1, 2), source="gateway")
    with store.session() as s:
        s.add(DetectionRow(**gateway))
    summary = import_megadetector(store, _write(tmp_path / "md.json", _results()), site_id="site-a",
                                  deployment_id="dep1")
    assert (summary.kept_gateway, summary.stored) == (1, 3)
    row = {r.media_id: r for r in _rows(store)}[media_id]
    assert {k: getattr(row, k) for k in gateway} == gateway


# ---- Camtrap DP export -----------------------------------------------------------------------------------------

TRUE = {"d1": (3.5, -77.2, "river"), "d2": (3.6, -77.3, "ridge")}


def _federation(tmp_path: Path, extra_blank: int = 0) -> Store:
    store = _store(tmp_path, "site-a")
    with store.session() as s:
        for dep, (lat, lon, name) in TRUE.items():
            s.add(DeploymentRow(site_id="site-a", deployment_id=dep, latitude=lat, longitude=lon, location_name=name,
                                source="test", categories_json="[]"))
    d1 = {"info": {"format_version": "1.4", "detector": "md"},
          "detection_categories": {"1": "animal", "2": "person"},
          "classification_categories": {"0": "Tapirus bairdii"},
          "images": [{"file": "d1/t.JPG", "datetime": "2021-03-04T05:06:07+02:00", "detections": [
                         {"category": "1", "conf": 0.8, "bbox": [0.125, 0.25, 0.5, 0.375],
                          "classifications": [["0", 0.75]]},
                         {"category": "2", "conf": 0.5, "bbox": [0.0, 0.0, 0.25, 0.5]}]},
                     {"file": "d1/f.JPG", "datetime": "2021-03-05T10:00:00+02:00", "detections": None,
                      "failure": "unreadable"}]}
    d2 = {"info": {"format_version": "1.4", "detector": "md"}, "detection_categories": {"1": "animal"},
          "classification_categories": {"0": "Panthera onca"},
          "images": [{"file": "d2/j.JPG", "datetime": "2021-04-01T12:00:00+00:00", "detections": [
              {"category": "1", "conf": 0.9, "bbox": [0.5, 0.5, 0.25, 0.25], "classifications": [["0", 0.6]]}]}]
          + [{"file": f"d2/e{i}.JPG", "datetime": "2021-04-02T00:00:00+00:00", "detections": []}
             for i in range(extra_blank)]}
    import_megadetector(store, _write(tmp_path / "d1.json", d1), site_id="site-a", deployment_id="d1")
    import_megadetector(store, _write(tmp_path / "d2.json", d2), site_id="site-a", deployment_id="d2")
    return store


def _viewer(store: Store, role: Role) -> Viewer:
    return Viewer(store, role, policy=LocationPolicy(radius_m=1000.0), secret=SECRET, category_of=TABLE)


def _read(folder: Path, name: str) -> tuple[list[str], list[dict[str, str]]]:
    with (folder / name).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_export_follows_the_role_and_the_standard(tmp_path: Path) -> None:
    store = _federation(tmp_path)
    out = {}
    for role in (Role.RANGER, Role.PARTNER):
        package = export_camtrap_dp(_viewer(store, role), tmp_path / role.value)
        assert package == tmp_path / role.value / "datapackage.json"
        out[role] = {n: _read(package.parent, n) for n in ("deployments.csv", "media.csv", "observations.csv")}
        assert out[role]["deployments.csv"][0] == CAMTRAP_DEPLOYMENTS
        assert out[role]["media.csv"][0] == CAMTRAP_MEDIA
        assert out[role]["observations.csv"][0] == CAMTRAP_OBSERVATIONS
        meta = json.loads(package.read_text())
        assert meta["profile"] == "https://raw.githubusercontent.com/tdwg/camtrap-dp/1.0.2/camtrap-dp-profile.json"
        assert {r["name"]: r["schema"] for r in meta["resources"]} == {
            n: f"https://raw.githubusercontent.com/tdwg/camtrap-dp/1.0.2/{n}-table-schema.json"
            for n in ("deployments", "media", "observations")}
        assert meta["temporal"] == {"start": "2021-03-04", "end": "2021-04-01"}
        assert meta["taxonomic"] == [{"scientificName": "Panthera onca"}, {"scientificName": "Tapirus bairdii"}]
        _dt.datetime.strptime(meta["created"], "%Y-%m-%dT%H:%M:%SZ")
        for row in out[role]["observations.csv"][1]:
            assert row["observationType"] in OBSERVATION_TYPES and row["observationLevel"] == "media"

    for role in (Role.RANGER, Role.PARTNER):  # deploymentID: "<site>/<deployment>", unique across sites
        assert sorted(r["deploymentID"] for r in out[role]["deployments.csv"][1]) == ["site-a/d1", "site-a/d2"]
        assert {r["deploymentID"] for r in out[role]["media.csv"][1]} == {"site-a/d1", "site-a/d2"}
    ranger = {r["deploymentID"].removeprefix("site-a/"): r for r in out[Role.RANGER]["deployments.csv"][1]}
    partner = {r["deploymentID"].removeprefix("site-a/"): r for r in out[Role.PARTNER]["deployments.csv"][1]}
    for dep, (lat, lon, name) in TRUE.items():
        assert (float(ranger[dep]["latitude"]), float(ranger[dep]["longitude"])) == (lat, lon)
        assert (ranger[dep]["locationName"], ranger[dep]["coordinateUncertainty"]) == (name, "")
    # d1 recorded an endangered tapir: displaced within 1 km for a partner, uncertainty covers the radius
    lat, lon, _ = TRUE["d1"]
    moved = haversine_m(lat, lon, float(partner["d1"]["latitude"]), float(partner["d1"]["longitude"]))
    assert 0.0 < moved <= 1000.0
    assert int(partner["d1"]["coordinateUncertainty"]) >= 1000 and moved <= int(partner["d1"]["coordinateUncertainty"])
    assert partner["d1"]["locationName"] == "d1" and partner["d1"]["timestampIssues"] == "true"
    assert (float(partner["d2"]["latitude"]), float(partner["d2"]["longitude"]), partner["d2"]["locationName"]) == \
        (3.6, -77.3, "ridge")  # only a near-threatened jaguar: exact for everyone

    # times: a partner gets only the date of d1's records; d2's stay exact; rangers see everything
    pm = {r["mediaID"]: r for r in out[Role.PARTNER]["media.csv"][1]}
    rm = {r["mediaID"]: r for r in out[Role.RANGER]["media.csv"][1]}
    t_id = _sha(b"d1/d1/t.JPG")[:32]
    j_id = _sha(b"d2/d2/j.JPG")[:32]
    assert rm[t_id]["timestamp"] == "2021-03-04T05:06:07+02:00" and pm[t_id]["timestamp"] == "2021-03-04T00:00:00Z"
    assert pm[j_id]["timestamp"] == rm[j_id]["timestamp"] == "2021-04-01T12:00:00+00:00"
    assert rm[t_id]["filePath"] == "d1/t.JPG" and pm[t_id]["filePath"] == f"media/{t_id}"
    assert ranger["d1"]["deploymentStart"] == "2021-03-04T05:06:07+02:00"
    assert ranger["d1"]["deploymentEnd"] == "2021-03-05T10:00:00+02:00"

    obs = {r["observationID"]: r for r in out[Role.RANGER]["observations.csv"][1]}
    assert len(obs) == 4  # two boxes, one failure, one jaguar box
    tapir = obs[f"{t_id}_1"]
    assert (tapir["observationType"], tapir["scientificName"], tapir["classificationProbability"]) == \
        ("animal", "Tapirus bairdii", "0.75")
    assert [float(tapir[k]) for k in ("bboxX", "bboxY", "bboxWidth", "bboxHeight")] == [0.125, 0.25, 0.5, 0.375]
    person = obs[f"{t_id}_2"]
    assert (person["observationType"], person["scientificName"], person["classificationProbability"]) == \
        ("human", "", "0.5")
    failed = obs[f"{_sha(b'd1/d1/f.JPG')[:32]}_0"]
    assert (failed["observationType"], failed["observationComments"]) == ("unclassified", "unreadable")
    assert {r["observationID"] for r in out[Role.PARTNER]["observations.csv"][1]} == set(obs)


def test_export_pages_through_every_record_and_zips(tmp_path: Path) -> None:
    store = _federation(tmp_path, extra_blank=1100)  # more than two pages of 500
    viewer = _viewer(store, Role.RANGER)
    folder = export_camtrap_dp(viewer, tmp_path / "pkg").parent
    _, media = _read(folder, "media.csv")
    _, obs = _read(folder, "observations.csv")
    assert len(media) == 3 + 1100 and len({m["mediaID"] for m in media}) == 1103
    assert sum(o["observationType"] == "blank" for o in obs) == 1100
    archive = zipfile.ZipFile(io.BytesIO(export_camtrap_dp_zip(viewer)))
    assert sorted(archive.namelist()) == ["datapackage.json", "deployments.csv", "media.csv", "observations.csv"]
    for name in ("deployments.csv", "media.csv", "observations.csv"):
        assert archive.read(name) == (folder / name).read_bytes()
    zipped = json.loads(archive.read("datapackage.json"))
    written = json.loads((folder / "datapackage.json").read_text())
    zipped.pop("created"), written.pop("created")
    assert zipped == written


def test_export_columns_match_the_real_example_package() -> None:
    pkg = DATA_ROOT / "camtrap-dp-example"
    if not pkg.is_dir():
        pytest.skip(f"real data not present at {pkg}"
                    " (set WILDFED_SHARED_DATA to the data folder; a fresh clone has no ../shared/data)")
    assert _read(pkg, "deployments.csv")[0] == CAMTRAP_DEPLOYMENTS
    assert _read(pkg, "media.csv")[0] == CAMTRAP_MEDIA
    assert _read(pkg, "observations.csv")[0] == CAMTRAP_OBSERVATIONS


# ---- CLI -------------------------------------------------------------------------------------------------------

def test_cli_import_then_export_as_partner(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from shared.keys import generate_signing_key, save_public_key

    from coordinator.cli import app

    runner = CliRunner()
    home = tmp_path / "fed"
    assert runner.invoke(app, ["init", str(home), "--federation-id", "fmt"]).exit_code == 0
    config = str(home / "coordinator.yaml")
    pub = save_public_key(generate_signing_key().public_key(), tmp_path / "site.pub")
    assert runner.invoke(app, ["enrol", "site-a", "--public-key", str(pub), "--config", config]).exit_code == 0
    md = _write(tmp_path / "md.json", _results())
    r = runner.invoke(app, ["import-detections", str(md), "--site", "site-a", "--deployment", "dep1",
                            "--config", config])
    assert r.exit_code == 0, r.output
    assert "4 new" in r.output
    bad = runner.invoke(app, ["import-detections", str(md), "--site", "nobody", "--deployment", "dep1",
                              "--config", config])
    assert bad.exit_code == 2 and "not enrolled" in bad.output
    r = runner.invoke(app, ["export-camtrap-dp", str(tmp_path / "out"), "--role", "partner", "--config", config])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "out" / "datapackage.json").read_text())
    assert meta["wildfed"] == {"role": "partner", "unplacedDeployments": ["site-a/dep1"], "recordsLeftOut": 4}
    assert runner.invoke(app, ["export-camtrap-dp", str(tmp_path / "x"), "--role", "admin",
                               "--config", config]).exit_code == 2


def test_files_outside_the_images_folder_are_not_read(tmp_path: Path) -> None:
    files = _need_media()
    store = _store(tmp_path, "site-a")
    root = _images(tmp_path, files)
    shutil.copy(files[2], tmp_path / "secret.JPG")
    (root / "cam" / "link.JPG").symlink_to(tmp_path / "secret.JPG")
    results = _results()
    results["images"] = [{"file": "../secret.JPG", "detections": []}, {"file": "cam/link.JPG", "detections": []},
                         {"file": str(tmp_path / "secret.JPG"), "detections": []}]
    summary = import_megadetector(store, _write(tmp_path / "md.json", results), site_id="site-a",
                                  deployment_id="dep1", images_dir=root)
    assert (summary.images_missing, summary.images_stored, _blobs(store)) == (3, 0, [])
    assert {r.media_id for r in _rows(store)} == {_sha(f"dep1/{f['file']}".encode())[:32] for f in results["images"]}


def test_export_into_a_file_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    viewer = Viewer(store, Role.RANGER, policy=LocationPolicy(), secret=SECRET, category_of=TABLE)
    target = tmp_path / "out.txt"
    target.write_text("keep me")
    for out in (target, target / "pkg"):
        with pytest.raises(ConfigError, match="fix: give a folder for the package") as err:
            export_camtrap_dp(viewer, out)
        assert err.value.source == str(out)
    assert target.read_text() == "keep me"
