"""A provisioned gateway can train: ``install-bundle`` installs the profile's training backend
(torch, or onnxruntime-training through the ``edge-ort`` extra), offline from wheels when it has them, and
``check-config`` fails, naming the backend and the install command, when that backend does not import.

The pip command lines are checked through the real ``wildfed-edge install-bundle`` CLI with ``subprocess.run``
recorded (a real install of torch would take minutes); the check-config failure runs the real CLI in a
subprocess whose import system refuses torch / onnxruntime (a ``sys.meta_path`` finder), as on a bare gateway.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from shared import bundle as fmt
from shared.keys import generate_signing_key, public_key_to_pem
from shared.profiles import PROFILES_DIR

from edge_sdk.cli import app
from tests.gateway_backend import needs_torch

from .conftest import write_package

REPO_ROOT = Path(__file__).resolve().parents[2]
SDK_WHEEL = "wildfed-0.1.0-py3-none-any.whl"
UNIT = "[Service]\nUser=@USER@\nExecStart=@EXEC@ run --config @PREFIX@/site.yaml\n"


def write_test_bundle(path: Path, profile: str, *, extra_wheels: tuple[str, ...] = ()) -> Path:
    """A signed bundle for ``profile`` (a shipped profile name) whose wheels are placeholder bytes: the tests that
    use it record pip's command lines instead of running pip."""
    coordinator, site = generate_signing_key(), generate_signing_key()
    site_yaml = {"federation_id": "fed1", "site_id": "site-1", "dataset": "data/camtrap",
                 "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
                 "outbox": "state/outbox.sqlite", "profile": "profile.yaml", "broker_url": "mqtt://127.0.0.1:1883"}
    members = [
        fmt.BundleMember(fmt.PROFILE, (PROFILES_DIR / f"{profile}.yaml").read_bytes()),
        fmt.BundleMember(fmt.SITE_CONFIG, yaml.safe_dump(site_yaml).encode()),
        fmt.BundleMember(fmt.SITE_KEY, site.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()), 0o600),
        fmt.BundleMember(fmt.SITE_PUBLIC_KEY, public_key_to_pem(site.public_key()).encode()),
        fmt.BundleMember(fmt.COORDINATOR_PUBLIC_KEY, public_key_to_pem(coordinator.public_key()).encode()),
        fmt.BundleMember(fmt.SYSTEMD_UNIT, UNIT.encode()),
        fmt.BundleMember(f"{fmt.WHEELS_DIR}/{SDK_WHEEL}", b"placeholder"),
    ] + [fmt.BundleMember(f"{fmt.WHEELS_DIR}/{name}", b"placeholder") for name in extra_wheels]
    with path.open("wb") as handle:
        fmt.write_bundle(handle, members, signing_key=coordinator, info={"federation_id": "fed1",
                                                                          "site_id": "site-1", "profile": profile})
    return path


