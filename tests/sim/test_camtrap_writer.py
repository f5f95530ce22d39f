"""Camtrap DP writer: the real standard's headers, pixel-exact round trip through PNG + CSV, atomic writes."""

from __future__ import annotations

import csv
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.camtrap_dp_schema import table_schema
from wildfed_sim import camtrap_writer
from wildfed_sim.animal_mnist import SPECIES_TABLE
from wildfed_sim.camtrap_writer import CamtrapWriteError, write_camtrap_dp
from wildfed_sim.ecology import SiteSpec
from tests.support import SHARED_DATA

EXAMPLE = SHARED_DATA / "camtrap-dp-example"
START = datetime(2024, 3, 1, 6, 30, tzinfo=timezone.utc)


def _header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as fh:
        return next(csv.reader(fh))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture()
def site_data() -> tuple[SiteSpec, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    n = 37
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)  # every grey level matters
    labels = rng.choice([0, 1, 5, 9], size=n).astype(np.int64)
    source = np.sort(rng.choice(10_000, size=n, replace=False)).astype(np.int64)
    site = SiteSpec(site_id="site-03", biome="savanna", species=(0, 1, 5, 9), indices=np.arange(n, dtype=np.int64),
                    monitoring_months=14, latitude=-2.123, longitude=34.987, habitat="East African savanna")
    return site, images, labels, source


def _write(tmp_path: Path, site_data, **kwargs) -> Path:
    site, images, labels, source = site_data
    return write_camtrap_dp(tmp_path / "pkg", site=site, images=images, labels=labels, start_time=START,
                            source_indices=source, seed=4, **kwargs)


@pytest.mark.parametrize("table", ["deployments", "media", "observations"])
def test_headers_match_the_official_example(tmp_path: Path, site_data, table: str) -> None:
    example = EXAMPLE / f"{table}.csv"
    if not example.is_file():
        pytest.skip(f"official Camtrap DP example not found at {example} (set WILDFED_SHARED_DATA to the data folder)")
    out = _write(tmp_path, site_data)
    assert _header(out / f"{table}.csv") == _header(example)


def test_datapackage_descriptor_follows_the_example(tmp_path: Path, site_data) -> None:
    out = _write(tmp_path, site_data)
    descriptor = json.loads((out / "datapackage.json").read_text())

    assert descriptor["profile"] == "tabular-data-package"  # a remote profile would be fetched: not offline
    resources = {r["name"]: r for r in descriptor["resources"]}
    assert set(resources) == {"deployments", "media", "observations"}
    for name, res in resources.items():
        assert res["path"] == f"{name}.csv"
        assert res["schema"] == f"schemas/{name}-table-schema.json"  # local, so that it validates offline
        assert json.loads((out / res["schema"]).read_text()) == table_schema(name)
        assert res["profile"] == "tabular-data-resource"
    if (EXAMPLE / "datapackage.json").is_file():
        example = json.loads((EXAMPLE / "datapackage.json").read_text())
        for res in example["resources"][:3]:
            mine = resources[res["name"]]
            # same keys and values as the official example, but the schema: a local file instead of its URL
            assert {k: mine[k] for k in res if k != "schema"} == {k: v for k, v in res.items() if k != "schema"}
            assert res["schema"].endswith(mine["schema"].removeprefix("schemas/"))
    for key in ("created", "contributors", "project", "spatial", "temporal", "taxonomic"):
        assert key in descriptor
    assert {t["scientificName"] for t in descriptor["taxonomic"]} == {
        "Ursus maritimus", "Passer domesticus", "Loxodonta cyclotis", "Equus quagga"}


def test_the_package_validates_offline_with_frictionless(tmp_path: Path, site_data) -> None:
    frictionless = pytest.importorskip("frictionless", reason="frictionless comes with the edge extra")
    out = _write(tmp_path, site_data)
    report = frictionless.validate(str(out / "datapackage.json"))  # offline: the schemas are local files
    assert report.valid, report.flatten(["rowNumber", "fieldName", "type", "note"])
    assert [task.name for task in report.tasks] == ["deployments", "media", "observations"]


