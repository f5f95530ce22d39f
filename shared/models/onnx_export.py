"""ONNX graphs of the camera CNN for ONNX Runtime: the model itself and one-pass per-example gradient graphs.

Used by the coordinator (``coordinator.artifacts``), which has torch; gateways only run the graphs. torch and onnx
are imported lazily, inside the functions.

Graphs (opset :data:`OPSET`, IR version <= :data:`MAX_IR_VERSION`, so that ``onnxruntime-training`` 1.19 loads
them; made with torch's TorchScript exporter, ``dynamo=False``, which needs no ``onnxscript``):

- :func:`export_model`: ``input`` float32 (B, 1, 28, 28) in [0, 1] -> ``logits`` float32 (B, K), the parameters as
  initializers named as in ``model.named_parameters()``. This is the base graph that
  ``onnxruntime.training.artifacts.generate_artifacts`` turns into the training, eval and optimizer graphs.
- :func:`export_per_example_graph`: inputs ``input``, ``labels`` int64 (B,) and every parameter (as graph inputs,
  so the gateway feeds its current weights), output ``per_example_grads`` float32 (B, d_trainable): row i is the
  gradient of example i's cross-entropy loss, flat in ``named_parameters()`` order over the trainable scope. The
  backward pass is written out explicitly (no autograd in the graph), for a sequential network of ``Conv2d``
  (stride 1, dilation 1, groups 1, numeric zero padding), ``Tanh``, ``MaxPool2d`` (kernel = stride, no padding),
  ``Flatten`` and ``Linear`` layers, which is what the camera CNN is:

  * loss:   d logits_i = softmax(logits_i) - onehot(y_i)                  (cross-entropy, per example)
  * Linear: g_i(W) = delta_i a_i^T, g_i(b) = delta_i; the input gradient is delta_i W
  * Tanh:   delta_in = delta_out * (1 - tanh^2); a tanh right before a max-pool is differentiated at the pooled
    resolution, (1 - pooled^2), since tanh is monotone and only the window's arg-max gets a gradient
  * MaxPool: computed as a max over the k*k window axis; the output gradient goes back to the window's arg-max
    (ties go to the first maximum in row-major window order, as in torch's ``max_pool2d``: flat image regions tie)
  * Conv2d: g_i(W)[o, c, u, v] = sum_p delta_i[o, p] * window_{u,v}(pad(a_i))[c, p]: the input is unfolded by one
    convolution with the identity kernel (B*C, kh*kw, P), then one batched product with delta_i (Rochette et al.
    2019, "Efficient per-example gradient computations in convolutional neural networks"); g_i(b) = sum_p
    delta_i[., p]; the input gradient is the convolution of delta_i with the flipped, transposed kernel.

  ``scope="head"`` gives the frozen-feature-extractor graph: only the head's gradient, the outer product of
  ``softmax - onehot`` with the features, and its bias part (B, K * F + K).

The parity of these graphs with ``torch.func`` per-example gradients is tested in ``tests/edge/test_ort_backend.py``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import onnx
    import torch

__all__ = ["OPSET", "MAX_IR_VERSION", "INPUT_NAME", "LABELS_NAME", "LOGITS_NAME", "PER_EXAMPLE_OUTPUT", "SCOPES",
           "export_model", "export_per_example_graph", "trainable_names"]

OPSET = 17
MAX_IR_VERSION = 10  # the highest IR version onnxruntime 1.19 loads
INPUT_NAME = "input"
LABELS_NAME = "labels"
LOGITS_NAME = "logits"
PER_EXAMPLE_OUTPUT = "per_example_grads"
SCOPES = ("all", "head")


def trainable_names(parameter_names: list[str] | tuple[str, ...], scope: str) -> tuple[str, ...]:
    """The trainable parameters of ``scope`` ("all": every parameter; "head": ``psi.*``), in the given order.

    Raises:
        ValueError: unknown scope.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return tuple(n for n in parameter_names if scope == "all" or n.startswith("psi."))


def _to_onnx(module: "torch.nn.Module", args: tuple, *, input_names: list[str], output_names: list[str],
             dynamic_axes: dict[str, dict[int, str]], training: bool = False) -> "onnx.ModelProto":
    import warnings

    import onnx
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(module, args, buf, input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=OPSET, dynamo=False, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL)
    model = onnx.load_from_string(buf.getvalue())
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION  # opset 17 needs IR 8; never ask for more than ORT 1.19 reads
    onnx.checker.check_model(model)
    return model


def export_model(num_classes: int, weights: Mapping[str, np.ndarray] | None = None) -> "onnx.ModelProto":
    """The camera CNN as an ONNX graph with dynamic batch (see the module docstring).

    Args:
        num_classes: K.
        weights: ``{name: float32 array}`` for the initializers; None keeps a fresh initialisation.
    """
    import torch

    from shared.models.camera_cnn import IMAGE_SIZE, build_model, load_numpy_state

    model = build_model(int(num_classes)).eval()
    if weights is not None:
        load_numpy_state(model, weights)
    dummy = torch.zeros(2, 1, IMAGE_SIZE, IMAGE_SIZE)
    # TRAINING mode keeps every parameter an initializer with its own name (no folding into constants).
    return _to_onnx(model, (dummy,), input_names=[INPUT_NAME], output_names=[LOGITS_NAME],
                    dynamic_axes={INPUT_NAME: {0: "batch"}, LOGITS_NAME: {0: "batch"}}, training=True)


