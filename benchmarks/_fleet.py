"""Pieces of load_fleet.py: the open-file limit, a throw-away PostgreSQL database and its write counts, the
essential per-update work timed in-process, and a CPU/RSS sampler of the processes under test."""

from __future__ import annotations

import resource
import threading
import time
import uuid

from _federation import MiB, head_template, print_table, seal_update

__all__ = ["raise_open_files", "create_database", "drop_database", "table_writes", "essential_work", "Sampler",
           "print_sys_table"]


def raise_open_files(need: int) -> str:
    """Raise this process's soft ``RLIMIT_NOFILE`` to at least ``need`` (at most the hard limit); children
    (mosquitto, the gateway processes) inherit it. Returns a line saying what the limit is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < need:
        raise SystemExit(f"open-file limit {soft} < {need} needed (hard limit {hard}): raise it (ulimit -Hn)")
    return f"open-file limit (soft) {soft}, hard {hard}, needed {need}"


def create_database(admin_url: str) -> tuple[str, str]:
    """``CREATE DATABASE wf_fleet_<random>`` on the server of ``admin_url``; returns (its URL, its name)."""
    import sqlalchemy as sa

    name = f"wf_fleet_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return str(sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)), name


def drop_database(admin_url: str, name: str) -> None:
    """Drop the database :func:`create_database` made (after every client of it has gone)."""
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


def table_writes(url: str) -> dict[str, tuple[int, int, int, int]]:
    """Per table of the database: (rows inserted, updated, deleted since the database was made, live rows now),
    from ``pg_stat_user_tables`` (a backend's counts arrive there when it exits or goes idle)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT relname, n_tup_ins, n_tup_upd, n_tup_del, n_live_tup "
                                 "FROM pg_stat_user_tables")).all()
    engine.dispose()
    return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def essential_work(num_classes: int, updates: int, categories: tuple[str, ...]) -> dict[str, float]:
    """CPU milliseconds per update (``time.process_time``, this process) of the work no coordinator can skip, on
    ``updates`` signed head-model updates made here: parse, Ed25519 signature, BLAKE3 payload digest, decode,
    FedAvg accumulate."""
    from coordinator.strategies.fedavg import add_weighted, new_running_sum
    from shared.envelope import Envelope, verify_payload, verify_signature
    from shared.keys import generate_signing_key
    from shared.protocol import decode_update

    from _federation import update_delta

    template = head_template(num_classes)
    key = generate_signing_key()
    raws = [seal_update(key=key, federation_id="essential", site_id=f"s{i}", round=1, model_hash="0" * 64,
                        delta=update_delta(template, i % 4), num_examples=100 + i, categories=categories)
            for i in range(updates)]
    pub = key.public_key()
    acc = new_running_sum(template)
    cpu = dict.fromkeys(("Envelope.from_bytes", "verify Ed25519 signature", "BLAKE3 payload digest",
                         "decode_update", "add_weighted (FedAvg)"), 0.0)
    for _ in range(2):  # first pass warms up; the second is kept
        for k in cpu:
            cpu[k] = 0.0
        for raw in raws:
            t0 = time.process_time()
            env = Envelope.from_bytes(raw)
            t1 = time.process_time()
            verify_signature(env.header, env.signature, pub)
            t2 = time.process_time()
            verify_payload(env)
            t3 = time.process_time()
            report, delta = decode_update(env.payload)
            t4 = time.process_time()
            add_weighted(acc, delta, float(report.num_examples))
            t5 = time.process_time()
            for k, a, b in zip(cpu, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                cpu[k] += b - a
    return {k: v / updates * 1000 for k, v in cpu.items()}


def print_sys_table(sys_before: dict[str, str], sys_after: dict[str, str]) -> None:
    """The broker's ``$SYS/broker/...`` counters (Mosquitto) over the round: differences of two snapshots."""

    def delta(key: str) -> str:
        try:
            return f"{float(sys_after[key]) - float(sys_before[key]):.0f}"
        except (KeyError, ValueError):
            return "n/a"

    def mib(value: str) -> str:
        return value if value == "n/a" else f"{float(value) / MiB:.1f}"

    print_table(["broker ($SYS, trigger -> 1.5 s after close)", "value"], [
        ["MQTT packets received", delta("messages/received")], ["MQTT packets sent", delta("messages/sent")],
        ["PUBLISH received", delta("publish/messages/received")],
        ["PUBLISH sent", delta("publish/messages/sent")],
        ["MiB received", mib(delta("bytes/received"))], ["MiB sent", mib(delta("bytes/sent"))],
        ["clients connected (at trigger)", sys_before.get("clients/connected", "n/a")],
        ["clients maximum", sys_after.get("clients/maximum", "n/a")],
    ])


class Sampler:
    """Samples CPU seconds (user + system, all threads) and RSS of named processes every 0.1 s (psutil); also
    ``"machine"`` (every core's busy time: total less idle and iowait) and, per :meth:`add_matching` name, the sum
    over processes whose command line holds a string (found again every second; one that exits keeps its last
    sampled CPU time in the sum)."""

    def __init__(self) -> None:
        self.procs: dict[str, object] = {}
        self.matching: dict[str, str] = {}
        self._found: dict[str, dict[int, object]] = {}
        self._gone: dict[str, dict[int, float]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.max_rss: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, name: str, pid: int) -> None:
        import psutil

        self.procs[name] = psutil.Process(pid)

    def add_matching(self, name: str, needle: str) -> None:
        """Sample, as ``name``, the CPU of every process whose command line contains ``needle`` (e.g. the
        PostgreSQL backends of one database: ``postgres: <user> <database> ...``)."""
        self.matching[name] = needle
        self._found[name], self._gone[name] = {}, {}

    def _discover(self) -> None:
        import psutil

        for proc in psutil.process_iter(["pid", "cmdline"]):
            line = " ".join(proc.info.get("cmdline") or ())
            for name, needle in self.matching.items():
                if needle in line and proc.pid not in self._found[name]:
                    self._found[name][proc.pid] = proc

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import psutil

        last_discovery = 0.0
        while not self._stop.wait(0.1):
            if self.matching and time.time() - last_discovery > 1.0:
                self._discover()
                last_discovery = time.time()
            cpu = {}
            for name, found in self._found.items():
                for pid, p in list(found.items()):
                    try:
                        t = p.cpu_times()
                        self._gone[name][pid] = t.user + t.system  # the last value is kept after it exits
                    except psutil.Error:
                        del found[pid]
                cpu[name] = sum(self._gone[name].values())
            m = psutil.cpu_times()
            cpu["machine"] = sum(getattr(m, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
            for name, p in list(self.procs.items()):
                try:
                    t = p.cpu_times()
                    cpu[name] = t.user + t.system
                    self.max_rss[name] = max(self.max_rss.get(name, 0.0), p.memory_info().rss / MiB)
                except psutil.Error:
                    pass
            self.samples.append((time.time(), cpu))

    def cpu_at(self, t: float, name: str) -> float:
        """The last sampled CPU seconds of ``name`` at or before ``t`` (0.0 before its first sample)."""
        return max((c[name] for ts, c in self.samples if ts <= t and name in c), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
