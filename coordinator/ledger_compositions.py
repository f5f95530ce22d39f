"""The privacy ledger's running compositions, kept in step with its stored rows.

:class:`LedgerCompositions` is the half of :class:`coordinator.ledger.PrivacyLedger` that keeps, per (site,
category, accountant), a running composition (:class:`shared.privacy.running.RunningComposition`) of the ledger
rows, and composes into it, before every read, only the rows it has not seen (module docstring of
:mod:`coordinator.ledger`: "Incremental", "The store stays the source of truth"). It reads the store; it writes
nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import func, select

from shared.iucn import IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName
from shared.privacy.events import PrivacyEvent, parse_event
from shared.privacy.running import RunningComposition

from coordinator.tables import LedgerRow

__all__ = ["LedgerCompositions", "RunningStream"]

log = logging.getLogger("coordinator.ledger")  # the ledger's log, whichever of its modules writes


@dataclass
class RunningStream:
    """The running composition of one (site, category, accountant) and the ledger row ids composed into it."""

    running: RunningComposition
    ids: set[int] = field(default_factory=set)
    max_id: int = 0


class LedgerCompositions:
    """Running compositions of a ledger's recorded events, refreshed from the store before every read. A base of
    :class:`coordinator.ledger.PrivacyLedger`, whose store, lock, accountant, ``target_delta``, stream map
    (``_streams``) and stream lookup (``_streams_of``) these methods use."""

    # ---- running compositions ------------------------------------------------------------------------------
    def _running(self, site_id: str, cat: IUCNCategory, accountant: AccountantName) -> RunningStream:
        """The (site, category, accountant) stream with every row committed before this call composed into it
        (:meth:`_refresh` of that one category). Caller holds ``self._lock``.

        Raises:
            dp_accounting.UnsupportedEventError, PayloadError: as :meth:`_refresh`.
        """
        self._refresh(site_id, (cat,), accountant)
        return self._streams[(site_id, cat.value, accountant)]

    def _refresh(self, site_id: str, cats: Iterable[IUCNCategory], accountant: AccountantName) -> None:
        """Compose into the (site, c, accountant) stream of each category ``c`` in ``cats`` every row committed
        before this call, in two reads whatever the number of categories.

        Caller holds ``self._lock``. Reads the site's rows of those categories that no stream has composed (ids
        above the smallest largest-composed id; rows already composed are skipped by id), then counts the rows per
        category (module docstring: a count above what is composed means a smaller id committed late, found by
        comparing ids). A count below it (rows removed: never in operation) rebuilds that stream from the store.

        Raises:
            dp_accounting.UnsupportedEventError: a new row's event is not supported (nothing of the batch is marked
                composed, so every later read raises too: never skipped).
            PayloadError: a new row does not parse as a known event type.
        """
        cats = sorted(set(cats), key=lambda c: c.rank)
        if not cats:
            return
        streams = {}
        for cat in cats:
            key = (site_id, cat.value, accountant)
            if key not in self._streams:
                self._streams[key] = RunningStream(RunningComposition(target_delta=self.target_delta,
                                                                accountant=accountant))
            streams[cat.value] = self._streams[key]
        since = min(st.max_id for st in streams.values())
        where = (LedgerRow.site_id == site_id, LedgerRow.category.in_(list(streams)))
        new: dict[str, list] = {c: [] for c in streams}
        with self._store.session() as s:
            for i, c, ev in s.execute(select(LedgerRow.id, LedgerRow.category, LedgerRow.event_json)
                                      .where(*where, LedgerRow.id > since).order_by(LedgerRow.id)).all():
                if int(i) not in streams[c].ids:
                    new[c].append((i, ev))
            counts = dict(s.execute(select(LedgerRow.category, func.count(LedgerRow.id)).where(*where)
                                    .group_by(LedgerRow.category)).all())
            vanished = []
            for c, st in streams.items():
                count = int(counts.get(c, 0))
                if count < len(st.ids):  # rows removed under us (e.g. a test reset the schema): start again
                    log.warning("ledger: %d row(s) of %s/%s vanished from the store; recomposing its history",
                                len(st.ids) - count, site_id, c)
                    vanished.append(c)
                elif count > len(st.ids) + len(new[c]):  # an id below what was read committed late (another writer)
                    seen = st.ids | {int(i) for i, _ in new[c]}
                    missing = [i for i in s.scalars(select(LedgerRow.id).where(
                        LedgerRow.site_id == site_id, LedgerRow.category == c)).all() if int(i) not in seen]
                    new[c] += s.execute(select(LedgerRow.id, LedgerRow.event_json)
                                        .where(LedgerRow.id.in_(missing))).all()
        for c, st in streams.items():
            if c in vanished or not new[c]:
                continue
            st.running.compose(parse_event(json.loads(ev)) for _, ev in sorted(new[c]))
            st.ids.update(int(i) for i, _ in new[c])
            st.max_id = max(st.max_id, *(int(i) for i, _ in new[c]))
        if vanished:
            for c in vanished:
                del self._streams[(site_id, c, accountant)]
            self._refresh(site_id, [IUCNCategory(c) for c in vanished], accountant)

    def _epsilon_with(self, site_id: str, category: IUCNCategory | str, extra: Sequence[PrivacyEvent],
                      accountant: AccountantName | None, *, refresh: bool = True) -> float:
        """Epsilon of every recorded event of (site, category) followed by ``extra`` (a dry run; nothing written).
        ``refresh=False``: the caller has just refreshed the category (:meth:`_refresh`); a stream never read
        is refreshed anyway."""
        cat = parse_category(category)
        acc = accountant or self.accountant
        with self._lock:
            st = self._streams.get((site_id, cat.value, acc)) if not refresh else None
            if st is None:
                st = self._running(site_id, cat, acc)
            return st.running.epsilon_with(extra) if extra else st.running.epsilon()

    def spent_by_category(self, site_id: str, categories: Iterable[IUCNCategory | str],
                          accountant: AccountantName | None = None) -> dict[IUCNCategory, float]:
        """:meth:`spent` of several categories of one site, read from the store once per stream (two queries per
        stream, where :meth:`spent` makes two per category): what a budget table of many sites needs.

        Returns:
            ``{category: epsilon}`` (0.0 where nothing is recorded).

        Raises:
            ConfigError: a key is not an IUCN category. dp_accounting.UnsupportedEventError, PayloadError: as
                :meth:`spent`.
        """
        cats = [parse_category(c) for c in categories]
        acc = accountant or self.accountant
        streams = self._streams_of(site_id)
        out = dict.fromkeys(cats, 0.0)
        with self._lock:  # a site with cohorts: the largest over its streams, as spent()
            for stream in streams:
                self._refresh(stream, cats, acc)
                for c in cats:
                    out[c] = max(out[c], self._streams[(stream, c.value, acc)].running.epsilon())
        return out
