"""Load test: N simulated gateways (default 200) through one round over MQTT on loopback; round time and the
coordinator's peak memory.

Run by hand (not part of the tests; needs a broker, e.g. the Mosquitto on 127.0.0.1:1883)::

    .venv/bin/python benchmarks/load_200.py [--gateways 200] [--params 1000000] [--workers 4]
                                            [--broker mqtt://127.0.0.1:1883] [--baseline]

The coordinator is the real one in its own process, ``wildfed-coordinator run`` (``coordinator.cli``) on a config
written to a temporary folder (SQLite, privacy ``none``, FedAvg, quorum 1.0, one round), with the round-0 model
(``--params`` float32 parameters, ~3.8 MiB for 1M) stored and the N gateways enrolled beforehand. Its resident
memory is sampled every 0.1 s (psutil) and its peak (``VmHWM``) read when it exits.

The gateways are paho clients (one MQTT connection each) spread over ``--workers`` processes (``_gateways.py``).
Their signed updates and the messages ``shared.transfer.send`` makes of them (manifest + 256 KiB chunks) are made
before the round (training is not measured). Gateways do not download their tasks (that would put another N x 3.8
MiB through these two cores); instead this process listens on the first gateway's task topic and, as soon as the
coordinator publishes the first task (after it opened the round for ingest), tells every gateway to upload, all at
once; the coordinator keeps publishing the other tasks meanwhile, as in a real round.

Printed: the round's times (opened -> closed; first update publish -> last gateway ACKed -> round closed, from the
coordinator's database timestamps), MiB/s of updates, the coordinator's time per update (wall, and its CPU time
over the same span, sampled with psutil: on a shared machine the CPU time is the fairer measure) and its peak RSS. ``--baseline`` then lets the
same gateways push the same messages to a plain counting subscriber (raw transfer through the same broker).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path


from _federation import MiB, load_average, model_template, print_table

_WRAPPER = """
import atexit, sys
def _peak():
    with open('/proc/self/status') as fh:
        for line in fh:
            if line.startswith(('VmHWM:', 'VmRSS:')):
                print('COORDINATOR', line.strip(), file=sys.stderr, flush=True)
