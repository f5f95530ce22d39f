"""``wildfed-coordinator budget`` agrees with the halt check, and the budget defaults agree
with the docs.

1. "rounds left" ignored NIRA's noisy-count charges (the field trial saw 100 where the halt check allowed 18). It
   now is the halt check's own dry run: every release of a round (DP-SGD steps AND the count release) and the rounds
   whose charges can still arrive. Checked through the CLI against dp-accounting composed directly (no WildFed
   code) and against the halting loop itself.
2. ``budget: {kind: from_anchor}`` without ``gamma`` gave gamma = 2 (NE 4.0) while README and docs/privacy.md give
   gamma = 1 as the default CCDP setting (NE 2.0): the code now defaults to gamma = 1; the table is worked by hand.
"""

from __future__ import annotations

import dp_accounting
import pytest
import yaml
from dp_accounting import rdp
from typer.testing import CliRunner

from shared.iucn import CCDPBudget, IUCNCategory
from shared.privacy.events import DPSGDEvent

from coordinator.cli import app
from coordinator.config import config_from_dict, load_config
from coordinator.ledger import PrivacyLedger
from coordinator.storage import RoundRow, dumps
from tests.coordinator.test_budget_report import _fed

LC = IUCNCategory.LC
DELTA = 1e-5
STEPS = DPSGDEvent(2.0, 0.02, 10)  # one round's DP-SGD steps
COUNTS = DPSGDEvent(20.0, 1.0, 1)  # one round's noisy class counts: one Gaussian release, sensitivity 1
runner = CliRunner()


