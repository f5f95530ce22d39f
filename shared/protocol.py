"""Message payloads: what rides inside an envelope.

Every payload is safetensors (:mod:`shared.codec`) whose metadata key ``"wildfed"`` holds the JSON of one of the
frozen dataclasses below; the tensors are model weights (TASK), a model delta (UPDATE) or none (ACK).

Compatibility rules: fields are never removed and never change meaning; new fields are optional with defaults
that keep the old meaning; decoders reject unknown fields so a misread is loud, not silent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shared.codec import decode_tensors, encode_tensors
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

__all__ = ["TrainingTask", "UpdateReport", "Ack", "encode_task", "decode_task", "encode_update",
           "decode_update", "encode_ack", "decode_ack", "METADATA_KEY"]

METADATA_KEY = "wildfed"
PrivacyMode = Literal["ccdp", "none"]


def _category(value: Any) -> IUCNCategory:
    try:
        return IUCNCategory(value)
    except ValueError:
        raise PayloadError(f"{value!r} is not an IUCN category") from None


def _positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = (type(value) is int) if integer else (isinstance(value, (int, float)) and not isinstance(value, bool))
    if not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise PayloadError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} "
                           f"{'integer' if integer else 'number'}, got {value!r}")


@dataclass(frozen=True)
class TrainingTask:
    """One site's instructions for one round (the payload tensors are the global weights).

    Attributes:
        federation_id, round, model_hash: identify the round and the global model version (hex SHA-256).
        local_steps: DP-SGD steps to run this round.
        expected_batch_size: B; the site samples at rate q = min(1, B / N_active).
        learning_rate: local SGD step size.
        clipping_norm: C, L2 bound of each per-example gradient.
        target_delta: delta of every category's (eps, delta) guarantee.
        planned_rounds: rounds the federation plans; noise is calibrated so that ``planned_rounds * local_steps``
            steps spend each category's whole budget.
        privacy: ``"ccdp"`` or ``"none"`` (non-private reference runs only).
        budgets: total epsilon budget per IUCN category (whole federation, per record).
        halted: categories whose records this site must not sample any more (the ledger halted them).
        seed: a seed for reproducible runs, or None. A gateway honours it only when its own site config sets
            ``allow_seeded_noise`` (whoever knows the seed can subtract the noise); it then warns loudly.
    """

    federation_id: str
    round: int
    model_hash: str
    local_steps: int
    expected_batch_size: int
    learning_rate: float
    clipping_norm: float
    target_delta: float
    planned_rounds: int
    privacy: PrivacyMode = "ccdp"
    budgets: Mapping[IUCNCategory, float] = field(default_factory=dict)
    halted: tuple[IUCNCategory, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        _positive("round", self.round, integer=True, allow_zero=True)
        _positive("local_steps", self.local_steps, integer=True)
        _positive("expected_batch_size", self.expected_batch_size, integer=True)
        _positive("learning_rate", self.learning_rate)
        _positive("clipping_norm", self.clipping_norm)
        _positive("planned_rounds", self.planned_rounds, integer=True)
        if not (isinstance(self.target_delta, float) and 0 < self.target_delta < 1):
            raise PayloadError(f"target_delta must be in (0, 1), got {self.target_delta!r}")
        if self.privacy not in ("ccdp", "none"):
            raise PayloadError(f"privacy must be 'ccdp' or 'none', got {self.privacy!r}")
        budgets = {_category(k): v for k, v in dict(self.budgets).items()}
        for cat, eps in budgets.items():
            _positive(f"budgets[{cat.value}]", eps)
        if self.privacy == "ccdp" and not budgets:
            raise PayloadError("a ccdp task must give budgets")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "halted", tuple(sorted({_category(c) for c in self.halted}, key=lambda c: c.rank)))
        if self.seed is not None and type(self.seed) is not int:
            raise PayloadError(f"seed must be an integer or null, got {self.seed!r}")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"federation_id": self.federation_id, "round": self.round, "model_hash": self.model_hash,
                "local_steps": self.local_steps, "expected_batch_size": self.expected_batch_size,
                "learning_rate": self.learning_rate, "clipping_norm": self.clipping_norm,
                "target_delta": self.target_delta, "planned_rounds": self.planned_rounds,
                "privacy": self.privacy, "budgets": {c.value: v for c, v in self.budgets.items()},
                "halted": [c.value for c in self.halted], "seed": self.seed}


@dataclass(frozen=True)
class UpdateReport:
    """What a site reports with its model delta (the payload tensors).

    Attributes:
        num_examples: N_k, records in the site's non-halted categories: declared public metadata (it is the
            FedAvg weight; docs/privacy.md).
        local_steps: steps actually run.
        events: per IUCN category, the DP-SGD event that was run (empty for privacy "none").
    """

    num_examples: int
    local_steps: int
    events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("num_examples", self.num_examples, integer=True, allow_zero=True)
        _positive("local_steps", self.local_steps, integer=True, allow_zero=True)
        events = {_category(k): v for k, v in dict(self.events).items()}
        for v in events.values():
            if not isinstance(v, DPSGDEvent):
                raise PayloadError(f"event {v!r} is not a DPSGDEvent")
        object.__setattr__(self, "events", events)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"num_examples": self.num_examples, "local_steps": self.local_steps,
                "events": {c.value: e.to_json() for c, e in self.events.items()}}


@dataclass(frozen=True)
class Ack:
    """The coordinator's answer to an update: stored durably (``accepted``) or rejected with ``reason``."""

    round: int
    accepted: bool
    reason: str = ""


