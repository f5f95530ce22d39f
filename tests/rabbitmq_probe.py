"""What a three-node RabbitMQ cluster's MQTT plugin does with what WildFed relies on: retained messages across nodes
and on wildcard filters, and the sessions of a node that is SIGKILLed (docs/brokers.md, "RabbitMQ 3.10").

Run by hand (about a minute: the cluster's start and one node's kill; prints one line per check)::

    .venv/bin/python -m tests.rabbitmq_probe [--queue-type quorum|classic] [--no-mirror]

1. A retained message published on node 0 to ``a/b/model``; a new subscriber on node 0 and on node 2 to that topic,
   and on node 0 to ``a/b/model/#`` and ``a/+/model``: how many retained messages each gets.
2. A subscription to ``$share/g/s/update`` on node 0 (MQTT 3.1.1, as WildFed's transports connect) and a message
   published to ``s/update``: received?
3. On node 2: a clean-session client ("gateway", QoS 1 subscription) and a persistent-session client
   ("coordinator", clean session 0, QoS 1 subscription) that then disconnects. Node 2 is SIGKILLed; the gateway
   connects to node 1 2 s later and subscribes (granted or not), a message is published to it on node 0 (received
   or not); three QoS 1 messages are published on node 0 for the
   coordinator, which then connects to node 1: session present? the three messages?
"""

from __future__ import annotations

import argparse
import time

import paho.mqtt.client as mqtt

from tests.rabbitmq_cluster import RabbitCluster


class Probe:
    """One paho client; records its CONNACK, SUBACKs and messages."""

    def __init__(self, port: int, client_id: str, *, clean: bool = True) -> None:
        self.got: list[bytes] = []
        self.state: dict[str, object] = {}
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                                  clean_session=clean)
        self.client.on_message = lambda c, u, m: self.got.append(m.payload)
        self.client.on_connect = lambda c, u, f, rc, p: self.state.update(present=f.session_present, rc=str(rc))
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.state.update(suback=[str(r) for r in rcs])
        self.client.on_disconnect = lambda c, u, f, rc, p: self.state.update(dropped=str(rc))
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()
        self._wait("rc")

    def _wait(self, key: str, timeout_s: float = 10.0) -> object:
        deadline = time.monotonic() + timeout_s
        while key not in self.state and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.state.get(key)

    def subscribe(self, topic_filter: str) -> object:
        """Subscribe at QoS 1; the SUBACK's codes, or None when none came in 10 s."""
        self.state.pop("suback", None)
        self.client.subscribe(topic_filter, qos=1)
        return self._wait("suback")

    def close(self) -> None:
        """Disconnect cleanly."""
        self.client.disconnect()
        self.client.loop_stop()


def main() -> None:
    """Start the cluster, run the checks of the module docstring, print what happened, stop the cluster."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")
    parser.add_argument("--no-mirror", action="store_true", help="no ha-mode policy on the subscription queues")
    args = parser.parse_args()
    with RabbitCluster(queue_type=args.queue_type, mirror=not args.no_mirror) as cluster:
        ports = cluster.mqtt_ports
        print(f"cluster up in {cluster.started_s:.1f} s (durable_queue_type {args.queue_type}, "
              f"mirror {not args.no_mirror})", flush=True)
        publisher = Probe(ports[0], "probe-pub")
        publisher.client.publish("a/b/model", b"R", qos=1, retain=True).wait_for_publish(10)
        publisher.close()
        for node, topic_filter in ((0, "a/b/model"), (2, "a/b/model"), (0, "a/b/model/#"), (0, "a/+/model")):
            reader = Probe(ports[node], f"probe-r{node}-{len(topic_filter)}")
            suback = reader.subscribe(topic_filter)
            time.sleep(1.5)  # a retained message comes right after the SUBACK
            print(f"retained on node 0, subscriber on node {node} to {topic_filter}: SUBACK {suback}, "
                  f"{len(reader.got)} retained message(s)", flush=True)
            reader.close()

        shared = Probe(ports[0], "probe-share")
        suback = shared.subscribe("$share/g/s/update")
        publisher = Probe(ports[1], "probe-pub1")
        publisher.client.publish("s/update", b"u", qos=1).wait_for_publish(10)
        publisher.close()
        time.sleep(1.0)
        print(f"shared subscription $share/g/s/update on node 0: SUBACK {suback}, dropped: "
              f"{shared.state.get('dropped')}, a message to s/update: {len(shared.got)} received", flush=True)
        shared.close()

        gateway = Probe(ports[2], "probe-gateway")
        gateway.subscribe("g/task")
        coordinator = Probe(ports[2], "probe-coordinator", clean=False)
        coordinator.subscribe("g/up/#")
        coordinator.close()
        time.sleep(1.0)
        print(cluster.ctl(1, "list_queues", "name", "type", "durable", "auto_delete", "pid", "slave_pids",
                          "members").strip(), flush=True)
        killed = time.monotonic()
        cluster.kill(2)
        time.sleep(2.0)  # a gateway's failover takes about that long (docs/brokers.md)
        moved = Probe(ports[1], "probe-gateway")
        suback = moved.subscribe("g/task")
        publisher = Probe(ports[0], "probe-pub2")
        publisher.client.publish("g/task", b"t", qos=1).wait_for_publish(10)
        time.sleep(1.0)
        print(f"node 2 killed; the gateway on node 1 after {time.monotonic() - killed:.1f} s: CONNACK "
              f"{moved.state.get('rc')}, SUBACK {suback}, dropped: {moved.state.get('dropped')}, a task published "
              f"on node 0 then: {len(moved.got)} received", flush=True)
        moved.close()
        for i in range(3):
            publisher.client.publish("g/up/s1", b"m%d" % i, qos=1).wait_for_publish(10)
        publisher.close()
        resumed = Probe(ports[1], "probe-coordinator", clean=False)
        suback = resumed.subscribe("g/up/#")
        time.sleep(2.0)
        print(f"the coordinator on node 1 after {time.monotonic() - killed:.1f} s: CONNACK "
              f"{resumed.state.get('rc')}, session present {resumed.state.get('present')}, SUBACK {suback}, "
              f"messages {[m.decode() for m in resumed.got]}", flush=True)
        resumed.close()


if __name__ == "__main__":
    main()
