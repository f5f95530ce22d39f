"""The demo's embedded broker: its readiness probe speaks MQTT (a CONNECT answered by a CONNACK, then DISCONNECT),
so the broker's log holds no failed session for it, and a port without a broker times out."""

from __future__ import annotations

import pytest

from wildfed_sim.embedded_broker import embedded_broker, free_port, wait_for_port

pytest.importorskip("amqtt")


def test_readiness_probe_leaves_no_failed_session_in_the_broker_log(tmp_path):
    import paho.mqtt.client as mqtt

    log = tmp_path / "broker.log"
    with embedded_broker(log_path=log) as url:
        port = int(url.rsplit(":", 1)[1])
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        client.connect("127.0.0.1", port)
        while not client.is_connected():
            assert client.loop(timeout=1.0) == mqtt.MQTT_ERR_SUCCESS
        client.disconnect()
    text = log.read_text(errors="replace")
    assert "Failed to initialize client session" not in text and "Error" not in text


def test_a_port_without_a_broker_times_out():
    with pytest.raises(TimeoutError, match="no MQTT broker accepted connections"):
        wait_for_port("127.0.0.1", free_port(), timeout_s=0.5)
