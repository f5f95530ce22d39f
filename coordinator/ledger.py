"""The privacy ledger: an append-only record of every DP-SGD event charged to each (site, IUCN category).

Semantics (docs/privacy.md):

- Unit of privacy: one record at a site, add-or-remove-one neighbours. CCDP noises each category's clipped
  gradient sum separately, so a record's guarantee is that of its category's mechanism (parallel composition):
  the ledger therefore keeps one event stream per (site, category) and never composes across categories.
- Rows are immutable: one :class:`shared.privacy.events.DPSGDEvent` per (site, round, category), committed before
  :meth:`PrivacyLedger.record_round` returns. Re-recording the *same* event for the same key is a no-op (a
  coordinator that crashed between "ledger written" and "model stored" replays the round safely); a *different*
  event for an existing key raises :class:`LedgerError`.
- Spend is the composition of *all* recorded events of the (site, category) by a dp-accounting accountant (RDP by
  default, Mironov 2017; or PLD). An event the accountant does not support raises
  ``dp_accounting.UnsupportedEventError``; it is never skipped.
- Incremental: per (site, category, accountant) the ledger keeps a running composition
  (:class:`shared.privacy.running.RunningComposition`) in memory, and each question (spend, dry run, rounds left)
  first composes into it only the rows it has not seen: a charge costs the same whatever the length of the history.
  Dry runs compose the candidate events into a copy of it. The results equal those of composing the whole history
  afresh (:func:`composed_epsilon`) to floating-point rounding for RDP and exactly for PLD (see that module).
- The store stays the source of truth: the in-memory compositions are a cache of its rows, rebuilt from them on
  first use (a new ``PrivacyLedger`` after a restart composes the stored history once per (site, category), coalesced:
  one accountant evaluation per distinct mechanism). Several processes (ingest workers, the CLI, the web view) may
  append to the same database: before every read the ledger fetches the site's rows of the categories asked about
  (one category for :meth:`PrivacyLedger.spent`; all of them at once for the halt check and
  :meth:`PrivacyLedger.spent_by_category`) with an id above the smallest largest-composed id, skipping those already
  composed, and then counts the rows per category; a count above what it has composed (a row with a smaller id
  committed late by another writer) makes it compare ids and compose the missing rows. Rows committed before the
  read are therefore never missed, as when the whole history was read.
- Cost: identical (noise_multiplier, sampling_rate) events are coalesced before composing
  (``SelfComposed(e, a) o SelfComposed(e, b) = SelfComposed(e, a + b)``, the definition of self-composition), so
  a site that repeats its calibrated event every round costs one accountant evaluation, not one per round.
- Halting: before a round is opened, :meth:`PrivacyLedger.halt_if_needed` dry-runs the site's *next* event of each
  category (by default the last event it reported for that category, since a site calibrates one noise multiplier
  for its whole planned schedule) and halts the category if the composed spend would pass its budget. Halts are
  durable and permanent, and each carries its reason (spend, budget, the dry-run's result), which
  :meth:`PrivacyLedger.halts` returns for ``wildfed-coordinator status``. A site whose every known category is
  halted is no longer selected.
- Cohorts (record-level budgets, :mod:`coordinator.cohorts`): a stream id is a site id or ``"<site>@c<round>"``, one
  cohort of the site's records; :meth:`PrivacyLedger.record_round` writes a site's round to each cohort the round
  named, and every per-stream method (spend, halts, dry runs) works on a cohort's stream as on a site's. Read with a
  site id, spend and events are those of the site's stream that spent the most in the category.
- Charges that can still arrive (:meth:`PrivacyLedger.pending_rounds`): a round whose task was sent to a site but
  whose update has not been charged yet (the round closed at its deadline, or a coordinator crashed and
  ``RoundManager.recover`` closed it) may still be charged when the site's update comes in late. The halt check
  counts each such round as one more round of the predicted events, as if it were already spent, so that however
  late those updates arrive (and whatever crashed) the spend never passes the budget. A pending round stops
  counting once any event of the site for it is charged. A site that never delivers a round keeps it pending: it
  only halts that site's categories up to one round early per round missed (conservative, never an overrun).
- Rounds left (:meth:`PrivacyLedger.rounds_left`, for ``wildfed-coordinator budget``): the same dry run repeated
  (the same predicted events, every mechanism, the same pending rounds), i.e. how many more rounds the accountant
  allows before the budget is passed (composition through dp-accounting, never a linear extrapolation of epsilon).
  It is 0 exactly when :meth:`PrivacyLedger.halt_if_needed` would halt the category.
- At close (:meth:`PrivacyLedger.round_would_exceed`): the round's events are checked once more against every
  other round's recorded events and pending rounds; an update that would pass its budget is not aggregated.
"""

