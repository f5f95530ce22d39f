"""The demo's observer tables (wildfed_sim.demo_observers): docs/privacy.md quotes exactly what the product computes,
and the distributed table's charge is what the coordinator's planner charges (the budgets, within 1 %)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.iucn import CCDPBudget

DOCS = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


@pytest.mark.slow
def test_docs_quote_the_computed_tables_and_the_charge_is_the_budget():
    from wildfed_sim.demo import DemoSettings
    from wildfed_sim.demo_observers import demo_observer_markdown, demo_observer_tables

    # Execute
    text = demo_observer_markdown()
    tables = demo_observer_tables()
    # Assert: the page holds the generated block verbatim (regenerate with `wildfed observers --markdown`)
    block = re.search(r"<!-- observers:begin[^\n]*-->\n(.*)\n<!-- observers:end -->", DOCS.read_text(), re.S)
    assert block is not None and block.group(1) == text
    # one participant (f = 1) faces exactly the charge, which spends each budget (within 1 %, never above)
    budgets = CCDPBudget.from_anchor("VU", 1.0, 1.0).table()
    one = next(r for r in tables["distributed"] if r.observer == "one participant")
    for c, eps in budgets.items():
        assert 0.99 * eps <= one.epsilon[c] <= eps
    assert DemoSettings(privacy="global").sites == 8


@pytest.mark.slow
def test_observers_command_prints_each_mode():
    from wildfed_sim.cli import app

    out = CliRunner().invoke(app, ["observers", "--sites", "3", "--rounds", "2"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    for mode in ("ccdp:", "trusted-server:", "distributed:"):
        assert mode in out.output
    assert "no guarantee" not in out.output and " none " in out.output  # the trusted coordinator's row
