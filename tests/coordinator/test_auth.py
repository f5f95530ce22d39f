"""Web-view accounts (coordinator.web.auth): Argon2id hashes checked with argon2-cffi's own verifier, the same
refusal for an unknown user, a wrong password and a disabled account, roles and what they see, login throttling
worked by hand with an injected clock, and the `user` CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from argon2 import PasswordHasher
from typer.testing import CliRunner

from coordinator.storage import Store, UserRow
from shared.errors import ConfigError

from coordinator.web.auth import AccountError, AccountStore, LoginThrottle, Role

CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)  # fast for tests; the default is 64 MiB x 3


def test_accounts_hash_authenticate_and_refuse_alike(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path)
    accounts = AccountStore(store, hasher=CHEAP)
    accounts.create("ana", "correct horse battery", "ranger")
    with store.session() as s:
        stored = s.get(UserRow, "ana").password_hash
    assert stored.startswith("$argon2id$") and "correct horse" not in stored
    assert PasswordHasher().verify(stored, "correct horse battery")  # a standard Argon2id hash, checked by the library
    assert accounts.authenticate("ana", "correct horse battery").role is Role.RANGER
    assert accounts.authenticate("ana", "wrong password!!") is None
    assert accounts.authenticate("nobody", "correct horse battery") is None
    accounts.update("ana", disabled=True)
    assert accounts.authenticate("ana", "correct horse battery") is None
    accounts.update("ana", disabled=False, role="partner", password="another long secret")
    assert accounts.authenticate("ana", "another long secret").role is Role.PARTNER
    with pytest.raises(AccountError, match="exists"):
        accounts.create("ana", "correct horse battery", "ranger")
    with pytest.raises(AccountError, match="shorter than 12"):
        accounts.create("bo", "short", "ranger")
    with pytest.raises(AccountError, match="role"):
        accounts.create("bo", "long enough password", "admin")
    with pytest.raises(AccountError, match="username"):
        accounts.create("Bad Name", "long enough password", "ranger")


def test_an_outdated_hash_is_upgraded_at_login(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path)
    AccountStore(store, hasher=CHEAP).create("op", "operator password", "operator")
    stronger = PasswordHasher(time_cost=2, memory_cost=16, parallelism=1)
    assert AccountStore(store, hasher=stronger).authenticate("op", "operator password") is not None
    with store.session() as s:
        assert not stronger.check_needs_rehash(s.get(UserRow, "op").password_hash)


def test_roles_decide_what_is_seen() -> None:
    assert [r.value for r in Role if r.sees_exact_locations] == ["operator", "ranger"]
    assert [r.value for r in Role if r.sees_budgets] == ["operator"]


def test_login_throttle_by_hand() -> None:
    now = [0.0]
    t = LoginThrottle(max_failures=3, max_failures_per_address=5, window_s=60.0, clock=lambda: now[0])
    for _ in range(3):
        assert t.allowed("ana", "1.2.3.4")
        t.failed("ana", "1.2.3.4")
        now[0] += 10.0
    assert not t.allowed("ana", "1.2.3.4") and not t.allowed(" ANA ", "1.2.3.4")  # names compare normalised
    assert t.allowed("bo", "1.2.3.4")  # another account behind the same address (one NAT) is not locked out
    assert t.allowed("ana", "9.9.9.9")  # nor is the account from elsewhere (no remote lock-out)
    t.failed("bo", "1.2.3.4")
    t.failed("cy", "1.2.3.4")  # 5 failures from 1.2.3.4 over all accounts: the spraying ceiling
    assert not t.allowed("dee", "1.2.3.4") and t.allowed("dee", "5.5.5.5")
    t.succeeded("bo", "1.2.3.4")  # a success clears its own pair only, never the address's ceiling
    assert not t.allowed("bo", "1.2.3.4")
    now[0] = 60.0  # the first failure (t = 0) leaves the window: 2 of 3 for ana, 4 of 5 for the address
    assert t.allowed("ana", "1.2.3.4")
    t.failed("ana", "1.2.3.4")
    assert not t.allowed("ana", "1.2.3.4")
    now[0] = 200.0  # every failure has left the window: nothing is kept
    assert t.allowed("ana", "1.2.3.4") and t.allowed("dee", "1.2.3.4")
    with pytest.raises(ConfigError, match="max_failures_per_address"):
        LoginThrottle(max_failures_per_address=0)


def test_user_cli(tmp_path: Path) -> None:
    from coordinator.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"]).exit_code == 0
    cfg = str(tmp_path / "c" / "coordinator.yaml")
    res = runner.invoke(app, ["user", "add", "ana", "--role", "ranger", "-c", cfg],
                        input="a long ranger password\na long ranger password\n")
    assert res.exit_code == 0, res.output
    assert "a long ranger password" not in res.output
    res = runner.invoke(app, ["user", "list", "-c", cfg])
    assert res.exit_code == 0 and "ana" in res.output and "ranger" in res.output
    res = runner.invoke(app, ["user", "add", "bo", "--role", "ranger", "-c", cfg], input="short\nshort\n")
    assert res.exit_code == 2 and "password" in res.output
    res = runner.invoke(app, ["user", "disable", "ana", "-c", cfg])
    assert res.exit_code == 0
    res = runner.invoke(app, ["user", "list", "-c", cfg])
    assert "disabled" in res.output
