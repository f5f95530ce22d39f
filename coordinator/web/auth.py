"""Accounts of the rangers' web view: roles, Argon2id password hashes, and login throttling (docs/web.md).

Roles (what each may see is decided here, once, and used by every page and API route):

============ ======================================= ==================== =====================
 role         who                                     exact locations      budgets and rounds
============ ======================================= ==================== =====================
 ``operator`` runs the federation                     yes                  yes
 ``ranger``   protects the animals on the ground      yes                  no
 ``partner``  researchers, NGOs                       no (fuzzed)          no
 ``public``   anyone given a read-only account        no (fuzzed)          no
============ ======================================= ==================== =====================

Passwords, their Argon2id hashes and login throttling follow one policy with the gateway's review page
(:mod:`shared.web_auth`: at least 12 characters, argon2-cffi's default parameters, an outdated hash upgraded at the
next login; failures limited per (account, client address) and, more loosely, per address); this module keeps the
accounts in the coordinator's database (``users`` table).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from argon2 import PasswordHasher
from sqlalchemy import delete, select

from shared.web_auth import (MIN_PASSWORD_LENGTH, AccountError, LoginThrottle, PasswordHashing, check_password,
                             check_username)

from coordinator.storage import Store, UserRow, WebSessionRow

__all__ = ["Role", "Account", "AccountError", "AccountStore", "LoginThrottle", "MIN_PASSWORD_LENGTH"]


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
        self._passwords = PasswordHashing(hasher)

    def create(self, username: str, password: str, role: str | Role) -> Account:
        """Create an account.

        Raises:
            AccountError: the name is not 2-64 characters of ``a-z0-9_.-``, the password is shorter than
                :data:`MIN_PASSWORD_LENGTH`, the role is unknown, or the name is taken.
        """
        check_username(username)
        check_password(password)
        parsed = _parse_role(role)
        with self._store.session() as s:
            if s.get(UserRow, username) is not None:
                raise AccountError(f"user {username!r} exists", field="username",
                                   fix="choose another name, or change that account's role or password")
            s.add(UserRow(username=username, password_hash=self._passwords.hash(password), role=parsed.value,
                          disabled=False))
        return Account(username, parsed, False)

    def authenticate(self, username: str, password: str) -> Account | None:
        """The account if ``password`` is its password and it is not disabled, else None (the same answer for an
        unknown user, a wrong password and a disabled account). Upgrades an outdated hash."""
        with self._store.session() as s:
            row = s.get(UserRow, username) if isinstance(username, str) else None
            # an unknown user costs one hash too: the same time as a real check
            if not self._passwords.verify(None if row is None else row.password_hash, password):
                return None
            if row.disabled:
                return None
            if self._passwords.needs_rehash(row.password_hash):
                row.password_hash = self._passwords.hash(password)
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
        if password is not None:
            check_password(password)
        with self._store.session() as s:
            row = s.get(UserRow, username)
            if row is None:
                raise AccountError(f"user {username!r} does not exist", field="username",
                                   fix="list the accounts with `wildfed-coordinator user list`")
            if parsed is not None:
                row.role = parsed.value
            if password is not None:
                row.password_hash = self._passwords.hash(password)
            if disabled is not None:
                row.disabled = bool(disabled)
            if password is not None or row.disabled:
                # a new password or a disabled account ends every web session of the account at once
                s.execute(delete(WebSessionRow).where(WebSessionRow.username == username))
            return Account(row.username, Role(row.role), row.disabled)
