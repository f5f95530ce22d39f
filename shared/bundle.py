"""The provisioning bundle: one tar file the coordinator writes for a new gateway and the gateway installs.

Both sides speak this format and never import each other, so it lives here: ``coordinator.provisioning`` writes it
with :func:`write_bundle`; ``edge_sdk.bundle`` reads it with :func:`read_bundle`, which verifies before anything
is written to disk.

Layout (every member a regular file; names relative, ``/``-separated, no ``..``, no links)::

    manifest.json                  format, federation, site, profile, created, ``models`` (which graph is which),
                                   and every other member's SHA-256, size and mode
    manifest.sig                   Ed25519 signature of manifest.json by the coordinator's key
    profile.yaml                   the gateway profile (shared.profiles)
    site.yaml                      the site config (edge_sdk.config), paths relative to the install prefix
    keys/site.key                  the site's fresh Ed25519 private key, PEM, mode 0600 (exists nowhere else)
    keys/site.pub                  its public key (enrolled at the coordinator)
    keys/coordinator.pub           the coordinator's public key
    keys/broker-ca.pem             the broker's CA (optional)
    systemd/wildfed-edge.service   unit template: @PREFIX@, @EXEC@, @USER@ are filled in at install
    wheels/<name>.whl              the WildFed SDK wheel (``wildfed-*.whl``), optionally with the wheels of its
                                   dependencies: the gateway then installs offline from them
    models/backbone/<name>.onnx    the site's backbone embedder, exported at provisioning
                                   (``shared.models.gateway_graphs``; e.g.
                                   ``efficientnet-lite0-579344248a93-p1-128px-opset17.onnx``, 13.5 MB)
    models/detector/<name>.onnx    the YOLOX-tiny detector (``yolox_tiny-31f8690fc62f-opset17.onnx``, 20.2 MB)

The graphs are members like any other: listed with their SHA-256 in the signed manifest, so a changed graph is
refused like a changed key. The manifest's ``models`` maps each role (``backbone``, ``detector``) to
``{"member", "sha256", "size"}`` plus, for the backbone, ``backbone``, ``input_size`` and ``backbone_id``. A bundle
without graphs (written before they were added) still installs; ``wildfed-edge check-config`` then reports them
missing on a gateway that cannot export them (no torch).

What the checks buy: the per-member SHA-256 catches corruption and a member changed after signing; the signature
catches a rewritten manifest unless the attacker also replaced ``keys/coordinator.pub``, which is why the
installer prints the coordinator key's fingerprint and can pin it (``--coordinator-fingerprint``). The bundle holds
a private key: move it like one (mode 0600, delete it after install).

Compatibility: members may be added (readers ignore none: an unlisted member is an error, so add them to the
manifest); the meaning of a member name never changes; ``format`` changes when that rule would be broken.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.errors import ConfigError
from shared.keys import key_fingerprint, public_key_from_pem

__all__ = [
    "BUNDLE_FORMAT", "MANIFEST", "SIGNATURE", "PROFILE", "SITE_CONFIG", "SITE_KEY", "SITE_PUBLIC_KEY",
    "COORDINATOR_PUBLIC_KEY", "BROKER_CA", "SYSTEMD_UNIT", "WHEELS_DIR", "MODELS_DIR", "BundleError", "BundleMember",
    "Bundle",
    "check_member_name", "write_bundle", "read_bundle",
]

BUNDLE_FORMAT = "wildfed-bundle/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
PROFILE = "profile.yaml"
SITE_CONFIG = "site.yaml"
SITE_KEY = "keys/site.key"
SITE_PUBLIC_KEY = "keys/site.pub"
COORDINATOR_PUBLIC_KEY = "keys/coordinator.pub"
BROKER_CA = "keys/broker-ca.pem"
SYSTEMD_UNIT = "systemd/wildfed-edge.service"
WHEELS_DIR = "wheels"
MODELS_DIR = "models"

MAX_MEMBERS = 64
MAX_MEMBER_BYTES = 512 * 1024 * 1024
_REQUIRED = (PROFILE, SITE_CONFIG, SITE_KEY, SITE_PUBLIC_KEY, COORDINATOR_PUBLIC_KEY, SYSTEMD_UNIT)


class BundleError(ConfigError):
    """A bundle that must not be installed (tampered, unsafe member, malformed); names the member and the fix."""


@dataclass(frozen=True)
class BundleMember:
    """One file of a bundle: ``name`` (relative, ``/``-separated), ``data``, POSIX ``mode``."""

    name: str
    data: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: the manifest (parsed) and every member's bytes by name (manifest and signature
    excluded)."""

    manifest: dict[str, Any]
    members: dict[str, bytes]

    @property
    def site_id(self) -> str:
        return str(self.manifest["site_id"])

    @property
    def federation_id(self) -> str:
        return str(self.manifest["federation_id"])

    @property
    def coordinator_fingerprint(self) -> str:
        """Hex SHA-256 of the bundled coordinator public key (compare it with the operator's)."""
        return key_fingerprint(public_key_from_pem(self.members[COORDINATOR_PUBLIC_KEY]))

    def mode(self, name: str) -> int:
        """POSIX mode recorded for member ``name``."""
        return int(self.manifest["members"][name]["mode"])

    def wheels(self) -> list[str]:
        """Member names of the bundled wheels."""
        return sorted(n for n in self.members if n.startswith(f"{WHEELS_DIR}/") and n.endswith(".whl"))

    def models(self) -> list[str]:
        """Member names of the bundled ONNX graphs (``models/<role>/<name>.onnx``)."""
        return sorted(n for n in self.members if n.startswith(f"{MODELS_DIR}/") and n.endswith(".onnx"))


