"""Rejections: the reason codes of refused site messages, the exception that carries one out of a chain of checks,
and the result a handler returns for it.

Every receiving handler of the coordinator (updates and chunked uploads, :mod:`coordinator.inbound.ingest` and
:mod:`coordinator.inbound.transfers`; health records, :mod:`coordinator.inbound.health`; detection records,
:mod:`coordinator.detections`; secure-aggregation stages, :mod:`coordinator.global_dp`) raises :class:`Reject` from
its checks and turns it into a stored, counted :class:`Rejected`. The codes are stable: they are stored
(``rejections`` table), counted in ``status``, and sent back to a site in a negative ACK.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["RejectReason", "Reject", "Rejected"]


class RejectReason(str, enum.Enum):
    """Stable reason codes of rejected messages (stored and counted in ``status``)."""

    MALFORMED_ENVELOPE = "malformed_envelope"
    BAD_TOPIC = "bad_topic"
    WRONG_KIND = "wrong_kind"
    WRONG_FEDERATION = "wrong_federation"
    TOPIC_MISMATCH = "topic_mismatch"
    UNKNOWN_SITE = "unknown_site"
    BAD_SIGNATURE = "bad_signature"
    WRONG_ROUND = "wrong_round"
    LATE = "late"
    NOT_SELECTED = "not_selected"
    STALE_MODEL = "stale_model"
    DUPLICATE = "duplicate"
    MALFORMED_PAYLOAD = "malformed_payload"
    WRONG_TENSORS = "wrong_tensors"
    NON_FINITE = "non_finite"
    BAD_REPORT = "bad_report"
    HALTED_CATEGORY = "halted_category"
    OVER_BUDGET = "over_budget"
    SECAGG_PROTOCOL = "secagg_protocol"
    OVERSIZED = "oversized"
    BAD_TRANSFER = "bad_transfer"
    UNKNOWN_TRANSFER = "unknown_transfer"
    NO_VALID_KEY = "no_valid_key"
    REPLAYED = "replayed"
    BAD_TIMESTAMP = "bad_timestamp"


class Reject(Exception):
    """A failed check: carries the rejection out of a handler's chain of checks to the place that records it.

    Args:
        reason: the stable code (:class:`RejectReason`).
        detail: what was wrong, for a person (logged, stored, and sent in a negative ACK).
        error: the typed library error that the check caught, if any; its class name is stored as ``error_kind``
            (``"check"`` when the check itself found the fault).
    """

    def __init__(self, reason: RejectReason, detail: str, error: BaseException | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.error_kind = type(error).__name__ if error is not None else "check"


@dataclass(frozen=True)
class Rejected:
    """A refused message: ``reason`` (code), ``detail`` (human-readable), the typed error's class name, and the
    site / round when they were known."""

    reason: RejectReason
    detail: str
    error_kind: str
    site_id: str | None = None
    round: int | None = None
