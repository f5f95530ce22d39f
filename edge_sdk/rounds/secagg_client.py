"""The gateway's part in a Global DP round: the secure-aggregation client (docs/secagg.md, docs/privacy.md).

A ``privacy: global`` task (accepted only where the site config sets ``allow_global_dp``) asks the site to
advertise fresh keys, compute its clipped gradient sum (kept in memory only until it is masked), add its share of
the Skellam noise when the noise is distributed, then follow the coordinator's stages: key list -> encrypted shares,
share inbox -> masked sum, recovery request -> the shares that unmask a dropped site's pairwise masks, round end.
A protocol error drops the site out of the round (the others recover its masks); nothing is retried.

Timing: the keys leave right after the task is accepted, before any record is read; every reply after them (the
shares, the masked sum, the recovery shares) waits for the round's public time slot
(:mod:`edge_sdk.privacy.timing`): the loop is busy while the sum is computed, so a key list that arrives meanwhile
would otherwise be answered at a time that tells how long the work took.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from shared.errors import PayloadError, PrivacyBudgetError
from shared.envelope import MessageKind, seal
from shared.models.feature_centre import centre_digest
from shared.privacy.distributed import skellam_noise, skellam_share_variance
from shared.protocol import (COORDINATOR_STAGES, SecAggMessage, TrainingTask, canonical_flatten, decode_secagg,
                             encode_secagg)
from shared.secagg import AdvertisedKeys, EncryptedShare, RecoveryRequest, SecAggClient, SecAggError
from shared.topics import secagg_topic

from edge_sdk.rounds.backends import BackendChooser
from edge_sdk.rounds.context import AgentContext
from edge_sdk.training import clipped_sum_locally
from edge_sdk.uplink.transport import TransportError

__all__ = ["SecAggRoundState", "SecAggSiteClient"]

log = logging.getLogger(__name__)


@dataclass
class SecAggRoundState:
    """This site's state in one Global DP round (memory only)."""

    round: int
    model_hash: str
    client: SecAggClient
    gradient: np.ndarray | None  # float64 (d,), canonical order, quantised from float64; dropped once masked
    num_examples: int
    categories: tuple[str, ...]
    noise: np.ndarray | None = None  # int64 (d,): this site's Skellam share (distributed DP); dropped once masked


