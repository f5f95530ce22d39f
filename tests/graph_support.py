"""Stand-ins for the two ONNX graphs a camera gateway runs (``shared.models.gateway_graphs``), with their interfaces
and canonical file names, so that provisioning and installing can be tested without torch, the real weights or a
download. Their outputs are computable by hand:

- backbone: ``images`` (batch, 3, S, S) -> ``embeddings`` (batch, 1280) = ReLU(per-channel means @ M), M a fixed
  (3, 1280) matrix (``numpy.random.default_rng(seed)``);
- detector: ``images`` (batch, 3, 640, 640) -> ``output`` (batch, 8400, 6) of zeros (objectness 0: no boxes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.models.gateway_graphs import backbone_graph_relpath, detector_graph_relpath


def fake_backbone_graph(path: Path, input_size: int, seed: int = 0) -> Path:
    """Write the stand-in backbone embedder for ``input_size`` px to ``path``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = np.random.default_rng(seed).standard_normal((3, 1280)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["images"], ["mean"], axes=[2, 3], keepdims=0),
         helper.make_node("MatMul", ["mean", "m"], ["z"]), helper.make_node("Relu", ["z"], ["embeddings"])],
        "fake_backbone",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, input_size, input_size])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", 1280])],
        [numpy_helper.from_array(m, "m")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def fake_detector_graph(path: Path) -> Path:
    """Write the stand-in detector (all-zero raw head output) to ``path``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["images"], ["mean"], axes=[1, 2, 3], keepdims=1),  # (batch, 1, 1, 1)
         helper.make_node("Reshape", ["mean", "shape"], ["flat"]),                          # (batch, 1, 1)
         helper.make_node("Mul", ["flat", "zeros"], ["output"])],                           # (batch, 8400, 6)
        "fake_detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 640, 640])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 8400, 6])],
        [numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "shape"),
         numpy_helper.from_array(np.zeros((1, 8400, 6), np.float32), "zeros")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def fake_graph_folder(root: Path, *, backbone: str = "efficientnet-lite0", input_size: int = 128) -> Path:
    """A graph folder (the WildFed cache's layout, a gateway's ``model_dir``) holding both stand-ins under their
    canonical names: what ``provision_site(graph_cache=root)`` ships without exporting anything."""
    fake_backbone_graph(root / backbone_graph_relpath(backbone, input_size), input_size)
    fake_detector_graph(root / detector_graph_relpath())
    return root