def direct_epsilon(rounds_with_counts: int, rounds_steps_only: int = 0) -> float:
    """dp-accounting directly: ``rounds_with_counts`` rounds of (STEPS, then the count release as a plain Gaussian
    mechanism) plus ``rounds_steps_only`` rounds of STEPS alone."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    total_steps = (rounds_with_counts + rounds_steps_only) * STEPS.steps
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        STEPS.sampling_rate, dp_accounting.GaussianDpEvent(STEPS.noise_multiplier)), total_steps))
    if rounds_with_counts:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(COUNTS.noise_multiplier),
                                                      rounds_with_counts))
    return acc.get_epsilon(DELTA)


def brute_rounds_left(history: int, budget: float, *, counts: bool = True, limit: int = 400) -> int:
    """Largest k with ``history`` recorded rounds (steps + counts) and k more rounds within ``budget``, trying
    k = 1, 2, ...; with ``counts=False`` the k more rounds are the steps alone (what the old report assumed)."""
    k = 0
    while k < limit and (direct_epsilon(history + k + 1) if counts
                         else direct_epsilon(history, k + 1)) <= budget:
        k += 1
    return k


def rounds_left_shown(cfg_path, site: str, category: str) -> str:
    """The "rounds left" cell of ``wildfed-coordinator budget`` for (site, category) (wide terminal: no wrapping)."""
    out = runner.invoke(app, ["budget", "--config", str(cfg_path)], env={"COLUMNS": "240"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    start = next(i for i, ln in enumerate(lines) if "privacy budget" in ln)
    row = next(ln for ln in lines[start:] if f" {site} " in ln and f" {category} " in ln)
    cells = [c.strip() for c in row.replace("┃", "│").split("│") if c.strip()]
    # site, category, budget, spent, remaining, used, rounds left, halted
    return cells[6]


@pytest.mark.slow  # about 14 s
def test_rounds_left_counts_the_count_releases_exactly_as_the_halt_check(tmp_path):
    # Prepare: 'ridge' ran 3 rounds of NIRA with noisy counts (LC budget 5/3 with the default gamma = 1)
    cfg_path, cfg, store = _fed(tmp_path)
    budget = cfg.budgets()[LC]
    assert budget == pytest.approx(5 / 3)
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    for r in (1, 2, 3):
        ledger.record_round("ridge", r, {LC: STEPS})
        ledger.record_round("ridge", r, {LC: COUNTS}, mechanism="counts")
    expected = brute_rounds_left(3, budget)
    assert expected < brute_rounds_left(3, budget, counts=False)  # the counts matter (38 vs 125 here)

    # Execute + Assert 1: the CLI shows the directly composed number
    assert rounds_left_shown(cfg_path, "ridge", "LC") == str(expected)

    # Assert 2: the halting loop (the round manager's dry run) then allows exactly that many more rounds
    ran = 0
    for r in range(4, 4 + expected + 5):
        if LC in ledger.halt_if_needed("ridge", cfg.budgets(), round=r):
            break
        ledger.record_round("ridge", r, {LC: STEPS})
        ledger.record_round("ridge", r, {LC: COUNTS}, mechanism="counts")
        ran += 1
    assert ran == expected
    assert rounds_left_shown(cfg_path, "ridge", "LC") == "0"
    assert ledger.spent("ridge", LC) == pytest.approx(direct_epsilon(3 + expected), rel=1e-9)
    assert ledger.spent("ridge", LC) <= budget
    store.dispose()


def _three_charged_two_pending(store, cfg, *, status: str, max_pending: int | None = None) -> PrivacyLedger:
    """'ridge' charged for rounds 1-3 (steps and counts); rounds 4 and 5 (``status``) sent to it, not charged."""
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta, max_pending=max_pending)
    for r in (1, 2, 3):
        ledger.record_round("ridge", r, {LC: STEPS})
        ledger.record_round("ridge", r, {LC: COUNTS}, mechanism="counts")
    with store.session() as s:
        for r in (4, 5):
            s.add(RoundRow(round=r, status=status, base_model_hash="0" * 64, selected_json=dumps(["ridge"]),
                           privacy="ccdp"))
    return ledger


def test_rounds_left_counts_rounds_whose_charges_can_still_arrive(tmp_path):
    # Prepare: 3 charged rounds, then rounds 4 and 5 sent to 'ridge' whose updates have not come (yet)
    cfg_path, cfg, store = _fed(tmp_path)
    budget = cfg.budgets()[LC]
    ledger = _three_charged_two_pending(store, cfg, status="failed")
    # Assert: the two pending rounds count as spent, in the report and in the halt check alike
    expected = brute_rounds_left(3 + 2, budget)
    assert rounds_left_shown(cfg_path, "ridge", "LC") == str(expected)
    assert ledger.rounds_left("ridge", LC, budget) == expected
    assert ledger.pending_rounds("ridge") == {"ridge": (4, 5)}
    # once a late update of round 4 is charged, round 4 is no longer pending
    ledger.record_round("ridge", 4, {LC: STEPS})
    ledger.record_round("ridge", 4, {LC: COUNTS}, mechanism="counts")
    assert ledger.pending_rounds("ridge") == {"ridge": (5,)}
    assert rounds_left_shown(cfg_path, "ridge", "LC") == str(expected)  # the same total: 4 moved from pending
    store.dispose()


# CCDP gamma = 1, VU = 1 (README, docs/privacy.md): eps_c = 1.0 * rank(c) / 3, by hand
GAMMA1_TABLE = {"CR": 1 / 3, "EN": 2 / 3, "VU": 3 / 3, "NT": 4 / 3, "LC": 5 / 3, "NE": 6 / 3}


@pytest.mark.parametrize("budget", [{"kind": "from_anchor"}, {"kind": "from_anchor", "category": "VU"},
                                    {"kind": "from_anchor", "category": "VU", "epsilon": 1.0}])
def test_from_anchor_without_gamma_is_the_documented_gamma_1(budget):
    cfg = config_from_dict({"federation_id": "f", "budget": budget})
    assert {c.value: v for c, v in cfg.budgets().items()} == pytest.approx(GAMMA1_TABLE, rel=1e-12)
    assert {c.value: v for c, v in CCDPBudget.from_anchor().table().items()} == pytest.approx(GAMMA1_TABLE,
                                                                                                 rel=1e-12)
    assert CCDPBudget.from_anchor().table() == CCDPBudget.from_max().table()  # both defaults: gamma 1, NE 2.0


def test_budget_command_shows_the_gamma_1_table_for_a_bare_from_anchor(tmp_path):
    # Prepare: an init'ed federation whose config says only `budget: {kind: from_anchor}`
    cfg_path, _, store = _fed(tmp_path)
    store.dispose()
    data = yaml.safe_load(cfg_path.read_text())
    data["budget"] = {"kind": "from_anchor"}
    cfg_path.write_text(yaml.safe_dump(data))
    assert load_config(cfg_path).budget.gamma == 1.0
    # Execute
    out = runner.invoke(app, ["budget", "--config", str(cfg_path)], env={"COLUMNS": "240"})
    assert out.exit_code == 0, out.output
    # Assert: the budget column is the hand-worked gamma = 1 table (NE 2.0, not gamma = 2's 4.0)
    for cat, eps in GAMMA1_TABLE.items():
        row = next(ln for ln in out.output.splitlines() if " ridge " in ln and f" {cat} " in ln)
        assert f" {eps:.4f} " in row, (cat, row)


def test_budget_help_says_what_rounds_left_computes_without_stray_line_breaks() -> None:
    """``budget --help`` once said "rounds left at the current rate" (a linear extrapolation, which it
    is not) and broke a line mid-sentence. At 80 columns every wrapped line of a paragraph must be full: the next
    word would not have fitted on it."""
    from typer.testing import CliRunner

    from coordinator.cli import app

    result = CliRunner().invoke(app, ["budget", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.output.split("Options")[0]
    flat = " ".join(text.split())
    assert "at the current rate" not in flat
    assert "Rounds left is the halt check's own dry run repeated" in flat
    assert "not a linear extrapolation of epsilon" in flat and "NIRA's noisy counts included" in flat
    lines = [line.strip() for line in text.splitlines()]
    for line, following in zip(lines, lines[1:]):
        if line and following and not line.startswith("Usage"):
            next_word = following.split()[0]
            assert len(line) + 1 + len(next_word) > 80 - 4, f"stray line break after {line!r}"


def test_buffered_rounds_count_at_most_one_pending_round_per_site(tmp_path):
    # Prepare: as above, but a buffered federation's ledger: rounds 4 and 5 sent to 'ridge', neither charged
    cfg_path, cfg, store = _fed(tmp_path)
    budget = cfg.budgets()[LC]
    ledger = _three_charged_two_pending(store, cfg, status="closed", max_pending=1)
    # Assert: only the newest pending round counts (a buffered gateway holds at most one uncharged update)
    assert ledger.pending_rounds("ridge") == {"ridge": (5,)}
    assert ledger.rounds_left("ridge", LC, budget) == brute_rounds_left(3 + 1, budget)
    assert PrivacyLedger(store, target_delta=cfg.target_delta, max_pending=0).pending_rounds("ridge") == {}
    store.dispose()
