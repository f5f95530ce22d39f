"""A zero-setup MQTT broker for the demo: amqtt (pure Python) on a free loopback port, in its own process.

Production and the integration tests use Mosquitto; amqtt is 3-5x slower per large message
but needs nothing installed beyond the ``demo`` extra. It listens on 127.0.0.1 only, allows anonymous
clients (nothing but this machine can reach it) and has the ``$SYS`` plugin off.

Run standalone: ``python -m wildfed_sim.embedded_broker --port 18830``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["free_port", "wait_for_port", "embedded_broker", "serve"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float = 20.0) -> None:
    """Block until an MQTT broker on ``host:port`` answers a CONNECT with a successful CONNACK (MQTT 3.1.1,
    sec. 3.1-3.2; paho's client), then disconnect cleanly. A bare TCP probe would do, but the broker logs every
    connection that closes before its CONNECT as a failed client session (amqtt: "Failed to initialize client
    session"), which reads like an error in the demo's broker log.

    Raises:
        TimeoutError: no broker accepted a connection within ``timeout_s`` seconds.
    """
    import paho.mqtt.client as mqtt

    deadline = time.monotonic() + timeout_s
    while True:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"wildfed-probe-{os.getpid()}")
        try:
            client.connect(host, port, keepalive=10)
            while not client.is_connected() and time.monotonic() < deadline:
                if client.loop(timeout=0.2) != mqtt.MQTT_ERR_SUCCESS:
                    break
            if client.is_connected():
                client.disconnect()
                client.loop(timeout=0.2)  # sends the DISCONNECT
                return
        except OSError:
            pass
        finally:
            sock = client.socket()  # still open after a refused or unanswered CONNECT
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no MQTT broker accepted connections on {host}:{port} within {timeout_s} s")
        time.sleep(0.1)


async def serve(port: int) -> None:
    """Run an amqtt broker on 127.0.0.1:``port`` until SIGTERM/SIGINT."""
    from amqtt.broker import Broker

    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await broker.shutdown()


@contextlib.contextmanager
def embedded_broker(port: int | None = None, *, log_path: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """Start the embedded broker in a child process; yield its URL ``mqtt://127.0.0.1:PORT``; stop it on exit.

    Raises:
        ImportError: amqtt is not installed (install the ``demo`` extra).
        TimeoutError: the broker did not come up.
    """
    import importlib.util

    if importlib.util.find_spec("amqtt") is None:
        raise ImportError("the embedded broker needs amqtt: pip install 'wildfed[demo]', or pass --broker "
                          "mqtt://host:port to use a running broker such as Mosquitto")
    port = port or free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "wildfed_sim.embedded_broker", "--port", str(port)],
                            stdout=log, stderr=log)
    try:
        wait_for_port("127.0.0.1", port)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


def main() -> None:
    """Entry point of ``python -m wildfed_sim.embedded_broker``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=1883)
    args = parser.parse_args()
    asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
