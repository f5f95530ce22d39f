"""Step 1-2 of a round (docs/architecture.md, "A round"): halt what must be halted, then choose the round's sites.

:func:`select_sites` is what :meth:`coordinator.rounds.RoundManager.select` runs: for every enrolled site with a
valid key, the ledger dry-runs the next round's events of each category and halts those that would pass their
budget (or, under record-level budgets, each chosen site's cohorts are planned: :mod:`coordinator.cohorts`); sites
with a category left are eligible, optionally a seeded random subset of ``sites_per_round``.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field

from shared.iucn import IUCNCategory, parse_category

from coordinator.cohorts import plan_round
from coordinator.config import CoordinatorConfig
from coordinator.ledger import PrivacyLedger
from coordinator.registry import Site, SiteRegistry
from coordinator.storage import Store

__all__ = ["Selection", "select_sites", "uses_cohorts", "derive_seed", "known_categories"]

log = logging.getLogger("coordinator.rounds")  # a step of the round manager: logged under its name


def derive_seed(seed: int | None, round: int, label: str) -> int | None:
    """A seed for (round, label) derived from the federation seed (None stays None): first 4 bytes of
    SHA-256("seed:round:label"). Used for site sampling; never sent to gateways."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}:{round}:{label}".encode()).digest()[:4], "big")


def known_categories(site: Site, ledger: PrivacyLedger) -> set[IUCNCategory]:
    """The categories a site holds: its declared ``metadata.categories``, else those it has spent on."""
    declared = site.metadata.get("categories")
    if declared:
        return {parse_category(c, field="metadata.categories") for c in declared}
    return ledger.categories(site.site_id)


def uses_cohorts(config: CoordinatorConfig) -> bool:
    """Whether rounds train records in cohorts with record-level budgets (:mod:`coordinator.cohorts`): every
    private camera federation; radio maps (a site's survey is one record) and ``privacy: none`` do not."""
    return config.privacy != "none" and config.model != "radio_unet"


@dataclass(frozen=True)
class Selection:
    """A round's selection.

    Attributes:
        selected: the chosen site ids. halted: ``{site: halted categories}`` for every enrolled site with a valid
        key (under cohorts, for a chosen site: the categories halted in every one of its cohorts).
        cohorts: ``{site: {cohort: halted categories}}`` of the chosen sites (empty outside record-level budgets).
    """

    selected: list[str]
    halted: dict[str, frozenset[IUCNCategory]]
    cohorts: dict[str, dict[int, frozenset[IUCNCategory]]] = field(default_factory=dict)


def select_sites(config: CoordinatorConfig, store: Store, registry: SiteRegistry, ledger: PrivacyLedger,
                 round: int) -> Selection:
    """Halt what must be halted, then choose round ``round``'s sites: those with a valid key (not revoked) and a
    category that is not halted. Under record-level budgets (:func:`uses_cohorts`) the seeded subset is drawn first
    and each chosen site's cohorts are then planned (:func:`coordinator.cohorts.plan_round`, written durably); a
    category is halted at a site when it is halted in every cohort."""
    budgets = config.budgets()
    halted: dict[str, frozenset[IUCNCategory]] = {}
    eligible: list[str] = []
    # rounds whose tasks went out and whose charges can still arrive: counted as spent in the dry run. Read
    # BEFORE the ledger's history: a late charge landing in between is then counted twice (safe), never missed.
    pending = ledger.pending_rounds(before_round=round) if config.privacy != "none" else {}
    cohorts = uses_cohorts(config)
    sites = {site.site_id: site for site in registry.list()}
    for site in sites.values():
        if not registry.verification_keys(site.site_id):
            log.warning("rounds: site %s has no valid key (revoked); it is not selected", site.site_id)
            continue
        if config.privacy != "none" and not cohorts:
            halted[site.site_id] = ledger.halt_if_needed(site.site_id, budgets, round=round,
                                                         pending=len(pending.get(site.site_id, ())))
        else:
            halted[site.site_id] = frozenset()
        known = known_categories(site, ledger)
        if known and known <= halted[site.site_id]:
            log.warning("rounds: site %s has every category halted; it is no longer selected", site.site_id)
            continue
        eligible.append(site.site_id)
    k = config.sites_per_round
    if k is not None and k < len(eligible):
        rng = random.Random(derive_seed(config.seed, round, "selection"))
        eligible = sorted(rng.sample(eligible, k))
    planned: dict[str, dict[int, frozenset[IUCNCategory]]] = {}
    if cohorts:
        for site_id in list(eligible):
            plan = plan_round(store, ledger, site_id, round, budgets,
                              categories=known_categories(sites[site_id], ledger),
                              pending_rounds=pending.get(site_id, ()))
            if not plan:
                eligible.remove(site_id)
                continue
            planned[site_id] = plan
            halted[site_id] = frozenset.intersection(*plan.values())
    return Selection(selected=eligible, halted=halted, cohorts=planned)