def check_member_name(name: str) -> str:
    """Return ``name`` if it is a safe relative member name.

    Raises:
        BundleError: absolute, empty, ``..`` or ``.`` components, backslashes, or control characters.
    """
    fix = "the bundle is malformed or tampered with: ask the operator for a fresh one"
    if not name or name.startswith("/") or "\\" in name or any(ord(c) < 32 for c in name):
        raise BundleError(f"unsafe member name {name!r} (absolute or odd characters)", field=name, fix=fix)
    parts = PurePosixPath(name).parts
    if any(p in ("..", ".", "") for p in name.split("/")) or not parts:
        raise BundleError(f"unsafe member name {name!r} (path traversal)", field=name, fix=fix)
    return name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bundle(out: IO[bytes], members: Iterable[BundleMember], *, signing_key: Ed25519PrivateKey,
                 info: Mapping[str, Any]) -> dict[str, Any]:
    """Write a signed bundle (uncompressed tar: the wheel is already compressed) to a binary file object.

    Args:
        out: where the tar goes.
        members: the files (must include the required members of the module docstring).
        signing_key: the coordinator's key; signs the manifest.
        info: manifest fields (``federation_id``, ``site_id``, ``profile``, ...).

    Returns:
        The manifest written.

    Raises:
        BundleError: a member name is unsafe or repeated, or a required member is missing.
    """
    members = list(members)
    names = [check_member_name(m.name) for m in members]
    if len(set(names)) != len(names):
        raise BundleError("a member name repeats", fix="give each file one name")
    missing = [n for n in _REQUIRED if n not in names]
    if missing:
        raise BundleError(f"required member(s) missing: {missing}", fix="this is a bug in the bundle writer")
    created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    manifest = {"format": BUNDLE_FORMAT, **dict(info), "created": created.isoformat(),
                "members": {m.name: {"sha256": _sha256(m.data), "size": len(m.data), "mode": m.mode}
                            for m in members}}
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")
    signature = signing_key.sign(manifest_bytes)
    mtime = int(created.timestamp())
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in [(MANIFEST, manifest_bytes, 0o644), (SIGNATURE, signature, 0o644)] + \
                [(m.name, m.data, m.mode) for m in members]:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime, ti.type = len(data), mode, mtime, tarfile.REGTYPE
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = "root"
            tar.addfile(ti, io.BytesIO(data))
    return manifest


def read_bundle(path: str | Path) -> Bundle:
    """Read and verify a bundle completely in memory; nothing is written.

    Checks: a tar file; every member a regular file with a safe name (:func:`check_member_name`), no repeats; the
    manifest's format; the signature by the bundled coordinator key; the member set equals the manifest's; each
    member's size and SHA-256.

    Raises:
        BundleError: any check fails (the message names the member).
    """
    path = Path(path)
    fix = "do not install it; ask the operator for a fresh bundle (`wildfed-coordinator provision`)"
    if not path.is_file():
        raise BundleError("bundle file not found", source=path, fix="check the path")
    raw: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for info in tar:
                check_member_name(info.name)
                if not info.isreg():
                    kind = "link" if (info.issym() or info.islnk()) else "non-regular member"
                    raise BundleError(f"member {info.name!r} is a {kind}", source=path, field=info.name, fix=fix)
                if info.name in raw:
                    raise BundleError(f"member {info.name!r} appears twice", source=path, field=info.name, fix=fix)
                if len(raw) >= MAX_MEMBERS or info.size > MAX_MEMBER_BYTES:
                    raise BundleError("too many or too large members", source=path, field=info.name, fix=fix)
                handle = tar.extractfile(info)
                raw[info.name] = handle.read() if handle is not None else b""
    except tarfile.TarError as exc:
        raise BundleError(f"not a readable tar file: {exc}", source=path, fix=fix) from exc
    except BundleError as exc:
        if exc.source is None:
            raise BundleError(exc.message, source=path, field=exc.field, fix=exc.fix) from None
        raise
    for needed in (MANIFEST, SIGNATURE, COORDINATOR_PUBLIC_KEY):
        if needed not in raw:
            raise BundleError(f"member {needed!r} is missing", source=path, field=needed, fix=fix)
    manifest_bytes, signature = raw.pop(MANIFEST), raw.pop(SIGNATURE)
    try:
        manifest = json.loads(manifest_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"manifest is not JSON: {exc}", source=path, field=MANIFEST, fix=fix) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"unknown bundle format (expected {BUNDLE_FORMAT})", source=path, field="format",
                          fix="install it with the WildFed version that matches the coordinator")
    try:
        public_key_from_pem(raw[COORDINATOR_PUBLIC_KEY], source=path).verify(signature, manifest_bytes)
    except (InvalidSignature, ConfigError) as exc:
        raise BundleError("manifest signature does not verify with the bundled coordinator key", source=path,
                          field=SIGNATURE, fix=fix) from exc
    listed = manifest.get("members")
    if not isinstance(listed, dict):
        raise BundleError("manifest has no member list", source=path, field="members", fix=fix)
    extra, missing = sorted(set(raw) - set(listed)), sorted(set(listed) - set(raw))
    if extra or missing:
        raise BundleError(f"members differ from the manifest (unlisted: {extra}, missing: {missing})", source=path,
                          field=(extra or missing)[0], fix=fix)
    for name, data in raw.items():
        entry = listed[name]
        if not isinstance(entry, dict) or entry.get("size") != len(data) or entry.get("sha256") != _sha256(data):
            raise BundleError(f"member {name!r} does not match its SHA-256 in the manifest (changed after "
                              "provisioning)", source=path, field=name, fix=fix)
    for needed in _REQUIRED:
        if needed not in raw:
            raise BundleError(f"member {needed!r} is missing", source=path, field=needed, fix=fix)
    return Bundle(manifest=manifest, members=raw)
