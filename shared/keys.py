"""Ed25519 key pairs: generation and PEM files.

Private keys are written as unencrypted PKCS#8 PEM with file mode 0600 (owner read/write only), created with that
mode from the start so the key is never readable by others, not even for an instant. Public keys are
SubjectPublicKeyInfo PEM (RFC 8410). All cryptography is delegated to the ``cryptography`` package.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.errors import ConfigError

__all__ = [
    "generate_signing_key",
    "save_private_key",
    "load_private_key",
    "save_public_key",
    "load_public_key",
    "public_key_to_pem",
    "public_key_from_pem",
    "key_fingerprint",
    "write_file_atomic",
]

PRIVATE_KEY_MODE = 0o600


def generate_signing_key() -> Ed25519PrivateKey:
    """Return a fresh Ed25519 private key (RFC 8032) drawn from the operating system's CSPRNG."""
    return Ed25519PrivateKey.generate()


def write_file_atomic(path: str | os.PathLike[str], data: bytes, mode: int) -> Path:
    """Write ``data`` to ``path`` with permission bits ``mode``, atomically (temp file, fsync, rename); the file is
    created with ``mode`` from the start, so a private key is never readable by others, even briefly. Returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # umask may have narrowed or, with O_CREAT on an existing file, not applied
    os.replace(tmp, path)
    return path


def save_private_key(key: Ed25519PrivateKey, path: str | os.PathLike[str]) -> Path:
    """Write ``key`` as PKCS#8 PEM to ``path`` with mode 0600, atomically; return the path.

    Raises:
        ConfigError: ``path`` exists and is a directory.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError("is a directory", source=path, fix="give a file path for the private key")
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_file_atomic(path, pem, PRIVATE_KEY_MODE)
    return path


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read an Ed25519 private key from a PKCS#8 PEM file.

    Raises:
        ConfigError: the file is missing, is not PEM, is not Ed25519, or is readable by group/others.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("private key file not found", source=path,
                          fix="create one with `wildfed-edge keygen` or `wildfed-coordinator init`")
    if os.name == "posix" and path.stat().st_mode & 0o077:
        raise ConfigError(f"private key is accessible by group/others (mode {oct(path.stat().st_mode & 0o777)})",
                          source=path, fix=f"run `chmod 600 {path}`")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a readable PEM private key ({exc})", source=path,
                          fix="regenerate the key pair") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"key type {type(key).__name__} is not Ed25519", source=path,
                          fix="WildFed signs with Ed25519; regenerate the key pair")
    return key


def public_key_to_pem(public_key: Ed25519PublicKey) -> str:
    """Return the SubjectPublicKeyInfo PEM text of ``public_key``."""
    return public_key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


def public_key_from_pem(text: str | bytes, *, source: object | None = None) -> Ed25519PublicKey:
    """Parse an Ed25519 public key from PEM text.

    Raises:
        ConfigError: the text is not a PEM public key or not Ed25519.
    """
    data = text.encode("ascii") if isinstance(text, str) else text
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnicodeError) as exc:
        raise ConfigError(f"not a PEM public key ({exc})", source=source,
                          fix="pass the .pub file written by `wildfed-edge keygen`") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"key type {type(key).__name__} is not Ed25519", source=source,
                          fix="WildFed verifies Ed25519 signatures only")
    return key


def save_public_key(public_key: Ed25519PublicKey, path: str | os.PathLike[str]) -> Path:
    """Write ``public_key`` as PEM to ``path`` (mode 0644), atomically; return the path."""
    path = Path(path)
    write_file_atomic(path, public_key_to_pem(public_key).encode("ascii"), 0o644)
    return path


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Read an Ed25519 public key from a PEM file.

    Raises:
        ConfigError: the file is missing or does not hold an Ed25519 public key.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("public key file not found", source=path, fix="check the path in the config")
    return public_key_from_pem(path.read_bytes(), source=path)


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """Hex SHA-256 (64 characters) of the raw 32-byte public key: a short, stable identifier for logs."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()