class _RecordedRun:
    """Stands in for ``subprocess.run`` in edge_sdk.bundle: records each command; creating a venv makes its
    ``bin/python`` so the installer goes on; everything succeeds with empty output."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, cmd, *args, **kwargs):
        cmd = [str(c) for c in cmd]
        self.commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            python = Path(cmd[-1]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    def pip(self) -> list[list[str]]:
        return [c for c in self.commands if c[1:4] == ["-m", "pip", "install"]]


def _install(tmp_path: Path, monkeypatch, profile: str, *extra_args: str, extra_wheels: tuple[str, ...] = ()):
    import edge_sdk.bundle as bundle_module

    tmp_path.mkdir(parents=True, exist_ok=True)
    recorder = _RecordedRun()
    monkeypatch.setattr(bundle_module.subprocess, "run", recorder)
    bundle = write_test_bundle(tmp_path / f"{profile}.tar", profile, extra_wheels=extra_wheels)
    prefix = tmp_path / "gw"
    result = CliRunner().invoke(app, ["install-bundle", str(bundle), "--prefix", str(prefix), *extra_args],
                                terminal_width=1000, env={"COLUMNS": "1000"})
    return recorder, prefix, result


@pytest.mark.parametrize("profile,extras", [
    ("radio-base-station", "edge,torch"),   # backend torch
    ("x86-gpu-gateway", "edge-ort"),        # backend auto on CUDA: runs without torch (CUDA torch is an opt-in)
    ("jetson-orin-nano", "edge,torch"),     # torch (JetPack's, through --system-site-packages)
    ("x86-cpu-gateway", "edge-ort"),        # backend auto on an x86_64 CPU box: onnxruntime-training, no torch
])
def test_install_bundle_installs_the_profiles_backend(tmp_path, monkeypatch, profile: str, extras: str) -> None:
    import edge_sdk.profiles as profiles

    monkeypatch.setattr(profiles.platform, "machine", lambda: "x86_64")  # the gateway's arch decides `auto`
    recorder, prefix, result = _install(tmp_path, monkeypatch, profile)

    assert result.exit_code == 0, result.output
    python, wheel = str(prefix / "venv" / "bin" / "python"), str(prefix / "wheels" / SDK_WHEEL)
    pip = [python, "-m", "pip", "install", "-q"]
    # Before the fix: one command, `pip install --force-reinstall <wheel>[edge]`, whatever the profile said.
    assert recorder.pip() == [pip + ["--no-deps", "--no-index", "--force-reinstall", wheel],
                              pip + [f"{wheel}[{extras}]"]]


def test_auto_on_an_arm_gateway_installs_torch(tmp_path, monkeypatch) -> None:
    import edge_sdk.profiles as profiles

    monkeypatch.setattr(profiles.platform, "machine", lambda: "aarch64")  # no onnxruntime-training wheel there
    recorder, prefix, result = _install(tmp_path, monkeypatch, "x86-cpu-gateway")
    assert result.exit_code == 0, result.output
    assert recorder.pip()[-1][-1] == f"{prefix / 'wheels' / SDK_WHEEL}[edge,torch]"


def test_wheels_in_the_bundle_or_find_links_install_offline(tmp_path, monkeypatch) -> None:
    import edge_sdk.profiles as profiles

    monkeypatch.setattr(profiles.platform, "machine", lambda: "x86_64")
    wheelhouse = tmp_path / "usb"
    wheelhouse.mkdir()
    recorder, prefix, result = _install(tmp_path, monkeypatch, "x86-cpu-gateway", "--find-links", str(wheelhouse),
                                        extra_wheels=("onnx-1.17.0-cp311-cp311-manylinux_2_17_x86_64.whl",))
    assert result.exit_code == 0, result.output
    deps = recorder.pip()[-1]
    # --no-index: nothing downloaded; the bundle's wheels/ folder first, then the operator's wheelhouse
    assert deps[5:] == ["--no-index", "--find-links", str(prefix / "wheels"), "--find-links", str(wheelhouse),
                        f"{prefix / 'wheels' / SDK_WHEEL}[edge-ort]"]
    # the SDK wheel is the wildfed one, although onnx-*.whl sorts first
    assert recorder.pip()[0][-1] == str(prefix / "wheels" / SDK_WHEEL)


def test_no_deps_installs_the_wheel_alone_and_a_missing_wheel_folder_is_named(tmp_path, monkeypatch) -> None:
    recorder, prefix, result = _install(tmp_path, monkeypatch, "radio-base-station", "--no-deps")
    assert result.exit_code == 0, result.output
    assert len(recorder.pip()) == 1 and "--no-deps" in recorder.pip()[0]

    _, _, missing = _install(tmp_path / "again", monkeypatch, "radio-base-station", "--find-links",
                             str(tmp_path / "absent"))
    assert missing.exit_code == 2
    assert "wheel folder not found" in missing.output and "absent" in missing.output


def test_jetson_without_system_site_packages_is_warned(tmp_path, monkeypatch) -> None:
    _, _, result = _install(tmp_path, monkeypatch, "jetson-orin-nano")
    assert result.exit_code == 0, result.output
    assert "JetPack" in " ".join(result.output.split()) and "--system-site-packages" in result.output


def test_pip_failure_names_the_command_and_the_wheel_folder(tmp_path, monkeypatch) -> None:
    import edge_sdk.bundle as bundle_module

    def failing(cmd, *args, **kwargs):
        cmd = [str(c) for c in cmd]
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[-1]) / "bin").mkdir(parents=True)
            (Path(cmd[-1]) / "bin" / "python").write_text("")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if "[edge-ort]" in cmd[-1]:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for onnx==1.17.0")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bundle_module.subprocess, "run", failing)
    wheelhouse = tmp_path / "usb"
    wheelhouse.mkdir()
    bundle = write_test_bundle(tmp_path / "b.tar", "x86-cpu-gateway")
    import edge_sdk.profiles as profiles

    monkeypatch.setattr(profiles.platform, "machine", lambda: "x86_64")
    result = CliRunner().invoke(app, ["install-bundle", str(bundle), "--prefix", str(tmp_path / "gw"),
                                      "--find-links", str(wheelhouse)], terminal_width=1000,
                                env={"COLUMNS": "1000"})
    text = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "onnx==1.17.0" in text and "wildfed[edge-ort]" in text and str(wheelhouse) in text


# -- check-config: the backend must import --------------------------------------------------------------------------
_BLOCKING_CLI = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
from edge_sdk.cli import app
app(sys.argv[2:], prog_name="wildfed-edge")
"""


def _site(tmp_path: Path, profile: str) -> Path:
    from shared.keys import save_private_key, save_public_key

    key = generate_signing_key()
    save_private_key(key, tmp_path / "keys" / "site.key")
    save_public_key(key.public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    body = {"federation_id": "fed1", "site_id": "site-1", "dataset": "pkg",
            "species": [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
                        {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}],
            "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
            "outbox": "state/outbox.sqlite", "profile": profile}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _check_config(blocked: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "2000", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", _BLOCKING_CLI, blocked, "check-config", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_check_config_fails_when_the_torch_backend_is_missing(tmp_path) -> None:
    site = _site(tmp_path, "radio-base-station")  # backend torch
    result = _check_config("torch", str(site))
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "backend" in out and "training backend torch cannot run here" in out
    assert "No module named 'torch'" in out
    assert "pip install 'wildfed[edge,torch]'" in out  # brackets survive rich


@needs_torch
def test_check_config_passes_the_torch_backend_where_torch_imports(tmp_path) -> None:
    """The same config as above is OK with torch importable: the check is the import, nothing else."""
    site = _site(tmp_path, "radio-base-station")  # backend torch
    ok = _check_config("nothing-blocked", str(site))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "valid site config" in ok.stdout


def test_check_config_auto_needs_one_of_the_two_backends(tmp_path) -> None:
    site = _site(tmp_path, "x86-cpu-gateway")  # backend auto
    neither = _check_config("torch,onnxruntime", str(site))
    out = " ".join((neither.stdout + neither.stderr).split())
    assert neither.returncode == 2, out
    assert "training backend auto cannot run here" in out and "onnxruntime.training" in out
    assert "wildfed[edge-ort]" in out  # what auto installs on x86_64 CPU
    only_ort = _check_config("torch", str(site))
    assert only_ort.returncode == 0, only_ort.stdout + only_ort.stderr
