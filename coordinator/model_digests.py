"""Models by digest: each model a round's tasks train from is published once, for every site, not once per task.

With ``transfer.models_by_digest`` a camera task carries no weights, only their hash (``TrainingTask.model_digest``),
and the model itself goes out once per distinct model: FedAvg's global model once per round, NIRA's each cluster's
model (phi with its cluster's head) once, whatever the number of sites. :class:`ModelDigests` publishes it as a
MODEL envelope (``shared.releases``: the weights, ``ModelRelease`` metadata with ``model_hash`` = the digest and
``round`` = the first round whose tasks name it), signed with the coordinator's key, addressed to
``shared.envelope.BROADCAST_SITE_ID``, **retained** on ``shared.topics.digest_topic(fed, digest)``: whole, or as
its chunks on ``.../<digest>/<i>`` and then its signed manifest (:func:`coordinator.retained.publish_retained`, as
model releases). A gateway that does not hold the model subscribes to that digest's topics until it has it
(``edge_sdk.rounds.model_cache``).

Once per digest: what is published is recorded in the strategy-state table (``model_digests``: ``{digest: {"round":
the last round whose tasks named it, "chunks": its chunk topics}}``), so a model that several rounds train from (a
failed round, a restarted coordinator) is not published again. A digest no task of the last
``transfer.model_retention_rounds`` rounds named is cleared: an empty retained message on its topic and each of its
chunk topics (a broker then delivers nothing there).

A failure to publish raises (:class:`coordinator.transport.TransportError`): the round's tasks, which name the
digest, must not go out without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import BROADCAST_SITE_ID, MessageKind, seal
from shared.releases import ModelRelease, encode_release
from shared.topics import digest_chunk_topic, digest_topic
from shared.transfer import piece_size_for

from coordinator.config import CoordinatorConfig
from coordinator.retained import publish_retained
from coordinator.storage import Store
from coordinator.transport import Transport

__all__ = ["ModelDigests", "STATE_KEY"]

log = logging.getLogger(__name__)

STATE_KEY = "model_digests"
"""Strategy-state key of what is published by digest (module docstring)."""


class ModelDigests:
    """Publishes each model once by digest and clears old ones (module docstring).

    Args:
        config: the coordinator config (federation, ``transfer.chunk_size_bytes``,
            ``transfer.model_retention_rounds``).
        store: where what is published is recorded. transport: the coordinator's transport (retained publishes).
        signing_key: the coordinator's Ed25519 key (signs the envelopes and manifests).
    """

    def __init__(self, *, config: CoordinatorConfig, store: Store, transport: Transport,
                 signing_key: Ed25519PrivateKey) -> None:
        self.config = config
        self._store = store
        self._transport = transport
        self._key = signing_key
        self._published: dict[str, dict[str, int]] | None = None  # the state row, read once
        self.published_now: list[str] = []
        """Digests published by this process, in order (observability, tests)."""

    def _state(self) -> dict[str, dict[str, int]]:
        if self._published is None:
            raw = self._store.get_state(STATE_KEY) or {}
            self._published = {str(d): {"round": int(e["round"]), "chunks": int(e["chunks"])} for d, e in raw.items()}
        return self._published

    def publish(self, round_: int, digest: str, weights: Mapping[str, np.ndarray]) -> bool:
        """Make sure the model ``digest`` (whose weights are ``weights``, float32 by name; ``digest`` must be their
        ``shared.codec.model_hash``) is retained on its topic for round ``round_``'s tasks, publishing it unless it is
        already. Call once per site task: only the first call for a digest publishes.

        Returns:
            True when it was published now, False when it was retained already.

        Raises:
            TransportError: a publish failed (nothing is recorded: the next call tries again).
            PayloadError: a weight that is not float32 or not finite.
        """
        state = self._state()
        entry = state.get(digest)
        if entry is not None:
            if entry["round"] < round_:
                entry["round"] = round_
                self._store.set_state(STATE_KEY, state)
            return False
        cfg = self.config
        payload = encode_release(ModelRelease(federation_id=cfg.federation_id, round=max(1, round_),
                                              model_hash=digest), weights)
        env = seal(private_key=self._key, federation_id=cfg.federation_id, site_id=BROADCAST_SITE_ID,
                   round=round_, base_model_hash=digest, kind=MessageKind.MODEL, sequence=round_, payload=payload,
                   piece_size=piece_size_for(cfg.transfer.chunk_size_bytes))
        fed = cfg.federation_id
        chunks = publish_retained(self._transport, env, topic=digest_topic(fed, digest),
                                  chunk_topic=lambda i: digest_chunk_topic(fed, digest, i),
                                  chunk_size_bytes=cfg.transfer.chunk_size_bytes, signing_key=self._key)
        state[digest] = {"round": round_, "chunks": chunks}
        self.published_now.append(digest)
        self._store.set_state(STATE_KEY, state)
        log.info("model digests: round %d model %s published once for every site (%d bytes, %d chunk(s))", round_,
                 digest[:12], env.wire_length, chunks)
        return True

    def expire(self, round_: int) -> list[str]:
        """Clear every digest no task of rounds ``round_ - retention + 1 .. round_`` named (an empty retained
        message on its topic and chunk topics). A failure is logged and tried again at the next round.

        Returns:
            The digests cleared.
        """
        keep = int(self.config.transfer.model_retention_rounds)
        state = self._state()
        old = sorted(d for d, e in state.items() if e["round"] <= round_ - keep)
        fed = self.config.federation_id
        cleared = []
        for digest in old:
            try:
                self._transport.publish(digest_topic(fed, digest), b"", qos=1, retain=True)
                for i in range(state[digest]["chunks"]):
                    self._transport.publish(digest_chunk_topic(fed, digest, i), b"", qos=1, retain=True)
            except Exception as exc:  # noqa: BLE001 - e.g. TransportError: cleared at the next round
                log.warning("model digests: model %s not cleared (%s: %s); tried again next round", digest[:12],
                            type(exc).__name__, exc)
                continue
            del state[digest]
            cleared.append(digest)
        if cleared:
            self._store.set_state(STATE_KEY, state)
            log.info("model digests: cleared %d model(s) no task of the last %d round(s) named", len(cleared), keep)
        return cleared
