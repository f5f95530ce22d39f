"""Model weights as numpy arrays: the one conversion every torch model of ``shared.models`` uses.

The wire and the stores hold weights as ``{parameter name: float32 array}`` (safetensors); these two functions move
them in and out of a ``torch.nn.Module``. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["to_numpy_state", "load_numpy_state"]


def to_numpy_state(model: "torch.nn.Module") -> dict[str, np.ndarray]:
    """``{parameter name: float32 array}`` (copies), names as ``model.named_parameters()`` gives them."""
    return {name: p.detach().cpu().numpy().astype(np.float32, copy=True) for name, p in model.named_parameters()}


def load_numpy_state(model: "torch.nn.Module", tensors: Mapping[str, np.ndarray]) -> None:
    """Copy ``tensors`` into ``model``'s parameters in place.

    Raises:
        ValueError: names or shapes differ from the model's (the message lists what is missing and unexpected).
    """
    import torch

    params = dict(model.named_parameters())
    if set(params) != set(tensors):
        raise ValueError(f"weights do not match the model: missing {sorted(set(params) - set(tensors))}, "
                         f"unexpected {sorted(set(tensors) - set(params))}")
    with torch.no_grad():
        for name, p in params.items():
            value = np.asarray(tensors[name])
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {value.shape} differs from the model's {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))
