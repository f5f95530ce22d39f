"""What the receiving path knows about the open round, and what it makes of an update it accepts.

:class:`RoundContext` is built by the round manager (:class:`coordinator.rounds.RoundManager`, or an ingest worker
from the round row, :mod:`coordinator.inbound.workers`) and handed to
:meth:`coordinator.inbound.ingest.Ingestor.open_round`; the ingest path fills its ``accepted`` with an
:class:`Accepted` per stored update, or answers :class:`Pending` while the update's commit group is not yet durable
(:mod:`coordinator.inbound.group_commit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import UpdateReport

from coordinator.strategies.base import Strategy, update_noise_variance

__all__ = ["Accepted", "Pending", "RoundContext"]


@dataclass(frozen=True)
class Accepted:
    """An update that passed every check and is stored durably.

    Attributes:
        site_id, round, sequence: from the verified header.
        num_examples: N_k reported by the site (its public record count, every category; unchanged by halts).
        weight: the FedAvg weight used (= ``num_examples``).
        payload_sha256: name of the stored blob: the update's payload digest (``shared.envelope``, a BLAKE3 hash
            list, verified against the signature; the name is kept from format 1, when it was the SHA-256).
        events: ``{category: DPSGDEvent}`` the site ran (charged to the ledger when the round closes).
        count_events: ``{category: DPSGDEvent}`` of its noisy count release (NIRA), charged with ``events``.
        species_counts: ``{class index: noisy count}`` it released (empty when the task asked for none).
    """

    site_id: str
    round: int
    sequence: int
    num_examples: int
    weight: float
    payload_sha256: str
    events: Mapping[IUCNCategory, DPSGDEvent]
    count_events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)
    species_counts: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Pending:
    """An update that passed every check and waits for its group to become durable
    (coordinator.inbound.group_commit): its ACK and its accumulation follow the group's commit, within
    ``group_commit.max_delay_s``; it may still be refused then as a duplicate or as late (another process stored one
    first, or the round closed meanwhile).

    Attributes:
        site_id, round, sequence: from the verified header.
    """

    site_id: str
    round: int
    sequence: int


@dataclass
class RoundContext:
    """What ingest must know about the open round (built by :class:`coordinator.rounds.RoundManager`).

    Attributes:
        round: round number.
        model_hash: hash of the global model the round trains from (shared.codec.model_hash).
        template: the global weights (names, shapes, dtypes are what updates must match).
        selected: sites offered the round.
        halted: per site, the categories it must not have trained.
        budgets: total epsilon per IUCN category.
        privacy: ``"ccdp"`` or ``"none"``.
        local_steps: steps the task asked for.
        strategy: running aggregate (``begin_round`` already called).
        accepted: filled by ingest, site id -> :class:`Accepted`.
        site_hashes: per site, the hash of the model it was sent (NIRA sends each cluster its own head); a site
            not listed trains from ``model_hash``.
        bundle: the strategy's stored model that the round steps (FedAvg: the model itself; None = ``template``).
        count_noise_multiplier: the count release the tasks asked for (None: none; NIRA with noisy counts).
        num_classes: length of a count vector.
        expected_events: radio rounds: the exact events every upload must report (``coordinator.radio``); None for
            camera rounds.
        learning_rate, clipping_norm, expected_batch_size: the task's (for :meth:`noise_variance`; 0: unknown).
    """

    round: int
    model_hash: str
    template: Mapping[str, np.ndarray]
    selected: frozenset[str]
    halted: Mapping[str, frozenset[IUCNCategory]]
    budgets: Mapping[IUCNCategory, float]
    privacy: str
    local_steps: int
    strategy: Strategy
    accepted: dict[str, Accepted] = field(default_factory=dict)
    site_hashes: Mapping[str, str] = field(default_factory=dict)
    bundle: Mapping[str, np.ndarray] | None = None
    count_noise_multiplier: float | None = None
    num_classes: int | None = None
    expected_events: Mapping[IUCNCategory, DPSGDEvent] | None = None
    learning_rate: float = 0.0
    clipping_norm: float = 0.0
    expected_batch_size: int = 0

    def noise_variance(self, report: UpdateReport) -> float | None:
        """The variance per coordinate of the DP noise in ``report``'s delta
        (:func:`coordinator.strategies.base.update_noise_variance`), or None when the task's parameters are unknown."""
        if self.learning_rate <= 0 or self.clipping_norm <= 0:
            return None if report.events else 0.0
        return update_noise_variance(report.events, clipping_norm=self.clipping_norm,
                                     learning_rate=self.learning_rate, expected_batch_size=self.expected_batch_size,
                                     num_examples=int(report.num_examples), local_steps=int(report.local_steps))

    def expected_hash(self, site_id: str) -> str:
        """The model hash ``site_id``'s update must have been trained from."""
        return self.site_hashes.get(site_id, self.model_hash)
