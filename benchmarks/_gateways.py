"""Simulated gateways for the MQTT benchmarks (round_mqtt.py, load_200.py), run in worker processes so that their
publishing does not share a GIL with the coordinator or the counting subscriber they are measured against.

A worker holds one paho client per gateway (its own MQTT connection and client id, QoS 1, subscribed to the
gateway's ACK topic; it reports ``("connected", n)`` once every one has its SUBACK) and is driven over a
``multiprocessing`` pipe:

- ``("seal", round, model_hash)``: make every gateway's signed UPDATE and record the MQTT messages
  ``shared.transfer.send`` publishes for it (one whole envelope, or a signed manifest + 256 KiB chunks); untimed;
- ``("updates", resend_interval_s)``: every gateway (one thread each, like independent devices) publishes its
  recorded messages on its update topic, each waiting for its PUBACK as the edge agent's uplink does, then waits for
  the coordinator's signed ACK (verified with the coordinator's public key). Like the edge agent
  (``EdgeAgent.resend_pending``), a gateway with no ACK after ``resend_interval_s`` (+-50 % jitter) publishes a
  resume manifest; the coordinator's signed RECEIPT lists the chunks it lacks, which the gateway then resends
  (``shared.transfer.send(missing=...)``): a broker that dropped messages is recovered from this way;
- ``("raw", prefix)``: the same messages, same sizes and order, on ``<prefix>/<site>`` (the baseline: nobody
  parses them);
- ``("quit",)``.

Times are ``time.time()`` (wall clock), comparable across processes.

Broker clusters (load_fleet.py ``--cluster``): with ``broker_urls`` (every node's URL, same order in every worker)
gateway number i connects to node ``i mod len(broker_urls)``, and a gateway whose connection drops moves to the next
node in the list (paho's own reconnect loop, which retries the client's host and port; its ``on_connect``
subscribes again). A publish that finds the client disconnected waits for the reconnection and publishes again.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Sequence

__all__ = ["worker_main"]


def worker_main(conn, broker_url: str, federation_id: str, sites: Sequence[tuple[str, bytes, int]],  # noqa: ANN001
                coordinator_public_pem: str, params: int, chunk_size: int, ack_timeout_s: float,
                head_classes: int = 0, categories: Sequence[str] = (),
                broker_urls: Sequence[str] = ()) -> None:
    """Entry point of a gateway worker process (see the module docstring). ``sites``: (site id, raw Ed25519
    private key bytes, index of the gateway in the federation: its delta and N_k, so every payload differs).
    ``head_classes`` > 0: the model is the demo's head (``shared.models.head``, 1280-d embeddings, that many
    classes) instead of a ``params``-parameter synthetic one; ``categories``: IUCN codes each update reports a
    DP-SGD event for (privacy ``ccdp``; empty: privacy ``none``); ``broker_urls``: a cluster's nodes, used instead of
    ``broker_url`` (module docstring)."""
    import paho.mqtt.client as mqtt
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from coordinator.transport.mqtt import parse_broker_url
    from shared.envelope import Envelope, MessageKind, verify
    from shared.protocol import decode_ack
    from shared.topics import ack_topic, update_topic
    from shared.transfer import decode_receipt, send

    from _federation import head_template, model_template, seal_update, update_delta

    nodes = [parse_broker_url(u)[:2] for u in (broker_urls or (broker_url,))]
    coord_key = load_pem_public_key(coordinator_public_pem.encode())
    keys = {s: Ed25519PrivateKey.from_private_bytes(raw) for s, raw, _ in sites}
    index = {s: i for s, _, i in sites}
    template = head_template(head_classes) if head_classes > 0 else model_template(params)
    deltas = [update_delta(template, i) for i in range(4)]
    lock = threading.Lock()
    acks: dict[str, tuple[float, bool]] = {}
    all_acked = threading.Event()
    clients: dict[str, mqtt.Client] = {}
    online: dict[mqtt.Client, threading.Event] = {}  # set while the client is connected
    moves = {"failovers": 0}

    inbox: dict[str, queue.Queue] = {s: queue.Queue() for s in keys}
    inners: dict[str, bytes] = {}
    stats = {"resume_manifests": 0, "receipts": 0, "chunks_resent": 0}

    def on_ack(client, userdata, message) -> None:  # noqa: ANN001
        t = time.time()
        env = Envelope.from_bytes(bytes(message.payload))
        verify(env, coord_key)
        if env.header.kind == MessageKind.RECEIPT:
            inbox[env.header.site_id].put(("receipt", decode_receipt(env.payload).missing))
            return
        ack = decode_ack(env.payload)
        with lock:
            acks.setdefault(env.header.site_id, (t, ack.accepted))
            if len(acks) == len(keys):
                all_acked.set()
        inbox[env.header.site_id].put(("ack",))

    def on_disconnect(client, userdata, flags, rc, props, ev) -> None:  # noqa: ANN001
        ev.clear()
        if len(nodes) > 1 and rc.is_failure:  # lost, not asked for: the next node; paho's reconnect reads _host/_port
            k = (nodes.index((client._host, client._port)) + 1) % len(nodes)
            client._host, client._port = nodes[k]
            with lock:
                moves["failovers"] += 1

    for site_id in keys:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{federation_id}-{site_id}",
                        protocol=mqtt.MQTTv311, clean_session=True)
        c.on_message = on_ack
        connected = online[c] = threading.Event()
        subscribed = threading.Event()
        c.on_connect = lambda client, u, f, rc, p, ev=connected, s=site_id: (
            client.subscribe(ack_topic(federation_id, s), qos=1), ev.set()) if not rc.is_failure else None
        c.on_subscribe = lambda *a, ev=subscribed: ev.set()
        c.on_disconnect = lambda client, u, f, rc, p, ev=connected: on_disconnect(client, u, f, rc, p, ev)
        c.reconnect_delay_set(min_delay=1, max_delay=8)
        host, port = nodes[index[site_id] % len(nodes)]
        c.connect(host, port, keepalive=60)
        c.loop_start()
        if not connected.wait(30) or not subscribed.wait(120):  # its ACK subscription in place before any upload
            raise RuntimeError(f"gateway {site_id}: no CONNACK or no SUBACK from {host}:{port}")
        clients[site_id] = c
    messages: dict[str, list[bytes]] = {}

    def publish_all(topic_of, results: dict, resend_interval_s: float | None = None) -> None:  # noqa: ANN001
        def publish(c, topic: str, payload: bytes) -> None:  # noqa: ANN001
            ev = online[c] if len(nodes) > 1 else None
            for _ in range(20):  # a cluster node may drop the link: wait for the reconnection and publish again
                if ev is not None and not ev.wait(120):
                    raise RuntimeError(f"{topic}: not reconnected within 120 s")
                info = c.publish(topic, payload, qos=1)
                if info.rc == mqtt.MQTT_ERR_NO_CONN and ev is not None:  # paho may also send the queued copy once
                    time.sleep(0.5)  # back: a duplicate (load_fleet.py counts the rows stored per site and round)
                    continue
                info.wait_for_publish(timeout=120)
                if not info.is_published():
                    raise RuntimeError(f"{topic}: no PUBACK")
                return
            raise RuntimeError(f"{topic}: not connected at 20 tries")

        def one(site_id: str) -> None:
            c, topic = clients[site_id], topic_of(site_id)
            t0 = time.time()
            for payload in messages[site_id]:
                publish(c, topic, payload)
            with lock:
                results[site_id] = (t0, time.time())
            if resend_interval_s is None:
                return
            deadline = t0 + ack_timeout_s
            next_resend = time.time() + resend_interval_s * random.uniform(0.5, 1.5)
            while True:
                now = time.time()
                try:
                    item = inbox[site_id].get(timeout=max(0.01, min(next_resend, deadline) - now))
                except queue.Empty:
                    if time.time() >= deadline:
                        return
                    send(lambda t, p: publish(c, t, p), topic, inners[site_id], private_key=keys[site_id],
                         resume=True)
                    with lock:
                        stats["resume_manifests"] += 1
                    next_resend = time.time() + resend_interval_s * random.uniform(0.5, 1.5)
                    continue
                if item[0] == "ack":
                    return
                with lock:
                    stats["receipts"] += 1
                    stats["chunks_resent"] += len(item[1])
                if item[1]:
                    send(lambda t, p: publish(c, t, p), topic, inners[site_id], private_key=keys[site_id],
                         missing=item[1])
                next_resend = time.time() + resend_interval_s * random.uniform(0.5, 1.5)

        threads = [threading.Thread(target=one, args=(s,)) for s in keys]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    conn.send(("connected", len(clients)))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "seal":
            _, round_, model_hash = cmd
            messages.clear()
            for site_id, key in keys.items():
                i = index[site_id]  # distinct payloads: the coordinator's content-addressed blobs are all written
                raw = seal_update(key=key, federation_id=federation_id, site_id=site_id, round=round_,
                                  model_hash=model_hash, delta=deltas[i % 4], num_examples=100 + i, sequence=round_,
                                  chunk_size=chunk_size, categories=categories)
                out: list[bytes] = []
                send(lambda t, p, out=out: out.append(bytes(p)), update_topic(federation_id, site_id), raw,
                     private_key=key, chunk_size=chunk_size)
                messages[site_id] = out
                inners[site_id] = raw
            conn.send(("sealed", sum(len(p) for m in messages.values() for p in m),
                       sum(len(m) for m in messages.values())))
        elif cmd[0] in ("updates", "raw"):
            with lock:
                acks.clear()
                all_acked.clear()
                stats.update(resume_manifests=0, receipts=0, chunks_resent=0)
                for q in inbox.values():
                    while not q.empty():
                        q.get_nowait()
            results: dict[str, tuple[float, float]] = {}
            if cmd[0] == "updates":
                publish_all(lambda s: update_topic(federation_id, s), results, cmd[1] if len(cmd) > 1 else None)
                all_acked.wait(ack_timeout_s)
            else:
                prefix = cmd[1]
                publish_all(lambda s: f"{prefix}/{s}", results)
            with lock:
                conn.send(("done", {"first_publish": min(r[0] for r in results.values()),
                                    "last_puback": max(r[1] for r in results.values()),
                                    "acks": dict(acks), **stats, **moves}))
    for c in clients.values():
        c.disconnect()
        c.loop_stop()
    conn.send(("bye",))


def spawn_workers(sites, *, workers: int, broker_url: str, federation_id: str, coordinator_public_pem: str,  # noqa: ANN001
                  params: int, chunk_size: int, timeout_s: float, head_classes: int = 0,
                  categories: Sequence[str] = (), broker_urls: Sequence[str] = ()):
    """Start ``workers`` gateway processes (spawned, so no paho state is inherited), sites dealt round-robin.

    Args:
        sites: ``[(site id, Ed25519PrivateKey)]``. Other args: as :func:`worker_main` (``timeout_s``: its
            ``ack_timeout_s``; ``broker_urls``: a cluster's nodes, gateways dealt over them round-robin by their
            index in ``sites``).

    Returns:
        ``(pipes, processes)``: one pipe per worker for :func:`broadcast_to`.
    """
    import multiprocessing as mp

    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for w in range(workers):
        mine = [(s, k.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()), i)
                for i, (s, k) in enumerate(sites) if i % workers == w]
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(child, broker_url, federation_id, mine, coordinator_public_pem,
                                                  params, chunk_size, timeout_s, head_classes, tuple(categories),
                                                  tuple(broker_urls)),
                           daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    return pipes, procs


def broadcast_to(pipes, cmd: tuple) -> list:  # noqa: ANN001
    """Send ``cmd`` to every worker and return their answers, in worker order."""
    for pipe in pipes:
        pipe.send(cmd)
    return [pipe.recv() for pipe in pipes]
