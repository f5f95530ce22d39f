"""RadioUNet's parameter groups (docs/radiomap.md): the sensitive group is exactly the parameters connected to the
transmitter channel, checked by autograd rather than by reading the model's structure."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shared.models.radio_unet import (  # noqa: E402
    TRANSMITTER_CHANNEL,
    build_model,
    initial_weights,
    load_numpy_state,
    parameter_groups,
    to_numpy_state,
)
from shared.protocol import canonical_flatten  # noqa: E402


def flat_grad(model, x):
    """Gradient of the sum of both stages' outputs w.r.t. every parameter, canonical_flatten order (float64)."""
    model = model.double()
    model.zero_grad(set_to_none=True)
    coarse, fine = model(x)
    (coarse.sum() + fine.sum()).backward()
    return np.concatenate([p.grad.numpy().reshape(-1) for _, p in sorted(model.named_parameters())])


def smooth(model):
    """The same model with every ReLU replaced by tanh, whose derivative is never zero: a dead ReLU (common at
    initialisation) would zero a parameter's gradient for reasons that have nothing to do with the transmitter."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ReLU):
                setattr(module, name, torch.nn.Tanh())
    return model


def test_sensitive_group_is_exactly_the_weights_that_touch_the_transmitter_channel():
    torch.manual_seed(0)
    model = build_model(width=4)
    layout = parameter_groups(model)
    smooth(model)
    sensitive = np.isin(layout.index, [i for i, s in enumerate(layout.sensitive) if s])
    x = torch.rand(3, 2, 16, 16, dtype=torch.float64) + 0.1     # positive everywhere: no dead inputs
    with_tx = flat_grad(model, x)
    x_no_tx = x.clone()
    x_no_tx[:, TRANSMITTER_CHANNEL] = 0.0
    without_tx = flat_grad(model, x_no_tx)
    # A weight that multiplies the transmitter channel has zero gradient when that channel is zero, and only those.
    np.testing.assert_array_equal(without_tx == 0.0, sensitive)
    assert np.all(with_tx[sensitive] != 0.0)
    # one entry per (output channel, kernel position) in each stage's input convolution: 4 * 3 * 3 per stage
    assert layout.sizes.tolist()[0] == 36 and layout.sizes.tolist()[2] == 36
    assert layout.dimension == sum(p.numel() for p in model.parameters())
    assert layout.names == ("stage1/transmitter", "stage1/residual", "stage2/transmitter", "stage2/residual")
    assert layout.stage == (1, 1, 2, 2)


def test_groups_follow_the_stages():
    model = build_model(width=3)
    layout = parameter_groups(model)
    offset = 0
    for name, p in sorted(model.named_parameters()):
        groups = set(layout.index[offset:offset + p.numel()].tolist())
        stage = 1 if name.startswith("stage1.") else 2
        assert {layout.stage[g] for g in groups} == {stage}, name
        offset += p.numel()


def test_stage_two_reads_stage_one_without_training_it():
    torch.manual_seed(1)
    model = build_model(width=3)
    x = torch.rand(2, 2, 16, 16)
    _, fine = model(x)
    fine.sum().backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.stage1.parameters())
    assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in model.stage2.parameters())


def test_weights_round_trip_and_bad_input():
    weights = initial_weights(width=3, seed=4)
    model = build_model(width=3)
    load_numpy_state(model, weights)
    np.testing.assert_array_equal(canonical_flatten(to_numpy_state(model)), canonical_flatten(weights))
    with pytest.raises(ValueError, match="multiples of 4"):
        model(torch.rand(1, 2, 18, 18))
    with pytest.raises(ValueError, match="width"):
        build_model(width=0)
    with pytest.raises(ValueError, match="missing"):
        load_numpy_state(model, {k: v for k, v in list(weights.items())[1:]})
