"""Tensors on the wire and on disk: safetensors, never pickle.

A payload is the safetensors serialization of a ``name -> numpy array`` mapping with an optional string-to-string
metadata map (safetensors' ``__metadata__``). Decoding is done by the safetensors library; the only thing read here
by hand is the documented JSON header (8-byte little-endian length + JSON) to recover the metadata, which the
library's numpy loader drops.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping

from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from shared.errors import PayloadError

__all__ = ["encode_tensors", "decode_tensors", "decode_with_metadata", "model_hash", "encode_model", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 1 << 20  # a header larger than 1 MiB is not something WildFed writes


def encode_tensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize arrays to safetensors bytes.

    Args:
        tensors: name -> array (any safetensors dtype; made C-contiguous here).
        metadata: optional str -> str map stored in the header.

    Raises:
        PayloadError: a value is not an array, or metadata is not str -> str.
    """
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(value, np.ndarray):
            raise PayloadError(f"tensor {name!r} is a {type(value).__name__}, expected numpy.ndarray")
        arrays[str(name)] = np.ascontiguousarray(value)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise PayloadError("safetensors metadata must map str to str")
    return _st_save(arrays, metadata=dict(metadata) if metadata else None)


def _read_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise PayloadError("payload shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise PayloadError(f"safetensors header length {header_len} is invalid")
    try:
        header = json.loads(data[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"safetensors header is not JSON: {exc}") from exc
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("safetensors __metadata__ must map str to str")
    return dict(metadata)


def decode_tensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors bytes into ``(tensors, metadata)``.

    Returns:
        tensors: name -> array (writable copies, dtypes as stored); metadata: str -> str (empty if none).

    Raises:
        PayloadError: the bytes are not a valid safetensors payload.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    metadata = _read_metadata(data)
    try:
        tensors = _st_load(data)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise PayloadError(f"payload is not valid safetensors: {exc}") from exc
    # safetensors' numpy loader returns arrays that own their memory and are writable; copy only one that is not
    return {name: array if array.flags.writeable else np.array(array, copy=True)
            for name, array in tensors.items()}, metadata


def model_hash(tensors: Mapping[str, np.ndarray]) -> str:
    """Hex SHA-256 (64 chars) of the canonical safetensors bytes of ``tensors`` (no metadata).

    safetensors writes names in a deterministic order, so equal weights give equal hashes. This is the model
    *version hash* carried in every envelope header.
    """
    return encode_model(tensors)[0]


def encode_model(tensors: Mapping[str, np.ndarray]) -> tuple[str, bytes]:
    """``(model_hash(tensors), encode_tensors(tensors))`` from ONE encoding: the version hash (hex SHA-256, 64 chars)
    and the safetensors bytes it is the hash of, for a caller that stores the bytes under the hash.

    Raises:
        PayloadError: as :func:`encode_tensors`.
    """
    data = encode_tensors(tensors)
    return hashlib.sha256(data).hexdigest(), data


def decode_with_metadata(payload: bytes | memoryview, *, key: str, fields: set[str] | frozenset[str],
                         what: str = "payload") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Parse a payload whose metadata ``key`` holds a JSON object of known ``fields`` (every WildFed payload:
    tasks, updates, releases, SDK releases).

    Returns:
        ``(tensors, body)``: the tensors as :func:`decode_tensors` gives them and the JSON object.

    Raises:
        PayloadError: not safetensors, no ``key`` metadata, not JSON, not an object, or a field not in ``fields``
            (``what`` names the payload in the message).
    """
    tensors, metadata = decode_tensors(bytes(payload))
    if key not in metadata:
        raise PayloadError(f"{what} has no '{key}' metadata")
    try:
        body = json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise PayloadError(f"{what}: '{key}' metadata is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise PayloadError(f"{what}: metadata body is not an object")
    unknown = set(body) - set(fields)
    if unknown:
        raise PayloadError(f"{what}: unknown fields {sorted(unknown)}")
    return tensors, body
