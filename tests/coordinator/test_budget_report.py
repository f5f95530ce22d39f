"""``wildfed-coordinator budget`` and ``status``: rounds left by dry-run composition (checked against dp-accounting
composed directly and against the halting loop), the comparison columns, --accountant, --plot, and halt reasons."""

from __future__ import annotations


import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from typer.testing import CliRunner

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.privacy.comparison import seed_advanced_composition_epsilon, textbook_gaussian_noise_multiplier
from shared.privacy.events import DPSGDEvent

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.reports import budget_report
from coordinator.storage import Store

DELTA = 1e-5
LC, CR, VU = IUCNCategory.LC, IUCNCategory.CR, IUCNCategory.VU
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
runner = CliRunner()


def direct_epsilon(params, accountant: str = "rdp") -> float:
    """Compose (z, q, steps) triples with dp-accounting directly (no WildFed code)."""
    acc = (rdp.RdpAccountant(neighboring_relation=ADD_REMOVE) if accountant == "rdp"
           else pld.PLDAccountant(neighboring_relation=ADD_REMOVE))
    for z, q, t in params:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t))
    return acc.get_epsilon(DELTA)


def brute_rounds_left(history, nxt, budget, accountant="rdp", limit=200) -> int:
    """Largest k <= limit with history + k rounds of nxt within budget, trying k = 1, 2, ... (k rounds of one event
    are one SelfComposed event of k times its steps, the definition of self-composition)."""
    k = 0
    z, q, t = nxt
    while k < limit and direct_epsilon(history + [(z, q, t * (k + 1))], accountant) <= budget:
        k += 1
    return k


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "data")
    yield s
    s.dispose()


def test_rounds_left_equals_what_the_halting_loop_then_allows(store):
    # Prepare: a budget that fits exactly 7 rounds of the event (computed directly)
    ledger = PrivacyLedger(store, target_delta=DELTA)
    p = (1.0, 0.05, 20)
    budget = (direct_epsilon([p] * 7) + direct_epsilon([p] * 8)) / 2
    assert ledger.rounds_left("s1", LC, budget) is None  # never ran: no rate to extrapolate
    ledger.record_round("s1", 1, {LC: DPSGDEvent(*p)})
    predicted = [ledger.rounds_left("s1", LC, budget)]
    # Execute: the halting loop of the round manager, round after round
    trained = 1
    for r in range(2, 20):
        if LC in ledger.halt_if_needed("s1", {LC: budget}, round=r):
            break
        ledger.record_round("s1", r, {LC: DPSGDEvent(*p)})
        trained += 1
        predicted.append(ledger.rounds_left("s1", LC, budget))
    # Assert: after round r the prediction was exactly the rounds that still ran; halted -> 0
    assert trained == 7
    assert predicted == [6, 5, 4, 3, 2, 1, 0]
    assert ledger.rounds_left("s1", LC, budget) == 0


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_rounds_left_with_mixed_history_matches_direct_composition(store, accountant):
    ledger = PrivacyLedger(store, target_delta=DELTA)
    history = [(1.1, 0.02, 10), (1.3, 0.03, 12), (0.9, 0.02, 10)]
    for r, e in enumerate(history, start=1):
        ledger.record_round("s1", r, {CR: DPSGDEvent(*e)})
    nxt = history[-1]  # the site's last round's event
    # a budget half-way between 5 and 6 more rounds, composed directly
    def more(k: int) -> list:  # k rounds of the next event: one self-composition of k times its steps
        return history + [(nxt[0], nxt[1], nxt[2] * k)]

    budget = (direct_epsilon(more(5), accountant) + direct_epsilon(more(6), accountant)) / 2
    assert ledger.rounds_left("s1", CR, budget, accountant=accountant) == 5
    # an explicit next event (a different rate) is honoured too
    other = (2.0, 0.02, 10)
    budget = (direct_epsilon(history + [other] * 12) + direct_epsilon(history + [other] * 13)) / 2
    assert ledger.rounds_left("s1", CR, budget, next_event=DPSGDEvent(*other), accountant="rdp") == 12


def test_rounds_left_uses_the_last_round_and_caps(store):
    ledger = PrivacyLedger(store, target_delta=DELTA)
    ledger.record_round("s1", 1, {LC: DPSGDEvent(1.0, 0.05, 20)})
    ledger.record_round("s1", 2, {LC: DPSGDEvent(3.0, 0.01, 5)})  # the current rate is the last round's
    budget = 1.5
    assert ledger.rounds_left("s1", LC, budget) == brute_rounds_left([(1.0, 0.05, 20), (3.0, 0.01, 5)],
                                                                     (3.0, 0.01, 5), budget, limit=10_000)
    assert ledger.rounds_left("s1", LC, 1000.0, cap=50) == 50  # "at least the cap"
    assert ledger.rounds_left("s1", LC, direct_epsilon([(1.0, 0.05, 20), (3.0, 0.01, 5)]) * 1.0000001) == 0


