"""Logging in and out (``/login``, ``/logout``) and the health check (``/healthz``), the routes without a session."""

from __future__ import annotations

import hmac
import logging
import secrets

from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from coordinator.web.context import LOGIN_CSRF_COOKIE, SESSION_COOKIE, WebContext, web

__all__ = ["router"]

log = logging.getLogger("coordinator.web.app")  # the name the login lines have always been logged under

router = APIRouter()


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """``{"status": "ok"}`` while the app answers."""
    return {"status": "ok"}


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/map", ctx: WebContext = Depends(web)) -> Response:
    """The login form, with a fresh CSRF token in a cookie and in the form (double submit)."""
    token = secrets.token_urlsafe(32)
    response = ctx.page(request, "login.html", None, csrf_token=token, next=ctx.safe_next(next), error=None,
                        username="")
    response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, **ctx.cookie_kwargs())
    return response


@router.post("/login")
def login(request: Request, username: str = Form(""), password: str = Form(""), csrf_token: str = Form(""),
          next: str = Form("/map"), ctx: WebContext = Depends(web)) -> Response:
    """Check the CSRF token, the throttle and the password; on success a session cookie and a redirect to ``next``
    (a local path only)."""
    throttle, config = ctx.throttle, ctx.config
    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not ctx.same_origin(request) or not cookie or not csrf_token or not hmac.compare_digest(cookie, csrf_token):
        raise HTTPException(status_code=403, detail="CSRF check failed: reload the login page and try again")
    address = ctx.client_address(request)
    if not throttle.allowed(username, address):  # per (account, address), and a looser ceiling per address
        log.warning("web: login throttled for %r from %s", username, address)
        return ctx.page(request, "login.html", None, status_code=429, csrf_token=cookie, next=ctx.safe_next(next),
                        username=username,
                        error=f"Too many failed logins: wait {int(throttle.window_s // 60)} minutes and try again.")
    account = ctx.accounts.authenticate(username.strip().lower(), password)
    if account is None:
        throttle.failed(username, address)
        log.info("web: failed login for %r from %s", username, address)
        return ctx.page(request, "login.html", None, status_code=401, csrf_token=cookie, next=ctx.safe_next(next),
                        username=username, error="Wrong user name or password, or the account is disabled.")
    throttle.succeeded(username, address)
    token, _ = ctx.sessions.create(account)
    log.info("web: %s (%s) logged in from %s", account.username, account.role.value, address)
    response = RedirectResponse(ctx.safe_next(next), status_code=303)
    response.set_cookie(SESSION_COOKIE, token, max_age=int(config.web.session_ttl_s), **ctx.cookie_kwargs())
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/")
    return response


@router.post("/logout")
def logout(request: Request, csrf_token: str = Form(""), ctx: WebContext = Depends(web)) -> Response:
    """End the session (CSRF token required) and go to the login page."""
    ws = ctx.need(request)
    ctx.check_csrf(request, ws, csrf_token)
    ctx.sessions.revoke(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
