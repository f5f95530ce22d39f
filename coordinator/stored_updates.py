"""Folding a round's durably stored updates into its running aggregate.

An accepted update is stored as a blob (its payload: ``shared.protocol.encode_update``) before it counts. Whenever
the round manager must count updates from the store rather than from ingest, it decodes each blob and hands the
delta to the round's strategy, with the update's report numbers, through :func:`fold_stored_updates`:

- closing a round, for an update another process stored (:func:`coordinator.round_close.absorb_stored`);
- closing a round without the updates that a close-time budget check refused (the running sum is rebuilt from the
  others, :func:`coordinator.round_close.drop_refused`);
- recovering a round a previous process left open (:meth:`coordinator.rounds.RoundManager.recover`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from shared.protocol import UpdateReport, decode_update

from coordinator.inbound.context import Accepted, RoundContext
from coordinator.storage import Store
from coordinator.tables import UpdateRow

__all__ = ["StoredUpdate", "fold_stored_updates", "accepted_from_stored"]


class StoredUpdate(Protocol):
    """What names a stored update: the site that sent it and its blob (an ``UpdateRow`` or an ``Accepted``)."""

    site_id: str
    payload_sha256: str


U = TypeVar("U", bound=StoredUpdate)


def fold_stored_updates(store: Store, ctx: RoundContext, updates: Iterable[U]) -> list[tuple[U, UpdateReport]]:
    """Decode each update's stored blob and accumulate its delta into ``ctx.strategy``, in the order given, weighted
    by the report's ``num_examples`` (its species counts and DP noise variance, :meth:`RoundContext.noise_variance`,
    passed along).

    Returns:
        ``[(update, its decoded report)]`` in the same order.

    Raises:
        FileNotFoundError: a blob is missing (``Store.get_blob``). PayloadError: a blob does not decode.
    """
    folded = []
    for upd in updates:
        report, delta = decode_update(store.get_blob(upd.payload_sha256))
        ctx.strategy.accumulate(upd.site_id, delta, num_examples=int(report.num_examples),
                                species_counts=report.species_counts or None,
                                noise_variance=ctx.noise_variance(report))
        folded.append((upd, report))
    return folded


def accepted_from_stored(round: int, upd: UpdateRow, report: UpdateReport) -> Accepted:
    """The :class:`coordinator.inbound.context.Accepted` of a stored update row of ``round`` and its decoded report (FedAvg
    weight = the report's ``num_examples``)."""
    return Accepted(site_id=upd.site_id, round=round, sequence=upd.sequence, num_examples=upd.num_examples,
                    weight=float(report.num_examples), payload_sha256=upd.payload_sha256, events=report.events,
                    count_events=dict(report.count_events), species_counts=dict(report.species_counts))
