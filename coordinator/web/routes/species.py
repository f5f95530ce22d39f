"""The species page (``GET /species``: records per species and month) and its plot (``GET /plots/species.svg``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from coordinator.web.context import WebContext, web
from coordinator.web.plots import species_plot_svg

__all__ = ["router"]

router = APIRouter()


@router.get("/species", response_class=HTMLResponse)
def species_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """Records per species and month as the role sees them; IUCN categories for roles with exact locations."""
    ws = ctx.need(request)
    counts = ctx.viewer(ws).species_counts()
    months = sorted({m for per in counts.values() for m in per})
    return ctx.page(request, "species.html", ws, counts=counts, months=months,
                    categories={s: ctx.category_of(s).value for s in counts}
                    if ws.account.role.sees_exact_locations else None)


@router.get("/plots/species.svg")
def species_plot(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """The SVG plot of records per month for the most recorded species."""
    ws = ctx.need(request)
    return Response(species_plot_svg(ctx.viewer(ws).species_counts()), media_type="image/svg+xml")