class SecAggSiteClient:
    """This site's Global DP rounds (module docstring).

    Args:
        ctx: the agent's shared state.
        backends: the site's training backends.
        feature_centre: the site's public feature centre (float32 (1280,)) or None.

    Attributes:
        state: the round in progress, or None.
    """

    def __init__(self, ctx: AgentContext, backends: BackendChooser, feature_centre: np.ndarray | None) -> None:
        self.ctx = ctx
        self.backends = backends
        self.feature_centre = feature_centre
        self.topic = secagg_topic(ctx.config.federation_id, ctx.site_id)
        self.state: SecAggRoundState | None = None

    def _send(self, state: SecAggRoundState, message: SecAggMessage) -> bool:
        envelope = seal(private_key=self.ctx.signing_key, federation_id=self.ctx.config.federation_id,
                        site_id=self.ctx.config.site_id, round=state.round, base_model_hash=state.model_hash,
                        kind=MessageKind.SECAGG, sequence=self.ctx.next_sequence(), payload=encode_secagg(message))
        try:
            self.ctx.transport.publish(self.topic, envelope.to_bytes(), qos=1)
        except TransportError as exc:
            self.ctx.stats["publish_failed"] += 1
            log.warning("site %s: round %d secagg %s not sent (%s); the site drops out of this round",
                        self.ctx.config.site_id, state.round, message.stage, exc)
            self.state = None
            return False
        self.ctx.stats[f"secagg_sent:{message.stage}"] += 1
        return True

    def start(self, task: TrainingTask, weights: dict[str, np.ndarray], records: object) -> bool:
        """Global DP: advertise fresh keys, then read the site's records again if they changed
        (``records.refresh()``, :class:`edge_sdk.rounds.camera.SiteRecords`: after the keys, so that when the keys
        leave does not depend on the records) and compute the clipped gradient sum of ``records.dataset`` (kept in
        memory until masked)."""
        assert task.secagg is not None  # decode_task checked it
        if task.capacity is None:
            self.ctx.reject("task", "no_capacity", f"round {task.round}: the task names no declared capacity for "
                            "this site (fix, at the coordinator: enrol the site with --metadata "
                            "'{\"capacity\": N}')")
            return False
        params = task.secagg.params(task.federation_id, task.round)
        if self.ctx.config.site_id not in params.site_ids:
            self.ctx.reject("task", "wrong_site", f"site not among the round's secagg sites {list(params.site_ids)}")
            return False
        if params.vector_length != sum(int(np.asarray(w).size) for w in weights.values()):
            self.ctx.reject("task", "model_mismatch", f"secagg vector_length {params.vector_length} != model size")
            return False
        centre = None
        if task.feature_centre is not None:  # the coordinator folds the sum back with this c: use the same one
            if self.feature_centre is None or centre_digest(self.feature_centre) != task.feature_centre:
                have = "none" if self.feature_centre is None else centre_digest(self.feature_centre)[:12]
                self.ctx.reject("task", "feature_centre_mismatch",
                                f"the task's gradients are taken on embeddings centred by {task.feature_centre[:12]}, "
                                f"this site's feature_centre is {have}: give the site the coordinator's centre file")
                return False
            centre = self.feature_centre
        self.ctx.set_last_round(task.round)  # durable before any data is touched
        client = SecAggClient(self.ctx.config.site_id, params)
        state = SecAggRoundState(round=task.round, model_hash=task.model_hash, client=client, gradient=None,
                                 num_examples=0, categories=())
        self.state = state
        if not self._send(state, SecAggMessage("keys", client.public_keys().to_json())):
            return False
        started = time.monotonic()
        records.refresh()  # type: ignore[attr-defined]
        dataset = records.dataset  # type: ignore[attr-defined]
        if self.feature_centre is not None and centre is None:
            log.info("site %s: round %d: the global task names no feature centre: plain (uncentred) gradients",
                     self.ctx.config.site_id, task.round)
        try:
            result = clipped_sum_locally(backend=self.backends.current, dataset=dataset, task=task,
                                         global_weights=weights, site_categories=self.ctx.config.categories,
                                         randomness=self.ctx.randomness(task), feature_centre=centre,
                                         record_mask=records.record_mask(task))  # type: ignore[attr-defined]
        except PrivacyBudgetError as exc:
            self.state = None
            self.ctx.reject("task", "privacy_budget", str(exc))
            return False
        except (ValueError, PayloadError) as exc:
            self.state = None
            self.ctx.reject("task", "model_mismatch", str(exc))
            return False
        state.gradient = canonical_flatten(result.gradient_sum, dtype=np.float64)  # quantised from float64
        if task.distributed_noise:  # distributed DP: this site's share of the noise, added before masking
            assert task.noise_multiplier is not None  # a global task carries it (TrainingTask checks)
            state.noise = skellam_noise(skellam_share_variance(
                noise_multiplier=task.noise_multiplier, clipping_norm=task.clipping_norm,
                vector_length=params.vector_length, scale=params.scale, threshold=params.threshold,
                colluding_sites=task.secagg.colluding_sites),
                params.vector_length)
        state.num_examples = result.num_examples
        state.categories = tuple(c.value for c in result.categories)
        self.ctx.stats["tasks_trained"] += 1
        slot = self.ctx.pacer.ready(task.round)  # the replies from here on wait for this public time slot
        log.info("site %s: round %d (global DP) clipped sum ready in %.1f s (N=%d, q=%.4g); %s",
                 self.ctx.config.site_id, task.round, time.monotonic() - started, result.num_examples,
                 result.sampling_rate, "waiting for the key list" if slot is None else
                 f"replies wait for the round's time slot ({self.ctx.pacer.wait_s(float('inf')):.1f} s)")
        return True

    def handle(self, data: bytes) -> bool:
        """Answer one secure-aggregation stage from the coordinator (key list, share inbox, recovery request, round
        end); returns True if it was handled. Bad or out-of-order messages are rejected, logged and counted; a
        protocol error drops the site out of the round (its masks are then recovered by the others)."""
        envelope = self.ctx.open(data, MessageKind.SECAGG, "secagg")
        if envelope is None:
            return False
        state = self.state
        if state is None or envelope.header.round != state.round:
            self.ctx.reject("secagg", "stale_round", f"round {envelope.header.round} is not a secure-aggregation round "
                         "in progress here")
            return False
        return self.ctx.pacer.release(state.round, lambda: self._answer(envelope.payload, state))

    def _answer(self, payload: bytes, state: SecAggRoundState) -> bool:
        """The reply to one verified stage message of ``state``'s round (at the round's time slot)."""
        if self.state is not state:  # the site left the round while the message waited
            log.info("site %s: round %d: a secure-aggregation message waited for the time slot of a round the site "
                     "has left; dropped", self.ctx.config.site_id, state.round)
            return False
        try:
            message = decode_secagg(payload, stages=COORDINATOR_STAGES)
            body = message.body
            if message.stage == "key_list":
                keys = [AdvertisedKeys.from_json(k) for k in body.get("keys", [])]
                shares = state.client.shares_for({k.site_id: k for k in keys})
                self._send(state, SecAggMessage("shares", {"shares": [s.to_json() for s in shares.values()]}))
            elif message.stage == "share_inbox":
                if state.gradient is None:
                    raise SecAggError("share inbox before the gradient sum was ready, or a second inbox")
                inbox = [EncryptedShare.from_json(x) for x in body.get("shares", [])]
                state.client.receive_shares({x.sender: x for x in inbox})
                masked = state.client.mask(state.gradient, integer_noise=state.noise)
                state.gradient = state.noise = None  # the unmasked sum is not kept once it has left masked
                self._send(state, SecAggMessage(
                    "masked", {"num_examples": state.num_examples, "categories": list(state.categories)}, masked))
            elif message.stage == "recovery_request":
                shares = state.client.reveal_for_recovery(RecoveryRequest.from_json(body))
                self._send(state, SecAggMessage("recovery", shares.to_json()))
            else:  # round_end
                log.info("site %s: round %d secure aggregation ended: %s %s", self.ctx.config.site_id, state.round,
                         body.get("status"), body.get("reason", ""))
                self.state = None
        except (SecAggError, PayloadError) as exc:
            self.state = None
            self.ctx.reject("secagg", getattr(exc, "reason", "secagg_error"), f"{exc}; the site leaves this round")
            return False
        return True

