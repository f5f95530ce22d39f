"""Provisioning: ``wildfed-coordinator provision`` writes one signed bundle and enrols the site together;
``wildfed-edge install-bundle`` verifies and installs it; the installed gateway trains one round against the
coordinator (in memory, and as a real ``wildfed-edge run`` process over Mosquitto). Tampered bundles and unsafe
members are refused before anything is written."""

from __future__ import annotations

import hashlib
import io
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared import bundle as fmt
from shared.bundle import BundleError, check_member_name, read_bundle
from shared.keys import generate_signing_key, load_private_key, save_private_key, save_public_key

from coordinator.provisioning import build_sdk_wheel, provision_site
from coordinator.registry import EnrolmentError, SiteRegistry
from coordinator.storage import Store
from shared.models.gateway_graphs import backbone_graph_relpath, detector_graph_relpath
from tests.coordinator.helpers import make_config
from tests.edge.conftest import write_package
from tests.graph_support import fake_graph_folder

SPECIES = [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
           {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]


@pytest.fixture(scope="session")
def sdk_wheel(tmp_path_factory) -> Path:
    """The SDK wheel, built once per test session from this checkout."""
    return build_sdk_wheel(tmp_path_factory.mktemp("wheels"))


@pytest.fixture(scope="session")
def graph_cache(tmp_path_factory) -> Path:
    """A graph folder with stand-ins of the backbone (efficientnet-lite0, 128 px) and detector graphs under their
    canonical names: provisioning ships them without exporting (no torch export, no download in these tests)."""
    return fake_graph_folder(tmp_path_factory.mktemp("graphs"))


@pytest.fixture
def fed(tmp_path: Path):
    """A coordinator config with its key pair on disk and an open store; yields (config, store)."""
    cfg = make_config(tmp_path, round_deadline_s=60.0, rounds=1, local_steps=2, expected_batch_size=2)
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    yield cfg, store
    store.dispose()


def provision(fed, sdk_wheel: Path, tmp_path: Path, site_id: str = "site-1", **kw):
    cfg, store = fed
    kw.setdefault("profile", "x86-cpu-gateway")
    kw.setdefault("graph_cache", GRAPHS[0])
    kw.setdefault("out", tmp_path / "out" / f"{site_id}.tar")
    return provision_site(config=cfg, store=store, site_id=site_id, species=SPECIES, wheel=sdk_wheel,
                          metadata={"capacity": 3}, **kw)


GRAPHS: list[Path] = []  # the session's graph folder (set by the autouse fixture below)


@pytest.fixture(autouse=True)
def _graphs(graph_cache) -> None:
    GRAPHS[:] = [graph_cache]


def test_provisioning_imports_no_edge_sdk_and_no_torch() -> None:
    code = ("import sys, coordinator.provisioning, coordinator.cli, shared.bundle, shared.profiles\n"
            "print([m for m in sys.modules if m == 'torch' or m.startswith('edge_sdk')])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- the bundle ---------------------------------------------------------------------------------------------------
def test_bundle_holds_everything_and_enrols_the_site(fed, sdk_wheel, tmp_path) -> None:
    cfg, store = fed
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    result = provision(fed, sdk_wheel, tmp_path, broker_ca=ca)
    assert os.stat(result.bundle_path).st_mode & 0o777 == 0o600
    bundle = read_bundle(result.bundle_path)
    graphs = {"backbone": f"models/{backbone_graph_relpath('efficientnet-lite0', 128)}",
              "detector": f"models/{detector_graph_relpath()}"}
    assert graphs["backbone"] == "models/backbone/efficientnet-lite0-579344248a93-p1-128px-opset17.onnx"
    assert set(bundle.members) == {fmt.PROFILE, fmt.SITE_CONFIG, fmt.SITE_KEY, fmt.SITE_PUBLIC_KEY,
                                   fmt.COORDINATOR_PUBLIC_KEY, fmt.SYSTEMD_UNIT, fmt.BROKER_CA,
                                   f"wheels/{sdk_wheel.name}", *graphs.values()}
    # the graphs are the cache's files, listed in the signed manifest with their hash and role
    for role, member in graphs.items():
        data = (GRAPHS[0] / member.removeprefix("models/")).read_bytes()
        assert bundle.members[member] == data and bundle.mode(member) == 0o644
        entry = bundle.manifest["models"][role]
        assert entry["member"] == member and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert bundle.manifest["models"]["backbone"]["input_size"] == 128
    assert bundle.mode(fmt.SITE_KEY) == 0o600 and bundle.site_id == "site-1"
    with tarfile.open(result.bundle_path) as tar:
        assert tar.getmember(fmt.SITE_KEY).mode == 0o600
    unit = bundle.members[fmt.SYSTEMD_UNIT].decode()
    assert "Restart=on-failure" in unit and "@EXEC@ run --config @PREFIX@/site.yaml" in unit
    assert "RestartPreventExitStatus=2" in unit.splitlines()  # a configuration error is not retried every 10 s
    site = yaml.safe_load(bundle.members[fmt.SITE_CONFIG])
    assert site["site_id"] == "site-1" and site["federation_id"] == cfg.federation_id
    assert site["species"] == SPECIES and site["num_classes"] == cfg.num_classes
    assert site["allow_non_private"] is False and site["allow_seeded_noise"] is False
    assert (site["backbone"], site["embedding_input_size"], site["model_dir"]) == ("efficientnet-lite0", 128, "models")
    # enrolled with the public half of the bundled private key
    site_key = load_private_key_from_bytes(bundle.members[fmt.SITE_KEY])
    assert SiteRegistry(store).get_public_key("site-1") == site_key.public_key()
    assert SiteRegistry(store).get("site-1").capacity == 3


def load_private_key_from_bytes(pem: bytes):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(pem, password=None)


def test_private_key_is_not_stored_at_the_coordinator(fed, sdk_wheel, tmp_path) -> None:
    cfg, store = fed
    result = provision(fed, sdk_wheel, tmp_path)
    secret = read_bundle(result.bundle_path).members[fmt.SITE_KEY]
    body = b"".join(secret.splitlines()[1:-1])  # base64 body, whatever the line breaks
    store.dispose()
    for path in cfg.data_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret not in data and body not in data.replace(b"\n", b""), path


def test_enrolment_failure_leaves_no_bundle(fed, sdk_wheel, tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(EnrolmentError):
        provision_site(config=fed[0], store=fed[1], site_id="site-1", profile="x86-cpu-gateway",
                       out=out / "b.tar", wheel=sdk_wheel, metadata={"capacity": -1}, graph_cache=GRAPHS[0])
    assert not out.exists() or list(out.iterdir()) == []
    assert not SiteRegistry(fed[1]).is_enrolled("site-1")
    provision(fed, sdk_wheel, tmp_path)
    with pytest.raises(EnrolmentError, match="already enrolled"):
        provision(fed, sdk_wheel, tmp_path, out=out / "again.tar")
    assert not (out / "again.tar").exists()


def test_replace_gives_an_enrolled_site_a_new_bundle_whose_key_alone_is_valid(fed, sdk_wheel, tmp_path) -> None:
    first = provision(fed, sdk_wheel, tmp_path)
    again = provision(fed, sdk_wheel, tmp_path, out=tmp_path / "out" / "again.tar", replace=True)
    valid = SiteRegistry(fed[1]).verification_keys("site-1")
    assert [fp for fp, _ in valid] == [again.fingerprint] != [first.fingerprint]


def test_species_outside_the_federations_classes_are_refused_before_anything(fed, sdk_wheel, tmp_path) -> None:
    from shared.errors import ConfigError

    wide = [{"scientific_name": "Gallus gallus domesticus", "class_index": fed[0].num_classes,
             "iucn_category": "LC"}]
    with pytest.raises(ConfigError, match=r"class_index \d+ is not in 0\.\.") as err:
        provision_site(config=fed[0], store=fed[1], site_id="site-9", profile="x86-cpu-gateway", species=wide,
                       out=tmp_path / "out" / "s9.tar", wheel=sdk_wheel, metadata={"capacity": 3},
                       graph_cache=GRAPHS[0])
    assert err.value.field == "species.class_index" and "num_classes" in str(err.value)
    assert not SiteRegistry(fed[1]).is_enrolled("site-9") and not (tmp_path / "out" / "s9.tar").exists()


def test_bundle_write_failure_rolls_back_the_enrolment(fed, sdk_wheel, tmp_path, monkeypatch) -> None:
    import coordinator.provisioning as provisioning

    def fail(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(provisioning.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        provision(fed, sdk_wheel, tmp_path)
    assert not SiteRegistry(fed[1]).is_enrolled("site-1")
    assert list((tmp_path / "out").iterdir()) == []


def test_bad_profile_or_site_id_fail_before_anything(fed, sdk_wheel, tmp_path) -> None:
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="not found"):
        provision(fed, sdk_wheel, tmp_path, profile="toaster")
    with pytest.raises(EnrolmentError):
        provision(fed, sdk_wheel, tmp_path, site_id="bad/site")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_cli_provision(tmp_path, sdk_wheel, graph_cache, monkeypatch) -> None:
    from coordinator.cli import app as coordinator_app

    monkeypatch.setenv("WILDFED_CACHE", str(graph_cache))  # the CLI ships the graphs of the WildFed cache

    runner = CliRunner()
    assert runner.invoke(coordinator_app, ["init", str(tmp_path / "fed"), "--federation-id", "f1"]).exit_code == 0
    species = tmp_path / "species.yaml"
    species.write_text(yaml.safe_dump(SPECIES))
    args = ["provision", "site-9", "--profile", "jetson-orin-nano", "--config", str(tmp_path / "fed/coordinator.yaml"),
            "--out", str(tmp_path / "site-9.tar"), "--wheel", str(sdk_wheel), "--species", str(species)]
    result = runner.invoke(coordinator_app, args)
    assert result.exit_code == 0, result.output
    assert "provisioned" in result.output and read_bundle(tmp_path / "site-9.tar").manifest["profile"] == \
        "jetson-orin-nano"
    # init's config has no federation species table: the operator is told what the bundle cannot name
    assert "the coordinator config has no species table" in " ".join(result.output.split())
    again = runner.invoke(coordinator_app, args)
    assert again.exit_code == 2 and "already enrolled" in again.output


# -- installing ---------------------------------------------------------------------------------------------------
def _rewrite(src: Path, dst: Path, change) -> None:
    """Copy a bundle tar member by member, letting ``change(name, data) -> (name, data) | None`` edit each."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for info in tin:
            data = tin.extractfile(info).read()
            out = change(info.name, data)
            if out is None:
                continue
            name, data = out
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), info.mode
            tout.addfile(ti, io.BytesIO(data))


def test_install_fast_path_writes_a_runnable_site(fed, sdk_wheel, tmp_path) -> None:
    from edge_sdk.bundle import install_bundle
    from edge_sdk.config import load_site_config

    result = provision(fed, sdk_wheel, tmp_path, profile="radio-base-station")
    prefix = tmp_path / "gw"
    installed = install_bundle(result.bundle_path, prefix=prefix, venv=False, service_user="ranger")
    assert os.stat(prefix / "keys/site.key").st_mode & 0o777 == 0o600
    load_private_key(prefix / "keys/site.key")  # the mode check of shared.keys passes
    for folder in ("state", "cache/artifacts", "cache/engines", "data"):
        assert (prefix / folder).is_dir()
    unit = installed.unit.read_text()
    assert f"ExecStart={sys.executable} -m edge_sdk.cli run --config {prefix.resolve()}/site.yaml" in unit
    assert "User=ranger" in unit and "MemoryMax=1024M" in unit and "@" not in unit
    cfg = load_site_config(installed.site_config)
    assert cfg.private_key == (prefix / "keys/site.key").resolve() and cfg.profile.endswith("profile.yaml")
    assert any("Camtrap DP" in w for w in installed.warnings)
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="installed here already"):
        install_bundle(result.bundle_path, prefix=prefix, venv=False)
    install_bundle(result.bundle_path, prefix=prefix, venv=False, force=True)


def test_tampered_member_is_refused_and_nothing_written(fed, sdk_wheel, tmp_path) -> None:
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path)
    evil = tmp_path / "evil.tar"
    _rewrite(result.bundle_path, evil, lambda n, d: (n, d.replace(b"site_id: site-1", b"site_id: site-2"))
             if n == fmt.SITE_CONFIG else (n, d))
    with pytest.raises(BundleError, match="SHA-256") as info:
        install_bundle(evil, prefix=tmp_path / "gw", venv=False)
    assert info.value.field == fmt.SITE_CONFIG
    assert not (tmp_path / "gw").exists()
    # a rewritten manifest no longer matches its signature
    _rewrite(result.bundle_path, evil, lambda n, d: (n, d.replace(b'"site-1"', b'"site-2"'))
             if n == fmt.MANIFEST else (n, d))
    with pytest.raises(BundleError, match="signature"):
        read_bundle(evil)
    # an extra, unlisted member
    def add_member(n, d):
        return (n, d)

    _rewrite(result.bundle_path, evil, add_member)
    with tarfile.open(evil, "a") as tar:
        ti = tarfile.TarInfo("extra.sh")
        ti.size = 3
        tar.addfile(ti, io.BytesIO(b"rm\n"))
    with pytest.raises(BundleError, match="unlisted"):
        read_bundle(evil)
    # the CLI refuses with exit status 2
    from edge_sdk.cli import app as edge_app

    cli = CliRunner().invoke(edge_app, ["install-bundle", str(evil), "--prefix", str(tmp_path / "gw"), "--no-venv"])
    assert cli.exit_code == 2 and not (tmp_path / "gw").exists()


def test_coordinator_key_pinning(fed, sdk_wheel, tmp_path) -> None:
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path)
    fingerprint = read_bundle(result.bundle_path).coordinator_fingerprint
    assert fingerprint == result.coordinator_fingerprint
    with pytest.raises(BundleError, match="does not match"):
        install_bundle(result.bundle_path, prefix=tmp_path / "gw", venv=False, coordinator_fingerprint="ab" * 32)
    assert not (tmp_path / "gw").exists()
    install_bundle(result.bundle_path, prefix=tmp_path / "gw", venv=False, coordinator_fingerprint=fingerprint[:16])


@pytest.mark.parametrize("name", ["../evil", "keys/../../evil", "/etc/passwd", "./site.yaml", "a//b", "a\\b"])
def test_unsafe_member_names_are_refused(name: str) -> None:
    with pytest.raises(BundleError):
        check_member_name(name)


@pytest.mark.parametrize("kind", ["traversal", "absolute", "symlink", "hardlink"])
def test_path_traversal_and_links_are_refused(fed, sdk_wheel, tmp_path, kind: str) -> None:
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path)
    evil = tmp_path / "evil.tar"
    shutil.copy(result.bundle_path, evil)
    with tarfile.open(evil, "a") as tar:
        if kind in ("traversal", "absolute"):
            ti = tarfile.TarInfo("../../outside.txt" if kind == "traversal" else "/tmp/outside.txt")
            ti.size = 2
            tar.addfile(ti, io.BytesIO(b"x\n"))
        else:
            ti = tarfile.TarInfo("keys/link")
            ti.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
            ti.linkname = "/etc/passwd" if kind == "symlink" else fmt.SITE_KEY
            tar.addfile(ti)
    with pytest.raises(BundleError):
        install_bundle(evil, prefix=tmp_path / "gw", venv=False)
    assert not (tmp_path / "gw").exists() and not (tmp_path / "outside.txt").exists()


# -- one round from an installed bundle ---------------------------------------------------------------------------
class _EdgeOverBus:
    """The edge Transport interface over the coordinator's in-memory bus (both sides in one process)."""

    def __init__(self, bus) -> None:
        self.bus, self.listeners = bus, []

    def connect(self, timeout_s: float = 10.0) -> None:
        for listener in self.listeners:
            listener()

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        self.bus.publish(topic, payload, qos)

    def subscribe(self, topic_filter: str, callback) -> None:
        self.bus.subscribe(topic_filter, callback)

    def add_connect_listener(self, listener) -> None:
        self.listeners.append(listener)

    def close(self) -> None:
        pass


def _install_with_data(fed, sdk_wheel, tmp_path) -> tuple[Path, object]:
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path, profile="radio-base-station")  # torch on CPU: no ORT artifacts
    prefix = tmp_path / "gw"
    installed = install_bundle(result.bundle_path, prefix=prefix, venv=False)
    write_package(prefix / "data" / "camtrap")  # the operator puts the site's Camtrap DP package in place
    return prefix, installed


def test_installed_bundle_trains_one_round_in_memory(fed, sdk_wheel, tmp_path) -> None:
    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport
    from edge_sdk.agent import EdgeAgent

    cfg, _ = fed
    prefix, installed = _install_with_data(fed, sdk_wheel, tmp_path)
    bus = InMemoryTransport()
    agent = EdgeAgent.from_config(installed.site_config, transport=_EdgeOverBus(bus))
    agent.start()
    trained: list[int] = []
    worker = threading.Thread(target=lambda: trained.append(agent.run(max_rounds=1, idle_timeout_s=60)))
    worker.start()
    with Coordinator(cfg, transport=bus) as coord:
        results = coord.run(1)
    worker.join(timeout=60)
    agent.close()
    assert trained == [1]
    assert results[0].status == "closed" and results[0].accepted == ("site-1",)
    assert agent.stats["acks_accepted"] == 1 and (prefix / "state" / "outbox.sqlite").is_file()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.broker
def test_installed_bundle_runs_as_wildfed_edge_process_over_mosquitto(tmp_path, sdk_wheel) -> None:
    if not _port_open(1883):
        pytest.skip("no MQTT broker on 127.0.0.1:1883 (start mosquitto to run this test)")
    from coordinator.service import Coordinator

    fed_id = f"prov{uuid.uuid4().hex[:10]}"
    cfg = make_config(tmp_path, federation_id=fed_id, broker_url="mqtt://127.0.0.1:1883", round_deadline_s=90.0,
                      rounds=1, local_steps=2, expected_batch_size=2)
    key = generate_signing_key()
    save_private_key(key, cfg.signing_key_path)
    save_public_key(key.public_key(), cfg.public_key_path)
    store = Store(cfg.database_url, cfg.data_dir)
    try:
        prefix, installed = _install_with_data((cfg, store), sdk_wheel, tmp_path)
    finally:
        store.dispose()
    ready = tmp_path / "ready"
    cmd = shlex.split(installed.executable) + ["run", "--config", str(installed.site_config), "--max-rounds", "1",
                                               "--idle-timeout", "120", "--ready-file", str(ready)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.stdout.read() if proc.poll() is not None else "gateway not ready in 60 s"
        with Coordinator(cfg) as coord:
            results = coord.run(1)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert results[0].status == "closed" and results[0].accepted == ("site-1",), output
    assert proc.returncode == 0 and "rounds trained: 1" in output, output


@pytest.mark.slow
def test_install_into_a_real_venv_without_downloads(fed, sdk_wheel, tmp_path) -> None:
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path)
    prefix = tmp_path / "gw"
    installed = install_bundle(result.bundle_path, prefix=prefix, venv=True, system_site_packages=True,
                               no_deps=True)
    venv_python = prefix / "venv" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import edge_sdk, torch; print(edge_sdk.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(prefix / "venv") in where
    # the unit starts the launcher of the stable version (signed updates), which runs the current version
    assert installed.executable == shlex.join([str(prefix.resolve() / "stable" / "bin" / "python"), "-m",
                                               "edge_sdk.updates.launch", "--prefix", str(prefix.resolve())])
    assert (prefix / "current").resolve() == (prefix / "stable").resolve() == (prefix / "venv").resolve()
    write_package(prefix / "data" / "camtrap")
    check = subprocess.run([*shlex.split(installed.executable), "check-config", str(installed.site_config)],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"ExecStart={installed.executable} run" in installed.unit.read_text()


@pytest.mark.slow
def test_install_with_the_backend_offline_from_a_wheel_folder(fed, sdk_wheel, tmp_path) -> None:
    """The real pip commands: the SDK wheel, then `wildfed[edge-ort]` for the x86 CPU profile
    (backend auto) with --no-index --find-links: every dependency is found without an index (here they are the
    parent environment's, seen through --system-site-packages), and the installed gateway's backend imports."""
    from edge_sdk.bundle import install_bundle

    result = provision(fed, sdk_wheel, tmp_path)  # x86-cpu-gateway
    prefix, wheelhouse = tmp_path / "gw", tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    installed = install_bundle(result.bundle_path, prefix=prefix, venv=True, system_site_packages=True,
                               find_links=(wheelhouse,))
    assert not [w for w in installed.warnings if "training backend" in w], installed.warnings
    venv_python = prefix / "venv" / "bin" / "python"
    probe = subprocess.run([str(venv_python), "-c", "import edge_sdk; from edge_sdk.profiles import "
                            "backend_import_problem as p; print(edge_sdk.__file__); print(p('auto') or 'ok')"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert str(prefix / "venv") in probe[0] and probe[1] == "ok"


def test_the_bundles_site_yaml_carries_the_coordinators_plan(fed, sdk_wheel, tmp_path) -> None:
    import yaml as _yaml

    cfg = fed[0]
    result = provision(fed, sdk_wheel, tmp_path)
    site = _yaml.safe_load(read_bundle(result.bundle_path).members[fmt.SITE_CONFIG])
    assert site["federation_plan"] == {
        "rounds": cfg.rounds, "local_steps": cfg.local_steps, "expected_batch": cfg.expected_batch_size,
        "target_delta": cfg.target_delta, "clipping_norm": cfg.clipping_norm, "variant": cfg.ccdp_variant,
        "budgets": {c.value: e for c, e in cfg.budgets().items()},
        "capacity": 3}  # the site's declared capacity (its enrolment metadata), by which its rounds' rates divide
    assert site["federation_plan"]["budgets"]["VU"] == 1.0  # the test config's anchor (from_anchor VU 1.0)


def test_the_bundles_site_yaml_names_every_class_of_the_federations_species_table(tmp_path) -> None:
    import yaml as _yaml

    from coordinator.site_config import render_site_config
    from edge_sdk.config import SiteConfig
    from shared.profiles import load_profile

    federation = [*SPECIES, {"scientific_name": "Prionailurus bengalensis", "class_index": 7, "iucn_category": "LC"}]
    cfg = make_config(tmp_path, num_classes=12, species=federation)
    text = render_site_config(config=cfg, profile=load_profile("x86-cpu-gateway"), profile_file="profile.yaml",
                              site_id="site-1", broker_url="mqtt://127.0.0.1:1883", species=SPECIES[:1], dataset=None)
    site = _yaml.safe_load(text)
    assert site["class_names"] == {0: "Loxodonta cyclotis", 1: "Equus quagga", 7: "Prionailurus bengalensis"}
    # the gateway reads it: a class the site does not list is named, the site's own rows on top
    parsed = SiteConfig.model_validate({**site, "species": SPECIES[:1]})
    assert parsed.names_by_class[7] == "Prionailurus bengalensis" and parsed.names_by_class[0] == "Loxodonta cyclotis"
    # without a federation species table there is nothing to name
    plain = _yaml.safe_load(render_site_config(
        config=make_config(tmp_path), profile=load_profile("x86-cpu-gateway"), profile_file="profile.yaml",
        site_id="site-1", broker_url="mqtt://127.0.0.1:1883", species=SPECIES, dataset=None))
    assert "class_names" not in plain
