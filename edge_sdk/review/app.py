"""``wildfed-edge review``: the rangers' review page on the gateway, a FastAPI app with server-rendered Jinja2 pages
(routes: :mod:`edge_sdk.review.login`, :mod:`edge_sdk.review.pages`).

Nothing is fetched from the internet and there is no JavaScript: every action is a plain HTML form. Responses carry
:func:`shared.web_auth.security_headers` (a Content-Security-Policy of this origin only, no scripts, no framing;
``nosniff``; ``Referrer-Policy: same-origin``; ``Cache-Control: no-store`` outside ``/static``, so photos and pages
are not kept in a shared station computer's browser cache).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.web_auth import LoginThrottle, SessionLifetime, security_headers

from edge_sdk.config import SiteConfig
from edge_sdk.field.site_package import SitePackage
from edge_sdk.field.store import FieldStore
from edge_sdk.review import login, pages
from edge_sdk.review.accounts import ReviewAccounts, utc_now
from edge_sdk.review.context import STATIC_DIR, NeedLogin, ReviewState, make_templates
from edge_sdk.review.query import PAGE_SIZE
from edge_sdk.site_paths import field_index_path, review_accounts_path

__all__ = ["create_app"]


def create_app(config: SiteConfig, *, hasher: Any | None = None, throttle: LoginThrottle | None = None,
               lifetime: SessionLifetime | None = None, clock: Callable[[], Any] = utc_now,
               secure_cookies: bool = False, page_size: int = PAGE_SIZE) -> FastAPI:
    """Build the review page of one site.

    Args:
        config: the site config (``dataset``: the package; the state folder holds ``field.sqlite`` and
            ``review.sqlite``, created when absent).
        hasher: an ``argon2.PasswordHasher`` (tests pass cheap parameters). throttle: the login throttle (default:
            5 failures per account and address, 50 per address, in 15 minutes). lifetime: session lifetimes
            (default 8 h, 1 h idle). clock: UTC now for sessions (tests).
        secure_cookies: mark cookies ``Secure`` (set when serving over TLS).
        page_size: events per list page.
    """
    state = ReviewState(
        config=config, store=FieldStore(field_index_path(config), gap_s=config.field.event_gap_s),
        package=SitePackage(config.dataset, site_id=config.site_id),
        accounts=ReviewAccounts(review_accounts_path(config), hasher=hasher, lifetime=lifetime, clock=clock),
        throttle=throttle or LoginThrottle(), templates=make_templates(config.site_id),
        secure_cookies=secure_cookies, page_size=page_size)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.close()

    app = FastAPI(title=f"WildFed review {config.site_id}", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.review = state
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    app.include_router(login.router)
    app.include_router(pages.router)

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        for name, value in security_headers(request.url.path).items():
            response.headers[name] = value
        return response

    @app.exception_handler(NeedLogin)
    async def _to_login(request: Request, _: NeedLogin) -> Response:
        if request.url.path.startswith("/media/"):
            return PlainTextResponse("log in first", status_code=401)
        if request.method != "GET":
            target = "/events"
        else:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse("/login?" + urllib.parse.urlencode({"next": target}), status_code=303)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith("/media/"):
            return PlainTextResponse(str(exc.detail), status_code=exc.status_code)
        if request.url.path == "/healthz":
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        return state.page(request, "error.html", state.session(request), status_code=exc.status_code,
                          status=exc.status_code, message=exc.detail)

    return app
