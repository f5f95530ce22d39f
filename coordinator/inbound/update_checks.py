"""The checks of an update after its envelope and signature passed: checks 8-17 of the table in
:mod:`coordinator.inbound.ingest`, i.e. its round binding (open round, selection, model version, duplicate) and
its content (payload, tensors, finite values, report, halted categories, budget); the charging of a refused
update's events to the ledger (a late one too); and the reads of what is stored already.

Functions of their inputs (the round's :class:`~coordinator.inbound.context.RoundContext`, the store, the registry,
the ledger); :class:`coordinator.inbound.ingest.Ingestor` calls them in the table's order. Each raises
:class:`coordinator.inbound.reject.Reject` with its reason code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from sqlalchemy import select

from shared.envelope import Envelope, EnvelopeHeader
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import UpdateReport, decode_update

from coordinator.inbound.context import RoundContext
from coordinator.inbound.reject import Reject, RejectReason
from coordinator.inbound.site_checks import MAX_HEADER_ROUND
from coordinator.ledger import LedgerError, PrivacyLedger
from coordinator.registry import SiteRegistry, UnknownSiteError
from coordinator.storage import RoundRow, Store, UpdateRow

__all__ = ["check_round_binding", "decode_checked_update", "check_tensors", "check_report", "charge_refused",
           "charge_late", "stored_update", "round_selected"]


def check_round_binding(h: EnvelopeHeader, ctx: RoundContext | None, store: Store, *,
                        read_stored: bool) -> RoundContext | None:
    """Checks 8-11, which need only the (verified) header: the round is open, the site was selected, the update was
    trained from the model the site was sent, and no update of the site is in for the round.

    Args:
        h: the verified header. ctx: the open round's context (None: no round is open).
        read_stored: also read the database for a stored update of the site (not only ``ctx.accepted``).

    Returns:
        ``ctx``, or None for an update of a past round that selected the site (a late update: the caller charges
        it, or lets its chunks come so that it can be charged).

    Raises:
        Reject: ``wrong_round``, ``not_selected``, ``stale_model`` or ``duplicate``.
    """
    if ctx is None or h.round != ctx.round:
        if round_selected(store, h.round, h.site_id):  # a past round (or one being closed right now)
            return None
        open_r = "none" if ctx is None else str(ctx.round)
        raise Reject(RejectReason.WRONG_ROUND, f"update for round {h.round}, open round is {open_r}")
    if h.site_id not in ctx.selected:
        raise Reject(RejectReason.NOT_SELECTED, f"site {h.site_id!r} was not selected for round {ctx.round}")
    if h.base_model_hash != ctx.expected_hash(h.site_id):
        raise Reject(RejectReason.STALE_MODEL, f"update trained from model {h.base_model_hash[:12]}, round "
                     f"{ctx.round} trains site {h.site_id} from {ctx.expected_hash(h.site_id)[:12]}")
    if h.site_id in ctx.accepted or (read_stored and stored_update(store, ctx.round, h.site_id) is not None):
        raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an accepted update for round "
                     f"{ctx.round}")
    return ctx


def decode_checked_update(payload: bytes, *, check_weights: bool = True
                          ) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """Check 12: :func:`shared.protocol.decode_update`, refusing report numbers no float holds (a JSON integer such
    as 10**400 passes shared.protocol's checks but raises OverflowError where it is used: the weight, the ledger's
    accountant) and JSON integers too long for Python to parse (ValueError).

    Returns:
        ``(report, delta)``: the update's report and its tensors by name.

    Raises:
        Reject: ``malformed_payload``.
    """
    try:
        report, delta = decode_update(payload, check_weights=check_weights)
        for ev in (*report.events.values(), *report.count_events.values()):
            float(ev.noise_multiplier), float(ev.sampling_rate)
    except (PayloadError, ValueError, OverflowError) as exc:  # ValueError: a JSON integer of > 4300 digits
        raise Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
    return report, delta


def check_tensors(ctx: RoundContext, delta: Mapping[str, np.ndarray]) -> None:
    """Checks 13 and 14: ``delta`` has exactly the names, shapes and dtypes of ``ctx.template``, and every value is
    finite.

    Raises:
        Reject: ``wrong_tensors`` or ``non_finite``.
    """
    names, want = set(delta), set(ctx.template)
    if names != want:
        raise Reject(RejectReason.WRONG_TENSORS, f"tensor names differ from the model: missing "
                     f"{sorted(want - names)[:5]}, unexpected {sorted(names - want)[:5]}")
    for name, ref in ctx.template.items():
        d = delta[name]
        if d.shape != ref.shape or d.dtype != ref.dtype:
            raise Reject(RejectReason.WRONG_TENSORS, f"tensor {name!r} is {d.dtype}{list(d.shape)}, the model "
                         f"has {ref.dtype}{list(ref.shape)}")
    for name, d in delta.items():
        if not np.all(np.isfinite(d)):
            raise Reject(RejectReason.NON_FINITE, f"tensor {name!r} has NaN or infinite values")


def _declared_capacity(registry: SiteRegistry, site_id: str) -> int | None:
    try:
        return registry.get(site_id).capacity
    except UnknownSiteError:
        return None


def check_report(ctx: RoundContext, site_id: str, report: UpdateReport, *, registry: SiteRegistry,
                 ledger: PrivacyLedger) -> dict[IUCNCategory, DPSGDEvent]:
    """Checks 15-17: the report is sane, no halted category was trained, no event takes its (site, category) spend
    past the budget. An update refused as ``halted_category`` or ``over_budget`` is charged first
    (:func:`charge_refused`).

    Returns:
        the report's DP-SGD events by IUCN category.

    Raises:
        Reject: ``bad_report``, ``halted_category``, ``over_budget`` (or ``duplicate`` when charging finds other
            events of the site already charged for the round).
    """
    n, steps = report.num_examples, report.local_steps
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HEADER_ROUND:
        raise Reject(RejectReason.BAD_REPORT, f"num_examples is {n!r}, must be a positive integer")
    declared = _declared_capacity(registry, site_id) if ctx.expected_events is None else None
    if declared is not None and n != declared:  # camera rounds: N_k is the public capacity, never a count
        raise Reject(RejectReason.BAD_REPORT, f"num_examples is {n}, the site's declared capacity is {declared} "
                     "(a gateway reports its capacity, never its record count: upgrade it)")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= ctx.local_steps:
        raise Reject(RejectReason.BAD_REPORT, f"local_steps is {steps!r}, task asked for {ctx.local_steps}")
    events = {IUCNCategory(c): e for c, e in report.events.items()}
    if ctx.privacy != "none" and not events:
        raise Reject(RejectReason.BAD_REPORT, "privacy is on but the update reports no DP events")
    if ctx.expected_events is not None and events != dict(ctx.expected_events):
        raise Reject(RejectReason.BAD_REPORT, f"a radio upload of this round must report exactly "
                     f"{ {c.value: e for c, e in ctx.expected_events.items()} }, got "
                     f"{ {c.value: e for c, e in events.items()} }")
    for cat, ev in events.items():
        if not isinstance(ev, DPSGDEvent) or ev.steps > steps:
            raise Reject(RejectReason.BAD_REPORT, f"event for {cat.value} ({ev!r}) is not a DP-SGD event of at "
                         f"most {steps} steps")
    counts = {IUCNCategory(c): e for c, e in report.count_events.items()}
    _check_counts(ctx, report, counts)
    halted = ctx.halted.get(site_id, frozenset())
    trained_halted = sorted(c.value for c in {*events, *counts} if c in halted
                            and (c in counts or events[c].steps > 0))
    if trained_halted:
        charge_refused(ledger, site_id, ctx.round, events, counts)
        raise Reject(RejectReason.HALTED_CATEGORY, f"site trained halted categories {trained_halted}; "
                     "its events were charged to the ledger")
    if ctx.privacy != "none":
        for cat in {*events, *counts}:
            budget = ctx.budgets.get(cat)
            round_events = tuple(e for e in (events.get(cat), counts.get(cat)) if e is not None)
            if budget is not None and ledger.would_exceed(site_id, cat, round_events, budget, round=ctx.round):
                charge_refused(ledger, site_id, ctx.round, events, counts)
                raise Reject(RejectReason.OVER_BUDGET, f"events for {cat.value} take site {site_id!r} past its "
                             f"budget eps={budget:.4f}; charged to the ledger, not aggregated")
    return events


def _check_counts(ctx: RoundContext, report: UpdateReport, counts: Mapping[IUCNCategory, DPSGDEvent]) -> None:
    """The count release is exactly what the task asked for: every class, the asked noise, one release."""
    z = ctx.count_noise_multiplier
    if z is None:
        if report.species_counts or counts:
            raise Reject(RejectReason.BAD_REPORT, "the update carries species counts the task did not ask for")
        return
    if ctx.num_classes is not None and set(report.species_counts) != set(range(ctx.num_classes)):
        raise Reject(RejectReason.BAD_REPORT, f"species_counts must cover classes 0..{ctx.num_classes - 1}")
    if ctx.privacy != "none":
        if set(counts) != set(report.events):
            raise Reject(RejectReason.BAD_REPORT, "the count release must be charged to every trained category")
        for cat, ev in counts.items():
            if ev != DPSGDEvent(float(z), 1.0, 1):
                raise Reject(RejectReason.BAD_REPORT, f"count event for {cat.value} is {ev!r}, the task asked "
                             f"for one Gaussian release with noise multiplier {z}")


def charge_refused(ledger: PrivacyLedger, site_id: str, round: int, events: Mapping[IUCNCategory, DPSGDEvent],
                   count_events: Mapping[IUCNCategory, DPSGDEvent] | None = None) -> None:
    """Charge a refused update's events to ``ledger`` (durably): its DP-SGD events, then its count release
    (mechanism ``counts``). A second, different report for the same round is a duplicate (ledger rows are
    immutable).

    Raises:
        Reject: ``duplicate``.
    """
    try:
        ledger.record_round(site_id, round, events)
        if count_events:
            ledger.record_round(site_id, round, count_events, mechanism="counts")
    except LedgerError as exc:
        raise Reject(RejectReason.DUPLICATE, f"site {site_id!r} already reported other events for round "
                     f"{round}", exc) from exc


def charge_late(store: Store, ledger: PrivacyLedger, env: Envelope) -> None:
    """Charge the events of ``env``, a verified update for a past round that selected its site (``late``): decoded
    (check 12), then :func:`charge_refused`.

    Raises:
        Reject: ``duplicate`` (an update of the site is stored for that round, or other events were charged for
            it), or ``malformed_payload``.
    """
    h = env.header
    if stored_update(store, h.round, h.site_id) is not None:
        raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an accepted update for round "
                     f"{h.round}")
    report, _ = decode_checked_update(env.payload)
    charge_refused(ledger, h.site_id, h.round, report.events, report.count_events)


def stored_update(store: Store, round: int, site_id: str) -> UpdateRow | None:
    """The stored update of ``site_id`` for ``round`` (its ``updates`` row), or None."""
    with store.session() as s:
        return s.scalars(select(UpdateRow).where(UpdateRow.round == round, UpdateRow.site_id == site_id)).first()


def round_selected(store: Store, round: int, site_id: str) -> bool:
    """True if ``round`` was opened (it has a round row) and selected ``site_id``."""
    with store.session() as s:
        row = s.get(RoundRow, round)
        return row is not None and site_id in json.loads(row.selected_json)
