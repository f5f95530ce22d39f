"""What every route of the web view shares (coordinator.web.app builds one, the routers reach it by :func:`web`).

One :class:`WebContext` per app, kept on ``app.state.web``: the config, the store, the location secret and policy,
accounts, sessions, the login throttle and the templates, with the helpers each page needs (who is logged in, the
role's :class:`~coordinator.web.views.Viewer`, rendering a page, the CSRF checks, the detection filters). A route takes
it as ``ctx: WebContext = Depends(web)``.
"""

from __future__ import annotations

import datetime as _dt
import hmac
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from shared.errors import ConfigError

from coordinator.config import CoordinatorConfig
from coordinator.storage import Store
from coordinator.web.auth import AccountStore, LoginThrottle
from coordinator.web.deployments import CategoryOf
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.sessions import SessionManager, WebSession
from coordinator.web.views import DetectionFilter, Viewer

__all__ = ["SESSION_COOKIE", "LOGIN_CSRF_COOKIE", "NeedLogin", "WebContext", "web"]

SESSION_COOKIE = "wildfed_session"
LOGIN_CSRF_COOKIE = "wildfed_login_csrf"


class NeedLogin(Exception):
    """Raised by a page that needs a session when there is none (the app answers 401 or a redirect to /login)."""


@dataclass
class WebContext:
    """The state of one web app and the helpers its routes share.

    Attributes:
        config: the resolved coordinator config. store: the open store. secret: the location-fuzzing secret (bytes).
        policy: the location policy. category_of: species name -> IUCN category. class_names: class index -> name.
        accounts, sessions, throttle: logins. templates: the Jinja2 pages. clock: naive-UTC now (tests), or None.
    """

    config: CoordinatorConfig
    store: Store
    secret: bytes
    policy: LocationPolicy
    category_of: CategoryOf
    class_names: dict[int, str]
    accounts: AccountStore
    sessions: SessionManager
    throttle: LoginThrottle
    templates: Jinja2Templates
    clock: Callable[[], _dt.datetime] | None = None

    def cookie_kwargs(self) -> dict[str, Any]:
        """The attributes of every cookie the app sets (HttpOnly, SameSite=Strict, Secure per config, path /)."""
        return {"httponly": True, "samesite": "strict", "secure": self.config.web.cookie_secure, "path": "/"}

    def current(self, request: Request) -> WebSession | None:
        """The request's live session, or None."""
        return self.sessions.get(request.cookies.get(SESSION_COOKIE))

    def need(self, request: Request, *, operator: bool = False) -> WebSession:
        """The request's session.

        Raises:
            NeedLogin: there is none. HTTPException: 403 when ``operator`` and the role does not see budgets.
        """
        ws = self.current(request)
        if ws is None:
            raise NeedLogin()
        if operator and not ws.account.role.sees_budgets:
            raise HTTPException(status_code=403, detail="this page is for operators")
        return ws

    def viewer(self, ws: WebSession) -> Viewer:
        """What the session's role may see of the store."""
        return Viewer(self.store, ws.account.role, policy=self.policy, secret=self.secret,
                      category_of=self.category_of, class_names=self.class_names)

    def page(self, request: Request, name: str, ws: WebSession | None, status_code: int = 200,
             **ctx: Any) -> HTMLResponse:
        """Render template ``name`` with the session's role and ``ctx``."""
        return self.templates.TemplateResponse(request, name,
                                               {"ws": ws, "role": ws.account.role.value if ws else None,
                                                "operator": bool(ws and ws.account.role.sees_budgets), **ctx},
                                               status_code=status_code)

    @staticmethod
    def same_origin(request: Request) -> bool:
        """Whether the request's ``Origin`` (when sent) is this host."""
        origin = request.headers.get("origin")
        if origin is None:  # not sent by non-browser clients; SameSite=Strict and the token still apply
            return True
        if origin == "null":  # an opaque origin (sandboxed frame, data: URL, cross-site redirect): never ours
            return False
        parsed = urllib.parse.urlsplit(origin)
        return parsed.netloc == request.headers.get("host", "")

    def check_csrf(self, request: Request, ws: WebSession, token: str) -> None:
        """Raises HTTPException 403 unless the form's token is the session's and the origin is this host."""
        if not self.same_origin(request) or not token or not hmac.compare_digest(token, ws.csrf_token):
            raise HTTPException(status_code=403, detail="CSRF check failed: reload the page and submit the form "
                                                        "again")

    @staticmethod
    def client_address(request: Request) -> str:
        """The peer's address (no proxy headers are trusted), or ``"unknown"``."""
        return request.client.host if request.client else "unknown"

    @staticmethod
    def filters(request: Request, ws: WebSession) -> DetectionFilter:
        """The detection filters of the query string.

        Raises:
            HTTPException: 422 naming the field for a bad value, or for ``category`` from a role without exact
                locations.
        """
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

    @staticmethod
    def safe_next(target: str | None) -> str:
        """Only local paths (no scheme, no host, no '//' or backslash tricks) are followed after login."""
        if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
            return "/map"
        return target


def web(request: Request) -> WebContext:
    """The app's :class:`WebContext` (a FastAPI dependency: ``ctx: WebContext = Depends(web)``)."""
    return request.app.state.web
