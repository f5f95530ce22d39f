"""Accounts of the rangers' web view: roles, Argon2id password hashes, and login throttling (issue 9).

Roles (what each may see is decided here, once, and used by every page and API route):

============ ======================================= ==================== =====================
 role         who                                     exact locations      budgets and rounds
============ ======================================= ==================== =====================
 ``operator`` runs the federation                     yes                  yes
 ``ranger``   protects the animals on the ground      yes                  no
 ``partner``  researchers, NGOs                       no (fuzzed)          no
 ``public``   anyone given a read-only account        no (fuzzed)          no
============ ======================================= ==================== =====================

Passwords are hashed with Argon2id through ``argon2-cffi`` (RFC 9106; its default parameters: 64 MiB, 3
passes, 4 lanes), never stored or logged; a hash made with older parameters is upgraded at the next login
(``check_needs_rehash``). Logins are throttled per account and per client address: after ``max_failures``
failures within ``window_s`` seconds, further attempts are refused until the window has passed, whether or not the
password is right (OWASP Authentication Cheat Sheet, "Login Throttling").
"""

from __future__ import annotations

import enum
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from sqlalchemy import delete, select

from shared.errors import ConfigError

from coordinator.storage import Store, UserRow, WebSessionRow

__all__ = ["Role", "Account", "AccountError", "AccountStore", "LoginThrottle", "MIN_PASSWORD_LENGTH"]

MIN_PASSWORD_LENGTH = 12
_USERNAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,63}$")


class Role(str, enum.Enum):
    """A web-view role (module docstring)."""

    OPERATOR = "operator"
    RANGER = "ranger"
    PARTNER = "partner"
    PUBLIC = "public"

    @property
    def sees_exact_locations(self) -> bool:
        """Whether this role sees true deployment coordinates (else sensitive ones are fuzzed)."""
        return self in (Role.OPERATOR, Role.RANGER)

    @property
    def sees_budgets(self) -> bool:
        """Whether this role sees privacy budgets, the ledger and the round history."""
        return self is Role.OPERATOR


class AccountError(ConfigError):
    """An account cannot be created or changed (bad name, weak password, unknown role, duplicate, unknown user)."""


@dataclass(frozen=True)
class Account:
    """A web-view account, without its password hash."""

    username: str
    role: Role
    disabled: bool


def _parse_role(role: str | Role) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise AccountError(f"role {role!r} is unknown", field="role",
                           fix=f"use one of {[r.value for r in Role]}") from None


