"""Per-example gradients of Linear layers held as their two factors, in numpy (no framework).

For a Linear layer y = W a + b and example i with output gradient delta_i = d loss_i / d y_i, the per-example
gradients are g_i(W) = delta_i a_i^T and g_i(b) = delta_i (Goodfellow 2015, "Efficient per-example gradient
computations"). So, without ever forming the (B, d) matrix,

- ``||g_i||^2 = sum_L ||delta_{L,i}||^2 (||a_{L,i}||^2 + [L has a bias])``, and
- ``sum_i w_i g_i(W_L) = (w * delta_L)^T a_L``, ``sum_i w_i g_i(b_L) = w^T delta_L``,

which is all the CCDP mechanism needs (:class:`edge_sdk.privacy.per_example.PerExampleGradients`). The ONNX Runtime
backend gets the factors from the coordinator's factor graph (``shared.models.onnx_export.export_factor_graph``);
the torch backend has its own torch version of the same identity (``torch_backend._GhostGradients``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edge_sdk.backends.base import ParameterSpec
from edge_sdk.privacy.per_example import PerExampleGradients, summation_error_bound

__all__ = ["LinearFactors"]


def _squared_rows(t: np.ndarray) -> np.ndarray:
    """float64 (B,) upper bounds of the squared row norms of float32 (B, n) ``t``: summed in float32 and raised by
    ``1 + gamma_n`` (:func:`~edge_sdk.privacy.per_example.summation_error_bound`), so clipping stays sound."""
    return np.einsum("ij,ij->i", t, t).astype(np.float64) * (1.0 + summation_error_bound(int(t.shape[1])))


class LinearFactors(PerExampleGradients):
    """Per-example gradients of a stack of Linear layers given as factors.

    Args:
        factors: ``{layer prefix: (a (B, in), delta (B, out))}`` float32 arrays, e.g. ``{"phi.0": ..., "psi":
            ...}``; every parameter of ``layout`` must be ``<prefix>.weight`` (out, in) or ``<prefix>.bias``
            (out,) of one of them.
        layout: the backend's trainable parameters (the order of the flat vector).
        input_sq_norms: float64 (B,) upper bounds of the model inputs' squared norms, used for ``input_layer``,
            the layer that reads the input (``shared.models.head.input_layer_prefix`` of the whole model),
            instead of measuring its
            ``a`` again; None (either): measure every layer.

    Attributes:
        norms: float64 (B,), each example's gradient norm over every parameter of ``layout``.

    Raises:
        ValueError: a layout entry is not the weight or bias of a given layer, or shapes disagree.
    """

    def __init__(self, factors: Mapping[str, tuple[np.ndarray, np.ndarray]],
                 layout: tuple[ParameterSpec, ...], input_sq_norms: np.ndarray | None = None,
                 input_layer: str | None = None) -> None:
        self._layout = layout
        self._pieces: list[tuple[str, np.ndarray, np.ndarray]] = []  # ("weight" | "bias", a, delta) per spec
        batch = None
        sq: np.ndarray | None = None
        first = input_layer if input_sq_norms is not None else None
        for spec in layout:
            prefix, _, kind = spec.name.rpartition(".")
            if prefix not in factors or kind not in ("weight", "bias"):
                raise ValueError(f"parameter {spec.name!r} is not the weight or bias of a factored Linear layer "
                                 f"({sorted(factors)})")
            a, delta = (np.asarray(t, dtype=np.float32) for t in factors[prefix])
            want = (delta.shape[1], a.shape[1]) if kind == "weight" else (delta.shape[1],)
            if a.ndim != 2 or delta.ndim != 2 or a.shape[0] != delta.shape[0] or spec.shape != want:
                raise ValueError(f"factors of {prefix!r} ({a.shape}, {delta.shape}) do not fit {spec.name} "
                                 f"{spec.shape}")
            batch = a.shape[0] if batch is None else batch
            if a.shape[0] != batch:
                raise ValueError(f"factors of {prefix!r} have batch {a.shape[0]}, others {batch}")
            d2 = _squared_rows(delta)
            if kind == "weight":
                a2 = (np.asarray(input_sq_norms, dtype=np.float64) if prefix == first else _squared_rows(a))
                if a2.shape != (a.shape[0],):
                    raise ValueError(f"input_sq_norms must be ({a.shape[0]},), got {a2.shape}")
            term = d2 * a2 if kind == "weight" else d2
            sq = term if sq is None else sq + term
            self._pieces.append((kind, a, delta))
        self.norms = np.sqrt(sq) if sq is not None else np.zeros(0)

    def weighted_sum(self, weights: np.ndarray, *, dtype: type = np.float32) -> np.ndarray:
        """(K, d) of ``dtype`` = weights (K, B) @ G, assembled per parameter in layout order, accumulated in
        ``dtype`` (:meth:`PerExampleGradients.weighted_sum`)."""
        w = np.asarray(weights, dtype=np.float32).astype(dtype)
        if w.ndim != 2 or w.shape[1] != self.batch_size:
            raise ValueError(f"weights must be (K, {self.batch_size}), got {w.shape}")
        out = np.empty((w.shape[0], sum(s.size for s in self._layout)), dtype=dtype)
        for spec, (kind, a, delta) in zip(self._layout, self._pieces):
            a, delta = a.astype(dtype, copy=False), delta.astype(dtype, copy=False)
            block = out[:, spec.offset:spec.offset + spec.size]
            if kind == "bias":
                block[...] = w @ delta
                continue
            for k in range(w.shape[0]):  # K is the number of weight rows (1 for privatize): one GEMM each
                block[k] = ((delta * w[k][:, None]).T @ a).reshape(-1)
        return out
