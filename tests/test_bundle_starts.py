"""A provisioned bundle starts with exactly what it installs.

- Fast: ``check-config`` and ``run`` share one preflight (``edge_sdk.preflight``) and exit with status 2, one line
  per problem and no traceback, where the site cannot start: a Jetson profile on this x86 box, a bundle without its
  ONNX graphs on a gateway without torch. With the graphs and no torch the same site checks OK.
- Slow (``slow``, ``broker``): each x86 profile is provisioned (real graphs, exported once into the WildFed cache),
  its bundle installed by the bundle's own ``wildfed-edge install-bundle`` into a fresh venv **without torch**
  (``python -m venv``, then pip from the configured package index; ``pip show torch`` fails there), checked, and run
  for one round against a coordinator over Mosquitto on 127.0.0.1:1883; ``detect`` then runs on two photos. The
  gateway processes get an empty ``$WILDFED_CACHE``, so every graph they use comes from the bundle.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared import bundle as fmt
from shared.bundle import read_bundle
from shared.keys import generate_signing_key, load_private_key, save_private_key, save_public_key

from coordinator.provisioning import build_sdk_wheel, provision_site
from coordinator.storage import Store
from tests.coordinator.helpers import make_config
from tests.edge.conftest import write_package
from tests.edge.test_gateway_install import _BLOCKING_CLI
from tests.graph_support import fake_graph_folder

REPO_ROOT = Path(__file__).resolve().parents[1]
SPECIES = [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
           {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]
PHOTOS = [REPO_ROOT / "wildfed_sim" / "assets" / "ena24" / name for name in ("2480.jpg", "2573.jpg")]


@pytest.fixture(scope="module")
def sdk_wheel(tmp_path_factory) -> Path:
    return build_sdk_wheel(tmp_path_factory.mktemp("wheels"))


def _federation(tmp_path: Path, **overrides):
    cfg = make_config(tmp_path, round_deadline_s=90.0, rounds=1, local_steps=2, expected_batch_size=2, **overrides)
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    return cfg


def _provision(cfg, tmp_path: Path, wheel: Path, profile: str, site_id: str, graph_cache: Path | None):
    store = Store(cfg.database_url, cfg.data_dir)
    try:
        return provision_site(config=cfg, store=store, site_id=site_id, profile=profile, species=SPECIES,
                              wheel=wheel, metadata={"capacity": 10}, out=tmp_path / f"{site_id}.tar",
                              graph_cache=graph_cache)
    finally:
        store.dispose()


def _installed_site(tmp_path: Path, wheel: Path, profile: str, *, graphs: bool = True) -> Path:
    """Provision ``profile`` with stand-in graphs, optionally strip the graphs from the bundle (as an older
    coordinator made it; re-signed, so only the graphs are missing), install it with this interpreter's SDK
    (``--no-venv``) and put the site's package in place; the installed ``site.yaml``."""
    from edge_sdk.bundle import install_bundle

    cfg = _federation(tmp_path)
    result = _provision(cfg, tmp_path, wheel, profile, "site-1", fake_graph_folder(tmp_path / "graphs"))
    bundle_path = result.bundle_path
    if not graphs:
        bundle = read_bundle(bundle_path)
        members = [fmt.BundleMember(n, d, bundle.mode(n)) for n, d in bundle.members.items()
                   if not n.startswith(f"{fmt.MODELS_DIR}/")]
        info = {k: v for k, v in bundle.manifest.items() if k not in ("format", "created", "members", "models")}
        bundle_path = tmp_path / "old-coordinator.tar"
        with bundle_path.open("wb") as handle:
            fmt.write_bundle(handle, members, signing_key=load_private_key(cfg.signing_key_path), info=info)
    installed = install_bundle(bundle_path, prefix=tmp_path / "gw", venv=False)
    assert graphs or any("no ONNX graphs" in w for w in installed.warnings), installed.warnings
    write_package(tmp_path / "gw" / "data" / "camtrap")
    return installed.site_config


