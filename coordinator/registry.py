"""Site registry: who may send updates, with which Ed25519 key, and their public metadata.

Enrolment binds a ``site_id`` to a public key (PEM, shared.keys) and to metadata that the federation declares
*public*: the site's species list (used later by NIRA clustering; CR/EN species are left out by default, see
the privacy semantics of docs/privacy.md), ``capacity`` (the declared capacity N_k: the FedAvg weight and the sampling
rate's denominator, a public constant, never the record count), biome, monitoring period. Nothing else
about a site's data is stored here.

Key rotation and revocation (docs/security.md): a site's *current* key is the one in ``sites`` (what
:meth:`SiteRegistry.get_public_key` returns). :meth:`SiteRegistry.rotate_key` makes a new key current and keeps
the old one valid for a grace period (default 24 h), so updates signed just before the gateway switched keys still
verify; :meth:`SiteRegistry.revoke_key` ends one key, or all of a site's keys, at once. What verifies a site's
messages is :meth:`SiteRegistry.verification_keys`. Times are naive UTC (coordinator.storage.utcnow); tests inject
a clock.

Key cache and its invalidation. Verification keys are cached per site, with their validity
(``valid_until``, ``revoked_at``), which is judged against the clock at every call, so a grace period ends on time
without any invalidation. What changes a site's keys (:meth:`SiteRegistry.enrol`, :meth:`~SiteRegistry.rotate_key`,
:meth:`~SiteRegistry.revoke_key`, provisioning's roll-back of an enrolment) increments the ``registry_version`` row
(coordinator.storage.RegistryVersionRow) in the same transaction, and drops the process's own cache entry after the
commit. Every :meth:`~SiteRegistry.verification_keys` call reads that one integer (one primary-key read, no ORM)
and empties the cache when it moved, so a revocation committed by any process, the CLI included, is seen by the
next verification: no window, no time bound to tune. The version is read before the keys, so keys read after a
revocation are never cached under an older version. Chosen over a time bound (re-read every N seconds), which
would let a revoked key verify for up to N seconds, and over SQLite's ``PRAGMA data_version`` (which moves on
every commit of any table by any other connection, including this process's own pool). A change written to the
tables by hand (SQL, not this module) does not move the counter: run ``wildfed-coordinator keys`` or restart the
coordinator after such an edit (docs/security.md).

The records themselves live beside this module and are re-exported here: :class:`Site` and the metadata checks in
coordinator.site_metadata; :class:`SiteKey`, :func:`read_site_key_file` and the change counter in
coordinator.site_keys.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import select
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.envelope import BROADCAST_SITE_ID, validate_identifier
from shared.errors import ConfigError, MalformedEnvelopeError
from shared.keys import key_fingerprint, public_key_from_pem, public_key_to_pem

from coordinator.site_keys import (DEFAULT_GRACE_S, SiteKey, mark_keys_changed, naive_utc, parse_site_key,
                                   read_site_key_file, registry_version)
from coordinator.site_metadata import SITE_ID_PATTERN, EnrolmentError, Site, validate_metadata
from coordinator.storage import SiteKeyRow, SiteRow, Store, dumps, utcnow

__all__ = ["Site", "SiteKey", "SiteRegistry", "EnrolmentError", "UnknownSiteError", "KeyRotationError",
           "SITE_ID_PATTERN", "DEFAULT_GRACE_S", "read_site_key_file", "mark_keys_changed", "registry_version"]


class UnknownSiteError(ConfigError):
    """A site id that was never enrolled."""


class KeyRotationError(ConfigError):
    """A key rotation or revocation was refused (bad key, key already used or revoked, unknown fingerprint)."""


class SiteRegistry:
    """Enrol, list and look up sites in a :class:`~coordinator.storage.Store`.

    Public keys are parsed once and cached; the cache is rebuilt from the database on a miss, so a second
    process that enrols a site is seen by a running coordinator. The keys that verify a site
    (:meth:`verification_keys`) are cached with their validity and dropped whenever the registry's change counter
    moves (module docstring): a revocation committed by this or any other process counts at the next verification.

    A site's key is its own: enrolment and rotation refuse a key that another site has, or had
    (a signature must name one site), and the coordinator's own key (:meth:`reserve`; the CLI and
    :class:`coordinator.service.Coordinator` reserve it), which would let the coordinator's messages pass as the
    site's and the site's as the coordinator's.

    Args:
        store: the coordinator's store.
        clock: current time as naive UTC (default :func:`coordinator.storage.utcnow`); tests inject one.
        reserved_keys: keys no site may have (the coordinator's public key).
    """

    def __init__(self, store: Store, *, clock: Callable[[], _dt.datetime] = utcnow,
                 reserved_keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._store = store
        self._cache: dict[str, Site] = {}
        self._keys_cache: dict[str, list[SiteKey]] = {}  # site -> every key with its validity (keys())
        self._keys_version: int | None = None  # the registry_version the cache was read at
        self._clock = clock
        self._reserved = {key_fingerprint(k) for k in reserved_keys}

    def reserve(self, public_key: Ed25519PublicKey) -> None:
        """Refuse ``public_key`` as any site's key from now on (the coordinator's own key)."""
        self._reserved.add(key_fingerprint(public_key))

    def _check_key_is_new(self, s: Any, public_key: Ed25519PublicKey, site_id: str, error: type[ConfigError]) -> None:
        """Refuse the coordinator's key and a key that another site has or had (every ``sites`` and ``site_keys``
        row is read: a key rotated out stays another site's)."""
        fp = key_fingerprint(public_key)
        if fp in self._reserved:
            raise error(f"the public key given for site {site_id!r} is the coordinator's own key", field="public_key",
                        fix="pass the site's key: the .pub file `wildfed-edge keygen` wrote on the gateway, not "
                            "the coordinator's keys/coordinator.pub")
        holders = {r.site_id for r in s.scalars(select(SiteKeyRow).where(SiteKeyRow.fingerprint == fp))}
        holders |= {sid for sid, pem in s.execute(select(SiteRow.site_id, SiteRow.public_key_pem))
                    if key_fingerprint(public_key_from_pem(pem)) == fp}
        holders.discard(site_id)
        if holders:
            raise error(f"the public key given for site {site_id!r} is already the key of site "
                        f"{sorted(holders)[0]!r} (fingerprint {fp[:16]})", field="public_key",
                        fix=f"generate a key pair on {site_id}'s own gateway (`wildfed-edge keygen`) and pass its "
                            ".pub file: each site signs with its own key")

    def enrol(self, site_id: str, public_key_pem: str, metadata: Mapping[str, Any] | None = None) -> Site:
        """Enrol a new site.

        Args:
            site_id: topic-safe id (letters, digits, ``_.-``; at most 64 characters).
            public_key_pem: Ed25519 public key, PEM text (shared.keys.public_key_to_pem).
            metadata: public metadata (see :class:`Site`).

        Returns:
            The enrolled :class:`Site`.

        Raises:
            EnrolmentError: bad id, unparsable key, bad metadata, the site id is already enrolled (re-enrolment
                with a new key is a deliberate operator act and is not done silently), or the key is the
                coordinator's or another site's (nothing is written then).
        """
        try:
            validate_identifier(site_id, "site_id")
        except MalformedEnvelopeError:
            site_id_ok = False
        else:
            site_id_ok = bool(SITE_ID_PATTERN.match(site_id))
        if not site_id_ok:
            raise EnrolmentError(f"site id {site_id!r} is not topic-safe", field="site_id",
                                 fix="use letters, digits, '_', '.', '-' (no '/', '+', '#', spaces)")
        if site_id == BROADCAST_SITE_ID:
            raise EnrolmentError(f"site id {site_id!r} is reserved: it addresses the models every site reads "
                                 "(docs/protocol.md, 'Models by digest')", field="site_id",
                                 fix="choose another site id")
        public_key = parse_site_key(public_key_pem, EnrolmentError, f"public key of site {site_id!r}",
                                     fix="pass the site's Ed25519 public key PEM (the .pub file of `wildfed-edge "
                                     "keygen`)")
        meta = validate_metadata(site_id, metadata or {})
        with self._store.session() as s:
            if s.get(SiteRow, site_id) is not None:
                raise EnrolmentError(f"site {site_id!r} is already enrolled", field="site_id",
                                     fix="choose another site id, or remove the old enrolment deliberately first")
            self._check_key_is_new(s, public_key, site_id, EnrolmentError)
            s.add(SiteRow(site_id=site_id, public_key_pem=public_key_to_pem(public_key), metadata_json=dumps(meta)))
            mark_keys_changed(s)
        site = Site(site_id=site_id, public_key=public_key, metadata=meta)
        self._cache[site_id] = site
        self._keys_cache.pop(site_id, None)
        return site

    def _from_row(self, row: SiteRow) -> Site:
        return Site(site_id=row.site_id, public_key=public_key_from_pem(row.public_key_pem),
                    metadata=json.loads(row.metadata_json or "{}"))

    def get(self, site_id: str) -> Site:
        """The enrolled site ``site_id``; raises :class:`UnknownSiteError` if it was never enrolled."""
        site = self._cache.get(site_id)
        if site is not None:
            return site
        with self._store.session() as s:
            row = s.get(SiteRow, site_id)
            if row is None:
                raise UnknownSiteError(f"site {site_id!r} is not enrolled", field="site_id",
                                       fix="enrol it with `wildfed-coordinator enrol SITE --public-key FILE`")
            site = self._from_row(row)
        self._cache[site_id] = site
        return site

    def get_public_key(self, site_id: str) -> Ed25519PublicKey:
        """The site's Ed25519 verification key; raises :class:`UnknownSiteError`."""
        return self.get(site_id).public_key

    def is_enrolled(self, site_id: str) -> bool:
        """Whether ``site_id`` is enrolled (no exception)."""
        try:
            self.get(site_id)
        except UnknownSiteError:
            return False
        return True

    def list(self) -> list[Site]:
        """Every enrolled site, sorted by id."""
        with self._store.session() as s:
            rows = list(s.scalars(select(SiteRow).order_by(SiteRow.site_id)))
            return [self._from_row(r) for r in rows]

    # ---- key rotation and revocation ---------------------------------------------------------------------------
    def _now(self, now: _dt.datetime | None) -> _dt.datetime:
        return naive_utc(now if now is not None else self._clock())

    @staticmethod
    def _unknown(site_id: str) -> UnknownSiteError:
        return UnknownSiteError(f"site {site_id!r} is not enrolled", field="site_id",
                                fix="enrol it with `wildfed-coordinator enrol SITE --public-key FILE`")

    @staticmethod
    def _key_rows(s: Any, site_id: str) -> list[SiteKeyRow]:
        return list(s.scalars(select(SiteKeyRow).where(SiteKeyRow.site_id == site_id).order_by(SiteKeyRow.id)))

    @staticmethod
    def _materialise_current(s: Any, row: SiteRow, rows: list[SiteKeyRow]) -> SiteKeyRow:
        """The ``site_keys`` row of the site's current key, added (valid, created at enrolment) if missing."""
        current_fp = key_fingerprint(public_key_from_pem(row.public_key_pem))
        for key_row in rows:
            if key_row.fingerprint == current_fp:
                return key_row
        key_row = SiteKeyRow(site_id=row.site_id, fingerprint=current_fp, public_key_pem=row.public_key_pem,
                             created_at=row.enrolled_at or utcnow())
        s.add(key_row)
        rows.append(key_row)
        return key_row

    def keys(self, site_id: str) -> list[SiteKey]:
        """Every key the site has had (current first, then newest first), valid or not; read from the database.

        Raises:
            UnknownSiteError: ``site_id`` is not enrolled.
        """
        with self._store.session() as s:
            row = s.get(SiteRow, site_id)
            if row is None:
                raise self._unknown(site_id)
            current = public_key_from_pem(row.public_key_pem)
            current_fp = key_fingerprint(current)
            out: dict[str, SiteKey] = {}
            for key_row in self._key_rows(s, site_id):
                out[key_row.fingerprint] = SiteKey(
                    fingerprint=key_row.fingerprint, public_key=public_key_from_pem(key_row.public_key_pem),
                    current=key_row.fingerprint == current_fp, created_at=key_row.created_at,
                    valid_until=key_row.valid_until, revoked_at=key_row.revoked_at)
            if current_fp not in out:  # never rotated or revoked: the enrolment key, valid
                out[current_fp] = SiteKey(fingerprint=current_fp, public_key=current, current=True,
                                          created_at=row.enrolled_at)
        newest_first = sorted(out.values(), key=lambda k: k.created_at or _dt.datetime.min, reverse=True)
        return sorted(newest_first, key=lambda k: not k.current)  # stable: current first, then newest first

    def verification_keys(self, site_id: str, now: _dt.datetime | None = None) -> list[tuple[str, Ed25519PublicKey]]:
        """The keys that verify ``site_id``'s messages at ``now``: ``[(fingerprint, key), ...]``, current first.

        Cached per site; the cache is emptied whenever the registry's change counter moved, which this call reads
        every time (one primary-key read), so a rotation or revocation committed by any process counts at once.
        Validity is judged at ``now`` on every call. An empty list means the site may not send anything (every key
        revoked or past its grace period).

        Args:
            site_id: the site.
            now: the time to judge validity at (naive or aware UTC); default the registry's clock.

        Raises:
            UnknownSiteError: ``site_id`` is not enrolled.
        """
        moment = self._now(now)
        version = registry_version(self._store)  # before the keys: keys read later are at least this new
        if version != self._keys_version:
            self._keys_cache.clear()
            self._keys_version = version
        keys = self._keys_cache.get(site_id)
        if keys is None:
            keys = self.keys(site_id)  # raises UnknownSiteError (never cached)
            self._keys_cache[site_id] = keys
        return [(k.fingerprint, k.public_key) for k in keys if k.valid_at(moment)]

    def rotate_key(self, site_id: str, new_public_key_pem: str, *, grace_s: float = DEFAULT_GRACE_S,
                   now: _dt.datetime | None = None) -> SiteKey:
        """Make ``new_public_key_pem`` the site's current key; the old current key stays valid for ``grace_s``.

        Keys still in an earlier grace period keep their own (earlier) end. The new key becomes what
        :meth:`get_public_key` returns, here at once and in other processes after their cache is refreshed
        (verification uses :meth:`verification_keys`, whose cache the change counter invalidates everywhere).

        Args:
            site_id: an enrolled site.
            new_public_key_pem: the site's new Ed25519 public key (PEM, shared.keys.public_key_to_pem).
            grace_s: seconds the old key stays valid (>= 0; 0 ends it at once).
            now: the rotation time (naive or aware UTC); default the registry's clock.

        Returns:
            The new current :class:`SiteKey`.

        Raises:
            UnknownSiteError: ``site_id`` is not enrolled.
            KeyRotationError: the PEM does not parse, ``grace_s`` is negative or not finite, the key is the
                current one or was used by this site before (a key is never brought back after rotation or
                revocation), or it is the coordinator's or another site's.
        """
        if not isinstance(grace_s, (int, float)) or not grace_s >= 0 or grace_s == float("inf"):
            raise KeyRotationError(f"grace period {grace_s!r} s is not a finite number >= 0", field="grace_s",
                                   fix="give the hours the old key stays valid, e.g. --grace-hours 24")
        new_key = parse_site_key(new_public_key_pem, KeyRotationError, f"new public key of site {site_id!r}",
                                  fix="pass the site's new Ed25519 public key PEM (.pub)")
        new_fp = key_fingerprint(new_key)
        moment = self._now(now)
        with self._store.session() as s:
            row = s.get(SiteRow, site_id, with_for_update=True)
            if row is None:
                raise self._unknown(site_id)
            rows = self._key_rows(s, site_id)
            old = self._materialise_current(s, row, rows)
            if any(r.fingerprint == new_fp for r in rows):
                raise KeyRotationError(f"key {new_fp[:16]} was already used by site {site_id!r}", field="public_key",
                                       fix="generate a fresh key pair on the gateway (`wildfed-edge keygen`)")
            self._check_key_is_new(s, new_key, site_id, KeyRotationError)
            end = moment + _dt.timedelta(seconds=float(grace_s))
            if old.valid_until is None or end < old.valid_until:
                old.valid_until = end
            pem = public_key_to_pem(new_key)
            s.add(SiteKeyRow(site_id=site_id, fingerprint=new_fp, public_key_pem=pem, created_at=moment))
            row.public_key_pem = pem
            meta = json.loads(row.metadata_json or "{}")
            mark_keys_changed(s)
        self._cache[site_id] = Site(site_id=site_id, public_key=new_key, metadata=meta)
        self._keys_cache.pop(site_id, None)
        return SiteKey(fingerprint=new_fp, public_key=new_key, current=True, created_at=moment)

    def revoke_key(self, site_id: str, fingerprint: str | None = None, *,
                   now: _dt.datetime | None = None) -> list[str]:
        """Revoke one key of a site (``fingerprint``: the full hex or a unique prefix of >= 8 characters), or,
        with ``fingerprint=None``, every key of the site, effective at ``now``. A site with no valid key left
        cannot send anything until it is rotated to a fresh key.

        Returns:
            The fingerprints revoked by this call (already-revoked keys are not repeated; empty if none was left).

        Raises:
            UnknownSiteError: ``site_id`` is not enrolled.
            KeyRotationError: no key, or more than one, of the site matches ``fingerprint``.
        """
        moment = self._now(now)
        with self._store.session() as s:
            row = s.get(SiteRow, site_id, with_for_update=True)
            if row is None:
                raise self._unknown(site_id)
            rows = self._key_rows(s, site_id)
            self._materialise_current(s, row, rows)
            if fingerprint is None:
                targets = rows
            else:
                wanted = fingerprint.strip().lower()
                if len(wanted) < 8:
                    raise KeyRotationError(f"fingerprint prefix {fingerprint!r} is shorter than 8 characters",
                                           field="fingerprint", fix="give at least 8 hex characters (see "
                                           "`wildfed-coordinator keys SITE`)")
                targets = [r for r in rows if r.fingerprint.startswith(wanted)]
                if len(targets) != 1:
                    known = ", ".join(r.fingerprint[:16] for r in rows)
                    raise KeyRotationError(
                        f"{'no' if not targets else 'more than one'} key of site {site_id!r} matches fingerprint "
                        f"{fingerprint!r}", field="fingerprint",
                        fix=f"give the full fingerprint or a unique prefix of >= 8 hex characters (keys: {known})")
            revoked = []
            for key_row in targets:
                if key_row.revoked_at is None:
                    key_row.revoked_at = moment
                    revoked.append(key_row.fingerprint)
            mark_keys_changed(s)
        self._keys_cache.pop(site_id, None)  # committed: this process never verifies with the revoked key again
        return revoked
