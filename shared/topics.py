"""The MQTT topic layout (documented in docs/protocol.md).

::

    wildfed/v1/{federation_id}/site/{site_id}/task        coordinator -> site   signed TASK
    wildfed/v1/{federation_id}/site/{site_id}/update      site -> coordinator   signed UPDATE
    wildfed/v1/{federation_id}/site/{site_id}/ack         coordinator -> site   signed ACK
    wildfed/v1/{federation_id}/site/{site_id}/detection   site -> coordinator   signed DETECTION
    wildfed/v1/{federation_id}/site/{site_id}/secagg      site -> coordinator   signed SECAGG (Global DP mode)
    wildfed/v1/{federation_id}/site/{site_id}/status      site (or the broker) -> coordinator   UNSIGNED presence
    wildfed/v1/{federation_id}/site/{site_id}/health      site -> coordinator   signed HEALTH
    wildfed/v1/{federation_id}/site/{site_id}/model       coordinator -> site   signed MODEL (or its MANIFEST), retained
    wildfed/v1/{federation_id}/site/{site_id}/model/{i}   coordinator -> site   chunk i of a chunked MODEL, retained
    wildfed/v1/{federation_id}/site/{site_id}/software    coordinator -> site   signed SOFTWARE (or its MANIFEST), retained
    wildfed/v1/{federation_id}/site/{site_id}/software/{i} coordinator -> site  chunk i of a chunked SOFTWARE, retained
    wildfed/v1/{federation_id}/models/{digest}            coordinator -> every site   signed MODEL (or its MANIFEST),
                                                          retained: a round's model, published once (by digest)
    wildfed/v1/{federation_id}/models/{digest}/{i}        coordinator -> every site   chunk i of it, retained

The coordinator's SECAGG messages to a site (key list, share inbox, recovery request, round end) ride on the
site's ``task`` topic: a gateway reads only that topic and ``ack``.

One topic per site and direction keeps broker ACLs simple (a site may publish only under its own ``site/{id}/``
and read only its own task/ack topics) and lets the coordinator subscribe to ``site/+/update`` with one filter,
or as a shared subscription (``$share/coordinators/...``) when several coordinator workers ingest.

``model`` holds the global model the site should predict with (:mod:`shared.releases`), published **retained** by
the coordinator after every round that makes a new model, so that a gateway that connects later still gets it. A
model larger than the coordinator's chunk size travels as a signed manifest on ``model`` and its chunks on
``model/0``, ``model/1``, ... (one topic per chunk, since a broker retains one message per topic); a gateway
subscribes to ``model/#`` (:func:`model_filter`), which matches ``model`` itself and every chunk topic.
``software`` holds, the same way, the SDK version the operator published for the gateways (:mod:`shared.software`).

``models/{digest}`` holds a model a round's tasks train from, published **once** for every site (``digest`` is the
model hash, ``shared.codec.model_hash``): a task sent by digest (``TrainingTask.model_digest``) carries no weights,
and a gateway that does not hold that model subscribes to :func:`digest_filter` until it has it. Its envelope is
addressed to the reserved site id ``shared.envelope.BROADCAST_SITE_ID`` (docs/protocol.md, "Models by digest").

``health`` carries a gateway's signed health record (:mod:`shared.health`): on start, after every reconnect, when
it keeps a new model, and every ``health_interval_s``.

``status`` carries a small UTF-8 JSON presence message, ``{"site_id": ..., "state": "online" | "offline"}``
(:func:`status_payload`), published *retained*: the gateway publishes ``online`` after every (re)connect, and the
broker publishes the gateway's MQTT last will (``offline``) when the link drops without a DISCONNECT. The will
is sent by the broker, so it cannot carry the site's signature: status messages are **advisory only** (monitoring,
dashboards); the coordinator never bases a protocol or privacy decision on them. The broker ACL lets only the site
itself write its status topic (docs/security.md), which is all the authenticity they have.
"""

from __future__ import annotations

import json
import re

from shared.envelope import validate_identifier
from shared.errors import MalformedEnvelopeError

__all__ = ["PREFIX", "CHANNELS", "task_topic", "update_topic", "ack_topic", "detection_topic",
           "secagg_topic", "status_topic", "health_topic", "model_topic", "model_chunk_topic", "model_filter",
           "software_topic", "software_chunk_topic", "software_filter", "digest_topic", "digest_chunk_topic",
           "digest_filter", "models_filter",
           "updates_filter", "detections_filter", "secagg_filter", "status_filter", "health_filter",
           "status_payload", "parse_status_payload", "STATUS_STATES", "parse_topic"]

PREFIX = "wildfed/v1"
CHANNELS = ("task", "update", "ack", "detection", "secagg", "status", "health", "model", "software")
#: The states a presence message (:func:`status_payload`) may carry.
STATUS_STATES = ("online", "offline")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _topic(federation_id: str, site_id: str, channel: str) -> str:
    validate_identifier(federation_id, "federation_id")
    validate_identifier(site_id, "site_id")
    return f"{PREFIX}/{federation_id}/site/{site_id}/{channel}"


def _chunk_topic(topic: str, index: int) -> str:
    """``<topic>/<index>``: the topic of chunk ``index`` of a retained, chunked envelope on ``topic``."""
    if type(index) is not int or index < 0:
        raise MalformedEnvelopeError(f"chunk index {index!r} must be a non-negative integer")
    return f"{topic}/{index}"


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


