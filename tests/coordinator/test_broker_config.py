"""Broker configuration from the registry (coordinator/broker_config.py and its parts): ACL, mosquitto.conf, password file, TLS
material, idempotence and errors. Real-broker behaviour is tested in tests/edge/test_mqtt_tls.py."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.keys import generate_signing_key, public_key_to_pem

from shared.broker import load_broker_credentials

from coordinator.broker_acl import render_acl
from coordinator.broker_config import generate_broker_config
from coordinator.broker_passwords import hash_password_pbkdf2, verify_password_pbkdf2
from coordinator.broker_tls import validate_hostname
from coordinator.mosquitto_conf import render_mosquitto_conf
from coordinator.registry import SiteRegistry
from coordinator.storage import Store

MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")

# The ACL for federation "f" and sites "b", "a", written out by hand from the specification in the brief
# (sites sorted by id; coordinator user first).
EXPECTED_ACL_TWO_SITES = """\
# Mosquitto ACL of WildFed federation f, written by `wildfed-coordinator broker-config`.
# Mosquitto checks 'write' when a client publishes and 'read' when a message is delivered to it, against
# the message's topic (also for $share/... subscriptions). Regenerate rather than edit.

user coordinator-f
topic read wildfed/v1/f/site/+/update
topic read wildfed/v1/f/site/+/detection
topic read wildfed/v1/f/site/+/secagg
topic read wildfed/v1/f/site/+/status
topic read wildfed/v1/f/site/+/health
topic write wildfed/v1/f/site/+/task
topic write wildfed/v1/f/site/+/ack
topic write wildfed/v1/f/site/+/model
topic write wildfed/v1/f/site/+/model/#
topic write wildfed/v1/f/site/+/software
topic write wildfed/v1/f/site/+/software/#
topic write wildfed/v1/f/models/#

user site-a
topic write wildfed/v1/f/site/a/update
topic write wildfed/v1/f/site/a/detection
topic write wildfed/v1/f/site/a/secagg
topic write wildfed/v1/f/site/a/status
topic write wildfed/v1/f/site/a/health
topic read wildfed/v1/f/site/a/task
topic read wildfed/v1/f/site/a/ack
topic read wildfed/v1/f/site/a/model
topic read wildfed/v1/f/site/a/model/#
topic read wildfed/v1/f/site/a/software
topic read wildfed/v1/f/site/a/software/#
topic read wildfed/v1/f/models/#

user site-b
topic write wildfed/v1/f/site/b/update
topic write wildfed/v1/f/site/b/detection
topic write wildfed/v1/f/site/b/secagg
topic write wildfed/v1/f/site/b/status
topic write wildfed/v1/f/site/b/health
topic read wildfed/v1/f/site/b/task
topic read wildfed/v1/f/site/b/ack
topic read wildfed/v1/f/site/b/model
topic read wildfed/v1/f/site/b/model/#
topic read wildfed/v1/f/site/b/software
topic read wildfed/v1/f/site/b/software/#
topic read wildfed/v1/f/models/#
"""


# What broker-config writes for the same sites: each site also has its detection publisher's account
# (site-<id>@detect), which may write nothing but the site's detection topic; written out by hand.
EXPECTED_GENERATED_ACL_TWO_SITES = EXPECTED_ACL_TWO_SITES.replace(
    "topic read wildfed/v1/f/models/#\n\nuser site-b\n",
    "topic read wildfed/v1/f/models/#\n\nuser site-a@detect\ntopic write wildfed/v1/f/site/a/detection\n\nuser site-b\n").replace(
    "wildfed/v1/f/site/b/software/#\ntopic read wildfed/v1/f/models/#\n",
    "wildfed/v1/f/site/b/software/#\ntopic read wildfed/v1/f/models/#\n\nuser site-b@detect\ntopic write wildfed/v1/f/site/b/detection\n")

# Two ingest workers (ingest_workers: 2): each reads every site's update topic and writes every task and ack topic.
EXPECTED_WORKER_BLOCKS = """\
user coordinator-f@ingest-1
topic read wildfed/v1/f/site/+/update
topic write wildfed/v1/f/site/+/task
topic write wildfed/v1/f/site/+/ack

