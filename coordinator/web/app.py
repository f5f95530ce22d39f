"""``wildfed-coordinator serve``: the rangers' web view, a FastAPI app with server-rendered pages (docs/web.md).

Nothing is fetched from the internet at run time: pages are Jinja2 templates, the map is an SVG drawn here from the
deployments' coordinates (:func:`map_svg`), plots are SVGs drawn by matplotlib, and the one stylesheet is served
from ``/static``. There is no JavaScript.

This module builds the app (:func:`create_app`): the security headers, the error pages and the login redirect, and the
routers of coordinator.web.routes, one per page group (login, map, detections, species, sites, operator, export,
api). What the routes share (store, sessions, policy, templates) is one coordinator.web.context.WebContext.

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
import logging
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from argon2 import PasswordHasher
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.config import CoordinatorConfig
from coordinator.fleet import format_age, format_gib
from coordinator.storage import Store
from coordinator.web.auth import AccountStore, LoginThrottle
from coordinator.web.context import LOGIN_CSRF_COOKIE, SESSION_COOKIE, NeedLogin, WebContext
from coordinator.web.deployments import species_table_categories
from coordinator.web.location_privacy import load_or_create_secret
from coordinator.web.plots import species_plot_svg
from coordinator.web.routes import api, detections, export, login, operator, sites, species
from coordinator.web.routes import map as map_routes
from coordinator.web.routes.map import map_svg
from coordinator.web.sessions import SessionManager
from coordinator.web.views import policy_from_config

__all__ = ["create_app", "map_svg", "species_plot_svg", "SESSION_COOKIE", "LOGIN_CSRF_COOKIE"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'none'; object-src 'none'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_ROUTERS = (login.router, map_routes.router, detections.router, species.router, sites.router, operator.router,
            export.router, api.router)
"""Added in this order (no two share a path)."""


def create_app(config: CoordinatorConfig, *, store: Store | None = None, hasher: PasswordHasher | None = None,
               throttle: LoginThrottle | None = None, clock: Callable[[], _dt.datetime] | None = None) -> FastAPI:
    """Build the web view of a coordinator (routes in the module docstring, one router per page group under
    coordinator.web.routes; what they share is a :class:`~coordinator.web.context.WebContext` on ``app.state.web``).

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
    ctx = WebContext(config=config, store=store, secret=secret, policy=policy_from_config(config),
                     category_of=species_table_categories(config.species),
                     class_names={e.class_index: e.scientific_name for e in config.species or []},
                     accounts=accounts, sessions=sessions, throttle=throttle, templates=templates, clock=clock)

    app = FastAPI(title=f"WildFed {config.federation_id}", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static")
    app.state.store, app.state.accounts, app.state.sessions, app.state.throttle = store, accounts, sessions, throttle
    app.state.web = ctx

    if own_store:
        @app.on_event("shutdown")
        def _close() -> None:  # pragma: no cover - process exit
            store.dispose()

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

    @app.exception_handler(NeedLogin)
    async def _to_login(request: Request, exc: NeedLogin) -> Response:
        if request.url.path.startswith(("/api/", "/export/")):
            return JSONResponse({"detail": "log in first"}, status_code=401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse("/login?" + urllib.parse.urlencode({"next": target}), status_code=303)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith(("/api/", "/export/")):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        ws = ctx.current(request)
        return ctx.page(request, "error.html", ws, status_code=exc.status_code, status=exc.status_code,
                        message=exc.detail)

    for router in _ROUTERS:
        _add_routes(app, router)
    return app


def _add_routes(app: FastAPI, router: APIRouter) -> None:
    """Add ``router``'s routes to ``app`` one by one, as ``app.include_router`` did before FastAPI kept an included
    router as one opaque entry of ``app.routes``: each route stays an entry of ``app.routes`` (which
    tests/coordinator/test_web_app.py walks for the access matrix), whatever the FastAPI version."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"{route!r}: only path operations are expected in coordinator.web.routes")
        app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name,
                          response_class=route.response_class)


def serve(config: CoordinatorConfig, *, host: str | None = None, port: int | None = None) -> None:  # pragma: no cover
    """Run the web view with uvicorn until interrupted (TLS when the config names a certificate and key)."""
    import uvicorn

    app = create_app(config)
    ssl = {}
    if config.web.tls_cert_file is not None:
        ssl = {"ssl_certfile": str(config.web.tls_cert_file), "ssl_keyfile": str(config.web.tls_key_file)}
    uvicorn.run(app, host=host or config.web.host, port=port or config.web.port, log_level="info",
                proxy_headers=False, **ssl)
