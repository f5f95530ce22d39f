"""The payload of a HEALTH envelope: a gateway's small, periodic health record (site -> coordinator).

A gateway publishes one on its ``health`` topic (``shared.topics.health_topic``), signed with its site key, when it
starts and after every reconnect, when it keeps a new global model, and every ``health_interval_s`` (site.yaml;
default 15 minutes). The coordinator stores the newest per site (``coordinator.fleet``) and ``wildfed-coordinator
fleet`` shows them.

What it says is operational and declared public (docs/privacy.md, "Public metadata"): the software version, which
global model the gateway holds, the last round it trained (that a site trains in a round is public anyway), how many
updates wait for their ACK (protocol state, at most a few), how many photos wait in the incoming folder and how many
detection records wait to be sent (counts of photos, each of which leaves as a detection record anyway; None where
the site publishes no detection records), the free space of the state folder rounded down to a whole GiB, and the
newest error line of its log. Nothing about the site's training records: no record count, no species, no loss.

Payload: safetensors with no tensor, the JSON of :class:`HealthRecord` under metadata key ``"wildfed"``.
Compatibility rules (those of :mod:`shared.protocol`): fields are never removed and never change meaning; new fields
are optional with defaults; the decoder rejects unknown fields.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from shared.codec import decode_tensors, encode_tensors
from shared.errors import PayloadError

__all__ = ["HealthRecord", "encode_health", "decode_health", "MAX_ERROR_CHARS", "DISK_FREE_STEP_BYTES",
           "MAX_HEALTH_BYTES", "VERSION_PATTERN", "round_disk_free"]

METADATA_KEY = "wildfed"
MAX_ERROR_CHARS = 200
"""The longest ``last_error`` a record carries (the sender cuts it; the decoder refuses a longer one)."""
DISK_FREE_STEP_BYTES = 1 << 30
"""``disk_free_bytes`` is rounded down to a multiple of this (1 GiB; :func:`round_disk_free`)."""
MAX_HEALTH_BYTES = 16 * 1024
"""A health record is a few hundred bytes: the coordinator refuses a larger message unparsed."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+!-]{0,63}$")
"""What ``sdk_version`` may hold (a PEP 440 version, or ``unknown``)."""


def round_disk_free(free_bytes: int) -> int:
    """``free_bytes`` rounded down to a whole :data:`DISK_FREE_STEP_BYTES` (what a record carries)."""
    return max(0, int(free_bytes)) // DISK_FREE_STEP_BYTES * DISK_FREE_STEP_BYTES


def _count(name: str, value: Any, *, optional: bool = False, minimum: int = 0) -> None:
    if value is None and optional:
        return
    if type(value) is not int or value < minimum:
        raise PayloadError(f"{name} must be an integer >= {minimum}{' or null' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class HealthRecord:
    """One health record of a gateway.

    Attributes:
        sdk_version: the installed WildFed version (``importlib.metadata``; 1-64 of ``A-Za-z0-9_.+!-``).
        model_round: the round of the global model the gateway predicts with: the round that made it for a model
            released by the coordinator, the round of the task that carried it otherwise; None when it holds none.
        model_hash: that model's hash (64 hex), ``""`` when none.
        last_round: the last round the gateway trained, -1 before any.
        outbox_backlog: updates waiting for the coordinator's ACK.
        incoming_backlog: photos waiting in the incoming folder; None without an incoming folder or when the site
            publishes no detection records (the count is then not public).
        detection_backlog: detection records waiting to be published; None as ``incoming_backlog``.
        disk_free_bytes: free bytes of the file system of the state folder, rounded down to a whole GiB
            (:func:`round_disk_free`); None when unknown.
        last_error: the newest ERROR line of the gateway's log, at most :data:`MAX_ERROR_CHARS` characters; ``""``
            when none since it started.
        last_error_at: when it was logged, Unix seconds; None when none.
        started_at: when the agent started, Unix seconds.

    Raises:
        PayloadError: a field out of range.
    """

    sdk_version: str
    model_round: int | None
    model_hash: str
    last_round: int
    outbox_backlog: int
    incoming_backlog: int | None
    detection_backlog: int | None
    disk_free_bytes: int | None
    last_error: str
    last_error_at: int | None
    started_at: int

    def __post_init__(self) -> None:
        if not isinstance(self.sdk_version, str) or not VERSION_PATTERN.match(self.sdk_version):
            raise PayloadError(f"sdk_version {self.sdk_version!r:.80} is not a version string")
        _count("model_round", self.model_round, optional=True)
        if not isinstance(self.model_hash, str) or not (self.model_hash == "" or _HEX64.match(self.model_hash)):
            raise PayloadError("model_hash must be 64 lowercase hex characters or empty")
        if (self.model_round is None) != (self.model_hash == ""):
            raise PayloadError("model_round and model_hash are given together (a model) or not at all")
        _count("last_round", self.last_round, minimum=-1)
        _count("outbox_backlog", self.outbox_backlog)
        _count("incoming_backlog", self.incoming_backlog, optional=True)
        _count("detection_backlog", self.detection_backlog, optional=True)
        _count("disk_free_bytes", self.disk_free_bytes, optional=True)
        if self.disk_free_bytes is not None and self.disk_free_bytes % DISK_FREE_STEP_BYTES:
            raise PayloadError(f"disk_free_bytes must be a multiple of {DISK_FREE_STEP_BYTES} (whole GiB)")
        if not isinstance(self.last_error, str) or len(self.last_error) > MAX_ERROR_CHARS:
            raise PayloadError(f"last_error must be a string of at most {MAX_ERROR_CHARS} characters")
        _count("last_error_at", self.last_error_at, optional=True)
        _count("started_at", self.started_at)

    def to_json(self) -> dict[str, Any]:
        """The metadata JSON object (every field)."""
        return asdict(self)


def encode_health(record: HealthRecord) -> bytes:
    """The payload of a HEALTH envelope (no tensors)."""
    return encode_tensors({}, {METADATA_KEY: json.dumps(record.to_json(), sort_keys=True, separators=(",", ":"))})


def decode_health(payload: bytes | memoryview) -> HealthRecord:
    """Inverse of :func:`encode_health`.

    Raises:
        PayloadError: not safetensors, tensors present, no or malformed metadata, unknown or missing fields, values
            out of range.
    """
    tensors, metadata = decode_tensors(bytes(payload))
    if tensors:
        raise PayloadError("a health record carries no tensors")
    if METADATA_KEY not in metadata:
        raise PayloadError(f"health payload has no '{METADATA_KEY}' metadata")
    try:
        body = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise PayloadError(f"'{METADATA_KEY}' metadata is not JSON: {exc}") from exc
    fields = set(HealthRecord.__dataclass_fields__)
    if not isinstance(body, dict) or set(body) != fields:
        got = set(body) if isinstance(body, dict) else set()
        raise PayloadError(f"health record fields wrong: unknown {sorted(got - fields)}, missing "
                           f"{sorted(fields - got)}")
    return HealthRecord(**body)
