"""The secured transport against a REAL Mosquitto started with the configuration `wildfed-coordinator broker-config`
generates (TLS, per-site passwords, ACL; optionally client certificates): authentication, ACL isolation between
sites, the last will, reconnect back-off and the in-flight window. Skipped without the mosquitto binary."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.broker import load_broker_credentials
from shared.keys import generate_signing_key, public_key_to_pem
from shared.topics import parse_status_payload, status_filter, status_topic, task_topic, update_topic

from coordinator.broker_config import BrokerConfigResult, generate_broker_config
from coordinator.registry import SiteRegistry
from coordinator.storage import Store
from coordinator.transport.mqtt import MqttTransport as CoordinatorTransport
from coordinator.transport.mqtt import transport_from_config as coordinator_transport_from_config
from edge_sdk.config import SiteConfig
from edge_sdk.uplink.mqtt import MqttTransport, full_jitter_delay
from edge_sdk.uplink.site_transport import transport_from_config
from edge_sdk.uplink.transport import TransportError

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
FED = "f"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@dataclass
class SecureBroker:
    """A private mosquitto running a generated configuration."""

    result: BrokerConfigResult
    tls_port: int
    plain_port: int
    proc: subprocess.Popen

    @property
    def tls_url(self) -> str:
        return f"mqtts://127.0.0.1:{self.tls_port}"

    def creds(self, site: str):
        return load_broker_credentials(self.result.site_credentials[site])

    def site(self, site: str, **kwargs) -> MqttTransport:
        c = self.creds(site)
        return MqttTransport(self.tls_url, client_id=f"t-{site}-{random.getrandbits(32)}", ca_file=self.result.ca_cert,
                             username=c.username, password=c.password, **kwargs)

    def coordinator(self) -> CoordinatorTransport:
        c = load_broker_credentials(self.result.coordinator_credentials)
        return CoordinatorTransport(self.tls_url, client_id=f"t-coord-{random.getrandbits(32)}",
                                    ca_file=self.result.ca_cert, username=c.username, password=c.password,
                                    connect_timeout_s=5)


def _start_broker(tmp: Path, *, client_certs: bool) -> SecureBroker:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    reg = SiteRegistry(Store("sqlite://", tmp / "data"))
    for site in ("a", "b"):
        reg.enrol(site, public_key_to_pem(generate_signing_key().public_key()))
    tls_port, plain_port = free_port(), free_port()
    result = generate_broker_config(registry=reg, federation_id=FED, out=tmp / "broker", tls_port=tls_port,
                                    bind_address="127.0.0.1", loopback_port=plain_port, client_certs=client_certs,
                                    persistence=False, broker_user="root" if os.geteuid() == 0 else None)
    proc = subprocess.Popen([MOSQUITTO, "-c", str(result.conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(tls_port)
        wait_port(plain_port)
    except RuntimeError:
        proc.kill()
        raise
    return SecureBroker(result, tls_port, plain_port, proc)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = _start_broker(tmp_path_factory.mktemp("secure"), client_certs=False)
    yield b
    b.proc.terminate()
    b.proc.wait(5)


@pytest.fixture(scope="module")
def cert_broker(tmp_path_factory):
    b = _start_broker(tmp_path_factory.mktemp("certs"), client_certs=True)
    yield b
    b.proc.terminate()
    b.proc.wait(5)


class Proxy:
    """A TCP relay in front of the broker's plain loopback listener that a test can stall or cut."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hold_down = threading.Event()  # broker -> client bytes are held back while set
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while down and self.hold_down.is_set():
                    time.sleep(0.01)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        """Drop every relayed connection at once (both ends see the link die; no DISCONNECT is sent)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.hold_down.clear()

    def stop_listening(self) -> None:
        """Refuse new connections (shutdown wakes the accepting thread; close alone would not)."""
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def close(self) -> None:
        self.stop_listening()
        self.cut()


def collector():
    got: list[tuple[str, bytes]] = []
    event = threading.Event()

    def callback(topic: str, payload: bytes) -> None:
        got.append((topic, payload))
        event.set()

    return got, event, callback


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---- authentication ------------------------------------------------------------------------------------------------
def test_site_connects_over_tls_with_credentials_from_its_config(broker: SecureBroker, tmp_path: Path) -> None:
    # Prepare: a site config as a provisioned gateway would have it
    creds_file = tmp_path / "broker-credentials.yaml"
    shutil.copy(broker.result.site_credentials["a"], creds_file)
    os.chmod(creds_file, 0o600)
    config = SiteConfig(federation_id=FED, site_id="a", task="radiomap", dataset=tmp_path, private_key=tmp_path / "k",
                        coordinator_public_key=tmp_path / "c", outbox=tmp_path / "o", broker_url=broker.tls_url,
                        broker_ca_file=broker.result.site_credentials["a"].parent / "broker-ca.pem",
                        broker_password_file=creds_file)
    t = transport_from_config(config)
    # Execute
    start = time.monotonic()
    t.connect(timeout_s=5)
    t.publish(update_topic(FED, "a"), b"hello", timeout_s=5)
    # Assert
    assert time.monotonic() - start < 5
    t.close()


def test_wrong_password_and_anonymous_are_refused(broker: SecureBroker) -> None:
    c = broker.creds("a")
    for username, password in ((c.username, c.password + "x"), (None, None), ("site-b", c.password)):
        t = MqttTransport(broker.tls_url, ca_file=broker.result.ca_cert, username=username, password=password)
        start = time.monotonic()
        with pytest.raises(TransportError, match="refused|closed"):
            t.connect(timeout_s=5)
        assert time.monotonic() - start < 3  # refused promptly, not after the CONNACK timeout
        t.close()
    coordinator = CoordinatorTransport(broker.tls_url, ca_file=broker.result.ca_cert, username="coordinator-f",
                                       password="wrong", connect_timeout_s=5)
    with pytest.raises(Exception, match="refused"):
        coordinator.connect()


def test_broker_certificate_from_another_ca_is_rejected(broker: SecureBroker, cert_broker: SecureBroker) -> None:
    c = broker.creds("a")
    t = MqttTransport(broker.tls_url, ca_file=cert_broker.result.ca_cert, username=c.username, password=c.password)
    with pytest.raises(TransportError, match="certificate verify failed.*fix: set broker_ca_file"):
        t.connect(timeout_s=5)
    t.close()


# ---- ACL -----------------------------------------------------------------------------------------------------------
def test_site_cannot_publish_on_another_sites_topic(broker: SecureBroker, tmp_path: Path) -> None:
    # Prepare: the coordinator (built from its config) listens to every site's updates
    from tests.coordinator.helpers import make_config

    cfg = make_config(tmp_path, federation_id=FED, broker_url=broker.tls_url, broker_ca_file=str(broker.result.ca_cert),
                      broker_password_file=str(broker.result.coordinator_credentials))
    coordinator = coordinator_transport_from_config(cfg)
    got, event, callback = collector()
    coordinator.subscribe(f"wildfed/v1/{FED}/site/+/update", callback)
    coordinator.connect()
    a = broker.site("a")
    a.connect(timeout_s=5)
    # Execute: A forges B's topic (the broker acks and drops it), then uses its own
    a.publish(update_topic(FED, "b"), b"forged", timeout_s=5)
    a.publish(update_topic(FED, "a"), b"genuine", timeout_s=5)
    # Assert: messages of one connection arrive in order, so the forged one would have come first
    assert event.wait(5)
    time.sleep(0.3)
    assert got == [(update_topic(FED, "a"), b"genuine")]
    a.close()
    coordinator.close()


def test_site_cannot_read_another_sites_task(broker: SecureBroker) -> None:
    a = broker.site("a")
    got, event, callback = collector()
    a.subscribe(task_topic(FED, "b"), callback)  # Mosquitto grants the SUBSCRIBE but never delivers
    a.subscribe(task_topic(FED, "a"), callback)
    a.connect(timeout_s=5)
    coordinator = broker.coordinator()
    coordinator.connect()
    coordinator.publish(task_topic(FED, "b"), b"for b only")
    coordinator.publish(task_topic(FED, "a"), b"for a")
    assert event.wait(5)
    time.sleep(0.3)
    assert got == [(task_topic(FED, "a"), b"for a")]
    a.close()
    coordinator.close()


def test_shared_subscription_is_checked_against_the_underlying_topic(broker: SecureBroker) -> None:
    coordinator = broker.coordinator()
    got, event, callback = collector()
    coordinator.subscribe(f"$share/ingest/wildfed/v1/{FED}/site/+/update", callback)
    coordinator.connect()
    time.sleep(0.2)  # the coordinator transport does not wait for SUBACK
    b = broker.site("b")
    b.connect(timeout_s=5)
    b.publish(update_topic(FED, "b"), b"via share", timeout_s=5)
    assert event.wait(5) and got == [(update_topic(FED, "b"), b"via share")]
    b.close()
    coordinator.close()


# ---- client certificates -------------------------------------------------------------------------------------------
def test_client_certificates_required(cert_broker: SecureBroker) -> None:
    site_dir = cert_broker.result.site_credentials["a"].parent
    good = MqttTransport(cert_broker.tls_url, ca_file=cert_broker.result.ca_cert, cert_file=site_dir / "client.crt",
                         key_file=site_dir / "client.key")
    good.connect(timeout_s=5)  # CN site-a is the username: no password needed
    good.publish(update_topic(FED, "a"), b"ok", timeout_s=5)
    good.close()
    c = cert_broker.creds("a")
    bare = MqttTransport(cert_broker.tls_url, ca_file=cert_broker.result.ca_cert, username=c.username,
                         password=c.password)
    start = time.monotonic()
    with pytest.raises(TransportError):
        bare.connect(timeout_s=5)
    assert time.monotonic() - start < 4
    bare.close()


# ---- last will, reconnect, in-flight -------------------------------------------------------------------------------
def test_last_will_offline_and_online_after_reconnect(broker: SecureBroker) -> None:
    # Prepare
    coordinator = broker.coordinator()
    got, _, callback = collector()
    coordinator.subscribe(status_filter(FED), callback)
    coordinator.connect()
    time.sleep(0.3)  # SUBACK, and any retained status of earlier tests
    got.clear()
    proxy = Proxy(broker.plain_port)
    c = broker.creds("a")
    site = MqttTransport(f"mqtt://127.0.0.1:{proxy.port}", username=c.username, password=c.password,
                         status_topic=status_topic(FED, "a"), site_id="a", backoff_base_s=0.05, backoff_cap_s=0.2)
    states = lambda: [parse_status_payload(p)[1] for t, p in got if t == status_topic(FED, "a")]  # noqa: E731
    try:
        site.connect(timeout_s=5)
        assert wait_for(lambda: states() == ["online"], 3)
        # Execute: the link dies without a DISCONNECT
        proxy.cut()
        # Assert: the broker publishes the will; the transport reconnects and says online again
        assert wait_for(lambda: states()[:2] == ["online", "offline"], 3), states()
        assert wait_for(lambda: states() == ["online", "offline", "online"], 5), states()
        assert parse_status_payload(got[1][1]) == ("a", "offline")
        # a clean close publishes offline itself (a DISCONNECT discards the will)
        site.close()
        assert wait_for(lambda: states()[-1] == "offline", 3), states()
        # retained: a late subscriber learns the last state (the first coordinator client leaves first: the
        # broker binds the client id to the username, so a second one would take over its session)
        coordinator.close()
        late = broker.coordinator()
        late_got, late_event, late_cb = collector()
        late.subscribe(status_topic(FED, "a"), late_cb)
        late.connect()
        assert late_event.wait(3) and parse_status_payload(late_got[0][1]) == ("a", "offline")
        late.close()
    finally:
        site.close()
        proxy.close()
        coordinator.close()


def test_publish_waiting_for_puback_fails_promptly_when_the_link_drops(broker: SecureBroker) -> None:
    proxy = Proxy(broker.plain_port)
    c = broker.creds("a")
    site = MqttTransport(f"mqtt://127.0.0.1:{proxy.port}", username=c.username, password=c.password,
                         backoff_base_s=0.05, backoff_cap_s=0.2)
    try:
        site.connect(timeout_s=5)
        proxy.hold_down.set()  # the PUBACK will not reach the gateway
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def publish() -> None:
            try:
                site.publish(update_topic(FED, "a"), b"x" * 100_000, timeout_s=20)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                outcome.append(exc)
            done.set()

        threading.Thread(target=publish, daemon=True).start()
        time.sleep(0.5)
        assert not done.is_set()  # still waiting for its PUBACK
        cut_at = time.monotonic()
        proxy.stop_listening()  # no quick reconnect either (paho would re-send the message and get its PUBACK)
        proxy.cut()
        assert done.wait(3), "publish still blocked after the link dropped"
        assert time.monotonic() - cut_at < 2
        assert isinstance(outcome[0], TransportError) and "dropped before the PUBACK" in str(outcome[0])
    finally:
        site.close()
        proxy.close()


def test_reconnect_delays_use_full_jitter(broker: SecureBroker) -> None:
    proxy = Proxy(broker.plain_port)
    c = broker.creds("b")
    site = MqttTransport(f"mqtt://127.0.0.1:{proxy.port}", username=c.username, password=c.password,
                         backoff_base_s=0.05, backoff_cap_s=0.4, rng=random.Random(7))
    try:
        site.connect(timeout_s=5)
        proxy.stop_listening()  # nothing accepts any more: every attempt fails
        proxy.cut()
        assert wait_for(lambda: len(site.reconnect_delays) >= 5, 5)
        delays = list(site.reconnect_delays)
        assert all(0 <= d <= min(0.4, 0.05 * 2 ** i) for i, d in enumerate(delays)), delays
        assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    finally:
        site.close()
        proxy.close()


def test_full_jitter_delay_bounds_and_spread() -> None:
    rng = random.Random(0)
    for attempt in range(12):
        ceiling = min(30.0, 0.5 * 2 ** attempt)
        draws = [full_jitter_delay(attempt, base_s=0.5, cap_s=30.0, rng=rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        assert max(draws) > 0.8 * ceiling and min(draws) < 0.2 * ceiling  # the whole range is used
    assert full_jitter_delay(10_000, base_s=1, cap_s=5, rng=rng) <= 5  # no overflow for huge attempt counts


# ---- configuration (no broker needed) ------------------------------------------------------------------------------
def _site_config(tmp_path: Path, **kw) -> SiteConfig:
    base = dict(federation_id=FED, site_id="a", task="radiomap", dataset=tmp_path, private_key=tmp_path / "k",
                coordinator_public_key=tmp_path / "c", outbox=tmp_path / "o")
    return SiteConfig(**{**base, **kw})


def test_site_config_broker_fields_are_validated(tmp_path: Path) -> None:
    from pydantic import ValidationError

    assert _site_config(tmp_path, broker_url="mqtts://h:8883").broker_url == "mqtts://h:8883"
    with pytest.raises(ValidationError, match="both or neither"):
        _site_config(tmp_path, broker_url="mqtts://h", broker_cert_file=tmp_path / "c.crt")
    with pytest.raises(ValidationError, match="mqtts"):
        _site_config(tmp_path, broker_url="mqtt://h", broker_ca_file=tmp_path / "ca.pem")


def test_credentials_file_must_be_private_and_complete(tmp_path: Path) -> None:
    from edge_sdk.uplink.mqtt import load_broker_credentials as edge_load
    from shared.errors import ConfigError

    path = tmp_path / "creds.yaml"
    path.write_text("username: site-a\npassword: pw\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        edge_load(path)
    os.chmod(path, 0o600)
    creds = edge_load(path)
    assert (creds.username, creds.password) == ("site-a", "pw") and "pw" not in repr(creds)
    path.write_text("username: site-a\n")
    with pytest.raises(ConfigError, match="password"):
        edge_load(path)
    with pytest.raises(ConfigError, match="not found"):
        edge_load(tmp_path / "missing.yaml")


def test_transport_options_are_checked(tmp_path: Path) -> None:
    from edge_sdk.uplink.mqtt import parse_mqtt_url, parse_mqtt_url_tls
    from shared.errors import ConfigError

    assert parse_mqtt_url_tls("mqtts://b.example.org") == ("b.example.org", 8883, True)
    assert parse_mqtt_url("mqtts://b:9000") == ("b", 9000)
    with pytest.raises(ConfigError, match="mqtts"):
        MqttTransport("mqtt://h", ca_file=tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match="not found"):
        MqttTransport("mqtts://h", ca_file=tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match="username"):
        MqttTransport("mqtt://h", password="pw")
    with pytest.raises(ConfigError, match="status_topic"):
        MqttTransport("mqtt://h", status_topic=status_topic(FED, "a"))
    with pytest.raises(ConfigError, match="both"):
        CoordinatorTransport("mqtts://h", cert_file=tmp_path / "c.crt")


def test_coordinator_config_broker_fields(tmp_path: Path) -> None:
    from coordinator.config import config_from_dict
    from shared.errors import ConfigError

    cfg = config_from_dict({"federation_id": FED, "broker_url": "mqtts://h:8883", "broker_ca_file": "tls/ca.crt",
                            "broker_password_file": "coordinator/creds.yaml"}).resolved(tmp_path)
    assert cfg.broker_ca_file == (tmp_path / "tls" / "ca.crt").resolve()
    assert cfg.broker_password_file == (tmp_path / "coordinator" / "creds.yaml").resolve()
    with pytest.raises(ConfigError):
        config_from_dict({"federation_id": FED, "broker_url": "mqtt://h", "broker_ca_file": "ca.crt"})
    with pytest.raises(ConfigError):
        coordinator_transport_from_config(cfg)  # the credentials file does not exist


def test_status_topic_and_payload() -> None:
    from shared.errors import MalformedEnvelopeError
    from shared.topics import parse_topic, status_payload

    assert status_topic(FED, "a") == "wildfed/v1/f/site/a/status"
    assert parse_topic("wildfed/v1/f/site/a/status") == (FED, "a", "status")
    assert status_payload("a", "offline") == b'{"site_id":"a","state":"offline"}'
    assert parse_status_payload(status_payload("a", "online")) == ("a", "online")
    for bad in (b"nope", b'{"site_id":"a","state":"gone"}', b'{"state":"online"}'):
        with pytest.raises(MalformedEnvelopeError):
            parse_status_payload(bad)
    with pytest.raises(MalformedEnvelopeError):
        status_payload("a", "asleep")


def test_another_sites_credentials_are_refused_before_connecting(tmp_path: Path) -> None:
    """With site b's credentials file, site a would log in and have everything it publishes dropped by the ACL:
    the transport refuses to build, naming broker_password_file."""
    from shared.errors import ConfigError

    creds = tmp_path / "broker-credentials.yaml"
    creds.write_text("username: site-b\npassword: secret\n")
    creds.chmod(0o600)
    with pytest.raises(ConfigError, match="broker_password_file") as info:
        transport_from_config(_site_config(tmp_path, broker_password_file=creds))
    assert "site-a" in str(info.value) and "sites/a/broker-credentials.yaml" in str(info.value)
