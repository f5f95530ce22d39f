"""shared.web_auth, the login policy both web sides use: hashes that argon2-cffi's own verifier accepts, the same
answer (and one hash) for an unknown user, names and passwords refused by rule, tokens and their digests checked
against hashlib, the Origin check and the redirect filter on hand-written cases, session lifetimes at their edges."""

from __future__ import annotations

import datetime as _dt
import hashlib

import pytest
from argon2 import PasswordHasher

from shared.errors import ConfigError
from shared.web_auth import (MIN_PASSWORD_LENGTH, AccountError, PasswordHashing, SessionLifetime, check_password,
                             check_username, new_token, safe_next, same_origin, security_headers,
                             session_cookie_options, token_digest, tokens_match)

CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


class CountingHasher:
    """A PasswordHasher that counts the hashes it makes."""

    def __init__(self) -> None:
        self.inner, self.hashes = CHEAP, 0

    def hash(self, password: str) -> str:
        self.hashes += 1
        return self.inner.hash(password)

    def verify(self, stored: str, password: str) -> bool:
        return self.inner.verify(stored, password)

    def check_needs_rehash(self, stored: str) -> bool:
        return self.inner.check_needs_rehash(stored)


def test_hashes_are_standard_argon2id_and_checked_alike() -> None:
    hashing = PasswordHashing(CHEAP)
    stored = hashing.hash("correct horse battery")
    assert stored.startswith("$argon2id$") and "correct horse" not in stored
    assert PasswordHasher().verify(stored, "correct horse battery")  # the library's own verifier, default params
    assert hashing.verify(stored, "correct horse battery")
    assert not hashing.verify(stored, "correct horse batterx")
    assert not hashing.verify("not a hash", "correct horse battery")
    assert not hashing.verify(stored, None)
    counting = CountingHasher()
    assert not PasswordHashing(counting).verify(None, "anything at all")  # no such account...
    assert counting.hashes == 1  # ...still costs one hash
    stronger = PasswordHashing(PasswordHasher(time_cost=2, memory_cost=16, parallelism=1))
    assert stronger.needs_rehash(stored) and not hashing.needs_rehash(stored)


def test_names_and_passwords_by_rule() -> None:
    assert check_username("ana.b-c_9") == "ana.b-c_9"
    for bad in ("A", "Ana", "a", "-ana", "ana b", "a" * 65, "", None, "ana\n"):
        with pytest.raises(AccountError, match="username"):
            check_username(bad)
    assert check_password("x" * MIN_PASSWORD_LENGTH)
    with pytest.raises(AccountError, match=f"shorter than {MIN_PASSWORD_LENGTH}"):
        check_password("x" * (MIN_PASSWORD_LENGTH - 1))
    with pytest.raises(AccountError, match="shorter"):
        PasswordHashing(CHEAP).hash("short")
    assert issubclass(AccountError, ConfigError)


def test_tokens_digests_and_comparison() -> None:
    tokens = {new_token() for _ in range(50)}
    assert len(tokens) == 50 and all(len(t) == 43 for t in tokens)  # 32 bytes in unpadded base64url
    assert token_digest("abc") == hashlib.sha256(b"abc").hexdigest()
    assert tokens_match("same-token", "same-token")
    assert not tokens_match("same-token", "same-tokeN")
    assert not tokens_match("", "") and not tokens_match(None, "x") and not tokens_match("x", None)


def test_origin_and_next() -> None:
    assert same_origin(None, "gw.local:8081")  # a non-browser client sends no Origin
    assert same_origin("http://gw.local:8081", "gw.local:8081")
    assert not same_origin("http://evil.example", "gw.local:8081")
    assert not same_origin("http://gw.local:8082", "gw.local:8081")
    assert not same_origin("null", "gw.local:8081")
    assert safe_next("/events/e1?order=newest", "/") == "/events/e1?order=newest"
    for bad in ("//evil.example/x", "https://evil.example/", "/\\evil", "", None, "events"):
        assert safe_next(bad, "/events") == "/events"


def test_session_lifetime_edges() -> None:
    life = SessionLifetime(ttl_s=100, idle_s=10)
    t0 = _dt.datetime(2024, 1, 1, 12, 0, 0)
    end = life.expires_at(t0)
    assert end == t0 + _dt.timedelta(seconds=100)
    s = _dt.timedelta(seconds=1)
    assert life.alive(expires_at=end, last_seen_at=t0, now=t0 + 10 * s)  # idle exactly 10 s: still alive
    assert not life.alive(expires_at=end, last_seen_at=t0, now=t0 + 11 * s)
    assert life.alive(expires_at=end, last_seen_at=t0 + 95 * s, now=t0 + 99 * s)
    assert not life.alive(expires_at=end, last_seen_at=t0 + 95 * s, now=t0 + 100 * s)  # absolute end
    for bad in ({"ttl_s": 0}, {"idle_s": -1}):
        with pytest.raises(ConfigError, match="positive"):
            SessionLifetime(**bad)


def test_cookie_options_and_headers() -> None:
    assert session_cookie_options(secure=True) == {"httponly": True, "samesite": "strict", "secure": True,
                                                   "path": "/"}
    assert session_cookie_options(secure=False)["secure"] is False
    h = security_headers("/events")
    assert "script-src 'none'" in h["Content-Security-Policy"] and h["Cache-Control"] == "no-store"
    assert "Cache-Control" not in security_headers("/static/review.css")
