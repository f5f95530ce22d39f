"""Typed errors shared by the gateway and the coordinator.

Every error that a user can cause names *where* (the file or message), *which field*, and *how to fix it*, so that
an operator reading a log line knows what to change. Library code never turns an error into a catch-all "unknown";
callers catch the narrowest class they can handle.

Hierarchy::

    WildFedError
    ├── ConfigError (also ValueError)      bad configuration value or file
    │   └── DatasetError                   bad Camtrap DP package / local dataset
    ├── EnvelopeError                      a wire message that must be rejected
    │   ├── MalformedEnvelopeError         bytes do not parse as an envelope
    │   │   └── UnsupportedVersionError    a format version this reader does not read (retired or newer)
    │   ├── SignatureError                 signature, payload digest or length does not verify
    │   └── PayloadError                   payload does not decode or has the wrong tensors
    └── PrivacyBudgetError                 an action would pass a privacy budget
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "tagged_fields",
    "WildFedError",
    "ConfigError",
    "DatasetError",
    "EnvelopeError",
    "MalformedEnvelopeError",
    "UnsupportedVersionError",
    "SignatureError",
    "PayloadError",
    "PrivacyBudgetError",
]


class WildFedError(Exception):
    """Base class of every error WildFed raises on purpose."""


class ConfigError(WildFedError, ValueError):
    """A configuration value or file is invalid.

    Args:
        message: what is wrong.
        source: the file (or other origin) the value came from, if known.
        field: the dotted name of the offending field, if known.
        fix: one sentence telling the user what to change.

    The string form is ``"<source>: <field>: <message> (fix: <fix>)"`` with absent parts left out.
    """

    def __init__(self, message: str, *, source: object | None = None, field: str | None = None,
                 fix: str | None = None) -> None:
        self.message = message
        self.source = None if source is None else str(source)
        self.field = field
        self.fix = fix
        parts = [p for p in (self.source, field) if p]
        text = ": ".join(parts + [message]) if parts else message
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class DatasetError(ConfigError):
    """A local dataset (Camtrap DP package, manifest, media file) is missing, incomplete or inconsistent."""


class EnvelopeError(WildFedError):
    """A wire message that must be rejected; ``reason`` is a short machine-readable tag used in counts."""

    reason = "envelope"


class MalformedEnvelopeError(EnvelopeError):
    """The bytes do not parse as a WildFed envelope (bad magic, truncated, bad header JSON or fields)."""

    reason = "malformed"


class UnsupportedVersionError(MalformedEnvelopeError):
    """A wire message in a format version this reader does not read: a retired one (e.g. envelope format 1 or
    ``WFC1`` chunks, retired by the hash-once design of ``shared.envelope``) or a newer one. The message names the
    version and the fix: run the same WildFed release on the gateway and the coordinator."""

    reason = "unsupported_version"


class SignatureError(EnvelopeError):
    """The Ed25519 signature, the payload digest (``shared.envelope``) or the payload length does not verify."""

    reason = "bad_signature"


class PayloadError(EnvelopeError):
    """The payload does not decode (not safetensors, bad metadata) or carries the wrong tensors."""

    reason = "malformed_payload"


class PrivacyBudgetError(WildFedError):
    """An action would pass a privacy budget (epsilon of a site and IUCN category)."""


def tagged_fields(data: Any, kind: str, names: set[str], what: str) -> dict[str, Any]:
    """The fields of a JSON object tagged ``"type": kind`` (the tag removed), when they are exactly ``names``: how
    the DP events and the secure-aggregation messages are read from the wire.

    Raises:
        PayloadError: not an object of that type (``unknown <what> ...``), or other fields than ``names``.
    """
    if not isinstance(data, dict) or data.get("type") != kind:
        raise PayloadError(f"unknown {what} {data!r:.80}: expected type {kind!r}")
    fields = {k: v for k, v in data.items() if k != "type"}
    if set(fields) != names:
        raise PayloadError(f"{what} fields wrong: {sorted(fields)}, expected {sorted(names)}")
    return fields
