"""The local Camtrap DP table schemas, the timestamp-source mark and reading a Camtrap DP date and time
(shared/camtrap_dp_schema.py, shared/camtrap_dp.py)."""

from __future__ import annotations

import csv
import datetime as dt
import json
import shutil
from pathlib import Path

import pytest

from shared.camtrap_dp import (DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, OBSERVATIONS_COLUMNS, mark_timestamp_source,
                               parse_datetime, timestamp_source)
from shared.camtrap_dp_schema import (LOCAL_PACKAGE_PROFILE, TABLES, local_resource, schema_file, table_schema,
                                      write_schema_files)
from tests.support import SHARED_DATA

EXAMPLE = SHARED_DATA / "camtrap-dp-example"


def test_schemas_hold_the_standard_columns_keys_and_references() -> None:
    for table, columns in (("deployments", DEPLOYMENTS_COLUMNS), ("media", MEDIA_COLUMNS),
                           ("observations", OBSERVATIONS_COLUMNS)):
        schema = table_schema(table)
        assert tuple(f["name"] for f in schema["fields"]) == columns
        assert schema["missingValues"] == [""]
    assert table_schema("media")["foreignKeys"] == [
        {"fields": "deploymentID", "reference": {"resource": "deployments", "fields": "deploymentID"}}]
    assert [k["reference"]["resource"] for k in table_schema("observations")["foreignKeys"]] == ["deployments",
                                                                                                   "media"]
    required = {f["name"] for f in table_schema("deployments")["fields"] if f["constraints"]["required"]}
    assert required == {"deploymentID", "latitude", "longitude", "deploymentStart", "deploymentEnd"}


def test_optional_fields_are_relaxed_and_said_so() -> None:
    schema = table_schema("deployments", optional=("latitude", "longitude"))
    fields = {f["name"]: f for f in schema["fields"]}
    assert not fields["latitude"]["constraints"]["required"] and not fields["longitude"]["constraints"]["required"]
    assert "latitude, longitude" in schema["description"]
    assert table_schema("deployments")["fields"][3]["constraints"]["required"]  # the shared data is untouched
    with pytest.raises(ValueError, match="no field"):
        table_schema("media", optional=("latitude",))
    with pytest.raises(ValueError, match="no table"):
        table_schema("events")


def _bad_json_rows(path: Path) -> set[int]:
    """Rows (header = 1) of the example's media.csv whose exifData is not JSON, found with the json module."""
    bad = set()
    with path.open(newline="", encoding="utf-8") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            try:
                if row["exifData"]:
                    json.loads(row["exifData"])
            except json.JSONDecodeError:
                bad.add(number)
    return bad


def test_the_official_example_validates_offline_against_the_local_schemas(tmp_path: Path) -> None:
    """The TDWG example (423 media, 549 observations) against our schemas: the only errors are its three media rows
    whose exifData is not JSON (a fact of the example's data, checked here with the json module)."""
    if not EXAMPLE.is_dir():
        pytest.skip(f"official Camtrap DP example not found at {EXAMPLE} (set WILDFED_SHARED_DATA to the data folder)")
    from edge_sdk.packaging.validate import validate_package

    package = tmp_path / "example"
    shutil.copytree(EXAMPLE, package)
    meta = json.loads((package / "datapackage.json").read_text())
    meta["profile"] = LOCAL_PACKAGE_PROFILE
    meta["resources"] = [local_resource(r["name"]) for r in meta["resources"] if r["name"] in TABLES]
    (package / "datapackage.json").write_text(json.dumps(meta))
    write_schema_files(package)

    problems = validate_package(package)
    assert {(p.table, p.row, p.field, p.kind) for p in problems} == {
        ("media", row, "exifData", "type-error") for row in _bad_json_rows(package / "media.csv")}
    assert len(problems) == 3
    assert (package / schema_file("media")).is_file()


def test_timestamp_source_mark_round_trips_and_keeps_other_comments() -> None:
    assert mark_timestamp_source("mtime") == "timestampSource:mtime"
    marked = mark_timestamp_source("table", "timestampSource:mtime | lens fogged")
    assert marked == "timestampSource:table | lens fogged"
    assert timestamp_source(marked) == "table"
    assert timestamp_source("lens fogged | timestampSource:exif") == "exif"
    assert timestamp_source("timestamp is the file time") is None
    assert timestamp_source("timestampSource:guess") is None
    assert timestamp_source(None) is None
    assert timestamp_source(mark_timestamp_source("run")) == "run"  # an unreadable file: the time of the run
    with pytest.raises(ValueError, match="not one of"):
        mark_timestamp_source("guess")


UTC, PLUS_1 = dt.timezone.utc, dt.timezone(dt.timedelta(hours=1))


@pytest.mark.parametrize("text,want", [
    ("2024-01-02T10:00:00Z", dt.datetime(2024, 1, 2, 10, tzinfo=UTC)),  # Python 3.10's fromisoformat refuses "Z"
    ("2024-01-02T10:00:00z", dt.datetime(2024, 1, 2, 10, tzinfo=UTC)),
    ("2024-01-02T10:00:00+01:00", dt.datetime(2024, 1, 2, 10, tzinfo=PLUS_1)),
    ("2024-01-02T10:00:00.5+01:00", dt.datetime(2024, 1, 2, 10, 0, 0, 500_000, tzinfo=PLUS_1)),  # 1 digit
    ("2024-01-02T10:00:00.1234567Z", dt.datetime(2024, 1, 2, 10, 0, 0, 123_456, tzinfo=UTC)),  # 7: cut to 6
    (" 2024-01-02 10:00:00 ", dt.datetime(2024, 1, 2, 10)),  # no zone: naive
])
def test_camtrap_dp_datetimes_read_the_same_on_every_supported_python(text: str, want: dt.datetime) -> None:
    got = parse_datetime(text)
    assert got == want and got.utcoffset() == want.utcoffset()


def test_a_text_that_is_no_datetime_is_refused_naming_it() -> None:
    for bad in ("yesterday", "2024-13-01T00:00:00Z", ""):
        with pytest.raises(ValueError, match="not an ISO 8601 date and time"):
            parse_datetime(bad)


def test_the_field_loop_reads_z_timestamps_as_utc() -> None:
    from edge_sdk.field.events import epoch_seconds

    assert epoch_seconds("2024-01-02T00:00:00Z") == 1_704_153_600.0  # 2024-01-01 is day 19,723 of the epoch, + 1
    assert epoch_seconds("2024-01-02T01:00:00+01:00") == 1_704_153_600.0
    with pytest.raises(ValueError, match="no UTC offset"):
        epoch_seconds("2024-01-02T00:00:00")
