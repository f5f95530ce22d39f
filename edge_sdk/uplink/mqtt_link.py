"""The MQTT transport's link supervision (:class:`LinkSupervisor`, a base of
:class:`edge_sdk.uplink.mqtt.MqttTransport`): what happens when the link drops, and the reconnects after it.

Reconnection: paho's own reconnect loop (a fixed doubling from ``reconnect_delay_set``) is switched off
(``reconnect_on_failure=False``: paho's network thread ends when the link drops). A supervisor thread then waits
``uniform(0, min(cap, base * 2**n))`` seconds before attempt ``n`` (n = 0, 1, ... since the last CONNACK): "full
jitter" (M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015), which spreads the reconnects of
hundreds of gateways after a broker restart instead of synchronising them.

Failover (docs/brokers.md): with ``failover_urls`` (the site's ``broker_failover_urls``, further nodes of a broker
cluster) the first attempt after a drop goes to the same node, and every later one to the next node of the list, in
turn; :meth:`~edge_sdk.uplink.mqtt.MqttTransport.connect` tries them in order too. The session is clean, so nothing
is lost by changing node: the outbox re-sends on the CONNACK as after any reconnect.

In-flight window: a :meth:`~edge_sdk.uplink.mqtt.MqttTransport.publish` that is waiting for its PUBACK when the link
drops raises :class:`~edge_sdk.uplink.transport.TransportError` at once (within about 50 ms), instead of waiting out
its timeout. The message may or may not have reached the broker. paho would keep it and send it again (DUP) after
the reconnect; this transport discards paho's copies of the messages in flight when the link drops instead, because
a message the broker refuses by closing the connection (over its ``max_packet_size``) would otherwise be sent again
on every reconnect, and the link would never carry anything else. The gateway's outbox still holds the update and
re-sends it (or gives it up, edge_sdk.agent) on the next connect, and the coordinator deduplicates by (site, round)
and envelope sequence, so at-least-once delivery holds and duplicates are harmless.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

__all__ = ["LinkSupervisor", "full_jitter_delay"]

log = logging.getLogger("edge_sdk.uplink.mqtt")  # the transport's logger: its link messages as before


def full_jitter_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to wait before reconnect attempt ``attempt`` (0-based): uniform in ``[0, min(cap_s, base_s * 2**attempt)]``.

    "Full jitter" from M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog (2015).
    """
    ceiling = min(cap_s, base_s * (2.0 ** min(attempt, 62)))
    return rng.uniform(0.0, ceiling)


class LinkSupervisor:
    """The transport's link-drop handling and reconnect thread, as a base class of
    :class:`edge_sdk.uplink.mqtt.MqttTransport`, which provides what it reads and writes: ``_client`` (the paho
    client), ``_connected``, ``_generation``, ``disconnects``, ``_last_failure``, ``_closing``, ``_link_down``,
    ``_stop``, ``_loop_lock`` (a lock around starting and stopping paho's network thread), ``_backoff``, ``_rng``, ``_attempt``, ``reconnect_delays``, ``brokers``, ``broker``, ``failovers``,
    ``_host``, ``_port`` and ``_keepalive``."""

    # paho callback (network thread) ----------------------------------------------------------------------------
    def _discard_in_flight(self) -> None:
        """Drop paho's copies of the messages it has not seen acknowledged (module docstring, "In-flight window"),
        so that it does not send them again after the reconnect; their publishers get a TransportError. paho 2.x
        has no public call for it: this reads its ``_out_messages`` under its ``_out_message_mutex`` and does
        nothing where a paho version lacks them."""
        messages = getattr(self._client, "_out_messages", None)
        mutex = getattr(self._client, "_out_message_mutex", None)
        if messages is None or mutex is None:
            return
        with mutex:
            dropped = len(messages)
            messages.clear()
        if dropped:
            log.info("MQTT link down: %d unacknowledged message(s) discarded (the outbox re-sends updates)", dropped)

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object,
                       properties: object) -> None:
        self._discard_in_flight()
        self._connected.clear()
        self._generation += 1
        self.disconnects += 1
        if self._last_failure is None:
            self._last_failure = f"link closed ({reason_code})"
        if self._closing:
            log.info("MQTT disconnected from %s:%s", self._host, self._port)
        else:
            log.warning("MQTT disconnected from %s:%s (%s); reconnecting with jittered back-off", self._host,
                        self._port, reason_code)
        self._link_down.set()

    # reconnection (supervisor thread) --------------------------------------------------------------------------
    def _stop_network_thread(self) -> None:
        """Make sure paho's network thread has ended (it ends by itself after a drop: reconnect_on_failure=False)."""
        with self._loop_lock:  # never while the supervisor is starting a network thread (paho cannot join it yet)
            try:
                self._client.loop_stop()
            except AttributeError:  # paho cleared its thread handle between its check and its join: already gone
                pass

    def _use_broker(self, index: int) -> None:
        """Point the (disconnected) paho client at node ``index`` of :attr:`brokers` (paho's ``connect_async``
        only records the target; the next ``reconnect`` connects to it)."""
        self.broker = index % len(self.brokers)
        self._host, self._port = self.brokers[self.broker]
        self._client.connect_async(self._host, self._port, keepalive=self._keepalive)

    def _supervise(self) -> None:
        """Wait for a dropped link, then reconnect with full-jitter back-off until connected or closed."""
        base, cap = self._backoff
        while not self._stop.is_set():
            self._link_down.wait()
            if self._stop.is_set():
                return
            self._link_down.clear()
            self._stop_network_thread()
            while not self._stop.is_set():
                if self._attempt > 0 and len(self.brokers) > 1:  # the last attempt failed: the next node
                    self._use_broker(self.broker + 1)
                    self.failovers += 1
                delay = full_jitter_delay(self._attempt, base_s=base, cap_s=cap, rng=self._rng)
                self._attempt += 1
                self.reconnect_delays.append(delay)
                log.info("MQTT reconnect attempt %d to %s:%s in %.2f s", self._attempt, self._host, self._port,
                         delay)
                if self._stop.wait(delay):
                    return
                try:
                    self._client.reconnect()
                except OSError as exc:  # includes ssl.SSLError
                    self._last_failure = f"cannot reach {self._host}:{self._port}: {exc}"
                    log.warning("MQTT reconnect to %s:%s failed: %s", self._host, self._port, exc)
                    continue
                # a close() from here on either sees the started thread and joins it, or is seen here: paho's
                # loop_stop on a thread created but not yet started raises "cannot join thread before it is started"
                with self._loop_lock:
                    if self._stop.is_set():  # closed while reconnecting: undo, start nothing
                        self._client.disconnect()
                        return
                    self._client.loop_start()
                break
