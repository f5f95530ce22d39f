"""The payload of a SOFTWARE envelope: a new version of the gateway SDK, published by the operator.

``wildfed-coordinator publish-update`` publishes, retained, on each gateway's ``software`` topic
(``shared.topics.software_topic``) a SOFTWARE envelope signed with the coordinator's key and addressed to the site,
whose ``base_model_hash`` is the SHA-256 of the SDK wheel and whose ``sequence`` is the release's ``issued`` time.
The gateway installs it beside the running version and switches to it (``edge_sdk.updates``).

Payload: safetensors (``shared.codec``) whose tensors are the wheel files as uint8 vectors named ``wheels/<file>``
(the SDK wheel ``wildfed-<version>-*.whl`` and, optionally, wheels of its dependencies for gateways without a
package index), and whose metadata key ``"wildfed"`` holds the JSON of :class:`SoftwareRelease`. A well-kept
serializer carries the files: nothing on the gateway unpacks an archive from the wire before it is verified, and a
wheel is only ever handed to pip after its SHA-256 matched the signed listing.

Order: ``issued`` (Unix seconds) only grows between the releases of one coordinator; a gateway refuses a release
that is not newer than the last one it acted on, so a replayed old release (a downgrade to a version with a known
flaw) is refused even though its signature is valid. ``version`` is pinned: the gateway moves to exactly that
version (a lower one too, when the operator publishes a rollback as a new release).

Compatibility rules (those of :mod:`shared.protocol`): fields are never removed and never change meaning; new fields
are optional with defaults that keep the old meaning; the decoder rejects unknown fields.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.codec import decode_with_metadata, encode_tensors
from shared.envelope import validate_identifier
from shared.errors import MalformedEnvelopeError, PayloadError

__all__ = ["SoftwareRelease", "WheelFile", "encode_software", "decode_software", "sdk_wheel_version",
           "METADATA_KEY", "WHEEL_PREFIX"]

METADATA_KEY = "wildfed"
WHEEL_PREFIX = "wheels/"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!_-]{0,63}$")  # a PEP 440 version, as a file name may hold it
_WHEEL_NAME = re.compile(r"^[A-Za-z0-9_.+!-]{1,200}\.whl$")
#: Seconds a new version may take to come back (connected to the broker) before it is rolled back, at most.
MAX_CONFIRM_S = 24 * 3600


def sdk_wheel_version(name: str) -> str | None:
    """The version in an SDK wheel's file name (``wildfed-0.2.0-py3-none-any.whl`` -> ``0.2.0``; PEP 427), or None
    when ``name`` is not a WildFed wheel."""
    parts = name[:-4].split("-") if name.endswith(".whl") else []
    return parts[1] if len(parts) >= 5 and parts[0] == "wildfed" else None


@dataclass(frozen=True)
class WheelFile:
    """One file of a release: its name (a ``.whl`` file name, no folders), SHA-256 (hex) and size (bytes)."""

    name: str
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _WHEEL_NAME.match(self.name) or self.name.startswith("."):
            raise PayloadError(f"wheel name {self.name!r:.80} is not a plain .whl file name")
        if not isinstance(self.sha256, str) or not _HEX64.match(self.sha256):
            raise PayloadError(f"wheel {self.name}: sha256 must be 64 lowercase hex characters")
        if type(self.size) is not int or self.size < 1:
            raise PayloadError(f"wheel {self.name}: size must be a positive integer")


@dataclass(frozen=True)
class SoftwareRelease:
    """What a SOFTWARE envelope says about the files it carries.

    Attributes:
        federation_id: the federation (equal to the envelope header's).
        version: the SDK version the gateways move to (the SDK wheel's version).
        issued: Unix seconds the operator published it (equal to the header's ``sequence``; module docstring).
        confirm_within_s: seconds the new version has, from its start, to connect to the broker before the gateway
            rolls back to the version it ran (1 .. :data:`MAX_CONFIRM_S`).
        wheels: the files, the SDK wheel first (``wildfed-<version>-*.whl``).

    Raises:
        PayloadError: a field out of range, or the first wheel is not the SDK wheel of ``version``.
    """

    federation_id: str
    version: str
    issued: int
    confirm_within_s: int
    wheels: tuple[WheelFile, ...]

    def __post_init__(self) -> None:
        try:
            validate_identifier(self.federation_id, "federation_id")
        except MalformedEnvelopeError as exc:
            raise PayloadError(str(exc)) from None
        if not isinstance(self.version, str) or not _VERSION.match(self.version):
            raise PayloadError(f"version {self.version!r:.80} is not a version number")
        if type(self.issued) is not int or self.issued < 1:
            raise PayloadError("issued must be a positive integer (Unix seconds)")
        if type(self.confirm_within_s) is not int or not 1 <= self.confirm_within_s <= MAX_CONFIRM_S:
            raise PayloadError(f"confirm_within_s must be an integer in 1..{MAX_CONFIRM_S}")
        if not self.wheels or sdk_wheel_version(self.wheels[0].name) != self.version:
            raise PayloadError(f"the first wheel must be the SDK wheel wildfed-{self.version}-*.whl")
        if len({w.name for w in self.wheels}) != len(self.wheels):
            raise PayloadError("a wheel is listed twice")

    @property
    def sdk_wheel(self) -> WheelFile:
        """The SDK wheel (the first)."""
        return self.wheels[0]

    def to_json(self) -> dict[str, Any]:
        """The metadata JSON object."""
        return {"federation_id": self.federation_id, "version": self.version, "issued": self.issued,
                "confirm_within_s": self.confirm_within_s,
                "wheels": [{"name": w.name, "sha256": w.sha256, "size": w.size} for w in self.wheels]}


def encode_software(*, federation_id: str, issued: int, confirm_within_s: int,
                    wheels: Mapping[str, bytes]) -> tuple[SoftwareRelease, bytes]:
    """Build a release from wheel files (name -> bytes; the SDK wheel's name first, or any order: it is put first).

    Returns:
        ``(release, payload)``.

    Raises:
        PayloadError: no SDK wheel, two SDK wheels, a bad name, or a field out of range.
    """
    sdk = [name for name in wheels if sdk_wheel_version(name) is not None]
    if len(sdk) != 1:
        raise PayloadError(f"a release holds exactly one SDK wheel (wildfed-*.whl), got {len(sdk)}")
    names = sdk + sorted(n for n in wheels if n != sdk[0])
    listing = tuple(WheelFile(n, hashlib.sha256(wheels[n]).hexdigest(), len(wheels[n])) for n in names)
    release = SoftwareRelease(federation_id=federation_id, version=sdk_wheel_version(sdk[0]) or "", issued=issued,
                              confirm_within_s=confirm_within_s, wheels=listing)
    tensors = {WHEEL_PREFIX + n: np.frombuffer(wheels[n], dtype=np.uint8) for n in names}
    meta = json.dumps(release.to_json(), sort_keys=True, separators=(",", ":"))
    return release, encode_tensors(tensors, {METADATA_KEY: meta})


def decode_software(payload: bytes | memoryview) -> tuple[SoftwareRelease, dict[str, bytes]]:
    """Inverse of :func:`encode_software`: ``(release, {file name: bytes})``, every file checked against the
    listing (name, size, SHA-256).

    Raises:
        PayloadError: not safetensors, malformed or unknown metadata fields, a file missing, extra, not uint8, or
            whose size or SHA-256 differs from the listing.
    """
    fields = set(SoftwareRelease.__dataclass_fields__)
    tensors, body = decode_with_metadata(payload, key=METADATA_KEY, fields=fields, what="software release")
    if set(body) != fields:
        raise PayloadError(f"software release fields missing: {sorted(fields - set(body))}")
    if not isinstance(body["wheels"], list) or not all(isinstance(w, dict) and set(w) == {"name", "sha256", "size"}
                                                       for w in body["wheels"]):
        raise PayloadError("software release wheels must be a list of {name, sha256, size}")
    release = SoftwareRelease(**{**body, "wheels": tuple(WheelFile(**w) for w in body["wheels"])})
    if set(tensors) != {WHEEL_PREFIX + w.name for w in release.wheels}:
        raise PayloadError("the files carried differ from the release's listing")
    files: dict[str, bytes] = {}
    for wheel in release.wheels:
        array = tensors[WHEEL_PREFIX + wheel.name]
        if array.dtype != np.uint8 or array.ndim != 1:
            raise PayloadError(f"file {wheel.name} is not a uint8 vector")
        data = array.tobytes()
        if len(data) != wheel.size or hashlib.sha256(data).hexdigest() != wheel.sha256:
            raise PayloadError(f"file {wheel.name} does not match its listed size and SHA-256")
        files[wheel.name] = data
    return release, files