class AccountStore:
    """Create, check and manage accounts in the coordinator's database (``users`` table).

    Args:
        store: the coordinator's :class:`~coordinator.storage.Store`.
        hasher: an ``argon2.PasswordHasher`` (default parameters of argon2-cffi; tests may pass cheaper ones).
    """

    def __init__(self, store: Store, *, hasher: PasswordHasher | None = None) -> None:
        self._store = store
        self._hasher = hasher or PasswordHasher()

    def create(self, username: str, password: str, role: str | Role) -> Account:
        """Create an account.

        Raises:
            AccountError: the name is not 2-64 characters of ``a-z0-9_.-``, the password is shorter than
                :data:`MIN_PASSWORD_LENGTH`, the role is unknown, or the name is taken.
        """
        if not isinstance(username, str) or not _USERNAME.match(username):
            raise AccountError(f"username {username!r} is not 2-64 characters of a-z, 0-9, _.-", field="username",
                               fix="use lower-case letters, digits, '_', '.', '-'")
        if not isinstance(password, str) or len(password) < MIN_PASSWORD_LENGTH:
            raise AccountError(f"the password is shorter than {MIN_PASSWORD_LENGTH} characters", field="password",
                               fix=f"choose a password of at least {MIN_PASSWORD_LENGTH} characters")
        parsed = _parse_role(role)
        with self._store.session() as s:
            if s.get(UserRow, username) is not None:
                raise AccountError(f"user {username!r} exists", field="username",
                                   fix="choose another name, or change that account's role or password")
            s.add(UserRow(username=username, password_hash=self._hasher.hash(password), role=parsed.value,
                          disabled=False))
        return Account(username, parsed, False)

    def authenticate(self, username: str, password: str) -> Account | None:
        """The account if ``password`` is its password and it is not disabled, else None (the same answer for an
        unknown user, a wrong password and a disabled account). Upgrades an outdated hash."""
        with self._store.session() as s:
            row = s.get(UserRow, username) if isinstance(username, str) else None
            if row is None:
                self._hasher.hash(password if isinstance(password, str) else "")  # same time as a real check
                return None
            try:
                self._hasher.verify(row.password_hash, password)
            except (VerifyMismatchError, VerificationError, InvalidHashError, TypeError):
                return None
            if row.disabled:
                return None
            if self._hasher.check_needs_rehash(row.password_hash):
                row.password_hash = self._hasher.hash(password)
            return Account(row.username, Role(row.role), row.disabled)

    def get(self, username: str) -> Account | None:
        """The account named ``username``, or None."""
        with self._store.session() as s:
            row = s.get(UserRow, username)
            return None if row is None else Account(row.username, Role(row.role), row.disabled)

    def list(self) -> list[Account]:
        """Every account, by name."""
        with self._store.session() as s:
            return [Account(r.username, Role(r.role), r.disabled)
                    for r in s.scalars(select(UserRow).order_by(UserRow.username))]

    def update(self, username: str, *, role: str | Role | None = None, password: str | None = None,
               disabled: bool | None = None) -> Account:
        """Change an account's role, password or disabled flag. A new password or disabling ends the account's web
        sessions (a role change applies at the next request, since sessions read the role each time).

        Raises:
            AccountError: unknown user, unknown role, or a password shorter than :data:`MIN_PASSWORD_LENGTH`.
        """
        parsed = None if role is None else _parse_role(role)
        if password is not None and len(password) < MIN_PASSWORD_LENGTH:
            raise AccountError(f"the password is shorter than {MIN_PASSWORD_LENGTH} characters", field="password",
                               fix=f"choose a password of at least {MIN_PASSWORD_LENGTH} characters")
        with self._store.session() as s:
            row = s.get(UserRow, username)
            if row is None:
                raise AccountError(f"user {username!r} does not exist", field="username",
                                   fix="list the accounts with `wildfed-coordinator user list`")
            if parsed is not None:
                row.role = parsed.value
            if password is not None:
                row.password_hash = self._hasher.hash(password)
            if disabled is not None:
                row.disabled = bool(disabled)
            if password is not None or row.disabled:
                # a new password or a disabled account ends every web session of the account at once
                s.execute(delete(WebSessionRow).where(WebSessionRow.username == username))
            return Account(row.username, Role(row.role), row.disabled)


class LoginThrottle:
    """Refuses login attempts for an account or a client address after ``max_failures`` failures within
    ``window_s`` seconds (module docstring). Thread-safe; state is in memory (a restart clears it).

    Args:
        max_failures: failures allowed per key within the window (>= 1). window_s: seconds (> 0).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, *, max_failures: int = 5, window_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1 or not window_s > 0:
            raise ConfigError("login throttle needs max_failures >= 1 and window_s > 0", field="login_throttle",
                              fix="e.g. max_failures 5, window_s 900")
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> deque[float]:
        q = self._failures.setdefault(key, deque())
        while q and now - q[0] >= self.window_s:
            q.popleft()
        return q

    def allowed(self, *keys: str) -> bool:
        """Whether an attempt for these keys (e.g. ``"user:alice"``, ``"ip:10.0.0.7"``) may be checked now."""
        now = self._clock()
        with self._lock:
            return all(len(self._recent(k, now)) < self.max_failures for k in keys)

    def failed(self, *keys: str) -> None:
        """Record a failed attempt for each key."""
        now = self._clock()
        with self._lock:
            for k in keys:
                self._recent(k, now).append(now)

    def succeeded(self, *keys: str) -> None:
        """Forget the failures of these keys after a successful login."""
        with self._lock:
            for k in keys:
                self._failures.pop(k, None)