atexit.register(_peak)
sys.argv = ['wildfed-coordinator', 'run', '--config', sys.argv[1]]
from coordinator.cli import app
app()
"""


def _private_broker(tmp: Path, extra_conf: str = "") -> tuple[subprocess.Popen, str]:
    """A mosquitto on a free loopback port with no per-client queue limit (the stock default, 1000 queued QoS 1
    messages per client, drops a coordinator's backlog when N gateways upload at once); ``extra_conf``: more lines
    of mosquitto.conf (load_fleet.py adds ``sys_interval 1``). It inherits this process's open-file limit, which
    caps its connections (``max_connections`` is unlimited by default)."""
    import shutil as _sh
    import socket

    exe = _sh.which("mosquitto") or "/usr/sbin/mosquitto"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 0\n"
                    f"{extra_conf}")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"mqtt://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the private mosquitto did not start")


def _epoch(naive_utc: dt.datetime) -> float:
    return naive_utc.replace(tzinfo=dt.timezone.utc).timestamp()


def _compare() -> None:
    """``--compare``: this script twice (same other arguments), whole-model tasks then ``--models-by-digest``; prints
    each run's output and the coordinator's CPU per update of both and their ratio (CPU, not wall: fairer on a
    shared machine)."""
    import re

    argv = [a for a in sys.argv[1:] if a not in ("--compare", "--models-by-digest")]
    cpu, cpu_open = {}, {}
    for label, extra in (("whole model in each task", []), ("models by digest", ["--models-by-digest"])):
        out = subprocess.run([sys.executable, __file__, *argv, *extra], capture_output=True, text=True,
                             check=False)
        print(f"==== {label} ====\n{out.stdout}{out.stderr[-2000:] if out.returncode else ''}", flush=True)
        found = re.search(r"= ([0-9.]+) ms per update", out.stdout)
        cpu[label] = float(found.group(1)) if found else float("nan")
        found = re.search(r"= ([0-9.]+) ms/update per update", out.stdout)
        cpu_open[label] = float(found.group(1)) if found else float("nan")
    for name, values in (("first update -> closed", cpu), ("round opened -> closed", cpu_open)):
        (a, va), (b, vb) = values.items()
        print(f"coordinator CPU per update ({name}): {a} {va:.1f} ms, {b} {vb:.1f} ms; ratio "
              f"{va / vb if vb else float('nan'):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=200)
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (float32)")
    parser.add_argument("--workers", type=int, default=4, help="gateway worker processes")
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--chunk-size", type=int, default=256 * 1024, help="bytes per chunk (shared.transfer)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds the round may take")
    parser.add_argument("--baseline", action="store_true", help="also time the raw transfer of the same messages")
    parser.add_argument("--resend-interval", type=float, default=60.0, help="seconds a gateway waits for its ACK "
                        "before it sends a resume manifest (+-50 %% jitter; the edge agent's resend_interval_s)")
    parser.add_argument("--private-broker", action="store_true", help="start a private mosquitto on a free port "
                        "with no per-client queue limit (max_queued_messages 0) instead of using --broker")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (database, blobs, log)")
    parser.add_argument("--models-by-digest", action="store_true", help="transfer.models_by_digest: the round's "
                        "model published once (retained, by digest) and tasks without weights")
    parser.add_argument("--compare", action="store_true", help="run twice in subprocesses, tasks with the whole "
                        "model then --models-by-digest, and print the coordinator's CPU per update of each and "
                        "their ratio")
    args = parser.parse_args()
    if args.compare:
        _compare()
        return

    import paho.mqtt.client as mqtt
    import psutil

    from coordinator.config import config_from_dict, load_config, save_config
    from coordinator.registry import SiteRegistry
    from coordinator.storage import RoundRow, Store
    from coordinator.transport.mqtt import parse_broker_url
    from shared.codec import encode_tensors, model_hash
    from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key
    from shared.topics import task_topic

    from _gateways import broadcast_to, spawn_workers

    fed = f"load{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="wildfed-load-"))
    broker_proc = None
    if args.private_broker:
        broker_proc, args.broker = _private_broker(tmp)
    print(f"load_200: {args.gateways} gateways in {args.workers} worker processes, model {args.params:,} float32 "
          f"parameters, broker {args.broker}, federation {fed}, folder {tmp}; {load_average()}", flush=True)

    # Coordinator state: config, keys, round-0 model, enrolled gateways.
    key = generate_signing_key()
    save_private_key(key, tmp / "keys" / "coordinator.key")
    save_public_key(key.public_key(), tmp / "keys" / "coordinator.pub")
    cfg_path = save_config(config_from_dict({
        "federation_id": fed, "data_dir": "data", "broker_url": args.broker, "rounds": 1, "quorum_fraction": 1.0,
        "round_deadline_s": args.timeout, "local_steps": 5, "privacy": "none", "ship_ort_artifacts": False,
        "seed": 0, "signing_key_path": "keys/coordinator.key", "public_key_path": "keys/coordinator.pub",
        "transfer": {"chunk_size_bytes": args.chunk_size, "models_by_digest": args.models_by_digest}}),
        tmp / "coordinator.yaml")
    cfg = load_config(cfg_path)
    template = model_template(args.params)
    h0 = model_hash(template)
    store = Store(cfg.database_url or "", cfg.data_dir)
    store.put_model(h0, encode_tensors(template), round=0)
    registry = SiteRegistry(store)
    sites = [(f"gw{i:03d}", generate_signing_key()) for i in range(args.gateways)]
    for i, (site_id, k) in enumerate(sites):  # _gateways reports N_k = 100 + its index
        registry.enrol(site_id, public_key_to_pem(k.public_key()), {"capacity": 100 + i})

    # Gateway workers: connect, then make their signed updates for round 1.
    pipes, procs = spawn_workers(sites, workers=args.workers, broker_url=args.broker, federation_id=fed,
                                 coordinator_public_pem=public_key_to_pem(key.public_key()), params=args.params,
                                 chunk_size=args.chunk_size, timeout_s=args.timeout)

    def broadcast(cmd: tuple) -> list:
        return broadcast_to(pipes, cmd)

    for pipe in pipes:
        assert pipe.recv()[0] == "connected"
    t0 = time.time()
    sealed = broadcast(("seal", 1, h0))
    total_bytes, total_msgs = sum(s[1] for s in sealed), sum(s[2] for s in sealed)
    print(f"  {args.gateways} gateways connected; {total_bytes / MiB:.0f} MiB of updates in {total_msgs} messages "
          f"sealed in {time.time() - t0:.1f} s", flush=True)

    # The trigger: the first task the coordinator publishes (the round is open for ingest by then).
    host, port, _ = parse_broker_url(args.broker)
    opened = threading.Event()
    watch_ready = threading.Event()
    watch = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{fed}-watch", protocol=mqtt.MQTTv311,
                        clean_session=True)
    watch.on_message = lambda *a: opened.set()
    watch.on_subscribe = lambda *a: watch_ready.set()
    watch.on_connect = lambda client, *a: client.subscribe(task_topic(fed, sites[0][0]), qos=0)
    raw_prefix = f"bench/{fed}/raw"
    counter = {"bytes": 0, "expected": None, "last": 0.0}
    raw_done = threading.Event()

    def on_raw(client, userdata, message) -> None:  # noqa: ANN001
        counter["bytes"] += len(message.payload)
        counter["last"] = time.time()
        if counter["expected"] is not None and counter["bytes"] >= counter["expected"]:
            raw_done.set()

    watch.message_callback_add(f"{raw_prefix}/+", on_raw)
    watch.connect(host, port, keepalive=60)
    watch.loop_start()
    if not watch_ready.wait(30):
        raise SystemExit("could not subscribe to the task topic")

    # The coordinator process, its memory sampled.
    err_path = tmp / "coordinator.stderr"
    with open(err_path, "w") as err, open(tmp / "coordinator.stdout", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, str(cfg_path)], cwd=tmp, stdout=out, stderr=err,
                                env={**os.environ, "COLUMNS": "160"})
    ps = psutil.Process(proc.pid)
    samples: list[tuple[float, float, float]] = []  # (time, RSS MiB, CPU seconds user + system, all threads)

    def sample() -> None:
        while proc.poll() is None:
            try:
                cpu = ps.cpu_times()
                samples.append((time.time(), ps.memory_info().rss / MiB, cpu.user + cpu.system))
            except psutil.Error:
                break
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t_launch = time.time()
    if not opened.wait(args.timeout):
        proc.kill()
        raise SystemExit(f"the coordinator published no task; see {err_path}")
    t_trigger = time.time()
    print(f"  coordinator started, round open, first task seen {t_trigger - t_launch:.1f} s after launch; "
          "gateways uploading ...", flush=True)
    results = broadcast(("updates", args.resend_interval))
    first = min(r[1]["first_publish"] for r in results)
    last_puback = max(r[1]["last_puback"] for r in results)
    acks = {s: a for r in results for s, a in r[1]["acks"].items()}
    ok = sum(1 for _, accepted in acks.values() if accepted)
    resumes = {k: sum(r[1][k] for r in results) for k in ("resume_manifests", "receipts", "chunks_resent")}
    print(f"  {ok} of {args.gateways} gateways got a positive ACK; waiting for the coordinator to exit ...", flush=True)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"the coordinator did not finish its round; see {err_path}")
    sampler.join(timeout=5)
    peak_lines = [ln for ln in err_path.read_text().splitlines() if ln.startswith("COORDINATOR")]
    vm = {ln.split()[1].rstrip(":"): float(ln.split()[2]) / 1024 for ln in peak_lines}
    with store.session() as s:
        row = s.get(RoundRow, 1)
        status, accepted = row.status, row.num_accepted
        t_open, t_close = _epoch(row.opened_at), _epoch(row.closed_at) if row.closed_at else float("nan")
    rejections = store.rejection_counts()
    before_updates = [rss for t, rss, _ in samples if t < first]
    during = [rss for t, rss, _ in samples if first <= t <= t_close]
    cpu_before = max((c for t, _, c in samples if t < first), default=float("nan"))
    cpu_at_close = max((c for t, _, c in samples if t <= t_close), default=float("nan"))
    cpu_round = cpu_at_close - cpu_before  # sampled every 0.1 s: +-0.1 s at each end
    cpu_open = cpu_at_close - max((c for t, _, c in samples if t < t_open), default=float("nan"))

    raw_time = None
    if args.baseline:
        counter.update(bytes=0, expected=total_bytes, last=0.0)
        watch.subscribe(f"{raw_prefix}/+", qos=1)
        time.sleep(0.5)
        out_raw = broadcast(("raw", raw_prefix))
        if raw_done.wait(120):
            raw_time = counter["last"] - min(o[1]["first_publish"] for o in out_raw)
        else:
            print(f"  raw transfer incomplete after 120 s: {counter['bytes'] / MiB:.0f} of {total_bytes / MiB:.0f} MiB "
                  "received (the broker dropped messages)")
    broadcast(("quit",))
    for p in procs:
        p.join(timeout=10)
    watch.disconnect()
    watch.loop_stop()
    store.dispose()

    print(f"\nround 1: {status}, {accepted} of {args.gateways} updates accepted, {ok} positive ACKs, rejections "
          f"{rejections or 'none'}; gateways' resume manifests {resumes['resume_manifests']}, receipts "
          f"{resumes['receipts']}, chunks resent {resumes['chunks_resent']}; {load_average()}")
    rows = [
        ["round opened -> closed (coordinator DB)", f"{t_close - t_open:.1f}", ""],
        ["first task seen -> first update published", f"{first - t_trigger:.2f}", ""],
        ["first update published -> last PUBACK", f"{last_puback - first:.1f}", f"{total_bytes / MiB / (last_puback - first):.0f}"],
        ["first update published -> all ACKed", f"{max(t for t, _ in acks.values()) - first:.1f}" if acks else "n/a",
         f"{total_bytes / MiB / (max(t for t, _ in acks.values()) - first):.0f}" if acks else ""],
        ["first update published -> round closed", f"{t_close - first:.1f}", f"{total_bytes / MiB / (t_close - first):.0f}"],
    ]
    if raw_time is not None:
        rows.append(["raw transfer of the same messages (baseline)", f"{raw_time:.1f}",
                     f"{total_bytes / MiB / raw_time:.0f}"])
    print_table(["phase", "seconds", "MiB/s of updates"], rows)
    if raw_time is not None:
        print(f"ratio round closed / raw transfer: {(t_close - first) / raw_time:.2f}x")
    print(f"coordinator time per update (first update published -> round closed, / {args.gateways}): "
          f"{(t_close - first) / args.gateways * 1000:.1f} ms wall; its CPU (user + system, all threads) over the "
          f"same span: {cpu_round:.1f} s = {cpu_round / args.gateways * 1000:.1f} ms per update (target: "
          "<= 15 ms)")
    print(f"coordinator CPU from round opened (tasks published) -> round closed: {cpu_open:.1f} s = "
          f"{cpu_open / args.gateways * 1000:.1f} ms/update per update")
    print()
    print_table(["coordinator memory", "MiB"], [
        ["peak RSS (VmHWM at exit)", f"{vm.get('VmHWM', float('nan')):.0f}"],
        ["max sampled RSS before the first update", f"{max(before_updates):.0f}" if before_updates else "n/a"],
        ["max sampled RSS while updates came in", f"{max(during):.0f}" if during else "n/a"],
        ["updates received (N x update)", f"{total_bytes / MiB:.0f}"],
    ])
    if broker_proc is not None:
        broker_proc.terminate()
        broker_proc.wait(timeout=10)
    if args.keep:
        print(f"(coordinator log: {err_path}; data in {tmp / 'data'})")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
