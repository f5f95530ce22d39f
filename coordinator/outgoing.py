"""The open round's sealed tasks: kept on disk, sent chunked, resent when a site's download receipt asks.

The round manager (:mod:`coordinator.rounds`) seals a task per selected site, keeps it here while the round is open
and sends it; a site that lost chunks, or was offline when the round opened, answers with a download receipt
(``coordinator.inbound.transfers``), and whoever holds the receipt (the round manager, or an ingest worker of
:mod:`coordinator.inbound.workers`, which shares ``data_dir``) resends from the kept bytes. Both import this module;
neither imports the other for it.

On disk: ``<data_dir>/outgoing/<round>/<site>.head`` (magic, header, signature) names the payload file
``payload-<payload digest>.bin`` beside it, written once per content (every site whose payload is the same shares it).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope
from shared.topics import task_topic
from shared.transfer import NO_TRANSFER, Receipt, send, transfer_id_of

from coordinator.config import CoordinatorConfig
from coordinator.inbound.context import RoundContext
from coordinator.transport import Transport, pipelined_publish

__all__ = ["outgoing_task_path", "store_outgoing_task", "load_outgoing_task", "send_task_bytes",
           "answer_download_receipt"]

log = logging.getLogger(__name__)


def outgoing_task_path(config: CoordinatorConfig, r: int, site_id: str) -> Path:
    """Where round ``r``'s sealed task for ``site_id`` is kept while the round is open (for resends): the envelope's
    head (magic, header, signature) in ``<data_dir>/outgoing/<r>/<site>.head``, which names the payload file
    ``payload-<payload digest>.bin`` beside it (shared by every site whose task payload is the same)."""
    return config.data_dir / "outgoing" / str(r) / f"{site_id}.head"


def store_outgoing_task(config: CoordinatorConfig, r: int, site_id: str, env: Envelope) -> None:
    """Keep a sealed task for resends: its head per site, its payload once per content (no fsync: a lost file only
    means the site waits for the next round). Both are written to a temporary file and renamed, so a download
    receipt answered while the round's tasks are still being stored never reads half a file.

    Raises:
        OSError: a file could not be written.
    """
    head_path = outgoing_task_path(config, r, site_id)
    head_path.parent.mkdir(parents=True, exist_ok=True)
    payload_path = head_path.parent / f"payload-{env.header.payload_digest}.bin"
    if not payload_path.exists():
        tmp = payload_path.with_suffix(".tmp")
        tmp.write_bytes(env.payload)
        tmp.replace(payload_path)
    tmp = head_path.with_suffix(".head.tmp")
    tmp.write_bytes(env.head_bytes())
    tmp.replace(head_path)


def load_outgoing_task(config: CoordinatorConfig, r: int, site_id: str) -> bytes:
    """The sealed task bytes kept by :func:`store_outgoing_task`.

    Raises:
        FileNotFoundError: none kept for (r, site).
    """
    head = outgoing_task_path(config, r, site_id).read_bytes()
    digest = Envelope.from_bytes(head).header.payload_digest  # the head parses: the payload is empty there
    return head + (outgoing_task_path(config, r, site_id).parent / f"payload-{digest}.bin").read_bytes()


def send_task_bytes(config: CoordinatorConfig, transport: Transport, key: Ed25519PrivateKey, site_id: str,
                    data: bytes | Envelope, *, missing: tuple[int, ...] | None = None) -> int:
    """Publish a sealed task (an envelope sealed here, or its wire bytes) on the site's task topic, chunked past
    ``transfer.chunk_size_bytes`` (``shared.transfer.send``); returns the number of messages."""
    topic = task_topic(config.federation_id, site_id)
    with pipelined_publish(transport) as publish:  # MqttTransport: the chunks' PUBACKs awaited together
        return send(publish, topic, data, private_key=key, chunk_size=config.transfer.chunk_size_bytes,
                    missing=missing)


def answer_download_receipt(config: CoordinatorConfig, transport: Transport, key: Ed25519PrivateKey,
                            ctx: RoundContext | None, site_id: str, round: int, receipt: Receipt) -> None:
    """Answer a site's download receipt (``coordinator.inbound.transfers``): resend the missing chunks of its task for
    the open round ``ctx``, or the whole task when the site holds nothing yet (``shared.transfer.NO_TRANSFER``: it was
    offline when the round opened). Receipts with no open round, from a site not selected, or from a site whose
    update is already in, are ignored (logged). Ingest workers answer them too: the task files are in the shared
    ``data_dir``."""
    if ctx is None or site_id not in ctx.selected or site_id in ctx.accepted:
        log.debug("outgoing: receipt from %s for round %d ignored (no open round for it)", site_id, round)
        return
    try:
        data = load_outgoing_task(config, ctx.round, site_id)
    except FileNotFoundError:
        # the round is open but its tasks are still being sealed and published: the task is on its way
        log.info("outgoing: %s asked for round %d's task while it is still being sent; it arrives as sent",
                 site_id, ctx.round)
        return
    if receipt.transfer_id == NO_TRANSFER:
        sent = send_task_bytes(config, transport, key, site_id, data)
    elif receipt.transfer_id == transfer_id_of(data):
        sent = send_task_bytes(config, transport, key, site_id, data, missing=receipt.missing)
    else:
        log.info("outgoing: receipt from %s names transfer %s, not its round-%d task", site_id, receipt.transfer_id[:12],
                 ctx.round)
        return
    log.info("outgoing: resent round %d task to %s (%d messages)", ctx.round, site_id, sent)
