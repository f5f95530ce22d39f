"""Secure aggregation: the protocol maths both sides use (Bonawitz et al. 2017).

K. Bonawitz, V. Ivanov, B. Kreuter, A. Marcedone, H. B. McMahan, S. Patel, D. Ramage, A. Segal, K. Seth,
"Practical Secure Aggregation for Privacy-Preserving Machine Learning", ACM CCS 2017. Section and figure numbers
below are those of the CCS paper: §3 (cryptographic primitives), §4 (technical intuition: one-time pads from
pairwise key agreement, dropout recovery by secret sharing, double masking), Fig. 4 (the protocol, rounds 0-4),
§6 (security analysis). This module is the honest-but-curious variant: rounds 0, 1, 2 and 4 of Fig. 4, without
round 3 (ConsistencyCheck) and without signatures on the round messages (see docs/secagg.md).

One round, as the methods map onto Fig. 4 (``U1 ⊇ U2 ⊇ U3`` are the sites still present after each round)::

    round 0  AdvertiseKeys         SecAggClient.public_keys()          -> AdvertisedKeys     (server: collect_keys)
    round 1  ShareKeys             SecAggClient.shares_for(U1 keys)    -> {v: EncryptedShare} (server: route_shares)
    round 2  MaskedInputCollection SecAggClient.receive_shares(...); SecAggClient.mask(x) -> y_u (server: add_masked)
    round 4  Unmasking             SecAggServer.recovery_request() -> RecoveryRequest;
                                   SecAggClient.reveal_for_recovery(request) -> RecoveryShares
                                   SecAggServer.unmask_sum(responses) -> float64 sum over U3

What is computed (all arithmetic in ``Z_{2^k}``, ``k = modulus_bits``)::

    y_u = Q(x_u) + PRG(b_u) + sum_{v in U2, v != u} Delta_{u,v} PRG(s_{u,v})      Delta_{u,v} = +1 if u > v else -1
    sum_{u in U3} Q(x_u) = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u)
                           - sum_{u in U3} sum_{v in U2 \\ U3} Delta_{u,v} PRG(s_{u,v})

* ``Q`` is the quantiser (:func:`quantise`): clip each coordinate to ``[-max_abs_value, max_abs_value]``, multiply
  by ``scale``, round to the nearest integer, reduce mod ``2^k``. :class:`SecAggParams` refuses parameters unless
  ``num_sites * rint(max_abs_value * scale) < 2^(k-1)``, so the integer sum of any subset of sites lies in
  ``(-2^(k-1), 2^(k-1))`` and :func:`dequantise_sum` recovers it exactly (no wrap-around).
* ``s_{u,v}`` is a 32-byte key from HKDF-SHA256 over the X25519 agreement of u's and v's *mask* key pairs, with an
  ``info`` context binding protocol version, federation id, round, both site ids and both public keys.
* ``PRG(key)`` is the AES-256-CTR keystream under ``key`` (zero IV; every key is used for one stream only), read as
  little-endian unsigned integers and reduced mod ``2^k``: uniform on ``Z_{2^k}`` because ``2^k`` divides ``2^32``
  or ``2^64``.
* ``b_u`` is 32 bytes from :mod:`secrets`; its mask is ``PRG(HKDF(b_u, context(federation, round, u)))``.
* Dropout recovery (§4, Fig. 4 rounds 1 and 4): each site Shamir-shares, t-out-of-|U1|, both the raw bytes of its
  X25519 mask private key ``s_u^SK`` and ``b_u`` (the paper's choice), over the prime field ``GF(2^521 - 1)``.
  Shares travel to the other sites encrypted with AES-256-GCM under a key from a *second* X25519 pair (the
  channel pair ``c_u``), so that reconstructing a dropped site's mask key does not also open its share channel.
  In round 4 each surviving site reveals, for every site in ``U2``, exactly one of the two shares it holds: the
  mask-key share if that site dropped, the self-mask share if it survived (never both: double masking means a late
  update of a site declared dropped stays hidden behind ``PRG(b_u)``).

Shares and messages are plain frozen dataclasses of ints and bytes with strict JSON forms (``to_json`` /
``from_json``, bytes as lower-case hex); nothing is pickled. Masked vectors are numpy ``uint32`` (``k <= 32``) or
``uint64`` arrays, which safetensors carries as ``U32`` / ``U64``.

Compatibility rules (as :mod:`shared.envelope`): the key-derivation label ``wildfed-secagg-v1`` changes whenever a
message field, a context string or an encoding changes meaning; JSON readers reject unknown or missing fields.

Randomness: key pairs from ``X25519PrivateKey.generate()`` (the OS CSPRNG), ``b_u``, Shamir coefficients and GCM
nonces from :mod:`secrets`. There is no seeded mode on purpose.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.envelope import validate_identifier
from shared.errors import ConfigError, MalformedEnvelopeError, PayloadError, WildFedError, tagged_fields

__all__ = [
    "PROTOCOL_LABEL",
    "SHAMIR_PRIME",
    "SecAggError",
    "NotEnoughSharesError",
    "ShareAuthenticationError",
    "SecAggParams",
    "max_power_of_two_scale",
    "quantise",
    "dequantise_sum",
    "quantisation_error_bound",
    "Share",
    "shamir_split",
    "shamir_combine",
    "expand_mask",
    "AdvertisedKeys",
    "EncryptedShare",
    "RecoveryRequest",
    "RecoveryShares",
    "SecAggClient",
    "SecAggServer",
    "unmask_sum",
]

PROTOCOL_LABEL = b"wildfed-secagg-v1"
#: The Mersenne prime 2^521 - 1: the Shamir field. Much larger than the 256-bit secrets, so a reconstruction from
#: inconsistent shares lands below 2^256 only with probability 2^-265 and is detected (see :func:`shamir_combine`).
SHAMIR_PRIME = (1 << 521) - 1
SECRET_BYTES = 32
_SHARE_Y_BYTES = (SHAMIR_PRIME.bit_length() + 7) // 8  # 66
_SHARE_BYTES = 2 + _SHARE_Y_BYTES
_GCM_NONCE_BYTES = 12
_KEY_BYTES = 32
_MIN_MODULUS_BITS, _MAX_MODULUS_BITS = 16, 64


# --------------------------------------------------------------------------------------------------------- errors
class SecAggError(WildFedError):
    """A secure-aggregation step must be refused: a protocol message out of order or inconsistent, a reconstructed
    key that does not match its advertised public key, a second masking, a conflicting recovery request."""


class NotEnoughSharesError(SecAggError):
    """Fewer than ``threshold`` sites (or shares) are available to reconstruct a secret: the round cannot be
    unmasked and must be abandoned and re-run with a fresh :class:`SecAggParams` (a new round number)."""


class ShareAuthenticationError(SecAggError):
    """An encrypted share does not authenticate (AES-GCM tag): it was altered, re-addressed, or sent for another
    federation or round."""


# ----------------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class SecAggParams:
    """The public parameters of one secure-aggregation round; every site and the server must hold equal copies.

    Attributes:
        federation_id: identifier of the federation (bound into every derived key).
        round: round number (>= 0; bound into every derived key, so masks never repeat across rounds).
        site_ids: the sites selected for the round (``U`` of Fig. 4); stored sorted. Its order defines each site's
            Shamir x-coordinate (position + 1) and the sign ``Delta_{u,v}`` of pairwise masks.
        threshold: t of the t-out-of-n Shamir sharing: the fewest surviving sites that can unmask, and one more
            than the largest coalition of sites that (with the server) learns nothing beyond the sum. Must satisfy
            ``2 <= t <= n`` and ``2t > n`` (a majority: two disjoint groups of survivors cannot both reach t,
            so a server cannot obtain a site's mask key from one group and its self-mask seed from another).
        vector_length: d, number of float32 coordinates of one (flattened) update.
        max_abs_value: B, the clipping bound on each coordinate (same unit as the update).
        scale: integers per unit of the update: ``Q(x) = rint(clip(x, -B, B) * scale) mod 2^k``.
        modulus_bits: k, masks and sums live in ``Z_{2^k}``; 16 <= k <= 64; ``uint32`` arrays for k <= 32, else
            ``uint64``.

    Raises:
        ConfigError: a value out of range, or ``n * rint(B * scale) >= 2^(k-1)`` (the modular sum could wrap).
    """

    federation_id: str
    round: int
    site_ids: tuple[str, ...]
    threshold: int
    vector_length: int
    max_abs_value: float
    scale: float
    modulus_bits: int = 32

    def __post_init__(self) -> None:
        try:
            validate_identifier(self.federation_id, "federation_id")
            for site in self.site_ids:
                validate_identifier(site, "site_id")
        except MalformedEnvelopeError as err:
            raise ConfigError(str(err), field="site_ids/federation_id",
                              fix="use identifiers of 1-64 characters from A-Za-z0-9_.-") from None
        if type(self.round) is not int or self.round < 0:
            raise ConfigError(f"round must be a non-negative integer, got {self.round!r}", field="round")
        sites = tuple(sorted(self.site_ids))
        if len(set(sites)) != len(sites) or len(sites) < 2:
            raise ConfigError(f"site_ids must hold at least 2 distinct sites, got {list(self.site_ids)!r}",
                              field="site_ids", fix="list each selected site once")
        if len(sites) >= 1 << 16:
            raise ConfigError("at most 65535 sites per round", field="site_ids")
        object.__setattr__(self, "site_ids", sites)
        n, t = len(sites), self.threshold
        if type(t) is not int or not (2 <= t <= n) or 2 * t <= n:
            raise ConfigError(f"threshold must be an integer with 2 <= t <= n and 2t > n (n = {n}), got {t!r}",
                              field="threshold", fix=f"use threshold = {n // 2 + 1} (the smallest majority)")
        if type(self.vector_length) is not int or self.vector_length < 1:
            raise ConfigError(f"vector_length must be a positive integer, got {self.vector_length!r}",
                              field="vector_length")
        k = self.modulus_bits
        if type(k) is not int or not (_MIN_MODULUS_BITS <= k <= _MAX_MODULUS_BITS):
            raise ConfigError(f"modulus_bits must be an integer in [16, 64], got {k!r}", field="modulus_bits")
        for name in ("max_abs_value", "scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}", field=name)
        if self.max_quantised < 1:
            raise ConfigError(f"max_abs_value * scale rounds to 0 ({self.max_abs_value} * {self.scale})",
                              field="scale", fix="raise scale so that one unit of B is at least one integer step")
        if n * self.max_quantised >= 1 << (k - 1):
            best = max_power_of_two_scale(num_sites=n, max_abs_value=self.max_abs_value, modulus_bits=k)
            raise ConfigError(
                f"the sum of {n} quantised updates can wrap mod 2^{k}: n * rint(B * scale) = "
                f"{n * self.max_quantised} >= 2^{k - 1}", field="scale",
                fix=f"use scale <= {best!r} (largest power of two that fits), lower max_abs_value, "
                    "or raise modulus_bits to 64")

    @property
    def num_sites(self) -> int:
        """n = |U|."""
        return len(self.site_ids)

    @property
    def modulus(self) -> int:
        """2^k."""
        return 1 << self.modulus_bits

    @property
    def dtype(self) -> np.dtype:
        """``uint32`` for k <= 32, else ``uint64``."""
        return np.dtype(np.uint32) if self.modulus_bits <= 32 else np.dtype(np.uint64)

    @property
    def max_quantised(self) -> int:
        """``rint(B * scale)``: the largest |Q(x)| of one coordinate of one site (rint is monotone)."""
        return int(np.rint(np.float64(self.max_abs_value) * np.float64(self.scale)))

    def x_coordinate(self, site_id: str) -> int:
        """The site's Shamir x-coordinate: its position in the sorted ``site_ids`` plus one (never 0)."""
        try:
            return self.site_ids.index(site_id) + 1
        except ValueError:
            raise SecAggError(f"site {site_id!r} is not in this round's site_ids") from None


def max_power_of_two_scale(*, num_sites: int, max_abs_value: float, modulus_bits: int) -> float:
    """The largest power-of-two ``scale`` with ``num_sites * rint(max_abs_value * scale) < 2^(modulus_bits-1)``.

    A power of two makes ``sum / scale`` an exact float operation. The per-coordinate rounding error of the
    dequantised sum is then at most ``num_sites / (2 * scale)`` (:func:`quantisation_error_bound`).
    """
    limit = 1 << (modulus_bits - 1)
    exponent = math.floor(math.log2(limit / (num_sites * max_abs_value))) + 1
    while exponent > -1074:
        scale = math.ldexp(1.0, exponent)
        if num_sites * int(np.rint(max_abs_value * scale)) < limit:
            return scale
        exponent -= 1
    raise ConfigError("no positive scale fits", field="max_abs_value")


def _modulus_mask(params: SecAggParams) -> np.unsignedinteger:
    return params.dtype.type((1 << params.modulus_bits) - 1)


def quantise(values: np.ndarray, params: SecAggParams) -> np.ndarray:
    """``Q(x) = rint(clip(x, -B, B) * scale) mod 2^k`` per coordinate.

    Args:
        values: float array of shape ``(vector_length,)`` (float32 in WildFed; computed in float64).

    Returns:
        ``params.dtype`` array of shape ``(vector_length,)``; negative integers in two's complement mod ``2^k``.

    Raises:
        SecAggError: wrong shape or a non-finite value (clip first; NaN must never be aggregated).
    """
    x = np.asarray(values)
    if x.shape != (params.vector_length,) or not np.issubdtype(x.dtype, np.floating):
        raise SecAggError(f"update must be a float vector of shape ({params.vector_length},), got {x.dtype} "
                          f"{x.shape}; flatten the tensors in a fixed order first")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("update has non-finite values; they cannot be quantised")
    bound = float(params.max_abs_value)
    q = np.rint(np.clip(x, -bound, bound) * float(params.scale)).astype(np.int64)
    return (q.view(np.uint64) & np.uint64(params.modulus - 1)).astype(params.dtype)


def dequantise_sum(total: np.ndarray, params: SecAggParams) -> np.ndarray:
    """Map a sum of quantised updates in ``Z_{2^k}`` back to real numbers: centre into ``[-2^(k-1), 2^(k-1))``
    (exact, by the no-wrap bound of :class:`SecAggParams`) and divide by ``scale``.

    Returns:
        float64 array of shape ``(vector_length,)``. The integer is exact; the float is the nearest float64 (exact
        for |integer| <= 2^53 with a power-of-two scale).
    """
    s = np.asarray(total, dtype=params.dtype).astype(np.uint64)
    half = np.uint64(1 << (params.modulus_bits - 1))
    if params.modulus_bits == 64:
        centred = s.view(np.int64)
    else:
        centred = s.astype(np.int64) - np.where(s >= half, np.int64(params.modulus), np.int64(0))
    return centred.astype(np.float64) / float(params.scale)


def quantisation_error_bound(params: SecAggParams, num_summands: int) -> float:
    """Per-coordinate bound on ``|dequantise_sum(sum Q(x_u)) - sum clip(x_u)|`` (the right side summed exactly):
    ``num_summands / (2 scale)`` (each rounding moves a value by at most half a step) plus
    ``num_summands * max_abs_value * 2^-52`` (the float64 rounding of the result, which matters only when the
    integer sum passes 2^53, i.e. with ``modulus_bits > 54``). It bounds the error against the plain sum when no
    coordinate exceeds ``max_abs_value``."""
    return num_summands * 0.5 / float(params.scale) + num_summands * float(params.max_abs_value) * 2.0 ** -52


# --------------------------------------------------------------------------------------------------------- Shamir
@dataclass(frozen=True)
class Share:
    """One Shamir share ``(x, y)``: the polynomial's value y at x, in ``GF(SHAMIR_PRIME)``; x is the holder's
    :meth:`SecAggParams.x_coordinate`. Wire form: 2-byte big-endian x, 66-byte big-endian y."""

    x: int
    y: int

    def __post_init__(self) -> None:
        if type(self.x) is not int or not (1 <= self.x < 1 << 16):
            raise PayloadError(f"share x must be in [1, 65535], got {self.x!r}")
        if type(self.y) is not int or not (0 <= self.y < SHAMIR_PRIME):
            raise PayloadError("share y must be an integer in [0, 2^521 - 1)")

    def to_bytes(self) -> bytes:
        return self.x.to_bytes(2, "big") + self.y.to_bytes(_SHARE_Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Share":
        """Raises PayloadError on a wrong length or out-of-range value."""
        if len(data) != _SHARE_BYTES:
            raise PayloadError(f"a share is {_SHARE_BYTES} bytes, got {len(data)}")
        return cls(int.from_bytes(data[:2], "big"), int.from_bytes(data[2:], "big"))


def shamir_split(secret: bytes, *, threshold: int, xs: Sequence[int]) -> dict[int, Share]:
    """Shamir t-out-of-n sharing (Shamir 1979; Bonawitz et al. §3) of a 32-byte secret.

    Draws a polynomial ``f`` of degree ``threshold - 1`` over ``GF(SHAMIR_PRIME)`` with ``f(0) = secret`` (as a
    big-endian integer) and uniformly random other coefficients (:func:`secrets.randbelow`); returns ``f(x)`` for
    every x. Any ``threshold - 1`` shares are jointly uniform and independent of the secret.

    Args:
        secret: 32 bytes.
        threshold: t >= 1.
        xs: distinct x-coordinates in [1, 65535].

    Returns:
        ``{x: Share(x, f(x))}``.
    """
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"a shared secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(not (1 <= x < 1 << 16) for x in xs):
        raise SecAggError(f"x-coordinates must be distinct and in [1, 65535], got {list(xs)!r}")
    if not (1 <= threshold <= len(xs)):
        raise SecAggError(f"threshold {threshold} must be in [1, {len(xs)}]")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(SHAMIR_PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % SHAMIR_PRIME
        shares[x] = Share(x, y)
    return shares


def _interpolate(points: Sequence[Share], at: Sequence[int]) -> list[int]:
    """Values at ``at`` of the polynomial of degree < len(points) through ``points`` (Lagrange, mod p)."""
    p = SHAMIR_PRIME
    xs = [s.x for s in points]
    inv_denominators = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if j != i:
                d = d * (xi - xj) % p
        inv_denominators.append(pow(d, -1, p))
    values = []
    for a in at:
        # numerator_i = prod_{j != i} (a - x_j), by prefix and suffix products: O(t) per point.
        diffs = [(a - xj) % p for xj in xs]
        prefix = [1]
        for d in diffs:
            prefix.append(prefix[-1] * d % p)
        suffix = [1]
        for d in reversed(diffs):
            suffix.append(suffix[-1] * d % p)
        suffix.reverse()
        total = 0
        for i, share in enumerate(points):
            total = (total + share.y * prefix[i] % p * suffix[i + 1] % p * inv_denominators[i]) % p
        values.append(total)
    return values


def shamir_combine(shares: Iterable[Share], *, threshold: int) -> bytes:
    """Reconstruct a 32-byte secret from at least ``threshold`` shares.

    Interpolates ``f(0)`` from the ``threshold`` shares with the smallest x, then checks every further share lies
    on the same polynomial, and that ``f(0) < 2^256``. The field is far larger than the secret space, so a single
    altered share among exactly ``threshold`` is still caught with probability ``1 - 2^-265``.

    Raises:
        NotEnoughSharesError: fewer than ``threshold`` distinct shares.
        SecAggError: two different shares for one x, or inconsistent shares.
    """
    by_x: dict[int, Share] = {}
    for share in shares:
        if share.x in by_x and by_x[share.x] != share:
            raise SecAggError(f"two different shares for x = {share.x}")
        by_x[share.x] = share
    if len(by_x) < threshold:
        raise NotEnoughSharesError(f"{len(by_x)} shares given, {threshold} needed to reconstruct the secret")
    ordered = [by_x[x] for x in sorted(by_x)]
    basis, extra = ordered[:threshold], ordered[threshold:]
    values = _interpolate(basis, [0] + [s.x for s in extra])
    if any(v != s.y for v, s in zip(values[1:], extra)):
        raise SecAggError("shares are inconsistent: they do not lie on one polynomial of degree threshold - 1")
    if values[0] >= 1 << (8 * SECRET_BYTES):
        raise SecAggError("shares are inconsistent: the reconstructed value is not a 32-byte secret")
    return values[0].to_bytes(SECRET_BYTES, "big")


# ------------------------------------------------------------------------------------------- derivations and PRG
def _context(kind: str, params: SecAggParams, *parts: str | bytes) -> bytes:
    """Length-prefixed, unambiguous HKDF ``info``: label, kind, federation, round, then ``parts``."""
    out = [PROTOCOL_LABEL]
    for part in (kind, params.federation_id, str(params.round), *parts):
        raw = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        out.append(len(raw).to_bytes(4, "big") + raw)
    return b"".join(out)


def _hkdf(ikm: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=None, info=info).derive(ikm)


def _agree(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as err:  # a low-order point gives an all-zero secret; OpenSSL refuses it
        raise SecAggError(f"X25519 key agreement failed ({err}); a peer's public key is invalid") from None


def _pairwise_mask_key(shared: bytes, params: SecAggParams, u: str, pk_u: bytes, v: str, pk_v: bytes) -> bytes:
    """``s_{u,v}``: symmetric in (u, v) because the context lists the pair in site-id order."""
    (a, pk_a), (b, pk_b) = sorted(((u, pk_u), (v, pk_v)))
    return _hkdf(shared, _context("pairwise-mask", params, a, b, pk_a, pk_b))


def _self_mask_key(seed: bytes, params: SecAggParams, u: str) -> bytes:
    return _hkdf(seed, _context("self-mask", params, u))


def _channel_key(shared: bytes, params: SecAggParams, sender: str, recipient: str) -> bytes:
    """One AES-256-GCM key per direction (sender -> recipient)."""
    return _hkdf(shared, _context("share-channel", params, sender, recipient))


def _share_aad(params: SecAggParams, sender: str, recipient: str) -> bytes:
    return _context("share-aad", params, sender, recipient)


def expand_mask(key: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``PRG(key)``: the AES-256-CTR keystream of ``key`` (zero IV), as ``length`` little-endian unsigned integers
    mod ``2^modulus_bits`` (``uint32`` for k <= 32, else ``uint64``). Uniform on ``Z_{2^k}`` if the key is.

    Each key must expand one stream only (zero IV): every key here comes from HKDF with a context unique to its
    (federation, round, sites) slot.
    """
    if len(key) != _KEY_BYTES:
        raise SecAggError("a mask key is 32 bytes")
    dtype = np.dtype("<u4") if modulus_bits <= 32 else np.dtype("<u8")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor()
    stream = encryptor.update(bytes(length * dtype.itemsize)) + encryptor.finalize()
    values = np.frombuffer(stream, dtype=dtype).astype(dtype.newbyteorder("="))
    if modulus_bits not in (32, 64):
        values &= values.dtype.type((1 << modulus_bits) - 1)
    return values


def _pair_sign(u: str, v: str) -> int:
    """``Delta_{u,v}`` of Fig. 4: +1 if u > v, -1 if u < v (site-id order)."""
    return 1 if u > v else -1


# ------------------------------------------------------------------------------------------------------ messages
def _hex(data: Any, name: str, length: int | None = None) -> bytes:
    if not isinstance(data, str):
        raise PayloadError(f"{name} must be a hex string")
    try:
        raw = bytes.fromhex(data)
    except ValueError:
        raise PayloadError(f"{name} is not hex") from None
    if length is not None and len(raw) != length:
        raise PayloadError(f"{name} must be {length} bytes, got {len(raw)}")
    return raw


def _site_list(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PayloadError(f"{name} must be a list of site ids")
    return tuple(value)


@dataclass(frozen=True)
class AdvertisedKeys:
    """Round 0 (AdvertiseKeys): a site's two X25519 public keys, raw 32 bytes each. ``channel_public`` (the
    paper's ``c_u^PK``) encrypts shares; ``mask_public`` (``s_u^PK``) seeds the pairwise masks. In production they
    ride in the site's signed envelope (the PKI of §3)."""

    site_id: str
    channel_public: bytes
    mask_public: bytes

    def __post_init__(self) -> None:
        for name in ("channel_public", "mask_public"):
            if not isinstance(getattr(self, name), bytes) or len(getattr(self, name)) != 32:
                raise PayloadError(f"{name} must be 32 raw bytes")

    def to_json(self) -> dict[str, Any]:
        return {"type": "secagg_keys", "site_id": self.site_id, "channel_public": self.channel_public.hex(),
                "mask_public": self.mask_public.hex()}

    @classmethod
    def from_json(cls, data: Any) -> "AdvertisedKeys":
        body = tagged_fields(data, "secagg_keys", {"site_id", "channel_public", "mask_public"}, "secagg message")
        if not isinstance(body["site_id"], str):
            raise PayloadError("site_id must be a string")
        return cls(body["site_id"], _hex(body["channel_public"], "channel_public", 32),
                   _hex(body["mask_public"], "mask_public", 32))


@dataclass(frozen=True)
class EncryptedShare:
    """Round 1 (ShareKeys): ``sender``'s shares of its mask key and self-mask seed for ``recipient``, AES-256-GCM
    encrypted under the sender -> recipient channel key; ``(federation, round, sender, recipient)`` is the
    associated data. The server routes it and cannot read it."""

    sender: str
    recipient: str
    nonce: bytes
    ciphertext: bytes

    def to_json(self) -> dict[str, Any]:
        return {"type": "secagg_share", "sender": self.sender, "recipient": self.recipient,
                "nonce": self.nonce.hex(), "ciphertext": self.ciphertext.hex()}

    @classmethod
    def from_json(cls, data: Any) -> "EncryptedShare":
        body = tagged_fields(data, "secagg_share", {"sender", "recipient", "nonce", "ciphertext"}, "secagg message")
        if not isinstance(body["sender"], str) or not isinstance(body["recipient"], str):
            raise PayloadError("sender and recipient must be strings")
        return cls(body["sender"], body["recipient"], _hex(body["nonce"], "nonce", _GCM_NONCE_BYTES),
                   _hex(body["ciphertext"], "ciphertext"))


@dataclass(frozen=True)
class RecoveryRequest:
    """Round 4 (Unmasking), server -> survivors: ``survivors`` = U3 (sites whose masked update arrived), ``dropped``
    = U2 \\ U3 (sites that sent shares but no masked update). Both sorted."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"type": "secagg_recovery_request", "survivors": list(self.survivors), "dropped": list(self.dropped)}

    @classmethod
    def from_json(cls, data: Any) -> "RecoveryRequest":
        body = tagged_fields(data, "secagg_recovery_request", {"survivors", "dropped"}, "secagg message")
        return cls(_site_list(body["survivors"], "survivors"), _site_list(body["dropped"], "dropped"))


@dataclass(frozen=True)
class RecoveryShares:
    """Round 4 (Unmasking), survivor -> server: the sender's share of each dropped site's mask private key and of
    each surviving site's self-mask seed, keyed by the site the secret belongs to."""

    sender: str
    mask_key_shares: Mapping[str, Share] = field(default_factory=dict)
    self_mask_shares: Mapping[str, Share] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": "secagg_recovery_shares", "sender": self.sender,
                "mask_key_shares": {k: s.to_bytes().hex() for k, s in sorted(self.mask_key_shares.items())},
                "self_mask_shares": {k: s.to_bytes().hex() for k, s in sorted(self.self_mask_shares.items())}}

    @classmethod
    def from_json(cls, data: Any) -> "RecoveryShares":
        body = tagged_fields(data, "secagg_recovery_shares", {"sender", "mask_key_shares", "self_mask_shares"},
                             "secagg message")
        maps = {}
        for name in ("mask_key_shares", "self_mask_shares"):
            if not isinstance(body[name], dict):
                raise PayloadError(f"{name} must be an object")
            maps[name] = {str(k): Share.from_bytes(_hex(v, name, _SHARE_BYTES)) for k, v in body[name].items()}
        if not isinstance(body["sender"], str):
            raise PayloadError("sender must be a string")
        return cls(body["sender"], **maps)


def _check_advertised(params: SecAggParams, advertised: Mapping[str, AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
    """U1: a subset of ``site_ids`` of size >= t, each entry under its own id, all public keys distinct."""
    keys = dict(advertised)
    for site, entry in keys.items():
        if entry.site_id != site:
            raise SecAggError(f"keys of {entry.site_id!r} filed under {site!r}")
        params.x_coordinate(site)
    if len(keys) < params.threshold:
        raise NotEnoughSharesError(f"only {len(keys)} sites advertised keys, threshold is {params.threshold}")
    publics = [k.channel_public for k in keys.values()] + [k.mask_public for k in keys.values()]
    if len(set(publics)) != len(publics):
        raise SecAggError("two advertised public keys are equal; every key pair must be fresh")
    return keys


# ------------------------------------------------------------------------------------------------------- client
class SecAggClient:
    """One site's side of one round (Fig. 4, user side). Holds the round's secrets: create a new client for every
    round and never reuse one (masking twice with the same masks would reveal the difference of two updates).

    Call in order: :meth:`public_keys`, :meth:`shares_for`, :meth:`receive_shares`, :meth:`mask`,
    :meth:`reveal_for_recovery` (the last may be called again with the same request, e.g. on retransmission).
    """

    def __init__(self, site_id: str, params: SecAggParams) -> None:
        self.site_id = site_id
        self.params = params
        self._x = params.x_coordinate(site_id)
        self._channel_key = X25519PrivateKey.generate()
        self._mask_key = X25519PrivateKey.generate()
        self._self_seed = secrets.token_bytes(SECRET_BYTES)
        self._advertised: dict[str, AdvertisedKeys] | None = None
        self._held_mask_key: dict[str, Share] = {}  # owner -> my share of owner's mask private key
        self._held_self: dict[str, Share] = {}  # owner -> my share of owner's self-mask seed
        self._participants: tuple[str, ...] | None = None  # U2
        self._masked = False
        self._revealed: dict[str, str] = {}  # owner -> "mask_key" | "self_mask"

    def public_keys(self) -> AdvertisedKeys:
        """Round 0: this site's public keys."""
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        return AdvertisedKeys(self.site_id, self._channel_key.public_key().public_bytes(*raw),
                              self._mask_key.public_key().public_bytes(*raw))

    def shares_for(self, advertised: Mapping[str, AdvertisedKeys]) -> dict[str, EncryptedShare]:
        """Round 1: Shamir-share this site's mask private key and self-mask seed among U1 (the sites in
        ``advertised``, t-out-of-|U1|) and encrypt each other site's pair of shares to it.

        Args:
            advertised: ``{site_id: AdvertisedKeys}`` for U1 as the server broadcast it; must contain this site's
                own keys unchanged.

        Returns:
            ``{recipient: EncryptedShare}`` for every other site of U1 (this site keeps its own shares).

        Raises:
            NotEnoughSharesError: |U1| < t. SecAggError: called twice, own keys altered, duplicate keys.
        """
        if self._advertised is not None:
            raise SecAggError("shares_for was already called in this round")
        keys = _check_advertised(self.params, advertised)
        if keys.get(self.site_id) != self.public_keys():
            raise SecAggError("the broadcast key list does not hold this site's own keys unchanged")
        self._advertised = keys
        raw = serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        xs = [self.params.x_coordinate(site) for site in sorted(keys)]
        key_shares = shamir_split(self._mask_key.private_bytes(*raw), threshold=self.params.threshold, xs=xs)
        seed_shares = shamir_split(self._self_seed, threshold=self.params.threshold, xs=xs)
        self._held_mask_key[self.site_id] = key_shares[self._x]
        self._held_self[self.site_id] = seed_shares[self._x]
        out = {}
        for site in sorted(keys):
            if site == self.site_id:
                continue
            x = self.params.x_coordinate(site)
            key = _channel_key(_agree(self._channel_key, keys[site].channel_public), self.params, self.site_id, site)
            nonce = secrets.token_bytes(_GCM_NONCE_BYTES)
            plaintext = key_shares[x].to_bytes() + seed_shares[x].to_bytes()
            ciphertext = AESGCM(key).encrypt(nonce, plaintext, _share_aad(self.params, self.site_id, site))
            out[site] = EncryptedShare(self.site_id, site, nonce, ciphertext)
        return out

    def receive_shares(self, shares: Mapping[str, EncryptedShare]) -> None:
        """Round 2, first half: decrypt the shares the server forwarded (one per other site of U2, keyed by sender)
        and fix U2 = the senders plus this site.

        Raises:
            ShareAuthenticationError: a ciphertext fails AES-GCM authentication (altered, re-addressed, replayed
                from another round). NotEnoughSharesError: |U2| < t. SecAggError: out of order, unknown sender.
        """
        if self._advertised is None or self._participants is not None:
            raise SecAggError("receive_shares must follow shares_for, once")
        received_key: dict[str, Share] = {}
        received_self: dict[str, Share] = {}
        for sender, message in shares.items():
            if message.sender != sender or message.recipient != self.site_id:
                raise SecAggError(f"share from {message.sender!r} to {message.recipient!r} filed under {sender!r}")
            if sender == self.site_id or sender not in self._advertised:
                raise SecAggError(f"share from {sender!r}, which is not another site of U1")
            key = _channel_key(_agree(self._channel_key, self._advertised[sender].channel_public), self.params,
                               sender, self.site_id)
            try:
                plaintext = AESGCM(key).decrypt(message.nonce, message.ciphertext,
                                                _share_aad(self.params, sender, self.site_id))
            except (InvalidTag, ValueError):
                raise ShareAuthenticationError(
                    f"share from {sender!r} does not authenticate; drop {sender!r} from this round") from None
            key_share = Share.from_bytes(plaintext[:_SHARE_BYTES])
            self_share = Share.from_bytes(plaintext[_SHARE_BYTES:])
            if key_share.x != self._x or self_share.x != self._x:
                raise SecAggError(f"share from {sender!r} is for another x-coordinate")
            received_key[sender], received_self[sender] = key_share, self_share
        participants = tuple(sorted({*received_key, self.site_id}))
        if len(participants) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(participants)} sites sent shares, threshold is "
                                       f"{self.params.threshold}; abandon this round")
        self._held_mask_key.update(received_key)
        self._held_self.update(received_self)
        self._participants = participants

    @property
    def participants(self) -> tuple[str, ...]:
        """U2 as this site sees it (after :meth:`receive_shares`)."""
        if self._participants is None:
            raise SecAggError("U2 is known only after receive_shares")
        return self._participants

    def mask(self, update: np.ndarray, integer_noise: np.ndarray | None = None) -> np.ndarray:
        """Round 2: ``y_u = Q(x_u) + n_u + PRG(b_u) + sum_{v in U2 \\ {u}} Delta_{u,v} PRG(s_{u,v}) mod 2^k``.

        Args:
            update: float vector of shape ``(vector_length,)`` (the flattened, clipped update).
            integer_noise: int64 ``(vector_length,)`` noise ``n_u`` added to the quantised update before masking
                (distributed DP: this site's share of the Skellam noise, ``shared.privacy.distributed``), or None.

        Returns:
            ``params.dtype`` array of shape ``(vector_length,)``: uniformly distributed on ``Z_{2^k}^d`` given the
            server's view, whatever ``update`` is.

        Raises:
            SecAggError: before :meth:`receive_shares`, or a second call.
        """
        if self._participants is None:
            raise SecAggError("mask must follow receive_shares")
        if self._masked:
            raise SecAggError("this client already masked an update; masks are one-time pads, use a new round")
        p, d, k = self.params, self.params.vector_length, self.params.modulus_bits
        y = quantise(update, p)
        if integer_noise is not None:
            n = np.asarray(integer_noise)
            if n.shape != (d,) or not np.issubdtype(n.dtype, np.integer):
                raise SecAggError(f"integer_noise must be an integer vector of shape ({d},), got {n.dtype} {n.shape}")
            y += (n.astype(np.int64).view(np.uint64) & np.uint64(p.modulus - 1)).astype(p.dtype)
        self._masked = True
        y += expand_mask(_self_mask_key(self._self_seed, p, self.site_id), d, k)
        mine = self._advertised[self.site_id].mask_public
        for v in self._participants:
            if v == self.site_id:
                continue
            theirs = self._advertised[v].mask_public
            key = _pairwise_mask_key(_agree(self._mask_key, theirs), p, self.site_id, mine, v, theirs)
            if _pair_sign(self.site_id, v) > 0:
                y += expand_mask(key, d, k)
            else:
                y -= expand_mask(key, d, k)
        return y & _modulus_mask(p)

    def reveal_for_recovery(self, request: RecoveryRequest) -> RecoveryShares:
        """Round 4: for each dropped site, this site's share of its mask private key; for each survivor, this
        site's share of its self-mask seed. Never both for one site, across any number of requests.

        Raises:
            NotEnoughSharesError: |U3| < t (the paper's abort). SecAggError: not masked yet, this site not among the
                survivors, sets that are not a partition of U2, or a request that contradicts an earlier one.
        """
        if not self._masked:
            raise SecAggError("reveal_for_recovery must follow mask")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped or survivors | dropped != set(self._participants) \
                or len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
            raise SecAggError("recovery request is not a partition of U2 into survivors and dropped sites")
        if self.site_id not in survivors:
            raise SecAggError("recovery request lists this site as dropped, but it sent its masked update")
        if len(survivors) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(survivors)} survivors, threshold is {self.params.threshold}")
        wanted = {site: "mask_key" for site in dropped} | {site: "self_mask" for site in survivors}
        conflicts = sorted(s for s, kind in wanted.items() if self._revealed.get(s, kind) != kind)
        if conflicts:
            raise SecAggError(f"recovery request contradicts an earlier one for {conflicts}: revealing both shares "
                              "of a site would unmask its update")
        self._revealed.update(wanted)
        return RecoveryShares(self.site_id,
                              {s: self._held_mask_key[s] for s in sorted(dropped)},
                              {s: self._held_self[s] for s in sorted(survivors)})


# ------------------------------------------------------------------------------------------------------- server
class SecAggServer:
    """The aggregator's side of one round (Fig. 4, server side). Holds only public keys, opaque ciphertexts and a
    running masked sum mod ``2^k`` (never K updates at once).

    Call in order: :meth:`collect_keys`, :meth:`route_shares`, :meth:`add_masked` per arriving site,
    :meth:`recovery_request`, :meth:`unmask_sum` (or :meth:`unmask_integer_sum`).
    """

    def __init__(self, params: SecAggParams) -> None:
        self.params = params
        self._advertised: dict[str, AdvertisedKeys] | None = None
        self._participants: tuple[str, ...] | None = None
        self._received: list[str] = []
        self._sum = np.zeros(params.vector_length, dtype=params.dtype)
        self._request: RecoveryRequest | None = None

    def collect_keys(self, advertised: Iterable[AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
        """Round 0 -> 1: fix U1 and return the key list to broadcast.

        Raises:
            NotEnoughSharesError: |U1| < t. SecAggError: a site twice, an unknown site, repeated keys.
        """
        keys: dict[str, AdvertisedKeys] = {}
        for entry in advertised:
            if entry.site_id in keys:
                raise SecAggError(f"site {entry.site_id!r} advertised keys twice")
            keys[entry.site_id] = entry
        self._advertised = _check_advertised(self.params, keys)
        return dict(self._advertised)

    def route_shares(self, outgoing: Mapping[str, Mapping[str, EncryptedShare]]
                     ) -> dict[str, dict[str, EncryptedShare]]:
        """Round 1 -> 2: fix U2 = the senders, and regroup ``{sender: {recipient: share}}`` into
        ``{recipient: {sender: share}}`` for the recipients in U2 (a sender must address every other site of U1).

        Raises:
            NotEnoughSharesError: |U2| < t. SecAggError: out of order, unknown sender, missing recipients.
        """
        if self._advertised is None or self._participants is not None:
            raise SecAggError("route_shares must follow collect_keys, once")
        participants = tuple(sorted(outgoing))
        if len(participants) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(participants)} sites sent shares, threshold is "
                                       f"{self.params.threshold}; abandon this round")
        inbox: dict[str, dict[str, EncryptedShare]] = {site: {} for site in participants}
        for sender, messages in outgoing.items():
            if sender not in self._advertised:
                raise SecAggError(f"shares from {sender!r}, which did not advertise keys")
            if set(messages) != set(self._advertised) - {sender}:
                raise SecAggError(f"{sender!r} must send one share to every other site of U1")
            for recipient, message in messages.items():
                if message.sender != sender or message.recipient != recipient:
                    raise SecAggError(f"share filed under {sender!r} -> {recipient!r} is addressed otherwise")
                if recipient in inbox:
                    inbox[recipient][sender] = message
        self._participants = participants
        return inbox

    def add_masked(self, site_id: str, masked: np.ndarray) -> None:
        """Round 2: add one site's masked update to the running sum mod ``2^k``.

        Raises:
            SecAggError: the site is not in U2, sent twice, arrived after the recovery request was issued
                (a late site is treated as dropped), or the array has the wrong dtype/shape/range.
        """
        if self._participants is None:
            raise SecAggError("add_masked must follow route_shares")
        if self._request is not None:
            raise SecAggError(f"masked update of {site_id!r} arrived after the recovery request; it stays dropped")
        if site_id not in self._participants:
            raise SecAggError(f"site {site_id!r} is not in U2 (it sent no shares)")
        if site_id in self._received:
            raise SecAggError(f"site {site_id!r} sent its masked update twice")
        y = np.asarray(masked)
        if y.dtype != self.params.dtype or y.shape != (self.params.vector_length,):
            raise SecAggError(f"masked update must be {self.params.dtype} of shape ({self.params.vector_length},), "
                              f"got {y.dtype} {y.shape}")
        if self.params.modulus_bits not in (32, 64) and np.any(y > _modulus_mask(self.params)):
            raise SecAggError(f"masked update has values >= 2^{self.params.modulus_bits}")
        self._received.append(site_id)
        self._sum += y
        self._sum &= _modulus_mask(self.params)

    def recovery_request(self) -> RecoveryRequest:
        """Round 4: close collection and name U3 (survivors) and U2 \\ U3 (dropped). Idempotent.

        Raises:
            NotEnoughSharesError: |U3| < t: the round cannot be unmasked.
        """
        if self._participants is None:
            raise SecAggError("recovery_request must follow route_shares")
        if self._request is None:
            survivors = tuple(sorted(self._received))
            if len(survivors) < self.params.threshold:
                raise NotEnoughSharesError(f"only {len(survivors)} masked updates arrived, threshold is "
                                           f"{self.params.threshold}; abandon this round")
            self._request = RecoveryRequest(survivors, tuple(s for s in self._participants if s not in survivors))
        return self._request

    def unmask_integer_sum(self, responses: Iterable[RecoveryShares]) -> np.ndarray:
        """Round 4: reconstruct the dropped sites' mask private keys and the survivors' self-mask seeds from the
        survivors' shares, remove the masks, and return ``sum_{u in U3} Q(x_u) mod 2^k`` (``params.dtype``).

        Raises:
            NotEnoughSharesError: fewer than t shares for some secret (names it).
            SecAggError: a response from a site not in U3 or sent twice, a share for a site outside the request, a
                share at the wrong x, inconsistent shares, or a key that does not match its advertised public key.
        """
        request = self.recovery_request()
        p, d, k = self.params, self.params.vector_length, self.params.modulus_bits
        key_shares: dict[str, list[Share]] = {site: [] for site in request.dropped}
        seed_shares: dict[str, list[Share]] = {site: [] for site in request.survivors}
        seen: set[str] = set()
        for response in responses:
            if response.sender not in request.survivors or response.sender in seen:
                raise SecAggError(f"recovery shares from {response.sender!r}: not a survivor, or sent twice")
            seen.add(response.sender)
            x = p.x_coordinate(response.sender)
            for target, collected, shares in (("dropped", key_shares, response.mask_key_shares),
                                              ("survivors", seed_shares, response.self_mask_shares)):
                for owner, share in shares.items():
                    if owner not in collected:
                        raise SecAggError(f"{response.sender!r} sent a share for {owner!r}, not among the {target}")
                    if share.x != x:
                        raise SecAggError(f"{response.sender!r} sent a share at x = {share.x}, its own is {x}")
                    collected[owner].append(share)
        for kind, collected in (("mask key", key_shares), ("self-mask seed", seed_shares)):
            for owner, shares in collected.items():
                if len(shares) < p.threshold:
                    raise NotEnoughSharesError(
                        f"{len(shares)} shares of the {kind} of {owner!r}, {p.threshold} needed; wait for more "
                        "survivors' recovery shares or abandon the round")
        total = self._sum.copy()
        for u in request.survivors:
            seed = shamir_combine(seed_shares[u], threshold=p.threshold)
            total -= expand_mask(_self_mask_key(seed, p, u), d, k)
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        for v in request.dropped:
            private = X25519PrivateKey.from_private_bytes(shamir_combine(key_shares[v], threshold=p.threshold))
            pk_v = self._advertised[v].mask_public
            if private.public_key().public_bytes(*raw) != pk_v:
                raise SecAggError(f"reconstructed mask key of {v!r} does not match its advertised public key")
            for u in request.survivors:
                pk_u = self._advertised[u].mask_public
                mask = expand_mask(_pairwise_mask_key(_agree(private, pk_u), p, u, pk_u, v, pk_v), d, k)
                # survivor u added Delta_{u,v} PRG(s_{u,v}); take it back out.
                if _pair_sign(u, v) > 0:
                    total -= mask
                else:
                    total += mask
        return total & _modulus_mask(p)

    def unmask_sum(self, responses: Iterable[RecoveryShares]) -> np.ndarray:
        """:meth:`unmask_integer_sum`, dequantised: float64 ``sum_{u in U3} x_u`` (clipped), shape ``(d,)``, within
        :func:`quantisation_error_bound` ``(params, len(U3))`` per coordinate."""
        return dequantise_sum(self.unmask_integer_sum(responses), self.params)

    @property
    def survivors(self) -> tuple[str, ...]:
        """The sites whose masked update has been added so far (sorted)."""
        return tuple(sorted(self._received))


def unmask_sum(params: SecAggParams, *, advertised: Iterable[AdvertisedKeys],
               outgoing_shares: Mapping[str, Mapping[str, EncryptedShare]], masked_updates: Mapping[str, np.ndarray],
               responses: Iterable[RecoveryShares]) -> np.ndarray:
    """One-call server side for a round whose messages are all at hand (tests, offline replays): drives a
    :class:`SecAggServer` through keys, share routing, masked updates and recovery. Returns the float64 sum over
    the sites in ``masked_updates`` (see :meth:`SecAggServer.unmask_sum`)."""
    server = SecAggServer(params)
    server.collect_keys(advertised)
    server.route_shares(outgoing_shares)
    for site, values in masked_updates.items():
        server.add_masked(site, values)
    return server.unmask_sum(responses)
