"""Fleet load test: N light simulated gateways (default 1,000) with real signed updates of the demo's head model,
one round against the real coordinator, its ingest workers on PostgreSQL and a private Mosquitto; round time,
coordinator CPU per update beside the essential work, broker and database load, memory.

Run by hand (not part of the tests; needs mosquitto on PATH and PostgreSQL at ``--pg`` with trust auth)::

    .venv/bin/python benchmarks/load_fleet.py [--gateways 1000] [--ingest-workers 2] [--gateway-procs 4]
                                              [--privacy ccdp] [--categories VU,EN,LC] [--models-by-digest]
                                              [--pg postgresql+psycopg2://postgres@127.0.0.1:5432/test]
                                              [--cluster rabbitmq [--kill-node-at 0.5]]

What runs, all on this machine:

- a private mosquitto on a free loopback port (load_200.py's, ``max_queued_messages 0``, plus ``sys_interval 1``
  so its ``$SYS/broker/...`` counters are read once a second). It inherits this process's open-file limit: N
  gateways + the coordinator's clients need more than N descriptors, so the soft ``RLIMIT_NOFILE`` is raised
  (``resource.setrlimit``, up to the hard limit) before anything starts, and the limit is printed;
- a database of its own on that PostgreSQL server, ``CREATE DATABASE wf_fleet_<random>`` (dropped at the end);
- ``wildfed-coordinator run`` (load_200.py's wrapper: peak RSS at exit) on a generated config: FedAvg, quorum 1.0,
  one round, ``ingest_workers: W``, ``privacy: ccdp`` by default (each update reports one DP-SGD event per
  category of ``--categories``, so the ledger is written as in a camera round) or ``none``;
- W ``wildfed-coordinator ingest-worker`` processes (W = 0: the coordinator ingests alone);
- the gateways: paho clients (one connection each) in ``--gateway-procs`` processes (``_gateways.py``), each update
  the demo's head (``psi.weight`` 10 x 1280 + bias: 12,810 float32 parameters, one MQTT message), sealed before
  the round and published, all at once, when the coordinator publishes its first task (as in load_200.py).

Printed: the round's phases (coordinator database timestamps); CPU (user + system, psutil, sampled every 0.1 s) of
the coordinator and of the workers from the first update to the round's close, per update, beside the essential
work measured in this process on updates of the same shape (``Envelope.from_bytes``, Ed25519 verify, the BLAKE3
payload digest, ``decode_update``, ``add_weighted``); the broker's ``$SYS`` counters over the round (messages and
bytes in and out, clients) and its CPU and RSS; rows the round wrote per table (``pg_stat_user_tables``: inserts,
updates, deletes, so rows written and removed again, such as staging, count too); peak RSS of every process.

``--cluster rabbitmq`` (``_fleet_rabbit.py``): a three-node RabbitMQ 3.10 cluster (tests/rabbitmq_cluster.py) instead
of the Mosquitto; the coordinator and this process's watcher on node 0, gateway i on node i mod 3 (a gateway whose
node goes moves to the next one); ``ingest_workers`` 0 and ``models_by_digest`` false are forced and there are no
``$SYS`` counters (each node's CPU and RSS instead). ``--kill-node-at F`` SIGKILLs node 2 once F x N updates are
stored; the printout says whether the round closed and whether each update was stored once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from _federation import MiB, head_template, load_average, print_table
from _fleet import (Sampler, create_database, drop_database, essential_work, print_sys_table, raise_open_files,
                    table_writes)

_PG_DEFAULT = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def main() -> None:  # noqa: C901 - one linear script
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=1000)
    parser.add_argument("--ingest-workers", type=int, default=2, help="ingest-worker processes (0: the coordinator "
                        "ingests alone)")
    parser.add_argument("--gateway-procs", type=int, default=4, help="processes the gateways are spread over")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to run; the detailed tables are round 1's, "
                        "a per-round table (ledger rows by cohort) follows when more than one")
    parser.add_argument("--num-classes", type=int, default=10, help="head rows (the demo's species table: 10)")
    parser.add_argument("--privacy", choices=("ccdp", "none"), default="ccdp")
    parser.add_argument("--categories", default="VU,EN,LC", help="IUCN categories each ccdp update reports")
    parser.add_argument("--models-by-digest", action="store_true", help="transfer.models_by_digest")
    parser.add_argument("--pg", default=_PG_DEFAULT, help="an existing database on the server to connect to "
                        "first; the benchmark creates and drops a database of its own beside it")
    parser.add_argument("--essential-updates", type=int, default=200, help="updates timed in-process")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the round may take")
    parser.add_argument("--resend-interval", type=float, default=120.0, help="as load_200.py")
    parser.add_argument("--tally-channels", action="store_true", help="also subscribe to every topic of the "
                        "federation and count messages and bytes per channel (task, update, ack, model, ...); the "
                        "broker then sends all of it once more, to this process")
    parser.add_argument("--profile-coordinator", metavar="PATH", help="run the coordinator under cProfile and "
                        "write its stats to PATH (pstats); its CPU figures then include the profiler's overhead")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--cluster", choices=("rabbitmq",), help="a three-node broker cluster instead of Mosquitto")
    parser.add_argument("--kill-node-at", type=float, metavar="F", help="with --cluster: SIGKILL node 2 once a "
                        "fraction F of the round's updates is stored")
    args = parser.parse_args()
    if args.cluster:
        import _fleet_rabbit as rabbit

        args.ingest_workers, args.models_by_digest = 0, False
    elif args.kill_node_at is not None:
        parser.error("--kill-node-at needs --cluster")
    categories = tuple(c for c in args.categories.split(",") if c) if args.privacy == "ccdp" else ()

    import paho.mqtt.client as mqtt

    from coordinator.config import config_from_dict, load_config, save_config
    from coordinator.registry import SiteRegistry
    from coordinator.storage import RoundRow, Store
    from coordinator.transport.mqtt import parse_broker_url
    from shared.codec import encode_tensors, model_hash
    from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key
    from shared.topics import task_topic

    from _gateways import broadcast_to, spawn_workers
    from load_200 import _WRAPPER, _epoch, _private_broker

    limit = raise_open_files(args.gateways + 64 * (args.ingest_workers + 2) + 256)
    fed = f"fleet{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="wildfed-fleet-"))
    if args.cluster:
        cluster, broker_proc = rabbit.start_cluster(tmp / "rabbit"), None
        broker_url = cluster.urls[0]
        print(f"{rabbit.FORCED}; nodes up in {cluster.started_s:.1f} s: {' '.join(cluster.urls)}", flush=True)
    else:
        cluster, (broker_proc, broker_url) = None, _private_broker(tmp, "sys_interval 1\n")
    db_url, db_name = create_database(args.pg)
    print(f"load_fleet: {args.gateways} gateways in {args.gateway_procs} processes, head model {args.num_classes} x "
          f"1280, privacy {args.privacy} {list(categories)}, {args.ingest_workers} ingest workers, broker "
          f"{broker_url}, database {db_name}; {limit}; {load_average()}", flush=True)
    children: list[subprocess.Popen] = []
    sampler = Sampler()
    killer = None
    try:
        key = generate_signing_key()
        save_private_key(key, tmp / "keys" / "coordinator.key")
        save_public_key(key.public_key(), tmp / "keys" / "coordinator.pub")
        privacy = {"privacy": "none"} if args.privacy == "none" else {
            "privacy": "ccdp", "expected_batch_size": 8, "learning_rate": 0.1, "clipping_norm": 1.0,
            "target_delta": 1e-5, "budget": {"kind": "from_anchor", "category": "VU", "epsilon": 50.0, "gamma": 1.0}}
        cfg_path = save_config(config_from_dict({
            "federation_id": fed, "data_dir": "data", "broker_url": broker_url, "database_url": db_url,
            "rounds": args.rounds, "quorum_fraction": 1.0, "round_deadline_s": args.timeout, "local_steps": 5,
            "ship_ort_artifacts": False, "seed": 0, "ingest_workers": args.ingest_workers,
            "signing_key_path": "keys/coordinator.key", "public_key_path": "keys/coordinator.pub",
            "transfer": {"models_by_digest": args.models_by_digest}, **privacy}), tmp / "coordinator.yaml")
        cfg = load_config(cfg_path)
        template = head_template(args.num_classes)
        h0 = model_hash(template)
        store = Store(cfg.database_url or "", cfg.data_dir)
        store.put_model(h0, encode_tensors(template), round=0)
        registry = SiteRegistry(store)
        sites = [(f"gw{i:04d}", generate_signing_key()) for i in range(args.gateways)]
        for i, (site_id, k) in enumerate(sites):
            meta = {"capacity": 100 + i, **({"categories": list(categories)} if categories else {})}
            registry.enrol(site_id, public_key_to_pem(k.public_key()), meta)
        store.dispose()

        t0 = time.time()
        pipes, procs = spawn_workers(sites, workers=args.gateway_procs, broker_url=broker_url, federation_id=fed,
                                     coordinator_public_pem=public_key_to_pem(key.public_key()), params=0,
                                     chunk_size=256 * 1024, timeout_s=args.timeout, head_classes=args.num_classes,
                                     categories=categories, broker_urls=cluster.urls if cluster else ())
        for pipe in pipes:
            assert pipe.recv()[0] == "connected"
        print(f"  {args.gateways} gateways connected and subscribed in {time.time() - t0:.1f} s", flush=True)
        sealed = broadcast_to(pipes, ("seal", 1, h0))
        total_bytes, total_msgs = sum(s[1] for s in sealed), sum(s[2] for s in sealed)
        print(f"  {args.gateways} gateways connected and sealed {total_bytes / MiB:.1f} MiB in {total_msgs} messages "
              f"in {time.time() - t0:.1f} s", flush=True)

        host, port, _ = parse_broker_url(broker_url)
        opened, watch_ready = threading.Event(), threading.Event()
        task_seen: dict[int, str] = {}  # round -> base model hash, from the first gateway's task header

        def on_task(client, userdata, m) -> None:  # noqa: ANN001
            from shared.envelope import Envelope

            header = Envelope.from_bytes(bytes(m.payload)).header
            task_seen.setdefault(header.round, header.base_model_hash)
            opened.set()

        sys_stats: dict[str, str] = {}
        watch = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{fed}-watch", protocol=mqtt.MQTTv311)
        watch.message_callback_add(task_topic(fed, sites[0][0]), on_task)
        watch.message_callback_add("$SYS/broker/#", lambda c, u, m: sys_stats.__setitem__(
            m.topic.removeprefix("$SYS/broker/"), m.payload.decode(errors="replace")))
        tally: dict[str, list[int]] = {}

        def count(client, userdata, m) -> None:  # noqa: ANN001 - wildfed/v1/<fed>/<site|digest>/<id>/<channel>[/i]
            parts = m.topic.split("/")
            channel = parts[5] if len(parts) > 5 else "/".join(parts[3:4])
            c = tally.setdefault(channel + (" (chunks)" if len(parts) > 6 else ""), [0, 0])
            c[0] += 1
            c[1] += len(m.payload)

        watch.message_callback_add(f"wildfed/v1/{fed}/#", count)
        subs = [(task_topic(fed, sites[0][0]), 0)] + ([] if cluster else [("$SYS/broker/#", 0)])
        subs += [(f"wildfed/v1/{fed}/#", 0)] if args.tally_channels else []
        watch.on_subscribe = lambda *a: watch_ready.set()
        watch.on_connect = lambda client, *a: client.subscribe(subs)
        watch.connect(host, port, keepalive=60)
        watch.loop_start()
        if not watch_ready.wait(120):
            raise SystemExit("could not subscribe to the task topic")

        nodes = [f"RabbitMQ node {i}" for i in range(3)] if cluster else ["broker"]
        for name, pid in zip(nodes, rabbit.beam_pids(cluster) if cluster else [broker_proc.pid]):
            sampler.add(name, pid)
        sampler.add_matching("PostgreSQL backends", db_name)
        for p, i in zip(procs, range(len(procs))):
            sampler.add(f"gateways-{i}", p.pid)
        env = {**os.environ, "COLUMNS": "160"}
        for i in range(1, args.ingest_workers + 1):
            with open(tmp / f"ingest-{i}.out", "w") as out:
                w = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "ingest-worker", "--config",
                                      str(cfg_path), "--worker-id", f"ingest-{i}", "--log-level", "WARNING"],
                                     cwd=tmp, stdout=out, stderr=subprocess.STDOUT, env=env)
            children.append(w)
            sampler.add(f"ingest-{i}", w.pid)
        for i in range(1, args.ingest_workers + 1):
            log = tmp / f"ingest-{i}.out"
            deadline = time.time() + 120
            while "listening" not in log.read_text():
                if children[i - 1].poll() is not None or time.time() > deadline:
                    raise SystemExit(f"ingest worker {i} did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        time.sleep(1.5)  # a fresh $SYS publication and the workers' table reads flushed to pg_stat
        writes_before = table_writes(db_url)
        sampler.start()

        err_path = tmp / "coordinator.stderr"
        with open(err_path, "w") as err, open(tmp / "coordinator.stdout", "w") as out:
            (tmp / "coordinator_main.py").write_text(_WRAPPER)
            profile = ["-m", "cProfile", "-o", str(Path(args.profile_coordinator).resolve())] \
                if args.profile_coordinator else []
            proc = subprocess.Popen([sys.executable, *profile, str(tmp / "coordinator_main.py"), str(cfg_path)],
                                    cwd=tmp, stdout=out, stderr=err, env=env)
        children.append(proc)
        sampler.add("coordinator", proc.pid)
        t_launch = time.time()
        if not opened.wait(args.timeout):
            raise SystemExit(f"the coordinator published no task; see {err_path}")
        t_trigger = time.time()
        sys_before = dict(sys_stats)
        tally_before = {k: list(v) for k, v in tally.items()}
        print(f"  round open, first task seen {t_trigger - t_launch:.1f} s after launch; gateways uploading ...",
              flush=True)
        if args.kill_node_at is not None:
            killer = rabbit.NodeKiller(cluster, db_url, args.gateways, args.kill_node_at)
            killer.start()
        results = broadcast_to(pipes, ("updates", args.resend_interval))
        first = min(r[1]["first_publish"] for r in results)
        acks = {s: a for r in results for s, a in r[1]["acks"].items()}
        ok = sum(1 for _, accepted in acks.values() if accepted)
        resumes = {k: sum(r[1].get(k, 0) for r in results)
                   for k in ("resume_manifests", "receipts", "chunks_resent", "failovers")}
        firsts = {1: first}
        for r in range(2, args.rounds + 1):  # later rounds: seal on the round's base model once its task is seen
            deadline = time.time() + args.timeout
            while r not in task_seen and time.time() < deadline and proc.poll() is None:
                time.sleep(0.05)
            if r not in task_seen:
                raise SystemExit(f"no task of round {r}; see {err_path}")
            broadcast_to(pipes, ("seal", r, task_seen[r]))
            out_r = broadcast_to(pipes, ("updates", args.resend_interval))
            firsts[r] = min(x[1]["first_publish"] for x in out_r)
            print(f"  round {r}: {sum(1 for x in out_r for _, a in x[1]['acks'].values() if a)} positive ACKs",
                  flush=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the coordinator did not finish its round; see {err_path}")
        time.sleep(1.5)  # the broker's next $SYS publication
        sys_after = dict(sys_stats)
        sampler.stop()
        for w in children[:-1]:
            w.terminate()
        for w in children[:-1]:
            w.wait(timeout=30)
        broadcast_to(pipes, ("quit",))
        gateway_rss = dict(sampler.max_rss)
        for p in procs:
            p.join(timeout=10)
        watch.disconnect()
        watch.loop_stop()
        time.sleep(0.5)
        writes_after = table_writes(db_url)
        store = Store(db_url, cfg.data_dir, create=False)
        with store.session() as s:
            row = s.get(RoundRow, 1)
            status, accepted = row.status, row.num_accepted
            t_open, t_close = _epoch(row.opened_at), _epoch(row.closed_at) if row.closed_at else float("nan")
        rejections = store.rejection_counts()
        per_round = []
        if args.rounds > 1:
            import sqlalchemy as sa

            with store.session() as s:
                for r in range(1, args.rounds + 1):
                    rr = s.get(RoundRow, r)
                    led = s.execute(sa.text("SELECT count(*), count(DISTINCT site_id) FROM ledger WHERE round = :r"),
                                    {"r": r}).one()
                    cr = s.execute(sa.text("SELECT count(*) FROM cohort_rounds WHERE round = :r"), {"r": r}).one()
                    per_round.append([str(r), rr.status, str(rr.num_accepted),
                                      f"{_epoch(rr.closed_at) - firsts[r]:.1f}" if rr.closed_at else "n/a",
                                      str(led[0]), str(led[1]), str(cr[0])])
        store.dispose()
        vm = {ln.split()[1].rstrip(":"): float(ln.split()[2]) / 1024 for ln in err_path.read_text().splitlines()
              if ln.startswith("COORDINATOR")}

        n = args.gateways
        print(f"\nround 1: {status}, {accepted} of {n} updates accepted, {ok} positive ACKs, rejections "
              f"{rejections or 'none'}; resume manifests {resumes['resume_manifests']}, receipts "
              f"{resumes['receipts']}, chunks resent {resumes['chunks_resent']}, gateway failovers "
              f"{resumes['failovers']}; {load_average()}")
        if killer is not None:
            killer.stop()
            print("node 2 SIGKILLed: " + (f"{killer.at - first:.1f} s after the first update, {killer.stored_at_kill} "
                  f"updates stored; round closed {t_close - killer.at:.1f} s after the kill" if killer.at else
                  "no (threshold not reached)"))
        if cluster:
            lost = [i for i, (s, _) in enumerate(sites) if s not in acks]
            print(f"gateways without an ACK, by the node they started on: "
                  f"{[sum(1 for i in lost if i % 3 == k) for k in range(3)]}")
            print("stored once: " + ", ".join(f"{k} {v}" for k, v in rabbit.stored_once(db_url).items()))
        last_ack = max((t for t, _ in acks.values()), default=float("nan"))
        print_table(["phase", "seconds"], [
            ["round opened -> closed (coordinator DB)", f"{t_close - t_open:.1f}"],
            ["first update published -> all ACKed", f"{last_ack - first:.1f}"],
            ["first update published -> round closed", f"{t_close - first:.1f}"],
            ["updates per second (first update -> closed)", f"{n / (t_close - first):.0f}"],
        ])
        if per_round:
            print_table(["round", "status", "accepted", "first update -> closed, s", "ledger rows",
                         "ledger streams (site@cohort)", "cohort_rounds rows"], per_round)
        print()
        names = ["coordinator"] + [f"ingest-{i}" for i in range(1, args.ingest_workers + 1)]
        gws = [f"gateways-{i}" for i in range(len(procs))]
        others = [*nodes, "PostgreSQL backends", "machine"]
        cpu = {k: sampler.cpu_at(t_close, k) - sampler.cpu_at(first, k) for k in names + gws + others}
        cpu_acked = {k: sampler.cpu_at(last_ack, k) - sampler.cpu_at(first, k) for k in names + gws + others}
        cpu["gateways (all processes)"] = sum(cpu.pop(k) for k in gws)
        cpu_acked["gateways (all processes)"] = sum(cpu_acked.pop(k) for k in gws)
        coord_total = sum(cpu[k] for k in names)
        cpu["coordinator + workers"] = coord_total
        cpu_acked["coordinator + workers"] = sum(cpu_acked[k] for k in names)
        order = names + ["coordinator + workers", *nodes, "PostgreSQL backends", "gateways (all processes)",
                         "machine"]
        rows = [[k if k != "machine" else f"machine ({os.cpu_count()} cores, every process)", f"{cpu[k]:.1f}",
                 f"{cpu[k] / n * 1000:.2f}", f"{cpu_acked[k]:.1f}", f"{cpu[k] - cpu_acked[k]:.1f}"] for k in order]
        ess = essential_work(args.num_classes, min(args.essential_updates, n), categories)
        for k, v in ess.items():
            rows.append([f"  essential, in-process: {k}", "", f"{v:.3f}", "", ""])
        rows.append(["  essential, sum", "", f"{sum(ess.values()):.3f}", "", ""])
        print_table(["CPU (user + system)", "s, first update -> closed", "ms per update", "s, of which until all "
                     "ACKed", "s, after"],
                    rows)
        ratio = coord_total / n * 1000 / sum(ess.values())
        print(f"coordinator + workers CPU per update / essential work: {ratio:.0f}x")
        launch = sampler.cpu_at(t_close, "coordinator")
        print(f"coordinator CPU from launch -> round closed (imports, selection and cohort planning, tasks, ingest or "
              f"merge, close): {launch:.1f} s = {launch / n * 1000:.1f} ms per site; first task seen "
              f"{t_trigger - t_launch:.1f} s after launch")
        print()

        if cluster:
            print("broker: no $SYS on RabbitMQ; its nodes' CPU is in the table above, their peak RSS below")
        else:
            print_sys_table(sys_before, sys_after)
        print()
        if args.tally_channels:
            print_table(["channel (this process's subscription; trigger -> close)", "messages", "MiB", "KiB each"],
                        [[k, str(v[0] - tally_before.get(k, [0, 0])[0]),
                          f"{(v[1] - tally_before.get(k, [0, 0])[1]) / MiB:.2f}",
                          f"{v[1] / max(v[0], 1) / 1024:.1f}"] for k, v in sorted(tally.items())])
            print()
        wrows, tot = [], [0, 0, 0]
        for table in sorted(writes_after):
            a, b = writes_after[table], writes_before.get(table, (0, 0, 0, 0))
            d = [a[j] - b[j] for j in range(3)]
            if any(d):
                wrows.append([table, *map(str, d), str(a[3])])
                tot = [x + y for x, y in zip(tot, d)]
        wrows.append(["total", *map(str, tot), ""])
        print_table([f"PostgreSQL rows written by {args.rounds} round(s)", "inserted", "updated", "deleted",
                     "live after"], wrows)
        print()
        print_table(["peak RSS", "MiB"], [["coordinator (VmHWM at exit)", f"{vm.get('VmHWM', float('nan')):.0f}"]]
                    + [[k, f"{v:.0f}"] for k, v in gateway_rss.items() if k != "coordinator"])
    finally:
        sampler.stop()
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(timeout=10)
        if killer is not None:
            killer.stop()
        if cluster:
            cluster.stop()
        else:
            broker_proc.terminate()
            broker_proc.wait(timeout=10)
        drop_database(args.pg, db_name)
        if args.keep:
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