from __future__ import annotations

import functools
import json
import logging
import datetime as _dt
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import func, select

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName, epsilon_spent
from shared.privacy.events import DPSGDEvent, PrivacyEvent, SkellamEvent, parse_event
from shared.privacy.running import RunningComposition, coalesce

from coordinator.storage import CohortRoundRow, CohortRow, HaltRow, LedgerRow, RoundRow, Store, dumps

__all__ = ["PrivacyLedger", "LedgerError", "HaltInfo", "coalesce", "composed_epsilon", "repeat_rounds",
           "UNCHARGEABLE_PRIVACY", "COHORT_MARK", "stream_id", "base_site", "cohort_of"]

#: What separates a site id from its cohort in a ledger stream id (site ids never hold ``@``).
COHORT_MARK = "@c"


def stream_id(site_id: str, cohort: int | None) -> str:
    """The ledger stream of a site's cohort: ``"<site>@c<cohort>"``; ``site_id`` itself for ``None`` (sites and
    rounds without cohorts: radio uploads) and for cohort 0, the records a site trained before it had cohorts (their
    spend is on the site's own stream)."""
    return site_id if not cohort else f"{site_id}{COHORT_MARK}{int(cohort)}"


def base_site(stream: str) -> str:
    """The site a ledger stream belongs to."""
    return stream.split(COHORT_MARK, 1)[0]


def cohort_of(stream: str) -> int | None:
    """The cohort (its first round) of a ledger stream; None for a site's own stream."""
    return int(stream.rsplit(COHORT_MARK, 1)[1]) if COHORT_MARK in stream else None

log = logging.getLogger(__name__)


def repeat_rounds(per_round: Sequence[DPSGDEvent], k: int) -> tuple[DPSGDEvent, ...]:
    """``k`` rounds of ``per_round`` (one round's events, every mechanism) as ``len(per_round)`` events with ``k``
    times the steps: exact, by the definition of self-composition. ``k = 0`` gives ``()``."""
    if k <= 0:
        return ()
    return tuple(e.with_steps(e.steps * k) for e in per_round)


# Round privacy modes whose updates are never charged after the round (no late charge can arrive): Global DP charges
# the survivors before unmasking and drops its secure-aggregation state with the round; "none" charges nothing.
UNCHARGEABLE_PRIVACY = frozenset({"global", "none"})


@functools.lru_cache(maxsize=4096)
def composed_epsilon(events: tuple[DPSGDEvent, ...], target_delta: float, accountant: AccountantName) -> float:
    """Epsilon of the composition of ``events`` (after :func:`coalesce`) at ``target_delta``; pure, memoised.

    The whole history composed afresh: the reference the ledger's running compositions equal, and what it falls
    back to for a replay whose stored events differ from the ones checked (:meth:`PrivacyLedger.round_would_exceed`).

    Raises:
        dp_accounting.UnsupportedEventError: the accountant cannot interpret an event.
    """
    return epsilon_spent(list(coalesce(events)), target_delta=target_delta, accountant=accountant)


class LedgerError(PrivacyBudgetError):
    """A ledger write would change history (a different event for an existing (site, round, category))."""


@dataclass(frozen=True)
class HaltInfo:
    """A halted (site, category): from which round, why (the reason written when it was halted), and when."""

    site_id: str
    category: IUCNCategory
    round: int
    reason: str
    halted_at: _dt.datetime | None


@dataclass
class _Stream:
    """The running composition of one (site, category, accountant) and the ledger row ids composed into it."""

    running: RunningComposition
    ids: set[int] = field(default_factory=set)
    max_id: int = 0


def _check_budget(budget: float) -> None:
    """Raises PrivacyBudgetError: ``budget`` is not a positive finite epsilon."""
    if not (budget > 0 and math.isfinite(budget)):
        raise PrivacyBudgetError(f"budget must be a positive finite epsilon, got {budget!r}")


def _mechanism_steps(events: Iterable[PrivacyEvent]) -> dict[tuple, int]:
    """``{mechanism key: steps}`` of the events with steps: equal for two event lists that compose the same."""
    return {e.mechanism_key(): int(e.steps) for e in coalesce(e for e in events if e.steps > 0)}