def _cli(blocked: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    """``wildfed-edge ARGS`` in a subprocess whose import system refuses the modules in ``blocked`` (a gateway
    without them), with an empty WildFed cache (nothing but the bundle's graphs)."""
    env = {**os.environ, "COLUMNS": "2000", "PYTHONPATH": str(REPO_ROOT), "WILDFED_CACHE": str(cache)}
    env.pop("WILDFED_BACKBONE_ONNX", None)
    env.pop("WILDFED_DETECTOR_ONNX", None)
    return subprocess.run([sys.executable, "-c", _BLOCKING_CLI, blocked, *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.skipif(Path("/etc/nv_tegra_release").exists(), reason="this machine is a Jetson")
def test_check_config_and_run_refuse_a_jetson_profile_on_this_x86_box(tmp_path, sdk_wheel) -> None:
    from edge_sdk.cli import app

    site = _installed_site(tmp_path, sdk_wheel, "jetson-orin-nano")
    check = CliRunner().invoke(app, ["check-config", str(site)], env={"COLUMNS": "2000"})
    assert check.exit_code == 2, check.output
    assert "profile.kind" in check.output and "needs a jetson_orin_nano" in check.output
    assert "x86-cpu-gateway" in check.output  # the fix names a profile that fits
    # run refuses it the same way: status 2 (the unit does not restart it), one line per problem, no traceback
    run = CliRunner().invoke(app, ["run", "--config", str(site)], env={"COLUMNS": "80"})
    assert run.exit_code == 2 and isinstance(run.exception, SystemExit), run.output
    assert "Traceback" not in run.output
    lines = _error_lines(run.output)
    assert any("profile.kind: profile jetson-orin-nano needs a jetson_orin_nano" in line for line in lines), lines
    assert all("fix:" in line for line in lines), lines  # one line each, although wider than the terminal


def test_a_bundle_without_its_graphs_fails_check_config_and_run_without_torch(tmp_path, sdk_wheel) -> None:
    site = _installed_site(tmp_path, sdk_wheel, "x86-cpu-gateway", graphs=False)
    empty_cache = tmp_path / "cache"
    check = _cli("torch", "check-config", str(site), cache=empty_cache)
    out = " ".join((check.stdout + check.stderr).split())
    assert check.returncode == 2, out
    assert "model_dir" in out and "no ONNX graph of the backbone efficientnet-lite0 at 128 px" in out
    assert "install-bundle --force" in out
    run = _cli("torch", "run", "--config", str(site), cache=empty_cache)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    lines = _error_lines(run.stderr)
    assert len(lines) == 1 and "model_dir: no ONNX graph of the backbone" in lines[0] and "fix:" in lines[0], lines


def test_the_bundles_graphs_are_all_a_gateway_without_torch_needs(tmp_path, sdk_wheel) -> None:
    site = _installed_site(tmp_path, sdk_wheel, "x86-cpu-gateway")
    graphs = sorted(p.relative_to(tmp_path / "gw").as_posix() for p in (tmp_path / "gw" / "models").rglob("*.onnx"))
    assert graphs == ["models/backbone/efficientnet-lite0-579344248a93-p1-128px-opset17.onnx",
                      "models/detector/yolox_tiny-31f8690fc62f-opset17.onnx"]
    with_incoming = yaml.safe_load(site.read_text()) | {"incoming": "incoming"}  # the field loop needs the detector
    site.write_text(yaml.safe_dump(with_incoming))
    check = _cli("torch", "check-config", str(site), cache=tmp_path / "cache")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "run would start" in " ".join(check.stdout.split())
    (tmp_path / "gw" / graphs[1]).unlink()  # a detector graph lost after install
    lost = _cli("torch", "check-config", str(site), cache=tmp_path / "cache")
    assert lost.returncode == 2 and "no ONNX graph of the detector" in " ".join(lost.stdout.split())


def test_the_systemd_unit_does_not_restart_a_configuration_error() -> None:
    from coordinator.provisioning import SYSTEMD_UNIT_TEMPLATE

    service = dict(line.split("=", 1) for line in SYSTEMD_UNIT_TEMPLATE.splitlines() if "=" in line)
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"


# -- the real thing: a fresh venv without torch, one round over Mosquitto, detect ---------------------------------
def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory, sdk_wheel) -> Path:
    """A venv made by ``python -m venv`` and given the bundle's SDK wheel alone (docs/gateways.md, "First install on
    a bare gateway"); the profiles share it (one slow pip install), each from its own install prefix."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(sdk_wheel)],
                         capture_output=True, text=True, timeout=600, env=_gateway_env(venv.parent))
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return venv


def _gateway_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WILDFED_BACKBONE_ONNX",
                                                             "WILDFED_DETECTOR_ONNX", "VIRTUAL_ENV")}
    return env | {"WILDFED_CACHE": str(root / "empty-cache"), "COLUMNS": "2000"}


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.parametrize("profile", ["x86-cpu-gateway", "x86-gpu-gateway"])
def test_each_x86_bundle_installs_without_torch_and_trains_a_round(profile, bare_venv, sdk_wheel,
                                                                   tmp_path) -> None:
    if not _port_open(1883):
        pytest.skip("no MQTT broker on 127.0.0.1:1883 (start mosquitto to run this test)")
    from coordinator.service import Coordinator
    from shared.models.detector_weights import WeightsUnavailableError

    cfg = _federation(tmp_path, federation_id=f"bundle{uuid.uuid4().hex[:10]}", broker_url="mqtt://127.0.0.1:1883")
    site_id = profile.split("-")[1] + "-site"  # cpu-site, gpu-site
    try:  # the real graphs, exported once into the WildFed cache (torch is here, at the "coordinator")
        result = _provision(cfg, tmp_path, sdk_wheel, profile, site_id, graph_cache=None)
    except WeightsUnavailableError as exc:
        pytest.skip(f"the detector's weights cannot be fetched here: {exc}")
    size_mb = result.bundle_path.stat().st_size / 1e6
    assert 30 < size_mb < 60, size_mb  # two graphs (13.5 + 20.2 MB) and the SDK wheel

    root = tmp_path / "gw"  # the site's prefix; its venv is the shared one, which install-bundle reuses
    root.mkdir()
    (root / "venv").symlink_to(bare_venv, target_is_directory=True)
    env = _gateway_env(root)
    edge = str(root / "venv" / "bin" / "wildfed-edge")
    install = subprocess.run([edge, "install-bundle", str(result.bundle_path), "--prefix", str(root)],
                             capture_output=True, text=True, timeout=900, env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    assert "training backend" not in install.stdout, install.stdout  # the profile's backend imports
    torch = subprocess.run([str(root / "venv" / "bin" / "python"), "-m", "pip", "show", "torch"],
                           capture_output=True, text=True, env=env)
    assert torch.returncode != 0, torch.stdout  # no torch in the gateway's venv
    write_package(root / "data" / "camtrap")
    site = root / "site.yaml"

    check = subprocess.run([edge, "check-config", str(site)], capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    if profile == "x86-gpu-gateway":
        assert "ONNX Runtime on the CPU" in " ".join(check.stdout.split())

    ready = tmp_path / "ready"
    cmd = [edge, "run", "--config", str(site), "--max-rounds", "1", "--idle-timeout", "120", "--ready-file",
           str(ready)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.stdout.read() if proc.poll() is not None else "gateway not ready in 120 s"
        with Coordinator(cfg) as coord:
            results = coord.run(1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert results[0].status == "closed" and results[0].accepted == (site_id,), output
    assert proc.returncode == 0 and "rounds trained: 1" in output, output
    text = " ".join(output.split())
    assert "backend ort" in text, output  # trained with ONNX Runtime
    if profile == "x86-gpu-gateway":  # the fallback is said, once, in words
        assert "torch with CUDA is not available here, so training runs on ONNX Runtime on the CPU" in text, output

    out = tmp_path / "detections"
    detect = subprocess.run([edge, "detect", *map(str, PHOTOS), "--config", str(site), "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert detect.returncode == 0, detect.stdout + detect.stderr
    assert "engines: detector ort-cpu, classifier ort-cpu" in detect.stdout, detect.stdout
    megadetector = json.loads((out / "megadetector.json").read_text())
    assert len(megadetector["images"]) == len(PHOTOS)
    assert not list((root / "empty-cache").rglob("*.onnx"))  # every graph came from the bundle
