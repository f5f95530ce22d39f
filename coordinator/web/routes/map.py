"""The map page (``GET /``, ``GET /map``) and the offline SVG map it draws (:func:`map_svg`)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from coordinator.web.context import WebContext, web
from coordinator.web.location_privacy import EARTH_RADIUS_M

__all__ = ["router", "map_svg"]

router = APIRouter()


@router.get("/")
def index(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """Logged in: to the map (else to the login page)."""
    ctx.need(request)
    return RedirectResponse("/map", status_code=303)


@router.get("/map", response_class=HTMLResponse)
def map_page(request: Request, ctx: WebContext = Depends(web)) -> Response:
    """The SVG map of the deployments the role sees, and their coordinates with the ``fuzzed`` flag."""
    ws = ctx.need(request)
    deployments = ctx.viewer(ws).deployments()
    return ctx.page(request, "map.html", ws, deployments=deployments, svg=map_svg(deployments), policy=ctx.policy,
                    any_fuzzed=any(d["fuzzed"] for d in deployments))


def map_svg(deployments: list[dict[str, Any]], *, width: int = 760, height: int = 460, pad: int = 36) -> str:
    """An SVG map of deployments, drawn without tiles: an equirectangular projection scaled by the cosine of the
    mean latitude (so distances are right to within a few percent over a reserve), a 1-2-5 scale bar in metres,
    a graticule, and one marker per deployment. Fuzzed markers are hollow with a dashed circle of the displacement
    radius around them (the true point lies inside it). Every marker carries ``data-site``, ``data-deployment``,
    ``data-lat``, ``data-lon`` and ``data-fuzzed`` attributes and a ``<title>``.

    Args:
        deployments: items of :meth:`coordinator.web.views.Viewer.deployments` (coordinates in decimal degrees).
        width, height, pad: pixels.
    """
    from markupsafe import escape

    pts = [d for d in deployments if d.get("latitude") is not None]
    if not pts:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" class="map" viewBox="0 0 {width} {height}" role="img">'
                f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no deployments with coordinates'
                '</text></svg>')
    lats = [float(d["latitude"]) for d in pts]
    lons = [float(d["longitude"]) for d in pts]
    lat0 = math.radians(sum(lats) / len(lats))
    kx = math.cos(lat0) * EARTH_RADIUS_M * math.pi / 180.0  # metres per degree of longitude here
    ky = EARTH_RADIUS_M * math.pi / 180.0
    xs = [lon * kx for lon in lons]
    ys = [lat * ky for lat in lats]
    # the frame holds every marker and its dashed radius (a fuzzed marker may sit up to one radius off the truth)
    margin = max([float(d.get("radius_m") or 0.0) for d in pts if d.get("fuzzed")] + [0.0])
    span_x = max(max(xs) - min(xs) + 2 * margin, 2000.0)
    span_y = max(max(ys) - min(ys) + 2 * margin, 2000.0)
    scale = min((width - 2 * pad) / span_x, (height - 2 * pad) / span_y)  # pixels per metre
    cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2

    def px(x: float, y: float) -> tuple[float, float]:
        return width / 2 + (x - cx) * scale, height / 2 - (y - cy) * scale

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="map" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="map of {len(pts)} deployments">',
             f'<rect x="0" y="0" width="{width}" height="{height}" class="map-bg"/>']
    # graticule: about 6 lines each way at a round step in degrees
    lat_min, lat_max = (cy - (height / 2) / scale) / ky, (cy + (height / 2) / scale) / ky
    lon_min, lon_max = (cx - (width / 2) / scale) / kx, (cx + (width / 2) / scale) / kx
    for lo, hi, horizontal in ((lat_min, lat_max, True), (lon_min, lon_max, False)):
        step = _nice_step((hi - lo) / 6)
        v = math.ceil(lo / step) * step
        last_label = -1e9  # pixel position of the last longitude label: labels closer than 60 px are skipped
        while v <= hi:
            if horizontal:
                _, yy = px(cx, v * ky)
                parts.append(f'<line x1="0" y1="{yy:.1f}" x2="{width}" y2="{yy:.1f}" class="grid"/>')
                if 14 < yy < height - 18:  # keep clear of the longitude labels along the bottom
                    parts.append(f'<text x="4" y="{yy - 2:.1f}" class="grid-label">{v:.6g}°</text>')
            else:
                xx, _ = px(v * kx, cy)
                parts.append(f'<line x1="{xx:.1f}" y1="0" x2="{xx:.1f}" y2="{height}" class="grid"/>')
                if 40 < xx < width - 60 and xx - last_label >= 60:  # clear of the edges and of the last label
                    last_label = xx
                    parts.append(f'<text x="{xx + 2:.1f}" y="{height - 4}" class="grid-label">{v:.6g}°</text>')
            v += step
    for d, x, y in zip(pts, xs, ys):
        X, Y = px(x, y)
        fuzzed = bool(d.get("fuzzed"))
        title = escape(f'{d.get("name")} ({float(d["latitude"]):.5f}, {float(d["longitude"]):.5f})'
                       + (" fuzzed" if fuzzed else ""))
        attrs = (f'data-site="{escape(d.get("site_id") or "")}" data-deployment="{escape(d["deployment_id"])}" '
                 f'data-lat="{float(d["latitude"]):.6f}" '
                 f'data-lon="{float(d["longitude"]):.6f}" data-fuzzed="{str(fuzzed).lower()}"')
        if fuzzed and d.get("radius_m") and float(d["radius_m"]) * scale > 8:  # drawn when it shows beyond the marker
            parts.append(f'<circle cx="{X:.1f}" cy="{Y:.1f}" r="{float(d["radius_m"]) * scale:.1f}" '
                         'class="fuzz-radius"/>')
        parts.append(f'<circle cx="{X:.1f}" cy="{Y:.1f}" r="6" class="marker{" fuzzed" if fuzzed else ""}" '
                     f'{attrs}><title>{title}</title></circle>')
    # scale bar
    target = (width - 2 * pad) / 4 / scale
    bar_m = _nice_step(target)
    bar_px = bar_m * scale
    label = f"{bar_m / 1000:g} km" if bar_m >= 1000 else f"{bar_m:g} m"
    parts.append(f'<line x1="{pad}" y1="{pad / 2}" x2="{pad + bar_px:.1f}" y2="{pad / 2}" class="scale"/>'
                 f'<text x="{pad}" y="{pad / 2 - 4}" class="scale-label">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _nice_step(x: float) -> float:
    """The 1-2-5 number nearest below ``x`` (> 0)."""
    if not x > 0:
        return 1.0
    exp = math.floor(math.log10(x))
    base = 10.0 ** exp
    for m in (5, 2, 1):
        if m * base <= x:
            return m * base
    return base
