"""MqttTransport against a real Mosquitto started by the test on a free loopback port (skipped without one)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from shared.errors import ConfigError

from edge_sdk.uplink.mqtt import MqttTransport, parse_mqtt_url
from edge_sdk.uplink.transport import TransportError

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("mosquitto did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def broker(tmp_path: Path):
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    b = Broker(tmp_path)
    b.start()
    yield b
    b.stop()


def test_parse_url() -> None:
    assert parse_mqtt_url("mqtt://10.0.0.2:1884") == ("10.0.0.2", 1884)
    assert parse_mqtt_url("mqtt://broker") == ("broker", 1883)
    with pytest.raises(ConfigError, match="mqtt://host:port"):
        parse_mqtt_url("tcp://x:1")


def test_unreachable_broker_raises() -> None:
    t = MqttTransport(f"mqtt://127.0.0.1:{free_port()}")
    with pytest.raises(TransportError):
        t.connect(timeout_s=1)
    t.close()


def test_qos1_publish_and_resubscribe_after_broker_restart(broker: Broker) -> None:
    url = f"mqtt://127.0.0.1:{broker.port}"
    received: list[tuple[str, bytes]] = []
    got = threading.Event()
    connects = []
    sub, pub = MqttTransport(url), MqttTransport(url)
    sub.subscribe("wildfed/v1/f/site/+/update", lambda t, p: (received.append((t, p)), got.set()))
    sub.add_connect_listener(lambda: connects.append(1))
    sub.connect(timeout_s=5)
    pub.connect(timeout_s=5)  # sub.connect() returned after its SUBACK: no sleep needed
    payload = bytes(range(256)) * 4000  # ~1 MB
    pub.publish("wildfed/v1/f/site/s1/update", payload, timeout_s=5)
    assert got.wait(5) and received == [("wildfed/v1/f/site/s1/update", payload)]

    broker.stop()
    time.sleep(0.3)
    with pytest.raises(TransportError):
        pub.publish("wildfed/v1/f/site/s1/update", b"x", timeout_s=0.5)
    broker.start()
    deadline = time.monotonic() + 10
    while len(connects) < 2 and time.monotonic() < deadline:  # paho reconnects with back-off (>= 1 s)
        time.sleep(0.1)
    assert len(connects) == 2
    pub.connect(timeout_s=10)
    got.clear()
    pub.publish("wildfed/v1/f/site/s2/update", b"after restart", timeout_s=5)
    assert got.wait(5) and received[-1] == ("wildfed/v1/f/site/s2/update", b"after restart")
    sub.close()
    pub.close()


def test_agent_round_over_real_broker(broker: Broker, tmp_path: Path) -> None:
    from edge_sdk.agent import EdgeAgent
    from edge_sdk.config import load_site_config

    from .test_agent import make_site

    url = f"mqtt://127.0.0.1:{broker.port}"
    coordinator = make_site(tmp_path, MqttTransport(url), ack_in_thread=True)
    agent = EdgeAgent.from_config(load_site_config(tmp_path / "site.yaml", overrides={"broker_url": url}))
    agent.start()  # returns after the SUBACKs, so the (not retained) task cannot be missed
    coordinator.send(coordinator.task(1))
    assert agent.run(max_rounds=1, idle_timeout_s=15) == 1
    assert len(coordinator.updates) == 1 and agent.outbox.pending() == []
    assert agent.stats["acks_accepted"] == 1
    agent.close()
    coordinator.transport.close()


def test_failover_urls_checked_and_connect_falls_over_to_the_next_node(broker: Broker) -> None:
    """A failover URL of another scheme is refused naming the field; a dead first node is skipped at connect."""
    with pytest.raises(ConfigError, match="broker_failover_urls"):
        MqttTransport("mqtt://127.0.0.1:1", failover_urls=["mqtts://127.0.0.1:2"])
    dead = free_port()  # nothing listens there
    t = MqttTransport(f"mqtt://127.0.0.1:{dead}", failover_urls=[f"mqtt://127.0.0.1:{broker.port}"])
    try:
        t.connect(timeout_s=5)
        assert t.brokers[t.broker] == ("127.0.0.1", broker.port) and t.broker == 1
    finally:
        t.close()


class _StartingClient:
    """A stand-in for paho's client whose ``loop_start`` holds until released, recording whether ``loop_stop`` ever
    ran while a network thread was being started (paho then raises "cannot join thread before it is started")."""

    def __init__(self) -> None:
        self.starting, self.proceed, self.disconnected = threading.Event(), threading.Event(), threading.Event()
        self.in_start = False
        self.stopped_during_start = 0
        self.starts = 0

    def reconnect(self) -> None:
        pass

    def loop_start(self) -> None:
        self.in_start = True
        self.starting.set()
        self.proceed.wait(30)
        self.starts += 1
        self.in_start = False

    def loop_stop(self) -> None:
        if self.in_start:
            self.stopped_during_start += 1

    def disconnect(self) -> None:
        self.disconnected.set()

    def connect_async(self, *args: object, **kwargs: object) -> None:
        pass


def test_close_never_stops_the_network_thread_while_the_reconnect_starts_it() -> None:
    # Prepare: a transport whose link dropped, its supervisor reconnecting at once (no back-off)
    t = MqttTransport("mqtt://127.0.0.1:1")
    t._backoff = (0.0, 0.0)
    fake = _StartingClient()
    t._client = fake
    t._started = True
    t._supervisor = threading.Thread(target=t._supervise, daemon=True)
    t._supervisor.start()
    t._link_down.set()
    assert fake.starting.wait(30)  # the supervisor is inside loop_start
    # Execute: close() from another thread while the network thread is being started
    closer = threading.Thread(target=t.close)
    closer.start()
    assert fake.disconnected.wait(30)  # close() has disconnected and goes on to stop the network thread
    fake.proceed.set()
    closer.join(30)
    # Assert: close waited for the start to finish before it stopped the thread
    assert not closer.is_alive() and fake.stopped_during_start == 0 and fake.starts == 1