def status_topic(federation_id: str, site_id: str) -> str:
    """Topic of ``site_id``'s retained, unsigned presence messages (online / last-will offline); advisory only."""
    return _topic(federation_id, site_id, "status")


def health_topic(federation_id: str, site_id: str) -> str:
    """Topic on which ``site_id`` publishes its signed health records (``shared.health``)."""
    return _topic(federation_id, site_id, "health")


def model_topic(federation_id: str, site_id: str) -> str:
    """Topic of ``site_id``'s released global model (retained): the MODEL envelope, or the manifest of a chunked one."""
    return _topic(federation_id, site_id, "model")


def model_chunk_topic(federation_id: str, site_id: str, index: int) -> str:
    """Topic of chunk ``index`` (>= 0) of a chunked MODEL for ``site_id`` (retained): ``.../model/<index>``.

    Raises:
        MalformedEnvelopeError: a negative or non-integer ``index``.
    """
    return _chunk_topic(model_topic(federation_id, site_id), index)


def model_filter(federation_id: str, site_id: str) -> str:
    """Subscription filter of ``site_id``'s model topic and its chunk topics (``.../model/#``; MQTT 3.1.1 sec.
    4.7.1.2: ``#`` also matches the parent level, the manifest's topic)."""
    return f"{model_topic(federation_id, site_id)}/#"


def software_topic(federation_id: str, site_id: str) -> str:
    """Topic of ``site_id``'s published SDK version (retained): the SOFTWARE envelope (``shared.software``), or the
    manifest of a chunked one."""
    return _topic(federation_id, site_id, "software")


def software_chunk_topic(federation_id: str, site_id: str, index: int) -> str:
    """Topic of chunk ``index`` (>= 0) of a chunked SOFTWARE release for ``site_id`` (retained).

    Raises:
        MalformedEnvelopeError: a negative or non-integer ``index``.
    """
    return _chunk_topic(software_topic(federation_id, site_id), index)


def software_filter(federation_id: str, site_id: str) -> str:
    """Subscription filter of ``site_id``'s software topic and its chunk topics (``.../software/#``)."""
    return f"{software_topic(federation_id, site_id)}/#"


def digest_topic(federation_id: str, digest: str) -> str:
    """Topic of the model whose hash is ``digest`` (64 lowercase hex; retained): ``wildfed/v1/<fed>/models/<digest>``,
    the MODEL envelope or the manifest of a chunked one.

    Raises:
        MalformedEnvelopeError: a bad federation id or a digest that is not 64 lowercase hex characters.
    """
    validate_identifier(federation_id, "federation_id")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise MalformedEnvelopeError(f"model digest {digest!r} must be 64 lowercase hex characters (a model hash)")
    return f"{PREFIX}/{federation_id}/models/{digest}"


def digest_chunk_topic(federation_id: str, digest: str, index: int) -> str:
    """Topic of chunk ``index`` (>= 0) of the chunked model ``digest`` (retained): ``.../models/<digest>/<index>``.

    Raises:
        MalformedEnvelopeError: a bad digest, or a negative or non-integer ``index``.
    """
    if type(index) is not int or index < 0:
        raise MalformedEnvelopeError(f"chunk index {index!r} must be a non-negative integer")
    return f"{digest_topic(federation_id, digest)}/{index}"


def digest_filter(federation_id: str, digest: str) -> str:
    """Subscription filter of model ``digest``'s topic and its chunk topics (``.../models/<digest>/#``)."""
    return f"{digest_topic(federation_id, digest)}/#"


def models_filter(federation_id: str) -> str:
    """Filter of every model-by-digest topic of the federation (``wildfed/v1/<fed>/models/#``; the broker ACL's)."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/models/#"


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


def status_filter(federation_id: str) -> str:
    """Subscription filter matching every site's status (presence) topic."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/site/+/status"


def health_filter(federation_id: str) -> str:
    """Subscription filter matching every site's health topic."""
    validate_identifier(federation_id, "federation_id")
    return f"{PREFIX}/{federation_id}/site/+/health"


def status_payload(site_id: str, state: str) -> bytes:
    """The presence message ``{"site_id": site_id, "state": state}`` as compact UTF-8 JSON (sorted keys).

    Unsigned on purpose: the ``offline`` one is the MQTT last will, which the broker publishes for the site.

    Raises:
        MalformedEnvelopeError: ``site_id`` is not topic-safe or ``state`` is not in :data:`STATUS_STATES`.
    """
    validate_identifier(site_id, "site_id")
    if state not in STATUS_STATES:
        raise MalformedEnvelopeError(f"status state {state!r} is not one of {STATUS_STATES}")
    return json.dumps({"site_id": site_id, "state": state}, sort_keys=True, separators=(",", ":")).encode("utf-8")


def parse_status_payload(payload: bytes) -> tuple[str, str]:
    """``(site_id, state)`` of a presence message (advisory: never trust it for anything that matters).

    Raises:
        MalformedEnvelopeError: not UTF-8 JSON of that shape.
    """
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedEnvelopeError(f"status payload is not UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("state") not in STATUS_STATES or not isinstance(obj.get("site_id"), str):
        raise MalformedEnvelopeError(f"status payload {obj!r} is not {{'site_id': str, 'state': online|offline}}")
    validate_identifier(obj["site_id"], "site_id")
    return obj["site_id"], obj["state"]


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
