"""Ledger streams and the composition arithmetic the privacy ledger (:mod:`coordinator.ledger`) is built on.

A ledger stream is one event history: a site's (``"<site>"``) or one cohort of its records under record-level budgets
(``"<site>@c<round>"``, :mod:`coordinator.cohorts`). Repeating a round's events ``k`` times is exact by the
definition of self-composition (:func:`repeat_rounds`); :func:`composed_epsilon` is the whole history composed afresh,
the reference the ledger's running compositions equal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

from shared.errors import PrivacyBudgetError
from shared.privacy.accounting import AccountantName, epsilon_spent
from shared.privacy.events import DPSGDEvent, PrivacyEvent
from shared.privacy.running import coalesce

__all__ = ["COHORT_MARK", "stream_id", "base_site", "cohort_of", "repeat_rounds", "UNCHARGEABLE_PRIVACY",
           "composed_epsilon", "check_budget", "mechanism_steps"]

#: What separates a site id from its cohort in a ledger stream id (site ids never hold ``@``).
COHORT_MARK = "@c"


def stream_id(site_id: str, cohort: int | None) -> str:
    """The ledger stream of a site's cohort: ``"<site>@c<cohort>"``; ``site_id`` itself for ``None`` (sites and
    rounds without cohorts: radio uploads) and for cohort 0, the records a site trained before it had cohorts (their
    spend is on the site's own stream)."""
    return site_id if not cohort else f"{site_id}{COHORT_MARK}{int(cohort)}"


def base_site(stream: str) -> str:
    """The site a ledger stream belongs to."""
    return stream.split(COHORT_MARK, 1)[0]


def cohort_of(stream: str) -> int | None:
    """The cohort (its first round) of a ledger stream; None for a site's own stream."""
    return int(stream.rsplit(COHORT_MARK, 1)[1]) if COHORT_MARK in stream else None



def repeat_rounds(per_round: Sequence[DPSGDEvent], k: int) -> tuple[DPSGDEvent, ...]:
    """``k`` rounds of ``per_round`` (one round's events, every mechanism) as ``len(per_round)`` events with ``k``
    times the steps: exact, by the definition of self-composition. ``k = 0`` gives ``()``."""
    if k <= 0:
        return ()
    return tuple(e.with_steps(e.steps * k) for e in per_round)


# Round privacy modes whose updates are never charged after the round (no late charge can arrive): Global DP charges
# the survivors before unmasking and drops its secure-aggregation state with the round; "none" charges nothing.
UNCHARGEABLE_PRIVACY = frozenset({"global", "none"})


@functools.lru_cache(maxsize=4096)
def composed_epsilon(events: tuple[DPSGDEvent, ...], target_delta: float, accountant: AccountantName) -> float:
    """Epsilon of the composition of ``events`` (after :func:`coalesce`) at ``target_delta``; pure, memoised.

    The whole history composed afresh: the reference the ledger's running compositions equal, and what it falls
    back to for a replay whose stored events differ from the ones checked (:meth:`PrivacyLedger.round_would_exceed`).

    Raises:
        dp_accounting.UnsupportedEventError: the accountant cannot interpret an event.
    """
    return epsilon_spent(list(coalesce(events)), target_delta=target_delta, accountant=accountant)


def check_budget(budget: float) -> None:
    """Raises PrivacyBudgetError: ``budget`` is not a positive finite epsilon."""
    if not (budget > 0 and math.isfinite(budget)):
        raise PrivacyBudgetError(f"budget must be a positive finite epsilon, got {budget!r}")


def mechanism_steps(events: Iterable[PrivacyEvent]) -> dict[tuple, int]:
    """``{mechanism key: steps}`` of the events with steps: equal for two event lists that compose the same."""
    return {e.mechanism_key(): int(e.steps) for e in coalesce(e for e in events if e.steps > 0)}
