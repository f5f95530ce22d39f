"""A running composition: the spend of a growing stream of DP events, kept up to date one batch of events at a time.

The ledger (``coordinator.ledger``) charges each (site, IUCN category) a few events per round and asks for the spend,
and for dry runs of the next round, before every round. Recomposing the whole history for each question costs time
that grows with the number of rounds; a :class:`RunningComposition` composes each new event once into a dp-accounting
accountant kept in memory, and a dry run composes the candidate events into a copy of it.

Accountants (both dp-accounting's, never a hand-written one; add-or-remove-one neighbours, as
:func:`shared.privacy.accounting.make_accountant`):

- ``"rdp"``: a running ``dp_accounting.rdp.RdpAccountant`` (Mironov 2017). RDP composes by adding the RDP curves
  (Mironov 2017, Prop. 1), so composing event by event is the same composition as composing the history at once:
  the epsilon agrees with :func:`shared.privacy.accounting.epsilon_spent` of the coalesced history to floating-point
  rounding (about 1e-15 relative). A new batch costs one accountant evaluation per distinct mechanism in the batch,
  whatever the length of the history; a dry run costs the same plus a copy of an O(number of RDP orders) state.
- ``"pld"``: dp-accounting's PLD composition is not associative to that precision (its discretisation and tail
  truncation depend on the grouping: k steps composed one round at a time against the same steps composed at once
  differed by 1.2e-9 relative after 20 rounds, and the gap grows), and composing into a running PLD costs about a
  second per round at the ledger's settings (the PLD's support grows with every composition). The running state is
  therefore the coalesced history (one event per distinct mechanism, kept up to date in O(1) per event), composed
  into a fresh ``dp_accounting.pld.PLDAccountant`` when epsilon is asked (memoised): exactly today's computation,
  and constant in the number of rounds for a site whose calibrated schedule repeats its mechanisms.

Events with zero steps are left out (as :func:`shared.privacy.accounting.epsilon_spent` does); an event the
accountant does not support raises ``dp_accounting.UnsupportedEventError`` when it is composed, and leaves the
composition unchanged (it is never skipped).
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Iterable
from typing import Any

import dp_accounting

from shared.errors import ConfigError
from shared.privacy.accounting import AccountantName, _quiet_non_convergence, epsilon_spent, make_accountant
from shared.privacy.events import PrivacyEvent

__all__ = ["RunningComposition", "coalesce"]

# Dry runs remembered per composition: the halt check's, the ingest check's and the check at close usually ask for
# the very events the next charge brings, whose composition is then adopted instead of computed again.
_FORKS_KEPT = 4


def coalesce(events: Iterable[PrivacyEvent]) -> tuple[PrivacyEvent, ...]:
    """Merge events of the same per-step mechanism (``mechanism_key``: type and parameters) by adding their steps;
    order of first occurrence.

    Exact: k steps of the same mechanism then m more are k + m steps of it (the definition of self-composition,
    ``SelfComposed(e, a) o SelfComposed(e, b) = SelfComposed(e, a + b)``).
    """
    first: dict[tuple, PrivacyEvent] = {}
    steps: dict[tuple, int] = {}
    for ev in events:
        key = ev.mechanism_key()
        first.setdefault(key, ev)
        steps[key] = steps.get(key, 0) + int(ev.steps)
    return tuple(first[k].with_steps(t) for k, t in steps.items())


@functools.lru_cache(maxsize=1024)
def _fresh_epsilon(events: tuple[PrivacyEvent, ...], target_delta: float, accountant: AccountantName) -> float:
    """:func:`epsilon_spent` of ``events`` (already coalesced), memoised (the PLD path)."""
    return epsilon_spent(list(events), target_delta=target_delta, accountant=accountant)


def _dp_event(events: tuple[PrivacyEvent, ...]) -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent([e.to_dp_event() for e in events])


def _positive(events: Iterable[PrivacyEvent]) -> tuple[PrivacyEvent, ...]:
    """``events`` with at least one step, coalesced (the canonical form of a batch, and its dry-run key)."""
    return coalesce(e for e in events if e.steps > 0)


def _fork(acc: dp_accounting.PrivacyAccountant) -> dp_accounting.PrivacyAccountant:
    """An independent copy of ``acc``'s composition state.

    ``copy.deepcopy``, except that the accountant's own log of the events composed so far (a
    ``dp_accounting.DpEventBuilder``, read only by its ``ledger`` property) starts empty in the copy: copying it would
    cost O(history), and the epsilon does not depend on it. The store, not the accountant, is the record of events.
    """
    memo: dict[int, Any] = {id(v): dp_accounting.DpEventBuilder() for v in vars(acc).values()
                            if isinstance(v, dp_accounting.DpEventBuilder)}
    return copy.deepcopy(acc, memo)


class RunningComposition:
    """The composition of every event given to :meth:`compose` so far, per record under add/remove-one neighbours.

    Args:
        target_delta: delta at which epsilon is reported, in (0, 1).
        accountant: ``"rdp"`` (a running RDP accountant) or ``"pld"`` (the coalesced history, composed fresh); see
            the module docstring for why they differ.

    Raises:
        ConfigError: delta not in (0, 1), or an unknown accountant name.

    Not thread-safe: callers that share one across threads hold a lock (the ledger does).
    """

    def __init__(self, *, target_delta: float, accountant: AccountantName = "rdp") -> None:
        if not (isinstance(target_delta, (int, float)) and 0 < target_delta < 1):
            raise ConfigError(f"target_delta must be in (0, 1), got {target_delta!r}", field="target_delta",
                              fix="use a delta well below 1/N, e.g. 1e-5")
        self.target_delta = float(target_delta)
        self.accountant: AccountantName = accountant
        # RDP: the running accountant (make_accountant raises ConfigError on an unknown name, for both paths)
        acc = make_accountant(accountant)
        self._acc: dp_accounting.PrivacyAccountant | None = acc if accountant == "rdp" else None
        self._history: dict[tuple, PrivacyEvent] = {}  # the coalesced history: mechanism key -> event, all steps
        self._forks: collections.OrderedDict[tuple[PrivacyEvent, ...], dp_accounting.PrivacyAccountant] = \
            collections.OrderedDict()

    @property
    def events(self) -> tuple[PrivacyEvent, ...]:
        """The coalesced history: one event per distinct mechanism with all its steps, order of first occurrence."""
        return tuple(self._history.values())

    def compose(self, events: Iterable[PrivacyEvent]) -> None:
        """Add ``events`` to the composition (their order does not matter; zero-step events are left out).

        Cost: one accountant evaluation per distinct mechanism among ``events`` (RDP), none when a dry run of exactly
        these events was made since the last change (its composition is adopted), independent of the history.

        Raises:
            dp_accounting.UnsupportedEventError: the accountant cannot interpret one of ``events``; nothing of the
                batch is composed.
        """
        batch = _positive(events)
        if not batch:
            return
        if self._acc is not None:
            adopted = self._forks.get(batch)
            if adopted is not None:
                self._acc = adopted  # the same composition of the same events on the same state, made by the dry run
            else:
                with _quiet_non_convergence():
                    self._acc.compose(_dp_event(batch))  # checks every sub-event before changing any state
        else:
            probe = make_accountant(self.accountant)
            if not probe.supports(_dp_event(batch)):  # fail here, as the RDP path does, not at the next epsilon
                probe.compose(_dp_event(batch))  # raises UnsupportedEventError with the library's own message
        for ev in batch:
            key = ev.mechanism_key()
            old = self._history.get(key)
            self._history[key] = ev if old is None else old.with_steps(old.steps + ev.steps)
        self._forks.clear()

    def epsilon(self) -> float:
        """Epsilon of the composition at ``target_delta`` (float >= 0; 0.0 when no event with steps was composed)."""
        if not self._history:
            return 0.0
        if self._acc is None:
            return _fresh_epsilon(self.events, self.target_delta, self.accountant)
        with _quiet_non_convergence():
            return float(self._acc.get_epsilon(self.target_delta))

    def epsilon_with(self, events: Iterable[PrivacyEvent]) -> float:
        """Dry run: epsilon of the composition followed by ``events``; the composition itself is unchanged.

        RDP: ``events`` are composed into a copy of the running accountant (remembered, so that composing the same
        events next adopts it). PLD: the coalesced history and ``events`` composed fresh.

        Raises:
            dp_accounting.UnsupportedEventError: the accountant cannot interpret one of ``events``.
        """
        extra = _positive(events)
        if not extra:
            return self.epsilon()
        if self._acc is None:
            return _fresh_epsilon(coalesce((*self.events, *extra)), self.target_delta, self.accountant)
        fork = self._forks.get(extra)
        if fork is None:
            fork = _fork(self._acc)
            with _quiet_non_convergence():
                fork.compose(_dp_event(extra))
            self._forks[extra] = fork
            while len(self._forks) > _FORKS_KEPT:
                self._forks.popitem(last=False)
        else:
            self._forks.move_to_end(extra)
        with _quiet_non_convergence():
            return float(fork.get_epsilon(self.target_delta))
