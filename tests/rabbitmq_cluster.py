"""A three-node RabbitMQ cluster with its MQTT listeners, on loopback ports of its own, for tests and benchmarks.

RabbitMQ clusters and speaks MQTT 3.1.1 through its ``rabbitmq_mqtt`` plugin (docs/brokers.md says what of WildFed
works through RabbitMQ 3.10 and what does not). :class:`RabbitCluster` starts ``rabbitmq-server`` (3.10.8 from
Debian is what was measured) three times in a temporary folder, every node a stranger to the system's broker:

* its own Erlang port mapper (``epmd -port <free>``, in the foreground, stopped with the cluster) and its own cookie
  (``HOME`` is the cluster's folder), so the system's ``rabbit@localhost`` and its epmd on 4369 are never asked;
* node names ``wf-<random>-<i>@localhost``, each with its own ``RABBITMQ_MNESIA_BASE``/``RABBITMQ_LOG_BASE``, AMQP
  port (``RABBITMQ_NODE_PORT``), distribution port (``RABBITMQ_DIST_PORT``) and MQTT listener, all free loopback
  ports picked at start (never 5672/1883), and its own ``rabbitmq.conf`` and ``enabled_plugins`` (only
  ``rabbitmq_mqtt``); ``RABBITMQ_CONF_ENV_FILE`` points at an empty file, so ``/etc/rabbitmq`` is not read;
* clustered by ``classic_config`` peer discovery: node 0 starts first and forms the cluster, then the others start
  together and join it (started all at once, two nodes may each form a cluster of their own).

Each MQTT QoS 1 subscription is a queue ``mqtt-subscription-<client id>qos1`` on the node the client is connected
to. ``queue_type`` is the plugin's ``mqtt.durable_queue_type``, the type of that queue for persistent sessions
(clean session 0, the coordinator's): ``"quorum"`` (the default here) replicates it on every node by Raft, so it
outlives its node with the messages in it; ``"classic"`` keeps it on one node. Clean sessions (the gateways') always
get a classic queue, durable and auto-delete, and when its node dies its record stays: the same client id is then
refused on every other node ("home node ... of durable queue ... is down") until that node is back. ``mirror``
(default True) sets the policy ``ha-mode: all``, ``ha-sync-mode: automatic`` on ``^mqtt-subscription-`` (classic
mirrored queues, deprecated but present in 3.10; quorum queues ignore it), so a mirror on a surviving node takes
over and the gateway can subscribe again there. docs/brokers.md has what was measured.

By hand (a cluster for ``benchmarks/round_mqtt.py --broker ...``; Ctrl-C stops it)::

    .venv/bin/python -m tests.rabbitmq_cluster
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.support import free_port, wait_for_connack

__all__ = ["RABBITMQ_SERVER", "RabbitCluster", "RabbitClusterError"]


def _scripts_dir() -> Path | None:
    """The folder of RabbitMQ's own scripts (``rabbitmq-server``, ``rabbitmqctl``), not Debian's wrappers in
    /usr/sbin, which switch to the ``rabbitmq`` user and its home; None when RabbitMQ is not installed."""
    found = shutil.which("rabbitmq-server") or ("/usr/sbin/rabbitmq-server"
                                                if os.path.exists("/usr/sbin/rabbitmq-server") else None)
    if found is None:
        return None
    folder = Path(os.path.realpath(found)).parent  # Debian: /usr/lib/rabbitmq/bin/rabbitmq-script-wrapper
    return folder if (folder / "rabbitmq-server").exists() and (folder / "rabbitmqctl").exists() else None


_SCRIPTS = _scripts_dir()
#: RabbitMQ's ``rabbitmq-server`` script, or None when it is not installed (tests using the cluster skip then).
RABBITMQ_SERVER = str(_SCRIPTS / "rabbitmq-server") if _SCRIPTS is not None else None
_EPMD = shutil.which("epmd")

_CONFIG = """mqtt.listeners.tcp.1 = 127.0.0.1:{mqtt_port}
mqtt.allow_anonymous = true
mqtt.durable_queue_type = {queue_type}
cluster_formation.peer_discovery_backend = classic_config
{peers}
log.console = false
log.file.level = info
"""


class RabbitClusterError(RuntimeError):
    """A node did not start, join or answer an MQTT CONNECT in time (its log's last lines are in the message)."""


class RabbitCluster:
    """Three ``rabbitmq-server`` nodes clustered together, each with an MQTT listener on 127.0.0.1.

    Args:
        folder: where the configs, Mnesia folders and logs go (default: a new temporary folder, removed by
            :meth:`stop`).
        nodes: how many nodes (3: quorum queues and the MQTT plugin's client-id tracker are Raft groups that need a
            majority, so 3 survive one node's loss).
        queue_type: ``mqtt.durable_queue_type``, ``"quorum"`` or ``"classic"`` (module docstring).
        mirror: set the policy ``ha-mode: all``, ``ha-sync-mode: automatic`` on the MQTT subscription queues
            (``^mqtt-subscription-``): the classic ones are mirrored on every node (module docstring).

    Raises:
        RabbitClusterError: from :meth:`start`, when RabbitMQ or epmd is missing or a node does not come up.
    """

    def __init__(self, folder: Path | None = None, *, nodes: int = 3, queue_type: str = "quorum",
                 mirror: bool = True) -> None:
        if queue_type not in ("quorum", "classic"):
            raise ValueError(f"queue_type must be 'quorum' or 'classic', not {queue_type!r}")
        self._own_folder = folder is None
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="wildfed-rabbit-"))
        tag = uuid.uuid4().hex[:8]
        self.names = [f"wf-{tag}-{i}@localhost" for i in range(nodes)]
        self.amqp_ports = [free_port() for _ in range(nodes)]
        self.dist_ports = [free_port() for _ in range(nodes)]
        self.mqtt_ports = [free_port() for _ in range(nodes)]
        self.epmd_port = free_port()
        self.queue_type = queue_type
        self.mirror = mirror
        self.procs: list[subprocess.Popen | None] = [None] * nodes
        self._epmd: subprocess.Popen | None = None
        self.started_s: float | None = None  # seconds from the first node's start to every node answering MQTT

    @property
    def urls(self) -> list[str]:
        """Each node's MQTT listener as ``mqtt://127.0.0.1:<port>``, node 0 first."""
        return [f"mqtt://127.0.0.1:{p}" for p in self.mqtt_ports]

    def log(self, i: int) -> Path:
        """Node ``i``'s RabbitMQ log file."""
        return self.folder / f"log{i}" / f"{self.names[i]}.log"

    def _env(self, i: int | None = None) -> dict[str, str]:
        """The environment of node ``i``'s server, or of a ``rabbitmqctl`` (``i`` None)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(HOME=str(self.folder), ERL_EPMD_PORT=str(self.epmd_port), ERL_EPMD_ADDRESS="127.0.0.1",
                   RABBITMQ_CONF_ENV_FILE=str(self.folder / "rabbitmq-env.conf"))
        if i is not None:
            env.update(RABBITMQ_NODENAME=self.names[i], RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
                       RABBITMQ_NODE_PORT=str(self.amqp_ports[i]), RABBITMQ_DIST_PORT=str(self.dist_ports[i]),
                       RABBITMQ_MNESIA_BASE=str(self.folder / f"mnesia{i}"),
                       RABBITMQ_LOG_BASE=str(self.folder / f"log{i}"),
                       RABBITMQ_CONFIG_FILE=str(self.folder / f"node{i}.conf"),
                       RABBITMQ_ADVANCED_CONFIG_FILE=str(self.folder / "advanced.config"),
                       RABBITMQ_ENABLED_PLUGINS_FILE=str(self.folder / "enabled_plugins"),
                       RABBITMQ_PID_FILE=str(self.folder / f"node{i}.pid"),
                       # the distribution listens on loopback only; one scheduler thread each (2 shared cores)
                       RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} "
                       "+S 1:1 +SDio 1 +A 2")
        return env

    def _prepare(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        cookie = self.folder / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(uuid.uuid4().hex.upper())
            cookie.chmod(0o400)
        (self.folder / "rabbitmq-env.conf").write_text("")
        (self.folder / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        peers = "\n".join(f"cluster_formation.classic_config.nodes.{j + 1} = {name}"
                          for j, name in enumerate(self.names))
        for i in range(len(self.names)):
            (self.folder / f"node{i}.conf").write_text(_CONFIG.format(
                mqtt_port=self.mqtt_ports[i], queue_type=self.queue_type, peers=peers))

    def start_node(self, i: int) -> None:
        """Start node ``i`` (again, after :meth:`kill`: same ports, same Mnesia folder) without waiting for it."""
        if RABBITMQ_SERVER is None:
            raise RabbitClusterError("rabbitmq-server is not installed (Debian: apt-get install rabbitmq-server)")
        (self.folder / f"log{i}").mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"log{i}" / "stdout.log", "ab") as out:
            self.procs[i] = subprocess.Popen([RABBITMQ_SERVER], env=self._env(i), cwd=self.folder, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout_s: float = 120.0) -> RabbitCluster:
        """Start epmd and every node (node 0 first, the others once it answers), wait until each answers an MQTT
        CONNECT, check that they form one cluster, and set the mirroring policy when asked for.

        Raises:
            RabbitClusterError: epmd or RabbitMQ is missing, a node exited, gave no CONNACK within ``timeout_s``,
                or the nodes did not form one cluster.
        """
        if RABBITMQ_SERVER is None or _EPMD is None:
            raise RabbitClusterError("rabbitmq-server (and its epmd) are not installed")
        began = time.monotonic()
        self._prepare()
        self._epmd = subprocess.Popen([_EPMD, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = began + timeout_s
        try:
            self.start_node(0)
            self.wait_ready(0, deadline - time.monotonic())
            for i in range(1, len(self.names)):
                self.start_node(i)
            for i in range(1, len(self.names)):
                self.wait_ready(i, max(1.0, deadline - time.monotonic()))
            running = self.ctl(0, "eval", "lists:sort(rabbit_nodes:all_running()).").strip()
            if any(name not in running for name in self.names):
                raise RabbitClusterError(f"the nodes did not form one cluster: node 0 runs with {running}")
            if self.mirror:
                self.ctl(0, "set_policy", "--apply-to", "queues", "mqtt-ha", "^mqtt-subscription-",
                         '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began
        return self

    def ctl(self, i: int, *args: str, timeout_s: float = 60.0) -> str:
        """Run ``rabbitmqctl -n <node i> <args>``; its standard output.

        Raises:
            RabbitClusterError: it failed (its output is in the message).
        """
        assert _SCRIPTS is not None
        done = subprocess.run([str(_SCRIPTS / "rabbitmqctl"), "-q", "-n", self.names[i], *args], env=self._env(),
                              cwd=self.folder, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RabbitClusterError(f"rabbitmqctl {' '.join(args)} on {self.names[i]}: {done.stdout} {done.stderr}")
        return done.stdout

    def wait_ready(self, i: int, timeout_s: float) -> float:
        """Wait until node ``i`` answers an MQTT CONNECT with a successful CONNACK; the seconds that took.

        Raises:
            RabbitClusterError: the node exited or gave no CONNACK within ``timeout_s``.
        """
        return wait_for_connack(self.mqtt_ports[i], client_id=f"wildfed-probe-{i}", timeout_s=timeout_s,
                                running=lambda: self.procs[i] is not None and self.procs[i].poll() is None,
                                failure=lambda what: RabbitClusterError(f"rabbitmq-server {self.names[i]} {what}: "
                                                                 f"{self._tail(i)}"),
                                poll_s=0.25)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``'s process group (a crash: no goodbye to its clients or peers) and reap it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        """Stop every node (SIGTERM to each process group, SIGKILL after 15 s), then epmd; remove the folder when
        this cluster made it."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass
                try:  # the script's child, the Erlang VM, too
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
            self.procs[i] = None
        if self._epmd is not None:
            self._epmd.kill()
            self._epmd.wait(5)
            self._epmd = None
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _tail(self, i: int, lines: int = 5) -> str:
        for path in (self.log(i), self.folder / f"log{i}" / "stdout.log"):
            try:
                return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                continue
        return "(no log)"

    def __enter__(self) -> RabbitCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a cluster for a benchmark run by hand
    cluster = RabbitCluster().start()
    print(f"up in {cluster.started_s:.1f} s", flush=True)
    print("\n".join(f"{name}: {url}" for name, url in zip(cluster.names, cluster.urls)), flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
