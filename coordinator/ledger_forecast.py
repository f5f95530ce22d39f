"""The privacy ledger's dry runs: what a round about to open, or closing, would spend, and halting on it.

:class:`LedgerForecasts` is the half of :class:`coordinator.ledger.PrivacyLedger` that predicts rather than records
(module docstring of :mod:`coordinator.ledger`: "Halting", "Charges that can still arrive", "Rounds left", "At
close"). It composes on the ledger's running compositions and reads its store; it writes only halts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from sqlalchemy import select

from shared.iucn import IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName
from shared.privacy.events import DPSGDEvent, SkellamEvent, parse_event

from coordinator.ledger_streams import (UNCHARGEABLE_PRIVACY, base_site, check_budget, composed_epsilon,
                                        mechanism_steps, repeat_rounds)
from coordinator.tables import LedgerRow, RoundRow

__all__ = ["LedgerForecasts"]


class LedgerForecasts:
    """Dry runs over a ledger's recorded events: pending rounds, the next round's predicted events, the check at
    close, rounds left, halting. A base of :class:`coordinator.ledger.PrivacyLedger`, whose store, lock, running
    compositions and reads (``events``, ``categories``, ``halted``, ``spent``, ``halt``...) these methods use."""

    #: the most pending rounds counted per site (None: every one); PrivacyLedger sets it
    max_pending: int | None = None

    def pending_rounds(self, site_id: str | None = None, *, before_round: int | None = None,
                       capped: bool = True) -> dict[str, tuple[int, ...]]:
        """Rounds whose charges can still arrive, per site: the site was selected (its task was sent, or was about
        to be: the round row is written before the tasks), the round's privacy mode charges updates (not Global
        DP, not "none"), and no event of the site for that round is in the ledger yet. Its update may still come
        late and be charged (``coordinator.inbound.ingest``: ``late``).

        Args:
            site_id: only this site (default: every site with a pending round).
            before_round: only rounds before this one (default: every recorded round, the open one included).
            capped: apply ``max_pending`` (False: every pending round, e.g. to see which tasks a site may hold).

        Returns:
            ``{site: (round, ...)}`` in round order, at most ``max_pending`` (the newest) per site when the ledger
            has that cap (buffered rounds); sites with none are left out.
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
        cap = self.max_pending if capped else None
        if cap is not None:  # buffered rounds: the newest `cap` only
            out = {k: v[len(v) - cap:] if cap > 0 else [] for k, v in out.items()}
        return {k: tuple(v) for k, v in out.items() if v}

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
        check_budget(budget)
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
            elif mechanism_steps(stored) == mechanism_steps(mine):  # this round's rows are ``events``: keep them
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
        check_budget(budget)
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
            check_budget(budget)
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
