"""Event assignment: photos of one deployment within the gap form one event (hand-worked spans)."""

from __future__ import annotations

import pytest

from edge_sdk.field.events import EventSpan, assign_event, epoch_seconds, event_id_for


def test_a_photo_joins_the_event_whose_span_plus_gap_holds_it() -> None:
    spans = [EventSpan("a", 1000.0, 1010.0), EventSpan("b", 2000.0, 2000.0)]
    assert assign_event(spans, 1005.0, gap_s=60).event_id == "a"  # inside
    assert assign_event(spans, 1070.0, gap_s=60).event_id == "a"  # 60 s after the end: still joins
    assert assign_event(spans, 1070.5, gap_s=60) is None  # 60.5 s after: a new event
    assert assign_event(spans, 940.0, gap_s=60).event_id == "a"  # before the start, within the gap


def test_the_nearest_event_wins_when_two_qualify() -> None:
    spans = [EventSpan("a", 0.0, 10.0), EventSpan("b", 100.0, 110.0)]
    assert assign_event(spans, 50.0, gap_s=60).event_id == "a"  # 40 s from a, 50 s from b
    assert assign_event(spans, 60.0, gap_s=60).event_id == "b"  # 50 s from a, 40 s from b
    assert assign_event(spans, 55.0, gap_s=60).event_id == "a"  # a tie goes to the earlier event


def test_ids_and_times() -> None:
    assert event_id_for("s/main", "m1") == event_id_for("s/main", "m1") != event_id_for("s/other", "m1")
    assert epoch_seconds("1970-01-01T01:00:00+01:00") == 0.0
    with pytest.raises(ValueError, match="offset"):
        epoch_seconds("2024-01-01T00:00:00")
    with pytest.raises(ValueError, match="gap"):
        assign_event([], 0.0, gap_s=-1)