def _fed(tmp_path, **cfg_extra):
    d = tmp_path / "coord"
    assert runner.invoke(app, ["init", str(d), "--federation-id", "bfed"]).exit_code == 0
    cfg_path = d / "coordinator.yaml"
    if cfg_extra:
        import yaml
        data = yaml.safe_load(cfg_path.read_text())
        data.update(cfg_extra)
        cfg_path.write_text(yaml.safe_dump(data))
    cfg = load_config(cfg_path)
    store = Store(cfg.database_url, cfg.data_dir)
    reg = SiteRegistry(store)
    for sid in ("ridge", "river"):
        reg.enrol(sid, public_key_to_pem(generate_signing_key().public_key()), {"capacity": 400})
    return cfg_path, cfg, store


def test_budget_command_prints_every_column(tmp_path):
    # Prepare: ridge spent 3 rounds on CR and LC; river spent past its CR budget and was halted
    cfg_path, cfg, store = _fed(tmp_path)
    budgets = cfg.budgets()
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    cr, lc = (4.0, 0.05, 20), (1.5, 0.05, 20)
    for r in (1, 2, 3):
        ledger.record_round("ridge", r, {CR: DPSGDEvent(*cr), LC: DPSGDEvent(*lc)})
    ledger.record_round("river", 1, {CR: DPSGDEvent(0.8, 0.2, 20)})
    ledger.halt_if_needed("river", budgets, round=2)
    store.dispose()
    # Execute
    out = runner.invoke(app, ["budget", "--config", str(cfg_path)], env={"COLUMNS": "220"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()

    def line(title_part: str, site: str, cat: str, after: int = 0) -> str:
        start = next(i for i, ln in enumerate(lines) if title_part in ln)
        return next(ln for ln in lines[start:] if f" {site} " in ln and f" {cat} " in ln)

    # Assert: budget table (budget, spent, remaining, rounds left) against dp-accounting directly
    lc_spent = direct_epsilon([lc] * 3)
    row = line("privacy budget", "ridge", "LC")
    for value in (f"{budgets[LC]:.4f}", f"{lc_spent:.4f}", f"{budgets[LC] - lc_spent:.4f}",
                  f" {brute_rounds_left([lc] * 3, lc, budgets[LC])} "):
        assert value in row, (value, row)
    assert " - " in line("privacy budget", "ridge", "EN")  # never ran: no rate
    river = line("privacy budget", "river", "CR")
    assert "yes" in river and " 0 " in river
    # comparison table: RDP, seed's bound, calibrated z, textbook z (labelled invalid where eps >= 1)
    assert "for comparison only" in out.output and "seed's loose bound" in out.output
    lc_cmp = line("for comparison only", "ridge", "LC")
    seed = seed_advanced_composition_epsilon([DPSGDEvent(*lc)] * 3, cfg.target_delta)
    for value in (f"{lc_spent:.4f}", f"{seed:.4f}", "1.500",
                  f"{textbook_gaussian_noise_multiplier(budgets[LC], cfg.target_delta):.3f} invalid (eps >= 1)"):
        assert value in lc_cmp, (value, lc_cmp)
    cr_cmp = line("for comparison only", "ridge", "CR")
    assert f"{textbook_gaussian_noise_multiplier(budgets[CR], cfg.target_delta):.3f}" in cr_cmp
    assert "invalid" not in cr_cmp  # CR's budget 1/3 < 1: the textbook formula applies (for one release)


def test_budget_accountant_option_and_plot(tmp_path):
    cfg_path, cfg, store = _fed(tmp_path)
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    ev = (1.5, 0.05, 20)
    for r in (1, 2):
        ledger.record_round("ridge", r, {VU: DPSGDEvent(*ev)})
    store.dispose()
    png = tmp_path / "plots" / "burn.png"
    out = runner.invoke(app, ["budget", "--config", str(cfg_path), "--accountant", "pld", "--plot", str(png)],
                        env={"COLUMNS": "220"})
    assert out.exit_code == 0, out.output
    assert "accountant=pld" in out.output and "halting uses the config's accountant (rdp)" in out.output
    vu = next(ln for ln in out.output.splitlines() if " ridge " in ln and " VU " in ln)
    assert f"{direct_epsilon([ev] * 2, 'pld'):.4f}" in vu
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = runner.invoke(app, ["budget", "--config", str(cfg_path), "--accountant", "moments"])
    assert bad.exit_code == 2 and "accountant" in bad.output


def test_budget_report_rows_cover_every_site_and_category(tmp_path):
    cfg_path, cfg, store = _fed(tmp_path)
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    ledger.record_round("ridge", 1, {VU: DPSGDEvent(1.5, 0.05, 20)})
    rows = budget_report(cfg, SiteRegistry(store), ledger, "rdp")
    store.dispose()
    assert [(r.site_id, r.category) for r in rows] == [(s, c) for s in ("ridge", "river") for c in IUCNCategory]
    vu = next(r for r in rows if r.site_id == "ridge" and r.category is VU)
    assert vu.z_calibrated == 1.5 and vu.eps_rdp == vu.spent and not vu.textbook_valid  # VU budget is 1.0
    assert all(r.rounds_left is None and r.z_calibrated is None for r in rows if r.site_id == "river")


def test_status_shows_halted_categories_and_why(tmp_path):
    cfg_path, cfg, store = _fed(tmp_path)
    ledger = PrivacyLedger(store, target_delta=cfg.target_delta)
    ledger.record_round("river", 1, {CR: DPSGDEvent(0.8, 0.2, 20), LC: DPSGDEvent(5.0, 0.01, 1)})
    ledger.halt_if_needed("river", cfg.budgets(), round=2)
    ledger.record_round("ridge", 1, {CR: DPSGDEvent(0.8, 0.2, 20)})
    ledger.halt_if_needed("ridge", cfg.budgets(), round=2)
    reason = ledger.halts("river")[0].reason
    store.dispose()
    assert [h.category for h in PrivacyLedger(Store(cfg.database_url, cfg.data_dir),
                                              target_delta=DELTA).halts("river")] == [CR]
    assert "budget" in reason and "next round" in reason and "would make it" in reason
    out = runner.invoke(app, ["status", "--config", str(cfg_path)], env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    assert "halted categories" in out.output
    river = next(ln for ln in out.output.splitlines() if " river " in ln and " CR " in ln)
    assert " 2 " in river and "would make it" in river
    # ridge's only known category is halted: it left the federation; river still trains LC
    assert "site ridge has every category halted" in out.output
    assert "site river has every category halted" not in out.output


def test_status_without_halts(tmp_path):
    cfg_path, _, store = _fed(tmp_path)
    store.dispose()
    out = runner.invoke(app, ["status", "--config", str(cfg_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "halted categories" in out.output and "(none)" in out.output


def test_budget_names_the_observers_and_what_each_faces_under_distributed_noise(tmp_path):
    from shared.privacy.events import SkellamEvent
    from shared.privacy.observers import observer_statement

    # Prepare: distributed noise, 4 enrolled sites (t = 3, the majority), f = 1; ridge spent 3 releases on CR
    cfg_path, cfg, store = _fed(tmp_path, privacy="global", local_steps=1, global_noise="distributed")
    reg = SiteRegistry(store)
    for sid in ("lake", "hill"):
        reg.enrol(sid, public_key_to_pem(generate_signing_key().public_key()), {"capacity": 400})
    ev = SkellamEvent(variance=4.0e6, l2_sensitivity=900.0, l1_sensitivity=1e5, steps=1)
    ledger = PrivacyLedger(store, target_delta=DELTA)
    for r in (1, 2, 3):
        ledger.record_round("ridge", r, {CR: ev})
    ledger.record_round("river", 1, {CR: ev})
    store.dispose()
    # Execute
    out = runner.invoke(app, ["budget", "--config", str(cfg_path)], env={"COLUMNS": "220"})
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # rich wraps the statement at the terminal width
    # Assert: the statement, and per observer ridge's CR spend (the most) at the variance it does not know:
    # max(t - k, 1) / (t - f) of mu, Thm 3.5 by hand at every integer order, converted by dp-accounting
    assert " ".join(f"observer: {observer_statement('distributed', 1, 3)}".split()) in text

    def eps(variance: float) -> float:
        a = np.arange(2, 2001, dtype=np.float64)
        r = 3 * (a * 900.0 ** 2 / (2 * variance)
                 + np.minimum(((2 * a - 1) * 900.0 ** 2 + 6e5) / (4 * variance ** 2), 3e5 / (2 * variance)))
        return float(rdp.rdp_privacy_accountant.compute_epsilon(a, r, DELTA)[0])

    lines = out.output.splitlines()
    start = next(i for i, ln in enumerate(lines) if "epsilon each observer faces" in ln)
    for name, fraction, within in (("coordinator", 1.5, "yes"), ("one participant", 1.0, "yes"),
                                   ("2 colluding participants", 0.5, "NO")):
        row = next(ln for ln in lines[start:] if name in ln)
        assert f"{fraction:.3g}x" in row and within in row, row
        printed = float(row.split("│")[-2])  # the CR column (the only category spent)
        assert printed == pytest.approx(eps(4.0e6 * fraction), abs=6e-5), row


def test_budget_names_the_rows_where_a_cohort_no_longer_training_spent_more():
    from types import SimpleNamespace

    from coordinator.cli import federation

    rows = [SimpleNamespace(site_id="s1", category=IUCNCategory.LC, spent=0.5, most_spent=0.75, budget=1.0),
            SimpleNamespace(site_id="s1", category=IUCNCategory.CR, spent=0.25, most_spent=0.25, budget=0.5)]
    with federation.console.capture() as captured:
        federation._print_retired_spend(rows)
    text = " ".join(captured.get().split())  # independent of the terminal's width
    assert "s1 LC 0.7500 (75% of 1.0000)" in text and "CR" not in text
    with federation.console.capture() as captured:
        federation._print_retired_spend(rows[1:])
    assert captured.get() == ""
