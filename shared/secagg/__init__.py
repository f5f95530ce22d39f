"""Secure aggregation: the protocol maths both sides use (Bonawitz et al. 2017).

K. Bonawitz, V. Ivanov, B. Kreuter, A. Marcedone, H. B. McMahan, S. Patel, D. Ramage, A. Segal, K. Seth,
"Practical Secure Aggregation for Privacy-Preserving Machine Learning", ACM CCS 2017. Section and figure numbers
below are those of the CCS paper: §3 (cryptographic primitives), §4 (technical intuition: one-time pads from
pairwise key agreement, dropout recovery by secret sharing, double masking), Fig. 4 (the protocol, rounds 0-4),
§6 (security analysis). This package is the honest-but-curious variant: rounds 0, 1, 2 and 4 of Fig. 4, without
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

One module per part of the protocol: :mod:`~shared.secagg.params` (the round's public parameters),
:mod:`~shared.secagg.quantise` (``Q`` and its inverse on the sum), :mod:`~shared.secagg.shamir` (secret sharing),
:mod:`~shared.secagg.derive` (key agreement, key derivation, ``PRG``), :mod:`~shared.secagg.messages` (the round
messages and their JSON forms), :mod:`~shared.secagg.client` (a site's side), :mod:`~shared.secagg.server` (the
aggregator's side: masked sum, recovery, unmasking), :mod:`~shared.secagg.errors`. Import the names from here.
"""

from __future__ import annotations

from shared.secagg.client import SecAggClient
from shared.secagg.derive import PROTOCOL_LABEL, expand_mask
from shared.secagg.errors import NotEnoughSharesError, SecAggError, ShareAuthenticationError
from shared.secagg.messages import AdvertisedKeys, EncryptedShare, RecoveryRequest, RecoveryShares
from shared.secagg.params import SecAggParams, max_power_of_two_scale
from shared.secagg.quantise import dequantise_sum, quantisation_error_bound, quantise
from shared.secagg.server import SecAggServer, unmask_sum
from shared.secagg.shamir import SHAMIR_PRIME, Share, shamir_combine, shamir_split

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
