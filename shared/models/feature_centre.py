"""A public centre for the backbone embeddings: local DP-SGD trains the head on ``x - c`` instead of ``x``.

Why: EfficientNet-Lite0's pooled embeddings are non-negative (ReLU6) and share a large common direction (on
Animal-MNIST their mean has norm ~27 of an average embedding norm ~28). A linear head's per-example gradient is
``(p - y) x^T``, so before centring most of each clipped gradient's norm C is spent on that common direction and
the DP noise, spread over every coordinate, swamps the part that tells species apart. Centring the inputs by a
mean estimated on *public* images is the standard remedy (feature normalisation from public data: Tramer and Boneh
2021, "Differentially private learning needs better features", sec. 3; De et al. 2022, sec. 4); measured on the
demo (docs/demo-data.md, "Tuning"), it is worth about +7 points at uniform epsilon 2 and +14 with CCDP.

How, without changing the model anyone else sees: for the first layer that reads the embedding (the adapter
``phi.0`` or, head only, ``psi``), ``W (x - c) + b = W x + (b - W c)``. The global model stays in the plain form
``(W, b')`` with ``b' = b - W c``; a gateway unfolds ``b = b' + W c`` (:func:`centred_weights`), runs its DP-SGD
steps on ``x - c``, and folds the result back (:func:`uncentred_weights`) before taking the delta. Clipping and
noise act on the centred gradients, so the guarantee is the usual one; folding with a public ``c`` is
post-processing. FedAvg and server SGD are linear, so averaging folded deltas equals averaging centred ones:
the federation trains exactly the centred model, and ``detect``, the audit and the evaluation need no change.

``c`` must not come from the site's own records (that would release a statistic of them without noise): it is
computed by whoever provisions the federation from public images (the demo: the training images no site holds,
:func:`wildfed_sim.common.demo_data.public_split_indices`) and given to every gateway as a file (site config
``feature_centre``): safetensors (``safetensors.numpy``, no pickle), one float32 tensor ``centre`` of shape (E,),
with the number of images in its metadata.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shared.errors import ConfigError

__all__ = ["CENTRE_TENSOR", "public_centre", "save_feature_centre", "load_feature_centre", "first_layer",
           "centred_weights", "uncentred_weights", "uncentred_gradient", "centre_digest"]

CENTRE_TENSOR = "centre"


def public_centre(public_features: np.ndarray) -> np.ndarray:
    """The mean of public embeddings, float32 (E,), from float (M, E) with M >= 1.

    Raises:
        ValueError: not a non-empty 2-D array of finite values.
    """
    arr = np.asarray(public_features, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or not np.isfinite(arr).all():
        raise ValueError(f"public_features must be a non-empty finite (M, E) array, got shape {arr.shape}")
    return arr.mean(axis=0).astype(np.float32)


def save_feature_centre(path: str | os.PathLike[str], centre: np.ndarray, *, num_images: int,
                        source: str) -> Path:
    """Write ``centre`` (float (E,)) as safetensors with metadata ``num_images`` and ``source`` (free text naming
    the public images). Returns the path."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({CENTRE_TENSOR: np.ascontiguousarray(centre, dtype=np.float32)}, str(out),
              metadata={"num_images": str(int(num_images)), "source": str(source)})
    return out


def load_feature_centre(path: str | os.PathLike[str], *, dim: int) -> np.ndarray:
    """Read a centre file written by :func:`save_feature_centre`: float32 (dim,).

    Raises:
        ConfigError (field ``feature_centre``): the file is missing or not safetensors, has no ``centre`` tensor,
            or the tensor is not finite of shape (dim,).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    p = Path(path)
    fix = "point feature_centre at a file written by shared.models.feature_centre.save_feature_centre, or remove it"
    if not p.is_file():
        raise ConfigError(f"feature centre file {p} does not exist", field="feature_centre", fix=fix)
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"feature centre file {p} is not a safetensors file: {exc}", field="feature_centre",
                          fix=fix) from None
    centre = tensors.get(CENTRE_TENSOR)
    if centre is None or centre.shape != (dim,) or not np.isfinite(centre).all():
        got = None if centre is None else centre.shape
        raise ConfigError(f"feature centre file {p} must hold a finite float tensor {CENTRE_TENSOR!r} of shape "
                          f"({dim},), got {got}", field="feature_centre", fix=fix)
    return centre.astype(np.float32)


def first_layer(weights: Mapping[str, np.ndarray]) -> str:
    """The prefix of the head model's layer that reads the embedding: ``"phi.0"`` with an adapter, else ``"psi"``
    (:func:`shared.models.head.input_layer_prefix`).

    Raises:
        ValueError: the weights are not a head model (``shared.models.head.HeadConfig.from_weights``).
    """
    from shared.models.head import HeadConfig, input_layer_prefix

    HeadConfig.from_weights(weights)  # names and shapes of a head model, or ValueError
    return str(input_layer_prefix(weights))


def _shift(weights: Mapping[str, np.ndarray], centre: np.ndarray, sign: float) -> dict[str, np.ndarray]:
    layer = first_layer(weights)
    w = np.asarray(weights[f"{layer}.weight"], dtype=np.float64)
    c = np.asarray(centre, dtype=np.float64)
    if w.shape[1] != c.shape[0]:
        raise ValueError(f"feature centre has {c.shape[0]} values, the model's {layer}.weight reads {w.shape[1]}")
    out = {k: np.asarray(v, dtype=np.float32).copy() for k, v in weights.items()}
    out[f"{layer}.bias"] = (np.asarray(weights[f"{layer}.bias"], dtype=np.float64) + sign * (w @ c)
                            ).astype(np.float32)
    return out


def centred_weights(weights: Mapping[str, np.ndarray], centre: np.ndarray) -> dict[str, np.ndarray]:
    """Plain-form weights -> the same function on centred inputs: first layer bias ``b = b' + W c``.

    Args:
        weights: head-model float32 arrays. centre: float (E,).

    Raises:
        ValueError: not a head model, or ``centre`` of the wrong length.
    """
    return _shift(weights, centre, +1.0)


def uncentred_weights(weights: Mapping[str, np.ndarray], centre: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of :func:`centred_weights`: ``b' = b - W c`` (the form the federation stores and serves)."""
    return _shift(weights, centre, -1.0)


def uncentred_gradient(gradient: Mapping[str, np.ndarray], centre: np.ndarray) -> dict[str, np.ndarray]:
    """A gradient of the centred parametrisation -> the step of the plain form (Global DP mode: the sites sum
    gradients taken on ``x - c``, the coordinator noises the sum and folds it back before its server step).

    With ``b' = b - W c`` a step ``(W, b) -= lr (G_W, G_b)`` is the step ``(W, b') -= lr (G_W, G_b - G_W c)``:
    the same linear map as :func:`uncentred_weights`, applied to the gradient. Linear and fixed, so it commutes with
    summing over sites, with the noise and with the server optimizer's momentum; computed from a public c, it is
    post-processing of the DP release.

    Args:
        gradient: head-model float32 arrays (the noisy mean gradient). centre: float (E,).

    Raises:
        ValueError: not a head model, or ``centre`` of the wrong length.
    """
    return _shift(gradient, centre, -1.0)


def centre_digest(centre: np.ndarray) -> str:
    """SHA-256 (hex) of the centre's float32 little-endian bytes: the value a Global DP task names so that the
    coordinator and every site fold with the same c (:class:`shared.protocol.TrainingTask` ``feature_centre``)."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(centre, dtype="<f4").tobytes()).hexdigest()
