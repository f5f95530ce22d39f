"""The review page's accounts and sessions, in a small SQLite file in the gateway's state folder
(``edge_sdk.site_paths.review_accounts_path``: ``<state>/review.sqlite``, mode 0600).

Accounts stay on the gateway: the rangers who review a site's photos log in to that site's gateway, on the site's
own network, and nothing about them is sent to the coordinator. Two tables:

``accounts``  user name, Argon2id hash of the password, disabled flag, creation time
``sessions``  SHA-256 of the session cookie's token (never the token), user name, the session's CSRF token,
              creation, last use and absolute end (ISO 8601, UTC)

The password policy, hashes, tokens and lifetimes are :mod:`shared.web_auth`'s (the coordinator's web view uses the
same). The file is shared by two processes: the review server, and ``wildfed-edge review-user`` run by an operator
while it serves; SQLite in WAL mode with a busy timeout serialises them, and every change is one transaction, so
disabling an account or changing its password ends its sessions at once, in the running server too. The file is
created 0600 and tightened to 0600 when found looser (SQLite gives its ``-wal`` and ``-shm`` files the same mode).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.web_auth import AccountError, PasswordHashing, SessionLifetime, check_username, new_token, token_digest

__all__ = ["ReviewAccount", "ReviewSession", "ReviewAccounts", "utc_now"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    username TEXT PRIMARY KEY, password_hash TEXT NOT NULL, disabled INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    token_sha256 TEXT PRIMARY KEY, username TEXT NOT NULL, csrf_token TEXT NOT NULL, created_at TEXT NOT NULL,
    last_seen_at TEXT NOT NULL, expires_at TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_user ON sessions(username);
"""


