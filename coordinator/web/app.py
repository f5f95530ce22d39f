"""``wildfed-coordinator serve``: the rangers' web view, a FastAPI app with server-rendered pages (docs/web.md).

Nothing is fetched from the internet at run time: pages are Jinja2 templates, the map is an SVG drawn here from the
deployments' coordinates (:func:`map_svg`), plots are SVGs drawn by matplotlib, and the one stylesheet is served
from ``/static``. There is no JavaScript.

Routes (every one but ``/login``, ``/healthz`` and ``/static`` needs a session; ``/operator`` and ``/api/operator``
need the operator role; what each role sees inside a page is decided by :class:`coordinator.web.views.Viewer`):

=============================== ============================================================================
 ``GET /login``, ``POST /login``  form login (CSRF double-submit cookie, throttled per (account, address) and
                                  more loosely per address: coordinator.web.auth)
 ``POST /logout``                 ends the session (CSRF token)
 ``GET /map``                     SVG map of deployments, table of coordinates with the ``fuzzed`` flag
 ``GET /detections``              detection list; filters site, species, category, date_from, date_to,
                                  min_confidence; paged by limit and offset
 ``GET /detections/{id}``         one record: image (when held) with its boxes, top species per box; ``id`` is
                                  the row id for rangers and operators, ``SITE~MEDIA`` for partners and the
                                  public (:meth:`coordinator.web.views.Viewer.record_ref`)
 ``GET /detections/{id}/image``   the image; re-encoded from its pixels alone (no metadata of any kind) for
                                  roles without exact locations (:func:`coordinator.web.media.strip_metadata`)
 ``GET /species``                 records per species and month (plot and table)
 ``GET /sites``                   per-site summary
 ``GET /operator/budgets``        privacy budget burn-down per site and category (plot and table)
 ``GET /operator/rounds``         round history
 ``GET /operator/fleet``          the gateways' health (coordinator.fleet): presence, last seen, versions, model,
                                  backlogs, disk free, last error; ``silent_hours`` flags sites not heard from
 ``GET /export/camtrap-dp.zip``   Camtrap DP package as this role may see it
 ``GET /api/...``                 JSON of the same: deployments, detections, detections/{id}, species-counts,
                                  sites, operator/budgets, operator/rounds, operator/fleet
=============================== ============================================================================

Security headers on every response: a Content-Security-Policy that allows only this origin
(``default-src 'self'``, no scripts at all, ``frame-ancestors 'none'``), ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: same-origin`` (nothing sent to other sites); pages behind a login are ``Cache-Control: no-store``. POST requests must carry the
right CSRF token and, when the browser sends an ``Origin`` header, come from this origin.
"""

from __future__ import annotations

import datetime as _dt
import hmac
import io
import json
import logging
import math
import secrets
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from argon2 import PasswordHasher
from fastapi import FastAPI, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import select
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import ConfigError, DatasetError

from coordinator.config import CoordinatorConfig
from coordinator.fleet import format_age, format_gib
from coordinator.storage import RoundRow, Store
from coordinator.web.auth import AccountStore, LoginThrottle
from coordinator.web.deployments import species_table_categories
from coordinator.web.location_privacy import EARTH_RADIUS_M, load_or_create_secret
from coordinator.web.sessions import SessionManager, WebSession
from coordinator.web.views import DetectionFilter, Viewer, policy_from_config

__all__ = ["create_app", "map_svg", "SESSION_COOKIE", "LOGIN_CSRF_COOKIE"]

log = logging.getLogger(__name__)

SESSION_COOKIE = "wildfed_session"
LOGIN_CSRF_COOKIE = "wildfed_login_csrf"
_HERE = Path(__file__).parent
_CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'none'; object-src 'none'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


class _NeedLogin(Exception):
    """Raised by a page that needs a session when there is none."""


# ---- the offline map -----------------------------------------------------------------------------------------------
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


