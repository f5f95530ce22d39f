"""Individualized DP-SGD's "Sample" calibration (Boenisch, Mühl, Dziedzic, Rinberg and Papernot, "Have it your
way: individualized privacy assignment for DP-SGD", NeurIPS 2023, Sec. 4.1), shared by the gateway (which samples)
and the coordinator (which, in Global DP mode, adds the one noise draw and charges the ledger): both compute the
same rates from the same public values, so what a site ran and what it is charged cannot drift apart.

One noise multiplier z for every record; the records of IUCN category c are Poisson-sampled at the largest rate
q_c <= q_max at which ``PoissonSampled(q_c, Gaussian(z))`` over the planned steps (with any fixed releases) spends
eps_c. The *anchor* is the category with the largest budget: z is calibrated so that it spends exactly its budget
at q_max.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import AccountantName, calibrated_noise_multiplier, calibrated_sampling_rate
from shared.privacy.events import DPSGDEvent

__all__ = ["anchor_category", "anchor_noise_multiplier", "individual_sampling_rates"]


def _checked(budgets: Mapping[IUCNCategory, float], categories: Iterable[IUCNCategory]) -> tuple[IUCNCategory, ...]:
    cats = tuple(sorted(set(categories), key=lambda c: c.rank))
    if not cats:
        raise PrivacyBudgetError("no active IUCN category: every category is halted, the site stops training")
    for c in cats:
        if c not in budgets:
            raise PrivacyBudgetError(
                f"the task gives no epsilon budget for active category {c.value}; refusing to train it "
                "(the coordinator must send a budget for every category of the site, or halt it)")
    return cats


def anchor_category(budgets: Mapping[IUCNCategory, float], categories: Iterable[IUCNCategory]) -> IUCNCategory:
    """The active category with the largest budget (ties: the higher IUCN rank). A public choice.

    Raises:
        PrivacyBudgetError: no category, or a category without a budget.
    """
    return max(_checked(budgets, categories), key=lambda c: (float(budgets[c]), c.rank))


def anchor_noise_multiplier(*, budgets: Mapping[IUCNCategory, float], categories: Iterable[IUCNCategory],
                            target_delta: float, max_rate: float, steps: int,
                            fixed_events: tuple[DPSGDEvent, ...] = (), accountant: AccountantName = "rdp") -> float:
    """z such that the anchor category, sampled at ``max_rate``, spends exactly its budget over ``steps`` steps
    (with ``fixed_events``): ``calibrate_noise_multiplier(eps_anchor, delta, q_max, steps)``.

    Raises:
        PrivacyBudgetError: as :func:`anchor_category`.
        ConfigError: out-of-range values, or fixed releases that alone exceed the budget.
    """
    anchor = anchor_category(budgets, categories)
    return calibrated_noise_multiplier(float(budgets[anchor]), float(target_delta), float(max_rate), int(steps),
                                       accountant, tuple(fixed_events))


def individual_sampling_rates(*, noise_multiplier: float, budgets: Mapping[IUCNCategory, float],
                              categories: Iterable[IUCNCategory], target_delta: float, max_rate: float, steps: int,
                              fixed_events: tuple[DPSGDEvent, ...] = (),
                              accountant: AccountantName = "rdp") -> dict[IUCNCategory, float]:
    """``{c: q_c}``: per category the largest rate <= ``max_rate`` at which ``steps`` steps of
    ``PoissonSampled(q_c, Gaussian(noise_multiplier))`` (with ``fixed_events``) spend at most eps_c
    (``shared.privacy.accounting.calibrate_sampling_rate``).

    Raises:
        PrivacyBudgetError: no category, or a category without a budget.
        ConfigError: out-of-range values, or fixed releases that alone exceed a budget.
    """
    return {c: calibrated_sampling_rate(float(budgets[c]), float(target_delta), float(noise_multiplier), int(steps),
                                        float(max_rate), accountant, tuple(fixed_events))
            for c in _checked(budgets, categories)}
