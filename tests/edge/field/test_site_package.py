"""Appending to a site's Camtrap DP package: whole lines, the file's own column order, a torn line repaired."""

from __future__ import annotations

import csv
from pathlib import Path

from edge_sdk.field.site_package import SitePackage


def test_created_with_headers_and_appended(tmp_path: Path) -> None:
    pkg = SitePackage(tmp_path / "pkg", site_id="site-1")
    pkg.ensure()
    assert (pkg.root / "datapackage.json").is_file()
    with pkg.locked():
        pkg.append("media", [{"mediaID": "m1", "deploymentID": "site-1/a", "timestamp": "2024-01-01T00:00:00Z"}])
    assert pkg.media_ids() == {"m1"}
    assert pkg.rows("media")[0]["deploymentID"] == "site-1/a"


def test_rows_follow_the_files_own_header_and_a_torn_line_is_dropped(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "media.csv").write_text("deploymentID,mediaID,timestamp\nd,m0,t0\nd,m1,t", encoding="utf-8")  # torn
    pkg = SitePackage(root, site_id="s")
    assert pkg.media_ids() == {"m0"}  # a reader never sees the half row
    with pkg.locked():
        pkg.append("media", [{"mediaID": "m2", "deploymentID": "d2", "timestamp": "t2", "fileName": "ignored"}])
    with (root / "media.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["deploymentID", "mediaID", "timestamp"], ["d", "m0", "t0"], ["d2", "m2", "t2"]]


def test_deployment_span_grows_and_coordinates_are_kept(tmp_path: Path) -> None:
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    pkg.ensure()
    with pkg.locked():
        pkg.upsert_deployment("s/a", timestamp="2024-01-02T00:00:00+00:00", latitude=1.5, longitude=2.5)
        pkg.upsert_deployment("s/a", timestamp="2024-01-01T00:00:00+00:00")
        pkg.upsert_deployment("s/a", timestamp="2024-01-03T12:00:00+00:00")
        pkg.upsert_deployment("s/b", timestamp="2024-02-01T00:00:00+00:00")
    rows = {r["deploymentID"]: r for r in pkg.rows("deployments")}
    assert rows["s/a"]["deploymentStart"] == "2024-01-01T00:00:00+00:00"
    assert rows["s/a"]["deploymentEnd"] == "2024-01-03T12:00:00+00:00"
    assert (rows["s/a"]["latitude"], rows["s/a"]["longitude"]) == ("1.500000", "2.500000")
    assert rows["s/b"]["latitude"] == ""


def test_a_photo_is_stored_once_under_its_media_id(tmp_path: Path) -> None:
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    with pkg.locked():
        rel = pkg.store_photo(b"jpeg bytes", "ab" * 16, ".JPG")
        assert pkg.store_photo(b"jpeg bytes", "ab" * 16, ".JPG") == rel
    assert rel == f"media/ab/{'ab' * 16}.jpg" and (pkg.root / rel).read_bytes() == b"jpeg bytes"


def test_coordinates_given_later_fill_only_the_deployments_without_them(tmp_path: Path) -> None:
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    pkg.ensure()
    with pkg.locked():
        pkg.upsert_deployment("s/a", timestamp="2024-01-01T00:00:00+00:00")
        pkg.upsert_deployment("s/b", timestamp="2024-01-01T00:00:00+00:00", latitude=1.0, longitude=2.0)
        changed = pkg.fill_coordinates({"s/a": (-1.25, 36.5, "Waterhole"), "s/b": (9.0, 9.0, "")})
    rows = {r["deploymentID"]: r for r in pkg.rows("deployments")}
    assert changed == ["s/a"]
    assert (rows["s/a"]["latitude"], rows["s/a"]["longitude"], rows["s/a"]["locationName"]) == \
        ("-1.250000", "36.500000", "Waterhole")
    assert (rows["s/b"]["latitude"], rows["s/b"]["longitude"]) == ("1.000000", "2.000000")  # kept
