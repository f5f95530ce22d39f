"""Two-stage RadioUNet for path-loss (radio) maps, and its transmitter-sensitive parameter groups.

Levie, Yapar, Kutyniok and Caire 2021, "RadioUNet: Fast Radio Map Estimation with Convolutional Neural Networks",
IEEE Trans. Wireless Communications 20(6), Sec. III: stage 1 maps the input (building raster and transmitter
raster) to a coarse radio map; stage 2 maps the same input plus stage 1's output to a refined map. Here each stage
is a small U-Net (Ronneberger et al. 2015) sized for a 2-core CPU and 64 x 64 maps (``shared.radio``):

    stage s (in_channels -> 1), base width c (default 8):
      enc0: conv3x3 in->c, ReLU, conv3x3 c->c, ReLU                         (B, c, H, W)
      enc1: max-pool 2, conv3x3 c->2c, ReLU, conv3x3 2c->2c, ReLU          (B, 2c, H/2, W/2)
      enc2: max-pool 2, conv3x3 2c->4c, ReLU, conv3x3 4c->4c, ReLU         (B, 4c, H/4, W/4)
      up1:  transposed conv 2x2 4c->2c, concat enc1, conv3x3 4c->2c, ReLU  (B, 2c, H/2, W/2)
      up0:  transposed conv 2x2 2c->c, concat enc0, conv3x3 2c->c, ReLU    (B, c, H, W)
      head: conv1x1 c->1                                                   (B, 1, H, W)

    stage 1 input: the model input (B, 2, H, W): channel 0 buildings, channel 1 transmitter one-hot
    stage 2 input: concat(model input, stage 1 output)  (B, 3, H, W)

The forward pass returns both stages' maps; stage 2's input takes stage 1's output *detached*, so the loss
``mse(stage 1) + mse(stage 2)`` trains each stage on its own target, which is RadioUNet's stage-by-stage training
done in one pass (the paper trains stage 2 with stage 1 frozen). H and W must be multiples of 4. No batch
normalisation (DP and federated averaging need each example's output to depend on that example only).

Parameter groups (docs/radiomap.md, "The mechanism"): the transmitter-sensitive entries are the weights
that multiply the transmitter channel, i.e. ``weight[:, TRANSMITTER_CHANNEL]`` of each stage's input convolution,
found from the model's structure (:meth:`RadioUNet.input_convolutions`), never from hard-coded indices. Every other
parameter entry is in its stage's residual group. :func:`parameter_groups` returns the layout over the flat update
vector in :func:`shared.protocol.canonical_flatten` order.

torch is imported lazily so that a coordinator without torch can import the constants and group layout helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.models.state import load_numpy_state, to_numpy_state
from shared.radio.dataset import BUILDING_CHANNEL, TRANSMITTER_CHANNEL

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["INPUT_CHANNELS", "BUILDING_CHANNEL", "TRANSMITTER_CHANNEL", "STAGES", "build_model", "initial_weights",
           "to_numpy_state", "load_numpy_state", "GroupLayout", "parameter_groups"]

INPUT_CHANNELS = 2  # the two channels of shared.radio.model_inputs
STAGES = (1, 2)


def build_model(*, width: int = 8) -> "torch.nn.Module":
    """A fresh :class:`RadioUNet` (``torch.nn.Module``) with sub-modules ``stage1`` and ``stage2``.

    Args:
        width: base channel count c of each stage's U-Net (>= 1); 8 (the default) gives 53,050 parameters.

    Input: float32 (B, 2, H, W), H and W multiples of 4. Output: a tuple (stage 1 map, stage 2 map), each float32
    (B, 1, H, W) of normalised path gain (``shared.radio``: 0 = gain_min_db or a building, 1 = gain_max_db).

    Raises:
        ValueError: width is not a positive integer.
    """
    import torch
    from torch import nn

    if type(width) is not int or width < 1:
        raise ValueError(f"width must be a positive integer, got {width!r}")

    def double_conv(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

    class UNetStage(nn.Module):
        """One stage: a three-level U-Net, ``in_channels`` -> 1 (see the module docstring)."""

        def __init__(self, in_channels: int, c: int) -> None:
            super().__init__()
            self.enc0 = double_conv(in_channels, c)
            self.enc1 = double_conv(c, 2 * c)
            self.enc2 = double_conv(2 * c, 4 * c)
            self.up1 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
            self.dec1 = nn.Sequential(nn.Conv2d(4 * c, 2 * c, 3, padding=1), nn.ReLU())
            self.up0 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
            self.dec0 = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU())
            self.head = nn.Conv2d(c, 1, 1)

        @property
        def input_convolution(self) -> nn.Conv2d:
            """The one layer that reads this stage's input."""
            return self.enc0[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e0 = self.enc0(x)
            e1 = self.enc1(nn.functional.max_pool2d(e0, 2))
            e2 = self.enc2(nn.functional.max_pool2d(e1, 2))
            d1 = self.dec1(torch.cat([self.up1(e2), e1], dim=1))
            d0 = self.dec0(torch.cat([self.up0(d1), e0], dim=1))
            return self.head(d0)

    class RadioUNet(nn.Module):
        """Two-stage RadioUNet (Levie et al. 2021, Sec. III); see the module docstring."""

        def __init__(self, c: int) -> None:
            super().__init__()
            self.stage1 = UNetStage(INPUT_CHANNELS, c)
            self.stage2 = UNetStage(INPUT_CHANNELS + 1, c)

        def input_convolutions(self) -> dict[int, tuple[str, int]]:
            """``{stage: (name of the weight of the layer that reads the stage's input, index of the transmitter
            channel in that input)}``, found by looking up each stage's input layer among the named parameters."""
            names = {id(p): n for n, p in self.named_parameters()}
            return {1: (names[id(self.stage1.input_convolution.weight)], TRANSMITTER_CHANNEL),
                    2: (names[id(self.stage2.input_convolution.weight)], TRANSMITTER_CHANNEL)}

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if x.ndim != 4 or x.shape[1] != INPUT_CHANNELS or x.shape[2] % 4 or x.shape[3] % 4:
                raise ValueError(f"expected input (B, {INPUT_CHANNELS}, H, W) with H, W multiples of 4, "
                                 f"got {tuple(x.shape)}")
            coarse = self.stage1(x)
            fine = self.stage2(torch.cat([x, coarse.detach()], dim=1))
            return coarse, fine

    return RadioUNet(width)


def initial_weights(*, width: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """PyTorch's default initialisation of :func:`build_model`, drawn with ``seed``: the round-0 global model."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return to_numpy_state(build_model(width=width))



@dataclass(frozen=True, eq=False)
class GroupLayout:
    """A partition of the flat update vector (:func:`shared.protocol.canonical_flatten` order) into named groups.

    Attributes:
        names: group names, e.g. ``("stage1/transmitter", "stage1/residual", ...)``.
        index: int64 (d,), ``index[i]`` = the group of coordinate i (0 <= index < len(names)).
        stage: the RadioUNet stage (1 or 2) of each group.
        sensitive: whether each group is transmitter-sensitive.

    Raises:
        ValueError: lengths disagree, an index is out of range, or a group is empty.
    """

    names: tuple[str, ...]
    index: np.ndarray
    stage: tuple[int, ...]
    sensitive: tuple[bool, ...]

    def __post_init__(self) -> None:
        g = len(self.names)
        if len(self.stage) != g or len(self.sensitive) != g:
            raise ValueError("names, stage and sensitive must have one entry per group")
        index = np.asarray(self.index)
        if index.ndim != 1 or index.dtype.kind not in "iu" or index.size == 0:
            raise ValueError(f"index must be a non-empty 1-D integer array, got {index.dtype} {index.shape}")
        if index.min() < 0 or index.max() >= g:
            raise ValueError(f"index values must lie in [0, {g})")
        sizes = np.bincount(index, minlength=g)
        if np.any(sizes == 0):
            raise ValueError(f"empty groups: {[n for n, s in zip(self.names, sizes) if s == 0]}")
        object.__setattr__(self, "index", index.astype(np.int64, copy=False))

    @property
    def sizes(self) -> np.ndarray:
        """int64 (G,): d_g, coordinates per group."""
        return np.bincount(self.index, minlength=len(self.names)).astype(np.int64)

    @property
    def dimension(self) -> int:
        """d, the flat vector's length."""
        return int(self.index.size)


def parameter_groups(model: "torch.nn.Module") -> GroupLayout:
    """The transmitter-sensitive and residual groups of a :func:`build_model` RadioUNet, over the flat vector of
    its parameters in :func:`shared.protocol.canonical_flatten` order (parameter names sorted).

    Groups: ``stage{s}/transmitter`` = the entries ``weight[:, TRANSMITTER_CHANNEL, :, :]`` of stage s's input
    convolution (:meth:`RadioUNet.input_convolutions`), ``stage{s}/residual`` = every other parameter of stage s.

    Raises:
        ValueError: the model lacks ``input_convolutions`` or a parameter belongs to no stage.
    """
    if not hasattr(model, "input_convolutions"):
        raise ValueError("parameter_groups needs a RadioUNet from shared.models.radio_unet.build_model")
    inputs = model.input_convolutions()
    names = tuple(f"stage{s}/{kind}" for s in STAGES for kind in ("transmitter", "residual"))
    params = {n: p for n, p in model.named_parameters()}
    pieces = []
    for name in sorted(params):
        shape = tuple(params[name].shape)
        stage = next((s for s in STAGES if name.startswith(f"stage{s}.")), None)
        if stage is None:
            raise ValueError(f"parameter {name!r} belongs to no stage")
        group = np.full(shape, names.index(f"stage{stage}/residual"), dtype=np.int64)
        weight_name, channel = inputs[stage]
        if name == weight_name:
            group[:, channel] = names.index(f"stage{stage}/transmitter")
        pieces.append(group.reshape(-1))
    return GroupLayout(names=names, index=np.concatenate(pieces),
                       stage=tuple(s for s in STAGES for _ in range(2)),
                       sensitive=tuple(kind == "transmitter" for _ in STAGES for kind in ("transmitter", "residual")))
