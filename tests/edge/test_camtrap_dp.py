"""Camtrap DP loader: a tiny package written by the test, the TDWG example, and every bad-input case."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared.errors import DatasetError
from shared.iucn import IUCNCategory

from edge_sdk.config import SpeciesEntry
from edge_sdk.data.camtrap_dp import load_camtrap_dp

from .conftest import COLOURS, EXAMPLE_PACKAGE, SPECIES


@contextlib.contextmanager
def _logged(match: str) -> Iterator[None]:
    """Expect one log record of the loader matching ``match``, as one line, and no Python warning (a
    UserWarning would print its source file and line on every check-config and run)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("edge_sdk.data.camtrap_dp")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        log.removeHandler(handler)
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    lines = [r.getMessage() for r in records if r.levelno == logging.WARNING and re.search(match, r.getMessage())]
    assert len(lines) == 1 and "\n" not in lines[0], [r.getMessage() for r in records]


def test_loads_records_labels_categories_and_pixels(package: Path) -> None:
    data = load_camtrap_dp(package, SPECIES, image_size=8)

    assert data.media_ids == ("m1", "m2", "m4")
    assert data.labels.dtype == np.int64 and data.labels.tolist() == [0, 1, 1]
    assert data.categories.dtype == np.int8 and data.categories.tolist() == [1, 4, 4]  # CR=1, NT=4
    assert data.images.dtype == np.uint8 and data.images.shape == (3, 8, 8)
    # Solid colours stay solid after bilinear resizing; grey levels from the luma formula (see conftest).
    for i, media_id in enumerate(data.media_ids):
        assert np.all(data.images[i] == COLOURS[media_id][1])
    assert data.category_counts() == {IUCNCategory.CR: 1, IUCNCategory.NT: 2}


def test_accepts_species_entries(package: Path) -> None:
    table = {name: SpeciesEntry(scientific_name=name, class_index=idx, iucn_category=cat)
             for name, (idx, cat) in SPECIES.items()}
    assert load_camtrap_dp(package, table).labels.tolist() == [0, 1, 1]


def test_no_pixels_are_read_unless_asked(package: Path) -> None:
    data = load_camtrap_dp(package, SPECIES)
    assert data.images is None and len(data.sha256) == 3  # files are hashed (record identity), not decoded
    assert load_camtrap_dp(package, SPECIES, image_size=28).images.shape == (3, 28, 28)


@pytest.mark.parametrize("table", ["deployments", "media", "observations"])
def test_missing_table_names_the_file(package: Path, table: str) -> None:
    (package / f"{table}.csv").unlink()
    with pytest.raises(DatasetError, match=f"{table}.csv") as info:
        load_camtrap_dp(package, SPECIES)
    assert info.value.fix


@pytest.mark.parametrize("table,column", [("observations", "scientificName"), ("media", "fileName"),
                                          ("media", "mediaID"), ("deployments", "deploymentID"),
                                          ("observations", "observationLevel")])
def test_missing_column_names_column_file_and_fix(make_package, table: str, column: str) -> None:
    pkg = make_package(drop_column=(table, column))
    with pytest.raises(DatasetError) as info:
        load_camtrap_dp(pkg, SPECIES)
    err = info.value
    assert err.field == column and err.source.endswith(f"{table}.csv") and column in err.fix
    assert column in str(err) and f"{table}.csv" in str(err)


def test_unknown_species_is_named_with_the_fix(package: Path) -> None:
    with pytest.raises(DatasetError, match="Equus quagga") as info:
        load_camtrap_dp(package, {"Loxodonta cyclotis": (0, "CR")})
    assert "species table" in info.value.fix


def test_missing_media_file_errors_or_is_skipped(package: Path) -> None:
    (package / "media" / "m2.png").unlink()
    with pytest.raises(DatasetError, match="m2"):
        load_camtrap_dp(package, SPECIES)
    with _logged("1 media file"):
        data = load_camtrap_dp(package, SPECIES, missing_media="skip")
    assert data.media_ids == ("m1", "m4")


def test_unreadable_image(package: Path) -> None:
    (package / "media" / "m2.png").write_bytes(b"this is not a PNG")
    with pytest.raises(DatasetError, match="image cannot be read") as info:
        load_camtrap_dp(package, SPECIES, image_size=8)
    assert info.value.source.endswith("m2.png")