def _metadata(obj: Any) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(obj, sort_keys=True, separators=(",", ":"))}


def _read(payload: bytes, fields: set[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    tensors, metadata = decode_tensors(payload)
    if METADATA_KEY not in metadata:
        raise PayloadError(f"payload has no '{METADATA_KEY}' metadata")
    try:
        body = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise PayloadError(f"'{METADATA_KEY}' metadata is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise PayloadError("metadata body is not an object")
    unknown = set(body) - fields
    if unknown:
        raise PayloadError(f"unknown fields {sorted(unknown)}")
    return tensors, body


def _check_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        array = np.asarray(value)
        if array.dtype != np.float32:
            raise PayloadError(f"tensor {name!r} has dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise PayloadError(f"tensor {name!r} holds non-finite values")
        out[name] = array
    return out


def encode_task(task: TrainingTask, weights: Mapping[str, np.ndarray]) -> bytes:
    """Payload of a TASK: the global weights (float32 arrays) with the task as metadata."""
    return encode_tensors(_check_weights(weights), _metadata(task.to_json()))


def decode_task(payload: bytes) -> tuple[TrainingTask, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_task`.

    Raises:
        PayloadError: not safetensors, missing/unknown fields, values out of range, non-float32 or non-finite
            weights.
    """
    tensors, body = _read(payload, set(TrainingTask.__dataclass_fields__))
    try:
        task = TrainingTask(**{**body, "halted": tuple(body.get("halted", ()))})
    except TypeError as exc:
        raise PayloadError(f"task fields wrong: {exc}") from exc
    return task, _check_weights(tensors)


def encode_update(report: UpdateReport, delta: Mapping[str, np.ndarray]) -> bytes:
    """Payload of an UPDATE: the model delta (local minus global, float32) with the report as metadata."""
    return encode_tensors(_check_weights(delta), _metadata(report.to_json()))


def decode_update(payload: bytes) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_update`.

    Raises:
        PayloadError: as :func:`decode_task`, or a malformed DP event.
    """
    tensors, body = _read(payload, set(UpdateReport.__dataclass_fields__))
    events = body.get("events", {})
    if not isinstance(events, dict):
        raise PayloadError("events must be an object keyed by IUCN category")
    try:
        report = UpdateReport(num_examples=body.get("num_examples"), local_steps=body.get("local_steps"),
                              events={k: DPSGDEvent.from_json(v) for k, v in events.items()})
    except TypeError as exc:
        raise PayloadError(f"update fields wrong: {exc}") from exc
    return report, _check_weights(tensors)


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
