"""The secrets of the broker accounts: each identity's credentials file and the Mosquitto password file.

A credentials file (``broker-credentials.yaml``, mode 0600) holds an identity's username and password and those
of its role accounts (``roles``); it is read by :func:`shared.broker.load_broker_credentials`. Existing passwords
are kept unless rotation is asked for.

Password hashing: ``mosquitto_passwd -U`` when the binary exists (Mosquitto 2.0's default, PBKDF2-HMAC-SHA512 with
101 iterations and a 12-byte salt); otherwise the same ``$7$<iterations>$<b64 salt>$<b64 hash>`` line is computed
with :func:`hashlib.pbkdf2_hmac` (format from Mosquitto 2.0's ``apps/mosquitto_passwd`` and
``src/security_default.c``; checked against ``mosquitto_passwd`` 2.0.11 output in the tests). The passwords are
``secrets.token_urlsafe(32)`` (256 random bits), so the low iteration count does not make guessing feasible.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from shared.broker import BrokerCredentials, load_broker_credentials, role_username
from shared.errors import ConfigError
from shared.keys import PRIVATE_KEY_MODE, write_file_atomic

__all__ = ["hash_password_pbkdf2", "verify_password_pbkdf2", "write_password_file", "account_credentials",
           "MOSQUITTO_PBKDF2_ITERATIONS"]

#: Mosquitto 2.0's default PBKDF2 iteration count (``mosquitto_passwd``).
MOSQUITTO_PBKDF2_ITERATIONS = 101
_SALT_BYTES = 12


def _write_credentials(path: Path, creds: BrokerCredentials, *, who: str,
                       roles: Mapping[str, BrokerCredentials] | None = None) -> None:
    body: dict[str, object] = {"username": creds.username, "password": creds.password}
    if roles:
        body["roles"] = {r: {"username": c.username, "password": c.password} for r, c in sorted(roles.items())}
    text = (f"# MQTT broker credentials of {who}, written by `wildfed-coordinator broker-config`.\n"
            "# A secret: keep this file mode 0600 and install it only on that machine.\n"
            + ("# roles: accounts of further clients of the same identity (the broker uses the username as client\n"
               "# id, so two clients sharing one account would disconnect each other).\n" if roles else "")
            + yaml.safe_dump(body, sort_keys=False))
    write_file_atomic(path, text.encode("utf-8"), PRIVATE_KEY_MODE)


def hash_password_pbkdf2(password: str, *, salt: bytes | None = None,
                         iterations: int = MOSQUITTO_PBKDF2_ITERATIONS) -> str:
    """Mosquitto's ``$7$`` hash of ``password``: ``$7$<iterations>$<base64 salt>$<base64 PBKDF2-HMAC-SHA512>``
    (64-byte digest, 12-byte random salt), as ``mosquitto_passwd`` 2.0 writes it after ``username:``."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password_pbkdf2(password: str, hashed: str) -> bool:
    """Whether a ``$7$`` hash (:func:`hash_password_pbkdf2`) is that of ``password``; False for other formats."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7":
        return False
    try:
        iterations, salt, digest = int(parts[2]), base64.b64decode(parts[3]), base64.b64decode(parts[4])
    except ValueError:
        return False
    calc = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations, dklen=len(digest))
    return secrets.compare_digest(calc, digest)


def _read_password_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if ":" in line and not line.startswith("#"):
                user, hashed = line.split(":", 1)
                out[user] = hashed
    return out


def write_password_file(path: Path, accounts: Mapping[str, str], mosquitto_passwd: str | None) -> bool:
    """Write ``user:$7$...`` lines for ``accounts`` (username -> password), keeping the existing hash of each
    unchanged password; new hashes by ``mosquitto_passwd -U`` when given, else by :func:`hash_password_pbkdf2`.
    Returns whether ``mosquitto_passwd`` was run."""
    existing = _read_password_file(path)
    kept = {u: existing[u] for u, p in accounts.items() if u in existing and verify_password_pbkdf2(p, existing[u])}
    fresh = {u: p for u, p in accounts.items() if u not in kept}
    hashed: dict[str, str] = dict(kept)
    used_binary = False
    if fresh and mosquitto_passwd:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".passwd-plain-")
        try:
            os.fchmod(fd, PRIVATE_KEY_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("".join(f"{u}:{p}\n" for u, p in sorted(fresh.items())))
            proc = subprocess.run([mosquitto_passwd, "-U", tmp], capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise ConfigError(f"mosquitto_passwd -U failed ({proc.returncode}): {proc.stderr.strip()[:200]}",
                                  field="mosquitto_passwd", fix="check the mosquitto installation, or pass "
                                  "--no-mosquitto-passwd to hash in Python")
            hashed.update(_read_password_file(Path(tmp)))
            used_binary = True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        hashed.update({u: hash_password_pbkdf2(p) for u, p in fresh.items()})
    text = "".join(f"{u}:{hashed[u]}\n" for u in sorted(accounts))
    write_file_atomic(path, text.encode("utf-8"), PRIVATE_KEY_MODE)
    return used_binary


def account_credentials(path: Path, username: str, *, rotate: bool, who: str, roles: Sequence[str] = ()
                        ) -> tuple[BrokerCredentials, dict[str, BrokerCredentials], list[str]]:
    """The account ``username`` and its role accounts (``roles``) in the credentials file ``path``: existing ones
    are kept (unless ``rotate`` or a username changed), missing ones drawn, roles no longer wanted dropped; the file
    (0600) is rewritten only when something changed. Returns ``(account, {role: account}, new usernames)``."""
    old: BrokerCredentials | None = None
    old_roles: dict[str, BrokerCredentials] = {}
    dropped = False
    if path.is_file() and not rotate:
        try:
            old = load_broker_credentials(path)
        except ConfigError:
            old = None
        if old is not None and old.username != username:
            old = None
        if old is not None:
            for role in roles:
                try:
                    old_roles[role] = load_broker_credentials(path, role=role)
                except ConfigError:
                    pass
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
            stored = raw.get("roles") if isinstance(raw, dict) else None
            dropped = isinstance(stored, dict) and bool(set(stored) - set(roles))
    fresh: list[str] = []
    creds = old
    if creds is None:
        creds = BrokerCredentials(username=username, password=secrets.token_urlsafe(32))
        fresh.append(username)
    accounts: dict[str, BrokerCredentials] = {}
    for role in roles:
        if role in old_roles:
            accounts[role] = old_roles[role]
        else:
            accounts[role] = BrokerCredentials(username=role_username(username, role),
                                               password=secrets.token_urlsafe(32))
            fresh.append(accounts[role].username)
    if fresh or dropped:
        _write_credentials(path, creds, who=who, roles=accounts)
    return creds, accounts, fresh
