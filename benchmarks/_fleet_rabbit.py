"""load_fleet.py ``--cluster rabbitmq``: the three-node RabbitMQ 3.10 cluster of tests/rabbitmq_cluster.py in place of
the private Mosquitto, its nodes' Erlang VMs for the CPU/RSS sampler, the optional SIGKILL of node 2 once a fraction
of the round's updates is stored, and the check that every update was stored (and charged) once.

What RabbitMQ 3.10 imposes (docs/brokers.md, "RabbitMQ 3.10"): no working ``$share`` subscriptions, so
``ingest_workers: 0``; retained messages are node-local and not delivered on wildcard filters, so
``transfer.models_by_digest: false``; no ``$SYS`` topics, so the broker's counters are not read.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

__all__ = ["FORCED", "NodeKiller", "beam_pids", "start_cluster", "stored_once"]

#: printed by load_fleet.py when ``--cluster rabbitmq`` overrides its options
FORCED = ("RabbitMQ 3.10 cluster: ingest_workers 0 and transfer.models_by_digest false forced (no $share "
          "delivery; retained messages node-local and never on wildcard filters); no $SYS: broker counters not "
          "available, each node's CPU and RSS (psutil, its beam.smp) printed instead")


def start_cluster(folder: Path):  # noqa: ANN201 - tests.rabbitmq_cluster.RabbitCluster
    """Start three RabbitMQ nodes (quorum queues for persistent sessions, the ``ha-mode: all`` policy on the MQTT
    subscription queues so that a killed node's gateways can subscribe again elsewhere) under ``folder``."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.rabbitmq_cluster import RabbitCluster

    return RabbitCluster(folder).start()


def beam_pids(cluster) -> list[int]:  # noqa: ANN001
    """Each node's Erlang VM (``beam.smp``, a child of the ``rabbitmq-server`` script), node 0 first."""
    import psutil

    pids = []
    for proc in cluster.procs:
        kids = psutil.Process(proc.pid).children(recursive=True)
        beams = [k.pid for k in kids if k.name().startswith("beam")]
        pids.append(beams[0] if beams else proc.pid)
    return pids


class NodeKiller:
    """Polls the round's stored updates (``updates`` rows of round 1, every 0.2 s) and SIGKILLs node ``node`` of the
    cluster once ``fraction`` x ``total`` are stored; ``at`` (wall clock) and ``stored_at_kill`` say when."""

    def __init__(self, cluster, db_url: str, total: int, fraction: float, node: int = 2) -> None:  # noqa: ANN001
        self.cluster, self.db_url, self.node = cluster, db_url, node
        self.threshold = max(1, round(fraction * total))
        self.at: float | None = None
        self.stored_at_kill = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def _run(self) -> None:
        import sqlalchemy as sa

        engine = sa.create_engine(self.db_url)
        try:
            while not self._stop.wait(0.2):
                with engine.connect() as c:
                    n = c.execute(sa.text("SELECT count(*) FROM updates WHERE round = 1")).scalar_one()
                if n >= self.threshold:
                    self.cluster.kill(self.node)
                    self.at, self.stored_at_kill = time.time(), int(n)
                    return
        finally:
            engine.dispose()

    def stop(self) -> None:
        """Stop polling (the node is not killed if the threshold was not reached)."""
        self._stop.set()
        self._thread.join(timeout=5)


def stored_once(db_url: str) -> dict[str, int]:
    """Rows against distinct keys: ``updates`` (site, round) and ``ledger`` (site, round, category, mechanism)."""
    import sqlalchemy as sa

    engine = sa.create_engine(db_url)
    with engine.connect() as c:
        u = c.execute(sa.text("SELECT count(*), count(DISTINCT (site_id, round)) FROM updates")).one()
        led = c.execute(sa.text("SELECT count(*), count(DISTINCT (site_id, round, category, mechanism)) "
                                "FROM ledger")).one()
    engine.dispose()
    return {"updates rows": int(u[0]), "updates distinct (site, round)": int(u[1]), "ledger rows": int(led[0]),
            "ledger distinct (site, round, category, mechanism)": int(led[1])}

