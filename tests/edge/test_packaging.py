"""``edge_sdk.packaging``: labels, timestamps and their marks, duplicates, boxes, species checks, and a package that is
written whole and valid or not at all. Small synthetic JPEGs; the four input kinds end to end are in
test_packaging_inputs.py."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest

from shared.camtrap_dp import timestamp_source
from shared.errors import DatasetError

from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.inference.detector import Box
from edge_sdk.packaging import (PackageOptions, PackageValidationError, build_content, classify, load_species_map,
                                read_folder, read_labels_csv, validate_package, write_package)
from edge_sdk.packaging.labels import Label
from edge_sdk.packaging.timestamps import parse_table_time

from .packaging_support import FILE_TIME, digest, jpeg, no_leftovers, rows

UTC = dt.timezone.utc


def test_labels_become_observation_types_through_the_species_map(tmp_path: Path) -> None:
    (tmp_path / "map.yaml").write_text("PBE: Prionailurus bengalensis\nUNID: unknown\nLeopard cat: "
                                       "Prionailurus bengalensis\n")
    mapping = load_species_map(tmp_path / "map.yaml")
    assert classify("PBE", mapping) == Label("animal", "Prionailurus bengalensis")
    assert classify("pbe", mapping) == Label("animal", "Prionailurus bengalensis")  # case-insensitive
    assert classify("leopard  cat", mapping) == Label("animal", "Prionailurus bengalensis")
    assert classify("UNID", mapping) == Label("unknown")
    assert classify("Unidentified") == Label("unknown")
    assert [classify(w).observation_type for w in ("Blank", "empty", "none", "No animal")] == ["blank"] * 4
    assert [classify(w).observation_type for w in ("human", "Person", "vehicle")] == ["human", "human", "vehicle"]
    assert classify("Sus scrofa") == Label("animal", "Sus scrofa")

    (tmp_path / "map.csv").write_text("code,scientificName\nVTA,Viverra tangalunga\n")
    assert load_species_map(tmp_path / "map.csv") == {"vta": "Viverra tangalunga"}
    (tmp_path / "bad.csv").write_text("VTA,Viverra tangalunga\nvta,Viverra zibetha\n")
    with pytest.raises(DatasetError, match="mapped twice"):
        load_species_map(tmp_path / "bad.csv")


@pytest.mark.parametrize("text, expected", [
    ("2024-05-01 06:30:00", "2024-05-01T06:30:00+02:00"),
    (" 2024-05-01T06:30:00", "2024-05-01T06:30:00+02:00"),  # Timelapse's leading space, T separator
    ("2024-05-01T06:30:00Z", "2024-05-01T06:30:00+00:00"),
    ("2024-05-01T06:30:00.250-05:00", "2024-05-01T06:30:00-05:00"),
    ("2024:05:01 06:30:00", "2024-05-01T06:30:00+02:00"),  # EXIF form
    ("01-May-2024 06:30:00", "2024-05-01T06:30:00+02:00"),  # Timelapse's Date and Time columns
])
def test_table_times_in_the_forms_tools_write(text: str, expected: str) -> None:
    zone = dt.timezone(dt.timedelta(hours=2))
    assert parse_table_time(text, utc_offset=zone) == expected


@pytest.mark.parametrize("text", ["yesterday", "2024-05-01", "2024-13-01 00:00:00"])
def test_a_table_time_that_is_not_a_time_is_refused(text: str) -> None:
    with pytest.raises(DatasetError, match="not a date and time"):
        parse_table_time(text, utc_offset=UTC)


def _labels_csv(tmp_path: Path) -> Path:
    """Three photos: EXIF time (table time ignored), table time only, neither (file time)."""
    jpeg(tmp_path / "img" / "a.jpg", (200, 10, 10), exif_time="2022:01:02 03:04:05")
    jpeg(tmp_path / "img" / "b.jpg", (10, 200, 10))
    jpeg(tmp_path / "img" / "c.jpg", (10, 10, 200))
    path = tmp_path / "labels.csv"
    path.write_text("file,species,timestamp,station\n"
                    "img/a.jpg,Sus scrofa,2030-01-01 00:00:00,north\n"
                    "img/b.jpg,Sus scrofa,2022-02-03 04:05:06,north\n"
                    "img/c.jpg,Blank,,south\n"
                    "img/d.jpg,,,south\n")  # unlabelled: left out, even though the file does not exist
    return path


def test_timestamps_come_from_exif_then_the_table_then_the_file_and_say_so(tmp_path: Path) -> None:
    read = read_labels_csv(_labels_csv(tmp_path))
    assert [p.deployment for p in read.photos] == ["north", "north", "south"]
    assert read.skipped == {"rows of labels.csv without a species": 1}
    content = build_content(read, PackageOptions(site="s1", classified_by="ana"))
    by_name = {r["fileName"]: r for r in content.media}
    assert by_name["a.jpg"]["timestamp"] == "2022-01-02T03:04:05+00:00"
    assert by_name["b.jpg"]["timestamp"] == "2022-02-03T04:05:06+00:00"
    assert by_name["c.jpg"]["timestamp"] == FILE_TIME.isoformat()
    assert [timestamp_source(by_name[n]["mediaComments"]) for n in ("a.jpg", "b.jpg", "c.jpg")] == [
        "exif", "table", "mtime"]
    issues = {r["deploymentID"]: r["timestampIssues"] for r in content.deployments}
    assert issues == {"s1/north": "false", "s1/south": "true"}
    north = next(r for r in content.deployments if r["deploymentID"] == "s1/north")
    assert (north["deploymentStart"], north["deploymentEnd"]) == ("2022-01-02T03:04:05+00:00",
                                                                  "2022-02-03T04:05:06+00:00")
    assert dict(content.summary.timestamps) == {"exif": 1, "table": 1, "mtime": 1}
    blank = next(o for o in content.observations if o["observationType"] == "blank")
    assert (blank["scientificName"], blank["count"]) == ("", "")


def test_a_photo_present_twice_is_one_media_row(tmp_path: Path) -> None:
    first = jpeg(tmp_path / "photos" / "Sus scrofa" / "x.jpg", (90, 90, 90))
    second = tmp_path / "photos" / "Sus scrofa" / "x-copy.jpg"
    second.write_bytes(first.read_bytes())
    jpeg(tmp_path / "photos" / "Sus scrofa" / "y.jpg", (30, 60, 90))
    content = build_content(read_folder(tmp_path / "photos"), PackageOptions(site="s1", classified_by="ana"))
    assert len(content.media) == 2 and content.summary.duplicates == 1
    assert {r["mediaID"] for r in content.media} == {digest(first), digest(tmp_path / "photos/Sus scrofa/y.jpg")}
    assert len(content.observations) == 2  # one per distinct photo and label
    assert any("1 photo(s) repeat another photo byte for byte" in w for w in content.summary.warnings)


def test_unknown_species_are_listed_together_with_the_fix(tmp_path: Path) -> None:
    for i, name in enumerate(("PBE", "VTA", "Sus scrofa")):
        jpeg(tmp_path / "photos" / name / f"{i}.jpg", (i * 40, 10, 10))
    read = read_folder(tmp_path / "photos")
    options = dict(site="s1", classified_by="ana", site_species=frozenset({"Sus scrofa"}),
                   site_config=tmp_path / "site.yaml")
    with pytest.raises(DatasetError) as caught:
        build_content(read, PackageOptions(**options))
    message = str(caught.value)
    assert "2 species are not in the site's species table" in message and "'PBE'" in message and "'VTA'" in message
    assert "--species-map" in message and "site.yaml" in message
    mapped = {"pbe": "Sus scrofa", "vta": "Viverra tangalunga"}
    with pytest.raises(DatasetError, match=r"1 species .*'Viverra tangalunga' \(1 photo\(s\), from label\(s\) "
                                           r"\['VTA'\]\).*fix the species map"):
        build_content(read, PackageOptions(**options, species_map=mapped))
    content = build_content(read, PackageOptions(**options, species_map={"pbe": "Sus scrofa", "vta": "unknown"}))
    assert sorted(o["observationType"] for o in content.observations) == ["animal", "animal", "unknown"]


class _FakeDetector:
    """Two boxes on photos wider than tall, none otherwise; counts its calls."""

    detector_id = "fake@0"

    def __init__(self) -> None:
        self.calls = 0

    def detect(self, images):
        self.calls += len(images)
        return [[Box(8, 6, 40, 30, 0.91), Box(0, 0, 21, 47, 0.4)] if im.width > im.height else [] for im in images]


def test_detected_boxes_carry_the_label_and_a_photo_without_one_keeps_a_row(tmp_path: Path) -> None:
    jpeg(tmp_path / "photos" / "Sus scrofa" / "wide.jpg", (90, 90, 90), size=(64, 48))
    jpeg(tmp_path / "photos" / "Sus scrofa" / "tall.jpg", (20, 90, 90), size=(48, 64))
    jpeg(tmp_path / "photos" / "blank" / "empty.jpg", (90, 20, 90), size=(64, 48))
    detector = _FakeDetector()
    content = build_content(read_folder(tmp_path / "photos"),
                            PackageOptions(site="s1", classified_by="ana", boxes="detect", detector=detector))
    assert detector.calls == 2  # the animal photos only
    boxed = [o for o in content.observations if o.get("bboxX")]
    # Box.normalised_xywh on 64 x 48: (8/64, 6/48, 32/64, 24/48) and (0, 0, 21/64, 47/48)
    assert [(o["bboxX"], o["bboxY"], o["bboxWidth"], o["bboxHeight"]) for o in boxed] == [
        ("0.125000", "0.125000", "0.500000", "0.500000"), ("0.000000", "0.000000", "0.328125", "0.979167")]
    assert {o["scientificName"] for o in boxed} == {"Sus scrofa"}
    assert boxed[0]["observationTags"] == "detectorConfidence:0.910 | detector:fake@0"
    assert (content.summary.boxes, content.summary.unboxed) == (2, 1)
    assert len(content.observations) == 4  # 2 boxes + the tall photo without a box + the blank photo
    # half the animal photos without a box: said, since those train on whole photos while detect uses crops
    assert [w for w in content.summary.warnings if w.startswith("no box in 1 of 2 animal photo(s)")]
    jpeg(tmp_path / "photos" / "Sus scrofa" / "wide2.jpg", (200, 30, 30), size=(64, 48))
    more = build_content(read_folder(tmp_path / "photos"),
                         PackageOptions(site="s1", classified_by="ana", boxes="detect", detector=_FakeDetector()))
    assert more.summary.unboxed == 1 and not [w for w in more.summary.warnings if w.startswith("no box in")]


def test_the_package_validates_and_loads_with_the_gateways_loader(tmp_path: Path) -> None:
    content = build_content(read_labels_csv(_labels_csv(tmp_path)), PackageOptions(site="s1", classified_by="ana"))
    out = write_package(tmp_path / "pkg", content, site="s1", contributor="ana")
    assert validate_package(out) == []
    data = load_camtrap_dp(out, {"Sus scrofa": (3, "VU")}, image_size=8)
    assert sorted(data.media_ids) == sorted([digest(tmp_path / "img/a.jpg"), digest(tmp_path / "img/b.jpg")])
    assert data.labels.tolist() == [3, 3] and data.categories.tolist() == [3, 3]  # VU rank 3
    assert np.all(data.images[data.media_ids.index(digest(tmp_path / "img/a.jpg"))] > 0)
    assert (out / "media" / "north" / "a.jpg").read_bytes() == (tmp_path / "img/a.jpg").read_bytes()


def test_nothing_is_written_when_validation_fails(tmp_path: Path) -> None:
    content = build_content(read_labels_csv(_labels_csv(tmp_path)), PackageOptions(site="s1", classified_by="ana"))
    content.observations[1]["observationType"] = "cat"
    with pytest.raises(PackageValidationError) as caught:
        write_package(tmp_path / "out" / "pkg", content, site="s1", contributor="ana")
    (problem,) = caught.value.problems
    assert (problem.table, problem.row, problem.field, problem.kind) == (
        "observations", 3, "observationType", "constraint-error")
    assert no_leftovers(tmp_path / "out", set())


def test_an_existing_package_is_replaced_only_with_force(tmp_path: Path) -> None:
    content = build_content(read_labels_csv(_labels_csv(tmp_path)), PackageOptions(site="s1", classified_by="ana"))
    out = tmp_path / "out" / "pkg"
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("keep")
    with pytest.raises(DatasetError, match="already exists"):
        write_package(out, content, site="s1", contributor="ana")
    assert (out / "mine.txt").read_text() == "keep"
    write_package(out, content, site="s1", contributor="ana", force=True)
    assert not (out / "mine.txt").exists() and len(rows(out / "media.csv")) == 3
    assert no_leftovers(tmp_path / "out", {"pkg"})
