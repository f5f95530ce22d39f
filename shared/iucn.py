"""IUCN Red List categories and the CCDP per-category privacy budgets.

CCDP (conservation-calibrated DP-SGD, docs/privacy.md "CCDP" and "Budgets") gives each IUCN category ``c`` its own
epsilon:

    eps_c = eps_max * (rank(c) / MAX_RANK) ** gamma                    (the seed's formula, "max" form)

with ranks CR 1, EN 2, VU 3, NT 4, LC 5, NE 6 (MAX_RANK = 6): the more threatened, the smaller the budget. The
seed's table has two columns that one ``eps_max`` cannot both give (gamma=1 needs eps_max = 2, gamma=2 needs
eps_max = 4); both share eps_VU = 1. So the budget is exposed in two equivalent parameterisations:

- :meth:`CCDPBudget.from_max`: ``eps_max`` (the NE budget) and ``gamma``;
- :meth:`CCDPBudget.from_anchor`: a category ``a`` pinned to ``eps_a`` and ``gamma``, i.e.
  ``eps_c = eps_a * (rank(c) / rank(a)) ** gamma``, which is the max form with
  ``eps_max = eps_a * (MAX_RANK / rank(a)) ** gamma``.

``from_anchor(VU, 1.0, gamma)`` reproduces both columns of the seed exactly (gamma=1: 0.33, 0.67, 1.00, 1.33,
1.67, 2.00; gamma=2: 0.11, 0.44, 1.00, 1.78, 2.78, 4.00). A record's category is a public attribute that decides its
budget (docs/privacy.md). DD (data deficient) and unlisted species are mapped to NE by the species table, never
silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.errors import ConfigError

__all__ = ["IUCNCategory", "MAX_RANK", "CCDPBudget", "parse_category"]


class IUCNCategory(str, Enum):
    """IUCN Red List categories used by WildFed, from most to least threatened (IUCN 2012, v3.1).

    ``CR`` critically endangered, ``EN`` endangered, ``VU`` vulnerable, ``NT`` near threatened, ``LC`` least concern,
    ``NE`` not evaluated (also used for domestic animals).
    """

    CR = "CR"
    EN = "EN"
    VU = "VU"
    NT = "NT"
    LC = "LC"
    NE = "NE"

    @property
    def rank(self) -> int:
        """CCDP rank: CR 1, EN 2, VU 3, NT 4, LC 5, NE 6."""
        return _RANKS[self]

    @property
    def is_sensitive(self) -> bool:
        """True for CR and EN: left out of public species lists by default (docs/privacy.md, "Public metadata")."""
        return self in (IUCNCategory.CR, IUCNCategory.EN)


_RANKS = {c: i + 1 for i, c in enumerate(IUCNCategory)}
MAX_RANK = len(_RANKS)


def parse_category(value: object, *, field: str = "iucn_category", source: object | None = None) -> IUCNCategory:
    """Parse a category code (case-insensitive) or raise :class:`ConfigError` naming the field and valid codes."""
    if isinstance(value, IUCNCategory):
        return value
    try:
        return IUCNCategory(str(value).strip().upper())
    except ValueError:
        raise ConfigError(f"{value!r} is not an IUCN category", source=source, field=field,
                          fix=f"use one of {', '.join(c.value for c in IUCNCategory)}") from None


@dataclass(frozen=True)
class CCDPBudget:
    """Per-category epsilon budgets of CCDP: ``eps_c = eps_max * (rank(c)/MAX_RANK) ** gamma``.

    Attributes:
        eps_max: budget of the least protected category (NE), total epsilon over the whole federation per
            record, at the federation's ``target_delta``. Must be > 0 and finite.
        gamma: steepness (>= 0); 0 gives every category ``eps_max`` (uniform DP).

    Raises:
        ConfigError: ``eps_max`` or ``gamma`` out of range.
    """

    eps_max: float
    gamma: float

    def __post_init__(self) -> None:
        if not (isinstance(self.eps_max, (int, float)) and 0 < self.eps_max < float("inf")):
            raise ConfigError(f"eps_max must be a positive finite number, got {self.eps_max!r}", field="eps_max",
                              fix="set a budget such as 2.0")
        if not (isinstance(self.gamma, (int, float)) and 0 <= self.gamma < float("inf")):
            raise ConfigError(f"gamma must be >= 0, got {self.gamma!r}", field="gamma",
                              fix="use 1 (linear in rank) or 2 (quadratic)")

    @classmethod
    def from_max(cls, eps_max: float = 2.0, gamma: float = 1.0) -> "CCDPBudget":
        """The seed's form: ``eps_max`` is the NE budget."""
        return cls(eps_max=float(eps_max), gamma=float(gamma))

    @classmethod
    def from_anchor(cls, category: IUCNCategory | str = IUCNCategory.VU, epsilon: float = 1.0,
                    gamma: float = 1.0) -> "CCDPBudget":
        """Pin ``category`` to ``epsilon``: ``eps_c = epsilon * (rank(c)/rank(category)) ** gamma``.

        The defaults are the documented CCDP setting (gamma = 1, VU = 1: NE 2.0), the same as :meth:`from_max`'s.

        Raises:
            ConfigError: unknown category or non-positive epsilon.
        """
        anchor = parse_category(category, field="anchor_category")
        if not (isinstance(epsilon, (int, float)) and 0 < epsilon < float("inf")):
            raise ConfigError(f"anchor epsilon must be a positive finite number, got {epsilon!r}",
                              field="anchor_epsilon", fix="set e.g. 1.0")
        return cls(eps_max=float(epsilon) * (MAX_RANK / anchor.rank) ** float(gamma), gamma=float(gamma))

    @classmethod
    def uniform(cls, epsilon: float) -> "CCDPBudget":
        """Every category gets ``epsilon`` (ordinary DP-SGD, for comparison runs)."""
        return cls(eps_max=float(epsilon), gamma=0.0)

    def epsilon(self, category: IUCNCategory | str) -> float:
        """Total epsilon budget of ``category`` (per record, whole federation, at the federation's delta)."""
        return self.eps_max * (parse_category(category).rank / MAX_RANK) ** self.gamma

    def table(self) -> dict[IUCNCategory, float]:
        """``{category: epsilon}`` for all six categories, most threatened first."""
        return {c: self.epsilon(c) for c in IUCNCategory}
