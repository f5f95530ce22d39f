"""Secure aggregation's key agreement, key derivation and PRG: the X25519 agreement of two sites' keys, the HKDF
contexts that bind every derived key to its (federation, round, sites) slot, and ``PRG`` (AES-256-CTR)."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.secagg.errors import SecAggError
from shared.secagg.params import SecAggParams

PROTOCOL_LABEL = b"wildfed-secagg-v1"
KEY_BYTES = 32


def _context(kind: str, params: SecAggParams, *parts: str | bytes) -> bytes:
    """Length-prefixed, unambiguous HKDF ``info``: label, kind, federation, round, then ``parts``."""
    out = [PROTOCOL_LABEL]
    for part in (kind, params.federation_id, str(params.round), *parts):
        raw = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        out.append(len(raw).to_bytes(4, "big") + raw)
    return b"".join(out)


def _hkdf(ikm: bytes, info: bytes) -> bytes:
    """A 32-byte key: HKDF-SHA256 of ``ikm`` with no salt and ``info`` as context."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(ikm)


def agree(private: X25519PrivateKey, public: bytes) -> bytes:
    """The 32-byte X25519 shared secret of ``private`` and the raw public key ``public``.

    Raises:
        SecAggError: ``public`` is invalid (a low-order point).
    """
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as err:  # a low-order point gives an all-zero secret; OpenSSL refuses it
        raise SecAggError(f"X25519 key agreement failed ({err}); a peer's public key is invalid") from None


def pairwise_mask_key(shared: bytes, params: SecAggParams, u: str, pk_u: bytes, v: str, pk_v: bytes) -> bytes:
    """``s_{u,v}``: symmetric in (u, v) because the context lists the pair in site-id order."""
    (a, pk_a), (b, pk_b) = sorted(((u, pk_u), (v, pk_v)))
    return _hkdf(shared, _context("pairwise-mask", params, a, b, pk_a, pk_b))


def self_mask_key(seed: bytes, params: SecAggParams, u: str) -> bytes:
    """The key of ``PRG(b_u)``: HKDF of the 32-byte seed ``b_u`` under site ``u``'s self-mask context."""
    return _hkdf(seed, _context("self-mask", params, u))


def channel_key(shared: bytes, params: SecAggParams, sender: str, recipient: str) -> bytes:
    """One AES-256-GCM key per direction (sender -> recipient)."""
    return _hkdf(shared, _context("share-channel", params, sender, recipient))


def share_aad(params: SecAggParams, sender: str, recipient: str) -> bytes:
    """The AES-GCM associated data of an encrypted share: (federation, round, sender, recipient)."""
    return _context("share-aad", params, sender, recipient)


def expand_mask(key: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``PRG(key)``: the AES-256-CTR keystream of ``key`` (zero IV), as ``length`` little-endian unsigned integers
    mod ``2^modulus_bits`` (``uint32`` for k <= 32, else ``uint64``). Uniform on ``Z_{2^k}`` if the key is.

    Each key must expand one stream only (zero IV): every key here comes from HKDF with a context unique to its
    (federation, round, sites) slot.
    """
    if len(key) != KEY_BYTES:
        raise SecAggError("a mask key is 32 bytes")
    dtype = np.dtype("<u4") if modulus_bits <= 32 else np.dtype("<u8")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor()
    stream = encryptor.update(bytes(length * dtype.itemsize)) + encryptor.finalize()
    values = np.frombuffer(stream, dtype=dtype).astype(dtype.newbyteorder("="))
    if modulus_bits not in (32, 64):
        values &= values.dtype.type((1 << modulus_bits) - 1)
    return values


def pair_sign(u: str, v: str) -> int:
    """``Delta_{u,v}`` of Fig. 4: +1 if u > v, -1 if u < v (site-id order)."""
    return 1 if u > v else -1
