"""The per-site summary page (``GET /sites``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from coordinator.web.context import WebContext, web

__all__ = ["router"]

router = APIRouter()


@router.get("/sites", response_class=HTMLResponse)
def sites_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """One row per site the role sees (coordinator.web.views.Viewer.site_summaries)."""
    ws = ctx.need(request)
    return ctx.page(request, "sites.html", ws, sites=ctx.viewer(ws).site_summaries())
