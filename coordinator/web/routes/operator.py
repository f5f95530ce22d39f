"""The operator's pages (``/operator/budgets``, ``/operator/rounds``, ``/operator/fleet``, ``/plots/budgets.svg``)
and the rows they show, which the JSON API (coordinator.web.routes.api) serves too. Operators only: 403 for the
other roles."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from sqlalchemy import select

from coordinator.storage import RoundRow
from coordinator.web.context import WebContext, web
from coordinator.web.plots import svg_of

__all__ = ["router", "budget_rows", "round_rows", "fleet"]

router = APIRouter()


def budget_rows(ctx: WebContext) -> list[dict[str, Any]]:
    """The privacy budget per site and category (coordinator.reports.budget_report), as JSON-ready dicts."""
    from coordinator.ledger import PrivacyLedger
    from coordinator.registry import SiteRegistry
    from coordinator.reports import budget_report

    config, store = ctx.config, ctx.store
    ledger = PrivacyLedger(store, target_delta=config.target_delta, accountant=config.accountant,
                           max_pending=config.pending_rounds_cap())
    rows = budget_report(config, SiteRegistry(store), ledger, config.accountant)
    return [{"site_id": r.site_id, "category": r.category.value, "budget": r.budget, "spent": r.spent,
             "remaining": r.remaining, "rounds_left": r.rounds_left, "halted": r.halted,
             "noise_multiplier": r.z_calibrated, "sampling_rate": r.q_recorded,
             "cohorts_active": r.cohorts_active, "cohorts_retired": r.cohorts_retired,
             "most_spent": r.most_spent} for r in rows]


def round_rows(ctx: WebContext) -> list[dict[str, Any]]:
    """Every round, newest first, as JSON-ready dicts (times ISO 8601 UTC with ``Z``, model hashes cut to 12)."""
    with ctx.store.session() as s:
        rows = list(s.scalars(select(RoundRow).order_by(RoundRow.round.desc())))
    return [{"round": r.round, "status": r.status, "privacy": r.privacy, "selected": len(json.loads(
        r.selected_json or "[]")), "accepted": r.num_accepted, "opened_at": r.opened_at.isoformat(
        timespec="seconds") + "Z", "closed_at": r.closed_at.isoformat(timespec="seconds") + "Z"
        if r.closed_at else None, "base_model": r.base_model_hash[:12], "new_model": (r.new_model_hash or "")[:12],
        "detail": r.detail} for r in rows]


def fleet(ctx: WebContext, silent_hours: float) -> list[dict[str, Any]]:
    """The gateways' health rows (coordinator.fleet.fleet_rows); sites not heard from in ``silent_hours`` flagged.

    Raises:
        HTTPException: 422 when ``silent_hours`` is not a positive finite number.
    """
    from coordinator.fleet import fleet_rows
    from coordinator.registry import SiteRegistry

    if not (silent_hours > 0 and math.isfinite(silent_hours)):
        raise HTTPException(status_code=422, detail="silent_hours must be a positive number of hours")
    return [row.to_json() for row in fleet_rows(ctx.store, SiteRegistry(ctx.store),
                                                 now=ctx.clock() if ctx.clock else None,
                                                 silent_after_s=silent_hours * 3600)]


@router.get("/operator/budgets", response_class=HTMLResponse)
def budgets_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """The privacy budget burn-down per site and category (plot and table)."""
    ws = ctx.need(request, operator=True)
    return ctx.page(request, "budgets.html", ws, rows=budget_rows(ctx), accountant=ctx.config.accountant,
                    delta=ctx.config.target_delta)


@router.get("/plots/budgets.svg")
def budgets_plot(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """The burn-down plot (coordinator.reports.burn_down_figure) as SVG."""
    ctx.need(request, operator=True)
    from coordinator.ledger import PrivacyLedger
    from coordinator.reports import burn_down_figure

    config = ctx.config
    ledger = PrivacyLedger(ctx.store, target_delta=config.target_delta, accountant=config.accountant,
                           max_pending=config.pending_rounds_cap())
    return Response(svg_of(burn_down_figure(config, ledger, config.accountant)), media_type="image/svg+xml")


@router.get("/operator/rounds", response_class=HTMLResponse)
def rounds_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """The round history."""
    ws = ctx.need(request, operator=True)
    return ctx.page(request, "rounds.html", ws, rounds=round_rows(ctx))


@router.get("/operator/fleet", response_class=HTMLResponse)
def fleet_page(request: Request, silent_hours: float = 1.0, ctx: WebContext = Depends(web)) -> Response:
    """The gateways' health; ``silent_hours`` flags sites not heard from."""
    ws = ctx.need(request, operator=True)
    return ctx.page(request, "fleet.html", ws, rows=fleet(ctx, silent_hours), silent_hours=silent_hours)
