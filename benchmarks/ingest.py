"""Coordinator ingest throughput (bytes/s of model updates) against a plain numpy add, and ingest peak memory vs K.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/ingest.py [--k 10,20,50] [--params 1000000] [--repeats 3] [--no-memory]

A float32 model of ``--params`` parameters in six tensors (``_federation.model_template``); K sites enrolled in a
real :class:`~coordinator.registry.SiteRegistry` on SQLite in a temporary folder; each site's update is a signed
UPDATE envelope (safetensors delta + report, Ed25519, ``shared.envelope.seal``) made before the timed part. Timed,
per K, over all K updates of one round:

- ``(a) Ingestor.handle``: the full path of an update that travels whole, as ``TransferReceiver`` hands it over:
  parse, topic/federation checks, Ed25519 signature + payload digest (BLAKE3 hash list, envelope format 2, one
  pass), replay window, round checks, decode
  (safetensors) + tensor/finite checks + ``decode_update``, report checks, durable blob write (fsync + rename), DB
  row (SQLite commit), signed ACK published on an ``InMemoryTransport``, accumulation into FedAvg's float64 running
  sum. Each repeat is a new round (the blobs of the previous one are deleted, untimed);
- ``(b) verify + decode + accumulate``: the same work without storage, checks or ACK: ``Envelope.from_bytes``,
  ``shared.envelope.verify`` (signature + payload digest, BLAKE3), ``shared.protocol.decode_update``,
  ``coordinator.strategies.fedavg.add_weighted``; each piece is also timed on its own;
- ``(b0) the same, unoptimised``: (b) with an unoptimised implementation (kept below as
  ``_old_from_bytes``, a payload copy, and ``_old_add_weighted``, two full-size float64 temporaries per tensor) and
  envelope format 1's verification (``_old_verify``: Ed25519 over the header, then one SHA-256 over the payload
  against the digest a format-1 header names, computed untimed), so that one run prints the ratio before and after;
- ``(c) numpy add``: the baseline, ``np.add(acc, x_k, out=acc)`` over K float32 arrays of the same number of bytes.

Throughput is (K x payload bytes) / time. Variants run in rotating, interleaved order (``_timing`` style) so that
load from other processes falls on all of them alike; medians and minima of ``--repeats`` repeats are printed with
the ratios (a)/(c), (b0)/(c) and (b)/(c) (target: (b) >= 25 % of (c)), and checks that (b) and (b0) end
with the same running sum, bit for bit.

Peak memory vs K: each K runs again in a fresh subprocess (``--child-memory K``), which feeds K updates through
``Ingestor.handle``, each envelope made just before it is handed over and dropped after (as a network thread
would), and reports the growth of ``ru_maxrss`` over the round and the ``tracemalloc`` peak (numpy buffers, Python
objects; not the Rust allocations of safetensors or OpenSSL's) above what was allocated before the round. Flat in K
means a streaming sum: never K updates in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

from _federation import MiB, load_average, model_template, num_bytes, peak_rss_mib, print_table, reset_peak_rss, \
    rss_mib, seal_update, update_delta

FED = "benchfed"


def _old_from_bytes(data: bytes):  # noqa: ANN202 - Envelope.from_bytes with a payload copy (unoptimised)
    from shared.envelope import MAGIC, MAX_HEADER_LENGTH, SIGNATURE_LENGTH, Envelope, EnvelopeHeader
    from shared.errors import MalformedEnvelopeError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedEnvelopeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or data[:4] != MAGIC:
        raise MalformedEnvelopeError("not a WildFed envelope (bad magic)")
    (header_length,) = struct.unpack(">I", data[4:8])
    if header_length > MAX_HEADER_LENGTH:
        raise MalformedEnvelopeError(f"header length {header_length} exceeds {MAX_HEADER_LENGTH} bytes")
    end = 8 + header_length
    if len(data) < end + SIGNATURE_LENGTH:
        raise MalformedEnvelopeError("envelope truncated")
    header = EnvelopeHeader.from_canonical_bytes(data[8:end])
    signature = data[end:end + SIGNATURE_LENGTH]
    payload = data[end + SIGNATURE_LENGTH:]
    return Envelope(header=header, signature=signature, payload=payload)


def _old_verify(env, public_key, payload_sha256: str) -> None:  # noqa: ANN001 - envelope format 1's verify
    """Envelope format 1's verification cost: the Ed25519 signature over the header (the same call as format 2),
    then SHA-256 over the whole payload against the digest its header named (``payload_sha256``)."""
    import hashlib

    from shared.envelope import verify_signature

    verify_signature(env.header, env.signature, public_key)
    if len(env.payload) != env.header.payload_length or hashlib.sha256(env.payload).hexdigest() != payload_sha256:
        raise ValueError("payload differs from its format-1 digest")


def _old_add_weighted(acc, delta, weight: float) -> None:  # noqa: ANN001 - unoptimised add_weighted
    if not (weight > 0 and np.isfinite(weight)):
        raise ValueError(f"FedAvg weight must be positive and finite, got {weight!r}")
    if set(delta) != set(acc.sums):
        raise ValueError("delta tensor names differ from the model")
    for name, buf in acc.sums.items():
        d = np.asarray(delta[name])
        if d.shape != buf.shape:
            raise ValueError(f"delta {name!r} has shape {d.shape}, model has {buf.shape}")
        buf += float(weight) * d.astype(np.float64, copy=False)
    acc.total_weight += float(weight)
    acc.count += 1


class Bench:
    """A coordinator's ingest side on SQLite in ``root``: store, registry with K sites, ledger, in-memory transport,
    ingestor; ``open_round(r)`` opens round r with a fresh FedAvg running sum."""

    def __init__(self, root: Path, k: int, params: int) -> None:
        from coordinator.inbound.ingest import Ingestor
        from coordinator.ledger import PrivacyLedger
        from coordinator.registry import SiteRegistry
        from coordinator.storage import Store
        from coordinator.transport import InMemoryTransport
        from shared.codec import model_hash
        from shared.keys import generate_signing_key, public_key_to_pem

        self.root = root
        self.store = Store(f"sqlite:///{root / 'coordinator.db'}", root / "data")
        self.registry = SiteRegistry(self.store)
        self.ledger = PrivacyLedger(self.store, target_delta=1e-5)
        self.transport = InMemoryTransport()
        self.acks = 0

        def count_ack(topic: str, raw: bytes) -> None:
            self.acks += 1

        from shared.topics import PREFIX

        self.transport.subscribe(f"{PREFIX}/{FED}/site/+/ack", count_ack)
        self.ingestor = Ingestor(federation_id=FED, store=self.store, registry=self.registry, ledger=self.ledger,
                                 transport=self.transport, signing_key=generate_signing_key())
        self.template = model_template(params)
        self.model_hash = model_hash(self.template)
        self.sites = [f"site{i:03d}" for i in range(k)]
        self.keys = {s: generate_signing_key() for s in self.sites}
        for s in self.sites:
            self.registry.enrol(s, public_key_to_pem(self.keys[s].public_key()), {"capacity": 100})
        self.deltas = [update_delta(self.template, i) for i in range(min(k, 4))]  # 4 distinct deltas, reused
        self.strategy = None

    def envelope(self, i: int, round: int) -> bytes:
        s = self.sites[i]
        return seal_update(key=self.keys[s], federation_id=FED, site_id=s, round=round, model_hash=self.model_hash,
                           delta=self.deltas[i % len(self.deltas)], num_examples=100 + i, sequence=round)

    def open_round(self, r: int) -> None:
        from coordinator.inbound.context import RoundContext
        from coordinator.storage import RoundRow, dumps
        from coordinator.strategies.fedavg import FedAvg

        self.ingestor.close_round()
        shutil.rmtree(self.store.blob_dir, ignore_errors=True)  # keep the disk small between rounds
        with self.store.session() as s:
            s.add(RoundRow(round=r, status="open", base_model_hash=self.model_hash, selected_json=dumps(self.sites),
                           privacy="none"))
        self.strategy = FedAvg()
        self.strategy.begin_round(self.template)
        self.ingestor.open_round(RoundContext(round=r, model_hash=self.model_hash, template=self.template,
                                              selected=frozenset(self.sites), halted={}, budgets={}, privacy="none",
                                              local_steps=5, strategy=self.strategy))

    def topic(self, i: int) -> str:
        from shared.topics import update_topic

        return update_topic(FED, self.sites[i])


def child_memory(k: int, params: int) -> None:
    """Peak memory of one round of K updates through ``Ingestor.handle`` (prints one JSON line)."""
    from coordinator.inbound.context import Accepted

    root = Path(tempfile.mkdtemp(prefix="wildfed-ingest-mem-"))
    try:
        bench = Bench(root, k, params)
        bench.open_round(1)  # warm-up round: one update, so that lazy imports and caches are in the baseline
        raw = bench.envelope(0, 1)
        assert isinstance(bench.ingestor.handle(bench.topic(0), raw), Accepted)
        del raw
        bench.open_round(2)
        reset = reset_peak_rss()
        rss0 = rss_mib() if reset else peak_rss_mib()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(k):
            raw = bench.envelope(i, 2)
            result = bench.ingestor.handle(bench.topic(i), raw)
            assert isinstance(result, Accepted), result
            del raw, result
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = peak_rss_mib()
        assert bench.strategy.count == k
        print(json.dumps({"k": k, "update_bytes": len(bench.envelope(0, 2)), "rss_before_mib": rss0, "hwm_reset": reset,
                          "rss_peak_mib": rss1, "rss_growth_mib": rss1 - rss0,
                          "tracemalloc_peak_mib": (peak - base) / MiB, "tracemalloc_left_mib": (current - base) / MiB}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def interleaved_prepared(steps: dict[str, tuple[Callable[[int], None], Callable[[], None]]], repeats: int,
                         warmup: int = 1) -> dict[str, np.ndarray]:
    """As ``_timing.interleaved``, but each step has an untimed ``prepare(repeat)`` run just before its timed call."""
    names = list(steps)
    for w in range(warmup):
        for name in names:
            prepare, run = steps[name]
            prepare(-1 - w)
            run()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            prepare, run = steps[name]
            prepare(r)
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: np.asarray(t) for name, t in times.items()}


def time_k(k: int, params: int, repeats: int) -> dict[str, object]:
    from coordinator.inbound.context import Accepted
    from coordinator.strategies.fedavg import add_weighted, new_running_sum
    from shared.envelope import Envelope, verify
    from shared.protocol import decode_update

    root = Path(tempfile.mkdtemp(prefix="wildfed-ingest-"))
    try:
        bench = Bench(root, k, params)
        payload_bytes = len(Envelope.from_bytes(bench.envelope(0, 0)).payload)
        keys = {s: bench.keys[s].public_key() for s in bench.sites}

        # (c) numpy add: K float32 arrays of the payload's tensor bytes into one accumulator.
        n = sum(v.size for v in bench.template.values())
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
        acc32 = np.zeros(n, np.float32)

        def numpy_add() -> None:
            for x in xs:
                np.add(acc32, x, out=acc32)

        # (b) verify + decode + accumulate, pieces timed too; (b0) the same, unoptimised (format 1, copies).
        raws_b = [bench.envelope(i, 0) for i in range(k)]
        format1_digests = [hashlib.sha256(Envelope.from_bytes(r).payload).hexdigest() for r in raws_b]  # untimed
        piece_names = ("Envelope.from_bytes", "verify (Ed25519 + payload hash)", "decode_update",
                       "add_weighted (FedAvg)")
        pieces: dict[str, list[float]] = {f"{v} {n}": [] for v in ("(b)", "(b0)") for n in piece_names}
        sums: dict[str, np.ndarray] = {}

        def new_verify(env, public_key, i: int) -> None:  # noqa: ANN001 - format 2: Ed25519 + BLAKE3 hash list
            verify(env, public_key)

        def old_verify(env, public_key, i: int) -> None:  # noqa: ANN001 - format 1: Ed25519 + SHA-256
            _old_verify(env, public_key, format1_digests[i])

        def make_vda(label: str, from_bytes: Callable, verify_one: Callable, accumulate: Callable
                     ) -> Callable[[], None]:
            def vda() -> None:
                acc = new_running_sum(bench.template)
                t = [0.0, 0.0, 0.0, 0.0]
                for i, raw in enumerate(raws_b):
                    t0 = time.perf_counter()
                    env = from_bytes(raw)
                    t1 = time.perf_counter()
                    verify_one(env, keys[env.header.site_id], i)
                    t2 = time.perf_counter()
                    report, delta = decode_update(env.payload)
                    t3 = time.perf_counter()
                    accumulate(acc, delta, float(report.num_examples))
                    t4 = time.perf_counter()
                    t = [t[0] + t1 - t0, t[1] + t2 - t1, t[2] + t3 - t2, t[3] + t4 - t3]
                for name, v in zip(piece_names, t):
                    pieces[f"{label} {name}"].append(v)
                sums[label] = acc.sums

            return vda

        # (a) the full path: a new round per repeat, K fresh envelopes sealed (untimed) for it.
        state = {"round": 10, "raws": []}

        def prepare_full(r: int) -> None:
            state["raws"] = []
            state["round"] += 1
            bench.open_round(state["round"])
            state["raws"] = [bench.envelope(i, state["round"]) for i in range(k)]

        def full() -> None:
            for i, raw in enumerate(state["raws"]):
                result = bench.ingestor.handle(bench.topic(i), raw)
                if not isinstance(result, Accepted):
                    raise RuntimeError(f"update {i} refused: {result}")

        # (h) and (w): the two primitives no verify + accumulate can skip, alone: one BLAKE3 pass over each payload
        # (one thread, as the coordinator hashes) and the float64 widen-scale-add of its tensors.
        from shared.envelope import hash_piece

        payloads = [Envelope.from_bytes(r).payload for r in raws_b]
        deltas = [decode_update(p)[1] for p in payloads]

        def hash_only() -> None:
            for p in payloads:
                hash_piece(p)

        def add_only() -> None:
            acc = new_running_sum(bench.template)
            for d in deltas:
                add_weighted(acc, d, 1.0)

        def nothing(r: int) -> None:
            pass

        names = {"a": "(a) Ingestor.handle (full path)", "b": "(b) verify + decode + accumulate",
                 "b0": "(b0) the same, unoptimised", "c": "(c) numpy add (baseline)",
                 "h": "(h) BLAKE3 of each payload alone", "w": "(w) widen-scale-add alone"}
        times = interleaved_prepared({names["a"]: (prepare_full, full),
                                      names["b"]: (nothing, make_vda("(b)", Envelope.from_bytes, new_verify,
                                                                     add_weighted)),
                                      names["b0"]: (nothing, make_vda("(b0)", _old_from_bytes, old_verify,
                                                                      _old_add_weighted)),
                                      names["c"]: (nothing, numpy_add), names["h"]: (nothing, hash_only),
                                      names["w"]: (nothing, add_only)}, repeats)
        for name in pieces:
            pieces[name] = pieces[name][1:]  # drop the warm-up call
        assert bench.acks >= k * (repeats + 1)
        for name, v in sums["(b)"].items():  # before and after give the same running sum, bit for bit
            if not np.array_equal(v, sums["(b0)"][name]):
                raise AssertionError(f"running sums of (b) and (b0) differ in {name!r}")
        return {"k": k, "payload_bytes": payload_bytes, "tensor_bytes": num_bytes(bench.template), "times": times,
                "pieces": {name: np.asarray(v) for name, v in pieces.items()}, "names": names}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", default="10,20,50", help="comma-separated numbers of updates per round")
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (float32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--child-memory", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory is not None:
        child_memory(args.child_memory, args.params)
        return

    ks = [int(x) for x in args.k.split(",") if x.strip()]
    print(f"ingest benchmark: model {args.params:,} float32 parameters, K = {ks}, {args.repeats} interleaved "
          f"repeats; {load_average()}", flush=True)
    rows, piece_rows, ratio_rows, floor_rows = [], [], [], []
    cores = os.cpu_count() or 1
    for k in ks:
        print(f"  K={k}: timing ...", flush=True)
        res = time_k(k, args.params, args.repeats)
        total = k * res["payload_bytes"]
        names = res["names"]
        med = {n: float(np.median(t)) for n, t in res["times"].items()}
        low = {n: float(np.min(t)) for n, t in res["times"].items()}
        for n, t in res["times"].items():
            rows.append([f"K={k:<3d} {n}", f"{med[n] * 1e3:.1f}", f"{low[n] * 1e3:.1f}", f"{med[n] / k * 1e3:.2f}",
                         f"{total / med[n] / MiB:.0f}", f"{total / low[n] / MiB:.0f}"])
        for n, t in res["pieces"].items():
            piece_rows.append([f"K={k:<3d} {n}", f"{np.median(t) / k * 1e3:.2f}",
                               f"{total / np.median(t) / MiB:.0f}"])
        a, b, b0, c = names["a"], names["b"], names["b0"], names["c"]
        floor = med[names["h"]] + med[names["w"]]
        floor_rows.append([f"K={k}", f"{med[names['h']] / k * 1e3:.2f}", f"{med[names['w']] / k * 1e3:.2f}",
                           f"{med[c] / floor:.3f}", f"{med[c] / (floor / cores):.3f}"])
        ratio_rows.append([f"K={k}", f"{med[c] / med[a]:.3f} ({low[c] / low[a]:.3f})",
                           f"{med[c] / med[b0]:.3f} ({low[c] / low[b0]:.3f})",
                           f"{med[c] / med[b]:.3f} ({low[c] / low[b]:.3f})",
                           f"{med[b0] / med[b]:.2f}x", "yes" if med[c] / med[b] >= 0.25 else "no"])
    payload_mib = res["payload_bytes"] / MiB
    print(f"\nthroughput (payload {payload_mib:.2f} MiB per update = {res['tensor_bytes'] / MiB:.2f} MiB of tensors "
          "+ safetensors header; numpy add over the same number of bytes):")
    print_table(["variant", "median ms", "min ms", "ms/update", "MiB/s (median)", "MiB/s (min)"], rows)
    print("\npieces of (b), per update (medians):")
    print_table(["piece", "ms/update", "MiB/s"], piece_rows)
    print("\nthroughput ratios vs numpy add, medians (minima in brackets); target: (b)/(c) >= 0.25")
    print_table(["K", "(a)/(c)", "(b0)/(c) before", "(b)/(c) after", "(b) speed-up", "(b) target met"],
                ratio_rows)

    print(f"\nthe ceiling of (b)/(c) on this machine: hash and accumulate alone, one after the other, and spread "
          f"perfectly over its {cores} cores (no verify + decode + accumulate can beat the latter)")
    print_table(["K", "(h) ms/update", "(w) ms/update", "(c)/((h)+(w))", f"(c)/(((h)+(w))/{cores})"], floor_rows)

    if not args.no_memory:
        print("\npeak memory of one round through Ingestor.handle, each K in a fresh subprocess:", flush=True)
        mem_rows = []
        here = Path(__file__).resolve()
        for k in ks:
            print(f"  K={k}: memory ...", flush=True)
            out = subprocess.run([sys.executable, str(here), "--child-memory", str(k), "--params", str(args.params)],
                                 capture_output=True, text=True, check=True, cwd=os.getcwd())
            m = json.loads(out.stdout.strip().splitlines()[-1])
            mem_rows.append([f"K={k}", f"{k * m['update_bytes'] / MiB:.0f}", f"{m['rss_before_mib']:.0f}",
                             f"{m['rss_peak_mib']:.0f}", f"{m['rss_growth_mib']:.1f}",
                             f"{m['tracemalloc_peak_mib']:.1f}", f"{m['tracemalloc_left_mib']:.1f}"])
        print_table(["K", "K x update MiB", "RSS before MiB", "RSS peak MiB", "RSS growth MiB",
                     "tracemalloc peak MiB", "still held MiB"], mem_rows)
        print("(flat RSS growth and tracemalloc peak across K = streaming sum; 'K x update' is what holding every "
              "update would cost)")
    print(f"\nfinished; {load_average()}")


if __name__ == "__main__":
    main()
