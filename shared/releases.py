"""The payload of a MODEL envelope: a global model released to a gateway to predict with.

After every round that makes a new global model the coordinator publishes, retained, on each camera site's
``model`` topic (``shared.topics.model_topic``) a MODEL envelope signed with its key, addressed to the site
(``site_id`` of the header), whose ``round`` is the round that produced the model and whose ``base_model_hash`` is
the model's hash (``shared.codec.model_hash``). NIRA releases each site the model of its cluster (the shared phi
with its cluster's head psi), the same model a task of that site would carry.

Payload: safetensors (``shared.codec``) whose tensors are the model's weights (float32, the names a task carries:
``phi.*``, ``psi.*``) and whose metadata key ``"wildfed"`` holds the JSON of :class:`ModelRelease`. As in a task,
the weights are the model as trained; the post-hoc logit adjustment the gateway folds into ``psi.bias`` before it
predicts (``shared.models.logit_adjustment``) travels beside them as ``prediction_offsets``.

Compatibility rules (those of :mod:`shared.protocol`): fields are never removed and never change meaning; new fields
are optional with defaults that keep the old meaning; the decoder rejects unknown fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.codec import decode_with_metadata, encode_tensors
from shared.envelope import validate_identifier
from shared.errors import MalformedEnvelopeError, PayloadError

__all__ = ["ModelRelease", "encode_release", "decode_release", "METADATA_KEY"]

METADATA_KEY = "wildfed"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelRelease:
    """What a MODEL envelope says about the weights it carries.

    Attributes:
        federation_id: the federation (equal to the envelope header's).
        round: the round that produced the model (>= 1; equal to the header's ``round``).
        model_hash: hex SHA-256 of the weights (``shared.codec.model_hash``; equal to the header's
            ``base_model_hash``); for NIRA the hash of the site's model (phi + its cluster's head).
        prediction_offsets: float (K,) ``tau (log pi_k - mean log pi)``, the post-hoc logit adjustment to take off
            ``psi.bias`` before predicting (as ``shared.protocol.TrainingTask.prediction_offsets``), or None.

    Raises:
        PayloadError: a field out of range.
    """

    federation_id: str
    round: int
    model_hash: str
    prediction_offsets: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        try:
            validate_identifier(self.federation_id, "federation_id")
        except MalformedEnvelopeError as exc:
            raise PayloadError(str(exc)) from None
        if type(self.round) is not int or self.round < 1:
            raise PayloadError(f"round must be an integer >= 1 (the round that made the model), got {self.round!r}")
        if not isinstance(self.model_hash, str) or not _HEX64.match(self.model_hash):
            raise PayloadError("model_hash must be 64 lowercase hex characters")
        offsets = self.prediction_offsets
        if offsets is not None:
            if (not isinstance(offsets, (list, tuple)) or len(offsets) < 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                               for v in offsets)):
                raise PayloadError(f"prediction_offsets must be a list of >= 2 finite numbers (one per class), "
                                   f"got {offsets!r:.80}")
            object.__setattr__(self, "prediction_offsets", tuple(float(v) for v in offsets))

    def to_json(self) -> dict[str, Any]:
        """The metadata JSON object (``prediction_offsets`` only when set)."""
        body: dict[str, Any] = {"federation_id": self.federation_id, "round": self.round,
                                "model_hash": self.model_hash}
        if self.prediction_offsets is not None:
            body["prediction_offsets"] = list(self.prediction_offsets)
        return body


def encode_release(release: ModelRelease, weights: Mapping[str, np.ndarray]) -> bytes:
    """The payload of a MODEL envelope: ``weights`` (float32 arrays by name) with ``release`` as metadata.

    Raises:
        PayloadError: a tensor that is not float32 or holds non-finite values.
    """
    tensors = {name: _checked(name, value) for name, value in weights.items()}
    return encode_tensors(tensors, {METADATA_KEY: json.dumps(release.to_json(), sort_keys=True,
                                                             separators=(",", ":"))})


def decode_release(payload: bytes | memoryview) -> tuple[ModelRelease, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_release`: ``(release, weights)``. The weights are not hashed here: the receiver
    compares ``shared.codec.model_hash(weights)`` with the signed header.

    Raises:
        PayloadError: not safetensors, no or malformed metadata, unknown or missing fields, values out of range,
            no tensor, a tensor that is not float32 or not finite.
    """
    tensors, body = decode_with_metadata(payload, key=METADATA_KEY, fields=set(ModelRelease.__dataclass_fields__),
                                         what="model release")
    missing = {"federation_id", "round", "model_hash"} - set(body)
    if missing:
        raise PayloadError(f"model release fields missing: {sorted(missing)}")
    if not tensors:
        raise PayloadError("a model release carries no weights")
    release = ModelRelease(**body)
    return release, {name: _checked(name, value) for name, value in tensors.items()}


def _checked(name: str, value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype != np.float32:
        raise PayloadError(f"tensor {name!r} has dtype {array.dtype}, expected float32")
    if not np.all(np.isfinite(array)):
        raise PayloadError(f"tensor {name!r} holds non-finite values")
    return array
