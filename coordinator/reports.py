"""Privacy-budget reports shared by the CLI (``wildfed-coordinator budget``) and the operator's web pages: one row
per (site, IUCN category) with spend, remaining budget and rounds left, and the burn-down plot.

Spend is composed by the ledger's accountant (dp-accounting RDP or PLD, :mod:`coordinator.ledger`); the textbook
and seed formulas of :mod:`shared.privacy.comparison` appear beside it for comparison only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.iucn import IUCNCategory
from shared.privacy.accounting import AccountantName
from shared.privacy.observers import Mode, ObserverRow, observer_statement, observer_table
from shared.privacy.running import RunningComposition
from shared.privacy.comparison import (
    seed_advanced_composition_epsilon,
    textbook_formula_valid,
    textbook_gaussian_noise_multiplier,
)

from coordinator.config import CoordinatorConfig
from coordinator.cohorts import CohortState, cohort_states
from coordinator.ledger import PrivacyLedger
from coordinator.ledger_streams import cohort_of
from coordinator.registry import SiteRegistry

__all__ = ["BudgetReportRow", "ROUNDS_LEFT_CAP", "budget_report", "burn_down_figure", "burn_down_points",
           "plot_burn_down",
           "ObserverReport", "observer_mode", "observer_report"]


@dataclass(frozen=True)
class BudgetReportRow:
    """One (site, IUCN category) line of ``wildfed-coordinator budget``.

    Attributes:
        spent: epsilon of all recorded events under the chosen accountant; remaining = max(0, budget - spent).
        rounds_left: further rounds that fit the budget by exactly the halt check's dry run
            (:meth:`coordinator.ledger.PrivacyLedger.rounds_left`: every release of a round, NIRA's noisy counts
            included, after the rounds whose charges can still arrive); 0 exactly when the next halt check halts the
            category; None when the category never ran there.
        z_calibrated: noise multiplier of the site's last DP-SGD event of the category (calibrated with
            dp-accounting). q_recorded: that event's sampling rate (CCDP "sample" gives each category its own).
        eps_rdp: RDP epsilon of the same events (beside the seed's bound).
        cohorts_active, cohorts_retired: under record-level budgets (:mod:`coordinator.cohorts`), the site's cohorts
            whose records still train the category and those whose records have spent it; spent, remaining, rounds
            left and the noise are then those of the oldest cohort still training it (its records are the next to
            retire), or of the cohort that spent the most when none trains it; halted means no cohort trains it.
            None for a site without cohorts, and for a category the site never trained. cohort: the cohort the
            figures are of (its first round; 0: the records the site trained before it had cohorts), or None.
        most_spent: the largest epsilon any of the site's records has spent on the category: the largest spend of
            any of its cohorts, including those retired or halted on the category (they can have spent more than
            the oldest one still training it, up to the budget); ``spent`` itself for a site without cohorts.
        COMPARISON ONLY (shared.privacy.comparison; never used for anything): z_textbook with textbook_valid
        (False where the budget is >= 1), and eps_seed_bound, the seed's advanced-composition formula.
    """

    site_id: str
    category: IUCNCategory
    budget: float
    spent: float
    remaining: float
    rounds_left: int | None
    halted: bool
    z_calibrated: float | None
    eps_rdp: float
    eps_seed_bound: float
    z_textbook: float
    textbook_valid: bool
    q_recorded: float | None = None
    cohorts_active: int | None = None
    cohorts_retired: int | None = None
    cohort: int | None = None
    most_spent: float = 0.0


ROUNDS_LEFT_CAP = 10_000


def budget_report(cfg: CoordinatorConfig, registry: SiteRegistry, ledger: PrivacyLedger,
                  accountant: AccountantName) -> list[BudgetReportRow]:
    """The rows of ``wildfed-coordinator budget``: every enrolled site (and any site with ledger rows) x every
    IUCN category."""
    budgets = cfg.budgets()
    delta = cfg.target_delta
    sites = sorted({s.site_id for s in registry.list()} | set(ledger.sites()))
    out = []
    for site_id in sites:
        states = cohort_states(ledger, site_id)
        trained = ledger.categories(site_id)  # a category the site never trained has no cohort to report
        halted = ledger.halted(site_id)
        _, last_sets = ledger.last_round_event_sets(site_id)
        pending_rounds = ledger.pending_rounds(site_id).get(site_id, ())
        for cat in IUCNCategory:
            stream, pending, counts, spends = site_id, len(pending_rounds), (None, None), {}
            if states and cat in trained:
                spends = {c.stream: ledger.spent(c.stream, cat, accountant) for c in states}  # each cohort's, once
                stream, active = _reported_stream(states, cat, spends)
                first = cohort_of(stream)
                pending = sum(1 for p in pending_rounds if first is None or p >= first)
                counts = (active, len(states) - active)
            events = ledger.events(stream, cat)
            # the halt check's own prediction: every release of one more round (DP-SGD steps, NIRA's noisy counts)
            nxt = ledger.next_round_events(stream, cat, last_sets)
            dpsgd = ledger.events(stream, cat, mechanism="dpsgd")
            spent = spends[stream] if stream in spends else ledger.spent(stream, cat, accountant)
            stopped = cat in halted if counts[0] is None else counts[0] == 0
            out.append(BudgetReportRow(
                site_id=site_id, category=cat, budget=budgets[cat], spent=spent,
                remaining=max(0.0, budgets[cat] - spent),
                rounds_left=(0 if stopped else ledger.rounds_left(stream, cat, budgets[cat], next_event=nxt,
                                                                  pending=pending, accountant=accountant,
                                                                  cap=ROUNDS_LEFT_CAP))
                if nxt is not None else None,
                halted=stopped, z_calibrated=float(dpsgd[-1].noise_multiplier) if dpsgd else None,
                q_recorded=float(dpsgd[-1].sampling_rate) if dpsgd else None,
                eps_rdp=spent if accountant == "rdp" else ledger.spent(stream, cat, "rdp"),
                eps_seed_bound=seed_advanced_composition_epsilon(events, delta),
                z_textbook=textbook_gaussian_noise_multiplier(budgets[cat], delta),
                textbook_valid=textbook_formula_valid(budgets[cat]),
                cohorts_active=counts[0], cohorts_retired=counts[1],
                cohort=(cohort_of(stream) or 0) if counts[0] is not None else None,
                most_spent=max([spent, *spends.values()])))
    return out


def _reported_stream(states: list[CohortState], cat: IUCNCategory, spends: Mapping[str, float]) -> tuple[str, int]:
    """``(stream, active cohorts)`` for a site's row of ``cat``: the oldest cohort still training ``cat``, else the
    cohort that spent the most on it (``spends``: each cohort's stream's epsilon; BudgetReportRow)."""
    active = [c for c in states if c.retired_round is None and cat not in c.halted]
    if active:
        return active[0].stream, len(active)
    return max((c.stream for c in states), key=lambda x: spends[x]), 0


def observer_mode(cfg: CoordinatorConfig) -> Mode | None:
    """The observer semantics of the config's privacy mode (:mod:`shared.privacy.observers`): ``"ccdp"`` for noise
    the gateways add to their own uploads (``ccdp``, and ``grouped`` radio uploads), ``global_noise`` for
    ``global``, None without privacy."""
    if cfg.privacy in ("ccdp", "grouped"):
        return "ccdp"
    if cfg.privacy == "global":
        return cfg.global_noise  # type: ignore[return-value]
    return None


@dataclass(frozen=True)
class ObserverReport:
    """Who the budget table's figures hold against (``wildfed-coordinator budget``).

    Attributes:
        statement: one sentence (:func:`shared.privacy.observers.observer_statement`).
        threshold: t assumed for the rows (distributed noise; None otherwise). rows: per observer the epsilon it
            faces for the spend so far, per category, of the site that spent the most in that category (empty
            without distributed noise, where every observer faces the printed figure or, for the trusted server's
            coordinator, no guarantee: the statement says which).
    """

    statement: str
    threshold: int | None
    rows: tuple[ObserverRow, ...]


def observer_report(cfg: CoordinatorConfig, registry: SiteRegistry, ledger: PrivacyLedger,
                    accountant: AccountantName) -> ObserverReport | None:
    """The observers of the config's privacy mode and, under distributed noise, the epsilon each faces for the
    ledger's spend (:func:`shared.privacy.observers.observer_table` on the recorded events; the config's
    ``secagg.colluding_sites``, and its threshold or else the smallest majority of the sites a round selects, as
    :func:`coordinator.global_dp.secagg_settings` picks it). None without privacy.

    Raises:
        dp_accounting.UnsupportedEventError: the accountant cannot interpret a recorded event.
    """
    mode = observer_mode(cfg)
    if mode is None:
        return None
    if mode != "distributed":
        return ObserverReport(statement=observer_statement(mode), threshold=None, rows=())
    f = cfg.secagg.colluding_sites
    n = len(registry.list())
    if cfg.sites_per_round is not None:
        n = min(n, cfg.sites_per_round)
    t = cfg.secagg.threshold if cfg.secagg.threshold is not None else n // 2 + 1
    t = max(min(t, max(n, 2)), f + 1)
    statement = observer_statement(mode, f, t)
    charged = {}
    for cat in IUCNCategory:
        spends = {site: ledger.spent(site, cat, accountant) for site in ledger.sites()}
        worst = max(spends, key=lambda site: spends[site], default=None)
        if worst is not None and spends[worst] > 0:
            charged[cat] = ledger.events(worst, cat)
    rows = observer_table(mode=mode, charged=charged, target_delta=cfg.target_delta, threshold=t,
                          colluding_sites=f, accountant=accountant)
    return ObserverReport(statement=statement, threshold=t, rows=tuple(rows))


def burn_down_figure(cfg: CoordinatorConfig, ledger: PrivacyLedger, accountant: AccountantName) -> Any:
    """A matplotlib figure of the privacy burn-down: per IUCN category (one panel each), each site's largest spend
    of any record after each round (:func:`burn_down_points`, composed by ``accountant`` at the config's delta),
    with the category's budget as a dashed line. The caller saves and closes it.

    Each stream is composed round by round by one running composition: O(rounds) accountant work, not O(rounds^2)
    for the prefixes; each point equals the composition of that prefix afresh (``coordinator.ledger_streams.
    composed_epsilon``) to floating-point rounding.

    Raises:
        dp_accounting.UnsupportedEventError: the accountant cannot interpret a recorded event.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = cfg.budgets()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    sites = ledger.sites()
    palette = plt.get_cmap("tab20" if len(sites) > 10 else "tab10")
    colour = {s: palette(i % palette.N) for i, s in enumerate(sites)}  # one colour per site in every panel
    for ax, cat in zip(axes.flat, IUCNCategory):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        for site_id in sites:
            points = burn_down_points(ledger, site_id, cat, cfg.target_delta, accountant)
            if not points:
                continue
            ax.plot(list(points), list(points.values()), marker="o", markersize=3, label=site_id,
                    color=colour[site_id])
        ax.axhline(budgets[cat], color="red", linestyle="--", label=f"budget {budgets[cat]:.2f}")
        ax.set_title(f"{cat.value}")
        ax.set_ylabel("epsilon spent")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) <= 10:
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    fig.suptitle(f"{cfg.federation_id}: privacy burn-down ({accountant}, delta={cfg.target_delta:g})")
    fig.tight_layout()
    return fig


