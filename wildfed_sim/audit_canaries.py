"""The privacy audit's canaries (:mod:`wildfed_sim.audit`, steps 1-3 of its method): their design (one parameter
coordinate each, the secret inclusion bits, key records), the coordinate ranking that chooses them, the training
backend wrapper that substitutes their per-example gradients, and the deliberately broken noise source of the
diagnostic run. Imports ``edge_sdk`` only on first use of the wrapper's gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.iucn import IUCNCategory


# ----------------------------------------------------------------------------------------------- canaries
@dataclass(frozen=True)
class CanaryDesign:
    """The canaries of one audit (M = total canaries over all audited categories).

    Attributes:
        categories: int8 (M,), IUCN rank of each canary.
        coordinates: int64 (M,), distinct indices into the flat parameter vector (backend layout order).
        included: bool (M,), the secret S (True = "in": gradient C e_j; False = zero-gradient slot).
        images: (M, *record shape), distinct keys that identify each canary's record: random embeddings
            (float32 (M, E), uniform in the backbone's [0, 6] range) for the head model's float32 inputs, random
            pixels for uint8 ones; none equal to a real record's.
    """

    categories: np.ndarray
    coordinates: np.ndarray
    included: np.ndarray
    images: np.ndarray

    def __post_init__(self) -> None:
        m = self.categories.shape[0]
        if self.coordinates.shape != (m,) or self.included.shape != (m,) or self.images.shape[0] != m:
            raise ValueError("canary arrays disagree in length")
        if np.unique(self.coordinates).size != m:
            raise ValueError("canary coordinates must be distinct")

    def __len__(self) -> int:
        return int(self.categories.shape[0])


def design_canaries(*, categories: Sequence[IUCNCategory], per_category: int, num_parameters: int,
                    coordinate_order: np.ndarray, real_images: np.ndarray,
                    rng: np.random.Generator) -> CanaryDesign:
    """Build the canaries: categories, coordinates, the secret inclusion S and the key images.

    Args:
        categories: audited categories; ``per_category`` canaries each.
        per_category: m >= 1.
        num_parameters: d, length of the flat parameter vector.
        coordinate_order: int (d,) permutation of ``range(d)``, most preferred coordinate first (see
            :func:`rank_coordinates`); the first ``len(categories) * m`` are used, shuffled among canaries.
        real_images: the site's real records as the model takes them (float32 (N, E) backbone embeddings, or
            uint8 images); canary keys have their shape and dtype and differ from all of them.
        rng: draws the assignment, the inclusion bits (each "in" with probability 1/2) and the key images.

    Returns:
        A :class:`CanaryDesign` with M = ``len(categories) * per_category`` canaries, grouped by category.

    Raises:
        ValueError: more canaries than parameters, or ``coordinate_order`` not of length d.
    """
    total = len(categories) * int(per_category)
    if total > num_parameters:
        raise ValueError(f"{total} canaries need {total} distinct coordinates, the model has {num_parameters}")
    order = np.asarray(coordinate_order, dtype=np.int64)
    if order.shape != (num_parameters,):
        raise ValueError(f"coordinate_order must have shape ({num_parameters},), got {order.shape}")
    coords = rng.permutation(order[:total])
    ranks = np.repeat(np.asarray([c.rank for c in categories], dtype=np.int8), per_category)
    included = rng.random(total) < 0.5
    shape = real_images.shape[1:]
    real_keys = {img.tobytes() for img in real_images}
    if real_images.dtype == np.uint8:
        images = rng.integers(0, 256, size=(total, *shape), dtype=np.uint8)
    else:
        images = (6.0 * rng.random((total, *shape))).astype(real_images.dtype)
    keys = [img.tobytes() for img in images]
    if len(set(keys)) != total or any(k in real_keys for k in keys):  # astronomically unlikely for 28x28 noise
        raise ValueError("canary key images collide; draw again")
    return CanaryDesign(categories=ranks, coordinates=coords, included=included, images=images)


def rank_coordinates(per_example_grads: Any, clipping_norm: float, rng: np.random.Generator) -> np.ndarray:
    """Coordinates ordered by mean |clipped per-example gradient| over a probe batch, smallest first.

    Args:
        per_example_grads: a :class:`~edge_sdk.privacy.per_example.PerExampleGradients` of the probe batch (B, d).
        clipping_norm: C; each probe gradient is clipped to C first, as the mechanism would.
        rng: random tie-break (many coordinates can share a magnitude, e.g. exact zeros).

    Returns:
        int64 (d,), a permutation of ``range(d)``.
    """
    b = per_example_grads.batch_size
    factors = np.minimum(1.0, clipping_norm / np.maximum(per_example_grads.norms, 1e-30)).astype(np.float32)
    grads = per_example_grads.weighted_sum(np.diag(factors))  # (B, d), row i = clip(g_i)
    magnitude = np.abs(np.asarray(grads, dtype=np.float64)).sum(axis=0) / max(1, b)
    return np.lexsort((rng.random(magnitude.shape[0]), magnitude)).astype(np.int64)


@functools.cache
def _canary_gradients_class() -> type:
    """The :class:`~edge_sdk.privacy.per_example.PerExampleGradients` subclass of :class:`CanaryBackend` (built on
    first use so that importing this module imports no ``edge_sdk``)."""
    from edge_sdk.privacy.per_example import PerExampleGradients

    class CanaryGradients(PerExampleGradients):
        """Real rows from the wrapped backend, canary rows as Dirac vectors ``C e_j`` ("in") or zeros ("out")."""

        def __init__(self, real: PerExampleGradients | None, real_rows: np.ndarray, canary_rows: np.ndarray,
                     canary_coords: np.ndarray, canary_norms: np.ndarray, batch_size: int, dim: int) -> None:
            self._real, self._real_rows = real, real_rows
            self._canary_rows, self._coords, self._canary_norms = canary_rows, canary_coords, canary_norms
            self._dim = dim
            norms = np.zeros(batch_size, dtype=np.float64)
            if real is not None:
                norms[real_rows] = real.norms
            norms[canary_rows] = canary_norms
            self.norms = norms

        def weighted_sum(self, weights: np.ndarray) -> np.ndarray:
            w = np.asarray(weights, dtype=np.float32)
            out = (self._real.weighted_sum(w[:, self._real_rows]).astype(np.float32, copy=True)
                   if self._real is not None else np.zeros((w.shape[0], self._dim), dtype=np.float32))
            # Canary row i contributes W[k, i] * norm_i at its own coordinate (norm_i = C "in", 0 "out").
            np.add.at(out, (slice(None), self._coords),
                      w[:, self._canary_rows] * self._canary_norms.astype(np.float32)[None, :])
            return out

    return CanaryGradients


class CanaryBackend:
    """A training backend wrapper that substitutes the canary records' per-example gradients.

    Conforms to :class:`edge_sdk.backends.base.TrainingBackend` (what :func:`edge_sdk.training.train_locally`
    calls) and delegates everything to ``inner`` except per-example gradients: rows whose image is a canary key get
    ``C e_j`` ("in") or the zero vector ("out"); the other rows get the inner backend's own per-example gradients
    (its ghost-clipping path for the torch backend), unchanged. Not registered: it exists only for the audit.

    Args:
        inner: the real backend.
        design: the canaries.
        clipping_norm: C; an "in" canary's gradient has L2 norm exactly C (not above, so clipping keeps it whole).
    """

    def __init__(self, inner: Any, design: CanaryDesign, clipping_norm: float) -> None:
        self.inner = inner
        self.design = design
        self.clipping_norm = float(clipping_norm)
        self._slot = {img.tobytes(): i for i, img in enumerate(design.images)}
        self.name = f"canary({getattr(inner, 'name', 'backend')})"

    @property
    def parameter_layout(self) -> Any:
        """The inner backend's layout."""
        return self.inner.parameter_layout

    @property
    def num_parameters(self) -> int:
        """d."""
        return int(self.inner.num_parameters)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Delegated."""
        self.inner.set_weights(weights)

    def get_weights(self) -> dict[str, np.ndarray]:
        """Delegated."""
        return self.inner.get_weights()

    def apply_gradient(self, flat_grad: np.ndarray, learning_rate: float) -> None:
        """Delegated."""
        self.inner.apply_gradient(flat_grad, learning_rate)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Delegated."""
        return self.inner.predict(x)

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(real row indices, canary row indices, canary slot per canary row), all int64."""
        slots = np.asarray([self._slot.get(img.tobytes(), -1) for img in np.asarray(x)], dtype=np.int64)
        canary_rows = np.flatnonzero(slots >= 0)
        return np.flatnonzero(slots < 0), canary_rows, slots[canary_rows]

    def per_example(self, x: np.ndarray, y: np.ndarray, *, input_sq_norms: np.ndarray | None = None) -> Any:
        """Per-example gradients of the batch (B, d), implicit: norms and weighted sums (see the class docstring).

        Returns:
            a :class:`~edge_sdk.privacy.per_example.PerExampleGradients`.
        """
        real_rows, canary_rows, slots = self._split(x)
        sq = None if input_sq_norms is None else np.asarray(input_sq_norms)[real_rows]
        real = self.inner.per_example(x[real_rows], y[real_rows], input_sq_norms=sq) if real_rows.size else None
        norms = np.where(self.design.included[slots], self.clipping_norm, 0.0)
        return _canary_gradients_class()(real, real_rows, canary_rows, self.design.coordinates[slots], norms,
                                         int(np.asarray(y).shape[0]), self.num_parameters)

    def per_example_gradients(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (B, d), the materialised form of :meth:`per_example`."""
        b = int(np.asarray(y).shape[0])
        return self.per_example(x, y).weighted_sum(np.eye(b, dtype=np.float32))

    def gradient(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (d,), mean of :meth:`per_example_gradients` (the non-private path; unused by the audit)."""
        return self.per_example_gradients(x, y).mean(axis=0).astype(np.float32)


class SilencedNoise:
    """TEST/DIAGNOSTIC ONLY: a random source whose Gaussian draws are all zero (the mechanism adds no noise).

    Uniforms (the Poisson sampling) come from ``inner`` unchanged, so only the noise is broken. Used by
    ``run_audit(break_noise=True)`` to show that the audit detects a mechanism without noise.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms from the wrapped source."""
        return self.inner.random(size)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 zeros of shape ``size`` (NOT Gaussian: this is the deliberate break)."""
        return np.zeros(size, dtype=np.float64)
