"""The MQTT topic layout (documented in docs/protocol.md).

::

    wildfed/v1/{federation_id}/site/{site_id}/task        coordinator -> site   signed TASK
    wildfed/v1/{federation_id}/site/{site_id}/update      site -> coordinator   signed UPDATE
    wildfed/v1/{federation_id}/site/{site_id}/ack         coordinator -> site   signed ACK
    wildfed/v1/{federation_id}/site/{site_id}/detection   site -> coordinator   signed DETECTION
    wildfed/v1/{federation_id}/site/{site_id}/secagg      site -> coordinator   signed SECAGG (Global DP mode)

The coordinator's SECAGG messages to a site (key list, share inbox, recovery request, round end) ride on the
site's ``task`` topic: a gateway reads only that topic and ``ack``.

One topic per site and direction keeps broker ACLs simple (a site may publish only under its own ``site/{id}/``
and read only its own task/ack topics) and lets the coordinator subscribe to ``site/+/update`` with one filter,
or as a shared subscription (``$share/coordinators/...``) when several coordinator workers ingest.
"""

from __future__ import annotations

from shared.envelope import validate_identifier
from shared.errors import MalformedEnvelopeError

__all__ = ["PREFIX", "CHANNELS", "task_topic", "update_topic", "ack_topic", "detection_topic",
           "secagg_topic", "updates_filter", "detections_filter", "secagg_filter", "parse_topic"]

PREFIX = "wildfed/v1"
CHANNELS = ("task", "update", "ack", "detection", "secagg")


def _topic(federation_id: str, site_id: str, channel: str) -> str:
    validate_identifier(federation_id, "federation_id")
    validate_identifier(site_id, "site_id")
    return f"{PREFIX}/{federation_id}/site/{site_id}/{channel}"


def task_topic(federation_id: str, site_id: str) -> str:
    """Topic on which the coordinator publishes tasks for ``site_id``."""
    return _topic(federation_id, site_id, "task")


def update_topic(federation_id: str, site_id: str) -> str:
    """Topic on which ``site_id`` publishes its updates."""
    return _topic(federation_id, site_id, "update")


def ack_topic(federation_id: str, site_id: str) -> str:
    """Topic on which the coordinator acknowledges ``site_id``'s updates."""
    return _topic(federation_id, site_id, "ack")


def detection_topic(federation_id: str, site_id: str) -> str:
    """Topic on which ``site_id`` publishes detection records."""
    return _topic(federation_id, site_id, "detection")


def secagg_topic(federation_id: str, site_id: str) -> str:
    """Topic on which ``site_id`` publishes its secure-aggregation messages (Global DP mode)."""
    return _topic(federation_id, site_id, "secagg")


def updates_filter(federation_id: str) -> str:
    """Subscription filter matching every site's update topic."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/site/+/update"


def detections_filter(federation_id: str) -> str:
    """Subscription filter matching every site's detection topic."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/site/+/detection"


def secagg_filter(federation_id: str) -> str:
    """Subscription filter matching every site's secure-aggregation topic."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/site/+/secagg"


def parse_topic(topic: str) -> tuple[str, str, str]:
    """Split a WildFed topic into ``(federation_id, site_id, channel)``.

    Raises:
        MalformedEnvelopeError: the topic is not in the layout above.
    """
    parts = topic.split("/")
    if len(parts) != 6 or "/".join(parts[:2]) != PREFIX or parts[3] != "site" or parts[5] not in CHANNELS:
        raise MalformedEnvelopeError(f"topic {topic!r} is not a WildFed topic")
    validate_identifier(parts[2], "federation_id")
    validate_identifier(parts[4], "site_id")
    return parts[2], parts[4], parts[5]
