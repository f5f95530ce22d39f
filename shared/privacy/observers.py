"""Who a printed epsilon holds against: the epsilon each observer of a federation faces, per IUCN category, in each
privacy mode (docs/privacy.md, "Who the guarantee holds against").

A record's guarantee is a statement about what an observer sees. The observers named here:

- **the coordinator**: it sees what the sites send (CCDP: each site's noised update; Global DP: only the sum that
  secure aggregation opens, over at least t sites) and everything it releases;
- **a non-participant**: anyone who sees only the released models;
- **k colluding participants**: sites of the round (not the record's own) that pool what they know. They see the
  released models, and each knows its own contribution, its own noise among them;
- the record's own site is never an observer of its own records.

What each faces, by mode (``mode``):

- ``"ccdp"`` (local DP): every site adds its own noise to its own update, and no one else knows it, so the charged
  epsilon holds against every observer: the coordinator and any coalition of participants included.
- ``"trusted-server"`` (Global DP, the coordinator adds one Gaussian draw to the opened sum): the charged epsilon
  holds against non-participants and any coalition of participants without the coordinator (the draw is the
  coordinator's); the
  coordinator sees the unnoised sum, so against it there is no DP guarantee at all (infinite epsilon; it is kept
  from single sites' sums by secure aggregation only).
- ``"distributed"`` (Global DP, each site adds a Skellam share of variance ``mu / (t - f)``;
  :mod:`shared.privacy.distributed`): the sum the coordinator opens holds at least t shares. Observers who know
  k shares face the variance of the others: with exactly t survivors (the fewest that open a round, so the worst
  case) ``max(t - k, 1) mu / (t - f)``; at least one share (the record's own site's) is always unknown to them.
  The coordinator and non-participants know none (``t mu / (t - f)``); a participant knows its own (k = 1); f
  colluding participants leave exactly ``mu``, the charged figure; f + 1 or more leave less, down to one site's
  share ``mu / (t - f)`` once t - 1 or more collude (with or without the coordinator: secure aggregation shows a
  coordinator with fewer than t sites only the sum of the others). Only the Skellam releases of the history are rescaled (a DP-SGD release of a local
  round is already the charge against everyone).

Every epsilon is composed by :func:`shared.privacy.accounting.epsilon_spent` (dp-accounting; the Skellam bound of
:mod:`shared.privacy.skellam`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import AccountantName, epsilon_spent
from shared.privacy.events import PrivacyEvent, SkellamEvent

__all__ = ["Mode", "MODES", "ObserverRow", "observer_table", "observer_statement", "markdown_table"]

Mode = Literal["ccdp", "trusted-server", "distributed"]
MODES: tuple[Mode, ...] = ("ccdp", "trusted-server", "distributed")


@dataclass(frozen=True)
class ObserverRow:
    """One observer's line of :func:`observer_table`.

    Attributes:
        observer: who it is (e.g. ``"one participant"``). colluders: k, the participants pooling what they know (0
            for the coordinator and non-participants; None: any number). sees: what it sees, in words.
        noise_fraction: the fraction of the charged noise variance left to it (distributed noise; 1.0 in the other
            modes where a guarantee holds, 0.0 where none does).
        epsilon: ``{category: epsilon}`` it faces (``math.inf``: no DP guarantee against it).
        charged: True where the charged (printed) epsilon holds against it, i.e. it faces at most that.
    """

    observer: str
    colluders: int | None
    sees: str
    noise_fraction: float
    epsilon: dict[IUCNCategory, float]
    charged: bool


def _check(mode: str, threshold: int | None, colluding_sites: int) -> tuple[int, int]:
    if mode not in MODES:
        raise ConfigError(f"unknown privacy mode {mode!r}", field="mode", fix=f"use one of {', '.join(MODES)}")
    if mode != "distributed":
        return 0, 0
    if type(threshold) is not int or threshold < 1:
        raise ConfigError(f"distributed noise needs the secure-aggregation threshold t >= 1, got {threshold!r}",
                          field="secagg.threshold", fix="give the round's threshold t")
    if type(colluding_sites) is not int or not 0 <= colluding_sites < threshold:
        raise ConfigError(f"colluding_sites must be from 0 to t - 1 = {threshold - 1}, got {colluding_sites!r}",
                          field="secagg.colluding_sites", fix=f"use at most {threshold - 1}")
    return threshold, colluding_sites


def _observers(mode: Mode, t: int, f: int) -> list[tuple[str, int | None, str]]:
    """``(name, k, what it sees)`` of every observer the table lists for ``mode``."""
    rows = [("coordinator", 0, "each site's noised update" if mode == "ccdp" else
             "the sum secure aggregation opens (at least t sites)" + (", unnoised" if mode == "trusted-server"
                                                                       else ", with the sites' noise")),
            ("non-participant", 0, "the released models only"),
            ("one participant", 1, "the released models and its own contribution")]
    if mode != "distributed":
        return rows + [("any number of colluding participants", None, "the released models and their contributions")]
    if f > 1:
        rows.append((f"{f} colluding participants (f)", f, "the released models and their f shares"))
    if f + 1 > 1:
        rows.append((f"{f + 1} colluding participants (f + 1)", f + 1, "the released models and their shares"))
    if t - 1 > max(f + 1, 1):
        rows.append((f"{t - 1} or more colluding participants (t - 1), with or without the coordinator", t - 1,
                     "all shares but one: the last honest site's sum carries its own share only"))
    return rows


def _scaled(events: Sequence[PrivacyEvent], factor: float) -> list[PrivacyEvent]:
    return [SkellamEvent(e.variance * factor, e.l2_sensitivity, e.l1_sensitivity, e.steps)
            if isinstance(e, SkellamEvent) else e for e in events]


def observer_table(*, mode: Mode, charged: Mapping[IUCNCategory, Sequence[PrivacyEvent]], target_delta: float,
                   threshold: int | None = None, colluding_sites: int = 0,
                   accountant: AccountantName = "rdp") -> list[ObserverRow]:
    """The epsilon each observer faces (module docstring), per category, for the releases ``charged``.

    Args:
        mode: ``"ccdp"``, ``"trusted-server"`` or ``"distributed"``.
        charged: ``{category: events}``: what the ledger charges (or plans to charge) a site for the category, e.g.
            its recorded history or the planned rounds' events. Skellam events carry the variance mu the shares of
            t - f survivors give.
        target_delta: delta of every epsilon. threshold: t (distributed only). colluding_sites: f, 0 <= f < t
            (distributed only). accountant: ``"rdp"`` (Skellam events need it) or ``"pld"``.

    Returns:
        Rows: the coordinator, a non-participant, one participant, then (distributed) f, f + 1 and t - 1 or more
        colluding participants where they differ from the rows above, or (other modes) any number of colluding
        participants.

    Raises:
        ConfigError: unknown mode, or t / f out of range for distributed noise.
        dp_accounting.UnsupportedEventError: the accountant cannot interpret an event (never skipped).
    """
    t, f = _check(mode, threshold, colluding_sites)
    rows = []
    for name, k, sees in _observers(mode, t, f):
        if mode == "trusted-server" and name == "coordinator":
            fraction = 0.0
        elif mode == "distributed":
            fraction = max(t - int(k or 0), 1) / (t - f)
        else:
            fraction = 1.0
        eps = {c: (math.inf if fraction == 0.0 else
                   epsilon_spent(_scaled(evs, fraction), target_delta=target_delta, accountant=accountant))
               for c, evs in charged.items()}
        rows.append(ObserverRow(observer=name, colluders=k, sees=sees, noise_fraction=fraction, epsilon=eps,
                                charged=fraction >= 1.0))
    return rows


def observer_statement(mode: Mode, colluding_sites: int = 0, threshold: int | None = None) -> str:
    """One sentence naming the observers the charged (printed) epsilon holds against, for the CLI and reports
    (``colluding_sites`` f and, when known, ``threshold`` t: distributed noise only).

    Raises:
        ConfigError: unknown mode.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown privacy mode {mode!r}", field="mode", fix=f"use one of {', '.join(MODES)}")
    if mode == "ccdp":
        return ("local DP (CCDP, or a radio site's grouped noise): every site noises its own uploads, so these "
                "figures hold against everyone but the record's own site: the coordinator, anyone who sees the "
                "released models, and any coalition of participants")
    if mode == "trusted-server":
        return ("Global DP, trusted server: these figures hold against anyone who sees only the released models, "
                "participants and their coalitions included; the coordinator sees the unnoised sum, so NO DP "
                "guarantee holds against it (nor against participants colluding with it)")
    if threshold is not None and threshold - colluding_sites == 1:
        return (f"Global DP, distributed noise (colluding_sites f = {colluding_sites}, threshold t = {threshold}): "
                "every site's share carries the whole noise, so these figures hold against the coordinator, anyone "
                "who sees only the released models, and any coalition of participants")
    who = ("one participant (its own share is covered)" if colluding_sites == 1 else
           f"up to {colluding_sites} colluding participants" if colluding_sites else
           "no participant: a participant knows its own share and faces more")
    return (f"Global DP, distributed noise (colluding_sites f = {colluding_sites}): these figures hold against the "
            f"coordinator, anyone who sees only the released models, and {who}; {colluding_sites + 1} or more "
            "colluding participants face more (docs/privacy.md, 'Who the guarantee holds against')")


def markdown_table(rows: Sequence[ObserverRow], categories: Sequence[IUCNCategory]) -> str:
    """``rows`` as a Markdown table: observer, what it sees, the noise variance left to it, whether it faces at most
    the charge, then epsilon per category (3 decimals, "no guarantee" for infinity), one line each."""
    head = "| observer | sees | noise variance left | within the charge | " + " | ".join(c.value for c in categories)
    lines = [head + " |", "|" + "---|" * (4 + len(categories))]
    for r in rows:
        cells = ["no guarantee" if math.isinf(r.epsilon[c]) else f"{r.epsilon[c]:.3f}" for c in categories]
        noise = "none" if r.noise_fraction == 0.0 else f"{r.noise_fraction:.3g} x charged"
        lines.append(f"| {r.observer} | {r.sees} | {noise} | {'yes' if r.charged else 'NO'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)
