"""Events: photos of one deployment taken within a gap of each other form one event (Camtrap DP ``eventID``).

A camera trap fires bursts: three to ten photos of the same animal within seconds. Rangers review an event, not
each photo, and an event's species is read from all its photos together: the mean of their probability vectors
(each photo contributing the vector of its most confident detection), read with the site prior and threshold of
:mod:`edge_sdk.field.predictions`. This is the sequence-level averaging camera-trap classifiers use (e.g.
MegaDetector's and Zamba's sequence aggregation; Norouzzadeh et al. 2021 average over a sequence's images).

Assignment is online (photos arrive one by one, not always in capture order): a photo joins the event of its
deployment whose span ``[start - gap, end + gap]`` contains its time, the nearest one when two do, and otherwise
opens a new event; events never merge afterwards, so an event id, once shown to a ranger, keeps its photos. The id is
a hash of the deployment and the first photo's media id: stable across restarts and re-processing. Only the camera's
own clock (EXIF) groups photos: a photo whose time is the file's (a card copied, an upload) is an event of its own,
since files copied together share a time that says nothing of when the animals passed (the gateway's index,
:mod:`edge_sdk.field.store`, applies this).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from shared.camtrap_dp import parse_datetime

__all__ = ["DEFAULT_GAP_S", "EventSpan", "event_id_for", "assign_event", "epoch_seconds"]

#: Photos of one deployment closer than this (seconds) belong to one event.
DEFAULT_GAP_S = 60.0


@dataclass(frozen=True)
class EventSpan:
    """An event's time span on its deployment.

    Attributes:
        event_id: the event's id.
        start, end: capture times of its first and last photo, seconds since the Unix epoch (UTC).
    """

    event_id: str
    start: float
    end: float


def epoch_seconds(timestamp: str) -> float:
    """Seconds since the Unix epoch of an ISO 8601 timestamp with a UTC offset (Camtrap DP's form).

    Raises:
        ValueError: not ISO 8601, or no offset.
    """
    moment = parse_datetime(timestamp)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {timestamp!r} has no UTC offset")
    return moment.timestamp()


def event_id_for(deployment_id: str, first_media_id: str) -> str:
    """The id of the event a photo opens: ``"event-"`` and 16 hex digits of SHA-256 of deployment and media id."""
    digest = hashlib.sha256(f"{deployment_id}\0{first_media_id}".encode("utf-8")).hexdigest()
    return f"event-{digest[:16]}"


def assign_event(spans: Iterable[EventSpan], when: float, *, gap_s: float = DEFAULT_GAP_S) -> EventSpan | None:
    """The event of a deployment that a photo taken at ``when`` joins, or None when it opens a new one.

    Args:
        spans: the deployment's events.
        when: the photo's capture time, epoch seconds.
        gap_s: the gap in seconds (>= 0).

    Returns:
        The joined event's span (before it grows to include ``when``), the nearest when several qualify (ties: the
        earlier event), or None.

    Raises:
        ValueError: a negative gap.
    """
    if gap_s < 0:
        raise ValueError(f"the event gap must be >= 0 seconds, got {gap_s!r}")
    best: tuple[float, float, EventSpan] | None = None
    for span in spans:
        if span.start - gap_s <= when <= span.end + gap_s:
            distance = 0.0 if span.start <= when <= span.end else min(abs(when - span.start), abs(when - span.end))
            key = (distance, span.start, span)
            if best is None or key[:2] < best[:2]:
                best = key
    return best[2] if best is not None else None