def utc_now() -> _dt.datetime:
    """The time now, UTC, to the second (timezone-aware)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


@dataclass(frozen=True)
class ReviewAccount:
    """An account, without its password hash."""

    username: str
    disabled: bool
    created_at: str


@dataclass(frozen=True)
class ReviewSession:
    """A valid session: whose it is and its CSRF token."""

    username: str
    csrf_token: str


def _open_private(path: Path) -> None:
    """Create ``path`` with mode 0600 if absent, or tighten it to 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        mode = os.fstat(fd).st_mode & 0o777
        if mode != 0o600:
            log.warning("review: %s had mode %o; set to 0600 (it holds password hashes)", path, mode)
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class ReviewAccounts:
    """Accounts and sessions of the review page (module docstring).

    Args:
        path: the SQLite file (created 0600 with its folder).
        hasher: an ``argon2.PasswordHasher`` (default: argon2-cffi's defaults; tests pass cheaper ones).
        lifetime: how long sessions live (default 8 hours, 1 hour idle).
        clock: UTC now, timezone-aware (tests inject one).
    """

    def __init__(self, path: str | Path, *, hasher: Any | None = None, lifetime: SessionLifetime | None = None,
                 clock: Callable[[], _dt.datetime] = utc_now) -> None:
        self.path = Path(path)
        _open_private(self.path)
        self.passwords = PasswordHashing(hasher)
        self.lifetime = lifetime or SessionLifetime()
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- accounts -------------------------------------------------------------------------------------------------
    def create(self, username: str, password: str) -> ReviewAccount:
        """Create an account.

        Raises:
            AccountError: the name breaks :data:`shared.web_auth.USERNAME_PATTERN`, the password is shorter than
                :data:`shared.web_auth.MIN_PASSWORD_LENGTH`, or the name is taken.
        """
        check_username(username)
        password_hash = self.passwords.hash(password)
        created = self._clock().isoformat()
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM accounts WHERE username = ?", (username,)).fetchone() is not None:
                raise AccountError(f"user {username!r} exists", field="username",
                                   fix="choose another name, or give that account a new password with "
                                       "`wildfed-edge review-user set-password`")
            db.execute("INSERT INTO accounts VALUES (?, ?, 0, ?)", (username, password_hash, created))
        return ReviewAccount(username, False, created)

    def get(self, username: str) -> ReviewAccount | None:
        """The account named ``username``, or None."""
        with self._lock:
            row = self._db.execute("SELECT username, disabled, created_at FROM accounts WHERE username = ?",
                                   (username,)).fetchone()
        return None if row is None else ReviewAccount(row[0], bool(row[1]), row[2])

    def list(self) -> list[ReviewAccount]:
        """Every account, by name."""
        with self._lock:
            rows = self._db.execute("SELECT username, disabled, created_at FROM accounts ORDER BY username").fetchall()
        return [ReviewAccount(u, bool(d), c) for u, d, c in rows]

    def authenticate(self, username: str, password: str) -> ReviewAccount | None:
        """The account if ``password`` is its password and it is not disabled, else None (one answer, and one
        Argon2id hash, for an unknown user, a wrong password and a disabled account). Upgrades an outdated hash."""
        with self._lock:
            row = self._db.execute("SELECT password_hash, disabled, created_at FROM accounts WHERE username = ?",
                                   (username if isinstance(username, str) else "",)).fetchone()
        if not self.passwords.verify(None if row is None else row[0], password) or row[1]:
            return None
        if self.passwords.needs_rehash(row[0]):
            with self._transaction() as db:
                db.execute("UPDATE accounts SET password_hash = ? WHERE username = ?",
                           (self.passwords.hash(password), username))
        return ReviewAccount(username, False, row[2])

    def update(self, username: str, *, password: str | None = None, disabled: bool | None = None) -> ReviewAccount:
        """Give an account a new password, or disable or enable it; a new password or disabling ends its sessions.

        Raises:
            AccountError: no such account, or a password that is too short.
        """
        password_hash = None if password is None else self.passwords.hash(password)
        with self._transaction() as db:
            row = db.execute("SELECT disabled, created_at FROM accounts WHERE username = ?", (username,)).fetchone()
            if row is None:
                raise AccountError(f"user {username!r} does not exist", field="username",
                                   fix="list the accounts with `wildfed-edge review-user list`")
            if password_hash is not None:
                db.execute("UPDATE accounts SET password_hash = ? WHERE username = ?", (password_hash, username))
            now_disabled = bool(row[0]) if disabled is None else bool(disabled)
            db.execute("UPDATE accounts SET disabled = ? WHERE username = ?", (int(now_disabled), username))
            if password_hash is not None or now_disabled:
                db.execute("DELETE FROM sessions WHERE username = ?", (username,))
        return ReviewAccount(username, now_disabled, row[1])

    # -- sessions -------------------------------------------------------------------------------------------------
    def start_session(self, account: ReviewAccount) -> tuple[str, str]:
        """Start a session; returns ``(cookie token, CSRF token)``. Drops ended sessions too."""
        token, csrf = new_token(), new_token()
        now = self._clock()
        with self._transaction() as db:
            db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now.isoformat(),))
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                       (token_digest(token), account.username, csrf, now.isoformat(), now.isoformat(),
                        self.lifetime.expires_at(now).isoformat()))
        return token, csrf

    def session(self, token: str | None) -> ReviewSession | None:
        """The session of a cookie token, or None when there is none, it has ended (too old, idle too long) or its
        account is disabled or gone (such a row is deleted). Marks it used."""
        if not token or len(token) > 256:
            return None
        now = self._clock()
        digest = token_digest(token)
        with self._transaction() as db:
            row = db.execute("SELECT s.username, s.csrf_token, s.last_seen_at, s.expires_at, a.disabled FROM sessions "
                             "s LEFT JOIN accounts a ON a.username = s.username WHERE s.token_sha256 = ?",
                             (digest,)).fetchone()
            if row is None:
                return None
            username, csrf, last_seen, expires, disabled = row
            alive = self.lifetime.alive(expires_at=_dt.datetime.fromisoformat(expires),
                                        last_seen_at=_dt.datetime.fromisoformat(last_seen), now=now)
            if not alive or disabled is None or disabled:
                db.execute("DELETE FROM sessions WHERE token_sha256 = ?", (digest,))
                return None
            db.execute("UPDATE sessions SET last_seen_at = ? WHERE token_sha256 = ?", (now.isoformat(), digest))
        return ReviewSession(username, csrf)

    def end_session(self, token: str | None) -> None:
        """End one session (logout); an unknown token is ignored."""
        if token:
            with self._transaction() as db:
                db.execute("DELETE FROM sessions WHERE token_sha256 = ?", (token_digest(token),))

    def session_count(self, username: str | None = None) -> int:
        """Stored sessions (of one account, or of all)."""
        with self._lock:
            if username is None:
                return int(self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])
            return int(self._db.execute("SELECT COUNT(*) FROM sessions WHERE username = ?",
                                        (username,)).fetchone()[0])
