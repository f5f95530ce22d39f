"""The camera model the federation trains under DP: an adapter ``phi`` and a classification head ``psi`` on the
frozen backbone's embeddings (docs/ort.md, "The head model on backbone embeddings").

A public, frozen EfficientNet-Lite0 (:mod:`shared.models.backbone`) embeds each crop once on the gateway; this
module is everything that is trained on site data::

    input  x : float32 (B, E)            E = 1280 backbone embedding (ReLU6-pooled, each value in [0, 6])
    phi      : Linear(E -> H), tanh      (B, H)   the adapter, shared by every cluster (NIRA), H = adapter_width
    psi      : Linear(H -> K)            (B, K)   the classification head; row k of ``psi.weight`` is species k's
                                                  embedding (what species-embedding sharing merges)

With ``adapter_width=0`` there is no adapter ("head only"): ``phi`` is the identity and ``psi`` is Linear(E -> K)
on the embedding itself (a linear probe). The other head-only variant, the adapter present but frozen, is a
training-backend setting (``scope="head"``), not an architecture.

Parameter names are ``phi.0.weight`` (H, E), ``phi.0.bias`` (H,), ``psi.weight`` (K, H), ``psi.bias`` (K,), in that
order (``named_parameters()`` order, the flat layout of the training backends). The prefixes are the contract with
NIRA (``head_prefix="psi."``: everything else is the shared phi) and with species embeddings (``psi.weight`` rows).

Why this shape: DP noise grows with the number of trained parameters while public features carry most of the
accuracy, so what DP trains should be small and sit on the best public features (Tramer and Boneh 2021,
"Differentially private learning needs better features (or much more data)", ICLR, sec. 3-4; De et al. 2022,
"Unlocking high-accuracy differentially private image classification through scale", sec. 4, which fine-tunes the
last layer from a zero initialisation). tanh keeps per-example gradient norms bounded (Papernot et al. 2021,
"Tempered sigmoid activations for deep learning with differential privacy", AAAI). No normalisation layer mixes
examples, so per-example gradients depend on their own example only. Sizes: 330,506 trainable parameters for
K = 10 with the 256-wide adapter, 12,810 head only.

Initialisation (:func:`initial_weights`) is drawn in numpy from an explicit generator, so the coordinator builds
the round-0 model deterministically and without torch: the adapter as PyTorch's default for ``nn.Linear``
(weight and bias uniform in +-1/sqrt(fan_in), He et al. 2015's uniform variant with a = sqrt(5)); the head at zero
by default (De et al. 2022), or the same uniform law with ``head_init="uniform"``.

torch is imported lazily by :func:`build_model`: the shapes, the initialisation and input checks are numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.models.backbone import EMBEDDING_DIM

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["input_layer_prefix", "KIND", "EMBEDDING_DIM", "DEFAULT_ADAPTER_WIDTH", "HEAD_PREFIX", "ADAPTER_PREFIX",
           "HEAD_INITS", "HeadConfig", "build_model", "initial_weights", "prepare_input"]

KIND = "head"
DEFAULT_ADAPTER_WIDTH = 256
HEAD_PREFIX = "psi."
ADAPTER_PREFIX = "phi."
HEAD_INITS = ("zeros", "uniform")


@dataclass(frozen=True)
class HeadConfig:
    """The architecture of one head model (everything that fixes parameter names and shapes).

    Attributes:
        num_classes: K >= 2, the rows of ``psi.weight`` (one per species of the federation's table).
        adapter_width: H, the adapter's output size; 0 for no adapter (``psi`` directly on the embedding).
        embedding_dim: E, the backbone embedding size (1280 for EfficientNet-Lite0).

    Raises:
        ValueError: a field is not an integer in range (the message names the field).
    """

    num_classes: int
    adapter_width: int = DEFAULT_ADAPTER_WIDTH
    embedding_dim: int = EMBEDDING_DIM

    def __post_init__(self) -> None:
        for name, low in (("num_classes", 2), ("adapter_width", 0), ("embedding_dim", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:  # bool and float are refused too
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    @property
    def has_adapter(self) -> bool:
        """Whether ``phi`` is a trained Linear + tanh (``adapter_width > 0``)."""
        return self.adapter_width > 0

    @property
    def feature_dim(self) -> int:
        """The width of psi's input: H with an adapter, E without."""
        return self.adapter_width if self.has_adapter else self.embedding_dim

    @property
    def options(self) -> dict[str, int]:
        """``{"adapter_width": H, "embedding_dim": E}``: the fields besides ``num_classes`` (model-kind options)."""
        return {"adapter_width": self.adapter_width, "embedding_dim": self.embedding_dim}

    def parameter_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``((name, shape), ...)`` in ``named_parameters()`` order (the backends' flat layout)."""
        psi = ((f"{HEAD_PREFIX}weight", (self.num_classes, self.feature_dim)),
               (f"{HEAD_PREFIX}bias", (self.num_classes,)))
        if not self.has_adapter:
            return psi
        return ((f"{ADAPTER_PREFIX}0.weight", (self.adapter_width, self.embedding_dim)),
                (f"{ADAPTER_PREFIX}0.bias", (self.adapter_width,))) + psi

    @property
    def num_parameters(self) -> int:
        """d = H E + H + K H + K with an adapter, K E + K without."""
        return sum(int(np.prod(shape)) for _, shape in self.parameter_shapes())

    @classmethod
    def from_weights(cls, weights: Mapping[str, np.ndarray]) -> "HeadConfig":
        """The configuration whose parameters ``weights`` are (names and shapes checked).

        Raises:
            ValueError: the names are not those of a head model, or the shapes disagree with each other.
        """
        names = set(weights)
        if "psi.weight" not in names or "psi.bias" not in names:
            raise ValueError(f"not a head model: psi.weight / psi.bias missing (names {sorted(names)})")
        k, f = (int(s) for s in np.shape(weights["psi.weight"]))
        if "phi.0.weight" in names:
            h, e = (int(s) for s in np.shape(weights["phi.0.weight"]))
            config = cls(num_classes=k, adapter_width=h, embedding_dim=e)
        else:
            config = cls(num_classes=k, adapter_width=0, embedding_dim=f)
        expected = dict(config.parameter_shapes())
        got = {n: tuple(int(s) for s in np.shape(v)) for n, v in weights.items()}
        if got != expected:
            raise ValueError(f"weights are not a head model: got {got}, a head model of these sizes has {expected}")
        return config


def input_layer_prefix(model_parameter_names: Iterable[str]) -> str | None:
    """The prefix of the head model's Linear layer that reads the model input (``"phi.0"`` with an adapter,
    ``"psi"`` without), from the names of **all** the model's parameters (not only the trained ones: with the
    adapter frozen, ``psi`` reads the adapter's output, not the input), or None for other models. Used by the
    feature centre's bias fold and by the backends' cached input norms."""
    names = set(model_parameter_names)
    if "phi.0.weight" in names:
        return "phi.0"
    if "psi.weight" in names and not any(n.startswith("phi.") for n in names):
        return "psi"
    return None


def build_model(config: HeadConfig) -> "torch.nn.Module":
    """A fresh ``torch.nn.Module`` with attributes ``phi`` (``nn.Sequential``: Linear, Tanh; empty without an
    adapter) and ``psi`` (``nn.Linear``); forward float32 (B, E) -> logits float32 (B, K).

    Its parameters carry PyTorch's default initialisation; load :func:`initial_weights` (or a model version) with
    ``shared.models.state.load_numpy_state``.
    """
    from torch import nn

    class HeadModel(nn.Module):
        """phi (adapter) + psi (head) on backbone embeddings; see ``shared.models.head``."""

        def __init__(self, config: HeadConfig) -> None:
            super().__init__()
            self.config = config
            self.phi = (nn.Sequential(nn.Linear(config.embedding_dim, config.adapter_width), nn.Tanh())
                        if config.has_adapter else nn.Sequential())
            self.psi = nn.Linear(config.feature_dim, config.num_classes)

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            return self.psi(self.phi(x))

    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    return HeadModel(config)


def initial_weights(config: HeadConfig, rng: np.random.Generator | int, *,
                    head_init: str = "zeros") -> dict[str, np.ndarray]:
    """The round-0 model: ``{name: float32 array}`` drawn from ``rng`` (see the module docstring).

    Args:
        config: the architecture.
        rng: a numpy ``Generator`` (used, and advanced) or an integer seed for ``numpy.random.default_rng``.
        head_init: ``"zeros"`` (psi = 0: every class starts at logit 0; De et al. 2022) or ``"uniform"``
            (PyTorch's nn.Linear default law, +-1/sqrt(feature_dim)).

    Returns:
        Arrays in ``named_parameters()`` order; the same generator state gives the same arrays on every machine
        (numpy's ``Generator.random`` is platform independent).

    Raises:
        ValueError: unknown ``head_init``, or ``rng`` neither a Generator nor an int.
    """
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init must be one of {HEAD_INITS}, got {head_init!r}")
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        rng = np.random.default_rng(int(rng))
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator or an integer seed, got {type(rng).__name__}")

    def uniform(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        bound = 1.0 / np.sqrt(fan_in)
        return ((rng.random(shape) * 2.0 - 1.0) * bound).astype(np.float32)

    out: dict[str, np.ndarray] = {}
    for name, shape in config.parameter_shapes():
        if name.startswith(HEAD_PREFIX) and head_init == "zeros":
            out[name] = np.zeros(shape, np.float32)
        else:
            fan_in = config.embedding_dim if name.startswith(ADAPTER_PREFIX) else config.feature_dim
            out[name] = uniform(shape, fan_in)
    return out


def prepare_input(x: np.ndarray, config: HeadConfig) -> np.ndarray:
    """Backbone embeddings as model input: float32 C-contiguous (B, E).

    Args:
        x: float (B, E) embeddings (float32 or float64; B may be 0).

    Raises:
        ValueError: not a 2-D float array of width E (e.g. uint8 images, which must be embedded first).
    """
    arr = np.asarray(x)
    e = config.embedding_dim
    if arr.ndim != 2 or arr.shape[1] != e or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"the head model takes backbone embeddings, float32 (B, {e}); got {arr.dtype} "
                         f"{arr.shape} (embed images first: edge_sdk.inference.embedder, "
                         "edge_sdk.data.embedding_cache)")
    return np.ascontiguousarray(arr, dtype=np.float32)
