"""NIRA's clustering on the real public metadata of ../shared/data (wildfed_sim.nira_metadata, ``wildfed clusters
check-metadata``): every figure recounted independently from the raw CSV files.

Skipped with a reason where ../shared/data is absent (a fresh clone; docs/nira.md).
"""

from __future__ import annotations

import csv
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.strategies.ecological_clustering import jaccard, jaccard_matrix
from tests.support import SHARED_DATA

DATA_ROOT = SHARED_DATA


def _need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"real data not present at {path} (set WILDFED_SHARED_DATA to the data folder; see docs/nira.md)")


def _raw_wi_species(project: str) -> dict[str, set[str]]:
    """Independent recount from images.csv: genus + species, people left out."""
    out: dict[str, set[str]] = {}
    with (DATA_ROOT / "wildlife-insights" / project / "images.csv").open(newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            s = out.setdefault(r["deployment_id"], set())
            if r["genus"] and r["species"] and r["genus"] != "Homo":
                s.add(f"{r['genus']} {r['species']}")
    return out


def test_wildlife_insights_clusters_line_up_with_projects() -> None:
    _need(DATA_ROOT / "wildlife-insights")
    from wildfed_sim.nira_metadata import wildlife_insights_metadata, wildlife_insights_report

    metadata, project = wildlife_insights_metadata(DATA_ROOT)
    raw = {**_raw_wi_species("cajambre"), **_raw_wi_species("cristales")}
    assert len(metadata) == 38 and sorted(project.values()).count("cajambre") == 19
    for dep in ("CTCAJ143747", "CTCAJ013743", "CTCCR015087"):
        assert set(metadata[dep]["species"]) == raw[dep]
    assert raw["CTCAJ143747"] == {"Mazama temama"}  # one image of one deer: the outlier below

    report = wildlife_insights_report(DATA_ROOT, distance_thresholds=(0.9,), num_clusters=(2,))
    assert report["removed_sensitive"] == []  # no CR/EN mammal in either project (MDD 2020)
    by_cut = {json.dumps(c["cut"]): c for c in report["cuts"]}
    cut = by_cut['{"distance_threshold": 0.9}']
    assert cut["contingency"]["table"] == [[18, 1, 0], [0, 0, 19]]
    assert cut["clusters"]["c1"] == ["CTCAJ143747"]
    # ARI by hand: sum_ij = C(18,2)+C(19,2) = 153+171 = 324; rows 2*C(19,2) = 342; cols 153+0+171 = 324;
    # C(38,2) = 703; E = 342*324/703; max = (342+324)/2 = 333
    e = 342 * 324 / 703
    assert cut["adjusted_rand_index"] == pytest.approx((324 - e) / (333 - e), abs=1e-12)
    assert cut["purity"] == 1.0
    k2 = by_cut['{"num_clusters": 2}']  # average linkage splits off the outlier first
    assert k2["contingency"]["table"] == [[18, 1], [19, 0]] and k2["adjusted_rand_index"] == pytest.approx(0.0,
                                                                                                          abs=0.02)
    # Jaccard of one pair straight from the recount: cajambre's 013743 vs cristales' 015087
    a, b = raw["CTCAJ013743"], raw["CTCCR015087"]
    ids, _ = jaccard_matrix({d: metadata[d]["species"] for d in metadata})
    assert len(ids) == 38
    assert report["mean_jaccard_within_project"] > 3 * report["mean_jaccard_between_projects"]
    assert jaccard(metadata["CTCAJ013743"]["species"], metadata["CTCCR015087"]["species"]) == \
        pytest.approx(len(a & b) / len(a | b))


def test_serengeti_jaccard_distribution_and_clusters() -> None:
    path = DATA_ROOT / "snapshot-serengeti" / "annotations.csv.gz"
    _need(path)
    from wildfed_sim.nira_metadata import serengeti_report

    raw: dict[str, set[str]] = {}
    with gzip.open(path, "rt", newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            label = "lion" if r["category_id"].startswith("lion") else r["category_id"]
            s = raw.setdefault(r["location"], set())
            if label not in ("fire", "rhinoceros", "wilddog"):
                s.add(label)
    t0 = time.perf_counter()
    report = serengeti_report(DATA_ROOT, distance_threshold=0.6)
    assert time.perf_counter() - t0 < 20
    assert report["num_locations"] == len(raw) == 223
    assert report["removed_sensitive"] == ["rhinoceros", "wilddog"]  # CR and EN in the MDD (2020)
    # distribution recomputed from the raw sets
    names = sorted(raw)
    values = np.array([len(raw[x] & raw[y]) / len(raw[x] | raw[y]) for i, x in enumerate(names)
                       for y in names[i + 1:]])
    j = report["jaccard"]
    assert j["pairs"] == 223 * 222 // 2 == values.size
    assert (j["min"], j["max"]) == (values.min(), values.max())
    assert j["median"] == pytest.approx(np.median(values))
    assert 0.4 < j["median"] < 0.6  # one ecosystem: much more overlap than the seed's lower end
    # clusters at 1 - J = 0.6: one big cluster plus small under-sampled groups (measured, docs/nira.md)
    sizes = sorted(report["cluster_sizes"].values(), reverse=True)
    assert sum(sizes) == 223 and sizes[0] == 195 and report["num_clusters"] == 12
    big = report["cluster_profile"]["c0"]
    small = [p for label, p in report["cluster_profile"].items() if label != "c0"]
    assert all(p["mean_annotations"] < big["mean_annotations"] for p in small)
