"""Which task to train when several wait: the newest.

A gateway that was busy (training, or offline while tasks were retained for it) can find several tasks in its inbox.
Training an older one spends budget on an update that can no longer count fully: in synchronous rounds its round
has closed (the coordinator opens a round only after closing the one before), so the update would be charged and
not aggregated; in buffered rounds it would be staler than the newest. So before training round r the agent looks
at what waits (:func:`newer_task_waiting`) and skips r when a verified task, or the signed manifest of a chunked
one, of a newer round addressed to this site is waiting; and a buffered round's task (``max_staleness`` set) is
not trained when the gateway has seen a task more than ``max_staleness`` rounds newer (:func:`too_stale`).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.envelope import Envelope, MessageKind, verify
from shared.errors import EnvelopeError
from shared.protocol import TrainingTask

from edge_sdk.rounds.context import AgentContext

__all__ = ["newer_task_waiting", "too_stale"]


def newer_task_waiting(ctx: AgentContext, waiting: Iterable[tuple[str, bytes]], round_: int) -> int | None:
    """The newest round above ``round_`` of a task waiting in the agent's inbox, or None.

    Args:
        ctx: the agent's context (the coordinator's key, the site). waiting: the inbox's ``(kind, payload)``
            items, in order. round_: the round about to be trained.

    Only a TASK or a MANIFEST on the task topic that verifies with the coordinator's key and is addressed to this
    site in its federation counts (anything else is left for its handler to refuse).
    """
    newest = None
    for kind, payload in waiting:
        if kind != "task":
            continue
        try:
            envelope = Envelope.from_bytes(payload)
            header = envelope.header
            if header.kind not in (MessageKind.TASK, MessageKind.MANIFEST) or header.round <= round_:
                continue
            verify(envelope, ctx.coordinator_key)
        except EnvelopeError:
            continue
        if header.federation_id == ctx.config.federation_id and header.site_id == ctx.site_id:
            newest = header.round if newest is None else max(newest, header.round)
    return newest


def too_stale(task: TrainingTask, newest_seen: int) -> bool:
    """Whether a buffered round's ``task`` is more than its ``max_staleness`` behind the newest round the gateway has
    seen a task of (False for a synchronous round's task)."""
    return task.max_staleness is not None and newest_seen - task.round > task.max_staleness
