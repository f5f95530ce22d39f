"""Login for WildFed's web pages, independent of where accounts and sessions are stored: the password policy and its
Argon2id hashes, login throttling, session and CSRF tokens, session lifetimes, and the request checks every form
POST goes through. Two sides use it over their own storage: the coordinator's web view (``coordinator.web.auth``,
``coordinator.web.sessions``, SQLAlchemy tables) and the gateway's review page (``edge_sdk.review``, a SQLite file in
the gateway's state folder).

**Passwords** (:class:`PasswordHashing`): at least :data:`MIN_PASSWORD_LENGTH` characters (NIST SP 800-63B, 5.1.1.2,
asks for at least 8; 12 because these accounts guard exact locations of threatened species and photos of people),
hashed with Argon2id through ``argon2-cffi`` (RFC 9106; the library's default parameters: 64 MiB, 3 passes, 4
lanes), never stored or logged. A hash made with older parameters is re-hashed at the next login
(``check_needs_rehash``). Checking a user that does not exist costs one hash too, so the answer's timing does not
tell whether a name exists.

**Throttling** (:class:`LoginThrottle`; OWASP Authentication Cheat Sheet, "Login Throttling"): two limits on failed
attempts within ``window_s`` seconds (default 15 minutes), after which attempts are refused until the window has
passed, whether or not the password is right:

* per (account, client address): ``max_failures`` (default 5). This is the brute-force limit on one account. It is
  *not* per address alone: a ranger station reaches the server through one NAT address, and one person mistyping
  five times must not lock every ranger of the station out. Nor is it per account alone, which would let anyone who
  can reach the page lock a known account out by failing five times.
* per client address, over all accounts: ``max_failures_per_address`` (default 50), a looser ceiling against
  password spraying (one address trying a few passwords on many accounts).

Not limited: one account attacked from many addresses gets ``max_failures`` guesses per address per window; each
guess costs the attacker a full Argon2id verification on the server, and a per-account limit over all addresses
would hand the same attacker a remote lock-out of that account.

**Sessions** (:func:`new_token`, :func:`token_digest`, :class:`SessionLifetime`): a login creates a 256-bit random
token (``secrets.token_urlsafe(32)``) that goes to the browser in a cookie marked ``HttpOnly``, ``SameSite=Strict``
and ``Secure`` when served over TLS (:func:`session_cookie_options`); storage keeps only its SHA-256, so a copy of
the accounts database does not let anyone log in. A session ends at logout, ``ttl_s`` after login (absolute), after
``idle_s`` without a request, or when its account is disabled or its password changes (the storage deletes it).

**CSRF** (synchronizer-token pattern of the OWASP CSRF Prevention Cheat Sheet): each session has its own random
token that every form carries in a hidden field and every POST must echo (:func:`tokens_match`, constant time); the
login form, which has no session yet, uses a double-submit cookie. A POST whose ``Origin`` header names another
origin is refused too (:func:`same_origin`).

``argon2-cffi`` is imported only when a :class:`PasswordHashing` is made: this module adds no dependency to the
parts of WildFed that serve no page.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import re
import secrets
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.errors import ConfigError

__all__ = ["MIN_PASSWORD_LENGTH", "USERNAME_PATTERN", "CONTENT_SECURITY_POLICY", "AccountError", "check_username",
           "check_password", "PasswordHashing", "LoginThrottle", "new_token", "token_digest", "tokens_match",
           "same_origin", "safe_next", "SessionLifetime", "session_cookie_options", "security_headers"]

MIN_PASSWORD_LENGTH = 12
#: Account names: 2-64 characters of lower-case letters, digits, ``_.-``, starting with a letter or digit.
USERNAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,63}$")
#: Only this origin; no scripts at all; no framing (clickjacking).
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'none'; "
                           "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


class AccountError(ConfigError):
    """An account cannot be created or changed (bad name, weak password, unknown role, duplicate, unknown user)."""


def check_username(username: object) -> str:
    """``username`` if it matches :data:`USERNAME_PATTERN`.

    Raises:
        AccountError: it does not (the message names the rule).
    """
    if not isinstance(username, str) or not USERNAME_PATTERN.fullmatch(username):  # "$" admits a final newline
        raise AccountError(f"username {username!r} is not 2-64 characters of a-z, 0-9, _.-", field="username",
                           fix="use lower-case letters, digits, '_', '.', '-'")
    return username


def check_password(password: object) -> str:
    """``password`` if it has at least :data:`MIN_PASSWORD_LENGTH` characters.

    Raises:
        AccountError: it is shorter (or not a string).
    """
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_LENGTH:
        raise AccountError(f"the password is shorter than {MIN_PASSWORD_LENGTH} characters", field="password",
                           fix=f"choose a password of at least {MIN_PASSWORD_LENGTH} characters")
    return password


class PasswordHashing:
    """Argon2id hashes of passwords (module docstring).

    Args:
        hasher: an ``argon2.PasswordHasher`` (default: argon2-cffi's default parameters; tests pass cheaper ones).
    """

    def __init__(self, hasher: Any | None = None) -> None:
        if hasher is None:
            from argon2 import PasswordHasher

            hasher = PasswordHasher()
        self.hasher = hasher

    def hash(self, password: str) -> str:
        """The Argon2id hash (PHC string ``$argon2id$...``) of a password that passes :func:`check_password`.

        Raises:
            AccountError: the password is too short.
        """
        return self.hasher.hash(check_password(password))

    def verify(self, stored_hash: str | None, password: object) -> bool:
        """Whether ``password`` matches ``stored_hash``. ``stored_hash`` None (no such account) costs one hash and
        answers False, so the time taken does not tell the two cases apart; a malformed hash answers False."""
        from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

        if stored_hash is None or not isinstance(password, str):
            self.hasher.hash(password if isinstance(password, str) else "")
            return False
        try:
            return bool(self.hasher.verify(stored_hash, password))
        except (VerifyMismatchError, VerificationError, InvalidHashError, TypeError):
            return False

    def needs_rehash(self, stored_hash: str) -> bool:
        """Whether a hash was made with other parameters than this hasher's (re-hash it at a successful login)."""
        return bool(self.hasher.check_needs_rehash(stored_hash))


class LoginThrottle:
    """Refuses login attempts after too many failures within ``window_s`` seconds: ``max_failures`` per (account,
    client address) and ``max_failures_per_address`` per client address over all accounts (module docstring).
    Thread-safe; state is in memory (a restart clears it) and bounded (keys with no failure left in the window are
    dropped).

    Args:
        max_failures: failures allowed per (account, address) within the window (>= 1).
        max_failures_per_address: failures allowed per address, all accounts together (>= 1).
        window_s: seconds (> 0). clock: monotonic seconds (tests inject one).

    Raises:
        ConfigError: a limit below 1 or a window that is not positive.
    """

    def __init__(self, *, max_failures: int = 5, max_failures_per_address: int = 50, window_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1 or max_failures_per_address < 1 or not window_s > 0:
            raise ConfigError("login throttle needs max_failures >= 1, max_failures_per_address >= 1 and "
                              "window_s > 0", field="login_max_failures",
                              fix="e.g. login_max_failures 5, login_max_failures_per_address 50, login_window_s 900")
        self.max_failures = max_failures
        self.max_failures_per_address = max_failures_per_address
        self.window_s = window_s
        self._clock = clock
        self._failures: dict[tuple[str, ...], deque[float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _keys(username: str, address: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        name = (username or "").strip().lower()
        return ("pair", name, address), ("address", address)

    def _count(self, key: tuple[str, ...], now: float) -> int:
        q = self._failures.get(key)
        while q and now - q[0] >= self.window_s:
            q.popleft()
        if q is not None and not q:
            del self._failures[key]
            return 0
        return len(q) if q else 0

    def _sweep(self, now: float) -> None:
        """Drop every key whose failures have all left the window (bounds memory under a flood of names)."""
        for key in [k for k, q in self._failures.items() if not q or now - q[-1] >= self.window_s]:
            del self._failures[key]

    def allowed(self, username: str, address: str) -> bool:
        """Whether a login attempt for ``username`` from client ``address`` may be checked now."""
        pair, addr = self._keys(username, address)
        now = self._clock()
        with self._lock:
            return (self._count(pair, now) < self.max_failures
                    and self._count(addr, now) < self.max_failures_per_address)

    def failed(self, username: str, address: str) -> None:
        """Record a failed attempt for ``username`` from ``address``."""
        now = self._clock()
        with self._lock:
            if len(self._failures) > 100_000:
                self._sweep(now)
            for key in self._keys(username, address):
                self._count(key, now)
                self._failures.setdefault(key, deque()).append(now)

    def succeeded(self, username: str, address: str) -> None:
        """Forget the failures of this (account, address) after a successful login. The address's count over all
        accounts stays: one valid password must not reset the ceiling against spraying."""
        pair, _ = self._keys(username, address)
        with self._lock:
            self._failures.pop(pair, None)


# ---- tokens ----------------------------------------------------------------------------------------------------
def new_token() -> str:
    """A fresh 256-bit random token, URL-safe base64 (43 characters): a session cookie or a CSRF token."""
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """SHA-256 hex digest of a token: what storage keeps instead of a session token."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def tokens_match(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison of a CSRF token with the one a form sent; False when either is empty."""
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8"))


def same_origin(origin: str | None, host: str | None) -> bool:
    """Whether a POST's ``Origin`` header names this server (``host``: the request's ``Host`` header).

    No ``Origin`` header passes (non-browser clients send none; the CSRF token and ``SameSite=Strict`` still apply);
    ``Origin: null`` (a sandboxed frame, a data: URL, a cross-site redirect) never does."""
    if origin is None:
        return True
    if origin == "null":
        return False
    return urllib.parse.urlsplit(origin).netloc == (host or "")


def safe_next(target: str | None, default: str) -> str:
    """``target`` when it is a local path (no scheme, no host, no ``//`` or backslash tricks), else ``default``:
    where a login may send the browser next (an open redirect otherwise)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target


@dataclass(frozen=True)
class SessionLifetime:
    """How long a session lives: ``ttl_s`` seconds after login at most, ``idle_s`` seconds without a request.

    Raises:
        ConfigError: a lifetime that is not positive.
    """

    ttl_s: float = 8 * 3600.0
    idle_s: float = 3600.0

    def __post_init__(self) -> None:
        if not (self.ttl_s > 0 and self.idle_s > 0):
            raise ConfigError("session lifetimes must be positive", field="session_ttl_s/session_idle_s",
                              fix="e.g. 28800 and 3600 seconds")

    def expires_at(self, created: _dt.datetime) -> _dt.datetime:
        """The absolute end of a session created at ``created``."""
        return created + _dt.timedelta(seconds=self.ttl_s)

    def alive(self, *, expires_at: _dt.datetime, last_seen_at: _dt.datetime, now: _dt.datetime) -> bool:
        """Whether a session is still valid at ``now`` (before its end, and used within ``idle_s``)."""
        return expires_at > now and (now - last_seen_at).total_seconds() <= self.idle_s


def session_cookie_options(*, secure: bool) -> dict[str, Any]:
    """Keyword arguments of Starlette's ``Response.set_cookie`` for session and login cookies: ``HttpOnly``,
    ``SameSite=Strict``, path ``/``, and ``Secure`` when ``secure`` (served over TLS)."""
    return {"httponly": True, "samesite": "strict", "secure": bool(secure), "path": "/"}


def security_headers(path: str) -> dict[str, str]:
    """Headers every response of a WildFed page carries: the :data:`CONTENT_SECURITY_POLICY`, ``nosniff``,
    ``Referrer-Policy: same-origin`` (nothing to other sites; under ``no-referrer`` Chromium sends ``Origin: null``
    on same-site form posts, which :func:`same_origin` must refuse), no framing, and ``Cache-Control: no-store``
    except under ``/static``."""
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY"}
    if not path.startswith("/static"):
        headers["Cache-Control"] = "no-store"
    return headers
