"""One coordinator process per federation (coordinator.instance_lock): a second holder is refused with the first one's
pid and command named, the lock is released by close and by the death of its process, and a coordinator that
could not start leaves no lock behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.instance_lock import CoordinatorRunning, InstanceLock

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_holder_is_refused_and_named(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path)
    first.acquire()
    first.acquire()  # idempotent
    with pytest.raises(CoordinatorRunning) as err:
        InstanceLock(tmp_path).acquire()
    text = str(err.value)
    assert f"pid {os.getpid()}" in text and "must not run at once" in text and "fix:" in text
    first.release()
    second = InstanceLock(tmp_path)
    second.acquire()
    assert second.held
    second.release()


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        from coordinator.instance_lock import InstanceLock
        InstanceLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        sys.stdin.readline()
        os._exit(9)  # no release: the kernel drops the lock
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(CoordinatorRunning, match=f"pid {proc.pid}"):
            InstanceLock(tmp_path).acquire()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 9
    finally:
        if proc.poll() is None:
            proc.kill()
    InstanceLock(tmp_path).acquire()


def test_a_coordinator_that_cannot_reach_its_broker_leaves_no_lock(tmp_path: Path) -> None:
    from shared.keys import generate_signing_key

    from coordinator.service import Coordinator
    from coordinator.transport import TransportError
    from tests.coordinator.helpers import make_config, tiny_weights
    from tests.support import free_port

    cfg = make_config(tmp_path, broker_url=f"mqtt://127.0.0.1:{free_port()}")  # nothing listens there
    coord = Coordinator(cfg, signing_key=generate_signing_key(), initial_weights=tiny_weights())
    with pytest.raises(TransportError):
        coord.start()
    coord.close()
    lock = InstanceLock(cfg.data_dir)
    lock.acquire()  # free again
    lock.release()
