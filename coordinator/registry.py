"""Site registry: who may send updates, with which Ed25519 key, and their public metadata.

Enrolment binds a ``site_id`` to a public key (PEM, shared.keys) and to metadata that the federation declares
*public*: the site's species list (used later by NIRA clustering; CR/EN species are left out by default, see
DESIGN.md "Privacy semantics"), ``num_examples`` (the FedAvg weight N_k), biome, monitoring period. Nothing else
about a site's data is stored here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.envelope import validate_identifier
from shared.errors import ConfigError, MalformedEnvelopeError
from shared.keys import key_fingerprint, public_key_from_pem, public_key_to_pem

from coordinator.storage import SiteRow, Store, dumps

__all__ = ["Site", "SiteRegistry", "EnrolmentError", "UnknownSiteError", "SITE_ID_PATTERN"]

#: Site ids travel inside MQTT topics and file names (shared.envelope.validate_identifier): no wildcards, no
#: slashes, no spaces, at most 64 characters.
SITE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class EnrolmentError(ConfigError):
    """Enrolment refused (duplicate site, bad id, bad key or metadata); the message names the field and the fix."""


class UnknownSiteError(ConfigError):
    """A site id that was never enrolled."""


@dataclass(frozen=True)
class Site:
    """An enrolled site.

    Attributes:
        site_id: topic-safe identifier (``SITE_ID_PATTERN``).
        public_key: the site's Ed25519 verification key.
        metadata: public metadata (JSON object): ``species`` (list of str), ``num_examples`` (int >= 1),
            ``biome`` (str), ... .
    """

    site_id: str
    public_key: Ed25519PublicKey
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_examples(self) -> int | None:
        """Declared (public) number of local records, or None if not declared."""
        n = self.metadata.get("num_examples")
        return int(n) if n is not None else None

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the raw public key (shared.keys.key_fingerprint)."""
        return key_fingerprint(self.public_key)


def _validate_metadata(site_id: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    meta = dict(metadata)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise EnrolmentError(f"metadata of site {site_id!r} is not JSON-serialisable: {exc}", field="metadata",
                             fix="pass a JSON object of strings, numbers and lists") from exc
    if "num_examples" in meta:
        n = meta["num_examples"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EnrolmentError(f"metadata.num_examples of site {site_id!r} is {n!r}", field="metadata.num_examples",
                                 fix="give a positive integer count of local records")
    if "species" in meta:
        sp = meta["species"]
        if not isinstance(sp, list) or not all(isinstance(x, str) for x in sp):
            raise EnrolmentError(f"metadata.species of site {site_id!r} must be a list of names", field="metadata.species",
                                 fix='give e.g. ["Loxodonta cyclotis", "Giraffa camelopardalis"]')
    if "categories" in meta:
        from shared.iucn import IUCNCategory

        cats = meta["categories"]
        valid = {c.value for c in IUCNCategory}
        if not isinstance(cats, list) or not all(isinstance(c, str) and c in valid for c in cats):
            raise EnrolmentError(f"metadata.categories of site {site_id!r} is {cats!r}", field="metadata.categories",
                                 fix=f"list IUCN codes from {sorted(valid)}")
    return meta


class SiteRegistry:
    """Enrol, list and look up sites in a :class:`~coordinator.storage.Store`.

    Public keys are parsed once and cached; the cache is rebuilt from the database on a miss, so a second
    process that enrols a site is seen by a running coordinator.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._cache: dict[str, Site] = {}

    def enrol(self, site_id: str, public_key_pem: str, metadata: Mapping[str, Any] | None = None) -> Site:
        """Enrol a new site.

        Args:
            site_id: topic-safe id (letters, digits, ``_.-``; at most 64 characters).
            public_key_pem: Ed25519 public key, PEM text (shared.keys.public_key_to_pem).
            metadata: public metadata (see :class:`Site`).

        Returns:
            The enrolled :class:`Site`.

        Raises:
            EnrolmentError: bad id, unparsable key, bad metadata, or the site id is already enrolled (re-enrolment
                with a new key is a deliberate operator act and is not done silently).
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
        try:
            public_key = public_key_from_pem(public_key_pem)
        except (ValueError, TypeError) as exc:
            raise EnrolmentError(f"public key of site {site_id!r} does not parse: {getattr(exc, 'message', exc)}",
                                 field="public_key",
                                 fix="pass the site's Ed25519 public key PEM (the .pub file of `wildfed-edge keygen`)") from exc
        meta = _validate_metadata(site_id, metadata or {})
        with self._store.session() as s:
            if s.get(SiteRow, site_id) is not None:
                raise EnrolmentError(f"site {site_id!r} is already enrolled", field="site_id",
                                     fix="choose another site id, or remove the old enrolment deliberately first")
            s.add(SiteRow(site_id=site_id, public_key_pem=public_key_to_pem(public_key), metadata_json=dumps(meta)))
        site = Site(site_id=site_id, public_key=public_key, metadata=meta)
        self._cache[site_id] = site
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
