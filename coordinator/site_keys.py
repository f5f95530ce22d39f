"""Site keys: a site's public-key file, one key and its validity, and the registry's change counter.

:func:`read_site_key_file` reads the Ed25519 public key an operator passes at enrolment or rotation (PEM, DER or
OpenSSH). :class:`SiteKey` is one key of a site with its grace period and revocation, judged against naive UTC times
(coordinator.storage.utcnow). :func:`mark_keys_changed` and :func:`registry_version` are the ``registry_version`` row
(coordinator.storage.RegistryVersionRow) that every change of a site's keys increments and that every key cache
reads before it trusts itself (coordinator.registry's module docstring, "Key cache and its invalidation").
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.errors import ConfigError
from shared.keys import public_key_from_pem, public_key_to_pem

from coordinator.storage import RegistryVersionRow, Store

__all__ = ["SiteKey", "DEFAULT_GRACE_S", "read_site_key_file", "mark_keys_changed", "registry_version",
           "parse_site_key", "naive_utc"]


#: Default grace period of a rotated-out key, seconds (24 h: a gateway offline for a day can still deliver an
#: update it signed with its old key before it learned of the rotation).
DEFAULT_GRACE_S = 24 * 3600.0


def mark_keys_changed(session: Any) -> None:
    """Increment the registry's change counter (``registry_version``) inside ``session``'s transaction: call it in
    every transaction that adds, removes, rotates or revokes a site key, so every process's key cache notices at its
    next verification once the transaction commits (coordinator.registry's module docstring).

    Args:
        session: an open SQLAlchemy session (its commit publishes the change; a roll-back undoes it).
    """
    bumped = session.execute(update(RegistryVersionRow).where(RegistryVersionRow.id == 1)
                             .values(version=RegistryVersionRow.version + 1)).rowcount
    if not bumped:  # a database from before the counter: the first change creates it (primary key 1: one row)
        session.add(RegistryVersionRow(id=1, version=1))
        session.flush()


def registry_version(store: Store) -> int:
    """The registry's change counter (0 when no key was ever changed through this module); one primary-key read."""
    with store.engine.connect() as conn:
        value = conn.execute(_VERSION_QUERY).scalar()
    return int(value or 0)


_VERSION_QUERY = select(RegistryVersionRow.version).where(RegistryVersionRow.id == 1)


def parse_site_key(pem: str, error: type[Exception], what: str, *, fix: str) -> Ed25519PublicKey:
    """The Ed25519 public key of ``pem``; raises ``error`` (a ConfigError subclass) naming ``what`` when it does not
    parse."""
    try:
        return public_key_from_pem(pem)
    except (ValueError, TypeError) as exc:
        raise error(f"{what} does not parse: {getattr(exc, 'message', exc)}", field="public_key",
                    fix=fix) from exc


def read_site_key_file(path: str | os.PathLike[str]) -> str:
    """The PEM text of the Ed25519 public key in file ``path``, for :meth:`coordinator.registry.SiteRegistry.enrol`
    and :meth:`~coordinator.registry.SiteRegistry.rotate_key`. Accepted: PEM (``-----BEGIN PUBLIC KEY-----``, what
    ``wildfed-edge keygen`` writes; CRLF line ends too), binary DER (SubjectPublicKeyInfo, e.g. ``openssl pkey
    -pubin -outform DER``) and an OpenSSH one-line key (``ssh-ed25519 AAAA...``); DER and OpenSSH are converted to
    PEM.

    Raises:
        ConfigError: missing file, or none of those forms of an Ed25519 key (field ``public_key``; the message
            names the file, says PEM is expected and how to convert a DER file).
    """
    from cryptography.hazmat.primitives import serialization

    path = Path(path)
    if not path.is_file():
        raise ConfigError("public key file not found", source=path, field="public_key",
                          fix="pass the .pub file the gateway wrote (`wildfed-edge keygen`)")
    data = path.read_bytes()
    text = data.lstrip(b"\xef\xbb\xbf").strip()
    if text.startswith(b"-----BEGIN"):
        return text.decode("ascii", errors="replace")  # public_key_from_pem names what is wrong with it
    loaders = ((serialization.load_der_public_key, "DER"), (serialization.load_ssh_public_key, "OpenSSH"))
    for loader, _form in loaders:
        try:
            key = loader(text if loader is serialization.load_ssh_public_key else data)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"key type {type(key).__name__} is not Ed25519", source=path, field="public_key",
                              fix="WildFed verifies Ed25519 signatures only: enrol the key `wildfed-edge keygen` "
                                  "wrote")
        return public_key_to_pem(key)
    raise ConfigError(
        "is not a public key: a PEM file (text starting with -----BEGIN PUBLIC KEY-----) is expected, and it is "
        "neither PEM nor a DER or OpenSSH Ed25519 public key", source=path, field="public_key",
        fix=f"pass the .pub file `wildfed-edge keygen` wrote; to convert another DER key file run `openssl pkey "
            f"-pubin -inform DER -in {path} -out {path}.pem` and pass {path}.pem")

@dataclass(frozen=True)
class SiteKey:
    """One key of a site and its validity.

    Attributes:
        fingerprint: hex SHA-256 of the raw key (shared.keys.key_fingerprint).
        public_key: the Ed25519 verification key.
        current: whether it is the site's current key (``sites.public_key_pem``).
        created_at: when it was recorded (naive UTC; for a key never rotated: the enrolment time).
        valid_until: end of its grace period after a rotation (naive UTC), or None.
        revoked_at: when it was revoked (naive UTC), or None.
    """

    fingerprint: str
    public_key: Ed25519PublicKey
    current: bool
    created_at: _dt.datetime | None
    valid_until: _dt.datetime | None = None
    revoked_at: _dt.datetime | None = None

    def valid_at(self, now: _dt.datetime) -> bool:
        """Whether the key verifies at ``now`` (naive UTC): not revoked, and before ``valid_until`` if set."""
        if self.revoked_at is not None and self.revoked_at <= now:
            return False
        return self.valid_until is None or now < self.valid_until


def naive_utc(moment: _dt.datetime) -> _dt.datetime:
    """``moment`` as naive UTC (aware times are converted; naive ones are taken as UTC already)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(_dt.timezone.utc).replace(tzinfo=None)
    return moment
