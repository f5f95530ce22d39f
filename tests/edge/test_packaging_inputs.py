"""``wildfed-edge package`` end to end, one test per input kind: the package frictionless validates (offline: this
machine has no internet) with 0 errors, and the gateway's loader reads the expected records from it.

Real data where it helps: camtrapR's species folders (``../shared/data/camtrapr-sample``, skipped when absent) and
the ENA24 labels CSV committed in ``wildfed_sim/assets/ena24``; a Timelapse export and a MegaDetector file written
here in their real formats (column sets and JSON fields from the tools' documentation and source).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.camtrap_dp import timestamp_source

from edge_sdk.cli import app
from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.packaging import validate_package

from .packaging_support import digest, jpeg, no_leftovers, rows, site_config
from tests.support import SHARED_DATA

REPO = Path(__file__).resolve().parents[2]
CAMTRAPR = SHARED_DATA / "camtrapr-sample"
ENA24 = REPO / "wildfed_sim" / "assets" / "ena24"

CAMTRAPR_MAP = {"PBE": "Prionailurus bengalensis", "VTA": "Viverra tangalunga", "MNE": "Macaca nemestrina",
                "EGY": "Echinosorex gymnura", "TRA": "Tragulus"}
ENA24_MAP = {"Virginia Opossum": "Didelphis virginiana", "Eastern Fox Squirrel": "Sciurus niger",
             "American Black Bear": "Ursus americanus", "American Crow": "Corvus brachyrhynchos",
             "Striped Skunk": "Mephitis mephitis", "Chicken": "Gallus gallus", "Grey Fox": "Urocyon cinereoargenteus"}


def _invoke(args: list[str]):
    """``wildfed-edge package ARGS``, on a console wide enough that no table cell wraps, whatever the terminal."""
    return CliRunner().invoke(app, ["package", *args], env={"COLUMNS": "240"})


def _package(args: list[str]) -> str:
    result = _invoke(args)
    assert result.exit_code == 0, result.output
    return result.output


def _frictionless_errors(package: Path) -> int:
    """The error count of ``frictionless validate --json`` run as the operator would, in another process."""
    done = subprocess.run([sys.executable, "-m", "frictionless", "validate", "--json",
                           str(package / "datapackage.json")], capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout)
    assert report["valid"] is (report["stats"]["errors"] == 0)
    return report["stats"]["errors"]


def test_folder_tree_of_species_camtrapr(tmp_path: Path) -> None:
    if not CAMTRAPR.is_dir():
        pytest.skip(f"camtrapR sample photos not found at {CAMTRAPR} (set WILDFED_SHARED_DATA to the data folder)")
    (tmp_path / "map.csv").write_text("code,scientificName\n" + "".join(f"{k},{v}\n" for k, v in CAMTRAPR_MAP.items())
                                      + "UNID,unknown\n")
    (tmp_path / "places.csv").write_text("station,lat,lon\nStationA,5.1,116.2\nStationB,5.2,116.3\n")
    out = tmp_path / "pkg"
    output = _package([str(out), str(CAMTRAPR), "--from", "folder", "--site", "site-07", "--species-map",
                       str(tmp_path / "map.csv"), "--deployments", str(tmp_path / "places.csv"), "--boxes", "none",
                       "--classified-by", "camtrapR"])

    assert _frictionless_errors(out) == 0
    photos = sorted(p for p in CAMTRAPR.rglob("*.JPG"))
    expected = {digest(p): CAMTRAPR_MAP[p.parent.name] for p in photos if p.parent.name != "UNID"}
    data = load_camtrap_dp(out, {n: (i, "LC") for i, n in enumerate(sorted(set(CAMTRAPR_MAP.values())))},
                           image_size=8)
    names = sorted(set(CAMTRAPR_MAP.values()))
    assert {m: names[label] for m, label in zip(data.media_ids, data.labels.tolist())} == expected
    deployments = {r["deploymentID"]: r for r in rows(out / "deployments.csv")}
    assert sorted(deployments) == ["site-07/StationA", "site-07/StationB", "site-07/StationC"]
    assert (deployments["site-07/StationA"]["latitude"], deployments["site-07/StationC"]["latitude"]) == (
        "5.100000", "")
    assert "site-07/StationC" in " ".join(output.split())  # the deployment without coordinates is named
    media = rows(out / "media.csv")
    assert len(media) == len(photos) and {timestamp_source(r["mediaComments"]) for r in media} == {"exif"}
    types = Counter(r["observationType"] for r in rows(out / "observations.csv"))
    assert types == {"animal": len(expected), "unknown": len(photos) - len(expected)}


def test_labels_csv_ena24(tmp_path: Path) -> None:
    (tmp_path / "map.yaml").write_text("".join(f"{k}: {v}\n" for k, v in ENA24_MAP.items()))
    config = site_config(tmp_path, sorted(ENA24_MAP.values()))
    out = tmp_path / "pkg"
    output = _package([str(out), str(ENA24 / "labels.csv"), "--from", "labels", "--site-config", str(config),
                       "--species-map", str(tmp_path / "map.yaml"), "--deployment", "cam-1", "--boxes", "none"])

    assert "timestamps from mtime" in output  # the committed subset has no EXIF and the CSV no time column
    expected = {digest(ENA24 / r["filepath"]): ENA24_MAP[r["label"]] for r in rows(ENA24 / "labels.csv")}
    table = sorted(ENA24_MAP.values())
    data = load_camtrap_dp(out, {n: (i, "LC") for i, n in enumerate(table)}, image_size=8)
    assert {m: table[label] for m, label in zip(data.media_ids, data.labels.tolist())} == expected
    (deployment,) = rows(out / "deployments.csv")
    assert (deployment["deploymentID"], deployment["timestampIssues"]) == ("site-07/cam-1", "true")


TIMELAPSE_EXPORT = """RootFolder,File,RelativePath,DateTime,DeleteFlag,Species,Count,Notes,Favorite
Reserve2024,IMG_0001.JPG,Cam1\\100RECNX, 2024-05-01 06:30:00,false,Sus scrofa,2,,false
Reserve2024,IMG_0002.JPG,Cam1\\100RECNX, 2024-05-01 06:31:10,false,Blank,0,wind,false
Reserve2024,IMG_0003.JPG,Cam1\\100RECNX, 2024-05-01 06:32:00,true,Sus scrofa,1,,false
Reserve2024,IMG_0001.JPG,Cam2, 2024-05-03 21:05:00,false,Sus scrofa,1,night,true
Reserve2024,IMG_0002.JPG,Cam2, 2024-05-03 21:06:00,false,,0,,false
"""


def test_timelapse_export(tmp_path: Path) -> None:
    root = tmp_path / "Reserve2024"
    for i, rel in enumerate(["Cam1/100RECNX/IMG_0001.JPG", "Cam1/100RECNX/IMG_0002.JPG", "Cam2/IMG_0001.JPG"]):
        jpeg(root / rel, (40 * i, 120, 60))  # no EXIF: the export's DateTime is the capture time
    (root / "TimelapseData.csv").write_text(TIMELAPSE_EXPORT)
    out = tmp_path / "pkg"
    output = _package([str(out), str(root / "TimelapseData.csv"), "--from", "timelapse", "--site", "site-07",
                       "--utc-offset", "+03:00", "--boxes", "none"])

    assert validate_package(out) == []
    media = {r["filePath"]: r for r in rows(out / "media.csv")}
    assert {p: (r["deploymentID"], r["timestamp"]) for p, r in media.items()} == {
        "media/Cam1/IMG_0001.JPG": ("site-07/Cam1", "2024-05-01T06:30:00+03:00"),
        "media/Cam1/IMG_0002.JPG": ("site-07/Cam1", "2024-05-01T06:31:10+03:00"),
        "media/Cam2/IMG_0001.JPG": ("site-07/Cam2", "2024-05-03T21:05:00+03:00")}
    assert {timestamp_source(r["mediaComments"]) for r in media.values()} == {"table"}
    flat = " ".join(output.split())
    assert "marked for deletion (DeleteFlag true) │ 1" in flat and "with an empty Species (not reviewed) │ 1" in flat
    data = load_camtrap_dp(out, {"Sus scrofa": (0, "LC")}, image_size=8)
    assert sorted(data.media_ids) == sorted(digest(root / p) for p in ("Cam1/100RECNX/IMG_0001.JPG",
                                                                       "Cam2/IMG_0001.JPG"))


def _megadetector_file(path: Path) -> None:
    """MegaDetector v5 batch output, format 1.4 (three categories, a typical threshold of 0.2)."""
    path.write_text(json.dumps({
        "info": {"format_version": "1.4", "detector": "md_v5a.0.0.pt",
                 "detector_metadata": {"megadetector_version": "v5a.0.0", "typical_detection_threshold": 0.2,
                                       "conservative_detection_threshold": 0.05}},
        "detection_categories": {"1": "animal", "2": "person", "3": "vehicle"},
        "images": [
            {"file": "cam/a.jpg", "detections": [
                {"category": "1", "conf": 0.93, "bbox": [0.1, 0.2, 0.3, 0.4]},
                {"category": "1", "conf": 0.19, "bbox": [0.5, 0.5, 0.1, 0.1]},  # below 0.2: dropped
                {"category": "2", "conf": 0.8, "bbox": [0.6, 0.1, 0.2, 0.7]}]},  # a person on an animal photo
            {"file": "cam/b.jpg", "detections": [{"category": "2", "conf": 0.88, "bbox": [0.25, 0.125, 0.5,
                                                                                          0.875]}]},
            {"file": "cam/c.jpg", "detections": []},
            {"file": "cam/d.jpg", "failure": "Failure image access", "detections": None},
            {"file": "cam/e.jpg", "detections": [{"category": "1", "conf": 0.5, "bbox": [0, 0, 1, 1]}]}]}))


def test_megadetector_output_with_labels(tmp_path: Path) -> None:
    for i, name in enumerate("abcd"):
        jpeg(tmp_path / "run" / "cam" / f"{name}.jpg", (30 * i, 30, 200))
    _megadetector_file(tmp_path / "run" / "md.json")
    (tmp_path / "labels.csv").write_text("file,species\ncam/a.jpg,Sus scrofa\ncam/b.jpg,person\n"
                                         "cam/c.jpg,Sus scrofa\ncam/d.jpg,Sus scrofa\n")
    out = tmp_path / "out" / "pkg"
    output = _package([str(out), str(tmp_path / "run" / "md.json"), "--from", "megadetector", "--labels",
                       str(tmp_path / "labels.csv"), "--images", str(tmp_path / "run"), "--site", "site-07"])

    assert _frictionless_errors(out) == 0
    by_media = {}
    for r in rows(out / "observations.csv"):
        by_media.setdefault(r["mediaID"], []).append(
            (r["observationType"], r["scientificName"], r["bboxX"], r["bboxY"], r["bboxWidth"], r["bboxHeight"]))
    photo = {n: digest(tmp_path / "run" / "cam" / f"{n}.jpg") for n in "abcd"}
    assert by_media == {
        photo["a"]: [("animal", "Sus scrofa", "0.100000", "0.200000", "0.300000", "0.400000")],
        photo["b"]: [("human", "", "0.250000", "0.125000", "0.500000", "0.875000")],
        photo["c"]: [("animal", "Sus scrofa", "", "", "", "")],  # the detector found nothing: one row, no box
        photo["d"]: [("animal", "Sus scrofa", "", "", "", "")]}  # a failed image: no boxes
    flat = " ".join(output.split())
    assert "boxes │ 2" in flat and "animal photos without a box (one row without bbox) │ 2" in flat
    assert "images in the detector output without a label │ 1" in flat and "confidence >= 0.2" in flat
    data = load_camtrap_dp(out, {"Sus scrofa": (0, "LC")}, image_size=8)
    assert sorted(data.media_ids) == sorted(photo[n] for n in "acd")
    assert no_leftovers(tmp_path / "out", {"pkg"})


def test_unknown_species_stop_the_command_before_anything_is_written(tmp_path: Path) -> None:
    config = site_config(tmp_path, ["Didelphis virginiana"])
    out = tmp_path / "out" / "pkg"
    result = _invoke([str(out), str(ENA24 / "labels.csv"), "--from", "labels",
                      "--site-config", str(config), "--boxes", "none"])
    assert result.exit_code == 2
    flat = " ".join(result.output.split())
    assert "7 species are not in the site's species table" in flat and "'Grey Fox' (3 photo(s))" in flat
    assert "--species-map" in flat
    assert not out.exists() and not (tmp_path / "out").exists()


def _one_photo_folder(tmp_path: Path) -> Path:
    jpeg(tmp_path / "photos" / "Sus scrofa" / "a.jpg", (90, 90, 90))
    return tmp_path / "photos"


def test_boxes_auto_fetches_the_detector_and_warns_loudly_where_it_cannot(tmp_path: Path, monkeypatch) -> None:
    from edge_sdk.inference import detector
    from edge_sdk.inference.weights import WeightsUnavailableError

    asked = []

    def closed(**kwargs):
        asked.append(kwargs.get("download"))
        raise WeightsUnavailableError("no cached detector", fix="run with --boxes detect once online")

    monkeypatch.setattr(detector.YoloxDetector, "open", staticmethod(closed))
    out = tmp_path / "pkg"
    output = " ".join(_package([str(out), str(_one_photo_folder(tmp_path)), "--from", "folder", "--site", "s1"])
                      .split())
    assert asked == [True]  # auto fetches the weights on first use, as detect does
    assert "warning: no boxes: the detector cannot be fetched or opened here (no cached detector)" in output
    assert "--boxes detect" in output and [r["bboxX"] for r in rows(out / "observations.csv")] == [""]

    result = _invoke([str(tmp_path / "pkg2"), str(tmp_path / "photos"), "--from",
                      "folder", "--site", "s1", "--boxes", "detect"])
    assert result.exit_code == 2 and "no cached detector" in result.output
    assert not (tmp_path / "pkg2").exists()


def test_bad_site_ids_and_existing_outputs_are_refused(tmp_path: Path) -> None:
    photos = _one_photo_folder(tmp_path)
    result = _invoke([str(tmp_path / "pkg"), str(photos), "--from", "folder", "--site",
                      "a/b", "--boxes", "none"])
    assert result.exit_code == 2 and "--site 'a/b' is not an identifier" in " ".join(result.output.split())
    (tmp_path / "pkg").mkdir()
    result = _invoke([str(tmp_path / "pkg"), str(photos), "--from", "folder", "--site",
                      "s1", "--boxes", "none"])
    assert result.exit_code == 2 and "already exists" in result.output and "--force" in result.output
    assert list((tmp_path / "pkg").iterdir()) == []


def test_validation_errors_are_printed_as_a_table_and_nothing_is_written(tmp_path: Path, monkeypatch) -> None:
    from edge_sdk import packaging

    real = packaging.build_content

    def corrupted(*args, **kwargs):
        content = real(*args, **kwargs)
        content.media[0]["timestamp"] = "yesterday"  # a row the builder never writes
        return content

    monkeypatch.setattr(packaging, "build_content", corrupted)
    out = tmp_path / "out" / "pkg"
    result = _invoke([str(out), str(_one_photo_folder(tmp_path)), "--from", "folder",
                      "--site", "s1", "--boxes", "none"])
    assert result.exit_code == 1
    flat = " ".join(result.output.split())
    assert "1 validation error(s); nothing was written" in flat
    assert "│ media │ 2 │ timestamp │" in flat
    assert not out.exists() and no_leftovers(tmp_path / "out", set())
