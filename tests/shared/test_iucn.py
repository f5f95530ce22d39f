"""CCDP budgets: the seed's table (docs/privacy.md, "Budgets") in both columns, exactly as printed (2 decimals)."""

import pytest

from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory

CATS = [IUCNCategory.CR, IUCNCategory.EN, IUCNCategory.VU, IUCNCategory.NT, IUCNCategory.LC, IUCNCategory.NE]
SEED_GAMMA1 = [0.33, 0.67, 1.00, 1.33, 1.67, 2.00]
SEED_GAMMA2 = [0.11, 0.44, 1.00, 1.78, 2.78, 4.00]


def test_ranks():
    assert [c.rank for c in CATS] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("budget,column", [
    (CCDPBudget.from_max(eps_max=2.0, gamma=1.0), SEED_GAMMA1),
    (CCDPBudget.from_max(eps_max=4.0, gamma=2.0), SEED_GAMMA2),
    (CCDPBudget.from_anchor(IUCNCategory.VU, 1.0, gamma=1.0), SEED_GAMMA1),
    (CCDPBudget.from_anchor("vu", 1.0, gamma=2.0), SEED_GAMMA2),
])
def test_seed_table_both_columns(budget, column):
    assert [round(budget.epsilon(c), 2) for c in CATS] == column


def test_exact_values_closed_form():
    b = CCDPBudget.from_anchor(IUCNCategory.VU, 1.0, gamma=2.0)
    # eps_c = (rank/3)^2 exactly.
    for c in CATS:
        assert b.epsilon(c) == pytest.approx((c.rank / 3) ** 2, rel=1e-12)
    assert b.eps_max == pytest.approx(4.0)


def test_uniform_and_errors():
    assert set(CCDPBudget.uniform(2.0).table().values()) == {2.0}
    with pytest.raises(ConfigError, match="eps_max"):
        CCDPBudget.from_max(eps_max=0)
    with pytest.raises(ConfigError, match="gamma"):
        CCDPBudget.from_max(eps_max=1, gamma=-1)
    with pytest.raises(ConfigError, match="IUCN"):
        CCDPBudget.from_anchor("XX", 1.0)
