"""Small helpers several test modules share: a free loopback port, polling another thread's state, and the
camera site folder the transfer tests run a real gateway from.

Polling is for state that only another thread changes (paho's network thread, an agent's stats) and that offers
no event to wait on; each call is bounded by its timeout.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from shared.keys import generate_signing_key, save_private_key, save_public_key

#: the real photos and tables the tests that need them read: ``$WILDFED_SHARED_DATA`` when set, else
#: ``../shared/data`` beside the checkout; tests that need them skip when it is absent
SHARED_DATA = Path(os.environ.get("WILDFED_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared"
                   / "data")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's choice for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_until(predicate: Callable[[], object], timeout_s: float) -> bool:
    """True once ``predicate()`` is truthy (checked every 0.02 s), False if ``timeout_s`` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    """The first truthy value of ``condition()`` (checked every 0.05 s); fails the test naming ``what`` after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return value


def camera_site(root: Path, site_id: str, coordinator_key, **settings) -> object:  # noqa: ANN001 - a signing key
    """A camera site folder (keys, a tiny Camtrap DP package, site.yaml with ``settings``); returns its key."""
    from tests.edge.conftest import write_package

    site_key = generate_signing_key()
    save_private_key(site_key, root / "keys" / "site.key")
    save_public_key(coordinator_key.public_key(), root / "keys" / "coordinator.pub")
    write_package(root / "pkg")
    (root / "site.yaml").write_text(yaml.safe_dump({
        "federation_id": "testfed", "site_id": site_id, "dataset": "pkg",
        "species": [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "VU"},
                    {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}],
        "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
        "outbox": "state/outbox.sqlite", "threads": 1, **settings}))
    return site_key


def assert_norm_upper_bounds(reported, exact, *, slack: float = 1e-4, below: float = 1e-6) -> None:
    """The backends' per-example norms are float32 sums raised by the float32 summation bound
    (``edge_sdk.privacy.per_example.summation_error_bound``): never below the exact norm (beyond float64 noise),
    and above it by at most ``slack`` relative (``1 + gamma_1281`` on a squared norm is < 8e-5). ``below``: how far
    under ``exact`` rounding of the reference itself may put it (relative)."""
    import numpy as np

    reported, exact = np.asarray(reported, dtype=np.float64), np.asarray(exact, dtype=np.float64)
    assert reported.shape == exact.shape
    assert np.all(reported >= exact * (1 - below)), (reported - exact).min()
    assert np.all(reported <= exact * (1 + slack) + 1e-30), ((reported - exact) / exact).max()


def wait_for_connack(port: int, *, client_id: str, timeout_s: float, running: Callable[[], bool],
                     failure: Callable[[str], Exception], poll_s: float = 0.1) -> float:
    """Seconds until 127.0.0.1:``port`` answers an MQTT 3.1.1 CONNECT with a successful CONNACK.

    Args:
        running: whether the node's process still runs (checked before each try).
        failure: builds the exception to raise from a message ("not running", "no CONNACK within ...").

    Raises:
        the exception ``failure`` builds: the node stopped, or gave no CONNACK within ``timeout_s``.
    """
    import paho.mqtt.client as mqtt

    start = time.monotonic()
    while True:
        if not running():
            raise failure("is not running")
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        try:
            client.connect("127.0.0.1", port, keepalive=10)
            client.loop_start()
            step = time.monotonic() + 2.0
            while not client.is_connected() and time.monotonic() < step:
                time.sleep(0.02)
            if client.is_connected():
                return time.monotonic() - start
        except OSError:
            pass
        finally:
            client.disconnect()
            client.loop_stop()
        if time.monotonic() - start >= timeout_s:
            raise failure(f"gave no MQTT CONNACK on port {port} within {timeout_s:.0f} s")
        time.sleep(poll_s)
