"""What one round came to (:class:`RoundResult`): returned by the round manager (:mod:`coordinator.rounds`) and the
Global DP round driver (:mod:`coordinator.global_round`), printed by ``run`` and the service."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.iucn import IUCNCategory

__all__ = ["RoundResult"]


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one round.

    Attributes:
        round: number. status: ``closed`` (new model) / ``failed`` (no quorum) / ``skipped`` (no site selectable).
        selected: sites offered the round. accepted: sites whose update was aggregated (or charged, if failed).
        model_hash: the global model after the round. duration_s: wall time, seconds, from the round's start (the
        halt check) to its close. open_s: seconds from the round's start until its last task was published (0.0
        where no task went out): the part of the gap between rounds that the round's opening takes.
        halted: per site, halted categories at the start of the round.
        stale: buffered rounds: the stale updates the round folded, as ``"<site>@r<round trained for>"``.
    """

    round: int
    status: str
    selected: tuple[str, ...]
    accepted: tuple[str, ...]
    model_hash: str
    duration_s: float
    halted: Mapping[str, tuple[IUCNCategory, ...]] = field(default_factory=dict)
    open_s: float = 0.0
    stale: tuple[str, ...] = ()
