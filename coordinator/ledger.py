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
  Buffered rounds cap the count at one per site (``max_pending``): there a gateway trains only the newest task it
  holds and only once its previous update was acknowledged (``edge_sdk.agent``), so at most one update it trained
  can still be charged; the rounds it missed cost it nothing.
- Rounds left (:meth:`PrivacyLedger.rounds_left`, for ``wildfed-coordinator budget``): the same dry run repeated
  (the same predicted events, every mechanism, the same pending rounds), i.e. how many more rounds the accountant
  allows before the budget is passed (composition through dp-accounting, never a linear extrapolation of epsilon).
  It is 0 exactly when :meth:`PrivacyLedger.halt_if_needed` would halt the category.
- At close (:meth:`PrivacyLedger.round_would_exceed`): the round's events are checked once more against every
  other round's recorded events and pending rounds; an update that would pass its budget is not aggregated.

Stream ids and the composition arithmetic are in :mod:`coordinator.ledger_streams`; the running compositions and
their refresh from the store in :mod:`coordinator.ledger_compositions`, and the dry runs (pending rounds, halting,
rounds left, the check at close) in :mod:`coordinator.ledger_forecast`, both bases of :class:`PrivacyLedger`.
"""

from __future__ import annotations

import json
import logging
import datetime as _dt
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import select

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName
from shared.privacy.events import DPSGDEvent, SkellamEvent, parse_event

from coordinator.ledger_compositions import LedgerCompositions, RunningStream
from coordinator.ledger_forecast import LedgerForecasts
from coordinator.ledger_streams import COHORT_MARK, base_site, check_budget, cohort_of, stream_id
from coordinator.storage import Store, dumps
from coordinator.tables import CohortRoundRow, HaltRow, LedgerRow

__all__ = ["PrivacyLedger", "LedgerError", "HaltInfo"]

log = logging.getLogger(__name__)


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


class PrivacyLedger(LedgerCompositions, LedgerForecasts):
    """Append-only per-site, per-IUCN-category ledger of DP-SGD events, composed with dp-accounting.

    Args:
        store: where rows live (:class:`coordinator.storage.Store`).
        target_delta: delta at which epsilon is reported (the federation's ``target_delta``), in (0, 1).
        accountant: default accountant name, ``"rdp"`` or ``"pld"`` (shared.privacy.accounting).
        max_pending: the most pending rounds per site the forecasts count (:meth:`pending_rounds`); None: all.
            Buffered rounds set 1 (``CoordinatorConfig.pending_rounds_cap``): a buffered gateway has at most one
            trained update that is not yet charged.

    A new ``PrivacyLedger`` on the same database (e.g. after a restart) reports exactly the same spend: what it keeps
    in memory (a running composition per (site, category, accountant), module docstring) is rebuilt from the rows,
    and rows appended by other processes are composed before every read. Safe to share between threads (one lock
    around the running compositions).
    """

    def __init__(self, store: Store, *, target_delta: float, accountant: AccountantName = "rdp",
                 max_pending: int | None = None) -> None:
        self._store = store
        self.max_pending = max_pending
        self.target_delta = float(target_delta)
        self.accountant: AccountantName = accountant
        self._streams: dict[tuple[str, str, str], RunningStream] = {}
        self._lock = threading.RLock()

    @property
    def store(self) -> Store:
        """The store the ledger reads and writes."""
        return self._store

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
        check_budget(budget)
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

