"""The Camtrap DP download (``GET /export/camtrap-dp.zip``): the package as the logged-in role may see it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from coordinator.web.context import WebContext, web

__all__ = ["router"]

router = APIRouter()


@router.get("/export/camtrap-dp.zip")
def export_zip(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """A zip of the Camtrap DP package of what the role sees (coordinator.web.formats.export_camtrap_dp_zip)."""
    ws = ctx.need(request)
    from coordinator.web.formats import export_camtrap_dp_zip

    data = export_camtrap_dp_zip(ctx.viewer(ws))
    name = f"{ctx.config.federation_id}-camtrap-dp-{ws.account.role.value}.zip"
    return Response(data, media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})
