"""One federated round of N gateways over a real MQTT broker, against the raw transfer of the same bytes.

Run by hand (not part of the tests; needs a broker, e.g. the Mosquitto on 127.0.0.1:1883)::

    .venv/bin/python benchmarks/round_mqtt.py [--gateways 20] [--params 1000000] [--repeats 3]
                                              [--broker mqtt://127.0.0.1:1883] [--workers 1]

A real :class:`~coordinator.service.Coordinator` (SQLite and blobs in a temporary folder, paho transport, FedAvg,
server SGD, privacy ``none``) runs in this process with N enrolled gateways. The gateways run in ``--workers``
separate processes (``_gateways.py``), one paho connection each. Training is not measured: every gateway's signed
UPDATE (a 1M-parameter float32 delta, ~3.8 MiB) and the MQTT messages ``shared.transfer.send`` makes of it (signed
manifest + 256 KiB chunks, as the edge agent sends them) are made before the clock starts, after the round is open
and its tasks published.

Timed, in rotating order each repeat:

- ``WildFed round``: from the first gateway's first publish to the coordinator's round close
  (``RoundManager.wait_for_quorum`` with quorum 1.0, then ``close_round``: ledger, FedAvg mean, server step, new
  model stored). Every chunk goes through ``TransferReceiver`` (staged in memory, or as a file past
  ``transfer.memory_limit_bytes``), each reassembled update through ``Ingestor.handle`` (verify, decode, checks,
  then with its commit group: fsync-ed blob, DB row, signed ACK, running sum). Also printed: the
  time until the last gateway has its (verified) ACK;
- ``raw transfer`` (baseline): the same gateways publish the same messages (same sizes, same order, QoS 1, each
  waiting for its PUBACK) to a plain topic; a plain paho subscriber in this process (QoS 1) only counts bytes. From
  the first publish to the last byte received.

Printed: per repeat and as medians, both times, their MiB/s and the ratio round / raw (issue target <= 1.5x). The
machine's load average is printed before and after (other processes disturb both variants alike, not equally
within one repeat: compare several repeats).
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from _federation import MiB, load_average, model_template, print_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=20)
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (float32)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each with its baseline transfer)")
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument("--chunk-size", type=int, default=256 * 1024, help="bytes per chunk (shared.transfer)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take")
    parser.add_argument("--essential", action="store_true",
                        help="also send the same messages to a subscriber that only does what any coordinator must "
                             "(hash each message, write each update durably, accumulate it) and print its CPU")
    args = parser.parse_args()

    import paho.mqtt.client as mqtt

    from coordinator.config import config_from_dict
    from coordinator.service import Coordinator
    from coordinator.transport.mqtt import parse_broker_url
    from shared.envelope import hash_piece
    from shared.keys import generate_signing_key, public_key_to_pem

    from _gateways import broadcast_to, spawn_workers

    fed = f"bench{uuid.uuid4().hex[:8]}"
    template = model_template(args.params)
    tmp = Path(tempfile.mkdtemp(prefix="wildfed-round-"))
    key = generate_signing_key()
    cfg = config_from_dict({
        "federation_id": fed, "data_dir": str(tmp / "data"), "broker_url": args.broker, "rounds": 10 ** 6,
        "quorum_fraction": 1.0, "round_deadline_s": args.timeout, "local_steps": 5, "privacy": "none",
        "ship_ort_artifacts": False, "seed": 0, "signing_key_path": str(tmp / "k.key"),
        "public_key_path": str(tmp / "k.pub"), "transfer": {"chunk_size_bytes": args.chunk_size}}).resolved(tmp)
    coord = Coordinator(cfg, signing_key=key, initial_weights=template)
    sites = [(f"gw{i:03d}", generate_signing_key()) for i in range(args.gateways)]
    for i, (site_id, k) in enumerate(sites):  # _gateways reports N_k = 100 + its index
        coord.enrol(site_id, public_key_to_pem(k.public_key()), {"capacity": 100 + i})
    coord.start()
    print(f"round_mqtt: {args.gateways} gateways in {args.workers} worker process(es), model {args.params:,} float32 "
          f"parameters, broker {args.broker}, chunks of {args.chunk_size} bytes, federation {fed}; {load_average()}",
          flush=True)

    # The baseline's plain subscriber: counts bytes, notes when the expected total is in.
    host, port, _ = parse_broker_url(args.broker)
    raw_prefix = f"bench/{fed}/raw"
    counter = {"bytes": 0, "expected": None, "last": 0.0}
    done = threading.Event()
    sub_ready = threading.Event()

    # The --essential variant's subscriber: what any coordinator must do with the same messages, and nothing else.
    essential_prefix = f"bench/{fed}/essential"
    jobs: queue.Queue = queue.Queue()
    essential: dict = {"per_site": 0, "parts": {}, "acc": None, "updates": 0, "expected": 0, "last": 0.0}
    essential_done = threading.Event()
    (tmp / "essential").mkdir()

    def essential_worker() -> None:
        """Per completed update: its bytes joined, written to a file and fsync-ed (``Store.put_blobs``), and its
        float32 values widened, scaled and added into a float64 running sum (FedAvg's ``_add_scaled``). No
        signature, decode, tensor checks, database row or ACK."""
        from coordinator.strategies.fedavg import _add_scaled, _scratch_buffer

        scratch = _scratch_buffer()
        while (item := jobs.get()) is not None:
            data = b"".join(item)
            fd = os.open(tmp / "essential" / f"{essential['updates']}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            values = np.frombuffer(data, dtype=np.float32, count=len(data) // 4)
            if essential["acc"] is None or essential["acc"].size != values.size:
                essential["acc"] = np.zeros(values.size)
            with np.errstate(all="ignore"):  # not every byte is a float (headers): the arithmetic is the same
                _add_scaled(essential["acc"], values, 0.05, scratch)
            essential["updates"] += 1
            if essential["updates"] >= essential["expected"]:
                essential["last"] = time.time()
                essential_done.set()

    threading.Thread(target=essential_worker, name="essential", daemon=True).start()

    def on_raw(client, userdata, message) -> None:  # noqa: ANN001
        if message.topic.startswith(essential_prefix):  # each message hashed once as it comes (check_chunk)
            hash_piece(message.payload)
            parts = essential["parts"].setdefault(message.topic, [])
            parts.append(message.payload)
            if len(parts) == essential["per_site"]:
                jobs.put(essential["parts"].pop(message.topic))
            return
        counter["bytes"] += len(message.payload)
        counter["last"] = time.time()
        if counter["expected"] is not None and counter["bytes"] >= counter["expected"]:
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{fed}-counter", protocol=mqtt.MQTTv311,
                      clean_session=True)
    sub.on_message = on_raw
    sub.on_subscribe = lambda *a: sub_ready.set()
    sub.on_connect = lambda client, *a: client.subscribe([(f"{raw_prefix}/+", 1), (f"{essential_prefix}/+", 1)])
    sub.connect(host, port, keepalive=60)
    sub.loop_start()
    if not sub_ready.wait(30):
        raise SystemExit("the counting subscriber could not subscribe")

    # Gateway workers.
    pipes, procs = spawn_workers(sites, workers=args.workers, broker_url=args.broker, federation_id=fed,
                                 coordinator_public_pem=public_key_to_pem(key.public_key()), params=args.params,
                                 chunk_size=args.chunk_size, timeout_s=args.timeout)
    for pipe in pipes:
        assert pipe.recv()[0] == "connected"

    def broadcast(cmd: tuple) -> list:
        return broadcast_to(pipes, cmd)

    import psutil

    this = psutil.Process()
    workers = [psutil.Process(p.pid) for p in procs]
    brokers = [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("mosquitto")]

    def thread_cpu() -> dict[str, float]:
        """CPU seconds so far of each thread of this process, by thread name (native threads without a Python
        name by id)."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, float] = {}
        for t in this.threads():
            name = names.get(t.id, f"native-{t.id}")
            out[name] = out.get(name, 0.0) + t.user_time + t.system_time
        return out

    def cpu() -> tuple[float, float, float]:
        """CPU seconds (user + system) so far of this process, the gateway workers, the local Mosquitto(s)."""
        def s(p) -> float:  # noqa: ANN001
            t = p.cpu_times()
            return t.user + t.system
        return s(this), sum(s(w) for w in workers), sum(s(b) for b in brokers)

    rows, ratios, bounds, essentials = [], [], [], []
    spent: dict[str, tuple[float, float, float]] = {}
    cores = os.cpu_count() or 1
    try:
        for rep in range(args.repeats):
            r, h = coord.rounds.next_round(), coord.rounds.current_model()[0]
            sealed = broadcast(("seal", r, h))
            total_bytes, total_msgs = sum(s[1] for s in sealed), sum(s[2] for s in sealed)
            order = (["raw", "round"] if rep % 2 == 0 else ["round", "raw"]) + (["essential"] if args.essential else [])
            times: dict[str, float] = {}
            for variant in order:
                c0, t0 = cpu(), thread_cpu()
                if variant == "essential":
                    essential.update(per_site=total_msgs // args.gateways, parts={}, updates=0,
                                     expected=args.gateways, last=0.0)
                    essential_done.clear()
                    out = broadcast(("raw", essential_prefix))
                    if not essential_done.wait(args.timeout):
                        raise SystemExit(f"essential: {essential['updates']} of {args.gateways} updates")
                    times["essential"] = essential["last"] - min(o[1]["first_publish"] for o in out)
                    print(f"  repeat {rep + 1}: essential work only (hash, durable write, accumulate), one update "
                          f"after the other: {times['essential']:.2f} s", flush=True)
                elif variant == "raw":
                    counter.update(bytes=0, expected=total_bytes, last=0.0)
                    done.clear()
                    out = broadcast(("raw", raw_prefix))
                    if not done.wait(args.timeout):
                        raise SystemExit(f"raw transfer incomplete: {counter['bytes']} of {total_bytes} bytes")
                    first = min(o[1]["first_publish"] for o in out)
                    times["raw"] = counter["last"] - first
                    print(f"  repeat {rep + 1}: raw transfer of {total_bytes / MiB:.1f} MiB in {total_msgs} messages: "
                          f"{times['raw']:.2f} s", flush=True)
                else:
                    t_open = time.time()
                    rctx = coord.rounds.open_round()
                    t_tasks = time.time() - t_open
                    task_cpu = (cpu()[0] - c0[0]) / args.gateways * 1e3
                    assert rctx is not None and rctx.round == r and rctx.model_hash == h
                    c0, t0 = cpu(), thread_cpu()  # the tasks' publishing is not timed, nor counted
                    for pipe in pipes:
                        pipe.send(("updates", 60.0))  # the edge agent's default resend interval
                    coord.rounds.wait_for_quorum(rctx)
                    result = coord.rounds.close_round(rctx)
                    t_close = time.time()
                    out = [pipe.recv() for pipe in pipes]
                    first = min(o[1]["first_publish"] for o in out)
                    acks = {s: a for o in out for s, a in o[1]["acks"].items()}
                    ok = sum(1 for _, accepted in acks.values() if accepted)
                    if result.status != "closed" or len(result.accepted) != args.gateways or ok != args.gateways:
                        raise SystemExit(f"round {r} {result.status}: {len(result.accepted)} accepted, {ok} positive "
                                         f"ACKs of {args.gateways}; rejections {coord.status().rejections}")
                    times["acked"] = max(t for t, _ in acks.values()) - first
                    times["round"] = t_close - first
                    print(f"  repeat {rep + 1}: round {r} closed with {len(result.accepted)} updates: all ACKed "
                          f"{times['acked']:.2f} s, closed {times['round']:.2f} s after the first publish (tasks "
                          f"published in {t_tasks:.2f} s before, {task_cpu:.1f} ms of this process's CPU per site)",
                          flush=True)
                c1, t1 = cpu(), thread_cpu()
                busy = sorted(((t1[n] - t0.get(n, 0.0), n) for n in t1), reverse=True)
                spent[variant] = tuple(b - a for a, b in zip(c0, c1))
                print(f"    CPU s of {variant}: this process {spent[variant][0]:.2f} ("
                      + ", ".join(f"{n} {d:.2f}" for d, n in busy if d >= 0.01)
                      + f"), gateways {spent[variant][1]:.2f}, broker {spent[variant][2]:.2f}; all "
                      f"{sum(spent[variant]):.2f} CPU s in {times[variant]:.2f} s = "
                      f"{sum(spent[variant]) / times[variant]:.2f} of {cores} cores", flush=True)
            ratios.append(times["round"] / times["raw"])
            # The round cannot take less wall time than all its CPU seconds spread over every core; the coordinator
            # may use at most what 1.5x the raw transfer's wall time leaves on the cores after the gateways and the
            # broker (as they used in this round).
            others = spent["round"][1] + spent["round"][2]
            bounds.append((sum(spent["round"]) / cores / times["raw"],
                           spent["round"][0] / args.gateways * 1e3,
                           max(0.0, 1.5 * times["raw"] * cores - others) / args.gateways * 1e3))
            if args.essential:
                essentials.append(spent["essential"][0] / args.gateways * 1e3)
            rows.append([f"repeat {rep + 1}", f"{total_bytes / MiB:.1f}", f"{times['raw']:.2f}",
                         f"{total_bytes / MiB / times['raw']:.0f}", f"{times['acked']:.2f}", f"{times['round']:.2f}",
                         f"{total_bytes / MiB / times['round']:.0f}", f"{times['acked'] / times['raw']:.2f}",
                         f"{ratios[-1]:.2f}"])
    finally:
        for pipe in pipes:
            try:
                pipe.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=10)
        sub.disconnect()
        sub.loop_stop()
        coord.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.gateways} gateways x 1 update, model {args.params:,} parameters; {load_average()}")
    print_table(["", "MiB", "raw s", "raw MiB/s", "all ACKed s", "round closed s", "round MiB/s", "ACKed/raw",
                 "closed/raw"], rows)
    print("CPU bound per repeat (all CPU seconds of the round / cores / raw transfer time; the round's ratio cannot "
          "be below it): " + ", ".join(f"{b[0]:.2f}x" for b in bounds))
    print("coordinator CPU per update, used / the most that a 1.5x round leaves it: "
          + ", ".join(f"{b[1]:.1f} / {b[2]:.1f} ms" for b in bounds))
    if essentials:
        print("essential CPU per update (receive, hash, durable write, accumulate: no signature, decode, checks, row "
              "or ACK): " + ", ".join(f"{e:.1f} ms" for e in essentials))
    med = float(np.median(ratios))
    print(f"median ratio round closed / raw transfer: {med:.2f}x (target <= 1.5x: {'met' if med <= 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
