"""One gateway's link to the broker, played by a TCP relay on the loopback: online it forwards bytes both ways,
offline it has cut the gateway off. The gateway's ``broker_url`` names the relay (:attr:`LinkRelay.url`); nothing in
the gateway SDK changes.

What "offline" is here, precisely:

- **Going offline** aborts every connection through the relay, both halves at once (the gateway's paho client sees
  its socket fail, the broker sees its client vanish without a DISCONNECT and publishes the site's last will). A
  message in flight is lost in the middle; the transport's chunk receipts, the outbox and the open-round task
  request on every reconnect are what recover it (docs/transport.md).
- **While offline** the relay still accepts TCP connections, and keeps what the gateway sends on them (its MQTT
  CONNECT) without answering: the gateway's connect attempt hangs, as a store-and-forward modem would hold it, and
  its paho client gives up after its keep-alive (30 s) and tries again. Nothing reaches the broker.
- **Coming online** opens a broker connection for every connection still held, sends what was kept and forwards
  from then on, so a gateway that was waiting is connected within milliseconds of the window's start.

Why hold rather than refuse: a refused connection would let the gateway's full-jitter back-off (1 s doubling to a
60 s cap, edge_sdk/uplink/mqtt.py) grow for the whole gap, and then sleep through a window; in compressed time a
60 s sleep is a whole satellite pass. Held, the back-off stays at its first steps and no window is missed because of
it. What the relay does not simulate: latency, bandwidth, packet loss, or a link that is up but degraded; the
broker and the coordinator are always reachable from each other. TLS passes through untouched (the gateway then
connects to 127.0.0.1, which its certificate check must accept: the demo uses plain ``mqtt://``).
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlparse

from shared.errors import ConfigError

__all__ = ["LinkRelay"]

_READ = 65536


class LinkRelay:
    """A relay from ``127.0.0.1:<free port>`` to the broker of ``upstream_url`` (module docstring), online at start.

    Args:
        upstream_url: the broker, ``mqtt://host:port`` (or ``mqtts://``; default ports 1883 / 8883).
        hold_bytes: the most bytes kept from one held connection (a client that sends more is dropped).

    Attributes:
        url: ``mqtt://127.0.0.1:<port>`` (the upstream's scheme), what the gateway's ``broker_url`` must name.
        cuts: connections aborted when the link went offline. held: connections accepted while offline.

    Raises:
        ConfigError: ``upstream_url`` is not an ``mqtt://`` or ``mqtts://`` URL with a host.
    """

    def __init__(self, upstream_url: str, *, hold_bytes: int = 1 << 20) -> None:
        parsed = urlparse(upstream_url)
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
            raise ConfigError(f"bad broker URL {upstream_url!r}", field="broker",
                              fix="use mqtt://host:port (the demo's embedded broker, or --broker)")
        self._upstream = (parsed.hostname, parsed.port or (8883 if parsed.scheme == "mqtts" else 1883))
        self._hold_bytes = int(hold_bytes)
        self.cuts = 0
        self.held = 0
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wildfed-link-relay", daemon=True)
        self._thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        except BaseException:
            self._stop_loop()
            raise
        self.url = f"{parsed.scheme}://127.0.0.1:{port}"

    @property
    def online(self) -> bool:
        """Whether the link is up now."""
        return self._up.is_set()

    def set_online(self, online: bool) -> None:
        """Bring the link up or down (module docstring); returns once done (every connection cut, going down).

        Raises:
            RuntimeError: the relay is closed.
        """
        if self._closed:
            raise RuntimeError("the link relay is closed")
        asyncio.run_coroutine_threadsafe(self._set(bool(online)), self._loop).result(timeout=10)

    def close(self) -> None:
        """Stop accepting, abort every connection, stop the relay's thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        finally:
            self._stop_loop()

    def __enter__(self) -> "LinkRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the relay's event loop --------------------------------------------------------------------------------
    async def _start(self) -> int:
        self._up = asyncio.Event()
        self._up.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _set(self, online: bool) -> None:
        if online:
            self._up.set()
            return
        if not self._up.is_set():
            return
        self._up.clear()
        for client, upstream in list(self._links):
            client.transport.abort()
            upstream.transport.abort()
            self.cuts += 1

    async def _shutdown(self) -> None:
        self._server.close()
        for writer in list(self._clients):
            writer.transport.abort()
        for client, upstream in list(self._links):
            client.transport.abort()
            upstream.transport.abort()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One gateway connection: held while offline, then forwarded until either side closes or it is cut."""
        self._clients.add(writer)
        upstream = None
        try:
            kept = bytearray()
            if not self._up.is_set():
                self.held += 1
                if not await self._hold(reader, kept):
                    return  # the gateway gave up while held
            try:
                up_reader, upstream = await asyncio.open_connection(*self._upstream)
            except OSError:
                return  # the broker is unreachable: the gateway sees the drop and reconnects
            if not self._up.is_set():  # went down while connecting
                return
            upstream.write(bytes(kept))
            pair = (writer, upstream)
            self._links.add(pair)
            try:
                pipes = {asyncio.ensure_future(_pipe(reader, upstream)),
                         asyncio.ensure_future(_pipe(up_reader, writer))}
                _, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
            finally:
                self._links.discard(pair)
        finally:
            self._clients.discard(writer)
            writer.transport.abort()
            if upstream is not None:
                upstream.transport.abort()

    async def _hold(self, reader: asyncio.StreamReader, kept: bytearray) -> bool:
        """Keep what the gateway sends until the link is up (True), or until it hangs up or sends too much
        (False)."""
        while not self._up.is_set():
            read = asyncio.ensure_future(reader.read(_READ))
            up = asyncio.ensure_future(self._up.wait())
            done, pending = await asyncio.wait({read, up}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if read in done:
                try:
                    data = read.result()
                except (ConnectionError, OSError):
                    return False
                if not data:
                    return False
                kept += data
                if len(kept) > self._hold_bytes:
                    return False
        return True

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until end of stream or a socket error."""
    try:
        while data := await reader.read(_READ):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
