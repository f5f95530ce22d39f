"""The JSON API (``GET /api/...``): what the pages show, as JSON, for the same roles (401 without a session)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request

from coordinator.web.context import WebContext, web
from coordinator.web.routes.operator import budget_rows, fleet, round_rows

__all__ = ["router"]

router = APIRouter(prefix="/api")


@router.get("/me")
def api_me(request: Request, ctx: WebContext = Depends(web)) -> dict[str, Any]:
    """The logged-in user name and role."""
    ws = ctx.need(request)
    return {"username": ws.account.username, "role": ws.account.role.value}


@router.get("/deployments")
def api_deployments(request: Request, ctx: WebContext = Depends(web)) -> list[dict[str, Any]]:
    """The deployments the role sees (coordinates as shown on the map)."""
    return ctx.viewer(ctx.need(request)).deployments()


@router.get("/detections")
def api_detections(request: Request, ctx: WebContext = Depends(web)) -> dict[str, Any]:
    """``{"total": n, "items": [...]}``: one page of the records the role sees, filtered as ``/detections``."""
    ws = ctx.need(request)
    items, total = ctx.viewer(ws).detections(ctx.filters(request, ws))
    return {"total": total, "items": items}


@router.get("/detections/{detection_id}")
def api_detection(request: Request, detection_id: str, ctx: WebContext = Depends(web)) -> dict[str, Any]:
    """One record; 404 when the role sees no such record."""
    item = ctx.viewer(ctx.need(request)).detection(detection_id)
    if item is None:
        raise HTTPException(status_code=404, detail=f"no detection {detection_id}")
    return item


@router.get("/species-counts")
def api_species(request: Request, ctx: WebContext = Depends(web)) -> dict[str, dict[str, int]]:
    """``{species: {month: records}}`` as the role sees them."""
    return ctx.viewer(ctx.need(request)).species_counts()


@router.get("/sites")
def api_sites(request: Request, ctx: WebContext = Depends(web)) -> list[dict[str, Any]]:
    """The per-site summaries the role sees."""
    return ctx.viewer(ctx.need(request)).site_summaries()


@router.get("/operator/budgets")
def api_budgets(request: Request, ctx: WebContext = Depends(web)) -> list[dict[str, Any]]:
    """The privacy budget rows (operators only)."""
    ctx.need(request, operator=True)
    return budget_rows(ctx)


@router.get("/operator/rounds")
def api_rounds(request: Request, ctx: WebContext = Depends(web)) -> list[dict[str, Any]]:
    """The round history (operators only)."""
    ctx.need(request, operator=True)
    return round_rows(ctx)


@router.get("/operator/fleet")
def api_fleet(request: Request, silent_hours: float = 1.0, ctx: WebContext = Depends(web)) -> list[dict[str, Any]]:
    """The gateways' health rows (operators only)."""
    ctx.need(request, operator=True)
    return fleet(ctx, silent_hours)
