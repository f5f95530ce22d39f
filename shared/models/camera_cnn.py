"""The gateway's camera-trap classifier: a small CNN for 28x28 grayscale crops, split into a feature extractor
``phi`` and a classification head ``psi``.

The split is the one NIRA needs (DESIGN.md "Seeds"): ``phi`` is shared across clusters, ``psi`` is kept per cluster.
No batch normalisation: per-example gradients (torch.func, ghost clipping) and DP-SGD need every example's
gradient to depend on that example only (Opacus makes the same rule). Tanh rather than ReLU: bounded activations
keep per-example gradient norms small, so less is lost to clipping (Papernot et al. 2021, "Tempered sigmoid
activations for deep learning with differential privacy", AAAI). Three conv blocks keep the feature vector small
(288) so the model has 33,194 parameters: DP noise grows with the square root of the parameter count, and on
Animal-MNIST this model matches the accuracy of a 3x larger one (1568-wide flatten) without DP.

Architecture (33,194 parameters for 10 classes)::

    phi: [conv 3x3 pad 1, tanh, max-pool 2] x 3 with 1->16->32->32 channels  (B,1,28,28) -> (B,32,3,3)
         -> flatten (288) -> linear 288->64, tanh                            -> (B,64)
    psi: linear 64->num_classes                                              (B,64) -> (B,num_classes)

Input: float32 (B, 1, 28, 28) in [0, 1] (uint8 pixels / 255). Output: float32 logits.
torch is imported lazily by :func:`build_model` and friends so that a coordinator or a gateway without torch can
import this module's constants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shared.models.state import load_numpy_state, to_numpy_state

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["IMAGE_SIZE", "FEATURE_DIM", "build_model", "initial_weights", "to_numpy_state", "load_numpy_state",
           "preprocess"]

IMAGE_SIZE = 28
FEATURE_DIM = 64


def build_model(num_classes: int = 10) -> "torch.nn.Module":
    """A fresh :class:`CameraCNN` (``torch.nn.Module``) with attributes ``phi`` and ``psi``."""
    import torch
    from torch import nn

    class CameraCNN(nn.Module):
        """phi (features) + psi (head); see the module docstring."""

        def __init__(self, num_classes: int) -> None:
            super().__init__()
            self.phi = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),     # 28 -> 14
                nn.Conv2d(16, 32, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),    # 14 -> 7
                nn.Conv2d(32, 32, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),    # 7 -> 3
                nn.Flatten(), nn.Linear(32 * 3 * 3, FEATURE_DIM), nn.Tanh())
            self.psi = nn.Linear(FEATURE_DIM, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.psi(self.phi(x))

    if type(num_classes) is not int or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return CameraCNN(num_classes)


def initial_weights(num_classes: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    """PyTorch's default initialisation of :func:`build_model`, drawn with ``seed``: the round-0 global model."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return to_numpy_state(build_model(num_classes))


def preprocess(images: np.ndarray) -> Any:
    """uint8 (B, 28, 28) pixels -> float32 torch tensor (B, 1, 28, 28) in [0, 1]."""
    import torch

    images = np.asarray(images)
    if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"expected images of shape (B, {IMAGE_SIZE}, {IMAGE_SIZE}), got {images.shape}")
    return torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
