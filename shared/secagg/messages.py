"""Secure aggregation's round messages (advertised keys, encrypted shares, recovery request and shares): frozen
dataclasses with strict JSON forms, bytes as lower-case hex; and the check of the advertised key list (U1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.errors import PayloadError, tagged_fields
from shared.secagg.errors import NotEnoughSharesError, SecAggError
from shared.secagg.params import SecAggParams
from shared.secagg.shamir import SHARE_BYTES, Share

GCM_NONCE_BYTES = 12


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
        return cls(body["sender"], body["recipient"], _hex(body["nonce"], "nonce", GCM_NONCE_BYTES),
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
            maps[name] = {str(k): Share.from_bytes(_hex(v, name, SHARE_BYTES)) for k, v in body[name].items()}
        if not isinstance(body["sender"], str):
            raise PayloadError("sender must be a string")
        return cls(body["sender"], **maps)


def check_advertised(params: SecAggParams, advertised: Mapping[str, AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
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
