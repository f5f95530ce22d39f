"""Logged-in sessions of the web view, kept in the coordinator's database (``web_sessions`` table; docs/web.md).

A login creates a 256-bit random token that goes to the browser in a cookie marked ``HttpOnly``,
``SameSite=Strict`` and (by default) ``Secure``; the table keeps only its SHA-256, so a copy of the database does not
let anyone log in. Each session has its own CSRF token (the synchronizer-token pattern of the OWASP CSRF Prevention
Cheat Sheet) that every form carries in a hidden field and every POST must echo. Tokens, digests and lifetimes are
:mod:`shared.web_auth`'s, which the gateway's review page uses too; this module keeps the sessions in the
coordinator's database.

A session ends at logout, ``ttl_s`` seconds after login (absolute), after ``idle_s`` seconds without a request,
when its account is disabled or deleted, or when the account's password or role changes
(:meth:`SessionManager.revoke_user`). The account's role is read from ``users`` on every request, so a role change
applies at once.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import delete

from shared.web_auth import SessionLifetime, new_token, token_digest

from coordinator.storage import Store, UserRow, WebSessionRow, utcnow
from coordinator.web.auth import Account, Role

__all__ = ["WebSession", "SessionManager"]


@dataclass(frozen=True)
class WebSession:
    """A valid session: the account (with its current role) and the session's CSRF token."""

    account: Account
    csrf_token: str


class SessionManager:
    """Create, look up and end sessions (module docstring).

    Args:
        store: the coordinator's store. ttl_s: absolute lifetime in seconds (> 0). idle_s: idle timeout in
            seconds (> 0). clock: naive-UTC ``datetime`` now (tests inject one).

    Raises:
        ConfigError: a non-positive lifetime.
    """

    def __init__(self, store: Store, *, ttl_s: float = 8 * 3600.0, idle_s: float = 3600.0,
                 clock: Callable[[], _dt.datetime] = utcnow) -> None:
        self.lifetime = SessionLifetime(ttl_s=ttl_s, idle_s=idle_s)
        self._store = store
        self._clock = clock

    def create(self, account: Account) -> tuple[str, str]:
        """Start a session for ``account``; returns ``(cookie token, CSRF token)``. Also drops expired rows."""
        token, csrf = new_token(), new_token()
        now = self._clock()
        with self._store.session() as s:
            s.execute(delete(WebSessionRow).where(WebSessionRow.expires_at <= now))
            s.add(WebSessionRow(token_sha256=token_digest(token), username=account.username, csrf_token=csrf,
                                created_at=now, last_seen_at=now, expires_at=self.lifetime.expires_at(now)))
        return token, csrf

    def get(self, token: str | None) -> WebSession | None:
        """The session of a cookie token, or None when there is none, it has expired or been idle too long, or
        its account is disabled or gone (such a row is deleted). Marks the session used."""
        if not token or len(token) > 256:
            return None
        now = self._clock()
        with self._store.session() as s:
            row = s.get(WebSessionRow, token_digest(token))
            if row is None:
                return None
            user = s.get(UserRow, row.username)
            alive = self.lifetime.alive(expires_at=row.expires_at, last_seen_at=row.last_seen_at, now=now)
            if not alive or user is None or user.disabled:
                s.delete(row)
                return None
            row.last_seen_at = now
            return WebSession(Account(user.username, Role(user.role), user.disabled), row.csrf_token)

    def revoke(self, token: str | None) -> None:
        """End one session (logout); unknown tokens are ignored."""
        if token:
            with self._store.session() as s:
                s.execute(delete(WebSessionRow).where(WebSessionRow.token_sha256 == token_digest(token)))

    def revoke_user(self, username: str) -> int:
        """End every session of an account (after a password change or when it is disabled); returns how many."""
        with self._store.session() as s:
            return s.execute(delete(WebSessionRow).where(WebSessionRow.username == username)).rowcount or 0
