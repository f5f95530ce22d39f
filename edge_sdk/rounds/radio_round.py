"""A radio base station's round (:mod:`edge_sdk.radio`): the allocator refreshed when due, local RadioUNet
training, then the grouped-noise upload through the outbox."""

from __future__ import annotations

import time

import numpy as np

from shared.errors import PayloadError
from shared.protocol import TrainingTask
from shared.radio import RadioMapSet

from edge_sdk.backends.ort_backend import ArtifactCache
from edge_sdk.radio import RadioSiteTrainer, run_radio_task
from edge_sdk.rounds.context import AgentContext
from edge_sdk.uplink.uploader import Uploader

__all__ = ["RadioRound"]


class RadioRound:
    """The radio rounds of one base station.

    Args:
        ctx: the agent's shared state.
        uploader: the outbox's traffic.
        maps: the site's radio maps.
        artifact_cache: the cache whose folder also keeps the allocator (``<cache>/radio``).
    """

    def __init__(self, ctx: AgentContext, *, uploader: Uploader, maps: RadioMapSet,
                 artifact_cache: ArtifactCache) -> None:
        self.ctx = ctx
        self.uploader = uploader
        self.maps = maps
        self.artifact_cache = artifact_cache
        self._trainer: RadioSiteTrainer | None = None

    def train(self, task: TrainingTask, weights: dict[str, np.ndarray], artifacts: dict[str, bytes]) -> bool:
        """Train one round and send the update; False (counted, logged) when the round is refused."""
        ctx = self.ctx
        ctx.set_last_round(task.round)  # durable before training, as for camera rounds
        started = time.monotonic()
        try:
            trainer = self._trainer
            if trainer is None or not trainer.matches(task):
                store = self.artifact_cache.root / "radio"  # the allocator beside the cached model artifacts
                trainer = RadioSiteTrainer.for_task(task, maps=self.maps, model_store=store,
                                                    noise=ctx.randomness(task))
                self._trainer = trainer
            trainer.noise = ctx.randomness(task)
            report, delta = run_radio_task(trainer, task, weights, artifacts, rng=np.random.default_rng())
        except (ValueError, PayloadError) as exc:  # bad city artifact, weights of another model
            ctx.reject("task", "model_mismatch", str(exc))
            return False
        assert task.radio is not None
        return ctx.pacer.release(task.round, lambda: self.uploader.send_update(  # at the public time slot
            task, report, delta, started=started, detail=f"N={report.num_examples} maps, {task.radio.defence}"))
