"""The layering is checked, not hoped for (docs/architecture.md, "Layout"): the import-linter contracts of
pyproject.toml.

``shared`` at the bottom; ``edge_sdk`` and ``coordinator`` on it and apart; ``wildfed_sim`` (the laboratory) above
both. Inside the coordinator, the receiving path (``coordinator.inbound``) is below the rounds (``coordinator.rounds``),
and the web view (``coordinator.web``) imports neither. The first test runs ``lint-imports`` on this checkout, as a
developer or CI would. The others prove that the same contracts, copied verbatim from pyproject.toml, fail: on a
scratch tree of four packages with the same names (and the coordinator's three parts), each forbidden import (a lazy
one inside a function, an indirect chain) breaks exactly the contract it should, and the allowed directions keep
every contract.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("shared", "edge_sdk", "coordinator", "wildfed_sim")


def _lint(cwd: Path, *, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.is_file():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter is in the dev extra (pip install -e '.[dev]')")
    env = {**os.environ, "COLUMNS": "200"}
    if pythonpath is not None:  # ahead of the editable install's finder, which comes after the path finder
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _contracts() -> dict[str, str]:
    """``{contract id: contract name}`` as pyproject.toml declares them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    return {c["id"]: c["name"] for c in config["contracts"]}


def _contract_section() -> str:
    """The ``[tool.importlinter]`` tables of pyproject.toml, copied line for line."""
    keep, out = False, []
    for line in (ROOT / "pyproject.toml").read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            keep = line.startswith(("[tool.importlinter]", "[[tool.importlinter."))
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def _verdicts(output: str) -> dict[str, str]:
    """``{contract id: "KEPT" | "BROKEN"}`` read from lint-imports' report (whitespace ignored: it pads names)."""
    flat = re.sub(r"\s+", "", output)
    verdicts = {}
    for cid, name in _contracts().items():
        key = re.sub(r"\s+", "", name)
        verdicts[cid] = "BROKEN" if key + "BROKEN" in flat else "KEPT" if key + "KEPT" in flat else "?"
    return verdicts


def test_this_checkout_keeps_every_layering_contract():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(_verdicts(out.stdout).values()) == {"KEPT"}, out.stdout
    assert set(_contracts()) == {"gateway", "cloud", "common", "inbound", "web"}


def _scratch(tmp_path: Path, modules: dict[str, str]) -> Path:
    """Four packages named as the project's, each with one module, and the coordinator's receiving path, rounds and
    web view (the web view reads through ``coordinator.service`` here); ``modules`` gives a module's source."""
    tree = tmp_path / "tree"
    files = {"shared/codec.py": "", "edge_sdk/agent.py": "import shared.codec\n",
             "coordinator/service.py": "import shared.codec\n",
             "coordinator/inbound/__init__.py": "", "coordinator/inbound/ingest.py": "import shared.codec\n",
             "coordinator/rounds.py": "import coordinator.inbound.ingest\n",
             "coordinator/web/__init__.py": "", "coordinator/web/app.py": "import coordinator.service\n",
             "wildfed_sim/demo.py": "import coordinator.service\nimport edge_sdk.agent\nimport shared.codec\n",
             **{f"{p}/__init__.py": "" for p in PACKAGES}, **modules}
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text, encoding="utf-8")
    (tree / "pyproject.toml").write_text(_contract_section(), encoding="utf-8")
    return tree


def test_the_allowed_directions_keep_every_contract(tmp_path):
    tree = _scratch(tmp_path, {})
    out = _lint(tree, pythonpath=tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(_verdicts(out.stdout).values()) == {"KEPT"}, out.stdout
    assert "Analyzed 13 files" in out.stdout  # the scratch tree, not this checkout


LAZY = "def f():\n    import {target}\n"


@pytest.mark.parametrize(("module", "source", "chain", "broken"), [
    ("edge_sdk/agent.py", "import coordinator.service\n", "edge_sdk.agent -> coordinator.service", {"gateway"}),
    ("edge_sdk/agent.py", LAZY.format(target="wildfed_sim.demo"), "edge_sdk.agent -> wildfed_sim.demo",
     {"gateway"}),
    ("coordinator/service.py", LAZY.format(target="edge_sdk.agent"), "coordinator.service -> edge_sdk.agent",
     {"cloud"}),
    ("coordinator/service.py", "from wildfed_sim import demo\n", "coordinator.service -> wildfed_sim.demo",
     {"cloud"}),
    ("shared/codec.py", LAZY.format(target="edge_sdk"), "shared.codec -> edge_sdk", {"common", "cloud"}),
    ("shared/codec.py", "import coordinator\n", "shared.codec -> coordinator", {"common", "gateway"}),
    ("shared/codec.py", "import wildfed_sim.demo\n", "shared.codec -> wildfed_sim.demo",
     {"common", "gateway", "cloud"}),
    ("coordinator/inbound/ingest.py", LAZY.format(target="coordinator.rounds"),
     "coordinator.inbound.ingest -> coordinator.rounds", {"inbound"}),
    ("coordinator/web/app.py", "import coordinator.inbound.ingest\n",
     "coordinator.web.app -> coordinator.inbound.ingest", {"web"}),
    ("coordinator/web/app.py", "from coordinator import rounds\n", "coordinator.web.app -> coordinator.rounds",
     {"web"}),
    ("coordinator/service.py", LAZY.format(target="coordinator.inbound.ingest"),
     "coordinator.service -> coordinator.inbound.ingest", {"web"}),  # through coordinator.web.app -> service
])
def test_each_forbidden_import_breaks_its_contract(tmp_path, module, source, chain, broken):
    # shared -> X also breaks the contracts of the sides that import shared: an indirect chain is an import too
    tree = _scratch(tmp_path, {module: source})
    out = _lint(tree, pythonpath=tree)
    report = " ".join(out.stdout.split())
    assert out.returncode == 1, out.stdout + out.stderr
    verdicts = _verdicts(out.stdout)
    assert {cid for cid, v in verdicts.items() if v == "BROKEN"} == broken, out.stdout
    assert {cid for cid, v in verdicts.items() if v == "KEPT"} == set(verdicts) - broken, out.stdout
    assert chain in report, out.stdout
    assert f"Contracts: {len(verdicts) - len(broken)} kept, {len(broken)} broken." in report
