"""An enrolled site and its public metadata: the :class:`Site` record, the topic-safe id pattern, and the checks
enrolment applies to the metadata (coordinator.registry enrols; docs/privacy.md says what may be public).

The metadata a federation declares public: the site's species list (used later by NIRA clustering; CR/EN species
are left out by default), ``capacity`` (the declared capacity N_k, a public constant, never the record count),
biome, monitoring period. :func:`validate_metadata` refuses the exact record count (``num_examples``) and malformed
values with an :class:`EnrolmentError` naming the field and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.errors import ConfigError
from shared.keys import key_fingerprint

__all__ = ["Site", "EnrolmentError", "SITE_ID_PATTERN", "validate_metadata"]

#: Site ids travel inside MQTT topics and file names (shared.envelope.validate_identifier): no wildcards, no
#: slashes, no spaces, at most 64 characters.
SITE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class EnrolmentError(ConfigError):
    """Enrolment refused (duplicate site, bad id, bad key or metadata); the message names the field and the fix."""


@dataclass(frozen=True)
class Site:
    """An enrolled site.

    Attributes:
        site_id: topic-safe identifier (``SITE_ID_PATTERN``).
        public_key: the site's Ed25519 verification key.
        metadata: public metadata (JSON object): ``capacity`` (int >= 1: the site's declared capacity, a public
            constant the operator chooses without looking at the exact record count, docs/privacy.md "No uncharged
            counts"), ``species`` (list of str), ``biome`` (str), ... .
    """

    site_id: str
    public_key: Ed25519PublicKey
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def capacity(self) -> int | None:
        """The site's declared capacity N_k (public: its sampling rate's denominator and FedAvg weight), or None if
        not declared. A site enrolled with the older ``num_examples`` key has that value as its capacity (it was
        released at enrolment already)."""
        n = self.metadata.get("capacity", self.metadata.get("num_examples"))
        return int(n) if n is not None else None

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the raw public key (shared.keys.key_fingerprint)."""
        return key_fingerprint(self.public_key)


def validate_metadata(site_id: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``metadata`` (a JSON object) once it is fit to enrol site ``site_id`` with; raises
    :class:`EnrolmentError` naming the field when it is not JSON, declares ``num_examples``, or has a malformed
    ``capacity``, ``species`` or ``categories``."""
    meta = dict(metadata)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise EnrolmentError(f"metadata of site {site_id!r} is not JSON-serialisable: {exc}", field="metadata",
                             fix="pass a JSON object of strings, numbers and lists") from exc
    if "num_examples" in meta:
        raise EnrolmentError(f"metadata.num_examples of site {site_id!r}: a site's exact record count would leave it "
                             "uncharged (it tells neighbouring datasets apart)", field="metadata.num_examples",
                             fix="declare the site's capacity instead, a round number chosen without counting the "
                                 'records (e.g. its expected photos a year): --metadata \'{"capacity": 1000}\'')
    if "capacity" in meta:
        n = meta["capacity"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EnrolmentError(f"metadata.capacity of site {site_id!r} is {n!r}", field="metadata.capacity",
                                 fix="give a positive integer: the site's declared capacity (docs/privacy.md)")
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
