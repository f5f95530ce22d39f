"""Gateway inference: camera-trap photos -> detection records (boxes, species, time, deployment).

Modules: ``weights`` (fetching the YOLOX-tiny checkpoint), ``engines`` (TensorRT engine cache, ONNX Runtime
fallback), ``detector`` (YOLOX-tiny pre/post-processing), ``classifier`` (the federated species model on detector
crops), ``records`` (images -> :class:`shared.protocol.DetectionRecord`, signed publishing), ``formats``
(MegaDetector batch-output JSON 1.4, Camtrap DP observations). See docs/inference.md.

Nothing is imported here eagerly: importing ``edge_sdk.inference`` costs nothing on a gateway that never detects.
"""