class PrivacyLedger:
    """Append-only per-site, per-IUCN-category ledger of DP-SGD events, composed with dp-accounting.

    Args:
        store: where rows live (:class:`coordinator.storage.Store`).
        target_delta: delta at which epsilon is reported (the federation's ``target_delta``), in (0, 1).
        accountant: default accountant name, ``"rdp"`` or ``"pld"`` (shared.privacy.accounting).

    A new ``PrivacyLedger`` on the same database (e.g. after a restart) reports exactly the same spend: what it keeps
    in memory (a running composition per (site, category, accountant), module docstring) is rebuilt from the rows,
    and rows appended by other processes are composed before every read. Safe to share between threads (one lock
    around the running compositions).
    """

    def __init__(self, store: Store, *, target_delta: float, accountant: AccountantName = "rdp") -> None:
        self._store = store
        self.target_delta = float(target_delta)
        self.accountant: AccountantName = accountant
        self._streams: dict[tuple[str, str, str], _Stream] = {}
        self._lock = threading.RLock()

    @property
    def store(self) -> Store:
        """The store the ledger reads and writes."""
        return self._store

    # ---- running compositions ------------------------------------------------------------------------------
    def _running(self, site_id: str, cat: IUCNCategory, accountant: AccountantName) -> _Stream:
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
                self._streams[key] = _Stream(RunningComposition(target_delta=self.target_delta,
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

    # ---- writes ----------------------------------------------------------------------------------------------
    def record_round(self, site_id: str, round: int, events: Mapping[IUCNCategory | str, DPSGDEvent], *,
                     mechanism: str = "dpsgd") -> None:
        """Append the events a site ran in ``round`` (one per category it trained), durably (committed).

        A site whose round has cohorts (:meth:`cohort_targets`) is charged once per cohort that took part, under the
        cohort's stream (:func:`stream_id`), for the categories not halted in that cohort: each record's history is
        its cohort's (coordinator/cohorts.py). Otherwise the events go to the site's own stream.

        Args:
            site_id: the site charged.
            round: the federated round the events belong to.
            events: ``{category: DPSGDEvent}`` as reported in the site's :class:`shared.protocol.UpdateReport`.
            mechanism: ``"dpsgd"`` (the training steps) or ``"counts"`` (a noisy count release, NIRA); a round may
                hold one event of each per category, and every one of them is composed into the spend.

        Raises:
            LedgerError: a different event is already recorded for (site, round, category, mechanism) (history is
                immutable).
            ConfigError: a key is not an IUCN category.
        """
        parsed = {parse_category(c, field="events"): e for c, e in events.items()}
        for stream, halted in self.cohort_targets(site_id, round):
            self._record(stream, round, {c: e for c, e in parsed.items() if c not in halted}, mechanism)

    def _record(self, site_id: str, round: int, parsed: Mapping[IUCNCategory, DPSGDEvent], mechanism: str) -> None:
        """Write ``parsed`` under the stream ``site_id`` (immutable rows; a replay of the same event is a no-op)."""
        with self._store.session() as s:
            for cat, ev in parsed.items():
                existing = s.scalars(select(LedgerRow).where(
                    LedgerRow.site_id == site_id, LedgerRow.round == round, LedgerRow.category == cat.value,
                    LedgerRow.mechanism == mechanism)).first()
                if existing is not None:
                    if parse_event(json.loads(existing.event_json)) != ev:
                        raise LedgerError(
                            f"ledger already holds a different {mechanism} event for site {site_id!r}, round "
                            f"{round}, category {cat.value}; ledger rows are immutable")
                    continue
                s.add(LedgerRow(site_id=site_id, round=round, category=cat.value,
                                noise_multiplier=float(ev.noise_multiplier), sampling_rate=float(ev.sampling_rate),
                                steps=int(ev.steps), event_json=dumps(ev.to_json()), mechanism=mechanism))
        log.info("ledger: recorded %d %s event(s) for site %s round %d", len(parsed), mechanism, site_id, round)

    def cohort_targets(self, site_id: str, round: int) -> list[tuple[str, frozenset[IUCNCategory]]]:
        """``[(stream, categories halted in it)]`` that a site's charge for ``round`` goes to: one per cohort the
        round's tasks named (``coordinator.cohorts``), else ``[(site_id, {})]``."""
        with self._store.session() as s:
            row = s.scalars(select(CohortRoundRow).where(CohortRoundRow.site_id == site_id,
                                                         CohortRoundRow.round == int(round))).first()
            active = json.loads(row.active_json) if row is not None else None
        if active is None:
            return [(site_id, frozenset())]
        return [(stream_id(site_id, int(c)), frozenset(IUCNCategory(x) for x in cats))
                for c, cats in sorted(active.items(), key=lambda kv: int(kv[0]))]

    def halted_in_round(self, site_id: str, round: int) -> frozenset[IUCNCategory]:
        """Categories no record of the site may train in ``round``: halted in every cohort the round's tasks named
        (a category still active in one cohort trains there), else the site's own halts."""
        targets = self.cohort_targets(site_id, round)
        if targets == [(site_id, frozenset())]:
            return self.stream_halted(site_id)
        return frozenset.intersection(*(h for _, h in targets)) if targets else frozenset(IUCNCategory)

    def cohort_round_would_exceed(self, site_id: str, category: IUCNCategory | str, round: int,
                                  events: Sequence[DPSGDEvent], budget: float, *, pending_rounds: Sequence[int] = (),
                                  accountant: AccountantName | None = None) -> bool:
        """:meth:`round_would_exceed` for each stream the site's charge for ``round`` goes to (:meth:`cohort_targets`,
        those where ``category`` is not halted): each cohort counts as pending only the site's ``pending_rounds``
        from its own first round on (it took part in no earlier round)."""
        cat = parse_category(category)
        for stream, halted in self.cohort_targets(site_id, round):
            if cat in halted:
                continue
            first = cohort_of(stream)
            pending = sum(1 for p in pending_rounds if first is None or p >= first)
            if self.round_would_exceed(stream, cat, round, events, budget, pending=pending, accountant=accountant):
                return True
        return False

    def _resolve(self, site_id: str, category: IUCNCategory) -> str:
        """The stream a site-level read of ``category`` means: the stream itself for a stream id or a site without
        cohorts, else the site's stream that spent the most in it (its worst-off records')."""
        if COHORT_MARK in site_id:
            return site_id
        streams = self.site_streams(site_id)
        if len(streams) <= 1:
            return streams[0] if streams else site_id
        return max(streams, key=lambda x: self._epsilon_with(x, category, (), None))

    def events_recorded(self, stream: str) -> bool:
        """Whether the stream (a site's own, or a cohort's) holds any ledger row."""
        with self._store.session() as s:
            return s.scalars(select(LedgerRow.id).where(LedgerRow.site_id == stream).limit(1)).first() is not None

    def _streams_of(self, site_id: str) -> list[str]:
        """The streams a read of ``site_id`` covers: a stream id itself; a site's own and its cohorts' streams."""
        return [site_id] if COHORT_MARK in site_id else (self.site_streams(site_id) or [site_id])

    def site_streams(self, site_id: str) -> list[str]:
        """The ledger streams of a site that hold rows: its own and its cohorts', sorted (cohorts by round)."""
        with self._store.session() as s:
            found = s.scalars(select(LedgerRow.site_id).where(LedgerRow.site_id.startswith(site_id,
                                                                                         autoescape=True))
                              .distinct()).all()
        mine = [x for x in found if x == site_id or x.startswith(site_id + COHORT_MARK)]
        return sorted(mine, key=lambda x: (x != site_id, int(x.rsplit(COHORT_MARK, 1)[1]) if x != site_id else 0))

    def halt(self, site_id: str, category: IUCNCategory | str, *, round: int, reason: str = "") -> None:
        """Halt ``category`` at ``site_id`` from ``round`` on (durable, idempotent, permanent)."""
        cat = parse_category(category)
        with self._store.session() as s:
            exists = s.scalars(select(HaltRow).where(HaltRow.site_id == site_id,
                                                     HaltRow.category == cat.value)).first()
            if exists is None:
                s.add(HaltRow(site_id=site_id, category=cat.value, round=round, reason=reason))
                # a cohort's halt is routine (its records retire; new cohorts train on): info, not a warning
                (log.info if COHORT_MARK in site_id else log.warning)(
                    "ledger: halted %s at site %s from round %d (%s)", cat.value, site_id, round, reason)

    # ---- reads -----------------------------------------------------------------------------------------------
    def events(self, site_id: str, category: IUCNCategory | str, *, mechanism: str | None = None
               ) -> list[DPSGDEvent]:
        """Every recorded event of (site, category) (of one ``mechanism``, ``"dpsgd"`` or ``"counts"``, if given;
        all of them by default, as spend composes them), in round order.

        Raises:
            PayloadError: a stored row does not parse as a known event type (never skipped).
        """
        cat = parse_category(category)
        site_id = self._resolve(site_id, cat)
        with self._store.session() as s:
            q = select(LedgerRow).where(LedgerRow.site_id == site_id, LedgerRow.category == cat.value)
            if mechanism is not None:
                q = q.where(LedgerRow.mechanism == mechanism)
            rows = s.scalars(q.order_by(LedgerRow.round, LedgerRow.id)).all()
            return [parse_event(json.loads(r.event_json)) for r in rows]

    def categories(self, site_id: str) -> set[IUCNCategory]:
        """Categories for which the site (any of its cohorts, for a site id) has at least one recorded event."""
        streams = self._streams_of(site_id)
        with self._store.session() as s:
            cats = s.scalars(select(LedgerRow.category).where(LedgerRow.site_id.in_(streams)).distinct()).all()
        return {IUCNCategory(c) for c in cats}

    def sites(self) -> list[str]:
        """Sites with at least one ledger row (their own or a cohort's), sorted."""
        with self._store.session() as s:
            return sorted({base_site(x) for x in s.scalars(select(LedgerRow.site_id).distinct()).all()})

    def spent(self, site_id: str, category: IUCNCategory | str, accountant: AccountantName | None = None) -> float:
        """Epsilon spent so far by (site, category) at ``target_delta``: the composition of ALL its events; for a
        site with cohorts, the largest over its streams (its worst-off record's); a stream id gives that stream's.

        Returns:
            epsilon (float, >= 0; 0.0 when nothing is recorded).

        Cost: the rows recorded since the last read are composed into the running composition; constant in the
        number of earlier rounds.

        Raises:
            dp_accounting.UnsupportedEventError: the accountant cannot interpret a recorded event.
            PayloadError: a stored row does not parse as a known event type.
        """
        cat = parse_category(category)
        return self._epsilon_with(self._resolve(site_id, cat), cat, (), accountant)

    def would_exceed(self, site_id: str, category: IUCNCategory | str,
                     next_event: DPSGDEvent | Sequence[DPSGDEvent], budget: float,
                     accountant: AccountantName | None = None, *, round: int | None = None) -> bool:
        """Dry run: would recording ``next_event`` (one event, or a round's events of every mechanism) make the
        (site, category) spend pass ``budget`` (epsilon)?

        Nothing is written. ``next_event`` is composed into a copy of the running composition (constant in the
        number of recorded rounds). With ``round``, every stream the site's charge for that round would go to is
        checked (:meth:`cohort_targets`): True when any would pass.

        Raises:
            PrivacyBudgetError: ``budget`` not a positive finite epsilon.
            dp_accounting.UnsupportedEventError: the accountant cannot interpret an event.
        """
        _check_budget(budget)
        nxt = (next_event,) if isinstance(next_event, (DPSGDEvent, SkellamEvent)) else tuple(next_event)
        cat = parse_category(category)
        streams = [x for x, halted in (self.cohort_targets(site_id, round) if round is not None else [(site_id, ())])
                   if cat not in halted]
        return any(self._epsilon_with(x, cat, nxt, accountant) > budget for x in streams)

    def halted(self, site_id: str) -> frozenset[IUCNCategory]:
        """Categories halted at ``site_id`` (empty set when none); for a site with cohorts, those halted in every
        cohort of its latest planned round (:meth:`halted_in_round`)."""
        if COHORT_MARK not in site_id:
            with self._store.session() as s:
                latest = s.scalars(select(CohortRoundRow.round).where(CohortRoundRow.site_id == site_id)
                                   .order_by(CohortRoundRow.round.desc())).first()
            if latest is not None:
                return self.halted_in_round(site_id, int(latest))
        return self.stream_halted(site_id)

    def stream_halted(self, stream: str) -> frozenset[IUCNCategory]:
        """Categories halted in one ledger stream (a site's own, or a cohort's)."""
        with self._store.session() as s:
            cats = s.scalars(select(HaltRow.category).where(HaltRow.site_id == stream)).all()
        return frozenset(IUCNCategory(c) for c in cats)

    def halts(self, site_id: str | None = None) -> list[HaltInfo]:
        """Every halt (of ``site_id`` and its cohorts, or of all sites), ordered by stream then IUCN rank, with its
        reason (a cohort's halt names its stream, :func:`stream_id`)."""
        with self._store.session() as s:
            q = select(HaltRow)
            rows = s.scalars(q).all()
            if site_id is not None:  # the site's own halts and its cohorts'
                rows = [r for r in rows if r.site_id == site_id or (COHORT_MARK not in site_id
                                                                    and base_site(r.site_id) == site_id)]
            out = [HaltInfo(site_id=r.site_id, category=IUCNCategory(r.category), round=int(r.round),
                            reason=r.reason or "", halted_at=r.halted_at) for r in rows]
        return sorted(out, key=lambda h: (h.site_id, h.category.rank))

    def round_events(self, site_id: str, category: IUCNCategory | str) -> list[tuple[int, DPSGDEvent]]:
        """``[(round, event)]`` of (site, category), in round order (for burn-down plots; a site with cohorts: its
        worst-off cohort's)."""
        cat = parse_category(category)
        site_id = self._resolve(site_id, cat)
        with self._store.session() as s:
            rows = s.scalars(select(LedgerRow).where(LedgerRow.site_id == site_id, LedgerRow.category == cat.value)
                             .order_by(LedgerRow.round, LedgerRow.id)).all()
            return [(int(r.round), parse_event(json.loads(r.event_json))) for r in rows]

    def last_round_events(self, site_id: str) -> tuple[int | None, dict[IUCNCategory, DPSGDEvent]]:
        """``(round, {category: DP-SGD event})`` of the site's most recent round in the ledger; ``(None, {})`` if
        none (see :meth:`last_round_event_sets` for every mechanism of that round)."""
        last, sets = self.last_round_event_sets(site_id, mechanisms=("dpsgd",))
        return last, {c: evs[0] for c, evs in sets.items()}

    def last_round_event_sets(self, site_id: str, mechanisms: tuple[str, ...] | None = None
                              ) -> tuple[int | None, dict[IUCNCategory, tuple[DPSGDEvent, ...]]]:
        """``(round, {category: (events of every mechanism, DP-SGD first)})`` of the site's most recent round (for
        a site with cohorts: the round's events as any one cohort that trained the category was charged them)."""
        streams = self._streams_of(site_id)
        with self._store.session() as s:
            q = select(LedgerRow.round).where(LedgerRow.site_id.in_(streams))
            if mechanisms is not None:
                q = q.where(LedgerRow.mechanism.in_(mechanisms))
            last = s.scalars(q.order_by(LedgerRow.round.desc())).first()
            if last is None:
                return None, {}
            q = select(LedgerRow).where(LedgerRow.site_id.in_(streams), LedgerRow.round == last)
            if mechanisms is not None:
                q = q.where(LedgerRow.mechanism.in_(mechanisms))
            rows = s.scalars(q.order_by(LedgerRow.mechanism.desc(), LedgerRow.id)).all()  # "dpsgd" before "counts"
            out: dict[IUCNCategory, tuple[DPSGDEvent, ...]] = {}
            source: dict[IUCNCategory, str] = {}
            for r in rows:
                cat = IUCNCategory(r.category)
                if source.setdefault(cat, r.site_id) == r.site_id:  # one cohort's copy of the round's events
                    out[cat] = (*out.get(cat, ()), parse_event(json.loads(r.event_json)))
            return int(last), out

    def pending_rounds(self, site_id: str | None = None, *, before_round: int | None = None
                       ) -> dict[str, tuple[int, ...]]:
        """Rounds whose charges can still arrive, per site: the site was selected (its task was sent, or was about
        to be: the round row is written before the tasks), the round's privacy mode charges updates (not Global
        DP, not "none"), and no event of the site for that round is in the ledger yet. Its update may still come
        late and be charged (``coordinator.ingest``: ``late``).

        Args:
            site_id: only this site (default: every site with a pending round).
            before_round: only rounds before this one (default: every recorded round, the open one included).

        Returns:
            ``{site: (round, ...)}`` in round order; sites with none are left out.
        """
        with self._store.session() as s:
            q = select(RoundRow.round, RoundRow.selected_json, RoundRow.privacy)
            if before_round is not None:
                q = q.where(RoundRow.round < before_round)
            rounds = s.execute(q.order_by(RoundRow.round)).all()
            q2 = select(LedgerRow.site_id, LedgerRow.round).distinct()
            if site_id is not None:
                q2 = q2.where(LedgerRow.site_id.startswith(site_id, autoescape=True))
            charged = {(base_site(str(a)), int(b)) for a, b in s.execute(q2).all()}  # a cohort's row: its site's
        out: dict[str, list[int]] = {}
        for r, selected_json, privacy in rounds:
            if (privacy or "ccdp") in UNCHARGEABLE_PRIVACY:
                continue
            for sid in json.loads(selected_json or "[]"):
                if (site_id is None or sid == site_id) and (sid, int(r)) not in charged:
                    out.setdefault(sid, []).append(int(r))
        return {k: tuple(v) for k, v in out.items()}

    def next_round_events(self, site_id: str, category: IUCNCategory | str,
                          last_sets: Mapping[IUCNCategory, tuple[DPSGDEvent, ...]] | None = None
                          ) -> tuple[DPSGDEvent, ...] | None:
        """The events one more round of (site, category) is predicted to charge, every mechanism: those of the
        site's last recorded round (DP-SGD steps and, with NIRA's noisy counts, the count release; a calibrated
        schedule repeats them every round), else the category's last recorded event; None when it never ran.
        The halt check, rounds left and the pending rounds all use this one prediction."""
        cat = parse_category(category)
        sets = self.last_round_event_sets(site_id)[1] if last_sets is None else last_sets
        if sets.get(cat):
            return tuple(sets[cat])
        history = self.events(site_id, cat)
        return (history[-1],) if history else None

    def round_would_exceed(self, site_id: str, category: IUCNCategory | str, round: int,
                           events: Sequence[DPSGDEvent], budget: float, *, pending: int = 0,
                           accountant: AccountantName | None = None) -> bool:
        """The check at close: would (site, category) pass ``budget`` with ``events`` as round ``round``'s events?

        Composes every recorded event of the other rounds (this round's own rows, if a replay already wrote them,
        are replaced by ``events``, never counted twice), ``pending`` more rounds of ``events`` (other rounds whose
        charges can still arrive) and ``events``. Nothing is written.

        Cost: constant in the number of recorded rounds when the round has no rows yet, or when its rows compose the
        same as ``events`` (the update was charged at ingest: the running composition already holds them); a replay
        whose stored rows differ from ``events`` (not seen in operation) composes the other rounds afresh.

        Raises:
            PrivacyBudgetError: ``budget`` not a positive finite epsilon.
            dp_accounting.UnsupportedEventError: the accountant cannot interpret an event.
        """
        _check_budget(budget)
        cat = parse_category(category)
        acc = accountant or self.accountant
        mine = tuple(events)
        with self._lock:
            st = self._running(site_id, cat, acc)
            with self._store.session() as s:  # read after the stream: rows it has not composed are not "in" it
                rows = s.execute(select(LedgerRow.id, LedgerRow.event_json).where(
                    LedgerRow.site_id == site_id, LedgerRow.category == cat.value, LedgerRow.round == round)).all()
            stored = [parse_event(json.loads(ev)) for i, ev in rows if int(i) in st.ids]
            if not stored:
                eps = st.running.epsilon_with((*repeat_rounds(mine, pending), *mine))
            elif _mechanism_steps(stored) == _mechanism_steps(mine):  # this round's rows are ``events``: keep them
                eps = st.running.epsilon_with(repeat_rounds(mine, pending))
            else:
                with self._store.session() as s:
                    others_rows = s.scalars(select(LedgerRow.event_json).where(
                        LedgerRow.site_id == site_id, LedgerRow.category == cat.value, LedgerRow.round != round)
                        .order_by(LedgerRow.round, LedgerRow.id)).all()
                others = tuple(parse_event(json.loads(ev)) for ev in others_rows)
                eps = composed_epsilon((*others, *repeat_rounds(mine, pending), *mine), self.target_delta, acc)
        return eps > budget

    def rounds_left(self, site_id: str, category: IUCNCategory | str, budget: float, *,
                    next_event: DPSGDEvent | Sequence[DPSGDEvent] | None = None, pending: int | None = None,
                    accountant: AccountantName | None = None, cap: int = 10_000) -> int | None:
        """How many more rounds of ``next_event`` (site, category) can run before its spend would pass ``budget``.

        The halt check's dry run (:meth:`halt_if_needed`) repeated: the largest ``k`` such that the composition of
        every recorded event, the pending rounds and ``k`` more rounds of the predicted events is at most
        ``budget``; ``0`` exactly when the next halt check would halt the category. Nothing is written.

        Args:
            next_event: one round's events (one event or every mechanism's); defaults to
                :meth:`next_round_events`, exactly what :meth:`halt_if_needed` dry-runs.
            pending: rounds whose charges can still arrive, counted as spent before the ``k`` rounds (default:
                :meth:`pending_rounds` of the site, as the halt check counts them).
            cap: search limit; a return value of ``cap`` means "at least ``cap``".

        Returns:
            ``k`` (0 when halted or when even one more round would pass the budget), or None when there is no
            event to extrapolate (the category never ran at this site).

        Each ``k`` tried is a dry run on a copy of the running composition (constant in the number of recorded
        rounds; a few tens of them for the search).

        Raises:
            PrivacyBudgetError: ``budget`` not a positive finite epsilon.
            dp_accounting.UnsupportedEventError: the accountant cannot interpret an event.
        """
        cat = parse_category(category)
        _check_budget(budget)
        per_round: tuple[DPSGDEvent, ...] | None
        if next_event is not None:
            per_round = (next_event,) if isinstance(next_event, (DPSGDEvent, SkellamEvent)) else tuple(next_event)
        else:
            per_round = self.next_round_events(site_id, cat)
        if per_round is None:
            return None
        if cat in self.stream_halted(site_id):
            return 0
        acc = accountant or self.accountant
        if pending is None:
            pending = len(self.pending_rounds(site_id).get(site_id, ()))

        def eps(k: int) -> float:
            return self._epsilon_with(site_id, cat, repeat_rounds(per_round, pending + k), acc)

        if eps(1) > budget:
            return 0
        # A first guess (it only saves accountant calls; the answer comes from the bracket search below, which
        # composes exactly): for RDP from eps^2 growing about linearly in the steps; for another accountant (PLD,
        # about 20x slower per call) the RDP answer, which is close to it.
        if acc == "rdp":
            e0, e1 = eps(0), eps(1)
            guess = (budget ** 2 - e0 ** 2) / max(e1 ** 2 - e0 ** 2, 1e-12)
        else:
            guess = self.rounds_left(site_id, cat, budget, next_event=per_round, pending=pending, accountant="rdp",
                                     cap=cap) or 1
        g = int(min(max(guess, 1), cap))
        step = max(1, g // 16)
        if eps(g) <= budget:  # grow until it passes, or stop at the cap
            lo = g
            while True:
                if lo >= cap:
                    return cap
                nxt = min(lo + step, cap)
                if eps(nxt) > budget:
                    hi = nxt
                    break
                lo, step = nxt, step * 2
        else:  # shrink until it fits (it does at 1)
            hi = g
            while True:
                nxt = max(hi - step, 1)
                if eps(nxt) <= budget:
                    lo = nxt
                    break
                hi, step = nxt, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if eps(mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo

    def site_halted(self, site_id: str, known_categories: Iterable[IUCNCategory | str] | None = None) -> bool:
        """True when every category the site is known to hold is halted.

        ``known_categories`` defaults to the categories with recorded events; a site with no known categories
        is never halted (it has spent nothing).
        """
        known = ({parse_category(c) for c in known_categories} if known_categories is not None
                 else self.categories(site_id))
        return bool(known) and known <= self.halted(site_id)

    # ---- policy ----------------------------------------------------------------------------------------------
    def halt_if_needed(self, site_id: str, budgets: Mapping[IUCNCategory, float], *, round: int,
                       next_events: Mapping[IUCNCategory, DPSGDEvent | Sequence[DPSGDEvent]] | None = None,
                       pending: int | None = None) -> frozenset[IUCNCategory]:
        """Halt every category whose next round would pass its budget; return the site's halted categories.

        The dry run composes, per category: every recorded event, then ``pending`` rounds of the predicted events
        (rounds whose tasks were sent and whose charges can still arrive, counted as spent), then one more round
        of them (the round about to open). The category is halted when that passes its budget.

        Args:
            site_id: the site about to be offered ``round``.
            budgets: total epsilon budget per category (shared.iucn.CCDPBudget.table()).
            round: the round about to open (recorded on new halts).
            next_events: predicted events of the next round (one event or a round's events of every mechanism);
                defaults to :meth:`next_round_events`.
            pending: rounds of the site whose charges can still arrive (default: :meth:`pending_rounds` before
                ``round``).

        Returns:
            The site's halted categories after this check.
        """
        already = self.stream_halted(site_id)
        last_sets = self.last_round_event_sets(site_id)[1]
        if pending is None:
            pending = len(self.pending_rounds(site_id, before_round=round).get(site_id, ()))
        cats = self.categories(site_id) | set(next_events or {})
        with self._lock:  # the site's rows read once for every category (the dry runs below need no store read)
            self._refresh(site_id, cats, self.accountant)
        for cat in sorted(cats, key=lambda c: c.rank):
            if cat in already:
                continue
            given = (next_events or {}).get(cat)
            nxt: tuple[DPSGDEvent, ...] | None
            if given is not None:
                nxt = (given,) if isinstance(given, (DPSGDEvent, SkellamEvent)) else tuple(given)
            else:
                nxt = self.next_round_events(site_id, cat, last_sets)
            if not nxt:
                continue
            budget = budgets.get(cat)
            if budget is None:
                continue
            dry = (*repeat_rounds(nxt, pending), *nxt)
            _check_budget(budget)
            after = self._epsilon_with(site_id, cat, dry, self.accountant, refresh=False)
            if after > budget:
                first = nxt[0]
                extra = f" + {len(nxt) - 1} other release(s)" if len(nxt) > 1 else ""
                waiting = (f"; {pending} earlier round(s) sent but not yet charged count as spent (their updates "
                           "can still arrive)" if pending else "")
                self.halt(site_id, cat, round=round,
                          reason=f"budget: spent eps={self.spent(site_id, cat):.4f} of {budget:.4f}{waiting}; the "
                                 f"next round (z={first.noise_multiplier:.4g}, q={first.sampling_rate:.4g}, "
                                 f"{first.steps} steps{extra}) would make it {after:.4f} ({self.accountant}, "
                                 f"delta={self.target_delta:g})")
        return self.stream_halted(site_id)
