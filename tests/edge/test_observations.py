"""A photo's current classification: the last human verdict supersedes earlier ones and the machine's; machine rows
train only with train_on=machine and enough probability; non-animal verdicts give no record."""

from __future__ import annotations

import pytest

from edge_sdk.data.observations import current_labels, row_bbox


def _row(mid: str, kind: str = "animal", name: str = "A", method: str = "human", at: str = "", by: str = "r",
         p: str = "", bbox: tuple[str, ...] = ("", "", "", "")) -> dict[str, str]:
    return {"observationID": f"{mid}-{at}-{name}", "mediaID": mid, "observationLevel": "media",
            "observationType": kind, "scientificName": name if kind == "animal" else "",
            "classificationMethod": method, "classificationTimestamp": at, "classifiedBy": by,
            "classificationProbability": p, "bboxX": bbox[0], "bboxY": bbox[1], "bboxWidth": bbox[2],
            "bboxHeight": bbox[3]}


def test_the_last_human_verdict_wins() -> None:
    rows = [_row("m1", name="A", method="machine", p="0.99", bbox=("0.1", "0.1", "0.2", "0.2")),
            _row("m1", name="B", at="2024-01-01T00:00:00Z", bbox=("0.1", "0.1", "0.2", "0.2")),
            _row("m1", name="C", at="2024-01-02T00:00:00Z", by="s")]  # a later correction, whole photo
    (label,) = current_labels(rows).values()
    assert (label.species, label.boxes, label.method) == (frozenset({"C"}), (), "human")
    rows.append(_row("m1", kind="blank", at="2024-01-03T00:00:00Z"))
    assert current_labels(rows) == {}  # now a blank: no training record


def test_a_verdict_is_the_rows_sharing_its_time_and_reviewer() -> None:
    rows = [_row("m1", name="A", at="t1", bbox=("0.1", "0.1", "0.2", "0.2")),
            _row("m1", name="A", at="t1", bbox=("0.5", "0.5", "0.1", "0.1")),
            _row("m1", name="A", at="t0", bbox=("0.9", "0.9", "0.1", "0.1"))]
    # file order decides: the last human row (t0) starts the verdict; rows of t1 belong to an earlier one
    assert current_labels(rows)["m1"].boxes == ((0.9, 0.9, 0.1, 0.1),)
    assert current_labels(rows[:2])["m1"].boxes == ((0.1, 0.1, 0.2, 0.2), (0.5, 0.5, 0.1, 0.1))


def test_machine_rows_need_train_on_machine_and_every_box_confident() -> None:
    rows = [_row("m1", name="A", method="machine", p="0.97"), _row("m1", name="A", method="machine", p="0.93"),
            _row("m2", name="Z", method="machine", p="0.99"), _row("m3", kind="blank", method="machine")]
    assert current_labels(rows) == {}
    got = current_labels(rows, train_on="machine", machine_threshold=0.95, listed={"A": 1})
    assert set(got) == {"m2"} and got["m2"].species == frozenset() and got["m2"].unlisted == {"Z"}
    got = current_labels(rows, train_on="machine", machine_threshold=0.9, listed={"A": 1})
    assert got["m1"].species == {"A"} and got["m1"].method == "machine"


def test_an_empty_method_counts_as_human_and_event_rows_are_ignored() -> None:
    rows = [_row("m1", method=""), {**_row("m2"), "observationLevel": "event"}]
    assert set(current_labels(rows)) == {"m1"}


def test_bad_boxes_and_options() -> None:
    with pytest.raises(ValueError, match="normalised"):
        row_bbox(_row("m1", bbox=("0.5", "0.5", "0", "0.1")))
    with pytest.raises(ValueError, match="m1-t-A"):
        current_labels([_row("m1", at="t", bbox=("1.5", "0", "0.1", "0.1"))])
    with pytest.raises(ValueError, match="train_on"):
        current_labels([], train_on="all")
