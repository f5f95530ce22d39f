"""The privacy ledger's charge + halt check per round: the full recomposition against the incremental ledger, at 10,
100 and 1000 rounds of history, from one run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/ledger.py [--rounds 10,100,1000] [--varying-rounds 10,50] [--repeats 5]

One site, one IUCN category, a SQLite ledger in a temporary folder holding ``n`` rounds of history. The step timed
is what the coordinator does for a site each round: charge the round's events (``PrivacyLedger.record_round``:
the DP-SGD steps and NIRA's noisy count release) and run the next round's halt check
(``PrivacyLedger.halt_if_needed``, RDP, delta 1e-5, a budget it does not reach). Two ledgers, each on its own copy
of the same history, timed interleaved in rotating order (``_timing.interleaved``):

- ``full``: the full recomposition, the baseline: every spend and dry run reads every stored event of the (site,
  category) and composes it afresh with :func:`coordinator.ledger_streams.composed_epsilon` (a ``PrivacyLedger`` whose
  composition step is replaced by that, the rest of the code shared);
- ``incremental``: ``PrivacyLedger`` as it is: the new rows composed into its running composition, the dry run on
  a copy of it.

Two histories: ``schedule``, the same calibrated events every round (z = 1.1, q = 0.02, 50 steps, and a count release
at z = 8): coalescing keeps the full recomposition at one or two accountant evaluations, and what grows is reading,
parsing and hashing the history; ``varying``, the sampling rate changes every round (a site whose data grows,
q = 64 / N_r), so no two rounds coalesce and the full recomposition evaluates every round of the history (about
80 ms each on this machine: 1000 rounds would take minutes per step, hence the smaller ``--varying-rounds``).
Each repeat adds a round, so the history grows by ``repeats + 1`` rounds during a measurement.

Printed per history length: median and minimum seconds per step of each, the ratio full / incremental, and the
largest relative difference of the two ledgers' spend at the end (they hold the same rows); then the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import interleaved  # noqa: E402  (the script's folder; Opacus ships a top-level package "benchmarks")
from coordinator.ledger import PrivacyLedger  # noqa: E402
from coordinator.ledger_streams import composed_epsilon  # noqa: E402
from coordinator.storage import LedgerRow, Store, dumps  # noqa: E402
from shared.iucn import IUCNCategory  # noqa: E402
from shared.privacy.events import DPSGDEvent  # noqa: E402

DELTA = 1e-5
CAT = IUCNCategory.LC
SITE = "site-a"
COUNTS = DPSGDEvent(8.0, 1.0, 1)


class FullRecomposition(PrivacyLedger):
    """The baseline ledger without a running composition: every question composes the whole stored history afresh."""

    def _epsilon_with(self, site_id, category, extra, accountant, *, refresh=True):  # type: ignore[override]
        return composed_epsilon((*self.events(site_id, category), *extra), self.target_delta,
                                accountant or self.accountant)


def round_events(kind: str, r: int) -> dict[str, DPSGDEvent]:
    """``{mechanism: event}`` of round ``r`` for the history ``kind`` (module docstring)."""
    q = 0.02 if kind == "schedule" else 64.0 / (3000 + 7 * r)
    return {"dpsgd": DPSGDEvent(1.1, q, 50), "counts": COUNTS}


def make_store(folder: Path, kind: str, rounds: int) -> Store:
    """A store holding ``rounds`` rounds of history (written in one transaction: setup, not timed)."""
    store = Store(f"sqlite:///{folder / 'coordinator.db'}", folder / "data")
    with store.session() as s:
        for r in range(1, rounds + 1):
            for mech, ev in round_events(kind, r).items():
                s.add(LedgerRow(site_id=SITE, round=r, category=CAT.value, noise_multiplier=ev.noise_multiplier,
                                sampling_rate=ev.sampling_rate, steps=ev.steps, event_json=dumps(ev.to_json()),
                                mechanism=mech))
    return store


def measure(kind: str, rounds: int, repeats: int) -> tuple[dict[str, list[float]], float]:
    """Seconds per step of each ledger, and the largest relative difference of their spend afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        ledgers: dict[str, PrivacyLedger] = {}
        nxt_round: dict[str, int] = {}
        for name, cls in (("full", FullRecomposition), ("incremental", PrivacyLedger)):
            folder = Path(tmp) / name
            folder.mkdir()
            ledgers[name] = cls(make_store(folder, kind, rounds), target_delta=DELTA)
            nxt_round[name] = rounds + 1

        def step(name: str):
            def run() -> None:
                ledger, r = ledgers[name], nxt_round[name]
                for mech, ev in round_events(kind, r).items():
                    ledger.record_round(SITE, r, {CAT: ev}, mechanism=mech)
                ledger.halt_if_needed(SITE, {CAT: 1e6}, round=r + 1, pending=0)
                nxt_round[name] = r + 1
            return run

        times = interleaved({name: step(name) for name in ledgers}, repeats=repeats, warmup=1)
        spent = {name: ledger.spent(SITE, CAT) for name, ledger in ledgers.items()}
        diff = abs(spent["full"] - spent["incremental"]) / spent["full"]
        for ledger in ledgers.values():
            ledger._store.dispose()
    return {name: list(t) for name, t in times.items()}, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", default="10,100,1000", help="history lengths of the 'schedule' history")
    parser.add_argument("--varying-rounds", default="10,50", help="history lengths of the 'varying' history")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'history':>9} {'rounds':>6} | {'full median':>11} {'min':>8} | {'incr median':>11} {'min':>8} | "
          f"{'full/incr':>9} | spend rel. diff")
    for kind, spec in (("schedule", args.rounds), ("varying", args.varying_rounds)):
        for n in (int(x) for x in spec.split(",") if x):
            t, diff = measure(kind, n, args.repeats)
            full, incr = statistics.median(t["full"]), statistics.median(t["incremental"])
            print(f"{kind:>9} {n:>6} | {full:>10.4f}s {min(t['full']):>7.4f}s | {incr:>10.4f}s "
                  f"{min(t['incremental']):>7.4f}s | {full / incr:>8.2f}x | {diff:.1e}", flush=True)
    one, five, fifteen = os.getloadavg()
    print(f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
