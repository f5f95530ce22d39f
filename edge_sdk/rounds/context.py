"""What every part of the gateway agent shares: the site's identity and keys, its outbox and durable counters, the
statistics, and the checks every envelope from the coordinator passes (signature, kind, federation, addressee).

Nothing here blocks or trains; the agent (:mod:`edge_sdk.agent`) builds one :class:`AgentContext` and hands it to the
parts in :mod:`edge_sdk.rounds` and to :class:`edge_sdk.uplink.uploader.Uploader`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.envelope import Envelope, MessageKind, verify
from shared.errors import EnvelopeError, MalformedEnvelopeError
from shared.protocol import TrainingTask

from edge_sdk.config import SiteConfig
from edge_sdk.privacy.randomness import RandomSource, SecureRandom, SeededRandom
from edge_sdk.privacy.timing import RoundPacer
from edge_sdk.uplink.outbox import Outbox
from edge_sdk.uplink.transport import Transport

__all__ = ["AgentContext", "kind_of"]

log = logging.getLogger(__name__)

_LAST_ROUND = "last_round"
_SEQUENCE = "sequence"


def kind_of(data: bytes) -> MessageKind | None:
    """The kind an envelope claims (verified later, by its handler), or None for anything else."""
    try:
        return Envelope.from_bytes(data).header.kind
    except MalformedEnvelopeError:
        return None


@dataclass
class AgentContext:
    """The state the agent's parts share (module docstring).

    Attributes:
        config: the site config.
        transport: the uplink.
        signing_key: the site's Ed25519 private key (signs what it sends).
        coordinator_key: the coordinator's Ed25519 public key (what it receives must verify with it).
        outbox: the persistent outbox (updates, and the agent's durable counters).
        stats: ``Counter`` of what happened (``tasks_trained``, ``rejected:<reason>``, ...).
        pacer: holds each round's outgoing messages until its public time slot (:mod:`edge_sdk.privacy.timing`).
        newest_round_seen: the newest round of a verified task this process has received (-1 before any).
    """

    config: SiteConfig
    transport: Transport
    signing_key: Ed25519PrivateKey
    coordinator_key: Ed25519PublicKey
    outbox: Outbox
    stats: Counter = field(default_factory=Counter)
    pacer: RoundPacer = field(default_factory=RoundPacer)
    newest_round_seen: int = -1

    @property
    def site_id(self) -> str:
        """The site's id."""
        return self.config.site_id

    # -- durable counters -------------------------------------------------------------------------------------
    def last_round(self) -> int:
        """The last round this site trained (or started), -1 before any: durable, so a restarted gateway never
        trains twice for one round (two noisy views of the same data)."""
        return int(self.outbox.get_state(_LAST_ROUND, "-1"))

    def set_last_round(self, round_: int) -> None:
        """Record ``round_`` as trained, durably, before any data is touched."""
        self.outbox.set_state(_LAST_ROUND, str(round_))

    def next_sequence(self) -> int:
        """The next envelope sequence number (durable, increasing)."""
        sequence = int(self.outbox.get_state(_SEQUENCE, "0")) + 1
        self.outbox.set_state(_SEQUENCE, str(sequence))
        return sequence

    # -- checks of what the coordinator sends ------------------------------------------------------------------
    def reject(self, what: str, reason: str, detail: str) -> None:
        """Count and log a refused message or task (``rejected:<reason>``)."""
        self.stats[f"rejected:{reason}"] += 1
        log.warning("site %s: %s rejected (%s): %s", self.site_id, what, reason, detail)

    def open(self, data: bytes, kind: MessageKind, what: str, *, addressee: str | None = None) -> Envelope | None:
        """Parse and verify an envelope from the coordinator addressed to this site (or to ``addressee``, e.g.
        ``shared.envelope.BROADCAST_SITE_ID`` on a digest topic); None if rejected."""
        try:
            envelope = Envelope.from_bytes(data)
            verify(envelope, self.coordinator_key)
        except EnvelopeError as exc:
            self.reject(what, exc.reason, str(exc))
            return None
        return self.addressed(envelope, kind, what, addressee=addressee)

    def addressed(self, envelope: Envelope, kind: MessageKind, what: str, *,
                  addressee: str | None = None) -> Envelope | None:
        """``envelope`` (verified) if it is of ``kind`` and addressed to this site (or to ``addressee`` where
        given) in our federation; None if rejected."""
        header = envelope.header
        if header.kind != kind:
            self.reject(what, "wrong_kind", f"kind {header.kind.value}, expected {kind.value}")
            return None
        if header.federation_id != self.config.federation_id:
            self.reject(what, "wrong_federation", f"federation {header.federation_id!r}")
            return None
        if header.site_id != (self.config.site_id if addressee is None else addressee):
            self.reject(what, "wrong_site", f"addressed to {header.site_id!r}")
            return None
        return envelope

    def randomness(self, task: TrainingTask) -> RandomSource:
        """The privacy noise source of a task: secure, unless the task carries a seed and the site config sets
        ``allow_seeded_noise`` (whoever knows the seed can reproduce, and subtract, the noise)."""
        if task.seed is None:
            return SecureRandom()
        if not self.config.allow_seeded_noise:
            log.warning("site %s: round %d task carries seed %d; ignored (allow_seeded_noise is false), "
                        "using secure randomness", self.site_id, task.round, task.seed)
            return SecureRandom()
        digest = hashlib.sha256(f"{task.seed}/{self.site_id}/{task.round}".encode()).digest()
        return SeededRandom(int.from_bytes(digest[:8], "big"))
