"""Updates out, acknowledgements in: the gateway's side of the store-and-forward upload.

An update is encoded, sealed with the site key and written to the outbox **before** it is published (QoS 1);
a verified ACK that names its sequence removes it; every (re)connect and every ``resend_interval_s`` (with +-50 %
jitter, so gateways cut off together do not all resend at once; AWS Architecture Blog, "Exponential Backoff And
Jitter", 2015) resends what is pending: a small update whole, a chunked one as a resume manifest, after which only
the chunks the coordinator's receipt lists as missing follow (:mod:`shared.transfer`).

Chunks that never arrive: a chunk of an upload that ``max_chunk_requests`` receipts list although it was sent before
the probe each answers (``shared.transfer.ResendTracker``) is being dropped on the way, typically by a broker whose
message limit is below the chunk size. The upload is then given up with an error naming ``chunk_size_bytes``
instead of being retried forever: it leaves the outbox and the reason stays in the agent state as
``abandoned/<message id>``.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable

import numpy as np

from shared.broker import MQTT_PUBLISH_OVERHEAD
from shared.envelope import Envelope, MessageKind, seal
from shared.errors import MalformedEnvelopeError, PayloadError
from shared.protocol import TrainingTask, UpdateReport, decode_ack, encode_update
from shared.topics import update_topic
from shared.transfer import (ResendTracker, TransferError, decode_receipt, is_chunk, piece_size_for, send,
                             transfer_id_of)

from edge_sdk.rounds.context import AgentContext
from edge_sdk.uplink.transport import MessageRefusedError, TransportError

__all__ = ["Uploader", "update_message_id"]

log = logging.getLogger(__name__)

_CRASH_ENV = "WILDFED_TEST_CRASH_AT"


def _test_crash_point(name: str) -> None:
    """TEST ONLY: SIGKILL this process here when ``$WILDFED_TEST_CRASH_AT == name``. The one point is
    ``mid_upload``: after the manifest and two chunks of a chunked upload went out (tests/test_faults.py). Never set
    it in production."""
    if os.environ.get(_CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _transfer_id(message: bytes) -> str:
    """The transfer id a pending outbox message travels under when chunked (``shared.transfer.transfer_id_of``: a
    hash of its header and signature, not of its payload), or ``""`` for bytes that are not an envelope."""
    try:
        return transfer_id_of(message)
    except MalformedEnvelopeError:
        return ""


def update_message_id(round_: int) -> str:
    """Outbox id of this site's update for ``round_``."""
    return f"update/{round_}"


