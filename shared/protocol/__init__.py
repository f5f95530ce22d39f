"""Message payloads: what rides inside an envelope.

Every payload is safetensors (:mod:`shared.codec`) whose metadata key ``"wildfed"`` holds the JSON of one of the
frozen dataclasses below; the tensors are model weights (TASK), a model delta (UPDATE) or none (ACK, DETECTION).

Compatibility rules: fields are never removed and never change meaning; new fields are optional with defaults
that keep the old meaning; decoders reject unknown fields so a misread is loud, not silent.

The payload families live in modules of their own: :mod:`shared.protocol.tasks` (TASK), :mod:`shared.protocol.updates`
(UPDATE, ACK), :mod:`shared.protocol.detections` (DETECTION), :mod:`shared.protocol.secagg_messages` (SECAGG and a
task's secure-aggregation settings), :mod:`shared.protocol.common` (what they share). This package re-exports their
public names: the gateway, the coordinator and the laboratory (some eighty modules) import them from here.
"""

from __future__ import annotations

from shared.protocol.common import (ARTIFACT_PREFIX, CCDP_VARIANTS, GUARANTEED_RADIO_DEFENCES, METADATA_KEY,
                                    PRIVACY_MODES, RADIO_CATEGORY, RADIO_DEFENCES, PrivacyMode, canonical_flatten,
                                    canonical_unflatten)
from shared.protocol.detections import (SPECIES_STATUSES, Detection, DetectionRecord, decode_detection,
                                        encode_detection)
from shared.protocol.secagg_messages import (COORDINATOR_STAGES, MASKED_TENSOR, SITE_STAGES, SecAggMessage,
                                             SecAggSettings, decode_secagg, encode_secagg)
from shared.protocol.tasks import RadioTask, TrainingTask, decode_task, decode_task_with_artifacts, encode_task
from shared.protocol.updates import Ack, UpdateReport, decode_ack, decode_update, encode_ack, encode_update

__all__ = ["CCDP_VARIANTS", "SPECIES_STATUSES", "TrainingTask", "UpdateReport", "Ack", "encode_task", "decode_task", "encode_update",
           "decode_update", "encode_ack", "decode_ack", "METADATA_KEY", "ARTIFACT_PREFIX",
           "decode_task_with_artifacts", "Detection", "DetectionRecord",
           "encode_detection", "decode_detection", "SecAggSettings", "SecAggMessage", "SITE_STAGES",
           "COORDINATOR_STAGES", "encode_secagg", "decode_secagg", "canonical_flatten", "canonical_unflatten",
           "RadioTask", "PRIVACY_MODES", "PrivacyMode", "MASKED_TENSOR", "RADIO_DEFENCES", "GUARANTEED_RADIO_DEFENCES", "RADIO_CATEGORY"]
