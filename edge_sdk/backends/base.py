"""The training-backend interface: per-example gradients in, one flat parameter vector out.

A backend owns a model and its parameters; the privacy mechanism (``edge_sdk.privacy.ccdp``) never sees the
framework. Every backend exposes the parameters as one flat float32 vector in a fixed order
(:attr:`TrainingBackend.parameter_layout`), so the mechanism is written once in numpy and fed by any backend
(the layering of Opacus's ``grad_sample`` behind its optimizer).

Backends register themselves by name with :func:`register_backend`; :func:`create_backend` builds one by name
and imports its module lazily, so a gateway never imports a framework it does not use.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

from edge_sdk.privacy.per_example import MaterialisedGradients, PerExampleGradients

__all__ = [
    "ParameterSpec",
    "TrainingBackend",
    "register_backend",
    "create_backend",
    "available_backends",
    "flatten",
    "unflatten",
]


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter tensor's place in the flat vector: ``flat[offset : offset + size].reshape(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        """Number of scalars."""
        return int(np.prod(self.shape, dtype=np.int64))


def checked_weights(weights: dict[str, np.ndarray], layout: tuple[ParameterSpec, ...], *,
                    allowed_extra: frozenset[str] | set[str] = frozenset()) -> dict[str, np.ndarray]:
    """``{name: float32 array}`` for every parameter of ``layout``, checked against it.

    Args:
        weights: name -> array, as received in a task.
        layout: the backend's parameters (names and shapes).
        allowed_extra: further names that may be present (e.g. buffers), passed through unchecked.

    Raises:
        ConfigError: a name is unknown or missing, or a shape differs.
    """
    unknown = set(weights) - {s.name for s in layout} - set(allowed_extra)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {sorted(unknown)}", field="weights",
                          fix="the task's model must be the backend's model kind and size (shared.models.kinds)")
    out = {}
    for spec in layout:
        if spec.name not in weights:
            raise ConfigError(f"parameter {spec.name!r} missing", field=spec.name, fix="send the full model")
        value = np.asarray(weights[spec.name], dtype=np.float32)
        if value.shape != spec.shape:
            raise ConfigError(f"parameter {spec.name!r} has shape {value.shape}, expected {spec.shape}",
                              field=spec.name, fix="use the same model architecture (number of classes) on both "
                                                   "sides")
        out[spec.name] = value
    return out


def flatten(weights: dict[str, np.ndarray], layout: tuple[ParameterSpec, ...]) -> np.ndarray:
    """Concatenate ``weights`` in ``layout`` order into float32 (d,) (names beyond ``layout`` are ignored).

    Raises:
        ConfigError: a name is missing or a shape differs.
    """
    checked = checked_weights({k: v for k, v in weights.items() if k in {s.name for s in layout}}, layout)
    parts = [checked[spec.name].reshape(-1) for spec in layout]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def unflatten(flat: np.ndarray, layout: tuple[ParameterSpec, ...], *,
              dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten`: (d,) -> ``{name: array of its shape}`` of ``dtype`` (copies)."""
    return {s.name: np.array(flat[s.offset:s.offset + s.size], dtype=dtype).reshape(s.shape) for s in layout}


class TrainingBackend(ABC):
    """A model with per-example gradients, trained by plain SGD steps applied from outside.

    Which model is a :class:`shared.models.kinds.ModelSpec` (the backend's ``spec``). Inputs ``x`` are what that
    kind takes (``ModelSpec.prepare_input``): float32 backbone embeddings (B, 1280) for the head model
    (``shared.models.head``); uint8 or float32 grayscale images (B, 28, 28) for the legacy camera CNN (uint8 scaled by
    1/255). Labels ``y`` are int64 (B,) class indices.

    Weights in and out (:meth:`set_weights`, :meth:`get_weights`) are the whole model version, frozen parameters
    included; gradients and the flat vector (:attr:`parameter_layout`) cover the trainable parameters only.
    """

    name: str = "abstract"

    @property
    @abstractmethod
    def parameter_layout(self) -> tuple[ParameterSpec, ...]:
        """Fixed order, shapes and offsets of the trainable parameters in every flat vector."""

    @property
    def num_parameters(self) -> int:
        """d, the length of a flat parameter/gradient vector."""
        layout = self.parameter_layout
        return layout[-1].offset + layout[-1].size if layout else 0

    @abstractmethod
    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load ``{name: float32 array}``: every parameter of the model, frozen ones included (a missing or extra
        name, or a wrong shape, raises ConfigError)."""

    @abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """Current ``{name: float32 array}`` of every parameter, frozen ones included and unchanged (copies)."""

    @abstractmethod
    def per_example_gradients(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of each example's loss, float32 (B, d) in :attr:`parameter_layout` order (not clipped)."""

    def per_example(self, x: np.ndarray, y: np.ndarray, *,
                    input_sq_norms: np.ndarray | None = None) -> PerExampleGradients:
        """Per-example gradients as the mechanism consumes them (norms + weighted sums).

        The default materialises :meth:`per_example_gradients`; a backend may override it with a path that never
        builds the (B, d) array (ghost clipping). Both must agree up to float32 rounding (a ghost path's norms
        are upper bounds, :func:`~edge_sdk.privacy.per_example.summation_error_bound`).

        Args:
            input_sq_norms: float64 (B,) upper bounds of ``||x_i||^2`` computed once per record
                (:class:`edge_sdk.training.TrainingInputs`); a ghost path uses them for the Linear layer that
                reads the input instead of measuring ``x`` again. Ignored by the materialised default.
        """
        return MaterialisedGradients(self.per_example_gradients(x, y))

    @abstractmethod
    def gradient(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of the mean loss over the batch, float32 (d,) (the fast non-private path)."""

    @abstractmethod
    def apply_gradient(self, flat_grad: np.ndarray, learning_rate: float) -> None:
        """One SGD step: ``theta <- theta - learning_rate * flat_grad``; ``flat_grad`` float32 (d,)."""

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted class indices, int64 (B,)."""


BackendFactory = Callable[..., TrainingBackend]
_REGISTRY: dict[str, BackendFactory] = {}
# Where each built-in backend registers itself; imported on first use.
_BUILTIN_MODULES = {"torch": "edge_sdk.backends.torch_backend", "ort": "edge_sdk.backends.ort_backend"}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Class/function decorator that registers a backend factory under ``name``.

    Raises:
        ValueError: ``name`` already registered to another factory.
    """

    def decorator(factory: BackendFactory) -> BackendFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"training backend {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def available_backends() -> tuple[str, ...]:
    """Names of registered and built-in backends."""
    return tuple(sorted(set(_REGISTRY) | set(_BUILTIN_MODULES)))


def create_backend(name: str, **kwargs: object) -> TrainingBackend:
    """Build the backend registered as ``name`` with ``kwargs`` (e.g. ``num_classes``, ``threads``).

    Raises:
        ConfigError: unknown name, or its framework is not installed (the fix names the extra to install).
    """
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        try:
            importlib.import_module(_BUILTIN_MODULES[name])
        except ImportError as exc:
            raise ConfigError(f"backend {name!r} cannot be imported: {exc}", field="backend",
                              fix=f"install it, e.g. pip install 'wildfed[{name}]'") from exc
    if name not in _REGISTRY:
        raise ConfigError(f"unknown training backend {name!r}", field="backend",
                          fix=f"use one of {', '.join(available_backends())}")
    return _REGISTRY[name](**kwargs)
