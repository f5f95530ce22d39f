"""Where the detector's weights and the files made from them live on a gateway: the WildFed cache
(``$WILDFED_CACHE``, default ``~/.cache/wildfed``) and the one-time fetch of the YOLOX-tiny checkpoint.

The code lives in :mod:`shared.models.detector_weights` because the coordinator uses it too (it exports the
detector's ONNX graph at provisioning and ships it in the bundle); this module is the gateway's name for it.
"""

from shared.models.detector_weights import (CHECKPOINT_MEMBER, CHECKPOINT_SHA256, ZAMBA_REQUIREMENT, ZAMBA_WHEEL,
                                            WeightsUnavailableError, cache_dir, detector_checkpoint, sha256_file)

__all__ = ["ZAMBA_REQUIREMENT", "ZAMBA_WHEEL", "CHECKPOINT_MEMBER", "CHECKPOINT_SHA256", "cache_dir",
           "sha256_file", "detector_checkpoint", "WeightsUnavailableError"]
