"""The review page's accounts and sessions (edge_sdk.review.accounts) and their commands (wildfed-edge review-user):
hashes argon2-cffi's own verifier accepts, one refusal for an unknown user, a wrong password and a disabled account,
sessions that end after their idle time and lifetime (worked by hand with an injected clock), disabling and a new
password ending sessions at once, the file's mode, and the CLI."""

from __future__ import annotations

import datetime as _dt
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from argon2 import PasswordHasher
from typer.testing import CliRunner

from shared.web_auth import AccountError, SessionLifetime, token_digest

from edge_sdk.cli import app as cli
from edge_sdk.review.accounts import ReviewAccounts
from tests.edge.review.support import HASHER, PASSWORD

T0 = _dt.datetime(2024, 6, 1, 8, 0, 0, tzinfo=_dt.timezone.utc)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_accounts_hash_authenticate_and_refuse_alike(tmp_path: Path) -> None:
    accounts = ReviewAccounts(tmp_path / "state" / "review.sqlite", hasher=HASHER)
    accounts.create("rita", PASSWORD)
    with sqlite3.connect(accounts.path) as db:
        stored = db.execute("SELECT password_hash FROM accounts WHERE username = 'rita'").fetchone()[0]
    assert stored.startswith("$argon2id$") and PASSWORD not in stored
    assert PasswordHasher().verify(stored, PASSWORD)  # a standard Argon2id hash
    assert accounts.authenticate("rita", PASSWORD).username == "rita"
    assert accounts.authenticate("rita", PASSWORD + "!") is None
    assert accounts.authenticate("nobody", PASSWORD) is None
    accounts.update("rita", disabled=True)
    assert accounts.authenticate("rita", PASSWORD) is None
    accounts.update("rita", disabled=False, password="another long secret")
    assert accounts.authenticate("rita", "another long secret") is not None
    with pytest.raises(AccountError, match="exists"):
        accounts.create("rita", PASSWORD)
    with pytest.raises(AccountError, match="shorter than 12"):
        accounts.create("sam", "short")
    with pytest.raises(AccountError, match="username"):
        accounts.create("Sam Smith", PASSWORD)
    with pytest.raises(AccountError, match="does not exist"):
        accounts.update("nobody", disabled=True)
    assert [a.username for a in accounts.list()] == ["rita"]
    assert _mode(accounts.path) == 0o600
    accounts.close()


def test_an_outdated_hash_is_upgraded_and_a_loose_file_tightened(tmp_path: Path) -> None:
    path = tmp_path / "review.sqlite"
    ReviewAccounts(path, hasher=HASHER).create("rita", PASSWORD)
    os.chmod(path, 0o644)
    stronger = PasswordHasher(time_cost=2, memory_cost=16, parallelism=1)
    accounts = ReviewAccounts(path, hasher=stronger)
    assert _mode(path) == 0o600
    assert accounts.authenticate("rita", PASSWORD) is not None
    with sqlite3.connect(path) as db:
        assert not stronger.check_needs_rehash(db.execute("SELECT password_hash FROM accounts").fetchone()[0])


def test_sessions_end_by_idle_time_lifetime_disabling_and_a_new_password(tmp_path: Path) -> None:
    now = [T0]
    accounts = ReviewAccounts(tmp_path / "review.sqlite", hasher=HASHER,
                              lifetime=SessionLifetime(ttl_s=3600, idle_s=600), clock=lambda: now[0])
    account = accounts.create("rita", PASSWORD)
    minute = _dt.timedelta(minutes=1)

    token, csrf = accounts.start_session(account)
    with sqlite3.connect(accounts.path) as db:  # the table holds the token's SHA-256, never the token
        assert db.execute("SELECT token_sha256 FROM sessions").fetchall() == [(token_digest(token),)]
    assert accounts.session(token).csrf_token == csrf
    for _ in range(5):  # used every 10 minutes: idle never exceeds 600 s
        now[0] += 10 * minute
        assert accounts.session(token) is not None
    now[0] += 10 * minute  # 60 minutes after login: the absolute lifetime has passed
    assert accounts.session(token) is None and accounts.session_count() == 0

    token, _ = accounts.start_session(account)
    now[0] += 10 * minute + _dt.timedelta(seconds=1)  # idle 601 s
    assert accounts.session(token) is None

    token, _ = accounts.start_session(account)
    accounts.update("rita", disabled=True)
    assert accounts.session_count("rita") == 0 and accounts.session(token) is None
    accounts.update("rita", disabled=False)
    token, _ = accounts.start_session(account)
    accounts.update("rita", password="a brand new password")
    assert accounts.session(token) is None
    token, _ = accounts.start_session(account)
    accounts.end_session(token)
    assert accounts.session(token) is None
    assert accounts.session(None) is None and accounts.session("x" * 300) is None


def test_review_user_commands(site_config: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["review-user", "add", "rita", "--config", str(site_config), "--password-stdin"],
                        input=PASSWORD + "\n")
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["review-user", "add", "sam", "-c", str(site_config)],
                        input="second long password\nsecond long password\n")
    assert res.exit_code == 0 and "second long password" not in res.output, res.output
    db = site_config.parent / "state" / "review.sqlite"
    assert _mode(db) == 0o600
    accounts = ReviewAccounts(db)  # default (strong) parameters: the CLI's hashes verify with them
    assert accounts.authenticate("rita", PASSWORD) and accounts.authenticate("sam", "second long password")
    for args, message in ((["add", "rita", "--password-stdin"], "exists"),
                          (["add", "Bad Name", "--password-stdin"], "username"),
                          (["disable", "nobody"], "does not exist"),
                          (["set-password", "nobody", "--password-stdin"], "does not exist")):
        res = runner.invoke(cli, ["review-user", *args, "-c", str(site_config)], input=PASSWORD + "\n")
        assert res.exit_code == 2 and message in res.output, (args, res.output)
    res = runner.invoke(cli, ["review-user", "add", "tom", "-c", str(site_config), "--password-stdin"],
                        input="short\n")
    assert res.exit_code == 2 and "shorter than 12" in res.output
    assert runner.invoke(cli, ["review-user", "disable", "sam", "-c", str(site_config)]).exit_code == 0
    res = runner.invoke(cli, ["review-user", "list", "-c", str(site_config)])
    lines = {line.split()[1]: line for line in res.output.splitlines() if line.startswith("│")}
    assert "disabled" in lines["sam"] and "active" in lines["rita"] and "tom" not in lines
    assert accounts.authenticate("sam", "second long password") is None
    assert runner.invoke(cli, ["review-user", "enable", "sam", "-c", str(site_config)]).exit_code == 0
    assert accounts.authenticate("sam", "second long password") is not None
    res = runner.invoke(cli, ["review-user", "set-password", "sam", "-c", str(site_config), "--password-stdin"],
                        input="third long password\n")
    assert res.exit_code == 0, res.output
    assert accounts.authenticate("sam", "third long password") and not accounts.authenticate("sam", "second long "
                                                                                                    "password")
