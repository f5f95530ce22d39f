"""Model kinds: which trainable camera model a backend, an ONNX export or an artifact set is for.

A :class:`ModelSpec` names a kind and fixes its architecture (number of classes and the kind's options); it is
plain, hashable, JSON-serialisable data (the ORT artifact manifest carries it), and everything that depends on the
architecture asks it: the torch module (:meth:`ModelSpec.build`), the round-0 weights
(:meth:`ModelSpec.initial_weights`), the shape of one example (:attr:`ModelSpec.example_shape`) and the conversion
of a batch to model input (:meth:`ModelSpec.prepare_input`). Kinds register in :data:`_KINDS`:

==============  =================================  ========================================  ===================
kind            module                             input, one example                        options
==============  =================================  ========================================  ===================
``head``        :mod:`shared.models.head`          float32 (E,) backbone embedding           ``adapter_width``,
                (phi adapter + psi head)                                                     ``embedding_dim``
==============  =================================  ========================================  ===================

There is one camera model kind, the head model on frozen backbone embeddings, used by the gateways, the demo, the
audit and the experiments. :func:`spec_from_weights` tells kinds apart by
their tensors, so code that holds only a model version (the coordinator's artifact store) needs no extra setting.

Compatibility of the JSON form (:meth:`ModelSpec.to_json`): a kind's options are only ever added with a default,
never renamed. A manifest without a spec is from before kinds existed (the camera CNN's artifact sets): it is
refused with the fix (rebuild the artifacts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_KIND", "KINDS", "SCOPES", "ModelSpec", "model_spec", "spec_from_weights", "as_spec",
           "trainable_names"]

DEFAULT_KIND = "head"
SCOPES = ("all", "head")  # what a backend trains: every parameter, or the head psi.* alone (phi frozen)


def trainable_names(parameter_names: list[str] | tuple[str, ...], scope: str) -> tuple[str, ...]:
    """The trainable parameters of ``scope`` (``"all"``: every parameter; ``"head"``: ``psi.*``), in the given
    order.

    Raises:
        ValueError: unknown scope.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return tuple(n for n in parameter_names if scope == "all" or n.startswith("psi."))


class _Kind(ABC):
    """What a model kind provides; one subclass per kind (all numpy except :meth:`build`)."""

    name: str
    #: every trainable layer is an ``nn.Linear`` on 2-D input (so per-example gradients factor as outer products)
    linear_only: bool

    @abstractmethod
    def options(self, num_classes: int, options: Mapping[str, Any]) -> dict[str, int]:
        """Checked, complete options (defaults filled in). Raises ConfigError naming the bad option."""

    @abstractmethod
    def build(self, spec: "ModelSpec") -> "torch.nn.Module":
        """A fresh torch module with ``phi`` / ``psi`` attributes."""

    @abstractmethod
    def initial_weights(self, spec: "ModelSpec", rng: np.random.Generator, **init: Any) -> dict[str, np.ndarray]:
        """Round-0 weights drawn from ``rng``."""

    @abstractmethod
    def example_shape(self, spec: "ModelSpec") -> tuple[int, ...]:
        """Shape of one example as the model takes it (no batch axis)."""

    @abstractmethod
    def prepare_input(self, spec: "ModelSpec", x: np.ndarray) -> np.ndarray:
        """A batch as float32 model input (B, *example_shape). Raises ValueError on another shape/dtype."""

    @abstractmethod
    def from_weights(self, weights: Mapping[str, np.ndarray]) -> "ModelSpec | None":
        """The spec these weights are a version of, or None if they are not this kind's."""

    @abstractmethod
    def parameter_shapes(self, spec: "ModelSpec") -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``((name, shape), ...)`` in ``named_parameters()`` order."""


class _Head(_Kind):
    name = "head"
    linear_only = True

    def _config(self, spec: "ModelSpec"):
        from shared.models.head import HeadConfig

        return HeadConfig(num_classes=spec.num_classes, **spec.option_dict)

    def options(self, num_classes: int, options: Mapping[str, Any]) -> dict[str, int]:
        from shared.models.head import HeadConfig

        unknown = set(options) - {"adapter_width", "embedding_dim"}
        if unknown:
            raise ConfigError(f"unknown option(s) {sorted(unknown)} for model kind 'head'", field="model",
                              fix="use adapter_width (0: head only) and embedding_dim")
        try:
            return HeadConfig(num_classes=num_classes, **options).options
        except ValueError as exc:
            raise ConfigError(str(exc), field="model", fix="adapter_width >= 0 (0: head only), "
                                                           "embedding_dim 1280 for EfficientNet-Lite0") from None

    def build(self, spec: "ModelSpec") -> "torch.nn.Module":
        from shared.models.head import build_model

        return build_model(self._config(spec))

    def initial_weights(self, spec: "ModelSpec", rng: np.random.Generator, **init: Any) -> dict[str, np.ndarray]:
        from shared.models.head import initial_weights

        return initial_weights(self._config(spec), rng, **init)

    def example_shape(self, spec: "ModelSpec") -> tuple[int, ...]:
        return (self._config(spec).embedding_dim,)

    def prepare_input(self, spec: "ModelSpec", x: np.ndarray) -> np.ndarray:
        from shared.models.head import prepare_input

        return prepare_input(x, self._config(spec))

    def from_weights(self, weights: Mapping[str, np.ndarray]) -> "ModelSpec | None":
        from shared.models.head import HeadConfig

        try:
            config = HeadConfig.from_weights(weights)
        except ValueError:
            return None
        return ModelSpec(self.name, config.num_classes, tuple(sorted(config.options.items())))

    def parameter_shapes(self, spec: "ModelSpec") -> tuple[tuple[str, tuple[int, ...]], ...]:
        return self._config(spec).parameter_shapes()


_KINDS: dict[str, _Kind] = {k.name: k for k in (_Head(),)}
KINDS = tuple(_KINDS)


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: a kind, its number of classes and its options (build with :func:`model_spec`).

    Attributes:
        kind: a name of :data:`KINDS`.
        num_classes: K.
        options: ``((name, int value), ...)`` sorted by name, complete (defaults filled in).
    """

    kind: str
    num_classes: int
    options: tuple[tuple[str, int], ...] = field(default=())

    @property
    def option_dict(self) -> dict[str, int]:
        """:attr:`options` as a dict."""
        return dict(self.options)

    @property
    def _kind(self) -> _Kind:
        return _KINDS[self.kind]

    @property
    def linear_only(self) -> bool:
        """Every trainable layer is a Linear on 2-D input (factored per-example gradients apply)."""
        return self._kind.linear_only

    @property
    def example_shape(self) -> tuple[int, ...]:
        """Shape of one example as the model takes it (no batch axis): (E,) for the head model."""
        return self._kind.example_shape(self)

    def parameter_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``((name, shape), ...)`` in ``named_parameters()`` order, without torch."""
        return self._kind.parameter_shapes(self)

    def build(self) -> "torch.nn.Module":
        """A fresh torch module of this architecture (imports torch)."""
        return self._kind.build(self)

    def initial_weights(self, rng: np.random.Generator | int, **init: Any) -> dict[str, np.ndarray]:
        """Round-0 weights ``{name: float32 array}`` drawn from ``rng`` (a numpy Generator or an int seed);
        ``init`` are the kind's initialisation options (head: ``head_init``)."""
        if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
            rng = np.random.default_rng(int(rng))
        return self._kind.initial_weights(self, rng, **init)

    def prepare_input(self, x: np.ndarray) -> np.ndarray:
        """A batch as float32 C-contiguous model input (B, *example_shape).

        Raises:
            ValueError: the batch has another shape or dtype than this kind takes (the message says which).
        """
        return self._kind.prepare_input(self, x)

    def to_json(self) -> dict[str, Any]:
        """``{"kind", "num_classes", "options"}`` (what the artifact manifest stores)."""
        return {"kind": self.kind, "num_classes": self.num_classes, "options": self.option_dict}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, *, num_classes: int | None = None) -> "ModelSpec":
        """Inverse of :meth:`to_json`.

        Raises:
            ConfigError: ``data`` None (a manifest from before model kinds: the retired camera CNN's), an unknown
                kind or bad options.
        """
        if data is None:
            raise ConfigError("the manifest names no model: it is from before model kinds (the retired 28x28 camera "
                              "CNN)", field="model", fix="rebuild the artifacts for the head model "
                              "(coordinator.artifacts.build_artifacts)")
        return model_spec(str(data.get("kind")), int(data.get("num_classes", -1)), **dict(data.get("options") or {}))


