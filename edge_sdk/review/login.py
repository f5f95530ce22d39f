"""The review page's login and logout (``/login``, ``/logout``) and its health check (``/healthz``).

The login form is protected by a double-submit cookie (the form has no session yet: a random token goes both into a
``SameSite=Strict`` cookie and into the form, and the POST must bring both, equal); attempts are throttled per
(account, client address) and more loosely per address (:class:`shared.web_auth.LoginThrottle`). A successful
login sets the session cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over TLS) and sends the browser where
it was going (``next``, a local path only). Logout is a POST with the session's CSRF token.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from shared.web_auth import new_token, safe_next, same_origin, tokens_match

from edge_sdk.review.context import LOGIN_CSRF_COOKIE, SESSION_COOKIE, review_state

__all__ = ["router", "HOME"]

log = logging.getLogger(__name__)

router = APIRouter()
#: Where a login goes when it was going nowhere in particular.
HOME = "/events"


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """``{"status": "ok"}`` (no login: for supervisors and tests)."""
    return {"status": "ok"}


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = HOME) -> Response:
    """The login form, with a fresh double-submit token in a cookie and a hidden field."""
    st = review_state(request)
    token = new_token()
    response = st.page(request, "login.html", None, csrf_token=token, next=safe_next(next, HOME), error=None,
                       username="")
    response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, **st.cookie_options())
    return response


@router.post("/login")
def login(request: Request, username: str = Form(""), password: str = Form(""), csrf_token: str = Form(""),
          next: str = Form(HOME)) -> Response:
    """Check the form's token, the throttle and the password; start a session (module docstring)."""
    st = review_state(request)
    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not same_origin(request.headers.get("origin"), request.headers.get("host")) \
            or not tokens_match(cookie, csrf_token):
        raise HTTPException(status_code=403, detail="CSRF check failed: reload the login page and try again")
    address, target = _client(request), safe_next(next, HOME)
    name = username.strip().lower()
    if not st.throttle.allowed(name, address):
        log.warning("review: login throttled for %r from %s", name, address)
        minutes = int(st.throttle.window_s // 60)
        return st.page(request, "login.html", None, status_code=429, csrf_token=cookie, next=target,
                       username=username, error=f"Too many failed logins: wait {minutes} minutes and try again.")
    account = st.accounts.authenticate(name, password)
    if account is None:
        st.throttle.failed(name, address)
        log.info("review: failed login for %r from %s", name, address)
        return st.page(request, "login.html", None, status_code=401, csrf_token=cookie, next=target,
                       username=username, error="Wrong user name or password, or the account is disabled.")
    st.throttle.succeeded(name, address)
    token, _ = st.accounts.start_session(account)
    log.info("review: %s logged in from %s", account.username, address)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(SESSION_COOKIE, token, max_age=int(st.accounts.lifetime.ttl_s), **st.cookie_options())
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/")
    return response


@router.post("/logout")
def logout(request: Request, csrf_token: str = Form("")) -> Response:
    """End the session (CSRF token required) and go to the login form."""
    st = review_state(request)
    ws = st.need(request)
    st.check_csrf(request, ws, csrf_token)
    st.accounts.end_session(request.cookies.get(SESSION_COOKIE))
    log.info("review: %s logged out", ws.username)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
