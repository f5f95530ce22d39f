"""The detection pages: the filtered list (``GET /detections``), one record (``GET /detections/{id}``) and its
image (``GET /detections/{id}/image``, without metadata for roles without exact locations)."""

from __future__ import annotations

import urllib.parse
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from shared.errors import DatasetError

from coordinator.web.context import WebContext, web

__all__ = ["router"]

router = APIRouter()


@router.get("/detections", response_class=HTMLResponse)
def detections_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """One page of the records the role sees, filtered by the query string, with links to the pages around it."""
    ws = ctx.need(request)
    f = ctx.filters(request, ws)
    v = ctx.viewer(ws)
    items, total = v.detections(f)
    q = dict(request.query_params)
    q.pop("offset", None)

    def link(offset: int) -> str:
        return "/detections?" + urllib.parse.urlencode({**q, "offset": offset})

    return ctx.page(request, "detections.html", ws, items=items, total=total, f=f, sites=v.site_ids(),
                    species=v.species_names(),
                    categories=[c.value for c in _categories()] if ws.account.role.sees_exact_locations else [],
                    prev=link(max(0, f.offset - f.limit)) if f.offset > 0 else None,
                    next=link(f.offset + f.limit) if f.offset + f.limit < total else None)


@router.get("/detections/{detection_id}", response_class=HTMLResponse)
def detection_page(request: Request, detection_id: str, ctx: WebContext = Depends(web)) -> Response:
    """One record with its boxes; 404 when the role sees no such record."""
    ws = ctx.need(request)
    item = ctx.viewer(ws).detection(detection_id)
    if item is None:
        raise HTTPException(status_code=404, detail=f"no detection {detection_id}")
    return ctx.page(request, "detection.html", ws, d=item, boxes=_boxes(item))


@router.get("/detections/{detection_id}/image")
def detection_image(request: Request, detection_id: str, ctx: WebContext = Depends(web)) -> Response:
    """The record's image: as stored for rangers and operators, re-encoded from its pixels alone for the others;
    404 when none is held, 415 when it cannot be re-encoded."""
    ws = ctx.need(request)
    v = ctx.viewer(ws)
    digest = v.image_sha256(detection_id)
    if digest is None:
        raise HTTPException(status_code=404, detail="the coordinator holds no image for this record (gateways "
                                                    "keep their images)")
    from coordinator.web.media import image_info, strip_metadata

    data = ctx.store.get_blob(digest)
    if not ws.account.role.sees_exact_locations:
        # an allow-list: the pixels (upright, sRGB) and nothing else of the file (coordinator.web.media)
        try:
            data = strip_metadata(data)
        except DatasetError as exc:  # pixels that cannot be re-encoded: a clean refusal, never a 500
            raise HTTPException(status_code=415, detail=f"this image cannot be shown without its metadata: "
                                                        f"{exc}") from None
    _, _, mime = image_info(data)
    return Response(data, media_type=mime)


def _categories() -> list[Any]:
    from shared.iucn import IUCNCategory

    return list(IUCNCategory)


def _boxes(item: dict[str, Any]) -> list[dict[str, Any]]:
    """Boxes in the pixel frame of the record's image (``bbox`` is normalised ``[x_min, y_min, w, h]``)."""
    w, h = item.get("width") or 0, item.get("height") or 0
    out = []
    for i, d in enumerate(item.get("detections", [])):
        bx = d.get("bbox") or [0, 0, 0, 0]
        out.append({"n": i + 1, "x": bx[0] * w, "y": bx[1] * h, "w": bx[2] * w, "h": bx[3] * h, **d})
    return out
