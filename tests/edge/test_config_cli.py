"""Site config, firmware profiles and the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import load_private_key, load_public_key

from edge_sdk.rounds.backends import build_backend
from edge_sdk.cli import app
from edge_sdk.config import load_site_config
from edge_sdk.profiles import GatewayKind, available_profiles, load_profile
from tests.gateway_backend import needs_torch

BASE = {
    "federation_id": "fed1", "site_id": "site-1", "dataset": "pkg",
    "species": [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
                {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}],
    "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
    "broker_url": "mqtt://127.0.0.1:1883", "outbox": "state/outbox.sqlite",
}


def write(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({**BASE, **changes}))
    return path


def test_site_config_resolves_paths_and_species(tmp_path: Path) -> None:
    cfg = load_site_config(write(tmp_path))
    assert cfg.dataset == (tmp_path / "pkg").resolve() and cfg.outbox.parent == (tmp_path / "state").resolve()
    assert cfg.categories == (IUCNCategory.CR, IUCNCategory.NT)
    assert cfg.species_table["Equus quagga"].class_index == 1 and cfg.model_classes == 2
    assert cfg.allow_non_private is False and cfg.allow_seeded_noise is False


def test_class_names_name_other_species_without_adding_categories(tmp_path: Path) -> None:
    names = {0: "Loxodonta cyclotis", 1: "Equus quagga", 2: "Lycaon pictus", 3: "Bos taurus"}
    cfg = load_site_config(write(tmp_path, num_classes=4, class_names=names))
    assert cfg.names_by_class == names
    assert cfg.categories == (IUCNCategory.CR, IUCNCategory.NT)  # EN (Lycaon) is not this site's: no noise for it
    assert load_site_config(write(tmp_path)).names_by_class == {0: "Loxodonta cyclotis", 1: "Equus quagga"}
    with pytest.raises(ConfigError, match="class_names\\[1\\] is 'Equus ferus'"):
        load_site_config(write(tmp_path, class_names={1: "Equus ferus"}))
    with pytest.raises(ConfigError, match="class indices"):
        load_site_config(write(tmp_path, num_classes=4, class_names={7: "Panthera leo"}))


@pytest.mark.parametrize("changes,field", [
    ({"site_id": "bad/site"}, "site_id"),
    ({"broker_url": "http://x"}, "broker_url"),
    ({"species": [{"scientific_name": "A b", "class_index": 0, "iucn_category": "XX"}]}, "species.0.iucn_category"),
    ({"species": [{"scientific_name": "A b", "class_index": 0, "iucn_category": "CR"}] * 2}, "species"),
    ({"threads": 0}, "threads"),
    ({"surprise": 1}, "surprise"),
])
def test_bad_site_config_names_file_field_and_fix(tmp_path: Path, changes: dict, field: str) -> None:
    path = write(tmp_path, **changes)
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert info.value.source == str(path) and info.value.field == field and info.value.fix


def test_profiles_cover_the_four_gateway_kinds() -> None:
    assert {load_profile(n).kind for n in available_profiles()} == set(GatewayKind)
    assert load_profile("radio-base-station").device == "cpu"
    with pytest.raises(ConfigError, match="not found"):
        load_profile("toaster")


@needs_torch  # the radio base station's profile trains with torch (RadioUNet)
def test_site_settings_override_profile(tmp_path: Path) -> None:
    cfg = load_site_config(write(tmp_path, profile="radio-base-station", threads=1))
    backend = build_backend(cfg)
    assert backend.name == "torch" and backend._microbatch == load_profile("radio-base-station").microbatch_size


def test_cli_keygen(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["keygen", "--out", str(tmp_path / "keys")])
    assert result.exit_code == 0, result.output
    key_path = tmp_path / "keys" / "site.key"
    assert os.stat(key_path).st_mode & 0o777 == 0o600
    assert load_private_key(key_path).public_key() == load_public_key(tmp_path / "keys" / "site.pub")
    again = runner.invoke(app, ["keygen", "--out", str(tmp_path / "keys")])
    assert again.exit_code == 2 and "--force" in again.output


def test_cli_run_reports_bad_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_agent_imports_neither_torch_nor_paho_until_needed() -> None:
    import subprocess
    import sys

    code = ("import sys, edge_sdk.agent, edge_sdk.cli, edge_sdk.privacy.ccdp; "
            "bad = [m for m in ('torch', 'paho') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def _site_on_a_memory_broker(tmp_path: Path, monkeypatch) -> None:
    """A site under ``tmp_path`` whose agent, when ``run`` builds it, talks to an in-memory broker."""
    from edge_sdk import agent as agent_module
    from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

    from .test_agent import make_site

    broker = InMemoryBroker()
    make_site(tmp_path, InMemoryTransport(broker))
    original = agent_module.EdgeAgent.from_config.__func__
    monkeypatch.setattr(agent_module.EdgeAgent, "from_config",
                        classmethod(lambda cls, cfg, transport=None, **kw: original(
                            cls, cfg, transport=InMemoryTransport(broker), **kw)))


def test_cli_run_writes_ready_file_and_stops_when_idle(tmp_path: Path, monkeypatch) -> None:
    _site_on_a_memory_broker(tmp_path, monkeypatch)
    ready = tmp_path / "ready" / "site.ready"
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "site.yaml"), "--idle-timeout", "0.2",
                                      "--ready-file", str(ready)])
    assert result.exit_code == 0, result.output
    assert ready.read_text().strip() == "site-1" and "rounds trained: 0" in result.output


def test_cli_run_interrupted_says_so_and_counts_what_was_trained(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C during run: the stop line says interrupted and counts the rounds the agent trained (not a word in
    place of the number)."""
    from edge_sdk import agent as agent_module

    _site_on_a_memory_broker(tmp_path, monkeypatch)

    def interrupted(self, **kw):  # noqa: ANN001, ANN003
        self.ctx.stats["tasks_trained"] += 2
        raise KeyboardInterrupt

    monkeypatch.setattr(agent_module.EdgeAgent, "run", interrupted)
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "site.yaml")])
    assert result.exit_code == 0, result.output
    assert "stopped (interrupted); rounds trained: 2;" in " ".join(result.output.split()), result.output


def test_cli_errors_keep_square_brackets(tmp_path: Path) -> None:
    """Rich must not take `[north]` in an error for markup and drop it."""
    absent = tmp_path / "site[north]" / "absent.yaml"
    result = CliRunner().invoke(app, ["run", "--config", str(absent)])
    assert result.exit_code == 2
    assert "site[north]/absent.yaml" in "".join(result.output.split())  # rich may fold a long path anywhere
    bad_engine = CliRunner().invoke(app, ["detect", str(tmp_path), "--engine", "[fast]"])
    assert bad_engine.exit_code == 2 and "--engine '[fast]'" in " ".join(bad_engine.output.split())