class Uploader:
    """The outbox's traffic (module docstring).

    Args:
        ctx: the agent's shared state.
        on_drained: called when the outbox becomes empty (the agent then asks for the open round's task).
    """

    def __init__(self, ctx: AgentContext, *, on_drained: Callable[[], None]) -> None:
        self.ctx = ctx
        self._on_drained = on_drained
        self.topic = update_topic(ctx.config.federation_id, ctx.site_id)
        self._requests = ResendTracker(ctx.config.max_chunk_requests)  # receipts listing chunks sent before
        self.next_resend = time.monotonic() + self._resend_delay()

    def _resend_delay(self) -> float:
        return self.ctx.config.resend_interval_s * random.uniform(0.5, 1.5)

    def due(self) -> bool:
        """Whether the periodic resend is due (then the next one is scheduled)."""
        if time.monotonic() < self.next_resend:
            return False
        self.next_resend = time.monotonic() + self._resend_delay()
        return True

    def send_update(self, task: TrainingTask, report: UpdateReport, delta: dict[str, np.ndarray], *,
                    started: float, detail: str) -> bool:
        """Encode, sign, store in the outbox (durable before publishing), publish; False if it cannot be encoded."""
        ctx = self.ctx
        try:
            payload = encode_update(report, delta)
        except PayloadError as exc:  # e.g. training diverged to non-finite weights
            ctx.reject("task", "bad_update", f"the trained update cannot be encoded: {exc}")
            return False
        update = seal(private_key=ctx.signing_key, federation_id=ctx.config.federation_id, site_id=ctx.site_id,
                      round=task.round, base_model_hash=task.model_hash, kind=MessageKind.UPDATE,
                      sequence=ctx.next_sequence(), payload=payload,
                      piece_size=piece_size_for(ctx.config.chunk_size_bytes))  # its chunks are its pieces
        message_id = update_message_id(task.round)
        ctx.outbox.put(message_id, self.topic, update.to_bytes())  # durable before publishing
        ctx.stats["tasks_trained"] += 1
        log.info("site %s: round %d update sent %.1f s after its task (%s); kept in the outbox until acknowledged",
                 ctx.site_id, task.round, time.monotonic() - started, detail)
        self.publish(message_id, self.topic, update)  # the envelope: its leaves are not hashed again
        return True

    def _drained(self) -> None:
        if not self.ctx.outbox.count():
            self._on_drained()

    def abandon(self, message_id: str, detail: str) -> None:
        """Give up an outbox message that cannot get through (``detail`` names the setting to change): drop it,
        keep the reason in the agent state (``abandoned/<id>``), count it, log it as an error."""
        outbox = self.ctx.outbox
        entry = outbox.get_state(f"abandoned/{message_id}")
        outbox.set_state(f"abandoned/{message_id}", detail if entry is None else f"{entry}; {detail}")
        removed = outbox.remove(message_id)
        self.ctx.stats["uploads_abandoned"] += 1
        log.error("site %s: %s given up: %s", self.ctx.site_id, message_id, detail)
        if removed:
            self._drained()

    def publish(self, message_id: str, topic: str, payload: bytes | Envelope, *, resume: bool = False,
                missing: tuple[int, ...] | None = None) -> bool:
        """Publish an outbox message (its bytes, or the envelope just sealed): whole, or as a manifest and chunks
        when it is larger than ``config.chunk_size_bytes``; ``resume`` sends only the manifest (the coordinator
        answers with a receipt), ``missing`` only those chunks (``shared.transfer.send``)."""
        ctx, config = self.ctx, self.ctx.config
        published = [0]

        def publish(t: str, p: bytes) -> None:
            ctx.transport.publish(t, p, qos=1)
            published[0] += 1
            if published[0] == 3 and is_chunk(p):
                _test_crash_point("mid_upload")

        try:
            send(publish, topic, payload, private_key=ctx.signing_key, chunk_size=config.chunk_size_bytes,
                 resume=resume, missing=missing,
                 max_message_bytes=config.broker_max_packet_bytes - MQTT_PUBLISH_OVERHEAD,
                 on_chunk=lambda tid, index: self._requests.sent(tid, (index,)), on_probe=self._requests.probed)
        except TransferError as exc:  # a message the broker would drop (e.g. a manifest of too many chunks)
            self.abandon(message_id, f"{exc} (broker_max_packet_bytes {config.broker_max_packet_bytes})")
            return False
        except MessageRefusedError as exc:  # the broker keeps dropping the link on it (edge_sdk.uplink.mqtt)
            self.abandon(message_id, str(exc))
            return False
        except TransportError as exc:
            ctx.stats["publish_failed"] += 1
            log.warning("site %s: publish of %s failed (%s); it stays in the outbox", ctx.site_id, message_id, exc)
            return False
        ctx.stats["updates_published"] += 1
        self.next_resend = time.monotonic() + self._resend_delay()  # the interval counts from the last send
        log.info("site %s: published %s (%d bytes)", ctx.site_id, message_id,
                 payload.wire_length if isinstance(payload, Envelope) else len(payload))
        return True

    def handle_ack(self, data: bytes) -> bool:
        """Verify an ACK envelope and drop the acknowledged update from the outbox; returns True if one was."""
        ctx = self.ctx
        envelope = ctx.open(data, MessageKind.ACK, "ack")
        if envelope is None:
            return False
        try:
            ack = decode_ack(envelope.payload)
        except PayloadError as exc:
            ctx.reject("ack", exc.reason, str(exc))
            return False
        if ack.round != envelope.header.round:
            ctx.reject("ack", "header_mismatch", f"ack round {ack.round} != header round {envelope.header.round}")
            return False
        pending = ctx.outbox.get(update_message_id(ack.round))
        if pending is not None and Envelope.from_bytes(pending.payload).header.sequence != envelope.header.sequence:
            ctx.reject("ack", "stale_ack", f"ack for sequence {envelope.header.sequence}, the pending update of round "
                       f"{ack.round} has another sequence")
            return False
        removed = ctx.outbox.remove(update_message_id(ack.round))
        if pending is not None:
            self._requests.forget(_transfer_id(pending.payload))
        if ack.accepted:
            ctx.stats["acks_accepted"] += 1
            log.info("site %s: round %d update acknowledged%s", ctx.site_id, ack.round,
                     "" if removed else " (was not pending)")
        else:
            ctx.stats["acks_refused"] += 1
            log.error("site %s: round %d update refused by the coordinator: %s", ctx.site_id, ack.round,
                      ack.reason or "no reason given")
        if removed:
            self._drained()
        return removed

    def handle_receipt(self, data: bytes) -> bool:
        """Verify the coordinator's RECEIPT for a chunked upload and send the chunks it lists as missing; returns
        True if chunks were sent."""
        ctx, config = self.ctx, self.ctx.config
        envelope = ctx.open(data, MessageKind.RECEIPT, "receipt")
        if envelope is None:
            return False
        try:
            receipt = decode_receipt(envelope.payload)
        except TransferError as exc:
            ctx.reject("receipt", exc.reason, str(exc))
            return False
        for entry in ctx.outbox.pending():
            message = ctx.outbox.get(entry.message_id)
            if message is None or _transfer_id(message.payload) != receipt.transfer_id:
                continue
            stuck = self._requests.answered(receipt.transfer_id, receipt.missing)
            if stuck is not None:
                index, times = stuck
                self._requests.forget(receipt.transfer_id)
                self.abandon(entry.message_id, (
                    f"chunk {index} ({config.chunk_size_bytes} bytes + 40 of header) was sent {times} times "
                    f"and the coordinator asked for it again each time: the broker drops it, most likely because "
                    f"chunk_size_bytes ({config.chunk_size_bytes}) is above the broker's message size limit "
                    f"(fix: lower chunk_size_bytes and set broker_max_packet_bytes to the broker's limit, now "
                    f"{config.broker_max_packet_bytes})"))
                return False
            log.info("site %s: resuming %s: %d chunk(s) missing", ctx.site_id, message.message_id,
                     len(receipt.missing))
            ctx.stats["uploads_resumed"] += 1
            return self.publish(message.message_id, message.topic, message.payload, missing=receipt.missing)
        ctx.reject("receipt", "unknown_transfer", f"no pending upload {receipt.transfer_id[:12]}")
        return False

    def resend_pending(self) -> int:
        """Publish every pending outbox message again (after a (re)connect, and every ``resend_interval_s``):
        a small one whole, a chunked one as a resume manifest (only the missing chunks follow, on the coordinator's
        receipt). Returns how many went out."""
        ctx = self.ctx
        sent = 0
        for entry in ctx.outbox.pending():
            message = ctx.outbox.get(entry.message_id)
            if message is None:  # acknowledged meanwhile
                continue
            log.info("site %s: resending %s", ctx.site_id, message.message_id)
            sent += int(self.publish(message.message_id, message.topic, message.payload,
                                     resume=entry.size > ctx.config.chunk_size_bytes))
        return sent
