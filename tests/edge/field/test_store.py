"""The gateway's index: events by deployment and gap, the event's mean probabilities read with the site prior,
least-certain-first ordering, and a ranger's verdict written to the package as human observations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_sdk.field.predictions import read_prediction
from edge_sdk.field.site_package import SitePackage
from edge_sdk.field.store import FieldStore, PhotoEntry
from edge_sdk.field.verdicts import apply_verdict


def _read(p: np.ndarray):
    return read_prediction(p, {0, 1, 2}, threshold=0.5)


def _photo(mid: str, dep: str, t: str, probs=None, boxes=({"bbox": [0.1, 0.1, 0.2, 0.2]},)) -> PhotoEntry:
    return PhotoEntry(mid, dep, f"media/{mid}.jpg", f"{mid}.jpg", t, "exif", 100, 80, tuple(boxes),
                      None if probs is None else np.asarray(probs, float))


def test_events_group_by_deployment_and_gap_and_average_probabilities(tmp_path: Path) -> None:
    store = FieldStore(tmp_path / "field.sqlite", gap_s=60)
    e1 = store.add_photo(_photo("m1", "s/a", "2024-01-01T10:00:00+00:00", [0.6, 0.3, 0.1]), _read)
    e2 = store.add_photo(_photo("m2", "s/a", "2024-01-01T10:00:30+00:00", [0.2, 0.7, 0.1]), _read)
    e3 = store.add_photo(_photo("m3", "s/b", "2024-01-01T10:00:10+00:00", [0.1, 0.1, 0.8]), _read)
    e4 = store.add_photo(_photo("m4", "s/a", "2024-01-01T10:05:00+00:00", boxes=()), _read)
    assert e1 == e2 and len({e1, e3, e4}) == 3
    event = store.event(e1)
    # mean of (0.6, 0.3, 0.1) and (0.2, 0.7, 0.1) = (0.4, 0.5, 0.1): class 1 at exactly 0.5 -> confident
    assert (event.n_media, event.n_classified, event.species_index, event.status) == (2, 2, 1, "confident")
    assert event.confidence == pytest.approx(0.5) and event.uncertainty == pytest.approx(0.5)
    assert (event.start, event.end) == ("2024-01-01T10:00:00+00:00", "2024-01-01T10:00:30+00:00")
    assert store.event(e4).status == "blank" and store.event(e3).species_index == 2
    order = [e.event_id for e in store.events(order="uncertain")]
    assert order[0] == e1  # 0.5 uncertain, then e3 (0.2), then the blank one (0)
    assert order == [e1, e3, e4]
    assert store.add_photo(_photo("m1", "s/a", "2024-01-01T10:00:00+00:00"), _read) == e1  # stored once
    assert store.counts() == {"media": 4, "events": 3, "reviewed": 0, "unreviewed": 3}


def test_a_failed_package_write_stores_nothing(tmp_path: Path) -> None:
    store = FieldStore(tmp_path / "field.sqlite")

    def broken(event_id: str) -> str:
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.add_photo(_photo("m1", "s/a", "2024-01-01T10:00:00+00:00", [1, 0, 0]), _read, write=broken)
    assert not store.has_media("m1") and store.counts()["events"] == 0


def test_a_verdict_appends_human_observations_and_marks_the_event(tmp_path: Path) -> None:
    store = FieldStore(tmp_path / "field.sqlite")
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    pkg.ensure()
    boxes = ({"bbox": [0.1, 0.2, 0.3, 0.4]}, {"bbox": [0.5, 0.5, 0.1, 0.1]})
    e = store.add_photo(_photo("m1", "s/a", "2024-01-01T10:00:00+00:00", [0.9, 0.1, 0.0], boxes), _read)
    store.add_photo(_photo("m2", "s/a", "2024-01-01T10:00:05+00:00", [0.8, 0.2, 0.0], ()), _read)
    n = apply_verdict(store, pkg, e, verdict="species", species="Lycaon pictus", reviewer="alice",
                      species_table={"Lycaon pictus": None}, at="2024-01-02T08:00:00+00:00")
    rows = pkg.rows("observations")
    assert n == 3 and len(rows) == 3  # two boxes on m1, one whole-photo row on m2
    assert {r["classificationMethod"] for r in rows} == {"human"} and {r["classifiedBy"] for r in rows} == {"alice"}
    assert [(r["mediaID"], r["bboxX"]) for r in rows] == [("m1", "0.100000"), ("m1", "0.500000"), ("m2", "")]
    assert store.event(e).verdict == "species" and store.events(reviewed=False) == []
    apply_verdict(store, pkg, e, verdict="blank", reviewer="bob", at="2024-01-02T09:00:00+00:00")
    assert [r["observationType"] for r in pkg.rows("observations")[3:]] == ["blank", "blank"]
    with pytest.raises(ValueError, match="species table"):
        apply_verdict(store, pkg, e, verdict="species", species="Panthera leo", reviewer="a", species_table={})
    with pytest.raises(ValueError, match="verdict"):
        apply_verdict(store, pkg, e, verdict="maybe", reviewer="a")
    with pytest.raises(KeyError):
        apply_verdict(store, pkg, "no-such-event", verdict="blank", reviewer="a")


def test_review_order_filters_count_and_the_event_after(tmp_path: Path) -> None:
    store = FieldStore(tmp_path / "field.sqlite", gap_s=60)
    # one photo per event, an hour apart; readings (with the site prior over {0, 1, 2}: none unexpected)
    plan = [("a", "s/a", [0.9, 0.05, 0.05]),  # confident 0.9 -> uncertainty 0.1
            ("b", "s/a", [0.4, 0.35, 0.25]),  # unknown 0.4 -> 0.6
            ("c", "s/b", [0.2, 0.6, 0.2]),  # confident 0.6 -> 0.4
            ("d", "s/b", [0.25, 0.15, 0.6]),  # confident 0.6 -> 0.4 (ties with c; d is later)
            ("e", "s/a", None)]  # blank (no box) -> 0
    ids = {}
    for i, (name, dep, probs) in enumerate(plan):
        ids[name] = store.add_photo(_photo(name, dep, f"2024-01-01T{10 + i:02d}:00:00+00:00", probs,
                                           boxes=() if probs is None else ({"bbox": [0.1, 0.1, 0.2, 0.2]},)), _read)
    by = {v: k for k, v in ids.items()}

    def names(events):
        return [by[e.event_id] for e in events]

    # least certain first: b (0.6), then d and c (0.4 each: the later end first), a (0.1), e (0)
    assert names(store.events(order="uncertain")) == ["b", "d", "c", "a", "e"]
    assert names(store.events(order="newest")) == ["e", "d", "c", "b", "a"]
    assert names(store.events(status="confident")) == ["d", "c", "a"]
    assert names(store.events(deployment_id="s/a", order="newest")) == ["e", "b", "a"]
    assert names(store.events(limit=2, offset=2)) == ["c", "a"]
    assert store.count_events() == 5 and store.count_events(status="unknown") == 1
    assert store.count_events(deployment_id="s/b", status="blank") == 0
    # the events after one, in each order
    assert names(store.events(after=ids["d"])) == ["c", "a", "e"]
    assert names(store.events(after=ids["c"], order="newest")) == ["b", "a"]
    assert names(store.events(after=ids["b"], deployment_id="s/a")) == ["a", "e"]
    store.set_verdict(ids["c"], verdict="blank", species=None, by="ana", at="2024-01-02T00:00:00+00:00")
    assert names(store.events(after=ids["c"], limit=1)) == ["a"]  # a reviewed event still has its place
    assert store.count_events() == 4 and store.count_events(reviewed=True) == 1
    assert store.count_events(reviewed=None) == 5
    with pytest.raises(ValueError, match="status"):
        store.events(status="maybe")
    with pytest.raises(KeyError):
        store.events(after="no-such-event")


def test_two_verdicts_within_one_second_do_not_merge(tmp_path: Path) -> None:
    from edge_sdk.data.observations import current_labels

    store = FieldStore(tmp_path / "field.sqlite")
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    pkg.ensure()
    e = store.add_photo(_photo("m1", "s/a", "2024-01-01T10:00:00+00:00", [0.9, 0.1, 0.0]), _read)
    table = {"Lycaon pictus": None, "Equus quagga": None}
    apply_verdict(store, pkg, e, verdict="species", species="Lycaon pictus", reviewer="ana", species_table=table)
    apply_verdict(store, pkg, e, verdict="species", species="Equus quagga", reviewer="ana", species_table=table)
    first, second = (r["classificationTimestamp"] for r in pkg.rows("observations"))
    assert second > first  # (same offset, whole seconds: the strings order as the times do)
    assert current_labels(pkg.rows("observations"))["m1"].species == frozenset({"Equus quagga"})


def test_photos_with_file_times_are_events_of_their_own(tmp_path: Path) -> None:
    # three photos copied in together: the same file time, different animals; the camera's clock was not read
    store = FieldStore(tmp_path / "field.sqlite", gap_s=60)
    filed = [PhotoEntry(m, "s/a", f"media/{m}.jpg", f"{m}.jpg", "2024-01-01T10:00:00+00:00", "mtime", 100, 80,
                        ({"bbox": [0.1, 0.1, 0.2, 0.2]},), np.asarray(p, float))
             for m, p in (("m1", [1, 0, 0]), ("m2", [0, 1, 0]), ("m3", [0, 0, 1]))]
    events = {store.add_photo(p, _read) for p in filed}
    assert len(events) == 3
    # and a camera-timed photo at the same time does not join them either
    e = store.add_photo(_photo("m4", "s/a", "2024-01-01T10:00:00+00:00", [1, 0, 0]), _read)
    assert e not in events and store.event(e).n_media == 1
