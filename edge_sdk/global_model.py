"""The global model a camera gateway keeps: the newest model it accepted in a task, written where ``detect`` and
the gateway service read it (``edge_sdk.config.global_model_path``, ``<state>/global-model.safetensors``).

It is the model the site predicts with: the global weights of a task, or of a model the coordinator released
(``shared.releases``; :mod:`edge_sdk.rounds.releases`), with the post-hoc logit adjustment folded into ``psi.bias``
(:mod:`shared.models.logit_adjustment`), as safetensors (the wire's encoding) with metadata ``round``,
``model_hash``, ``backbone_id`` (the backbone whose embeddings it takes), ``source`` (``task`` or ``release``),
``timestamp`` (the signing time of the envelope it came in, Unix ms) and, when adjusted, ``prediction_offsets``.

Newer only (:func:`keep_global_model`): a task of round r carries the model round r trains from, made before round
r; a release of round r carries the model round r made. So models are ordered by ``(round, source, timestamp)``
with a task before the release of the same round (:attr:`ModelVersion.order`), and the gateway keeps a model only
when it is newer than the one it holds: a delayed or replayed message never takes a gateway back to an older model.
The same model hash again changes nothing. A file from before ``source`` existed counts as a task's.
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

__all__ = ["save_global_model", "KeptModel", "ModelVersion", "kept_version", "keep_global_model", "SOURCES"]

#: Where a kept model came from, in the order a task's and a release's models of one round were made.
SOURCES = ("task", "release")


@dataclass(frozen=True)
class ModelVersion:
    """Which global model a message carries or a gateway keeps (module docstring).

    Attributes:
        round: the task's round (``source`` task) or the round that made the model (``source`` release).
        source: ``task`` or ``release``. timestamp: the carrying envelope's signing time, Unix ms (0: unknown).
        model_hash: hex SHA-256 of the weights as trained (``shared.codec.model_hash``).
    """

    round: int
    source: str
    timestamp: int
    model_hash: str

    @property
    def order(self) -> tuple[int, int, int]:
        """``(round, 0 for a task / 1 for a release, timestamp)``: newer models compare greater."""
        return (self.round, SOURCES.index(self.source), self.timestamp)


def kept_version(path: Path) -> ModelVersion | None:
    """The version of the model kept at ``path`` from its metadata alone (no tensor is read), or None when there is
    none or it is unreadable (a torn or foreign file: the next model replaces it)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
        source = meta.get("source", "task")
        return ModelVersion(int(meta.get("round", 0) or 0), source if source in SOURCES else "task",
                            int(meta.get("timestamp", 0) or 0), str(meta.get("model_hash", "")))
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - safetensors raises its own errors for a torn file; replaced by the next model
        return None


def keep_global_model(path: Path, weights: dict[str, np.ndarray], version: ModelVersion, *,
                      prediction_offsets: tuple[float, ...] | None = None, backbone_id: str | None = None) -> str:
    """Keep ``weights`` at ``path`` if they are a newer model than the one kept there (module docstring).

    Returns:
        ``kept`` (written), ``unchanged`` (the same model hash is kept already: nothing written) or ``older`` (the
        kept model is newer: nothing written).

    Raises:
        ValueError: offsets that do not fit the model's ``psi.bias``. OSError: the file could not be written.
    """
    current = kept_version(path)
    if current is not None and current.model_hash == version.model_hash:
        return "unchanged"
    if current is not None and current.order >= version.order:
        return "older"
    save_global_model(path, weights, round_=version.round, model_hash_hex=version.model_hash,
                      prediction_offsets=prediction_offsets, backbone_id=backbone_id, source=version.source,
                      timestamp=version.timestamp)
    return "kept"


def save_global_model(path: Path, weights: dict[str, np.ndarray], *, round_: int, model_hash_hex: str,
                      prediction_offsets: tuple[float, ...] | None = None, backbone_id: str | None = None,
                      source: str = "task", timestamp: int = 0) -> None:
    """Write ``weights`` (float32 arrays) to ``path`` atomically (a temporary file, then ``os.replace``), as
    safetensors (``shared.codec.encode_tensors``, the wire's encoding) with metadata ``round`` and ``model_hash``
    (the global model version it comes from), and ``backbone_id`` (``shared.models.backbone.BACKBONE_METADATA_KEY``:
    the site's backbone, whose embeddings the head takes; ``detect`` refuses the model on another) when given.

    ``prediction_offsets`` (the task's, float (K,)): the model kept is the one ``detect`` should predict with, the
    global model with ``psi.bias - offsets`` (post-hoc logit adjustment, :mod:`shared.models.logit_adjustment`);
    the metadata then also holds ``prediction_offsets`` (JSON list). ``source`` and ``timestamp`` order it
    (:class:`ModelVersion`).

    Raises:
        ValueError: offsets that do not fit the model's ``psi.bias``, or an unknown ``source``. OSError: the file
            could not be written.
    """
    if source not in SOURCES:
        raise ValueError(f"source {source!r} is not one of {SOURCES}")
    metadata = {"round": str(int(round_)), "model_hash": model_hash_hex, "source": source,
                "timestamp": str(int(timestamp))}
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


