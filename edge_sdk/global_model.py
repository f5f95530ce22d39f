"""The global model a camera gateway keeps: the newest model it accepted in a task, written where ``detect`` and
the gateway service read it (``edge_sdk.config.global_model_path``, ``<state>/global-model.safetensors``).

It is the model the site predicts with: the task's global weights with the task's post-hoc logit adjustment folded
into ``psi.bias`` (:mod:`shared.models.logit_adjustment`), as safetensors (the wire's encoding) with metadata
``round``, ``model_hash``, ``backbone_id`` (the backbone whose embeddings it takes) and, when adjusted,
``prediction_offsets``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.codec import decode_tensors, encode_tensors
from shared.models.backbone import BACKBONE_METADATA_KEY
from shared.models.logit_adjustment import adjusted_for_prediction

from edge_sdk.inference.classifier import load_classifier_weights

__all__ = ["save_global_model", "KeptModel"]


def save_global_model(path: Path, weights: dict[str, np.ndarray], *, round_: int, model_hash_hex: str,
                      prediction_offsets: tuple[float, ...] | None = None, backbone_id: str | None = None) -> None:
    """Write ``weights`` (float32 arrays) to ``path`` atomically (a temporary file, then ``os.replace``), as
    safetensors (``shared.codec.encode_tensors``, the wire's encoding) with metadata ``round`` and ``model_hash``
    (the global model version it comes from), and ``backbone_id`` (``shared.models.backbone.BACKBONE_METADATA_KEY``:
    the site's backbone, whose embeddings the head takes; ``detect`` refuses the model on another) when given.

    ``prediction_offsets`` (the task's, float (K,)): the model kept is the one ``detect`` should predict with, the
    global model with ``psi.bias - offsets`` (post-hoc logit adjustment, :mod:`shared.models.logit_adjustment`);
    the metadata then also holds ``prediction_offsets`` (JSON list).

    Raises:
        ValueError: offsets that do not fit the model's ``psi.bias``. OSError: the file could not be written.
    """
    metadata = {"round": str(int(round_)), "model_hash": model_hash_hex}
    if backbone_id is not None:
        metadata[BACKBONE_METADATA_KEY] = backbone_id
    if prediction_offsets is not None:
        weights = adjusted_for_prediction(weights, prediction_offsets)
        metadata["prediction_offsets"] = json.dumps([float(v) for v in prediction_offsets])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_tensors({k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
                                   metadata=metadata))
    os.replace(tmp, path)


@dataclass(frozen=True)
class KeptModel:
    """The global model a gateway keeps: weights, the round and hash it came from, the file's mtime."""

    weights: dict[str, np.ndarray]
    round: int
    model_hash: str
    mtime_ns: int

    @classmethod
    def load(cls, path: Path, *, backbone_id: str | None = None) -> "KeptModel | None":
        """The model at ``path``, or None when there is none yet.

        Args:
            backbone_id: the site's backbone id; a model whose metadata names another is refused.

        Raises:
            ConfigError: the file is not a head model, or it was trained on another backbone's embeddings.
        """
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        weights = load_classifier_weights(path, backbone_id=backbone_id)
        _, metadata = decode_tensors(path.read_bytes())
        return cls(weights, int(metadata.get("round", 0) or 0), str(metadata.get("model_hash", "")), mtime)


