"""A task's checks before any training: a verified TASK envelope is taken only for a round newer than the last one
trained (durably: a restarted gateway never trains a round twice, which would release two noisy views of the same
data), whose payload decodes, whose round and federation match the signed header, whose weights hash to the model
hash the coordinator signed, whose privacy mode the site allows (``privacy: none`` only with
``allow_non_private``; ``privacy: global`` only with ``allow_global_dp``: defaults the coordinator cannot override),
whose time padding (``round_duration_s``) is at least the site's ``min_round_duration_s``, whose kind (camera
or radio) is the site's, and, for a buffered round, that is not more than its ``max_staleness`` behind the newest
task seen (:mod:`edge_sdk.rounds.superseded`). A task that names its model by digest (``TrainingTask.model_digest``) carries no weights:
it is accepted with empty ``weights`` and its digest as ``model_hash`` (the agent then finds the model,
:mod:`edge_sdk.rounds.model_cache`, whose hash is checked there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.codec import model_hash
from shared.envelope import Envelope
from shared.errors import PayloadError
from shared.protocol import TrainingTask, decode_task_with_artifacts

from edge_sdk.rounds.context import AgentContext
from edge_sdk.rounds.superseded import too_stale

__all__ = ["AcceptedTask", "accept_task"]


@dataclass(frozen=True)
class AcceptedTask:
    """A task that passed every check: the task, its global weights (float32 by name; empty for a task with
    ``model_digest`` until they are found), its ONNX Runtime artifacts (file name -> bytes) and the weights' hash."""

    task: TrainingTask
    weights: dict[str, np.ndarray]
    artifacts: dict[str, bytes]
    model_hash: str


def accept_task(ctx: AgentContext, envelope: Envelope) -> AcceptedTask | None:
    """The checks of the module docstring on a verified, addressed TASK envelope; None (rejection counted and
    logged with its reason) when one fails. Nothing here raises for bad input from the wire."""
    header, config = envelope.header, ctx.config
    last = ctx.last_round()
    if header.round <= last:
        ctx.reject("task", "stale_round", f"round {header.round} <= last trained round {last}")
        return None
    try:
        task, weights, artifacts = decode_task_with_artifacts(envelope.payload)
    except PayloadError as exc:
        ctx.reject("task", exc.reason, str(exc))
        return None
    if too_stale(task, ctx.newest_round_seen):
        ctx.reject("task", "too_stale", f"round {task.round} is more than max_staleness {task.max_staleness} rounds "
                   f"behind round {ctx.newest_round_seen}, whose task came already: its update would not count")
        return None
    if task.round != header.round or task.federation_id != header.federation_id:
        ctx.reject("task", "header_mismatch", "task round/federation differ from the envelope header")
        return None
    actual_hash = model_hash(weights) if task.model_digest is None else task.model_digest
    if not (task.model_hash == header.base_model_hash == actual_hash):
        ctx.reject("task", "model_hash", f"weights hash {actual_hash[:12]} does not match the task")
        return None
    if task.privacy == "none" and not config.allow_non_private:
        ctx.reject("task", "non_private_refused",
                   "privacy 'none' requested but the site config does not set allow_non_private")
        return None
    if task.privacy == "global" and not config.allow_global_dp:
        ctx.reject("task", "global_dp_refused", "privacy 'global' requested (the coordinator would add the noise) "
                   "but the site config does not set allow_global_dp")
        return None
    if task.round_duration_s < config.min_round_duration_s:
        ctx.reject("task", "round_duration_too_short", f"the task pads the site's replies to round_duration_s "
                   f"{task.round_duration_s:g} s, less than this site's min_round_duration_s "
                   f"{config.min_round_duration_s:g} s (fix: raise round_duration_s in the coordinator config)")
        return None
    if (task.radio is not None) != (config.task == "radiomap"):
        ctx.reject("task", "task_kind", f"a {'radio' if task.radio is not None else 'camera'} task for a "
                   f"{config.task} site")
        return None
    return AcceptedTask(task, weights, artifacts, actual_hash)
