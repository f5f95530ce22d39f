"""Signed SDK updates on the gateway (edge_sdk/updates): what is refused, when a version is staged, and the
launcher's trial (switch, confirm, roll back on an early exit, a missed deadline or a second start).

The launcher runs as a real process (``python -m edge_sdk.updates.launch``) on a prefix whose "versions" are small
shell scripts standing in for ``wildfed-edge``: each writes which version ran to a log, and the new one confirms
(removes the trial file, as ``wildfed-edge run`` does once it reached the broker), exits, or hangs, as each case
needs. The receiver runs in a real agent on the in-memory broker, with a fake coordinator's signed releases.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key
from shared.software import encode_software
from shared.topics import software_chunk_topic, software_topic
from shared.transfer import piece_size_for, seal_manifest, split

from edge_sdk.agent import EdgeAgent
from edge_sdk.updates import receiver as receiver_module
from edge_sdk.updates.layout import InstallLayout
from edge_sdk.updates.stage import StagedVersion, StageError
from edge_sdk.updates.trial import begin, confirm, roll_back, take_rollback_notice
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from .test_agent import FED, SITE, make_site

REPO = Path(__file__).resolve().parents[2]


# -- the launcher, on stand-in versions --------------------------------------------------------------------------
def _version(prefix: Path, name: str, body: str) -> Path:
    """A stand-in venv: ``bin/wildfed-edge`` is a shell script (``$LOG``: the run log; ``$PREFIX``: the prefix)."""
    venv = prefix / "sdk" / name / "venv" if name != "A" else prefix / "venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "wildfed-edge"
    script.write_text(f'#!/bin/sh\necho "{name} $*" >> "$LOG"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return venv


CONFIRM = ('"$PY" -c "import sys; from pathlib import Path; from edge_sdk.updates.layout import InstallLayout; '
           'from edge_sdk.updates.trial import confirm; '
           'sys.exit(0 if confirm(InstallLayout(Path(sys.argv[1])), \'2.0\') else 9)" "$PREFIX" || exit 9')


def _prefix(tmp_path: Path, new_body: str) -> tuple[InstallLayout, Path]:
    prefix = tmp_path / "gw"
    layout = InstallLayout.create(prefix, version="1.0", venv=_version(prefix, "A", "exit 0"), options={})
    venv_b = _version(prefix, "B", new_body)
    begin(layout, version="2.0", venv_relative=layout.relative(venv_b), previous="1.0", issued=10,
          confirm_within_s=30)
    return layout, prefix / "run.log"


def _launch(layout: InstallLayout, log: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOG": str(log), "PREFIX": str(layout.prefix), "PYTHONPATH": str(REPO),
           "PY": sys.executable}
    return subprocess.run([sys.executable, "-m", "edge_sdk.updates.launch", "--prefix", str(layout.prefix), "run",
                           "--config", "site.yaml"], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=layout.prefix)


def test_a_version_that_confirms_becomes_stable_and_keeps_running(tmp_path) -> None:
    layout, log = _prefix(tmp_path, CONFIRM + "\nexit 7")  # confirms as `wildfed-edge run` does, then exits
    done = _launch(layout, log)
    assert done.returncode == 7, done.stderr  # the agent's own status, passed on
    assert log.read_text().splitlines() == ["B run --config site.yaml"]
    assert layout.version_of("current") == layout.version_of("stable") == "2.0"
    assert layout.trial() is None and layout.state()["failed"] == {}


def test_a_version_that_exits_before_it_confirms_is_rolled_back_and_the_previous_runs(tmp_path) -> None:
    layout, log = _prefix(tmp_path, "exit 3")
    done = _launch(layout, log)
    assert done.returncode == 0, done.stderr  # the previous version (A) ran in the launcher's place and exited 0
    assert log.read_text().splitlines() == ["B run --config site.yaml", "A run --config site.yaml"]
    assert layout.version_of("current") == layout.version_of("stable") == "1.0"
    assert layout.state()["failed"] == {"2.0": "exited with status 3 before it reached the broker"}
    assert take_rollback_notice(layout) == {"version": "2.0", "back_to": "1.0",
                                            "reason": "exited with status 3 before it reached the broker"}
    assert take_rollback_notice(layout) is None  # reported once


def test_a_version_that_does_not_come_back_in_time_is_stopped_and_rolled_back(tmp_path) -> None:
    layout, log = _prefix(tmp_path, "exec sleep 120")
    trial = layout.trial()
    layout.save_trial({**trial, "deadline": time.time() + 1.0, "confirm_within_s": 1})
    done = _launch(layout, log)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["B run --config site.yaml", "A run --config site.yaml"]
    assert layout.state()["failed"]["2.0"] == "did not reach the broker within 1 s"
    assert layout.version_of("current") == "1.0"


def test_a_second_start_during_a_trial_rolls_back_before_anything_runs(tmp_path) -> None:
    layout, log = _prefix(tmp_path, CONFIRM)
    layout.save_trial({**layout.trial(), "starts": 1})  # the launcher (or the gateway) died during the trial
    done = _launch(layout, log)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["A run --config site.yaml"]
    assert "started once already" in layout.state()["failed"]["2.0"]


def test_without_a_trial_the_launcher_runs_the_current_version_in_its_place(tmp_path) -> None:
    layout, log = _prefix(tmp_path, "exit 5")
    confirm(layout, "2.0")  # as if 2.0 came back earlier
    done = _launch(layout, log)
    assert done.returncode == 5 and log.read_text().splitlines() == ["B run --config site.yaml"]
    assert roll_back(layout, "no trial") is None  # nothing to roll back


# -- the receiver, in a real agent ---------------------------------------------------------------------------------
SDK_NEW = "wildfed-9.9.9-py3-none-any.whl"


@pytest.fixture
def gateway(tmp_path: Path):
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    (tmp_path / "venv").mkdir()
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    yield broker, coordinator, agent
    agent.close()


def _updatable(agent: EdgeAgent, tmp_path: Path) -> InstallLayout:
    layout = InstallLayout.create(tmp_path, version=agent.software.running_version, venv=tmp_path / "venv",
                                  options={})
    agent.software.layout = layout
    return layout


def _software(coordinator, *, issued: int, wheel: str = SDK_NEW, key=None, site: str = SITE, piece_size=None,
              size: int = 1):
    release, payload = encode_software(federation_id=FED, issued=issued, confirm_within_s=60,
                                       wheels={wheel: f"wheel {wheel} {issued}".encode() * size})
    env = seal(private_key=key or coordinator.key, federation_id=FED, site_id=site, round=0,
               base_model_hash=release.sdk_wheel.sha256, kind=MessageKind.SOFTWARE, sequence=issued,
               payload=payload, **({"piece_size": piece_size} if piece_size else {}))
    return release, env


def test_an_install_without_the_update_layout_receives_but_installs_nothing(gateway) -> None:
    _, coordinator, agent = gateway
    _, env = _software(coordinator, issued=100)
    assert agent.software.handle(env.to_bytes()) is False
    assert agent.stats["software_not_updatable"] == 1 and agent.software.pending is None


def test_forged_misaddressed_current_and_replayed_releases_are_refused(gateway, tmp_path) -> None:
    _, coordinator, agent = gateway
    layout = _updatable(agent, tmp_path)
    updates = agent.software
    assert updates.handle(_software(coordinator, issued=100, key=generate_signing_key())[1].to_bytes()) is False
    assert agent.stats["rejected:bad_signature"] == 1
    assert updates.handle(_software(coordinator, issued=100, site="site-2")[1].to_bytes()) is False
    assert agent.stats["rejected:wrong_site"] == 1
    running = f"wildfed-{updates.running_version}-py3-none-any.whl"
    assert updates.handle(_software(coordinator, issued=100, wheel=running)[1].to_bytes()) is False
    assert agent.stats["software_current"] == 1
    layout.save_state({**layout.state(), "last_issued": 100})
    assert updates.handle(_software(coordinator, issued=100)[1].to_bytes()) is False  # replayed: not newer
    assert agent.stats["rejected:stale_release"] == 1
    layout.save_state({**layout.state(), "failed": {"9.9.9": "exited with status 3"}})
    assert updates.handle(_software(coordinator, issued=101)[1].to_bytes()) is False
    assert agent.stats["software_failed_before"] == 1 and updates.pending is None


def test_a_chunked_release_is_staged_when_idle_and_run_returns_to_switch(gateway, tmp_path, monkeypatch) -> None:
    broker, coordinator, agent = gateway
    layout = _updatable(agent, tmp_path)
    staged_calls = []

    def fake_stage(layout_, release, files, *, site_config, running_version):
        staged_calls.append((release.version, sorted(files), site_config, running_version))
        return StagedVersion(version=release.version, previous=running_version, venv=tmp_path / "new",
                             venv_relative="new", issued=release.issued, confirm_within_s=release.confirm_within_s)

    monkeypatch.setattr(receiver_module, "stage_release", fake_stage)
    release, env = _software(coordinator, issued=200, piece_size=piece_size_for(1024), size=400)  # ~14 KB
    manifest, chunks = split(env)
    transport = InMemoryTransport(broker)
    transport.connect()
    for chunk in reversed(chunks):  # retained messages come in no fixed order: chunks before their manifest
        transport.publish(software_chunk_topic(FED, SITE, chunk.index), chunk.to_bytes(), qos=1, retain=True)
    transport.publish(software_topic(FED, SITE),
                      seal_manifest(private_key=coordinator.key, manifest=manifest).to_bytes(), qos=1, retain=True)
    assert agent.run(idle_timeout_s=30) == 0
    assert agent.staged is not None and agent.staged.version == "9.9.9"
    assert staged_calls == [("9.9.9", [SDK_NEW], tmp_path / "site.yaml", agent.software.running_version)]
    assert layout.state()["last_issued"] == 200  # a replay of this release is refused from now on


def test_a_version_that_fails_to_stage_is_recorded_and_the_agent_goes_on(gateway, tmp_path, monkeypatch) -> None:
    _, coordinator, agent = gateway
    layout = _updatable(agent, tmp_path)

    def failing(*_args, **_kwargs):
        raise StageError("version 9.9.9 failed its check-config (exit 2): profile.kind: ...")

    monkeypatch.setattr(receiver_module, "stage_release", failing)
    assert agent.software.handle(_software(coordinator, issued=300)[1].to_bytes()) is True
    assert agent.software.stage() is None
    assert "failed its check-config" in layout.state()["failed"]["9.9.9"]
    assert agent.errors.last is not None and "SDK update to 9.9.9 failed" in agent.errors.last[0]
    assert agent.stats["software_failed"] == 1 and agent.staged is None