def export_per_example_graph(num_classes: int, scope: str = "all") -> "onnx.ModelProto":
    """The one-pass per-example gradient graph of the camera CNN (see the module docstring).

    Args:
        num_classes: K.
        scope: ``"all"`` (every parameter trainable) or ``"head"`` (``psi.*`` only; frozen feature extractor).

    Raises:
        ValueError: unknown scope, or a layer the explicit backward does not cover.
    """
    import torch

    from shared.models.camera_cnn import IMAGE_SIZE, build_model

    model = build_model(int(num_classes)).eval()
    names = [n for n, _ in model.named_parameters()]
    trainable = trainable_names(names, scope)
    layers = _layers(model)
    module = _PerExampleModule(layers, names, trainable)
    params = tuple(p.detach().clone() for _, p in model.named_parameters())
    dummy_x = torch.zeros(2, 1, IMAGE_SIZE, IMAGE_SIZE)
    dummy_y = torch.zeros(2, dtype=torch.int64)
    dynamic = {INPUT_NAME: {0: "batch"}, LABELS_NAME: {0: "batch"}, PER_EXAMPLE_OUTPUT: {0: "batch"}}
    return _to_onnx(module, (dummy_x, dummy_y, *params), input_names=[INPUT_NAME, LABELS_NAME, *names],
                    output_names=[PER_EXAMPLE_OUTPUT], dynamic_axes=dynamic)


def _layers(model: "torch.nn.Module") -> list[tuple[str, Any]]:
    """``[(prefix, module)]`` of the network in forward order: the modules of ``phi`` then ``psi``."""
    import torch

    phi, psi = getattr(model, "phi", None), getattr(model, "psi", None)
    if not isinstance(phi, torch.nn.Sequential) or not isinstance(psi, torch.nn.Linear):
        raise ValueError("the per-example graph needs a model with a Sequential `phi` and a Linear `psi`")
    layers = [(f"phi.{i}", m) for i, m in enumerate(phi)] + [("psi", psi)]
    for prefix, m in layers:
        ok = isinstance(m, (torch.nn.Tanh, torch.nn.Flatten, torch.nn.Linear))
        if isinstance(m, torch.nn.Conv2d):
            ok = (tuple(m.stride) == (1, 1) and tuple(m.dilation) == (1, 1) and m.groups == 1
                  and m.padding_mode == "zeros" and not isinstance(m.padding, str) and m.bias is not None)
        if isinstance(m, torch.nn.MaxPool2d):
            k = m.kernel_size if isinstance(m.kernel_size, int) else m.kernel_size[0]
            s = m.stride if isinstance(m.stride, int) else m.stride[0]
            ok = k == s and m.padding in (0, (0, 0)) and m.dilation in (1, (1, 1)) and not m.ceil_mode
        if isinstance(m, torch.nn.Linear):
            ok = m.bias is not None
        if not ok:
            raise ValueError(f"layer {prefix} ({type(m).__name__}) is not covered by the explicit backward")
    return layers


