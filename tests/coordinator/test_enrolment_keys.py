"""A site's key is its own: one public key enrolled for two sites, and the coordinator's own key offered as a
site key, are both refused with an error naming the field and the fix, through the
real CLI (``enrol``, ``rotate-key``) and the registry, and nothing already stored changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.registry import EnrolmentError, KeyRotationError, SiteRegistry
from coordinator.storage import SiteKeyRow, SiteRow, Store
from shared.keys import generate_signing_key, key_fingerprint, public_key_to_pem, save_public_key
from tests.coordinator.helpers import wide_cli_consoles


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch: pytest.MonkeyPatch) -> None:
    wide_cli_consoles(monkeypatch)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _sites(config: str) -> list[tuple[str, str]]:
    cfg = load_config(Path(config))
    store = Store(cfg.database_url or "", cfg.data_dir)
    with store.session() as s:
        out = [(r.site_id, r.public_key_pem) for r in s.query(SiteRow).order_by(SiteRow.site_id)]
        out += [(r.site_id, r.fingerprint) for r in s.query(SiteKeyRow).order_by(SiteKeyRow.id)]
    store.dispose()
    return out


def test_the_cli_refuses_a_key_of_another_site_and_the_coordinators_own(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "fed"), "--federation-id", "keys"]).exit_code == 0
    config = str(tmp_path / "fed" / "coordinator.yaml")
    key_a = save_public_key(generate_signing_key().public_key(), tmp_path / "a.pub")
    assert runner.invoke(app, ["enrol", "site-a", "--public-key", str(key_a), "-c", config]).exit_code == 0
    before = _sites(config)

    res = runner.invoke(app, ["enrol", "site-b", "--public-key", str(key_a), "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2 and "public_key" in out and "already the key of site 'site-a'" in out, out
    assert "wildfed-edge keygen" in out

    coordinator_pub = tmp_path / "fed" / "keys" / "coordinator.pub"
    res = runner.invoke(app, ["enrol", "site-c", "--public-key", str(coordinator_pub), "-c", config])
    out = _flat(res.output)
    assert res.exit_code == 2 and "public_key" in out and "is the coordinator's own key" in out, out
    assert _sites(config) == before  # nothing enrolled, nothing changed

    key_b = save_public_key(generate_signing_key().public_key(), tmp_path / "b.pub")
    assert runner.invoke(app, ["enrol", "site-b", "--public-key", str(key_b), "-c", config]).exit_code == 0
    before = _sites(config)
    for pub in (key_a, coordinator_pub):  # rotating site-b to site-a's key or the coordinator's: refused too
        res = runner.invoke(app, ["rotate-key", "site-b", "--public-key", str(pub), "-c", config])
        assert res.exit_code == 2 and "public_key" in _flat(res.output), res.output
    assert _sites(config) == before


def test_the_registry_refuses_keys_in_use_even_after_rotation(tmp_path: Path) -> None:
    store = Store("sqlite://", tmp_path / "data")
    coordinator_key = generate_signing_key().public_key()
    registry = SiteRegistry(store, reserved_keys=[coordinator_key])
    old, new = generate_signing_key().public_key(), generate_signing_key().public_key()
    registry.enrol("site-a", public_key_to_pem(old))
    registry.rotate_key("site-a", public_key_to_pem(new), grace_s=0)
    for key in (old, new):  # a key site-a had, and the one it has
        with pytest.raises(EnrolmentError, match="already the key of site 'site-a'") as info:
            registry.enrol("site-b", public_key_to_pem(key))
        assert info.value.field == "public_key" and key_fingerprint(key)[:16] in str(info.value)
    with pytest.raises(EnrolmentError, match="coordinator's own key"):
        registry.enrol("site-b", public_key_to_pem(coordinator_key))
    registry.enrol("site-b", public_key_to_pem(generate_signing_key().public_key()))
    with pytest.raises(KeyRotationError, match="already the key of site 'site-a'"):
        registry.rotate_key("site-b", public_key_to_pem(old))
    assert [s.site_id for s in registry.list()] == ["site-a", "site-b"]


def test_the_coordinator_service_reserves_its_own_key(tmp_path: Path) -> None:
    from coordinator.config import config_from_dict
    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport

    key = generate_signing_key()
    cfg = config_from_dict({"federation_id": "svc", "data_dir": str(tmp_path / "data")}).resolved(tmp_path)
    coordinator = Coordinator(cfg, transport=InMemoryTransport(), signing_key=key)
    with pytest.raises(EnrolmentError, match="coordinator's own key"):
        coordinator.enrol("site-a", public_key_to_pem(key.public_key()))


def test_enrol_and_rotate_accept_der_and_openssh_and_explain_anything_else(tmp_path: Path) -> None:
    """A binary DER key must not print a raw UnicodeDecodeError. DER (and OpenSSH) keys are converted; any
    other binary file is refused naming the file, saying PEM is expected and how to convert, storing nothing."""
    from cryptography.hazmat.primitives import serialization

    runner = CliRunner()
    assert runner.invoke(app, ["init", str(tmp_path / "fed"), "--federation-id", "keys"]).exit_code == 0
    config = str(tmp_path / "fed" / "coordinator.yaml")
    key_a, key_b = generate_signing_key().public_key(), generate_signing_key().public_key()
    der = tmp_path / "a.der"
    der.write_bytes(key_a.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert not der.read_bytes().isascii()  # really binary: read_text() would have raised
    res = runner.invoke(app, ["enrol", "site-a", "--public-key", str(der), "-c", config])
    assert res.exit_code == 0, res.output
    assert _sites(config)[0] == ("site-a", public_key_to_pem(key_a))  # stored as the same key, in PEM

    ssh = tmp_path / "b.pub"
    ssh.write_bytes(key_b.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    res = runner.invoke(app, ["rotate-key", "site-a", "--public-key", str(ssh), "-c", config])
    assert res.exit_code == 0, res.output
    assert key_fingerprint(key_b)[:16] in _flat(res.output)

    before = _sites(config)
    junk = tmp_path / "junk.pub"
    junk.write_bytes(bytes(range(256)))  # binary, and no key in any form
    for args in (["enrol", "site-j"], ["rotate-key", "site-a"]):
        res = runner.invoke(app, [*args, "--public-key", str(junk), "-c", config])
        out = _flat(res.output)
        assert res.exit_code == 2 and "Traceback" not in out and "UnicodeDecodeError" not in out, out
        assert str(junk) in out and "public_key" in out and "PEM" in out, out
        assert f"openssl pkey -pubin -inform DER -in {junk} -out {junk}.pem" in out, out
    assert _sites(config) == before