def test_multi_species_image(make_package) -> None:
    pkg = make_package(extra_observations=[
        {"observationID": "o5", "mediaID": "m1", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Equus quagga", "count": "1"}])
    with pytest.raises(DatasetError, match="several species"):
        load_camtrap_dp(pkg, SPECIES, multi_species="error")
    with _logged("multi-species"):
        assert load_camtrap_dp(pkg, SPECIES).media_ids == ("m2", "m4")


def test_observation_with_unknown_media(make_package) -> None:
    pkg = make_package(extra_observations=[
        {"observationID": "o9", "mediaID": "nope", "observationLevel": "media", "observationType": "animal",
         "scientificName": "Equus quagga"}])
    with pytest.raises(DatasetError, match="unknown mediaID 'nope'"):
        load_camtrap_dp(pkg, SPECIES)


def test_bad_arguments(package: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="missing_media"):
        load_camtrap_dp(package, SPECIES, missing_media="ignore")
    with pytest.raises(DatasetError, match="not found"):
        load_camtrap_dp(tmp_path / "absent", SPECIES)
    with pytest.raises(DatasetError, match="species table entry"):
        load_camtrap_dp(package, {"Equus quagga": (1, "XX")})


def test_tdwg_example_package(caplog: pytest.LogCaptureFixture) -> None:
    if not EXAMPLE_PACKAGE.is_dir():
        pytest.skip(f"the Camtrap DP example is not at {EXAMPLE_PACKAGE} (../shared/data beside the repo)")
    names = ["Anas platyrhynchos", "Anas strepera", "Ardea", "Ardea cinerea", "Aves", "Martes foina",
             "Mustela putorius", "Rattus norvegicus", "Vulpes vulpes"]
    table = {name: (i, "LC") for i, name in enumerate(names)}
    with caplog.at_level(logging.WARNING, logger="edge_sdk.data.camtrap_dp"):
        data = load_camtrap_dp(EXAMPLE_PACKAGE, table, missing_media="skip", image_size=28)
    assert any("missing" in r.getMessage() for r in caplog.records)
    # Only the 10 JPEGs in media/ are present, and a machine model classified each as the genus "Ardea" (probability
    # 0.89 once, 0.88 eight times, 0.85 once, each with one box): no person verified them, so by default none trains.
    assert len(data) == 0
    with caplog.at_level(logging.WARNING, logger="edge_sdk.data.camtrap_dp"):
        data = load_camtrap_dp(EXAMPLE_PACKAGE, table, missing_media="skip", image_size=28, train_on="machine",
                               machine_threshold=0.85)
    present = len(list((EXAMPLE_PACKAGE / "media").glob("*.JPG")))
    assert len(data) == present == 10
    assert data.boxes[data.media_ids.index("7ab33b3a")] == ((0.35947, 0.61382, 0.32951, 0.31225),)
    for threshold, kept in ((0.88, 9), (0.885, 1), (0.9, 0)):
        assert len(load_camtrap_dp(EXAMPLE_PACKAGE, table, missing_media="skip", train_on="machine",
                                   machine_threshold=threshold)) == kept
    assert set(data.labels.tolist()) == {names.index("Ardea")}
    assert data.images.shape == (10, 28, 28) and data.images.dtype == np.uint8
    assert np.all(data.categories == IUCNCategory.LC.rank)
    assert data.images.std() > 0  # real photographs, not blank frames


# -- one image = one record ------------------------------------------------------------------------------------
def _add_media_rows(pkg: Path, rows: list[dict[str, str]], observations: list[dict[str, str]]) -> None:
    """Append media and observation rows to a package written by ``write_package`` (same columns)."""
    import csv

    for name, extra in (("media", rows), ("observations", observations)):
        path = pkg / f"{name}.csv"
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            columns, existing = list(reader.fieldnames or []), list(reader)
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            for row in existing + extra:
                writer.writerow({c: row.get(c, "") for c in columns})


def _animal(obs_id: str, media_id: str, name: str) -> dict[str, str]:
    return {"observationID": obs_id, "deploymentID": "d1", "mediaID": media_id, "observationLevel": "media",
            "observationType": "animal", "scientificName": name, "count": "1"}


def test_two_media_rows_with_one_file_path_and_two_species_are_one_multi_species_image(
        package: Path, caplog: pytest.LogCaptureFixture) -> None:
    # m5 is a second media row for m1's file (media/sub/m1.png) whose observation says zebra (NT) while m1's says
    # elephant (CR). Before the fix they loaded as two records with identical pixels, one CR and one NT.
    _add_media_rows(package, [{"mediaID": "m5", "deploymentID": "d1", "filePath": "media/sub/m1.png",
                               "fileName": "m5.png"}], [_animal("o5", "m5", "Equus quagga")])

    with caplog.at_level(logging.WARNING, logger="edge_sdk.data.camtrap_dp"):
        data = load_camtrap_dp(package, SPECIES)
    # The image shows two species: the project's rule leaves it out (it could not sit in one category).
    assert data.media_ids == ("m2", "m4")
    assert data.categories.tolist() == [4, 4]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "1 multi-species image" in messages and "1 media row(s)" in messages
    with pytest.raises(DatasetError, match="several species") as info:
        load_camtrap_dp(package, SPECIES, multi_species="error")
    assert "m1" in str(info.value) and "2 media rows" in str(info.value)


def test_same_file_listed_twice_with_one_species_is_one_record(package: Path) -> None:
    _add_media_rows(package, [{"mediaID": "m5", "deploymentID": "d1", "filePath": "media/sub/m1.png",
                               "fileName": "m5.png"}], [_animal("o5", "m5", "Loxodonta cyclotis")])

    with _logged("1 media row"):
        data = load_camtrap_dp(package, SPECIES)
    assert data.media_ids == ("m1", "m2", "m4")  # not ("m1", "m2", "m4", "m5")
    assert data.category_counts() == {IUCNCategory.CR: 1, IUCNCategory.NT: 2}


def test_byte_identical_files_at_two_paths_are_one_image(package: Path) -> None:
    # m6 is a copy of m2's PNG at another path, labelled as an elephant (CR); m2 is a zebra (NT).
    (package / "media" / "copies").mkdir()
    copy = package / "media" / "copies" / "m6.png"
    copy.write_bytes((package / "media" / "m2.png").read_bytes())
    _add_media_rows(package, [{"mediaID": "m6", "deploymentID": "d1", "filePath": "media/copies/m6.png",
                               "fileName": "m6.png"}], [_animal("o6", "m6", "Loxodonta cyclotis")])

    with _logged("multi-species"):
        data = load_camtrap_dp(package, SPECIES, image_size=28)
    assert data.media_ids == ("m1", "m4")
    # The pixels of m2 appear in no record at all (each record's image is distinct).
    assert not np.any(np.all(data.images == COLOURS["m2"][1], axis=(1, 2)))

    # Same bytes, same species: one record, kept under the first mediaID.
    obs = (package / "observations.csv").read_text(encoding="utf-8").replace(
        "o6,d1,m6,,,,media,animal,Loxodonta cyclotis", "o6,d1,m6,,,,media,animal,Equus quagga")
    (package / "observations.csv").write_text(obs, encoding="utf-8")
    with _logged("1 media row"):
        data = load_camtrap_dp(package, SPECIES)
    assert data.media_ids == ("m1", "m2", "m4")


def test_distinct_files_with_equal_colours_but_different_bytes_stay_two_records(package: Path) -> None:
    # m3.png and m4.png are both solid blue but m3 has only a blank observation; give m3 a zebra and check
    # that two distinct files (same pixels, m3 re-saved with another PNG compression -> other bytes) stay two.
    from PIL import Image

    Image.new("RGB", (40, 30), COLOURS["m3"][0]).save(package / "media" / "m3.png", compress_level=0)
    assert (package / "media" / "m3.png").read_bytes() != (package / "media" / "m4.png").read_bytes()
    _add_media_rows(package, [], [_animal("o3b", "m3", "Equus quagga")])
    data = load_camtrap_dp(package, SPECIES)
    assert data.media_ids == ("m1", "m2", "m3", "m4")
