"""The laboratory's experiments stay apart (wildfed_sim/common/__init__.py): an experiment imports wildfed_sim.common,
the building blocks, shared, edge_sdk and coordinator, never another experiment's module, and no private name
(``from wildfed_sim.X import _y``) of any module of wildfed_sim; the building blocks and common import no
experiment. Read from the source (every import counts, lazy ones inside functions too); wildfed_sim.cli, the entry
point, is the one module that imports them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "wildfed_sim"

#: each experiment with the modules that are its own parts (a module belongs to one experiment at most)
EXPERIMENTS: dict[str, set[str]] = {
    "demo": {"demo", "demo_prep", "demo_settings", "demo_report", "demo_observers", "demo_links", "nira"},  # nira runs the live demo once per configuration and seed
    "radio": {"radiomap", "radiomap_settings", "radiomap_data", "radiomap_model", "radiomap_run", "radiomap_report",
              "radio_demo", "radio_attack", "radio_data", "radio_shadows", "radio_tiles"},
    "fedsofim": {"fedsofim", "fedsofim_head", "fedsofim_pool", "fedsofim_tuning", "fedsofim_report",
                 "fedsofim_settings"},
    "privacy_utility": {"privacy_utility", "privacy_utility_configs", "privacy_utility_report"},
    "nira_sim": {"nira_sim", "nira_sim_settings", "nira_sim_scoring", "nira_sim_structures", "nira_sim_report",
                 "nira_metadata", "nira_datasets"},
    "tune_demo": {"tune_demo"},
    "real_photos": {"real_photos_run", "real_photos", "real_photo_sites"},
    "audit": {"audit", "audit_stats", "audit_canaries", "audit_records"},
    "budget_plan": {"budget_plan"},
    "fedbuff": {"fedbuff_sim", "fedbuff_experiment"},
}
#: what every experiment may use: the building blocks (besides wildfed_sim.common)
BUILDING_BLOCKS = {"animal_mnist", "animal_species", "camtrap_writer", "detections", "ecology", "ecology_summary",
                   "site_allocation", "embedded_broker", "embeddings", "evaluation", "fleet_check",
                   "gateway_processes", "demo_sim", "link_models", "link_driver", "link_relay"}
ENTRY_POINTS = {"cli", "cli_experiments", "cli_data", "__init__"}


def _module_names() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py")}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(imported wildfed_sim module, names taken from it)`` for every import of ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("wildfed_sim")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module == "wildfed_sim":  # from wildfed_sim import x: x is a module
                out += [(f"wildfed_sim.{a.name}", []) for a in node.names]
            elif module.startswith("wildfed_sim."):
                out.append((module, [a.name for a in node.names]))
    return out


def _owner(module: str) -> str | None:
    """The experiment a top-level wildfed_sim module belongs to, or None."""
    name = module.split(".")[1] if module.count(".") >= 1 else ""
    return next((exp for exp, members in EXPERIMENTS.items() if name in members), None)


def test_every_module_is_classified():
    classified = set().union(*EXPERIMENTS.values()) | BUILDING_BLOCKS | ENTRY_POINTS
    assert _module_names() == classified, "classify new modules of wildfed_sim in this test"


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.stem not in ENTRY_POINTS or p.parent != PACKAGE)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_experiments_import_no_other_experiment_and_no_private_name(path):
    here = ".".join(("wildfed_sim",) + path.relative_to(PACKAGE).with_suffix("").parts)
    mine = _owner(here) if path.parent == PACKAGE else None
    for module, names in _imports(path):
        owner = _owner(module)
        if owner is not None and not module.startswith("wildfed_sim.common"):
            assert owner == mine, f"{here} imports {module} of experiment {owner!r}: move what it needs to " \
                                  f"wildfed_sim.common"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{here} imports private {private} from {module}: make them public in wildfed_sim.common"
