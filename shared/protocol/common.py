"""What every payload family shares: the metadata key, the privacy modes and radio defences, field checks,
the canonical flattening of a model, and reading a payload's tensors and JSON (:mod:`shared.protocol`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from shared.codec import decode_with_metadata
from shared.errors import PayloadError
from shared.iucn import IUCNCategory


METADATA_KEY = "wildfed"
# TASK tensors whose name starts with this are opaque files (uint8), not weights: e.g. ONNX Runtime training
# artifacts (``coordinator.artifacts``); ``TrainingTask.artifacts`` lists each one's SHA-256.
ARTIFACT_PREFIX = "artifact/"
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # a plain file name: no path, no leading dot
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
PrivacyMode = Literal["ccdp", "global", "grouped", "none"]
PRIVACY_MODES = ("ccdp", "global", "grouped", "none")
#: CCDP's individualized DP-SGD variants (Boenisch et al., NeurIPS 2023, Sec. 4.1 "Sample", 4.2 "Scale")
CCDP_VARIANTS = ("sample", "scale")
RADIO_DEFENCES = ("none", "clip-only", "uniform", "steered-uniform", "adaptive", "grouped-clipping")
"""The upload defences of a radio task (edge_sdk.privacy.adaptive_noise), weakest first."""
GUARANTEED_RADIO_DEFENCES = ("uniform", "adaptive", "grouped-clipping")
"""The radio defences that noise every coordinate, hence state an (eps, delta): privacy ``"grouped"``."""
RADIO_CATEGORY = IUCNCategory.NE
"""The IUCN key of a radio upload's DP event and budget: the ledger keeps one stream per (site, IUCN category) and a
radio map has no species, so its stream is NE, "Not Evaluated"."""


def _category(value: Any) -> IUCNCategory:
    try:
        return IUCNCategory(value)
    except ValueError:
        raise PayloadError(f"{value!r} is not an IUCN category") from None


def _positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = (type(value) is int) if integer else (isinstance(value, (int, float)) and not isinstance(value, bool))
    if not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise PayloadError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} "
                           f"{'integer' if integer else 'number'}, got {value!r}")


def canonical_flatten(tensors: Mapping[str, np.ndarray], *, dtype: type = np.float32) -> np.ndarray:
    """Concatenate float tensors in sorted-name order into one vector (d,) of ``dtype``: the coordinate order of a
    secure-aggregation vector, fixed so that every site and the coordinator agree without exchanging layouts. A site
    flattens its clipped sum with ``dtype=np.float64``, so that nothing rounds it before it is quantised
    (``shared.privacy.sum_rounding``)."""
    if not tensors:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(tensors[name], dtype=dtype).reshape(-1) for name in sorted(tensors)])


def canonical_unflatten(flat: np.ndarray, template: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`canonical_flatten`: a (d,) vector back to ``{name: array of template[name]'s shape}``
    (the vector's dtype is kept).

    Raises:
        PayloadError: ``flat`` is not 1-D of length ``sum(size of template tensors)``.
    """
    flat = np.asarray(flat)
    sizes = {name: int(np.asarray(template[name]).size) for name in sorted(template)}
    if flat.ndim != 1 or flat.shape[0] != sum(sizes.values()):
        raise PayloadError(f"a flat vector of {sum(sizes.values())} values is needed, got shape {flat.shape}")
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = flat[offset:offset + size].reshape(np.asarray(template[name]).shape)
        offset += size
    return out


def _metadata(obj: Any) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(obj, sort_keys=True, separators=(",", ":"))}


def _read(payload: bytes, fields: set[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    return decode_with_metadata(payload, key=METADATA_KEY, fields=fields)


def _check_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        array = np.asarray(value)
        if array.dtype != np.float32:
            raise PayloadError(f"tensor {name!r} has dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise PayloadError(f"tensor {name!r} holds non-finite values")
        out[name] = array
    return out
