"""UPDATE and ACK payloads (site -> coordinator, and its answer): :class:`UpdateReport` with the model delta, and
:class:`Ack` (:mod:`shared.protocol`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.codec import encode_tensors
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

from shared.protocol.common import _category, _positive, _metadata, _read, _check_weights


@dataclass(frozen=True)
class UpdateReport:
    """What a site reports with its model delta (the payload tensors).

    Attributes:
        num_examples: N_k, the weight the site is counted with in FedAvg: its declared capacity (the task's
            ``capacity``), a public constant that does not depend on the site's data (docs/privacy.md, "No uncharged
            counts"); the coordinator refuses a report whose N_k is not the site's enrolled capacity. (In-process
            simulations without a capacity report the dataset's size.)
        local_steps: steps actually run.
        events: per IUCN category, the DP-SGD event that was run (empty for privacy "none").
        species_counts: ``{class index: noisy record count}`` for every class of the model when the task asked
            for counts (``TrainingTask.count_noise_multiplier``), else empty (then left out of the JSON).
        count_events: per active IUCN category, the event of that count release: ``DPSGDEvent(z_count, 1.0, 1)``
            (one Gaussian release, no subsampling); empty when none (left out of the JSON).
    """

    num_examples: int
    local_steps: int
    events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)
    species_counts: Mapping[int, float] = field(default_factory=dict)
    count_events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("num_examples", self.num_examples, integer=True, allow_zero=True)
        _positive("local_steps", self.local_steps, integer=True, allow_zero=True)
        for name in ("events", "count_events"):
            parsed = {_category(k): v for k, v in dict(getattr(self, name)).items()}
            for v in parsed.values():
                if not isinstance(v, DPSGDEvent):
                    raise PayloadError(f"event {v!r} is not a DPSGDEvent")
            object.__setattr__(self, name, parsed)
        counts: dict[int, float] = {}
        for k, v in dict(self.species_counts).items():
            try:
                index = int(k)
            except (TypeError, ValueError):
                raise PayloadError(f"species_counts key {k!r} is not a class index") from None
            if index < 0 or str(index) != str(k).strip() or isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v):
                raise PayloadError(f"species_counts[{k!r}] = {v!r}: need a class index and a finite number")
            counts[index] = float(v)
        object.__setattr__(self, "species_counts", counts)
        if bool(counts) != bool(self.count_events) and self.count_events:
            raise PayloadError("count_events without species_counts")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"num_examples": self.num_examples, "local_steps": self.local_steps,
                "events": {c.value: e.to_json() for c, e in self.events.items()},
                **({"species_counts": {str(k): v for k, v in sorted(self.species_counts.items())}}
                   if self.species_counts else {}),
                **({"count_events": {c.value: e.to_json() for c, e in self.count_events.items()}}
                   if self.count_events else {})}


@dataclass(frozen=True)
class Ack:
    """The coordinator's answer to an update: stored durably (``accepted``) or rejected with ``reason``."""

    round: int
    accepted: bool
    reason: str = ""


def encode_update(report: UpdateReport, delta: Mapping[str, np.ndarray]) -> bytes:
    """Payload of an UPDATE: the model delta (local minus global, float32) with the report as metadata."""
    return encode_tensors(_check_weights(delta), _metadata(report.to_json()))


def decode_update(payload: bytes, *, check_weights: bool = True) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_update`.

    Args:
        payload: the UPDATE payload bytes.
        check_weights: refuse non-float32 or non-finite tensors (default). False returns the tensors as stored, for
            a caller that checks them against the model itself (the coordinator's ingest, which gives those
            failures their own reason codes) without decoding the payload twice.

    Raises:
        PayloadError: as :func:`decode_task`, or a malformed DP event.
    """
    tensors, body = _read(payload, set(UpdateReport.__dataclass_fields__))
    events, count_events = body.get("events", {}), body.get("count_events", {})
    counts = body.get("species_counts", {})
    if not isinstance(events, dict) or not isinstance(count_events, dict):
        raise PayloadError("events and count_events must be objects keyed by IUCN category")
    if not isinstance(counts, dict):
        raise PayloadError("species_counts must be an object keyed by class index")
    try:
        report = UpdateReport(num_examples=body.get("num_examples"), local_steps=body.get("local_steps"),
                              events={k: DPSGDEvent.from_json(v) for k, v in events.items()},
                              species_counts=counts,
                              count_events={k: DPSGDEvent.from_json(v) for k, v in count_events.items()})
    except TypeError as exc:
        raise PayloadError(f"update fields wrong: {exc}") from exc
    return report, _check_weights(tensors) if check_weights else tensors


def encode_ack(ack: Ack) -> bytes:
    """Payload of an ACK (no tensors)."""
    return encode_tensors({}, _metadata({"round": ack.round, "accepted": ack.accepted, "reason": ack.reason}))


def decode_ack(payload: bytes) -> Ack:
    """Inverse of :func:`encode_ack`.

    Raises:
        PayloadError: malformed payload.
    """
    _, body = _read(payload, {"round", "accepted", "reason"})
    if type(body.get("round")) is not int or not isinstance(body.get("accepted"), bool):
        raise PayloadError("ack needs an integer round and a boolean accepted")
    return Ack(round=body["round"], accepted=body["accepted"], reason=str(body.get("reason", "")))
