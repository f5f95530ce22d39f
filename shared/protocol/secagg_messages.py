"""Secure-aggregation payloads (Global DP mode): the round's :class:`SecAggSettings` a TASK carries, and the SECAGG
envelopes' stage messages (:mod:`shared.protocol`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.codec import encode_tensors
from shared.errors import PayloadError
from shared.secagg import SecAggParams

from shared.protocol.common import _metadata, _read


@dataclass(frozen=True)
class SecAggSettings:
    """Secure-aggregation parameters of a Global DP round, sent in the task (``shared.secagg.SecAggParams`` minus
    the federation id and round, which the task already holds).

    Attributes:
        site_ids: the round's selected sites (U of Bonawitz et al. 2017, Fig. 4), sorted.
        threshold: t (2 <= t <= n, 2t > n). vector_length: d (model parameters, :func:`canonical_flatten` order).
        max_abs_value: B, per-coordinate box of a site's clipped gradient sum (same unit as the gradient).
        scale: quantisation steps per unit. modulus_bits: k (masks and sums in Z_{2^k}).
        colluding_sites: f, distributed-noise tasks only: how many colluding participants the noise must survive.
            Each site adds Skellam variance ``mu / (t - f)`` (``shared.privacy.distributed.skellam_share_variance``),
            so the shares of any t - f survivors carry the whole planned noise mu: t survivors less the f shares
            that colluders know of still do. 0 <= f < t. 0 (the default, left out of the JSON, so a task without
            the field reads as it was written) = shares of ``mu / t``, whose guarantee holds against the
            coordinator and non-participants but not against a participant, which knows its own share.
    """

    site_ids: tuple[str, ...]
    threshold: int
    vector_length: int
    max_abs_value: float
    scale: float
    modulus_bits: int = 32
    colluding_sites: int = 0

    _OPTIONAL = frozenset({"colluding_sites"})  # fields a sender may leave out (their default keeps the old meaning)

    def __post_init__(self) -> None:
        if not isinstance(self.site_ids, (tuple, list)) or not all(isinstance(x, str) for x in self.site_ids):
            raise PayloadError(f"secagg.site_ids must be a list of site ids, got {self.site_ids!r}")
        object.__setattr__(self, "site_ids", tuple(sorted(self.site_ids)))
        f = self.colluding_sites
        if type(f) is not int or f < 0 or (type(self.threshold) is int and f >= self.threshold):
            raise PayloadError(f"secagg.colluding_sites must be an integer from 0 to threshold - 1 "
                               f"({self.threshold!r} - 1), got {f!r}")

    def params(self, federation_id: str, round: int) -> SecAggParams:
        """The full parameters of round ``round``.

        Raises:
            PayloadError: the values do not form valid parameters (``SecAggParams`` refuses them).
        """
        try:
            return SecAggParams(federation_id=federation_id, round=round, site_ids=tuple(self.site_ids),
                                threshold=self.threshold, vector_length=self.vector_length,
                                max_abs_value=self.max_abs_value, scale=self.scale, modulus_bits=self.modulus_bits)
        except ValueError as exc:  # ConfigError
            raise PayloadError(f"secagg parameters invalid: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``colluding_sites`` left out when 0)."""
        return {"site_ids": sorted(self.site_ids), "threshold": self.threshold, "vector_length": self.vector_length,
                "max_abs_value": self.max_abs_value, "scale": self.scale, "modulus_bits": self.modulus_bits,
                **({"colluding_sites": self.colluding_sites} if self.colluding_sites else {})}

    @classmethod
    def from_json(cls, body: Any) -> "SecAggSettings":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: not an object, unknown or missing fields, wrong types.
        """
        fields_ = set(cls.__dataclass_fields__)
        required = fields_ - cls._OPTIONAL
        if not isinstance(body, Mapping) or not required <= set(body) <= fields_:
            raise PayloadError(f"secagg must be an object with fields {sorted(required)} "
                               f"(optional: {sorted(cls._OPTIONAL)})")
        if not isinstance(body["site_ids"], list) or not all(isinstance(x, str) for x in body["site_ids"]):
            raise PayloadError("secagg.site_ids must be a list of site ids")
        return cls(**{**body, "site_ids": tuple(body["site_ids"])})


# ---- secure aggregation stages (SECAGG envelopes, Global DP mode) --------------------------------------------------

SITE_STAGES = ("keys", "shares", "masked", "recovery")
"""Stages a site sends on its ``secagg`` topic (Bonawitz et al. 2017, Fig. 4 rounds 0, 1, 2 and 4)."""
COORDINATOR_STAGES = ("key_list", "share_inbox", "recovery_request", "round_end")
"""Stages the coordinator sends on a site's ``task`` topic: the U1 key list, the site's share inbox, the recovery
request (U3 and the dropped sites), and the end of the round (the site forgets its secagg state)."""
MASKED_TENSOR = "masked"


@dataclass(frozen=True)
class SecAggMessage:
    """One secure-aggregation message.

    Attributes:
        stage: one of :data:`SITE_STAGES` or :data:`COORDINATOR_STAGES`.
        body: JSON object; per stage: ``keys``: ``AdvertisedKeys.to_json()``; ``shares`` and ``share_inbox``:
            ``{"shares": [EncryptedShare.to_json(), ...]}``; ``masked``: ``{"num_examples": N_k, "categories":
            [IUCN codes of the site's active categories]}`` (both declared public metadata); ``recovery``:
            ``RecoveryShares.to_json()``; ``key_list``: ``{"keys": [AdvertisedKeys.to_json(), ...]}``;
            ``recovery_request``: ``RecoveryRequest.to_json()``; ``round_end``: ``{"status": str, "reason": str}``.
        masked: the masked, quantised gradient sum (uint32 or uint64, shape (d,)) for stage ``masked``; else None.
    """

    stage: str
    body: Mapping[str, Any]
    masked: np.ndarray | None = None


def encode_secagg(message: SecAggMessage) -> bytes:
    """Payload of a SECAGG envelope: the body as metadata, plus the masked vector as tensor ``"masked"``.

    Raises:
        PayloadError: unknown stage, or a masked vector missing / present where it does not belong.
    """
    if message.stage not in SITE_STAGES + COORDINATOR_STAGES:
        raise PayloadError(f"unknown secagg stage {message.stage!r}")
    if (message.masked is not None) != (message.stage == "masked"):
        raise PayloadError("a masked vector travels with stage 'masked' and only with it")
    tensors = {} if message.masked is None else {MASKED_TENSOR: np.ascontiguousarray(message.masked)}
    return encode_tensors(tensors, _metadata({"stage": message.stage, "body": dict(message.body)}))


def decode_secagg(payload: bytes, *, stages: tuple[str, ...]) -> SecAggMessage:
    """Inverse of :func:`encode_secagg`, accepting only ``stages`` (the sender side's stages).

    Raises:
        PayloadError: not safetensors, unknown fields, a stage not in ``stages``, a body that is not an object,
            or a masked vector that is missing, misplaced, not 1-D, or not uint32/uint64.
    """
    tensors, body = _read(payload, {"stage", "body"})
    stage = body.get("stage")
    if stage not in stages:
        raise PayloadError(f"secagg stage {stage!r} is not one of {stages}")
    if not isinstance(body.get("body"), dict):
        raise PayloadError("secagg body must be an object")
    masked = tensors.pop(MASKED_TENSOR, None)
    if tensors:
        raise PayloadError(f"unexpected tensors {sorted(tensors)[:5]} in a secagg message")
    if (masked is not None) != (stage == "masked"):
        raise PayloadError("a masked vector travels with stage 'masked' and only with it")
    if masked is not None and (masked.ndim != 1 or masked.dtype not in (np.uint32, np.uint64)):
        raise PayloadError(f"the masked vector must be 1-D uint32/uint64, got {masked.dtype} {masked.shape}")
    return SecAggMessage(stage=stage, body=body["body"], masked=masked)
