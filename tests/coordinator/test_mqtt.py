"""Integration: a 2-site, 2-round federation through a real Mosquitto broker with the paho transport; a tampered
update is rejected and counted. Uses 127.0.0.1:1883 when a broker listens there, otherwise starts a private
mosquitto on a free port; skipped when neither is possible."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import numpy as np
import pytest

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.transport.mqtt import MqttTransport
from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights

pytestmark = pytest.mark.broker


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory):
    if _port_open(1883):
        yield "mqtt://127.0.0.1:1883"
        return
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if shutil.os.path.exists("/usr/sbin/mosquitto")
                                        else None)
    if exe is None:
        pytest.skip("no MQTT broker on 127.0.0.1:1883 and no mosquitto binary; install mosquitto or start one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path_factory.mktemp("mosq") / "m.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if _port_open(port):
                break
            time.sleep(0.1)
        else:
            pytest.skip("private mosquitto did not start")
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_two_site_two_round_federation_over_mosquitto(tmp_path, broker_url):
    fed = f"mq{uuid.uuid4().hex[:10]}"
    transports = []
    try:
        key = generate_signing_key()
        cfg = make_config(tmp_path, federation_id=fed, broker_url=broker_url, round_deadline_s=15.0,
                          quorum_fraction=0.6)
        coord = Coordinator(cfg, signing_key=key, initial_weights=tiny_weights())
        sites = []
        for sid, value, n in (("s1", 1.0, 10), ("s2", 4.0, 30), ("evil", 50.0, 100)):
            t = MqttTransport(broker_url, client_id=f"{fed}-{sid}")
            transports.append(t)
            site = FakeSite(sid, t, key.public_key(), value=value, num_examples=n, events={IUCNCategory.LC: EVENT},
                            fed=fed)
            site.attach()
            t.connect()
            coord.enrol(sid, site.public_pem, {"capacity": n})
            sites.append(site)
        sites[2].tamper = True
        coord.start()
        results = coord.run()
        assert [r.status for r in results] == ["closed", "closed"]
        assert all(r.accepted == ("s1", "s2") for r in results)
        _, weights = coord.rounds.current_model()
        for name, w0 in tiny_weights().items():
            np.testing.assert_allclose(weights[name], w0 + 2 * 3.25, rtol=1e-6)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and coord.status().rejections.get("bad_signature", 0) < 2:
            time.sleep(0.05)
        assert coord.status().rejections.get("bad_signature") == 2
        assert coord.store.count_updates() == 4
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(sites[0].acks) < 2:
            time.sleep(0.05)
        assert [a.accepted for a in sites[0].acks] == [True, True]
        coord.close()
    finally:
        for t in transports:
            t.close()


def test_cli_run_connects_and_stops_when_no_site_can_train(tmp_path, broker_url):
    from typer.testing import CliRunner

    from coordinator.cli import app

    runner = CliRunner()
    d = tmp_path / "c"
    fed = f"cli{uuid.uuid4().hex[:8]}"
    assert runner.invoke(app, ["init", str(d), "--federation-id", fed, "--broker", broker_url]).exit_code == 0
    # a tiny round-0 model avoids torch here; the CLI then finds the stored model
    from coordinator.config import load_config
    from coordinator.storage import Store
    from shared.codec import encode_tensors, model_hash

    cfg = load_config(d / "coordinator.yaml")
    store = Store(cfg.database_url, cfg.data_dir)
    store.put_model(model_hash(tiny_weights()), encode_tensors(tiny_weights()), round=0)
    store.dispose()
    r = runner.invoke(app, ["run", "--config", str(d / "coordinator.yaml")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "round 1 skipped" in r.output and "reason" in r.output


def test_pipelined_publishes_arrive_in_order_and_are_all_acknowledged_when_the_block_ends(broker_url):
    """``MqttTransport.pipelined`` (a round's task chunks): 24 messages of 64 KiB handed to paho without a wait each
    (at most ``max_pending_bytes`` unacknowledged; half of them from a nested block, which joins the outer one);
    when the outer block ends the broker has PUBACKed every one, and a subscriber gets them all, in order, intact."""
    import threading

    topic = f"wf-test/{uuid.uuid4().hex[:10]}/task"
    pub = MqttTransport(broker_url, client_id=f"pipe-pub-{uuid.uuid4().hex[:8]}")
    sub = MqttTransport(broker_url, client_id=f"pipe-sub-{uuid.uuid4().hex[:8]}")
    got: list[bytes] = []
    done = threading.Event()
    messages = [bytes([i]) * 65536 for i in range(24)]

    def on_message(t: str, p: bytes) -> None:
        got.append(bytes(p))
        if len(got) == len(messages):
            done.set()

    infos = []
    real = pub._publish_nowait
    pub._publish_nowait = lambda t, p, q: (lambda i: (infos.append(i), i)[1])(real(t, p, q))
    try:
        sub.subscribe(topic, on_message)
        sub.connect()
        pub.connect()
        with pub.pipelined(max_pending_bytes=200_000) as publish:  # at most 3 of them unacknowledged at a time
            for m in messages[:12]:
                publish(topic, m)
            with pub.pipelined() as inner:  # a nested block joins the outer one
                assert inner is publish
                for m in messages[12:]:
                    inner(topic, m)
        assert len(infos) == len(messages) and all(i is not None and i.is_published() for i in infos)
        assert done.wait(30)
        assert got == messages
    finally:
        pub.close()
        sub.close()


def test_close_lets_the_replies_sent_without_a_wait_go_out_first(broker_url):
    """Replies a ``QueuedCallback`` handler publishes (ACKs, receipts) are not waited for where they are sent; a
    coordinator that stops right after its last round then closes the transport at once. ``close`` must let paho
    finish them first: 16 messages of 256 KiB published as a handler publishes them, then ``close`` straight away,
    and a subscriber gets every one."""
    import threading

    from coordinator.transport import handlers as handler_module

    topic = f"wf-test/{uuid.uuid4().hex[:10]}/ack"
    pub = MqttTransport(broker_url, client_id=f"close-pub-{uuid.uuid4().hex[:8]}")
    sub = MqttTransport(broker_url, client_id=f"close-sub-{uuid.uuid4().hex[:8]}")
    messages = [bytes([i]) * 262144 for i in range(16)]
    got: list[bytes] = []
    done = threading.Event()

    def on_message(t: str, p: bytes) -> None:
        got.append(bytes(p))
        if len(got) == len(messages):
            done.set()

    try:
        sub.subscribe(topic, on_message)
        sub.connect()
        pub.connect()
        handler_module._HANDLER_THREAD.active = True  # this thread publishes as a QueuedCallback handler does
        try:
            for m in messages:
                pub.publish(topic, m)
        finally:
            handler_module._HANDLER_THREAD.active = False
        pub.close()
        assert done.wait(30), f"{len(got)} of {len(messages)} arrived"
        assert got == messages
    finally:
        sub.close()


def test_each_topic_reaches_the_handlers_of_every_filter_it_matches_also_after_a_new_subscription() -> None:
    """The transport remembers a topic's handlers (no broker needed: paho's callback is called directly); a filter
    added later is seen by a topic looked up before, and a topic no filter matches reaches nobody."""
    from types import SimpleNamespace

    transport = MqttTransport("mqtt://127.0.0.1:1", client_id=f"t-{uuid.uuid4().hex[:6]}")
    got: list[tuple[str, str, bytes]] = []
    transport.subscribe("wildfed/f/+/update", lambda t, p: got.append(("update", t, p)))
    transport.subscribe("$share/g/wildfed/f/s1/#", lambda t, p: got.append(("s1", t, p)))

    def deliver(topic: str, payload: bytes) -> None:
        transport._on_message(None, None, SimpleNamespace(topic=topic, payload=payload, mid=1, qos=0))

    deliver("wildfed/f/s1/update", b"a")
    deliver("wildfed/f/s2/update", b"b")
    deliver("wildfed/f/s1/update", b"c")  # looked up before: the same two handlers
    deliver("wildfed/g/s1/update", b"x")  # another federation: nobody
    assert got == [("update", "wildfed/f/s1/update", b"a"), ("s1", "wildfed/f/s1/update", b"a"),
                   ("update", "wildfed/f/s2/update", b"b"),
                   ("update", "wildfed/f/s1/update", b"c"), ("s1", "wildfed/f/s1/update", b"c")]
    got.clear()
    transport.subscribe("wildfed/+/+/update", lambda t, p: got.append(("any", t, p)))
    deliver("wildfed/f/s2/update", b"d")
    deliver("wildfed/g/s1/update", b"y")
    assert got == [("update", "wildfed/f/s2/update", b"d"), ("any", "wildfed/f/s2/update", b"d"),
                   ("any", "wildfed/g/s1/update", b"y")]


def test_a_message_is_acknowledged_only_when_every_handler_returned() -> None:
    """paho's manual acknowledgement: PUBACK after the handlers; a handler that raised leaves the message
    unacknowledged, so a persistent session's broker delivers it again (no broker needed: paho's callbacks are
    called directly)."""
    from types import SimpleNamespace

    transport = MqttTransport("mqtt://127.0.0.1:1", client_id=f"t-{uuid.uuid4().hex[:6]}", persistent_session=True)
    acked: list[tuple[int, int]] = []
    transport._client.ack = lambda mid, qos: acked.append((mid, qos))  # what would send the PUBACK

    def store(topic: str, payload: bytes) -> None:
        if payload == b"bad":
            raise OSError("database gone")

    transport.subscribe("wildfed/f/+/detection", store)
    for mid, payload in ((1, b"good"), (2, b"bad"), (3, b"good")):
        transport._on_message(None, None, SimpleNamespace(topic="wildfed/f/s1/detection", payload=payload, mid=mid,
                                                          qos=1))
    transport._on_message(None, None, SimpleNamespace(topic="wildfed/f/s1/other", payload=b"x", mid=4, qos=1))
    assert acked == [(1, 1), (3, 1), (4, 1)]  # a message no handler wants is acknowledged (dropped)
    assert transport.unacknowledged == 1