def model_spec(kind: str = DEFAULT_KIND, num_classes: int = 10, **options: Any) -> ModelSpec:
    """A checked :class:`ModelSpec` (options completed with the kind's defaults).

    Example: ``model_spec("head", 10, adapter_width=256)``; ``model_spec("head", 10, adapter_width=0)`` is head only.

    Raises:
        ConfigError: unknown kind, num_classes < 2, or an unknown / out-of-range option (field ``model``).
    """
    if kind not in _KINDS:
        raise ConfigError(f"unknown model kind {kind!r}", field="model", fix=f"use one of {', '.join(KINDS)}")
    checked = _KINDS[kind].options(num_classes, options)
    return ModelSpec(kind, int(num_classes), tuple(sorted(checked.items())))


def spec_from_weights(weights: Mapping[str, np.ndarray]) -> ModelSpec:
    """The spec that ``weights`` (a model version, ``{name: array}``) belong to, told apart by names and shapes.

    Raises:
        ConfigError: the tensors are no registered kind's.
    """
    for kind in _KINDS.values():
        spec = kind.from_weights(weights)
        if spec is not None:
            return spec
    shapes = {n: tuple(np.shape(v)) for n, v in weights.items()}
    raise ConfigError(f"the weights are not a model of any kind {KINDS}: {shapes}", field="weights",
                      fix="send a model built by shared.models.kinds.model_spec(...).initial_weights")


def as_spec(model: "ModelSpec | str | None", num_classes: int | None, options: Mapping[str, Any] | None = None,
            ) -> ModelSpec:
    """Normalise the ways callers name a model: a :class:`ModelSpec` (``num_classes`` and ``options``, if given,
    must agree with it), a kind name, or None (:data:`DEFAULT_KIND`); ``num_classes`` None means 10.

    Raises:
        ConfigError: a spec and a disagreeing ``num_classes`` / ``options``, or what :func:`model_spec` raises.
    """
    if isinstance(model, ModelSpec):
        if num_classes is not None and int(num_classes) != model.num_classes:
            raise ConfigError(f"num_classes {num_classes} disagrees with the model spec's {model.num_classes}",
                              field="num_classes", fix="give one of them")
        if options:
            raise ConfigError("options given beside a ModelSpec", field="model_options",
                              fix="put them in the spec (model_spec(kind, K, **options))")
        return model
    return model_spec(DEFAULT_KIND if model is None else str(model), 10 if num_classes is None else int(num_classes),
                      **dict(options or {}))
