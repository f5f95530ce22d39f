"""The Mosquitto ACL of a federation: which account may write and read which topics.

Every rule is keyed by username (``user`` blocks), never by client id (``%c``), which the client chooses; the
accounts (sites, the coordinator and their role accounts) are described in :mod:`coordinator.broker_config`.

ACL semantics (Mosquitto 2.0 ``acl_file``, read from its source, src/security_default.c): a client is checked when
it *publishes* (``write``) and when a message is *delivered* to it (``read``), each time against the message's
actual topic; subscription filters themselves are not checked (subscribing to ``#`` succeeds, but nothing the ACL
does not allow is delivered). A denied publish is acknowledged and dropped silently. A shared subscription
``$share/<group>/wildfed/v1/<fed>/site/+/update`` therefore needs no ``$share`` ACL entry: each delivery is checked
against the underlying topic ``wildfed/v1/<fed>/site/<id>/update``, which the coordinator may read. The last will
is checked as a ``write`` of the will topic when the client connects.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.broker import SITE_ROLES, coordinator_username, role_username, site_username, validate_role
from shared.errors import ConfigError
from shared.topics import PREFIX

__all__ = ["render_acl", "ingest_worker_roles", "SITE_WRITE_CHANNELS", "SITE_READ_CHANNELS", "WORKER_READ_CHANNELS",
           "WORKER_WRITE_CHANNELS", "DETECT_WRITE_CHANNELS"]

#: Channels a site publishes on (its own topics only).
SITE_WRITE_CHANNELS = ("update", "detection", "secagg", "status", "health")
#: Channels a site reads (its own topics only): ``model/#`` are the chunk topics of a released model
#: (shared.topics.model_chunk_topic), ``software/#`` those of a published SDK version; the parents are listed too, so
#: the rule does not rest on ``#`` matching its parent.
SITE_READ_CHANNELS = ("task", "ack", "model", "model/#", "software", "software/#")
#: Channels an ingest worker reads (every site's).
WORKER_READ_CHANNELS = ("update",)
#: Channels an ingest worker writes (every site's): ACKs and receipts, and the task chunks it resends.
WORKER_WRITE_CHANNELS = ("task", "ack")
#: Channels a site's detection publisher (role ``detect``) writes (its own site's only).
DETECT_WRITE_CHANNELS = ("detection",)


def ingest_worker_roles(ingest_workers: int) -> tuple[str, ...]:
    """The role names of the coordinator's ingest workers: ``ingest-1`` .. ``ingest-<ingest_workers>`` (each
    worker runs with ``--worker-id`` set to its role and connects with that role's account)."""
    return tuple(f"ingest-{i}" for i in range(1, int(ingest_workers) + 1))


def render_acl(federation_id: str, site_ids: Sequence[str], *, coordinator_roles: Sequence[str] = (),
               site_roles: Sequence[str] = ()) -> str:
    """The Mosquitto ACL file of a federation.

    Each site user ``site-<id>`` may write ``wildfed/v1/<fed>/site/<id>/{update,detection,secagg,status,health}``
    and read ``.../site/<id>/{task,ack,model,model/#,software,software/#}`` and the federation's models by digest,
    ``wildfed/v1/<fed>/models/#`` (the same models for every site, shared.topics.digest_topic); the coordinator user
    may read every site's update, detection, secagg, status and health topics and write every site's task, ack, model
    and software topics and ``wildfed/v1/<fed>/models/#``. Role accounts (:mod:`coordinator.broker_config`): an ingest worker (``coordinator_roles``) reads every
    site's update topic and writes every task and ack topic; a site's ``detect`` role (in ``site_roles``) writes
    only that site's detection topic. Every rule is keyed by username (``user`` blocks), never by the
    client-chosen client id. Nothing else (no anonymous section, no patterns, no ``$SYS``). Sites and roles are listed sorted, so the text depends only on the sets.

    Raises:
        ConfigError: a bad role name, or a site role other than ``detect``.
    """
    base = f"{PREFIX}/{federation_id}/site"
    models = f"{PREFIX}/{federation_id}/models/#"  # shared.topics.models_filter: the models published by digest
    coord = coordinator_username(federation_id)
    lines = [f"# Mosquitto ACL of WildFed federation {federation_id}, written by `wildfed-coordinator broker-config`.",
             "# Mosquitto checks 'write' when a client publishes and 'read' when a message is delivered to it, against",
             "# the message's topic (also for $share/... subscriptions). Regenerate rather than edit.",
             "",
             f"user {coord}"]
    lines += [f"topic read {base}/+/{channel}" for channel in SITE_WRITE_CHANNELS]
    lines += [f"topic write {base}/+/{channel}" for channel in SITE_READ_CHANNELS]
    lines.append(f"topic write {models}")
    for role in sorted(coordinator_roles):
        lines += ["", f"user {role_username(coord, role)}"]
        lines += [f"topic read {base}/+/{channel}" for channel in WORKER_READ_CHANNELS]
        lines += [f"topic write {base}/+/{channel}" for channel in WORKER_WRITE_CHANNELS]
    for role in site_roles:
        if validate_role(role) not in SITE_ROLES:
            raise ConfigError(f"site role {role!r} is not one of {list(SITE_ROLES)}", field="site_roles",
                              fix=f"use {', '.join(SITE_ROLES)}")
    for site_id in sorted(site_ids):
        lines += ["", f"user {site_username(site_id)}"]
        lines += [f"topic write {base}/{site_id}/{channel}" for channel in SITE_WRITE_CHANNELS]
        lines += [f"topic read {base}/{site_id}/{channel}" for channel in SITE_READ_CHANNELS]
        lines.append(f"topic read {models}")
        for role in sorted(site_roles):
            lines += ["", f"user {role_username(site_username(site_id), role)}"]
            lines += [f"topic write {base}/{site_id}/{channel}" for channel in DETECT_WRITE_CHANNELS]
    return "\n".join(lines) + "\n"
