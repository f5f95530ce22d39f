"""Gateway profiles: every shipped profile validates; broken ones report every problem with its field;
``wildfed-edge check-config`` exit codes; ``wildfed-edge doctor``; profile fitting on fake machines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.keys import generate_signing_key, save_private_key, save_public_key
from shared.profiles import PROFILES_DIR, GatewayKind, GatewayProfile, profile_problems

from edge_sdk.cli import app
from edge_sdk.doctor import MachineReport, Probe, detect_kind, rank_profiles
from edge_sdk.profiles import FirmwareProfile, available_profiles, load_profile, resolve_backend

from .conftest import write_package

SHIPPED = available_profiles(PROFILES_DIR)


def raw(name: str) -> dict:
    return yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_validates(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile, FirmwareProfile) and profile.name == name
    assert profile_problems(raw(name)) == []
    assert profile.privacy.allow_non_private is False and profile.privacy.allow_seeded_noise is False
    assert not profile.identity.private_key.is_absolute()
    result = CliRunner().invoke(app, ["check-config", str(PROFILES_DIR / f"{name}.yaml")])
    assert result.exit_code == 0 and "OK" in result.output, result.output


def test_shipped_profiles_cover_every_gateway_kind_with_sensible_hardware() -> None:
    profiles = {load_profile(n).kind: load_profile(n) for n in SHIPPED}
    assert set(profiles) == set(GatewayKind) and len(SHIPPED) >= 5
    for kind in (GatewayKind.JETSON_ORIN_NANO, GatewayKind.JETSON_XAVIER_NX):
        assert profiles[kind].training.backend.value in ("torch", "auto")  # no aarch64 ORT training wheel
        assert profiles[kind].inference.engine.value == "tensorrt"
    for kind in (GatewayKind.X86_CPU, GatewayKind.RADIO_BASE_STATION):
        assert profiles[kind].device == "cpu" and profiles[kind].inference.engine.value == "ort-cpu"
    assert profiles[GatewayKind.X86_CPU].training.backend.value == "auto"
    # the agent's flat view (edge_sdk.rounds.backends.build_backend reads these)
    rbs = profiles[GatewayKind.RADIO_BASE_STATION]
    assert (rbs.backend, rbs.device, rbs.threads, rbs.microbatch_size) == ("torch", "cpu", 2, 16)


def test_broken_profile_reports_every_problem_with_its_field() -> None:
    data = raw("jetson-orin-nano")
    data.update(threads=0, memory_cap_mib=16, surprise=True)
    data["training"] = {"backend": "ort", "device": "cuda", "microbatch_size": 64}  # Jetson + ort, ort + cuda
    data["inference"] = {"engine": "warp-drive", "precision": "fp16", "batch_size": 0}
    data["identity"] = {"private_key": "../../etc/site.key", "coordinator_public_key": "/etc/coord.pub"}
    data["broker"] = {"url": "http://broker", "client_cert": "tls/client.pem"}
    fields = {f for f, _ in profile_problems(data)}
    assert fields == {"threads", "memory_cap_mib", "surprise", "training.backend", "training.device",
                      "inference.engine", "inference.batch_size", "identity.private_key",
                      "identity.coordinator_public_key", "broker.url", "broker.client_key"}


@pytest.mark.parametrize("kind,changes,field", [
    ("x86_cpu", {"training": {"device": "cuda"}}, "training.device"),
    ("radio_base_station", {"inference": {"engine": "tensorrt", "precision": "fp16"}}, "inference.engine"),
    ("x86_gpu", {"inference": {"engine": "ort-cpu", "precision": "fp16"}}, "inference.precision"),
    ("x86_gpu", {"inference": {"engine": "ort-cuda", "precision": "int8"}}, "inference.precision"),
    ("jetson_xavier_nx", {"training": {"backend": "ort"}}, "training.backend"),
    ("x86_gpu", {"broker": {"client_key": "k.pem"}}, "broker.client_cert"),
    ("x86_gpu", {"storage": {"data": "../outside"}}, "storage.data"),
    ("x86_gpu", {"name": "bad name"}, "name"),
])
def test_cross_field_rules_name_the_field(kind: str, changes: dict, field: str) -> None:
    data = {"name": "p", "kind": kind, **changes}
    problems = profile_problems(data)
    assert [f for f, _ in problems] == [field], problems
    with pytest.raises(Exception):
        GatewayProfile.model_validate(data)


def test_load_profile_error_names_file_and_lists_fields(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"name": "broken", "kind": "toaster", "threads": -1}))
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert info.value.source == str(path) and "kind" in str(info.value) and "threads" in str(info.value)
    with pytest.raises(ConfigError, match="not found"):
        load_profile("toaster")


def test_auto_backend_resolves_on_this_machine(monkeypatch) -> None:
    import edge_sdk.backends.base as base
    import edge_sdk.profiles as profiles

    monkeypatch.setattr(profiles, "ort_training_importable", lambda: True)
    monkeypatch.setattr(base, "available_backends", lambda: ("ort", "torch"))
    assert resolve_backend("auto") == "ort" and resolve_backend("torch") == "torch"
    cpu = load_profile("x86-cpu-gateway")
    assert cpu.backend == "auto" and cpu.resolved_backend == "ort" and cpu.device == "cpu"
    monkeypatch.setattr(base, "available_backends", lambda: ("torch",))  # ORT imports, no ort backend registered
    assert resolve_backend("auto") == "torch"
    monkeypatch.setattr(profiles, "ort_training_importable", lambda: False)
    monkeypatch.setattr(base, "available_backends", lambda: ("ort", "torch"))
    assert resolve_backend("auto") == "torch"


# -- check-config -------------------------------------------------------------------------------------------------
def test_check_config_lists_every_profile_error_and_exits_2(tmp_path: Path) -> None:
    data = raw("x86-gpu-gateway")
    data.update(threads=0, kind="x86_cpu")  # x86_cpu + cuda + tensorrt: three problems besides threads
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["check-config", str(path)], terminal_width=200)
    assert result.exit_code == 2
    for field in ("threads", "training.device", "inference.engine"):
        assert field in result.output, result.output
    assert "4 problem(s)" in result.output or "3 problem(s)" in result.output


def _site(tmp_path: Path, **changes) -> Path:
    key = generate_signing_key()
    save_private_key(key, tmp_path / "keys" / "site.key")
    save_public_key(key.public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    body = {"federation_id": "fed1", "site_id": "site-1", "dataset": "pkg",
            "species": [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
                        {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}],
            "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
            "outbox": "state/outbox.sqlite", "profile": "x86-cpu-gateway", **changes}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_check_config_site_ok_and_every_error(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["check-config", str(_site(tmp_path))], terminal_width=200)
    assert ok.exit_code == 0 and "valid site config" in ok.output, ok.output
    bad = _site(tmp_path, site_id="bad/id", threads=0, broker_url="http://x", surprise=1)
    result = runner.invoke(app, ["check-config", str(bad)], terminal_width=200)
    assert result.exit_code == 2
    for field in ("site_id", "threads", "broker_url", "surprise"):
        assert field in result.output, result.output
    missing = _site(tmp_path, dataset="nowhere", coordinator_public_key="keys/absent.pub", profile="toaster")
    result = runner.invoke(app, ["check-config", str(missing)], terminal_width=200)
    assert result.exit_code == 2
    for field in ("dataset", "coordinator_public_key", "profile"):
        assert field in result.output, result.output
    schema_only = runner.invoke(app, ["check-config", "--schema-only", str(_site(tmp_path, dataset="nowhere"))])
    assert schema_only.exit_code == 0, schema_only.output


def test_check_config_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["check-config", str(tmp_path / "absent.yaml")]).exit_code == 2
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    assert runner.invoke(app, ["check-config", str(tmp_path / "bad.yaml")]).exit_code == 2


# -- doctor -------------------------------------------------------------------------------------------------------
def test_doctor_prints_machine_and_profile_tables() -> None:
    result = CliRunner().invoke(app, ["doctor"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in ("this machine", "torch", "onnxruntime.training", "tensorrt", "nvidia-smi", "jetson", "profiles",
                 "x86-cpu-gateway"):
        assert text in result.output, text
    assert "recommended profile" in result.output or "no profile fits" in result.output


def _machine(*, arch: str = "x86_64", jetson: str | None = None, cuda: bool = False, trt: bool = False,
             ort_training: bool = False) -> MachineReport:
    probes = (Probe("training", "torch", True), Probe("training", "onnxruntime.training", ort_training),
              Probe("inference", "onnxruntime", True), Probe("inference", "tensorrt", trt))
    return MachineReport(probes=probes, arch=arch, jetson_model=jetson, torch_cuda=cuda,
                         gpus=("GPU",) if cuda else ())


@pytest.mark.parametrize("machine,best,kind", [
    (_machine(), "x86-cpu-gateway", GatewayKind.X86_CPU),
    (_machine(cuda=True, trt=True), "x86-gpu-gateway", GatewayKind.X86_GPU),
    (_machine(arch="aarch64", jetson="NVIDIA Jetson Orin Nano Developer Kit", cuda=True, trt=True),
     "jetson-orin-nano", GatewayKind.JETSON_ORIN_NANO),
    (_machine(arch="aarch64", jetson="NVIDIA Jetson Xavier NX Developer Kit", cuda=True),
     "jetson-xavier-nx", GatewayKind.JETSON_XAVIER_NX),
])
def test_rank_profiles_picks_the_machines_kind(machine: MachineReport, best: str, kind: GatewayKind) -> None:
    profiles = [load_profile(n) for n in SHIPPED]
    assert detect_kind(machine) is kind
    fits = rank_profiles(machine, profiles)
    assert fits[0].name == best and fits[0].fits, fits
    jetson_on_x86 = next(f for f in rank_profiles(_machine(), profiles) if f.name == "jetson-orin-nano")
    assert not jetson_on_x86.fits and any("cuda" in p for p in jetson_on_x86.problems)


def test_rank_profiles_warns_when_tensorrt_is_missing() -> None:
    fits = rank_profiles(_machine(cuda=True, trt=False), [load_profile("x86-gpu-gateway")])
    assert fits[0].fits and any("tensorrt" in w for w in fits[0].warnings)


def test_check_config_reports_a_species_the_table_lacks(tmp_path: Path) -> None:
    """check-config loads the package as `run` would: an observed species missing from the table is reported."""
    site = _site(tmp_path, species=[{"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}])
    result = CliRunner().invoke(app, ["check-config", str(site)], terminal_width=200)
    assert result.exit_code == 2
    assert "dataset" in result.output and "Loxodonta cyclotis" in result.output


# -- error messages that name the allowed fields and values, and the fix ---------------------------------------
WIDE = {"COLUMNS": "1000"}  # rich reads it: no wrapping inside table cells


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_check_config_profile_errors_name_allowed_fields_values_and_the_fix(tmp_path: Path) -> None:
    data = raw("x86-cpu-gateway")
    data.update(name="other-box", surprise=True, kind="toaster")
    data["training"] = {"backnd": "torch", "device": "gpu"}
    path = tmp_path / "my-box.yaml"
    path.write_text(yaml.safe_dump(data))

    result = CliRunner().invoke(app, ["check-config", "--kind", "profile", str(path)], env=WIDE)
    out = _flat(result.output)

    assert result.exit_code == 2, out
    assert "Extra inputs are not permitted" not in out and "String should match pattern" not in out
    # unknown keys: the allowed fields of their section, and the likely intended one
    assert ("unknown field 'backnd' in training; allowed fields there: backend, device, microbatch_size; fix: "
            "rename it to 'backend'") in out
    assert ("unknown field 'surprise' at the top level; allowed fields there: name, kind, description, training, "
            "inference, memory_cap_mib, threads, storage, broker, identity, privacy; fix: remove it") in out
    # enum and pattern fields: the allowed values in words
    assert ("'toaster' is not allowed; allowed values: jetson_orin_nano, jetson_xavier_nx, x86_gpu, x86_cpu, "
            "radio_base_station") in out
    assert "'gpu' is not allowed: it must be cpu, cuda or cuda:N" in out
    # the name is checked against the file name
    assert ("'other-box' differs from the file name 'my-box.yaml'; fix: set `name: my-box`, or rename the file to "
            "'other-box.yaml'") in out


def test_load_profile_checks_the_name_against_the_file(tmp_path: Path) -> None:
    data = raw("radio-base-station")
    (tmp_path / "rbs-2.yaml").write_text(yaml.safe_dump(data))  # name: radio-base-station
    with pytest.raises(ConfigError) as info:
        load_profile(tmp_path / "rbs-2.yaml")
    assert info.value.field == "name" and "differs from the file name 'rbs-2.yaml'" in str(info.value)
    # the copy a bundle installs as <prefix>/profile.yaml keeps the original name
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(data))
    assert load_profile(tmp_path / "profile.yaml").name == "radio-base-station"
    # a renamed copy whose name matches loads
    data["name"] = "rbs-2"
    (tmp_path / "rbs-2.yaml").write_text(yaml.safe_dump(data))
    assert load_profile(tmp_path / "rbs-2.yaml").name == "rbs-2"


def test_missing_and_non_mapping_fields_say_what_to_write() -> None:
    problems = dict(profile_problems({"kind": "x86_cpu", "inference": 5}))
    assert problems["name"] == "required field 'name' is missing; fix: add `name: ...`"
    assert problems["inference"].startswith("must be a mapping (key: value lines) with some of: engine, precision, "
                                            "batch_size; got 5")
    assert dict(profile_problems({"name": "p"}))["kind"] == (
        "required field 'kind' is missing; fix: add `kind: ...` (one of: jetson_orin_nano, jetson_xavier_nx, "
        "x86_gpu, x86_cpu, radio_base_station)")


# -- site config errors: the one config formatter, named fields, the backend `run` refuses ---------------------
def test_check_config_refuses_an_unknown_backend_like_run_does(tmp_path: Path) -> None:
    from edge_sdk.rounds.backends import build_backend
    from edge_sdk.backends import available_backends
    from edge_sdk.config import load_site_config

    site = _site(tmp_path, backend="onnx[gpu]")
    result = CliRunner().invoke(app, ["check-config", str(site)], env=WIDE)
    out = _flat(result.output)
    assert result.exit_code == 2, out
    assert "backend" in out and "unknown training backend 'onnx[gpu]'" in out, out
    for name in available_backends():  # the allowed names, as `run` lists them
        assert name in out
    with pytest.raises(ConfigError) as run_error:  # what `run` stops with: the same field and message
        build_backend(load_site_config(site))
    assert run_error.value.field == "backend" and "unknown training backend 'onnx[gpu]'" in run_error.value.message


def test_site_config_errors_name_the_field_and_the_allowed_fields(tmp_path: Path) -> None:
    from edge_sdk.config import load_site_config

    # a check across fields (chunk size vs the broker's limit) names its field, not <root>
    big = _site(tmp_path, chunk_size_bytes=200_000, broker_max_packet_bytes=100_000)
    out = _flat(CliRunner().invoke(app, ["check-config", str(big)], env=WIDE).output)
    assert "<root>" not in out and "chunk_size_bytes" in out, out
    with pytest.raises(ConfigError) as err:
        load_site_config(big)
    assert err.value.field == "chunk_size_bytes"
    # 100000 - 40 (chunk header) - 256 (MQTT header) = 99704 is the largest chunk that fits
    assert "99704" in str(err.value) and "Value error" not in str(err.value)
    # an unknown field: the allowed fields and the nearest one, not pydantic's "Extra inputs are not permitted"
    typo = _site(tmp_path, chunk_size_byte=1024)
    with pytest.raises(ConfigError) as err:
        load_site_config(typo)
    text = str(err.value)
    assert err.value.field == "chunk_size_byte" and "Extra inputs" not in text
    assert "unknown field 'chunk_size_byte' at the top level" in text and "rename it to 'chunk_size_bytes'" in text
    assert "allowed fields there: federation_id, site_id," in text
    # our own validators' messages lose pydantic's "Value error, " prefix and keep the field
    with pytest.raises(ConfigError) as err:
        load_site_config(_site(tmp_path, broker_url="http://x"))
    assert err.value.field == "broker_url" and "Value error" not in str(err.value)
    assert "must look like mqtt://host:port" in str(err.value)


def test_check_config_reports_merged_media_rows_as_one_log_line_not_a_python_warning(tmp_path: Path) -> None:
    """No check-config or run on the demo sites prints a UserWarning with its source line.
    Through the installed CLI in a subprocess (where Python prints warnings): one log line, no source line."""
    import csv
    import os
    import subprocess
    import sys

    site = _site(tmp_path)
    pkg = tmp_path / "pkg"
    for table, row in (("media", {"mediaID": "m9", "deploymentID": "d1", "filePath": "media/sub/m1.png",
                                  "fileName": "m9.png", "captureMethod": "activityDetection",
                                  "timestamp": "2024-01-02T00:00:00Z", "filePublic": "true",
                                  "fileMediatype": "image/png"}),
                       ("observations", {"observationID": "o9", "mediaID": "m9", "observationLevel": "media",
                                         "observationType": "animal", "scientificName": "Loxodonta cyclotis",
                                         "count": "1"})):
        path = pkg / f"{table}.csv"
        with open(path, newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh))
        with open(path, "a", newline="", encoding="utf-8") as fh:
            csv.DictWriter(fh, fieldnames=header, restval="", lineterminator="\n").writerow(row)
    env = {**os.environ, "COLUMNS": "1000", "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-m", "edge_sdk.cli", "check-config", str(site)], capture_output=True,
                          text=True, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "UserWarning" not in out and "warnings.warn" not in out and "camtrap_dp.py:" not in out, out
    lines = [line for line in out.splitlines() if "media row(s) show an image already listed" in line]
    assert len(lines) == 1 and "1 media row(s)" in lines[0], out