def burn_down_points(ledger: PrivacyLedger, site_id: str, category: IUCNCategory, target_delta: float,
                     accountant: AccountantName) -> dict[int, float]:
    """``{round: epsilon}``: after each round in which the site was charged for ``category``, the largest spend of
    any of its records then, i.e. the largest over its ledger streams (its own and its cohorts') of that stream's
    composition up to that round. A site without cohorts: its one stream's running spend. Each stream is composed
    once, round by round (:class:`shared.privacy.running.RunningComposition`).

    Raises:
        dp_accounting.UnsupportedEventError: the accountant cannot interpret a recorded event.
    """
    out: dict[int, float] = {}
    for stream in ledger.site_streams(site_id) or [site_id]:
        running = RunningComposition(target_delta=target_delta, accountant=accountant)
        by_round: dict[int, list] = {}
        for r, event in ledger.round_events(stream, category):
            by_round.setdefault(r, []).append(event)
        for r in sorted(by_round):
            running.compose(tuple(by_round[r]))
            out[r] = max(out.get(r, 0.0), running.epsilon())
    return dict(sorted(out.items()))


def plot_burn_down(cfg: CoordinatorConfig, ledger: PrivacyLedger, accountant: AccountantName, path: Path) -> Path:
    """Write :func:`burn_down_figure` to ``path`` (PNG, or the format its suffix names) and return the path."""
    import matplotlib.pyplot as plt

    fig = burn_down_figure(cfg, ledger, accountant)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