user coordinator-f@ingest-2
topic read wildfed/v1/f/site/+/update
topic write wildfed/v1/f/site/+/task
topic write wildfed/v1/f/site/+/ack
"""


def _registry(tmp_path: Path, sites=("a", "b")) -> SiteRegistry:
    reg = SiteRegistry(Store("sqlite://", tmp_path / "data"))
    for site in sites:
        reg.enrol(site, public_key_to_pem(generate_signing_key().public_key()))
    return reg


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_acl_for_two_sites_matches_the_hand_written_one() -> None:
    assert render_acl("f", ["b", "a"]) == EXPECTED_ACL_TWO_SITES


def test_conf_has_the_required_settings_and_absolute_paths(tmp_path: Path) -> None:
    text = render_mosquitto_conf(password_file=tmp_path / "passwd", acl_file=tmp_path / "acl",
                                 cafile=tmp_path / "ca.crt", certfile=tmp_path / "s.crt", keyfile=tmp_path / "s.key",
                                 tls_port=8883, client_certs=True, loopback_port=1884, persistence_dir=None,
                                 federation_id="f")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[:4] == ["per_listener_settings false", "allow_anonymous false", f"password_file {tmp_path}/passwd",
                         f"acl_file {tmp_path}/acl"]
    assert "max_packet_size 1115136" in lines[:lines.index("listener 8883")]  # global: (1 MiB + 64 KiB) + 1 KiB
    tls = lines.index("listener 8883")
    # client ids bound to usernames on every listener (a listener setting in Mosquitto 2.0)
    assert lines[tls:] == ["listener 8883", "protocol mqtt", f"cafile {tmp_path}/ca.crt",
                           f"certfile {tmp_path}/s.crt", f"keyfile {tmp_path}/s.key", "tls_version tlsv1.2",
                           "require_certificate true", "use_identity_as_username true", "use_username_as_clientid true",
                           "listener 1884 127.0.0.1", "protocol mqtt", "use_username_as_clientid true"]
    plain = render_mosquitto_conf(password_file=tmp_path / "p", acl_file=tmp_path / "a", cafile=tmp_path / "c",
                                  certfile=tmp_path / "s", keyfile=tmp_path / "k")
    assert "require_certificate" not in plain and "127.0.0.1" not in plain and "listener 8883\n" in plain
    with pytest.raises(ConfigError, match="absolute"):
        render_mosquitto_conf(password_file=Path("p"), acl_file=tmp_path, cafile=tmp_path, certfile=tmp_path,
                              keyfile=tmp_path)
    with pytest.raises(ConfigError, match="tls_port"):
        render_mosquitto_conf(password_file=tmp_path, acl_file=tmp_path, cafile=tmp_path, certfile=tmp_path,
                              keyfile=tmp_path, tls_port=70000)


def test_pbkdf2_hash_is_mosquittos_format() -> None:
    # Prepare: a fixed salt, so the expected line is computed independently with hashlib
    salt = bytes(range(12))
    expected = hashlib.pbkdf2_hmac("sha512", b"pw", salt, 101)
    # Execute
    line = hash_password_pbkdf2("pw", salt=salt)
    # Assert
    assert line == f"$7$101${base64.b64encode(salt).decode()}${base64.b64encode(expected).decode()}"
    assert verify_password_pbkdf2("pw", line) and not verify_password_pbkdf2("pW", line)
    assert not verify_password_pbkdf2("pw", "$6$abc$def")


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd is not installed")
def test_python_hash_verifies_mosquitto_passwd_output(tmp_path: Path) -> None:
    plain = tmp_path / "pw"
    plain.write_text("u1:s3cret\n")
    subprocess.run([MOSQUITTO_PASSWD, "-U", str(plain)], check=True, timeout=20)
    user, hashed = plain.read_text().strip().split(":", 1)
    assert user == "u1" and hashed.startswith("$7$")
    assert verify_password_pbkdf2("s3cret", hashed) and not verify_password_pbkdf2("other", hashed)


@pytest.mark.parametrize("use_binary", [True, False])
def test_generate_writes_everything_with_safe_modes(tmp_path: Path, use_binary: bool) -> None:
    if use_binary and MOSQUITTO_PASSWD is None:
        pytest.skip("mosquitto_passwd is not installed")
    reg = _registry(tmp_path)
    out = tmp_path / "out"
    res = generate_broker_config(registry=reg, federation_id="f", out=out, use_mosquitto_passwd=use_binary,
                                 client_certs=True)
    # files
    assert res.used_mosquitto_passwd is use_binary
    assert res.acl.read_text() == EXPECTED_GENERATED_ACL_TWO_SITES
    conf = res.conf.read_text()
    assert f"password_file {out / 'passwd'}" in conf and f"cafile {out / 'tls' / 'ca.crt'}" in conf
    for secret in (res.password_file, out / "tls" / "ca.key", res.server_key, res.coordinator_credentials,
                   *res.site_credentials.values(), out / "sites" / "a" / "client.key",
                   out / "coordinator" / "client.key", out / "sites" / "a" / "roles" / "detect" / "client.key"):
        assert _mode(secret) == 0o600, secret
    # credentials: one random password per account, and the password file verifies each
    creds = {s: load_broker_credentials(p) for s, p in res.site_credentials.items()}
    coord = load_broker_credentials(res.coordinator_credentials)
    detect = {s: load_broker_credentials(p, role="detect") for s, p in res.site_credentials.items()}
    assert {c.username for c in creds.values()} == {"site-a", "site-b"} and coord.username == "coordinator-f"
    assert {c.username for c in detect.values()} == {"site-a@detect", "site-b@detect"}
    assert len({c.password for c in [*creds.values(), *detect.values(), coord]}) == 5
    assert all(len(c.password) >= 40 for c in creds.values())
    lines = dict(ln.split(":", 1) for ln in res.password_file.read_text().splitlines())
    assert set(lines) == {"site-a", "site-b", "site-a@detect", "site-b@detect", "coordinator-f"}
    assert all(verify_password_pbkdf2(creds[s].password, lines[f"site-{s}"]) for s in ("a", "b"))
    assert all(verify_password_pbkdf2(detect[s].password, lines[f"site-{s}@detect"]) for s in ("a", "b"))
    assert "password" not in repr(coord).replace("password=<hidden>", "")
    # TLS: the server certificate names the default hosts and chains to the CA; client CN = username
    ca = x509.load_pem_x509_certificate(res.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(res.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(v) for v in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    client = x509.load_pem_x509_certificate((out / "sites" / "b" / "client.crt").read_bytes())
    client.verify_directly_issued_by(ca)
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-b"
    role_cert = x509.load_pem_x509_certificate((out / "sites" / "b" / "roles" / "detect" / "client.crt").read_bytes())
    role_cert.verify_directly_issued_by(ca)
    assert role_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-b@detect"
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (out / "sites" / "a" / "broker-ca.pem").read_bytes() == res.ca_cert.read_bytes()


def test_rerun_keeps_ca_certificates_and_credentials_and_adds_new_sites(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    out = tmp_path / "out"
    first = generate_broker_config(registry=reg, federation_id="f", out=out, client_certs=True)
    before = {p: p.read_bytes() for p in (first.ca_cert, first.server_cert, first.password_file,
                                          *first.site_credentials.values(), out / "sites" / "a" / "client.crt")}
    # Execute: unchanged registry, then one more site
    again = generate_broker_config(registry=reg, federation_id="f", out=out, client_certs=True)
    assert again.new_accounts == () and again.issued == ()
    assert all(p.read_bytes() == data for p, data in before.items())
    reg.enrol("c", public_key_to_pem(generate_signing_key().public_key()))
    third = generate_broker_config(registry=reg, federation_id="f", out=out, client_certs=True)
    # Assert
    assert third.new_accounts == ("site-c", "site-c@detect")
    assert third.issued == (out / "sites" / "c" / "client.crt", out / "sites" / "c" / "roles" / "detect" / "client.crt")
    assert first.ca_cert.read_bytes() == before[first.ca_cert]
    assert all(p.read_bytes() == before[p] for p in first.site_credentials.values())
    assert "user site-c" in third.acl.read_text()


def test_rotate_passwords_and_new_hostnames(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    out = tmp_path / "out"
    first = generate_broker_config(registry=reg, federation_id="f", out=out)
    old = load_broker_credentials(first.site_credentials["a"]).password
    old_server = first.server_cert.read_bytes()
    second = generate_broker_config(registry=reg, federation_id="f", out=out, rotate_passwords=True,
                                    hostnames=["broker.example.org", "10.0.0.5"])
    new = load_broker_credentials(second.site_credentials["a"]).password
    assert new != old and set(second.new_accounts) == {"site-a", "site-b", "site-a@detect", "site-b@detect",
                                                       "coordinator-f"}
    lines = dict(ln.split(":", 1) for ln in second.password_file.read_text().splitlines())
    assert verify_password_pbkdf2(new, lines["site-a"]) and not verify_password_pbkdf2(old, lines["site-a"])
    assert second.server_cert.read_bytes() != old_server and second.issued == (second.server_cert,)
    san = x509.load_pem_x509_certificate(second.server_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.example.org"]


def test_sites_without_a_valid_key_get_no_account(tmp_path: Path) -> None:
    reg = _registry(tmp_path, sites=("a", "b", "gone"))
    reg.revoke_key("gone")
    res = generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "out")
    assert res.acl.read_text() == EXPECTED_GENERATED_ACL_TWO_SITES and "gone" not in res.usernames


def test_existing_ca_is_used(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    made = generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "first")
    res = generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "second",
                                 ca_cert=made.ca_cert, ca_key=made.ca_cert.parent / "ca.key")
    assert res.ca_cert.read_bytes() == made.ca_cert.read_bytes()
    assert not (tmp_path / "second" / "tls" / "ca.key").exists()  # the operator's key is not copied
    ca = x509.load_pem_x509_certificate(made.ca_cert.read_bytes())
    x509.load_pem_x509_certificate(res.server_cert.read_bytes()).verify_directly_issued_by(ca)
    with pytest.raises(ConfigError, match="ca_cert"):
        generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "third", ca_cert=made.ca_cert)
    with pytest.raises(ConfigError, match="not a CA"):
        generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "fourth", ca_cert=made.server_cert,
                               ca_key=made.server_key)


def test_bad_input_names_field_and_fix(tmp_path: Path) -> None:
    empty = SiteRegistry(Store("sqlite://", tmp_path / "d0"))
    with pytest.raises(ConfigError) as exc:
        generate_broker_config(registry=empty, federation_id="f", out=tmp_path / "o")
    assert exc.value.field == "sites" and "enrol" in exc.value.fix
    reg = _registry(tmp_path)
    with pytest.raises(ConfigError) as exc:
        generate_broker_config(registry=reg, federation_id="f", out=tmp_path / "o", hostnames=["bad host!"])
    assert exc.value.field == "hostname" and "--hostname" in exc.value.fix
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as exc:
        generate_broker_config(registry=reg, federation_id="f", out=blocker / "sub")
    assert exc.value.field == "out" and "--out" in exc.value.fix
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot write"):
            generate_broker_config(registry=reg, federation_id="f", out=ro)
    assert validate_hostname("::1") == "::1" and validate_hostname("a-b.example.org") == "a-b.example.org"
    for bad in ("", "-a.org", "a..b", "x" * 64):
        with pytest.raises(ConfigError):
            validate_hostname(bad)


def test_cli_broker_config_and_no_password_in_output(tmp_path: Path) -> None:
    from coordinator.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["init", str(tmp_path / "c"), "--federation-id", "f"])
    assert result.exit_code == 0, result.output
    cfg = tmp_path / "c" / "coordinator.yaml"
    pub = tmp_path / "a.pub"
    pub.write_text(public_key_to_pem(generate_signing_key().public_key()))
    empty = runner.invoke(app, ["broker-config", "--out", str(tmp_path / "b"), "--config", str(cfg)])
    assert empty.exit_code == 2 and "sites" in empty.output
    assert runner.invoke(app, ["enrol", "a", "--public-key", str(pub), "--config", str(cfg)]).exit_code == 0
    result = runner.invoke(app, ["broker-config", "--out", str(tmp_path / "b"), "--config", str(cfg),
                                 "--hostname", "localhost", "--loopback-port", "1884"])
    assert result.exit_code == 0, result.output
    password = yaml.safe_load((tmp_path / "b" / "sites" / "a" / "broker-credentials.yaml").read_text())["password"]
    assert password not in result.output
    assert "listener 1884 127.0.0.1" in (tmp_path / "b" / "mosquitto.conf").read_text()


def test_certificates_are_renewed_when_close_to_expiry(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    out = tmp_path / "out"
    first = generate_broker_config(registry=reg, federation_id="f", out=out, cert_days=20)
    cert = x509.load_pem_x509_certificate(first.server_cert.read_bytes())
    assert cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc) < dt.timedelta(days=21)
    again = generate_broker_config(registry=reg, federation_id="f", out=out)  # 20 days < the 30-day margin
    assert again.issued == (again.server_cert,)
