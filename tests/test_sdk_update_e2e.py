"""Signed SDK updates end to end: version A to B, and a broken C and D that the gateway refuses to keep.

Four wheels are built from this checkout (``coordinator.provisioning.build_sdk_wheel``): A as it is (0.1.0), B with
the version 0.1.1, C (0.1.2) whose ``run`` exits with status 3 right after its checks (it passes check-config, then
never reaches the broker), D (0.1.3) whose checks crash (it fails check-config). A site is provisioned with A and
installed by ``install_bundle`` into a venv (with the test interpreter's packages, ``--no-deps``: no downloads),
then started through the launcher exactly as the systemd unit starts it, against a coordinator on Mosquitto
(127.0.0.1:1883). The operator records each release (``record_release``, as ``publish-update`` does) and the
coordinator publishes it (``publish_software``, as ``service`` does at each look). Asserted from the gateway's
records, its links and the coordinator's fleet table (health records):

- B is installed beside A, checked, switched to, comes back and is confirmed: ``current`` and ``stable`` point at
  it and the fleet shows SDK 0.1.1;
- C passes its check, is switched to, exits before it reaches the broker, and is rolled back to B, which reports
  the rollback in its health record (``last_error``); C is recorded as failed and not tried again;
- D fails its check-config and is never switched to; B keeps running.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.keys import generate_signing_key, save_private_key, save_public_key

from coordinator.fleet import fleet_rows
from coordinator.provisioning import build_sdk_wheel, provision_site
from coordinator.sdk_wheel import _SOURCE_ITEMS
from coordinator.software_delivery import record_release
from coordinator.storage import Store
from tests.coordinator.helpers import make_config
from tests.edge.conftest import write_package
from tests.graph_support import fake_graph_folder

pytestmark = [pytest.mark.slow, pytest.mark.broker]

REPO = Path(__file__).resolve().parents[1]
SPECIES = [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
           {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]
BROKEN_RUN = ("    checked = check_site(config, load_dataset=False)",
              "    checked = check_site(config, load_dataset=False)\n    raise typer.Exit(code=3)  # broken on purpose")
BROKEN_CHECK = ("def check_site(", "def check_site(*_a, **_k):\n    raise RuntimeError('broken on purpose')\n\n\n"
                                    "def _unused_check_site(")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wheel(tmp: Path, version: str, edits: dict[str, tuple[str, str]] | None = None) -> Path:
    """The SDK wheel of this checkout with ``version`` and ``edits`` ({file: (old, new)}) applied to a copy."""
    src = tmp / f"src-{version}"
    src.mkdir()
    for item in _SOURCE_ITEMS:
        path = REPO / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "assets"))
        else:
            shutil.copy2(path, src / item)
    pyproject = src / "pyproject.toml"
    pyproject.write_text(re.sub(r'(?m)^version = ".*"$', f'version = "{version}"', pyproject.read_text(), count=1))
    for name, (old, new) in (edits or {}).items():
        text = (src / name).read_text()
        assert old in text, (name, old)
        (src / name).write_text(text.replace(old, new, 1))
    return build_sdk_wheel(tmp / "wheels", source_root=src)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sdk-versions")
    built = {"A": build_sdk_wheel(tmp / "wheels"), "B": _wheel(tmp, "0.1.1"),
             "C": _wheel(tmp, "0.1.2", {"edge_sdk/cli.py": BROKEN_RUN}),
             "D": _wheel(tmp, "0.1.3", {"edge_sdk/preflight.py": BROKEN_CHECK})}
    assert [w.name.split("-")[1] for w in built.values()] == ["0.1.0", "0.1.1", "0.1.2", "0.1.3"]
    return built


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc: Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _wait(what: str, condition: Callable[[], object], proc: subprocess.Popen, timeout: float = 240.0) -> object:
    """Wait until ``condition()`` is truthy (the gateway's records change as it works), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert proc.poll() is None, f"the gateway exited ({proc.returncode}) waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_signed_update_is_installed_confirmed_and_broken_ones_are_rolled_back(tmp_path, wheels) -> None:
    if not _port_open(1883):
        pytest.skip("no MQTT broker on 127.0.0.1:1883 (start mosquitto to run this test)")
    from coordinator.service import Coordinator
    from edge_sdk.bundle import install_bundle
    from edge_sdk.updates.layout import InstallLayout

    cfg = make_config(tmp_path, federation_id=f"upd{uuid.uuid4().hex[:10]}", broker_url="mqtt://127.0.0.1:1883")
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    try:
        bundle = provision_site(config=cfg, store=store, site_id="site-1", profile="x86-cpu-gateway",
                                species=SPECIES, wheel=wheels["A"], metadata={"capacity": 10},
                                out=tmp_path / "site-1.tar", graph_cache=fake_graph_folder(tmp_path / "graphs"))
    finally:
        store.dispose()
    prefix = tmp_path / "gw"
    installed = install_bundle(bundle.bundle_path, prefix=prefix, system_site_packages=True, no_deps=True,
                               check_backend=False)
    write_package(prefix / "data" / "camtrap")
    layout = InstallLayout.find(installed.site_config)
    assert layout is not None and layout.version_of("current") == layout.version_of("stable") == "0.1.0"

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"WILDFED_CACHE": str(tmp_path / "cache"), "COLUMNS": "2000"}
    coord = Coordinator(cfg)
    coord.start()  # first: the gateway's first health record (at its connect) finds the coordinator subscribed
    log = (tmp_path / "gateway.log").open("w")
    command = [*shlex.split(installed.executable), "run", "--config", str(installed.site_config)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=prefix)
    try:

        def fleet_version() -> tuple[str, str] | None:
            rows = fleet_rows(coord.store, coord.registry)
            rec = rows[0].record if rows else None
            return (rec.sdk_version, rec.last_error) if rec is not None else None

        _wait("the first health record (SDK 0.1.0)", lambda: (fleet_version() or ("",))[0] == "0.1.0", proc)

        def publish(name: str) -> None:
            record_release(coord.store, Path(cfg.data_dir), federation_id=cfg.federation_id,
                           wheels={wheels[name].name: wheels[name].read_bytes()}, confirm_within_s=120)
            assert coord.publish_software() == {"site-1": wheels[name].name.split("-")[1]}

        # A -> B: installed beside, checked, switched, confirmed
        publish("B")
        _wait("B confirmed", lambda: layout.version_of("stable") == "0.1.1", proc)
        assert layout.version_of("current") == "0.1.1" and layout.trial() is None
        assert (prefix / "sdk" / "0.1.1" / "venv" / "bin" / "wildfed-edge").exists()
        _wait("the fleet showing SDK 0.1.1", lambda: (fleet_version() or ("",))[0] == "0.1.1", proc)
        # the launcher the unit started supervises B: one launcher and one agent, nothing stacked
        agent = _children(proc.pid)
        assert len(agent) == 1 and _children(agent[0]) == [], (agent, [_children(a) for a in agent])

        # B -> C: passes its check, exits before reaching the broker: rolled back to B, reported
        publish("C")
        _wait("C rolled back", lambda: "0.1.2" in layout.state()["failed"], proc)
        assert layout.state()["failed"]["0.1.2"] == "exited with status 3 before it reached the broker"
        assert layout.version_of("current") == layout.version_of("stable") == "0.1.1"
        # B handed C's trial back to that launcher (no second launcher); after the rollback B runs in its place
        assert _children(proc.pid) == []
        reported = _wait("the rollback in the health record",
                         lambda: (v := fleet_version()) and "rolled back" in v[1] and v, proc)
        assert reported[0] == "0.1.1" and "SDK update to 0.1.2 rolled back to 0.1.1" in reported[1]

        # B -> D: fails its check-config: never switched to
        publish("D")
        _wait("D refused", lambda: "0.1.3" in layout.state()["failed"], proc)
        assert "failed its check-config" in layout.state()["failed"]["0.1.3"]
        assert layout.version_of("current") == "0.1.1" and not (prefix / "sdk" / "0.1.3").exists()
        events = [entry[1:3] for entry in layout.state()["history"]]
        assert events == [["installed", "0.1.0"], ["received", "0.1.1"], ["switched", "0.1.1"],
                          ["confirmed", "0.1.1"], ["received", "0.1.2"], ["switched", "0.1.2"],
                          ["rolled back", "0.1.2"], ["received", "0.1.3"], ["failed", "0.1.3"]], events
    finally:
        coord.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher passes it on to the agent
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "gateway.log").read_text()[-3000:]
