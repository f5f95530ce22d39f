"""A round's outgoing messages wait for a public time slot, so that when they leave says nothing of the site's data.

Why. The gateway agent runs a round on one thread, and the round's cost grows with the records it touches: each
category's records are Poisson-sampled at its rate, and the CCDP step costs more with every sampled record (so does
reading the package and embedding newly verified photos). Without padding, the time from the task to the update
(or to the secure-aggregation replies of a Global DP round) is a noiseless function of the per-category record
counts, which the DP noise does not cover: anyone who sees the broker's traffic, the coordinator included, could
read them off the arrival times.

The rule. The task carries a public duration ``D`` (``TrainingTask.round_duration_s``; chosen by the coordinator
and the same for every site of a round, so that neither the value nor the sites' relative arrival times depend on
any site's data). A round accepted at ``started`` (monotonic clock) releases what it sends at the slot

    ``started + k D``, with ``k = max(1, ceil((ready - started) / D))``  (:func:`release_time`),

where ``ready`` is when its local work ended. What leaves at the slot is built there: the update is encoded,
sealed (its header carries a signing time) and put into the outbox at that moment, and a Global DP round's
secure-aggregation replies (shares, masked sum) are computed and sent then. So the release time reveals only
``k``: nothing when the work fits in ``D`` (k = 1), and when it does not, the number of whole durations it took.

Overrun (k > 1). The round is released at the next boundary, not refused: a refusal reveals the same fact
(``work > D``, seen as an update that never comes) and would drop the sites with the most records from every
round. Each overrun is logged as a warning that names the fix (a larger ``round_duration_s``) and counted in the
agent's statistics (``rounds_overran``). The slot index ``k`` is the resolution of what an overrun tells.

A busy loop. Releases run on the agent's loop thread. If the loop is busy when a slot comes (training another
round, say) and gets to the waiting messages more than :data:`RELEASE_TOLERANCE_S` after it, they move to the next
boundary, so that their lateness does not carry the other work's duration either.

Nothing here sleeps. The agent's loop asks :meth:`RoundPacer.wait_s` how long it may block on its inbox and calls
:meth:`RoundPacer.run_due` every turn, so it keeps reading ACKs, receipts and tasks while a release waits.
Held messages are in memory only: a gateway that restarts while one waits has recorded the round as trained
(``AgentContext.set_last_round``) and skips it, as after a crash during training.

What this does not pad: the task's acceptance, and a Global DP round's key advertisement, which leaves right after
acceptance, before any record is read. Data-independent refusals (a halted site, a model that does not fit) send
nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RELEASE_TOLERANCE_S", "RoundPacer", "release_time"]

log = logging.getLogger(__name__)

RELEASE_TOLERANCE_S = 1.0
"""Seconds after its slot within which a waiting release may still run; later, it moves to the next boundary."""


def release_time(started: float, ready: float, duration_s: float) -> float:
    """The slot of a round accepted at ``started`` whose work ended at ``ready``: ``started + k D``, ``k =
    max(1, ceil((ready - started) / D))`` (module docstring); ``ready`` itself when ``D`` is 0 (no padding).

    Args:
        started, ready: monotonic seconds. duration_s: ``D`` >= 0, seconds.

    Raises:
        ValueError: ``duration_s`` negative or not finite.
    """
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"round_duration_s must be a finite number >= 0, got {duration_s!r}")
    if duration_s == 0:
        return ready
    return started + max(1, math.ceil((ready - started) / duration_s)) * duration_s


@dataclass
class _Round:
    started: float
    duration_s: float
    slot: float | None = None
    waiting: deque[Callable[[], object]] = field(default_factory=deque)


class RoundPacer:
    """Holds each round's outgoing messages until its slot (module docstring).

    Args:
        clock: monotonic seconds (``time.monotonic``; tests inject one).
        tolerance_s: :data:`RELEASE_TOLERANCE_S`.
        stats: a counter to count ``rounds_padded``, ``rounds_overran`` and ``releases_late`` in (the agent's).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, tolerance_s: float = RELEASE_TOLERANCE_S,
                 stats: Counter | None = None) -> None:
        self.clock = clock
        self.tolerance_s = float(tolerance_s)
        self.stats = stats if stats is not None else Counter()
        self._rounds: dict[int, _Round] = {}

    def begin(self, round_: int, duration_s: float) -> None:
        """Start the clock of ``round_`` (its task was just accepted); ``duration_s`` 0 releases at once.
        Rounds older than ``round_`` with nothing waiting are forgotten.

        Raises:
            ValueError: ``duration_s`` negative or not finite.
        """
        release_time(0.0, 0.0, duration_s)  # validates
        for old in [r for r, st in self._rounds.items() if r < round_ and not st.waiting]:
            del self._rounds[old]
        self._rounds[round_] = _Round(started=self.clock(), duration_s=float(duration_s))

    def ready(self, round_: int) -> float | None:
        """The local work of ``round_`` has ended: fix its slot (once) and return it; None for a round not begun or
        not padded. An overrun (slot later than ``started + D``) is logged and counted."""
        st = self._rounds.get(round_)
        if st is None or st.duration_s == 0:
            return None
        if st.slot is None:
            now = self.clock()
            st.slot = release_time(st.started, now, st.duration_s)
            k = round((st.slot - st.started) / st.duration_s)
            self.stats["rounds_padded"] += 1
            if k > 1:
                self.stats["rounds_overran"] += 1
                log.warning("round %d: the local work took %.1f s, longer than round_duration_s %.1f s: released "
                            "at slot %d (%.1f s after the task), which tells observers that it took %d to %d "
                            "durations; raise round_duration_s in the coordinator config above the slowest "
                            "site's round", round_, now - st.started, st.duration_s, k, st.slot - st.started,
                            k - 1, k)
        return st.slot

    def release(self, round_: int, action: Callable[[], object]) -> bool:
        """Run ``action`` (send something of ``round_``) at the round's slot: at once when the round is not padded
        or its slot has passed with nothing waiting, else after the messages already waiting, at the slot
        (:meth:`run_due`). Fixes the slot first if :meth:`ready` was not called.

        Returns:
            True when ``action`` waits; else ``bool`` of what it returned.
        """
        st = self._rounds.get(round_)
        if st is None or st.duration_s == 0:
            return bool(action())
        slot = self.ready(round_)
        assert slot is not None
        now = self.clock()
        if not st.waiting and now >= slot:
            return bool(action())
        if not st.waiting:
            log.info("round %d: ready after %.1f s; its reply leaves at the round's public time slot in %.0f s "
                     "(round_duration_s %.0f s, docs/privacy.md \"Timing\")", round_, now - st.started, slot - now,
                     st.duration_s)
        st.waiting.append(action)
        self.run_due()
        return True

    def run_due(self) -> int:
        """Run every waiting action whose slot has come (in the order they were given); a slot missed by more than
        ``tolerance_s`` moves to the next boundary instead. Returns how many ran."""
        ran = 0
        for round_, st in list(self._rounds.items()):
            if not st.waiting or st.slot is None:
                continue
            now = self.clock()
            if now < st.slot:
                continue
            if now - st.slot > self.tolerance_s:
                late = now - st.slot
                st.slot = release_time(st.started, now, st.duration_s)
                if st.slot <= now:  # exactly on a boundary
                    st.slot += st.duration_s
                self.stats["releases_late"] += 1
                log.warning("round %d: the agent's loop reached the release %.1f s after its slot; it waits for the "
                            "next one, %.1f s after the task", round_, late, st.slot - st.started)
                continue
            while st.waiting:
                st.waiting.popleft()()
                ran += 1
        return ran

    def wait_s(self, cap_s: float) -> float:
        """Seconds the loop may block before the next waiting release is due: 0 when one is due, at most
        ``cap_s``."""
        slots = [st.slot for st in self._rounds.values() if st.waiting and st.slot is not None]
        if not slots:
            return cap_s
        return max(0.0, min(cap_s, min(slots) - self.clock()))

    def pending(self) -> bool:
        """Whether anything waits for its slot."""
        return any(st.waiting for st in self._rounds.values())
