"""PyTorch training backend: the camera model (a :class:`shared.models.kinds.ModelSpec`: the head model on backbone
embeddings, or the legacy 28x28 CNN) with per-example gradients in one pass.

Per-example gradients use the function transforms of ``torch.func`` (``functional_call``, ``grad``, ``vmap``;
the approach of Opacus's functorch grad sampler and of JAX's ``vmap(grad(.))`` in Abadi et al. 2016's DP-SGD):
the gradient of one example's cross-entropy loss is vectorised over the batch, so B gradients cost about one
batched backward pass. The non-private path (:meth:`TorchBackend.gradient`) is one ordinary autograd backward.

The DP training path (:meth:`TorchBackend.per_example`) does not build the (B, d) matrix at all when every
trainable parameter belongs to an ``nn.Linear`` on 2-D inputs or an ``nn.Conv2d`` (true of both models): one
forward and one backward to the layer outputs give each layer's inputs a_i and output gradients delta_i, and

- Linear: g_i(W) = delta_i a_i^T, so ||g_i(W)||^2 = ||delta_i||^2 ||a_i||^2 and sum_i w_i g_i(W) = (w*delta)^T a
  (Goodfellow 2015, "Efficient per-example gradient computations");
- Conv2d: g_i(W) = D_i U_i^T with U_i the unfolded input (im2col) and D_i the output gradient per position; these
  are small (out x C_in k^2) and are formed explicitly (Rochette et al. 2019, "Efficient per-example gradient
  computations in convolutional neural networks"); for stride 1 / dilation 1 as k^2 batched products with
  shifted windows of the padded input, without building U_i.

Other layouts fall back to the ``vmap`` path. Both paths are checked against each other in the tests, and on the
head model against the closed form (``tests/edge/test_head_backends.py``).

``scope="head"`` trains ``psi.*`` only (the adapter is frozen: loaded from the model version, never changed); the
flat layout then covers the head alone, while weights in and out are the whole model.

torch is imported only in this module. The model runs in ``eval()`` mode so that no layer mixes examples
(batch-norm statistics) or draws randomness (dropout) inside a per-example gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from shared.errors import ConfigError
from shared.models.head import input_layer_prefix
from shared.models.kinds import SCOPES, ModelSpec, as_spec, trainable_names

from edge_sdk.backends.base import ParameterSpec, TrainingBackend, checked_weights, register_backend
from edge_sdk.privacy.per_example import PerExampleGradients, summation_error_bound

__all__ = ["TorchBackend"]


@register_backend("torch")
class TorchBackend(TrainingBackend):
    """:class:`~edge_sdk.backends.base.TrainingBackend` over a ``shared.models`` camera model in torch.

    Args:
        num_classes: model output size K (None: the spec's, or 10 with a kind name).
        model: a :class:`~shared.models.kinds.ModelSpec`, or a kind name (``"head"``, ``"camera_cnn"``); None is
            :data:`shared.models.kinds.DEFAULT_KIND`.
        model_options: the kind's options with a kind name, e.g. ``{"adapter_width": 256}`` (0: head only).
        scope: ``"all"`` trains every parameter; ``"head"`` trains ``psi.*`` only (the adapter frozen).
        threads: ``torch.set_num_threads`` value (None leaves torch's default).
        device: torch device string, ``"cpu"`` or ``"cuda"``.
        microbatch_size: per-example gradients are computed this many examples at a time (bounds memory:
            about ``microbatch_size * d * 4`` bytes per chunk).
        module: an already built ``torch.nn.Module`` to train instead of ``model``'s fresh one (tests); inputs are
            still prepared as ``model``'s kind takes them.

    Raises:
        ConfigError: unknown kind or options, a bad scope, or a CUDA device where torch has none.
    """

    name = "torch"

    def __init__(self, num_classes: int | None = None, *, model: ModelSpec | str | None = None,
                 model_options: dict[str, object] | None = None, scope: str = "all", threads: int | None = None,
                 device: str = "cpu", microbatch_size: int = 256, module: torch.nn.Module | None = None) -> None:
        self._spec = as_spec(model, num_classes, model_options)
        if scope not in SCOPES:
            raise ConfigError(f"scope must be one of {SCOPES}, got {scope!r}", field="scope",
                              fix="all (train phi and psi) or head (train psi only)")
        if threads is not None:
            torch.set_num_threads(int(threads))
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but torch sees no CUDA device", field="device",
                              fix="set device: cpu in the site config or profile, or install a CUDA build of torch")
        self._device = torch.device(device)
        self._scope = scope
        self._model = (module if module is not None else self._spec.build()).to(self._device).eval()
        self._all = dict(self._model.named_parameters())
        trainable = set(trainable_names(tuple(self._all), scope))
        for n, p in self._all.items():
            if n not in trainable:
                p.requires_grad_(False)
        self._params = {n: p for n, p in self._all.items() if p.requires_grad}
        self._buffers = dict(self._model.named_buffers())
        offset, layout = 0, []
        for name, p in self._params.items():
            layout.append(ParameterSpec(name, tuple(p.shape), offset))
            offset += p.numel()
        self._layout = tuple(layout)
        self._all_layout = tuple(ParameterSpec(n, tuple(p.shape), 0) for n, p in self._all.items())
        self._microbatch = int(microbatch_size)

        model_ref, buffers = self._model, self._buffers

        def example_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = functional_call(model_ref, (params, buffers), (x.unsqueeze(0),))
            return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

        self._per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))
        self._ghost_layers = _ghost_layers(self._model, self._params)

    @property
    def parameter_layout(self) -> tuple[ParameterSpec, ...]:
        """Trainable parameters in ``model.named_parameters()`` order (``psi.*`` only with ``scope="head"``)."""
        return self._layout

    @property
    def spec(self) -> ModelSpec:
        """The model's architecture."""
        return self._spec

    @property
    def scope(self) -> str:
        """``"all"`` or ``"head"`` (what is trained)."""
        return self._scope

    @property
    def model(self) -> torch.nn.Module:
        """The underlying module (shares storage with the backend's parameters)."""
        return self._model

    def _inputs(self, x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(self._spec.prepare_input(x), device=self._device)

    def _labels(self, y: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(y, dtype=np.int64), device=self._device)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Copy ``{name: array}`` (every parameter, frozen ones included; buffers optional) into the model.

        Raises:
            ConfigError: a parameter is missing, unknown or has the wrong shape.
        """
        checked = checked_weights(weights, self._all_layout, allowed_extra=set(self._buffers))
        with torch.no_grad():
            for spec in self._all_layout:
                self._all[spec.name].copy_(torch.as_tensor(checked[spec.name]))
            for name, buf in self._buffers.items():
                if name in weights:
                    buf.copy_(torch.as_tensor(np.asarray(weights[name])))

    def get_weights(self) -> dict[str, np.ndarray]:
        """``{name: float32 array}`` of every parameter, frozen ones included (copies)."""
        return {n: p.detach().cpu().numpy().astype(np.float32, copy=True) for n, p in self._all.items()}

    def per_example_gradients(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (B, d): row i is the gradient of example i's cross-entropy loss, flat in layout order."""
        n = int(np.asarray(y).shape[0])
        out = np.empty((n, self.num_parameters), dtype=np.float32)
        params = {k: v.detach() for k, v in self._params.items()}
        for start in range(0, n, self._microbatch):
            stop = min(n, start + self._microbatch)
            grads = self._per_example(params, self._inputs(x[start:stop]), self._labels(y[start:stop]))
            flat = torch.cat([grads[s.name].reshape(stop - start, -1) for s in self._layout], dim=1)
            out[start:stop] = flat.cpu().numpy()
        return out

    def per_example(self, x: np.ndarray, y: np.ndarray, *,
                    input_sq_norms: np.ndarray | None = None) -> PerExampleGradients:
        """Per-example gradient norms and weighted sums without the (B, d) matrix (see the module docstring);
        falls back to materialised ``vmap`` gradients for layouts other than Linear/Conv2d.

        Raises:
            ValueError: ``x`` is not what the model kind takes (e.g. images for the head model).
        """
        if self._ghost_layers is None:
            return super().per_example(x, y)
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}

        def hook(name: str):
            def capture(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
                inputs[name], outputs[name] = args[0].detach(), output
            return capture

        handles = [module.register_forward_hook(hook(name)) for name, module in self._ghost_layers.items()]
        try:
            logits = self._model(self._inputs(x))
        finally:
            for handle in handles:
                handle.remove()
        loss = torch.nn.functional.cross_entropy(logits, self._labels(y), reduction="sum")
        names = list(self._ghost_layers)
        deltas = dict(zip(names, torch.autograd.grad(loss, [outputs[n] for n in names])))
        known: dict[int, torch.Tensor] = {}
        first = input_layer_prefix([name for name, _ in self._model.named_parameters()])
        if input_sq_norms is not None and first in inputs:
            sq = torch.as_tensor(np.asarray(input_sq_norms, dtype=np.float64))
            if sq.shape != (inputs[first].shape[0],):
                raise ValueError(f"input_sq_norms must be ({inputs[first].shape[0]},), got {tuple(sq.shape)}")
            known[id(inputs[first])] = sq
        pieces: dict[str, torch.Tensor] = {}  # parameter name -> per-example factors (see _GhostGradients)
        for name, module in self._ghost_layers.items():
            a, delta = inputs[name], deltas[name].detach()
            if isinstance(module, torch.nn.Linear):
                pieces[f"{name}.weight"] = ("outer", delta, a)
            else:
                d = delta.flatten(2)
                pieces[f"{name}.weight"] = ("dense", _conv_weight_per_example(a, delta, module))
                delta = d.sum(dim=2)
            if module.bias is not None:
                pieces[f"{name}.bias"] = ("dense", delta)
        return _GhostGradients(pieces, self._layout, known)

    def gradient(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (d,): gradient of the mean cross-entropy over the batch (one autograd backward)."""
        self._model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self._model(self._inputs(x)), self._labels(y))
        loss.backward()
        return torch.cat([self._params[s.name].grad.reshape(-1) for s in self._layout]).cpu().numpy()

    def apply_gradient(self, flat_grad: np.ndarray, learning_rate: float) -> None:
        """``theta <- theta - learning_rate * flat_grad`` (float32 (d,))."""
        flat = torch.as_tensor(np.asarray(flat_grad, dtype=np.float32), device=self._device)
        if flat.shape != (self.num_parameters,):
            raise ValueError(f"flat gradient must have shape ({self.num_parameters},), got {tuple(flat.shape)}")
        with torch.no_grad():
            for spec in self._layout:
                self._params[spec.name].sub_(flat[spec.offset:spec.offset + spec.size].view(spec.shape),
                                             alpha=float(learning_rate))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """int64 (B,) argmax classes."""
        with torch.no_grad():
            return self._model(self._inputs(x)).argmax(dim=1).cpu().numpy().astype(np.int64)


def _conv_weight_per_example(a: torch.Tensor, delta: torch.Tensor, module: torch.nn.Conv2d) -> torch.Tensor:
    """Per-example Conv2d weight gradients, (B, out * in * kh * kw) in the weight's row-major order.

    g_i[o, c, u, v] = sum_p delta_i[o, p] * patch_i[c, u, v, p]. For stride 1 and dilation 1 the (u, v) patch of
    every position is a shifted window of the zero-padded input, so the gradient is kh*kw batched matmuls of the
    output gradients with those windows (no im2col buffer: cheaper on CPU for these sizes); otherwise im2col
    (``unfold``) and one batched product.
    """
    b, out_ch = delta.shape[:2]
    d = delta.flatten(2)  # (B, O, P)
    if tuple(module.stride) != (1, 1) or tuple(module.dilation) != (1, 1):
        unfolded = torch.nn.functional.unfold(a, module.kernel_size, dilation=module.dilation,
                                              padding=module.padding, stride=module.stride)
        return torch.bmm(d, unfolded.transpose(1, 2)).flatten(1)
    kh, kw = module.kernel_size
    ph, pw = module.padding
    ho, wo = delta.shape[2:]
    padded = torch.nn.functional.pad(a, (pw, pw, ph, ph)) if (ph or pw) else a
    grads = torch.empty((b, out_ch, a.shape[1], kh * kw), dtype=d.dtype, device=d.device)
    for k in range(kh * kw):
        u, v = divmod(k, kw)
        window = padded[:, :, u:u + ho, v:v + wo].reshape(b, a.shape[1], ho * wo)  # (B, C, P)
        grads[:, :, :, k] = torch.bmm(d, window.transpose(1, 2))
    return grads.flatten(1)


def _ghost_layers(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Module] | None:
    """``{module name: module}`` when every trainable parameter is the weight/bias of a Linear or a plain Conv2d
    (groups 1, zero padding given as numbers); None otherwise (then the vmap path is used)."""
    layers: dict[str, torch.nn.Module] = {}
    covered: set[str] = set()
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        plain_conv = (isinstance(module, torch.nn.Conv2d) and module.groups == 1
                      and module.padding_mode == "zeros" and not isinstance(module.padding, str))
        if not (isinstance(module, torch.nn.Linear) or plain_conv) or set(own) - {"weight", "bias"}:
            return None
        layers[name] = module
        covered.update(f"{name}.{n}" for n in own)
    return layers if covered == set(params) else None


class _GhostGradients(PerExampleGradients):
    """Per-example gradients held per parameter as ``("dense", G (B, size))`` or ``("outer", delta (B, o),
    a (B, i))`` meaning G_b = delta_b a_b^T (flattened row-major as the (o, i) weight)."""

    def __init__(self, pieces: dict[str, tuple], layout: tuple[ParameterSpec, ...],
                 known_sq: dict[int, torch.Tensor] | None = None) -> None:
        self._pieces = pieces
        self._layout = layout
        # a layer's delta serves its weight and its bias: one norm each; ``known_sq``: the input's, given
        row_sq: dict[int, torch.Tensor] = dict(known_sq or {})

        def squared(t: torch.Tensor) -> torch.Tensor:
            """float64 (B,) upper bounds of the squared row norms: summed in float32 (3x cheaper than float64
            accumulation) and raised by the float32 summation bound ``1 + gamma_n``
            (:func:`~edge_sdk.privacy.per_example.summation_error_bound`), so no clipped norm can exceed C."""
            if id(t) not in row_sq:
                flat = t.flatten(1)
                bound = 1.0 + summation_error_bound(int(flat.shape[1]))
                row_sq[id(t)] = flat.square().sum(dim=1).to(torch.float64) * bound
            return row_sq[id(t)]

        sq = None
        for piece in pieces.values():
            term = squared(piece[1]) * squared(piece[2]) if piece[0] == "outer" else squared(piece[1])
            sq = term if sq is None else sq + term
        self.norms = sq.sqrt().cpu().numpy()

    def weighted_sum(self, weights: np.ndarray, *, dtype: type = np.float32) -> np.ndarray:
        """(K, d) of ``dtype`` = weights (K, B) @ G, assembled per parameter in layout order, accumulated in
        ``dtype`` (:meth:`PerExampleGradients.weighted_sum`)."""
        first = next(iter(self._pieces.values()))[1]
        wide = torch.float64 if dtype == np.float64 else torch.float32
        w = torch.as_tensor(np.asarray(weights, dtype=np.float32), device=first.device).to(wide)
        parts = []
        for spec in self._layout:
            piece = self._pieces[spec.name]
            piece = (piece[0], *(t.to(wide) for t in piece[1:]))
            if piece[0] == "outer" and w.shape[0] == 1:  # the production case (privatize): one 2-D GEMM
                parts.append((piece[1] * w[0][:, None]).T.matmul(piece[2]).reshape(1, -1))
            elif piece[0] == "outer":
                scaled = w[:, :, None] * piece[1][None, :, :]  # (K, B, o)
                parts.append(torch.matmul(scaled.transpose(1, 2), piece[2]).flatten(1))  # (K, o, i)
            else:
                parts.append(w @ piece[1])
        return torch.cat(parts, dim=1).cpu().numpy()
