"""ONNX graphs of the trainable camera models for ONNX Runtime: the model itself and one-pass per-example gradient
graphs.

Used by the coordinator (``coordinator.artifacts``), which has torch; gateways only run the graphs. torch and onnx
are imported lazily, inside the functions. Every function takes the model as a :class:`shared.models.kinds.ModelSpec`
(the head model on backbone embeddings, ``shared.models.head``); a bare number of classes K means the head model of
K classes with its default options.

Graphs (opset :data:`OPSET`, IR version <= :data:`MAX_IR_VERSION`, so that ``onnxruntime-training`` 1.19 loads
them; made with torch's TorchScript exporter, ``dynamo=False``, which needs no ``onnxscript``):

- :func:`export_model`: ``input`` float32 (B, *example_shape): (B, 1280) embeddings for the head model ->
  ``logits`` float32 (B, K), the parameters as initializers named as in ``model.named_parameters()``. This is the base graph that ``onnxruntime.training.artifacts.generate_artifacts``
  turns into the training, eval and optimizer graphs.
- :func:`export_per_example_graph`: inputs ``input``, ``labels`` int64 (B,) and every parameter (as graph inputs,
  so the gateway feeds its current weights), output ``per_example_grads`` float32 (B, d_trainable): row i is the
  gradient of example i's cross-entropy loss, flat in ``named_parameters()`` order over the trainable scope. The
  backward pass is written out explicitly (no autograd in the graph), for a sequential network of ``Conv2d``
  (stride 1, dilation 1, groups 1, numeric zero padding), ``Tanh``, ``MaxPool2d`` (kernel = stride, no padding),
  ``Flatten`` and ``Linear`` layers (the head model is Linear, Tanh, Linear; the Conv2d and MaxPool2d rules were
  written for the retired 28x28 camera CNN and no project model uses them now):

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
- :func:`export_factor_graph` (models whose trainable layers are all ``Linear``, i.e. the head model): the same
  explicit backward, but instead of the (B, d) gradients it outputs, for each trainable Linear layer ``L`` in layout
  order, ``L.input`` a_i (B, in) and ``L.delta`` delta_i (B, out), the two factors of g_i(W) = delta_i a_i^T and
  g_i(b) = delta_i (Goodfellow 2015, "Efficient per-example gradient computations"). The gateway forms norms and
  clipped sums from them (``edge_sdk.backends.factored``) without the (B, d) matrix: for the head model with a
  256-wide adapter, d = 330,506 and B = 64 would be 85 MB of gradients per step, the factors are 0.46 MB.

The parity of these graphs with ``torch.func`` per-example gradients is tested in ``tests/edge/test_ort_backend.py``
and ``tests/edge/test_head_backends.py``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.models.kinds import SCOPES, trainable_names

if TYPE_CHECKING:  # pragma: no cover
    import onnx
    import torch

    from shared.models.kinds import ModelSpec

__all__ = ["OPSET", "MAX_IR_VERSION", "INPUT_NAME", "LABELS_NAME", "LOGITS_NAME", "PER_EXAMPLE_OUTPUT", "SCOPES",
           "INPUT_SUFFIX", "DELTA_SUFFIX", "export_model", "export_per_example_graph", "export_factor_graph",
           "factor_layers", "trainable_names"]

OPSET = 17
MAX_IR_VERSION = 10  # the highest IR version onnxruntime 1.19 loads
INPUT_NAME = "input"
LABELS_NAME = "labels"
LOGITS_NAME = "logits"
PER_EXAMPLE_OUTPUT = "per_example_grads"
INPUT_SUFFIX = ".input"  # factor-graph outputs: "<layer prefix>.input" (B, in), "<layer prefix>.delta" (B, out)
DELTA_SUFFIX = ".delta"


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


def _spec(model: "ModelSpec | int") -> "ModelSpec":
    from shared.models.kinds import ModelSpec, model_spec

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (int, np.integer)) and not isinstance(model, bool):
        return model_spec("head", int(model))  # K classes: the head model with its default options
    raise TypeError(f"model must be a ModelSpec or a number of classes (head model), got {type(model).__name__}")


def _dummy_input(spec: "ModelSpec") -> "torch.Tensor":
    import torch

    return torch.zeros((2, *spec.example_shape))


def export_model(model: "ModelSpec | int", weights: Mapping[str, np.ndarray] | None = None) -> "onnx.ModelProto":
    """The model as an ONNX graph with dynamic batch (see the module docstring).

    Args:
        model: the architecture (a ``ModelSpec``; an int K means the head model of K classes).
        weights: ``{name: float32 array}`` for the initializers; None keeps a fresh initialisation.

    Raises:
        ValueError: the weights do not fit the model.
    """
    from shared.models.state import load_numpy_state

    spec = _spec(model)
    module = spec.build().eval()
    if weights is not None:
        load_numpy_state(module, weights)
    # TRAINING mode keeps every parameter an initializer with its own name (no folding into constants).
    return _to_onnx(module, (_dummy_input(spec),), input_names=[INPUT_NAME], output_names=[LOGITS_NAME],
                    dynamic_axes={INPUT_NAME: {0: "batch"}, LOGITS_NAME: {0: "batch"}}, training=True)


def export_per_example_graph(model: "ModelSpec | int", scope: str = "all") -> "onnx.ModelProto":
    """The one-pass per-example gradient graph (see the module docstring).

    Args:
        model: the architecture (a ``ModelSpec``; an int K means the head model of K classes).
        scope: ``"all"`` (every parameter trainable) or ``"head"`` (``psi.*`` only; frozen feature extractor).

    Raises:
        ValueError: unknown scope, or a layer the explicit backward does not cover.
    """
    import torch

    spec = _spec(model)
    module = spec.build().eval()
    names = [n for n, _ in module.named_parameters()]
    trainable = trainable_names(names, scope)
    graph = _PerExampleModule(_layers(module), names, trainable, factors=False)
    params = tuple(p.detach().clone() for _, p in module.named_parameters())
    dummy_y = torch.zeros(2, dtype=torch.int64)
    dynamic = {INPUT_NAME: {0: "batch"}, LABELS_NAME: {0: "batch"}, PER_EXAMPLE_OUTPUT: {0: "batch"}}
    return _to_onnx(graph, (_dummy_input(spec), dummy_y, *params), input_names=[INPUT_NAME, LABELS_NAME, *names],
                    output_names=[PER_EXAMPLE_OUTPUT], dynamic_axes=dynamic)


def factor_layers(model: "ModelSpec", scope: str = "all") -> tuple[str, ...]:
    """Prefixes of the trainable Linear layers, in layout order (``("phi.0", "psi")`` for the head model with an
    adapter and scope "all"): the layers whose factors :func:`export_factor_graph` outputs.

    Raises:
        ValueError: unknown scope, or the model has a trainable layer other than ``Linear`` (no factored form).
    """
    names = [n for n, _ in model.parameter_shapes()]
    trainable = trainable_names(names, scope)
    if not model.linear_only:
        raise ValueError(f"model kind {model.kind!r} has trainable layers other than Linear: no factor graph")
    prefixes: list[str] = []
    for name in trainable:
        prefix = name.rsplit(".", 1)[0]
        if prefix not in prefixes:
            prefixes.append(prefix)
    return tuple(prefixes)


def export_factor_graph(model: "ModelSpec", scope: str = "all") -> "onnx.ModelProto":
    """The per-example gradient factors graph of a Linear-only model (see the module docstring).

    Inputs as :func:`export_per_example_graph`; outputs ``<L>.input`` float32 (B, in) and ``<L>.delta`` float32
    (B, out) for each ``L`` of :func:`factor_layers`, in that order (input first).

    Raises:
        ValueError: unknown scope, or a model with a trainable layer other than Linear (e.g. a CNN).
    """
    import torch

    spec = _spec(model)
    layers = factor_layers(spec, scope)
    module = spec.build().eval()
    names = [n for n, _ in module.named_parameters()]
    graph = _PerExampleModule(_layers(module), names, trainable_names(names, scope), factors=True)
    params = tuple(p.detach().clone() for _, p in module.named_parameters())
    outputs = [f"{layer}{suffix}" for layer in layers for suffix in (INPUT_SUFFIX, DELTA_SUFFIX)]
    dynamic = {INPUT_NAME: {0: "batch"}, LABELS_NAME: {0: "batch"}, **{o: {0: "batch"} for o in outputs}}
    return _to_onnx(graph, (_dummy_input(spec), torch.zeros(2, dtype=torch.int64), *params),
                    input_names=[INPUT_NAME, LABELS_NAME, *names], output_names=outputs, dynamic_axes=dynamic)


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
        """forward(x, labels, *params) -> per-example gradients (B, d_trainable), or with ``factors`` the tuple
        (a_L, delta_L for each trainable Linear L in forward order); see the module docstring.

        The batch dimension is the only dynamic one: spatial sizes are fixed by the model's input, so reshapes
        use ``-1`` for the batch and constants elsewhere.
        """

        def __init__(self, layers: list, names: list[str], trainable: tuple[str, ...], factors: bool) -> None:
            super().__init__()
            self._layers = layers
            self._names = names
            self._trainable = trainable
            self._factors = factors

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
            factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            tanh_done = False  # the tanh before a max-pool was differentiated at the pooled resolution
            for prefix, m, a_in, out, extra in reversed(tape):
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    w_name, b_name = f"{prefix}.weight", f"{prefix}.bias"
                    if w_name in self._trainable:
                        if isinstance(m, torch.nn.Linear) and self._factors:  # g_i(W) = delta_i a_i^T, kept apart
                            factors[prefix] = (a_in, delta)
                            grads[w_name] = grads[b_name] = delta
                        elif isinstance(m, torch.nn.Linear):  # g_i(W) = delta_i a_i^T
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
            if self._factors:
                order = [prefix for prefix, _ in self._layers if prefix in factors]
                return tuple(t for prefix in order for t in factors[prefix])
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


def _PerExampleModule(layers: list, names: list[str], trainable: tuple[str, ...], *,
                      factors: bool) -> "torch.nn.Module":
    global _MODULE_CLASS
    if _MODULE_CLASS is None:
        _MODULE_CLASS = _build_module_class()
    return _MODULE_CLASS(layers, names, trainable, factors)