def test_round_trip_is_pixel_exact(tmp_path: Path, site_data) -> None:
    site, images, labels, source = site_data
    out = _write(tmp_path, site_data)
    by_source = {int(s): i for i, s in enumerate(source)}

    media = _rows(out / "media.csv")
    observations = {r["mediaID"]: r for r in _rows(out / "observations.csv")}
    assert len(media) == len(observations) == len(images)
    assert len(list((out / "media").iterdir())) == len(images)
    seen = set()
    for row in media:
        assert row["filePath"] == f"media/{row['fileName']}"
        assert (row["fileMediatype"], row["captureMethod"], row["filePublic"]) == (
            "image/png", "activityDetection", "false")
        assert row["deploymentID"] == site.site_id
        obs = observations[row["mediaID"]]
        i = by_source[int(obs["observationTags"].split("sourceIndex:")[1])]
        with Image.open(out / row["filePath"]) as img:
            assert img.mode == "L"
            pixels = np.array(img)
        np.testing.assert_array_equal(pixels, images[i])
        assert obs["scientificName"] == SPECIES_TABLE[int(labels[i])].scientific_name
        assert (obs["observationLevel"], obs["observationType"], obs["count"]) == ("media", "animal", "1")
        assert obs["deploymentID"] == site.site_id
        assert obs["eventStart"] == obs["eventEnd"] == row["timestamp"]
        seen.add(i)
    assert seen == set(range(len(images)))


def test_deployment_and_timestamps(tmp_path: Path, site_data) -> None:
    site, images, *_ = site_data
    out = _write(tmp_path, site_data)

    (deployment,) = _rows(out / "deployments.csv")
    assert deployment["deploymentID"] == site.site_id
    assert (float(deployment["latitude"]), float(deployment["longitude"])) == (site.latitude, site.longitude)
    start = datetime.fromisoformat(deployment["deploymentStart"])
    end = datetime.fromisoformat(deployment["deploymentEnd"])
    assert start == START
    assert end - start == timedelta(days=14 * 30.4375)
    stamps = [datetime.fromisoformat(r["timestamp"]) for r in _rows(out / "media.csv")]
    assert all(s.tzinfo is not None and start <= s <= end for s in stamps)
    assert stamps == sorted(stamps)


