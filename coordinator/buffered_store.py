"""The stored buffer of buffered rounds (``buffered:`` in the coordinator config, docs/transport.md "Buffered
rounds"): the stale updates that wait for the next round's close, and the claim that gives each to exactly one round.

A stale update (trained for a round that has closed) is stored as any update, under the round it was trained for
(``updates``: (round, site) stays unique, so a re-delivery is a duplicate), plus a ``buffered_updates`` row with a
null ``buffer_round``: it waits. When round r closes, :func:`claim_waiting` sets ``buffer_round = r`` on every
waiting row in one statement and returns the rows claimed for r; a crash after the claim and before the round's
model is stored leaves them claimed for r, and the recovery's close of r claims again and finds the same rows
(the claim is idempotent for r). An update stored after the claim waits for round r + 1. So each stale update is
folded into exactly one aggregate, whatever crashes, and a re-delivery is never stored twice.

The ledger is charged when a stale update is accepted, before it is stored (:mod:`coordinator.inbound.stale`): the
spend is durable before the update is ACKed and before any aggregate that contains it is released.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from coordinator.storage import Store, UpdateOutcome
from coordinator.tables import BufferedUpdateRow, UpdateRow

__all__ = ["store_waiting", "claim_waiting", "count_waiting", "buffer_counts"]


def store_waiting(store: Store, row: UpdateRow, payload: bytes) -> UpdateOutcome:
    """Store a stale update durably: its payload blob (fsync-ed), then its ``updates`` row and a waiting
    ``buffered_updates`` row in one transaction.

    Args:
        store: the coordinator's store. row: a new :class:`UpdateRow` (its ``round`` is the round it was trained
            for). payload: the update's payload bytes, named by ``row.payload_sha256`` (verified by the caller).

    Returns:
        ``STORED``, or ``DUPLICATE`` when an update of this (round, site) is stored already (nothing written).

    Raises:
        OSError, sqlalchemy.exc.SQLAlchemyError: storing failed (nothing is ACKed; the gateway re-sends).
    """
    store.put_blob(payload, sha256_hex=row.payload_sha256)
    try:
        with store.session() as s:
            s.add(row)
            s.flush()
            s.add(BufferedUpdateRow(update_id=row.id, buffer_round=None))
    except IntegrityError:
        return UpdateOutcome.DUPLICATE
    return UpdateOutcome.STORED


def claim_waiting(store: Store, round: int) -> list[UpdateRow]:
    """Give every waiting stale update to ``round`` (module docstring) and return the updates claimed for it,
    oldest first (those claimed before a crash included).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed (nothing is claimed then).
    """
    with store.session() as s:
        s.execute(update(BufferedUpdateRow).where(BufferedUpdateRow.buffer_round.is_(None))
                  .values(buffer_round=round))
    with store.session() as s:
        claimed = select(BufferedUpdateRow.update_id).where(BufferedUpdateRow.buffer_round == round)
        rows = list(s.scalars(select(UpdateRow).where(UpdateRow.id.in_(claimed)).order_by(UpdateRow.id)))
        s.expunge_all()
        return rows


def count_waiting(store: Store) -> int:
    """Stale updates stored and not yet claimed by a round (they count towards the open round's buffer)."""
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(BufferedUpdateRow)
                            .where(BufferedUpdateRow.buffer_round.is_(None))) or 0)


def buffer_counts(store: Store) -> tuple[int, int]:
    """``(waiting, folded)``: stale updates stored and not yet claimed, and those a closed round has folded."""
    with store.session() as s:
        total = int(s.scalar(select(func.count()).select_from(BufferedUpdateRow)) or 0)
    waiting = count_waiting(store)
    return waiting, total - waiting