# ---- plots ---------------------------------------------------------------------------------------------------------
def _svg_of(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    return buf.getvalue()


def species_plot_svg(counts: dict[str, dict[str, int]], *, top: int = 8) -> bytes:
    """SVG line plot of records per month for the ``top`` species with most records (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    months = sorted({m for per in counts.values() for m in per})
    ranked = sorted(counts, key=lambda s: -sum(counts[s].values()))[:top]
    for name in ranked:
        ax.plot(range(len(months)), [counts[name].get(m, 0) for m in months], marker="o", markersize=3, label=name)
    ax.set_xticks(range(len(months)), months, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("records (top species)")
    ax.set_xlabel("month of capture")
    ax.grid(alpha=0.3)
    if ranked:
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no records with a species yet", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return _svg_of(fig)


# ---- the app -------------------------------------------------------------------------------------------------------
def create_app(config: CoordinatorConfig, *, store: Store | None = None, hasher: PasswordHasher | None = None,
               throttle: LoginThrottle | None = None, clock: Callable[[], _dt.datetime] | None = None) -> FastAPI:
    """Build the web view of a coordinator (routes in the module docstring).

    Args:
        config: a resolved coordinator config (its ``web`` block, species table, budgets, data folder).
        store: an open store (default: one built from the config; closed when the app shuts down).
        hasher: Argon2 hasher (tests pass cheap parameters). throttle: login throttle (default from config).
        clock: naive-UTC now for sessions (tests).

    Raises:
        ConfigError: the location secret is unreadable or has loose permissions, or the database is unreachable.
    """
    own_store = store is None
    store = store or Store(config.database_url or "", config.data_dir)
    secret_path = config.web.location_secret_path or (Path(config.data_dir) / "location-secret")
    secret = load_or_create_secret(secret_path)
    policy = policy_from_config(config)
    category_of = species_table_categories(config.species)
    class_names = {e.class_index: e.scientific_name for e in config.species or []}
    accounts = AccountStore(store, hasher=hasher)
    sessions = SessionManager(store, ttl_s=config.web.session_ttl_s, idle_s=config.web.session_idle_s,
                              **({"clock": clock} if clock else {}))
    throttle = throttle or LoginThrottle(max_failures=config.web.login_max_failures,
                                         max_failures_per_address=config.web.login_max_failures_per_address,
                                         window_s=config.web.login_window_s)
    templates = Jinja2Templates(directory=str(_HERE / "templates"))
    templates.env.filters["fmt"] = lambda v, spec=".3f": "–" if v is None else format(v, spec)
    templates.env.filters["age"] = format_age
    templates.env.filters["gib"] = format_gib
    templates.env.globals["federation_id"] = config.federation_id

    app = FastAPI(title=f"WildFed {config.federation_id}", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static")
    app.state.store, app.state.accounts, app.state.sessions, app.state.throttle = store, accounts, sessions, throttle

    if own_store:
        @app.on_event("shutdown")
        def _close() -> None:  # pragma: no cover - process exit
            store.dispose()

    def cookie_kwargs() -> dict[str, Any]:
        return {"httponly": True, "samesite": "strict", "secure": config.web.cookie_secure, "path": "/"}

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", _CSP)
        response.headers["X-Content-Type-Options"] = "nosniff"
        # same-origin, not no-referrer: under no-referrer Chromium sends "Origin: null" on same-site form posts
        # (Fetch standard), which the CSRF origin check must refuse; other sites still get no referrer
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        if not request.url.path.startswith("/static"):
            response.headers["Cache-Control"] = "no-store"
        return response

    # ---- helpers -----------------------------------------------------------------------------------------------
    def current(request: Request) -> WebSession | None:
        return sessions.get(request.cookies.get(SESSION_COOKIE))

    def need(request: Request, *, operator: bool = False) -> WebSession:
        ws = current(request)
        if ws is None:
            raise _NeedLogin()
        if operator and not ws.account.role.sees_budgets:
            raise HTTPException(status_code=403, detail="this page is for operators")
        return ws

    def viewer(ws: WebSession) -> Viewer:
        return Viewer(store, ws.account.role, policy=policy, secret=secret, category_of=category_of,
                      class_names=class_names)

    def page(request: Request, name: str, ws: WebSession | None, status_code: int = 200, **ctx: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, name, {"ws": ws, "role": ws.account.role.value if ws else None,
                                                          "operator": bool(ws and ws.account.role.sees_budgets),
                                                          **ctx}, status_code=status_code)

    def same_origin(request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is None:  # not sent by non-browser clients; SameSite=Strict and the token still apply
            return True
        if origin == "null":  # an opaque origin (sandboxed frame, data: URL, cross-site redirect): never ours
            return False
        parsed = urllib.parse.urlsplit(origin)
        return parsed.netloc == request.headers.get("host", "")

    def check_csrf(request: Request, ws: WebSession, token: str) -> None:
        if not same_origin(request) or not token or not hmac.compare_digest(token, ws.csrf_token):
            raise HTTPException(status_code=403, detail="CSRF check failed: reload the page and submit the form "
                                                        "again")

    def client_address(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    def filters(request: Request, ws: WebSession) -> DetectionFilter:
        q = request.query_params
        if q.get("category") and not ws.account.role.sees_exact_locations:
            # which records are of a threatened species is what the fuzzing hides (docs/location-privacy.md)
            raise HTTPException(status_code=422, detail="category: filtering by IUCN category is for rangers and "
                                                        "operators (fix: filter by species instead)")
        try:
            return DetectionFilter.parse(site=q.get("site"), species=q.get("species"), category=q.get("category"),
                                         date_from=q.get("date_from"), date_to=q.get("date_to"),
                                         min_confidence=q.get("min_confidence"), limit=q.get("limit"),
                                         offset=q.get("offset"))
        except ConfigError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None  # "field: message (fix: ...)"

    @app.exception_handler(_NeedLogin)
    async def _to_login(request: Request, exc: _NeedLogin) -> Response:
        if request.url.path.startswith(("/api/", "/export/")):
            return JSONResponse({"detail": "log in first"}, status_code=401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse("/login?" + urllib.parse.urlencode({"next": target}), status_code=303)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith(("/api/", "/export/")):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        ws = current(request)
        return page(request, "error.html", ws, status_code=exc.status_code, status=exc.status_code,
                    message=exc.detail)

    def safe_next(target: str | None) -> str:
        """Only local paths (no scheme, no host, no '//' or backslash tricks) are followed after login."""
        if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
            return "/map"
        return target

    # ---- login / logout ----------------------------------------------------------------------------------------
    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "/map") -> Response:
        token = secrets.token_urlsafe(32)
        response = page(request, "login.html", None, csrf_token=token, next=safe_next(next), error=None, username="")
        response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, **cookie_kwargs())
        return response

    @app.post("/login")
    def login(request: Request, username: str = Form(""), password: str = Form(""), csrf_token: str = Form(""),
              next: str = Form("/map")) -> Response:
        cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        if not same_origin(request) or not cookie or not csrf_token or not hmac.compare_digest(cookie, csrf_token):
            raise HTTPException(status_code=403, detail="CSRF check failed: reload the login page and try again")
        address = client_address(request)
        if not throttle.allowed(username, address):  # per (account, address), and a looser ceiling per address
            log.warning("web: login throttled for %r from %s", username, address)
            return page(request, "login.html", None, status_code=429, csrf_token=cookie, next=safe_next(next),
                        username=username, error=f"Too many failed logins: wait {int(throttle.window_s // 60)} minutes and try again.")
        account = accounts.authenticate(username.strip().lower(), password)
        if account is None:
            throttle.failed(username, address)
            log.info("web: failed login for %r from %s", username, address)
            return page(request, "login.html", None, status_code=401, csrf_token=cookie, next=safe_next(next),
                        username=username, error="Wrong user name or password, or the account is disabled.")
        throttle.succeeded(username, address)
        token, _ = sessions.create(account)
        log.info("web: %s (%s) logged in from %s", account.username, account.role.value, address)
        response = RedirectResponse(safe_next(next), status_code=303)
        response.set_cookie(SESSION_COOKIE, token, max_age=int(config.web.session_ttl_s), **cookie_kwargs())
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/")
        return response

    @app.post("/logout")
    def logout(request: Request, csrf_token: str = Form("")) -> Response:
        ws = need(request)
        check_csrf(request, ws, csrf_token)
        sessions.revoke(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # ---- pages -------------------------------------------------------------------------------------------------
    @app.get("/")
    def index(request: Request) -> Response:
        need(request)
        return RedirectResponse("/map", status_code=303)

    @app.get("/map", response_class=HTMLResponse)
    def map_page(request: Request) -> Response:
        ws = need(request)
        deployments = viewer(ws).deployments()
        return page(request, "map.html", ws, deployments=deployments, svg=map_svg(deployments), policy=policy,
                    any_fuzzed=any(d["fuzzed"] for d in deployments))

    @app.get("/detections", response_class=HTMLResponse)
    def detections_page(request: Request) -> Response:
        ws = need(request)
        f = filters(request, ws)
        v = viewer(ws)
        items, total = v.detections(f)
        q = dict(request.query_params)
        q.pop("offset", None)

        def link(offset: int) -> str:
            return "/detections?" + urllib.parse.urlencode({**q, "offset": offset})

        return page(request, "detections.html", ws, items=items, total=total, f=f, sites=v.site_ids(),
                    species=v.species_names(),
                    categories=[c.value for c in _categories()] if ws.account.role.sees_exact_locations else [],
                    prev=link(max(0, f.offset - f.limit)) if f.offset > 0 else None,
                    next=link(f.offset + f.limit) if f.offset + f.limit < total else None)

    @app.get("/detections/{detection_id}", response_class=HTMLResponse)
    def detection_page(request: Request, detection_id: str) -> Response:
        ws = need(request)
        item = viewer(ws).detection(detection_id)
        if item is None:
            raise HTTPException(status_code=404, detail=f"no detection {detection_id}")
        return page(request, "detection.html", ws, d=item, boxes=_boxes(item))

    @app.get("/detections/{detection_id}/image")
    def detection_image(request: Request, detection_id: str) -> Response:
        ws = need(request)
        v = viewer(ws)
        digest = v.image_sha256(detection_id)
        if digest is None:
            raise HTTPException(status_code=404, detail="the coordinator holds no image for this record (gateways "
                                                        "keep their images)")
        from coordinator.web.media import image_info, strip_metadata

        data = store.get_blob(digest)
        if not ws.account.role.sees_exact_locations:
            # an allow-list: the pixels (upright, sRGB) and nothing else of the file (coordinator.web.media)
            try:
                data = strip_metadata(data)
            except DatasetError as exc:  # pixels that cannot be re-encoded: a clean refusal, never a 500
                raise HTTPException(status_code=415, detail=f"this image cannot be shown without its metadata: "
                                                            f"{exc}") from None
        _, _, mime = image_info(data)
        return Response(data, media_type=mime)

    @app.get("/species", response_class=HTMLResponse)
    def species_page(request: Request) -> Response:
        ws = need(request)
        counts = viewer(ws).species_counts()
        months = sorted({m for per in counts.values() for m in per})
        return page(request, "species.html", ws, counts=counts, months=months,
                    categories={s: category_of(s).value for s in counts}
                    if ws.account.role.sees_exact_locations else None)

    @app.get("/plots/species.svg")
    def species_plot(request: Request) -> Response:
        ws = need(request)
        return Response(species_plot_svg(viewer(ws).species_counts()), media_type="image/svg+xml")

    @app.get("/sites", response_class=HTMLResponse)
    def sites_page(request: Request) -> Response:
        ws = need(request)
        return page(request, "sites.html", ws, sites=viewer(ws).site_summaries())

    # ---- operator ----------------------------------------------------------------------------------------------
    def budget_rows() -> list[dict[str, Any]]:
        from coordinator.ledger import PrivacyLedger
        from coordinator.registry import SiteRegistry
        from coordinator.reports import budget_report

        ledger = PrivacyLedger(store, target_delta=config.target_delta, accountant=config.accountant)
        rows = budget_report(config, SiteRegistry(store), ledger, config.accountant)
        return [{"site_id": r.site_id, "category": r.category.value, "budget": r.budget, "spent": r.spent,
                 "remaining": r.remaining, "rounds_left": r.rounds_left, "halted": r.halted,
                 "noise_multiplier": r.z_calibrated, "sampling_rate": r.q_recorded,
                 "cohorts_active": r.cohorts_active, "cohorts_retired": r.cohorts_retired} for r in rows]

    def round_rows() -> list[dict[str, Any]]:
        with store.session() as s:
            rows = list(s.scalars(select(RoundRow).order_by(RoundRow.round.desc())))
        return [{"round": r.round, "status": r.status, "privacy": r.privacy, "selected": len(json.loads(
            r.selected_json or "[]")), "accepted": r.num_accepted, "opened_at": r.opened_at.isoformat(
            timespec="seconds") + "Z", "closed_at": r.closed_at.isoformat(timespec="seconds") + "Z"
            if r.closed_at else None, "base_model": r.base_model_hash[:12], "new_model": (r.new_model_hash or "")[:12],
            "detail": r.detail} for r in rows]

    def fleet(silent_hours: float) -> list[dict[str, Any]]:
        from coordinator.fleet import fleet_rows
        from coordinator.registry import SiteRegistry

        if not (silent_hours > 0 and math.isfinite(silent_hours)):
            raise HTTPException(status_code=422, detail="silent_hours must be a positive number of hours")
        return [row.to_json() for row in fleet_rows(store, SiteRegistry(store), now=clock() if clock else None,
                                                     silent_after_s=silent_hours * 3600)]

    @app.get("/operator/budgets", response_class=HTMLResponse)
    def budgets_page(request: Request) -> Response:
        ws = need(request, operator=True)
        return page(request, "budgets.html", ws, rows=budget_rows(), accountant=config.accountant,
                    delta=config.target_delta)

    @app.get("/plots/budgets.svg")
    def budgets_plot(request: Request) -> Response:
        need(request, operator=True)
        from coordinator.ledger import PrivacyLedger
        from coordinator.reports import burn_down_figure

        ledger = PrivacyLedger(store, target_delta=config.target_delta, accountant=config.accountant)
        return Response(_svg_of(burn_down_figure(config, ledger, config.accountant)), media_type="image/svg+xml")

    @app.get("/operator/rounds", response_class=HTMLResponse)
    def rounds_page(request: Request) -> Response:
        ws = need(request, operator=True)
        return page(request, "rounds.html", ws, rounds=round_rows())

    @app.get("/operator/fleet", response_class=HTMLResponse)
    def fleet_page(request: Request, silent_hours: float = 1.0) -> Response:
        ws = need(request, operator=True)
        return page(request, "fleet.html", ws, rows=fleet(silent_hours), silent_hours=silent_hours)

    # ---- export and JSON API -----------------------------------------------------------------------------------
    @app.get("/export/camtrap-dp.zip")
    def export_zip(request: Request) -> Response:
        ws = need(request)
        from coordinator.web.formats import export_camtrap_dp_zip

        data = export_camtrap_dp_zip(viewer(ws))
        name = f"{config.federation_id}-camtrap-dp-{ws.account.role.value}.zip"
        return Response(data, media_type="application/zip",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @app.get("/api/me")
    def api_me(request: Request) -> dict[str, Any]:
        ws = need(request)
        return {"username": ws.account.username, "role": ws.account.role.value}

    @app.get("/api/deployments")
    def api_deployments(request: Request) -> list[dict[str, Any]]:
        return viewer(need(request)).deployments()

    @app.get("/api/detections")
    def api_detections(request: Request) -> dict[str, Any]:
        ws = need(request)
        items, total = viewer(ws).detections(filters(request, ws))
        return {"total": total, "items": items}

    @app.get("/api/detections/{detection_id}")
    def api_detection(request: Request, detection_id: str) -> dict[str, Any]:
        item = viewer(need(request)).detection(detection_id)
        if item is None:
            raise HTTPException(status_code=404, detail=f"no detection {detection_id}")
        return item

    @app.get("/api/species-counts")
    def api_species(request: Request) -> dict[str, dict[str, int]]:
        return viewer(need(request)).species_counts()

    @app.get("/api/sites")
    def api_sites(request: Request) -> list[dict[str, Any]]:
        return viewer(need(request)).site_summaries()

    @app.get("/api/operator/budgets")
    def api_budgets(request: Request) -> list[dict[str, Any]]:
        need(request, operator=True)
        return budget_rows()

    @app.get("/api/operator/rounds")
    def api_rounds(request: Request) -> list[dict[str, Any]]:
        need(request, operator=True)
        return round_rows()

    @app.get("/api/operator/fleet")
    def api_fleet(request: Request, silent_hours: float = 1.0) -> list[dict[str, Any]]:
        need(request, operator=True)
        return fleet(silent_hours)

    return app


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


def serve(config: CoordinatorConfig, *, host: str | None = None, port: int | None = None) -> None:  # pragma: no cover
    """Run the web view with uvicorn until interrupted (TLS when the config names a certificate and key)."""
    import uvicorn

    app = create_app(config)
    ssl = {}
    if config.web.tls_cert_file is not None:
        ssl = {"ssl_certfile": str(config.web.tls_cert_file), "ssl_keyfile": str(config.web.tls_key_file)}
    uvicorn.run(app, host=host or config.web.host, port=port or config.web.port, log_level="info",
                proxy_headers=False, **ssl)