def test_existing_package_is_kept_unless_overwrite(tmp_path: Path, site_data) -> None:
    out = _write(tmp_path, site_data)
    (out / "marker").write_text("old")

    with pytest.raises(CamtrapWriteError, match="already exists"):
        _write(tmp_path, site_data)
    assert (out / "marker").read_text() == "old"

    _write(tmp_path, site_data, overwrite=True)
    assert not (out / "marker").exists()
    assert (out / "datapackage.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # no temporary folders left


def test_a_failure_mid_write_leaves_nothing(tmp_path: Path, site_data, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing_csv(path, columns, rows):
        calls.append(path)
        raise OSError("disk full")

    monkeypatch.setattr(camtrap_writer, "_write_csv", failing_csv)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path, site_data)
    assert calls  # the PNGs had been written when it failed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"labels": np.full(37, 10)}, "species table"),
        ({"images": np.zeros((37, 28, 28), np.float32)}, "uint8"),
        ({"images": np.zeros((36, 28, 28), np.uint8), "labels": np.zeros(36, np.int64),
          "source_indices": np.arange(36)}, "has 37 images"),
        ({"start_time": datetime(2024, 1, 1)}, "timezone-aware"),
        ({"source_indices": np.zeros(37, np.int64)}, "unique"),
    ],
)
def test_bad_input_raises_and_writes_nothing(tmp_path: Path, site_data, change, match) -> None:
    site, images, labels, source = site_data
    kwargs = {"site": site, "images": images, "labels": labels, "start_time": START, "source_indices": source}
    kwargs.update(change)

    with pytest.raises(CamtrapWriteError, match=match):
        write_camtrap_dp(tmp_path / "pkg", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_the_gateway_loader_reads_the_package_back(tmp_path: Path, site_data) -> None:
    loader = pytest.importorskip("edge_sdk.data.camtrap_dp", reason="the gateway's Camtrap DP loader is not built yet")
    site, images, labels, source = site_data
    out = _write(tmp_path, site_data)
    table = {e.scientific_name: (e.class_index, e.iucn) for e in SPECIES_TABLE}

    local = loader.load_camtrap_dp(out, table, image_size=28)

    by_media = {f"{site.site_id}-{int(s):05d}": i for i, s in enumerate(source)}
    order = [by_media[m] for m in local.media_ids]
    assert sorted(order) == list(range(len(images)))
    np.testing.assert_array_equal(local.images, images[order])
    np.testing.assert_array_equal(local.labels, labels[order])
    np.testing.assert_array_equal(local.categories, [SPECIES_TABLE[int(c)].iucn.rank for c in labels[order]])


def test_duplicate_images_are_refused_and_distinct_images_keeps_one_of_each(tmp_path: Path, site_data) -> None:
    """Animal-MNIST holds byte-identical pairs; were the demo to write both, the gateway would merge them (one
    image = one record, with a warning on every run), and a site's enrolled count would not be what its gateway
    loads."""
    site, images, labels, source = site_data
    images = images.copy()
    images[5] = images[2]  # same pixels, maybe another label: one image
    images[9] = images[2]
    with pytest.raises(CamtrapWriteError, match=r"2 image\(s\) repeat an earlier image .*row 5.*distinct_images"):
        write_camtrap_dp(tmp_path / "pkg", site=site, images=images, labels=labels, start_time=START,
                         source_indices=source)
    assert not (tmp_path / "pkg").exists()
    keep = camtrap_writer.distinct_images(images)
    assert keep.tolist() == [i for i in range(len(images)) if i not in (5, 9)]  # the first of each kept


def test_demo_sites_of_animal_mnist_load_exactly_their_image_count(tmp_path: Path, caplog) -> None:
    """With the real data, through the demo's own preparation (wildfed_sim.demo_prep.prepare_sites: split, site design,
    one package per site): every site's package loads exactly its ``num_images`` records (what the demo enrols as
    ``num_examples``), the gateway merges nothing, and no image is written twice."""
    import logging

    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from wildfed_sim.animal_mnist import default_cache_dir, fetch_animal_mnist
    from wildfed_sim.demo import DemoSettings
    from wildfed_sim.demo_prep import prepare_sites

    if not any(default_cache_dir().glob("animal_mnist-*.whl")):
        pytest.skip("Animal-MNIST is not in the cache (downloaded on the demo's first run)")
    data = fetch_animal_mnist()
    # independent count of byte-identical repeats: rows minus distinct rows (numpy's unique over whole images)
    repeats = len(data.images) - len(np.unique(data.images.reshape(len(data.images), -1), axis=0))
    assert repeats > 0 and len(camtrap_writer.distinct_images(data.images)) == len(data.images) - repeats

    class _Quiet:
        def log(self, *_: object) -> None:
            pass

    specs, train, _, _ = prepare_sites(DemoSettings(sites=3), tmp_path, _Quiet())
    table = {e.scientific_name: (e.class_index, e.iucn) for e in SPECIES_TABLE}
    for spec in specs:
        imgs = train.images[spec.indices].reshape(spec.num_images, -1)
        assert len(np.unique(imgs, axis=0)) == spec.num_images  # no image twice in a site
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edge_sdk.data.camtrap_dp"):
            local = load_camtrap_dp(tmp_path / "sites" / spec.site_id / "camtrap-dp", table)
        assert len(local) == spec.num_images
        assert not [r for r in caplog.records if "merged" in r.getMessage()]
