"""YOLOX-tiny, the camera-trap animal detector whose weights ship in ``zamba==2.7.2`` (MIT).

The modules below reproduce the ``yolox`` package's (Megvii, 0.3.0) ``YOLOX(YOLOPAFPN, YOLOXHead)`` with the same
parameter names, so that the checkpoint ``zamba/object_detection/yolox/assets/yolox_tiny_640_20220528.pth`` (its
``"model"`` state dict) loads with no missing and no unexpected keys.
Defining them here avoids the ``yolox`` package, whose import pulls cv2, torchvision, thop and loguru and pins
onnx 1.8.1.

Reference: Ge et al. 2021, "YOLOX: Exceeding YOLO Series in 2021", arXiv:2107.08430 (sec. 2.1: decoupled head,
anchor-free outputs per grid cell at strides 8, 16, 32).

Architecture (tiny: depth 0.33, width 0.375, in_channels [256, 512, 1024] -> 96, 192, 384 channels)::

    backbone.backbone   CSPDarknet: Focus stem, dark2..dark5 (dark5 has the SPP bottleneck)
    backbone.*          PAFPN: lateral_conv0, C3_p4, reduce_conv1, C3_p3, bu_conv2, C3_n3, bu_conv1, C3_n4
    head.*              per level: stems, cls_convs, reg_convs, cls_preds, reg_preds, obj_preds

Input: float32 (B, 3, 640, 640), RGB, **0..255** (no normalisation), image padded top-left with black (see
``edge_sdk.inference.detector.preprocess``). Output (``decode_in_inference=False``, the export form): float32
(B, 8400, 5 + num_classes) = per anchor point ``[dx, dy, log w, log h]`` (raw regression, grid units), objectness
(sigmoid) and class scores (sigmoid); anchor points are ordered stride 8 (80x80), 16 (40x40), 32 (20x20), each
row-major. :func:`decode_outputs` here and ``edge_sdk.inference.detector.decode`` turn them into boxes.

Batch normalisation uses ``eps=1e-3`` as ``yolox`` sets it (``init_yolo``); the checkpoint's running statistics
were trained with it, so the default 1e-5 would shift every activation slightly.

torch is imported lazily (:func:`build_model`, :func:`load_checkpoint`) so that a gateway running the exported
ONNX file can import this module's constants without torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["INPUT_SIZE", "STRIDES", "NUM_CLASSES", "DEPTH", "WIDTH", "IN_CHANNELS", "BN_EPS", "WEIGHTS_FILE",
           "build_model", "load_checkpoint", "load_weights", "grid_and_strides", "decode_outputs"]

INPUT_SIZE = 640
STRIDES = (8, 16, 32)
NUM_CLASSES = 1
DEPTH = 0.33
WIDTH = 0.375
IN_CHANNELS = (256, 512, 1024)
BN_EPS = 1e-3
WEIGHTS_FILE = "yolox_tiny_640_20220528.pth"


@functools.cache
def _blocks() -> SimpleNamespace:
    """Define the YOLOX building blocks: BaseConv, Bottleneck, SPPBottleneck, CSPLayer, Focus (needs torch; defined
    once, on first use)."""
    import torch
    from torch import nn

    class BaseConv(nn.Module):
        """Conv2d (no bias) -> BatchNorm2d -> SiLU; 'same' padding for odd kernels."""

        def __init__(self, in_channels: int, out_channels: int, ksize: int, stride: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, ksize, stride, padding=(ksize - 1) // 2, bias=False)
            self.bn = nn.BatchNorm2d(out_channels, eps=BN_EPS, momentum=0.03)
            self.act = nn.SiLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.bn(self.conv(x)))

    class Bottleneck(nn.Module):
        """1x1 conv -> 3x3 conv, plus the input when ``shortcut`` and the channel counts agree."""

        def __init__(self, in_channels: int, out_channels: int, shortcut: bool = True,
                     expansion: float = 0.5) -> None:
            super().__init__()
            hidden = int(out_channels * expansion)
            self.conv1 = BaseConv(in_channels, hidden, 1, 1)
            self.conv2 = BaseConv(hidden, out_channels, 3, 1)
            self.use_add = shortcut and in_channels == out_channels

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv2(self.conv1(x))
            return y + x if self.use_add else y

    class SPPBottleneck(nn.Module):
        """Spatial pyramid pooling (max-pool 5, 9, 13, stride 1) between two 1x1 convs."""

        def __init__(self, in_channels: int, out_channels: int, kernel_sizes: tuple[int, ...] = (5, 9, 13)) -> None:
            super().__init__()
            hidden = in_channels // 2
            self.conv1 = BaseConv(in_channels, hidden, 1, 1)
            self.m = nn.ModuleList([nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2) for k in kernel_sizes])
            self.conv2 = BaseConv(hidden * (len(kernel_sizes) + 1), out_channels, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv1(x)
            return self.conv2(torch.cat([x] + [m(x) for m in self.m], dim=1))

    class CSPLayer(nn.Module):
        """Cross-stage partial layer: two 1x1 branches, ``n`` bottlenecks on the first, concat, 1x1."""

        def __init__(self, in_channels: int, out_channels: int, n: int = 1, shortcut: bool = True,
                     expansion: float = 0.5) -> None:
            super().__init__()
            hidden = int(out_channels * expansion)
            self.conv1 = BaseConv(in_channels, hidden, 1, 1)
            self.conv2 = BaseConv(in_channels, hidden, 1, 1)
            self.conv3 = BaseConv(2 * hidden, out_channels, 1, 1)
            self.m = nn.Sequential(*[Bottleneck(hidden, hidden, shortcut, 1.0) for _ in range(n)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv3(torch.cat((self.m(self.conv1(x)), self.conv2(x)), dim=1))

    class Focus(nn.Module):
        """Space-to-depth (2x2 pixel blocks to channels), then a conv."""

        def __init__(self, in_channels: int, out_channels: int, ksize: int = 1, stride: int = 1) -> None:
            super().__init__()
            self.conv = BaseConv(in_channels * 4, out_channels, ksize, stride)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            top_left, top_right = x[..., ::2, ::2], x[..., ::2, 1::2]
            bot_left, bot_right = x[..., 1::2, ::2], x[..., 1::2, 1::2]
            return self.conv(torch.cat((top_left, bot_left, top_right, bot_right), dim=1))

    return SimpleNamespace(BaseConv=BaseConv, Bottleneck=Bottleneck, SPPBottleneck=SPPBottleneck,
                           CSPLayer=CSPLayer, Focus=Focus)


@functools.cache
def _modules() -> SimpleNamespace:
    """Define the YOLOX networks from :func:`_blocks`: CSPDarknet, YOLOPAFPN, YOLOXHead, YOLOX; the namespace holds
    the blocks too (needs torch; defined once, on first use)."""
    import torch
    from torch import nn

    blocks = _blocks()
    BaseConv, CSPLayer, Focus, SPPBottleneck = blocks.BaseConv, blocks.CSPLayer, blocks.Focus, blocks.SPPBottleneck

    class CSPDarknet(nn.Module):
        """The backbone; returns the dark3, dark4, dark5 feature maps (strides 8, 16, 32)."""

        def __init__(self, dep_mul: float, wid_mul: float) -> None:
            super().__init__()
            base_channels = int(wid_mul * 64)
            base_depth = max(round(dep_mul * 3), 1)
            self.stem = Focus(3, base_channels, ksize=3)
            self.dark2 = nn.Sequential(BaseConv(base_channels, base_channels * 2, 3, 2),
                                       CSPLayer(base_channels * 2, base_channels * 2, n=base_depth))
            self.dark3 = nn.Sequential(BaseConv(base_channels * 2, base_channels * 4, 3, 2),
                                       CSPLayer(base_channels * 4, base_channels * 4, n=base_depth * 3))
            self.dark4 = nn.Sequential(BaseConv(base_channels * 4, base_channels * 8, 3, 2),
                                       CSPLayer(base_channels * 8, base_channels * 8, n=base_depth * 3))
            self.dark5 = nn.Sequential(BaseConv(base_channels * 8, base_channels * 16, 3, 2),
                                       SPPBottleneck(base_channels * 16, base_channels * 16),
                                       CSPLayer(base_channels * 16, base_channels * 16, n=base_depth,
                                                shortcut=False))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = self.dark2(self.stem(x))
            d3 = self.dark3(x)
            d4 = self.dark4(d3)
            d5 = self.dark5(d4)
            return d3, d4, d5

    class YOLOPAFPN(nn.Module):
        """CSPDarknet plus the path-aggregation feature pyramid."""

        def __init__(self, depth: float, width: float, in_channels: tuple[int, int, int]) -> None:
            super().__init__()
            c0, c1, c2 = (int(c * width) for c in in_channels)
            n = round(3 * depth)
            self.backbone = CSPDarknet(depth, width)
            self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
            self.lateral_conv0 = BaseConv(c2, c1, 1, 1)
            self.C3_p4 = CSPLayer(2 * c1, c1, n, False)
            self.reduce_conv1 = BaseConv(c1, c0, 1, 1)
            self.C3_p3 = CSPLayer(2 * c0, c0, n, False)
            self.bu_conv2 = BaseConv(c0, c0, 3, 2)
            self.C3_n3 = CSPLayer(2 * c0, c1, n, False)
            self.bu_conv1 = BaseConv(c1, c1, 3, 2)
            self.C3_n4 = CSPLayer(2 * c1, c2, n, False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x2, x1, x0 = self.backbone(x)
            fpn_out0 = self.lateral_conv0(x0)
            f_out0 = self.C3_p4(torch.cat([self.upsample(fpn_out0), x1], 1))
            fpn_out1 = self.reduce_conv1(f_out0)
            pan_out2 = self.C3_p3(torch.cat([self.upsample(fpn_out1), x2], 1))
            pan_out1 = self.C3_n3(torch.cat([self.bu_conv2(pan_out2), fpn_out1], 1))
            pan_out0 = self.C3_n4(torch.cat([self.bu_conv1(pan_out1), fpn_out0], 1))
            return pan_out2, pan_out1, pan_out0

    class YOLOXHead(nn.Module):
        """Decoupled head: per level a 1x1 stem, two 3x3 convs for classes and two for box + objectness."""

        def __init__(self, num_classes: int, width: float, in_channels: tuple[int, int, int],
                     strides: tuple[int, int, int] = STRIDES) -> None:
            super().__init__()
            self.num_classes = num_classes
            self.strides = tuple(strides)
            self.decode_in_inference = False
            hidden = int(256 * width)
            self.stems = nn.ModuleList()
            self.cls_convs = nn.ModuleList()
            self.reg_convs = nn.ModuleList()
            self.cls_preds = nn.ModuleList()
            self.reg_preds = nn.ModuleList()
            self.obj_preds = nn.ModuleList()
            for c in in_channels:
                self.stems.append(BaseConv(int(c * width), hidden, 1, 1))
                self.cls_convs.append(nn.Sequential(BaseConv(hidden, hidden, 3, 1), BaseConv(hidden, hidden, 3, 1)))
                self.reg_convs.append(nn.Sequential(BaseConv(hidden, hidden, 3, 1), BaseConv(hidden, hidden, 3, 1)))
                self.cls_preds.append(nn.Conv2d(hidden, num_classes, 1, 1, 0))
                self.reg_preds.append(nn.Conv2d(hidden, 4, 1, 1, 0))
                self.obj_preds.append(nn.Conv2d(hidden, 1, 1, 1, 0))

        def forward(self, features: tuple[torch.Tensor, ...]) -> torch.Tensor:
            outputs = []
            for k, x in enumerate(features):
                x = self.stems[k](x)
                cls_out = self.cls_preds[k](self.cls_convs[k](x))
                reg_feat = self.reg_convs[k](x)
                outputs.append(torch.cat([self.reg_preds[k](reg_feat), self.obj_preds[k](reg_feat).sigmoid(),
                                          cls_out.sigmoid()], 1))
            out = torch.cat([o.flatten(start_dim=2) for o in outputs], dim=2).permute(0, 2, 1)
            if self.decode_in_inference:
                grid, strides = grid_and_strides(tuple(o.shape[-2:] for o in outputs), self.strides)
                g = torch.from_numpy(grid).to(out)
                s = torch.from_numpy(strides).to(out)
                out = torch.cat([(out[..., :2] + g) * s, torch.exp(out[..., 2:4]) * s, out[..., 4:]], dim=-1)
            return out

    class YOLOX(nn.Module):
        """``backbone`` (YOLOPAFPN) + ``head`` (YOLOXHead), parameter names as in the ``yolox`` package."""

        def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone
            self.head = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

    return SimpleNamespace(**vars(blocks), CSPDarknet=CSPDarknet, YOLOPAFPN=YOLOPAFPN, YOLOXHead=YOLOXHead,
                           YOLOX=YOLOX)


def build_model(num_classes: int = NUM_CLASSES) -> "torch.nn.Module":
    """A fresh YOLOX-tiny in eval mode (random weights): ``YOLOX(YOLOPAFPN(0.33, 0.375, [256, 512, 1024]),
    YOLOXHead(num_classes, width=0.375))``, outputs not decoded (see the module docstring)."""
    m = _modules()
    model = m.YOLOX(m.YOLOPAFPN(DEPTH, WIDTH, IN_CHANNELS), m.YOLOXHead(num_classes, WIDTH, IN_CHANNELS))
    return model.eval()


def load_checkpoint(path: str | Path) -> dict[str, "torch.Tensor"]:
    """The ``"model"`` state dict of a YOLOX checkpoint, read with ``torch.load(weights_only=True)`` (no arbitrary
    unpickling).

    Raises:
        ValueError: the file holds no ``"model"`` state dict.
    """
    import torch

    checkpoint = torch.load(Path(path), map_location="cpu", weights_only=True)
    state = checkpoint.get("model") if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: no 'model' state dict in the checkpoint (keys: "
                         f"{sorted(checkpoint)[:10] if isinstance(checkpoint, Mapping) else type(checkpoint)})")
    return dict(state)


def load_weights(path: str | Path) -> "torch.nn.Module":
    """YOLOX-tiny with the checkpoint at ``path`` loaded strictly, in eval mode.

    Raises:
        ValueError: missing or unexpected keys, or a shape mismatch (the message lists them).
    """
    model = build_model()
    state = load_checkpoint(path)
    try:
        result = model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{path} does not fit YOLOX-tiny: {exc}") from exc
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept as a guard
        raise ValueError(f"{path}: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    return model.eval()


def grid_and_strides(hw: tuple[tuple[int, int], ...] | None = None,
                     strides: tuple[int, ...] = STRIDES) -> tuple[np.ndarray, np.ndarray]:
    """Anchor-point grid of the head's output rows.

    Args:
        hw: feature map sizes per level; default ``INPUT_SIZE // stride`` squared for each stride.

    Returns:
        ``(grid, stride)``: float32 (N, 2) cell coordinates ``(x, y)`` and float32 (N, 1) strides, N = sum of
        ``h * w`` (8400 for 640x640), in the row order of the head's output.
    """
    if hw is None:
        hw = tuple((INPUT_SIZE // s, INPUT_SIZE // s) for s in strides)
    grids, out_strides = [], []
    for (h, w), s in zip(hw, strides):
        yv, xv = np.meshgrid(np.arange(int(h)), np.arange(int(w)), indexing="ij")
        grids.append(np.stack((xv, yv), axis=-1).reshape(-1, 2))
        out_strides.append(np.full((int(h) * int(w), 1), s))
    return (np.concatenate(grids).astype(np.float32), np.concatenate(out_strides).astype(np.float32))


def decode_outputs(raw: np.ndarray) -> np.ndarray:
    """Turn raw head outputs (B, N, 5 + C) into ``[cx, cy, w, h]`` in input pixels, keeping the scores.

    ``xy = (raw_xy + grid) * stride``, ``wh = exp(raw_wh) * stride`` (YOLOX ``decode_outputs``).
    """
    raw = np.asarray(raw, dtype=np.float32)
    grid, strides = grid_and_strides()
    if raw.shape[-2] != grid.shape[0]:
        raise ValueError(f"expected {grid.shape[0]} anchor points for a {INPUT_SIZE}x{INPUT_SIZE} input, got "
                         f"{raw.shape[-2]}")
    out = raw.copy()
    out[..., :2] = (raw[..., :2] + grid) * strides
    out[..., 2:4] = np.exp(raw[..., 2:4]) * strides
    return out
