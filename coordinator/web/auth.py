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
(``check_needs_rehash``).

Logins are throttled (OWASP Authentication Cheat Sheet, "Login Throttling"; :class:`LoginThrottle`), by two limits
on failed attempts within ``window_s`` seconds (default 15 minutes), after which attempts are refused until the
window has passed, whether or not the password is right:

* per (account, client address): ``max_failures`` (default 5). This is the brute-force limit on one account. It is
  *not* per address alone: a ranger station reaches the coordinator through one NAT address, and one person
  mistyping five times must not lock every ranger of the station out (issue 16, item 9). Nor is it per account
  alone, which would let anyone on the internet lock a known account out by failing five times.
* per client address, over all accounts: ``max_failures_per_address`` (default 50), a looser ceiling against
  password spraying (one address trying a few passwords on many accounts).

Not limited: one account attacked from many addresses gets ``max_failures`` guesses per address per window; each
guess costs the attacker a full Argon2id verification on the server, and a per-account limit over all addresses
would hand the same attacker a remote lock-out of that account.
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
                              "window_s > 0", field="web.login_max_failures",
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
