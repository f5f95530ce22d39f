"""A three-node NATS cluster with its MQTT listeners, on loopback ports of its own, for tests and benchmarks.

Mosquitto does not cluster; NATS does, and speaks MQTT 3.1.1 on top of JetStream (docs/brokers.md says what of
WildFed works through it and what does not). :class:`NatsCluster` starts ``nats-server`` (v2.9.10 is what was
measured) three times in a temporary folder: each node with its own ``server_name``, client port, route port, MQTT
port and JetStream ``store_dir``, the three joined by routes into one cluster (``cluster { routes: [...] }``), and
waits until every node answers an MQTT CONNECT. It never touches the system services on 1883/4222/5672: every
port is a free one picked at start.

By hand (a cluster for ``benchmarks/round_mqtt.py --broker ...``; Ctrl-C stops it)::

    .venv/bin/python -m tests.nats_cluster
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support import free_port, wait_for_connack

__all__ = ["NATS_SERVER", "NatsCluster", "NatsClusterError"]

#: The ``nats-server`` binary, or None when it is not installed (tests using the cluster skip then).
NATS_SERVER = shutil.which("nats-server") or ("/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK)
                                              else None)

_CONFIG = """server_name: {name}
listen: 127.0.0.1:{client_port}
max_payload: {max_payload}
jetstream {{ store_dir: "{store}" }}
cluster {{
  name: wildfed-test
  listen: 127.0.0.1:{route_port}
  routes: [{routes}]
}}
mqtt {{
  listen: 127.0.0.1:{mqtt_port}
  stream_replicas: {replicas}{consumer_replicas}
}}
"""


class NatsClusterError(RuntimeError):
    """A node did not start, or did not answer an MQTT CONNECT in time (its log's last lines are in the message)."""


class NatsCluster:
    """Three ``nats-server`` nodes joined by routes, each with an MQTT listener on 127.0.0.1.

    Args:
        folder: where the configs, logs and JetStream stores go (default: a new temporary folder, removed by
            :meth:`stop`).
        nodes: how many nodes (3: JetStream's replicated streams need a majority, so 3 survive one node's loss).
        max_payload: the nodes' ``max_payload``, bytes (default 1,115,136: what ``broker-config`` gives Mosquitto
            as ``max_packet_size``; docs/brokers.md says what NATS 2.9 does with it for MQTT).
        replicas: ``mqtt.stream_replicas``, the copies JetStream keeps of the MQTT sessions, retained messages
            and QoS 1 messages (default: one per node, at most 3).
        consumer_replicas: ``mqtt.consumer_replicas``: NATS makes one JetStream consumer per QoS 1 subscription;
            default (None) the server's, as many as ``replicas``. 1 made the consumer of the coordinator's
            session die with its node (docs/brokers.md, "Measured").

    Raises:
        NatsClusterError: from :meth:`start`, when ``nats-server`` is missing or a node does not come up.
    """

    def __init__(self, folder: Path | None = None, *, nodes: int = 3, max_payload: int = 1_115_136,
                 replicas: int | None = None, consumer_replicas: int | None = None) -> None:
        self._own_folder = folder is None
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="wildfed-nats-"))
        self.names = [f"n{i}" for i in range(nodes)]
        self.client_ports = [free_port() for _ in range(nodes)]
        self.route_ports = [free_port() for _ in range(nodes)]
        self.mqtt_ports = [free_port() for _ in range(nodes)]
        self.max_payload = max_payload
        self.replicas = replicas if replicas is not None else min(nodes, 3)
        self.consumer_replicas = consumer_replicas
        self.procs: list[subprocess.Popen | None] = [None] * nodes

    @property
    def urls(self) -> list[str]:
        """Each node's MQTT listener as ``mqtt://127.0.0.1:<port>``, node 0 first."""
        return [f"mqtt://127.0.0.1:{p}" for p in self.mqtt_ports]

    def _write_config(self, i: int) -> Path:
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i)
        store = self.folder / self.names[i] / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.names[i]}.conf"
        path.write_text(_CONFIG.format(name=self.names[i], client_port=self.client_ports[i],
                                       max_payload=self.max_payload, store=store, route_port=self.route_ports[i],
                                       routes=routes, mqtt_port=self.mqtt_ports[i], replicas=self.replicas,
                                       consumer_replicas="" if self.consumer_replicas is None else
                                       f"\n  consumer_replicas: {self.consumer_replicas}"))
        return path

    def log(self, i: int) -> Path:
        """Node ``i``'s log file."""
        return self.folder / f"{self.names[i]}.log"

    def start_node(self, i: int) -> None:
        """Start node ``i`` (again, after :meth:`kill`: same ports, same store) without waiting for it."""
        if NATS_SERVER is None:
            raise NatsClusterError("nats-server is not installed (Debian: apt-get install nats-server)")
        config = self._write_config(i)
        with open(self.log(i), "ab") as out:
            self.procs[i] = subprocess.Popen([NATS_SERVER, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        """Start every node and wait until each answers an MQTT CONNECT with a CONNACK (JetStream, which the MQTT
        listener needs, is up on a majority by then).

        Raises:
            NatsClusterError: a node exited, or one gave no CONNACK within ``timeout_s``.
        """
        for i in range(len(self.names)):
            self.start_node(i)
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.names)):
            self.wait_ready(i, max(1.0, deadline - time.monotonic()))
        return self

    def wait_ready(self, i: int, timeout_s: float) -> float:
        """Wait until node ``i`` answers an MQTT CONNECT with a successful CONNACK; the seconds that took.

        Raises:
            NatsClusterError: the node exited or gave no CONNACK within ``timeout_s``.
        """
        return wait_for_connack(self.mqtt_ports[i], client_id=f"wildfed-probe-{self.names[i]}",
                                timeout_s=timeout_s,
                                running=lambda: self.procs[i] is not None and self.procs[i].poll() is None,
                                failure=lambda what: NatsClusterError(f"nats-server {self.names[i]} {what}: "
                                                                 f"{self._tail(i)}"),
                                poll_s=0.1)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash: no goodbye to its clients or routes) and reap it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 10 s) and remove the folder when this cluster made it."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            self.procs[i] = None
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _tail(self, i: int, lines: int = 5) -> str:
        try:
            return " | ".join(self.log(i).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a cluster for a benchmark run by hand
    cluster = NatsCluster().start()
    print("\n".join(f"{name}: {url}" for name, url in zip(cluster.names, cluster.urls)), flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
