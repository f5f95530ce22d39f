"""What every route of the review page shares: the site's index, package and accounts, the login check, the CSRF
check, and page rendering with the summary header.

One :class:`ReviewState` per app, at ``app.state.review``; routes reach it with :func:`review_state`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from shared.web_auth import LoginThrottle, same_origin, session_cookie_options, tokens_match

from edge_sdk.config import SiteConfig
from edge_sdk.field.site_package import SitePackage
from edge_sdk.field.store import FieldStore
from edge_sdk.review.accounts import ReviewAccounts, ReviewSession
from edge_sdk.review.media import PhotoRenderer

__all__ = ["SESSION_COOKIE", "LOGIN_CSRF_COOKIE", "TEMPLATES_DIR", "STATIC_DIR", "NeedLogin", "ReviewState",
           "review_state", "make_templates"]

log = logging.getLogger(__name__)

# Cookies are shared by every port of a host: these names differ from the coordinator web view's, so both can run
# on one machine without one's login overwriting the other's.
SESSION_COOKIE = "wildfed_review_session"
LOGIN_CSRF_COOKIE = "wildfed_review_login_csrf"
_HERE = Path(__file__).parent
TEMPLATES_DIR = _HERE / "templates"
STATIC_DIR = _HERE / "static"


class NeedLogin(Exception):
    """Raised by a route that needs a session when the request has none."""


def make_templates(site_id: str) -> Jinja2Templates:
    """The page templates, with the ``fmt`` filter (a number with a format spec, ``–`` for None)."""
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    templates.env.filters["fmt"] = lambda v, spec=".2f": "–" if v is None else format(v, spec)
    templates.env.globals["site_id"] = site_id
    return templates


@dataclass
class ReviewState:
    """The review page's resources (module docstring).

    Attributes:
        config: the site config. store: the gateway's index (``<state>/field.sqlite``). package: the site's
            Camtrap DP package (``dataset``). accounts: accounts and sessions (``<state>/review.sqlite``).
        throttle: the login throttle. templates: the Jinja2 templates. renderer: the photo renderer.
        secure_cookies: mark cookies ``Secure`` (served over TLS). page_size: events per list page.
    """

    config: SiteConfig
    store: FieldStore
    package: SitePackage
    accounts: ReviewAccounts
    throttle: LoginThrottle
    templates: Jinja2Templates
    renderer: PhotoRenderer = field(default_factory=PhotoRenderer)
    secure_cookies: bool = False
    page_size: int = 24

    @property
    def names(self) -> dict[int, str]:
        """Class index -> scientific name (the federation's classes, the site's own table on top)."""
        return self.config.names_by_class

    def close(self) -> None:
        """Close the index and the accounts database."""
        self.store.close()
        self.accounts.close()

    def cookie_options(self) -> dict[str, Any]:
        """``HttpOnly``, ``SameSite=Strict``, ``Secure`` when served over TLS."""
        return session_cookie_options(secure=self.secure_cookies)

    def session(self, request: Request) -> ReviewSession | None:
        """The request's session, or None."""
        return self.accounts.session(request.cookies.get(SESSION_COOKIE))

    def need(self, request: Request) -> ReviewSession:
        """The request's session.

        Raises:
            NeedLogin: there is none (pages redirect to the login, photos answer 401).
        """
        ws = self.session(request)
        if ws is None:
            raise NeedLogin()
        return ws

    @staticmethod
    def check_csrf(request: Request, ws: ReviewSession, token: str) -> None:
        """Refuse a POST whose CSRF token is not the session's, or whose ``Origin`` is another site.

        Raises:
            HTTPException: 403.
        """
        if not same_origin(request.headers.get("origin"), request.headers.get("host")) \
                or not tokens_match(ws.csrf_token, token):
            log.warning("review: CSRF check failed for %s on %s", ws.username, request.url.path)
            raise HTTPException(status_code=403, detail="CSRF check failed: reload the page and submit the form "
                                                        "again")

    def page(self, request: Request, name: str, ws: ReviewSession | None, status_code: int = 200,
             **ctx: Any) -> HTMLResponse:
        """Render a template with the session and, for a logged-in ranger, the summary header's counts."""
        counts = self.store.counts() if ws is not None else None
        return self.templates.TemplateResponse(request, name, {"ws": ws, "counts": counts, **ctx},
                                               status_code=status_code)


def review_state(request: Request) -> ReviewState:
    """The app's :class:`ReviewState`."""
    return request.app.state.review