def _build_module_class():  # torch is imported lazily: the class is created on first use
    import torch
    import torch.nn.functional as F

    class PerExample(torch.nn.Module):
        """forward(x, labels, *params) -> per-example gradients (B, d_trainable), see the module docstring.

        The batch dimension is the only dynamic one: spatial sizes are fixed by the model's input, so reshapes
        use ``-1`` for the batch and constants elsewhere.
        """

        def __init__(self, layers: list, names: list[str], trainable: tuple[str, ...]) -> None:
            super().__init__()
            self._layers = layers
            self._names = names
            self._trainable = trainable

        def forward(self, x: torch.Tensor, labels: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
            p = dict(zip(self._names, params))
            before = {prefix: prev for (prefix, _), (_, prev) in zip(self._layers[1:], self._layers[:-1])}
            tape = []  # (prefix, module, layer input, layer output, extra)
            a = x
            for prefix, m in self._layers:
                extra = None
                if isinstance(m, torch.nn.Conv2d):
                    out = F.conv2d(a, p[f"{prefix}.weight"], p[f"{prefix}.bias"], padding=m.padding)
                elif isinstance(m, torch.nn.Linear):
                    out = F.linear(a, p[f"{prefix}.weight"], p[f"{prefix}.bias"])
                elif isinstance(m, torch.nn.Tanh):
                    out = torch.tanh(a)
                elif isinstance(m, torch.nn.MaxPool2d):
                    out, extra = _pool_forward(a, _int(m.kernel_size))
                else:  # Flatten
                    out = torch.flatten(a, 1)
                tape.append((prefix, m, a, out, extra))
                a = out
            logits = a
            onehot = torch.zeros_like(logits).scatter(1, labels.unsqueeze(1), 1.0)
            delta = torch.softmax(logits, dim=1) - onehot  # d loss_i / d logits_i
            grads: dict[str, torch.Tensor] = {}
            tanh_done = False  # the tanh before a max-pool was differentiated at the pooled resolution
            for prefix, m, a_in, out, extra in reversed(tape):
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    w_name, b_name = f"{prefix}.weight", f"{prefix}.bias"
                    if w_name in self._trainable:
                        if isinstance(m, torch.nn.Linear):  # g_i(W) = delta_i a_i^T
                            grads[w_name] = (delta.unsqueeze(2) * a_in.unsqueeze(1)).flatten(1)
                            grads[b_name] = delta
                        else:
                            grads[w_name] = _conv_weight_grads(a_in, delta, m)
                            grads[b_name] = delta.sum(dim=(2, 3))
                    if all(n in grads for n in self._trainable):
                        break  # nothing trainable further back (first layer, or the frozen feature extractor)
                    if isinstance(m, torch.nn.Linear):
                        delta = delta.matmul(p[w_name])
                    else:  # transposed convolution as a convolution with the flipped, transposed kernel
                        kh, kw = m.kernel_size
                        ph, pw = m.padding
                        flipped = p[w_name].flip(2, 3).transpose(0, 1)
                        delta = F.conv2d(delta, flipped, padding=(kh - 1 - ph, kw - 1 - pw))
                elif isinstance(m, torch.nn.Tanh):
                    if not tanh_done:
                        delta = delta * (1.0 - out * out)
                    tanh_done = False
                elif isinstance(m, torch.nn.Flatten):
                    delta = delta.reshape((-1, *a_in.shape[1:]))
                else:  # MaxPool2d
                    if isinstance(before.get(prefix), torch.nn.Tanh):
                        # tanh is monotone, so the pooled value is tanh at the arg-max, the only position that gets
                        # a gradient: (1 - tanh^2) there is (1 - pooled^2), four times fewer products
                        delta = delta * (1.0 - out * out)
                        tanh_done = True
                    delta = _pool_backward(delta, extra, _int(m.kernel_size), tuple(a_in.shape[1:]))
            return torch.cat([grads[n] for n in self._trainable], dim=1)

    def _int(value: int | tuple[int, int]) -> int:
        return value if isinstance(value, int) else int(value[0])

    def _pool_forward(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Max-pool with kernel = stride = k (floor mode) as a max over the k*k window axis; also returns the
        arg-max one-hot mask (B, C, Ho, Wo, k*k). Ties go to the first maximum in row-major window order, as in
        torch's ``max_pool2d``."""
        c, h, w = a.shape[1], a.shape[2], a.shape[3]
        ho, wo = h // k, w // k
        windows = a[:, :, :ho * k, :wo * k].reshape(-1, c, ho, k, wo, k).permute(0, 1, 2, 4, 3, 5)
        windows = windows.reshape(-1, c, ho, wo, k * k)
        out, idx = windows.max(dim=4)
        mask = (idx.unsqueeze(4) == torch.arange(k * k)).to(a.dtype)
        return out, mask

    def _pool_backward(delta: torch.Tensor, mask: torch.Tensor, k: int, in_shape: tuple[int, int, int]) -> torch.Tensor:
        c, h, w = in_shape
        ho, wo = h // k, w // k
        routed = (mask * delta.unsqueeze(4)).reshape(-1, c, ho, wo, k, k).permute(0, 1, 2, 4, 3, 5)
        routed = routed.reshape(-1, c, ho * k, wo * k)
        if ho * k != h or wo * k != w:  # floor mode dropped the last rows/columns: they get no gradient
            routed = F.pad(routed, (0, w - wo * k, 0, h - ho * k))
        return routed

    def _conv_weight_grads(a: torch.Tensor, delta: torch.Tensor, m: torch.nn.Conv2d) -> torch.Tensor:
        """(B, out * in * kh * kw) per-example weight gradients: unfold the input with one convolution by the
        identity kernel (B*C, kh*kw, Ho, Wo), then one batched product with the output gradient."""
        out_ch, in_ch, (kh, kw) = m.out_channels, m.in_channels, m.kernel_size
        h, w = a.shape[2], a.shape[3]
        ho, wo = delta.shape[2], delta.shape[3]
        eye = torch.eye(kh * kw, dtype=a.dtype).reshape(kh * kw, 1, kh, kw)
        cols = F.conv2d(a.reshape(-1, 1, h, w), eye, padding=m.padding)  # (B*C, kh*kw, Ho, Wo)
        cols = cols.reshape(-1, in_ch * kh * kw, ho * wo)  # (B, C*kh*kw, P)
        return torch.bmm(delta.reshape(-1, out_ch, ho * wo), cols.transpose(1, 2)).flatten(1)

    return PerExample


_MODULE_CLASS = None


def _PerExampleModule(layers: list, names: list[str], trainable: tuple[str, ...]) -> "torch.nn.Module":
    global _MODULE_CLASS
    if _MODULE_CLASS is None:
        _MODULE_CLASS = _build_module_class()
    return _MODULE_CLASS(layers, names, trainable)
