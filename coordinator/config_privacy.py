"""The coordinator's privacy sections: the CCDP budget (``budget:``) and secure aggregation (``secagg:``).

Parts of :class:`coordinator.config.CoordinatorConfig`; the cross-field rules (privacy mode against model,
strategy and steps) live there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from shared.config import StrictModel
from shared.iucn import CCDPBudget, IUCNCategory

__all__ = ["BudgetFromMax", "BudgetFromAnchor", "Budget", "SecAggConfig"]


class BudgetFromMax(StrictModel):
    """CCDP budget in the seed's form: ``eps_c = eps_max * (rank(c)/6) ** gamma`` (shared.iucn.CCDPBudget)."""

    kind: Literal["from_max"] = "from_max"
    eps_max: float = Field(2.0, gt=0, description="NE budget (total epsilon per record over the federation)")
    gamma: float = Field(1.0, ge=0)

    def to_budget(self) -> CCDPBudget:
        """The :class:`shared.iucn.CCDPBudget`."""
        return CCDPBudget.from_max(eps_max=self.eps_max, gamma=self.gamma)


class BudgetFromAnchor(StrictModel):
    """CCDP budget pinned at one category: ``eps_c = epsilon * (rank(c)/rank(category)) ** gamma``.

    Defaults are the documented CCDP setting (README, docs/privacy.md): VU = 1.0 with gamma = 1, i.e. CR 0.33,
    EN 0.67, VU 1.00, NT 1.33, LC 1.67, NE 2.00; ``gamma: 2`` must be asked for (NE 4.00)."""

    kind: Literal["from_anchor"] = "from_anchor"
    category: IUCNCategory = IUCNCategory.VU
    epsilon: float = Field(1.0, gt=0)
    gamma: float = Field(1.0, ge=0, description="steepness; 1 (default) is linear in rank, 2 quadratic")

    def to_budget(self) -> CCDPBudget:
        """The :class:`shared.iucn.CCDPBudget`."""
        return CCDPBudget.from_anchor(category=self.category, epsilon=self.epsilon, gamma=self.gamma)


Budget = Annotated[BudgetFromMax | BudgetFromAnchor, Field(discriminator="kind")]


class SecAggConfig(StrictModel):
    """Secure aggregation of Global DP rounds (Bonawitz et al. 2017; shared.secagg, docs/secagg.md)."""

    threshold: int | None = Field(None, ge=2, description="t: fewest surviving sites that can unmask; None -> the "
                                  "smallest majority of the round's selected sites, floor(n/2) + 1")
    modulus_bits: int = Field(32, ge=16, le=64, description="k: masks and sums live in Z_{2^k}")
    max_abs_value: float | None = Field(None, gt=0, description="B: per-coordinate box of a site's clipped gradient "
                                        "sum; None -> clipping_norm * expected_batch_size (never binding for a "
                                        "batch of at most that size)")
    stage_timeout_s: float = Field(60.0, gt=0, description="seconds each secure-aggregation stage waits for the "
                                   "sites (keys, masked updates, recovery shares); the shares stage, which waits "
                                   "for local training, uses round_deadline_s")
    colluding_sites: int = Field(1, ge=0, description="f, global_noise: distributed only: how many colluding "
                                 "participants the sites' noise must survive. Each site adds variance mu / (t - f), "
                                 "so the shares of t - f survivors carry the whole noise, and the epsilon charged "
                                 "holds against the coordinator, anyone who sees only the released models, and up "
                                 "to f colluding participants (docs/privacy.md, 'Who the guarantee holds against'). "
                                 "1 (the default): every participant knows its own share, so with f = 0 each site "
                                 "would face less noise than charged; must be below the round's threshold t")

    @model_validator(mode="after")
    def _colluders_below_threshold(self) -> "SecAggConfig":
        if self.threshold is not None and self.colluding_sites >= self.threshold:
            raise ValueError(f"colluding_sites ({self.colluding_sites}) must be below threshold ({self.threshold}): "
                             "the noise of threshold - colluding_sites survivors is what carries the guarantee")
        return self
