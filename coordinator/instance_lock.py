"""One coordinator process per federation at a time: an exclusive lock on ``<data_dir>/coordinator.lock``.

``wildfed-coordinator run`` and ``wildfed-coordinator service`` connect to the broker as the same MQTT client (the
coordinator's client id, coordinator.transport.mqtt.transport_from_config) and resume the same persistent session.
Two of them at once would not share the work: the broker disconnects the older connection whenever the other connects
(MQTT 3.1.1 sec. 3.1.4: a second client with the same id takes the session over), each reconnects and takes it back,
and messages are delivered to whichever holds it at that moment, while both open and close rounds in one database.
So a process that drives the federation takes this lock first and refuses to start, naming the holder, when
another has it.

The lock is ``flock(LOCK_EX | LOCK_NB)`` (POSIX advisory lock of an open file): the kernel releases it when its
process ends, however it ends (a SIGKILL too), so a crash never leaves a stale lock behind. The file holds the
holder's pid and command line, for the refusal's message. It detects processes that share the data folder, which
every coordinator process of one federation does (its blobs and models live there; ingest workers share it over a
network file system, and take no lock: they have client ids of their own).
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["LOCK_FILE", "CoordinatorRunning", "InstanceLock"]

LOCK_FILE = "coordinator.lock"


class CoordinatorRunning(ConfigError):
    """Another coordinator process holds the federation's lock (module docstring)."""


class InstanceLock:
    """The exclusive lock of one data folder (module docstring); :meth:`acquire`, then :meth:`release`.

    Args:
        data_dir: the coordinator's data folder (``data_dir`` of its config); created if absent.
    """

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.path = Path(data_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock and write this process's pid and command line into the file. Idempotent.

        Raises:
            CoordinatorRunning: another process (or another lock object of this one) holds it; the message names
                its pid and command and the fix.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise CoordinatorRunning(
                f"another coordinator of this federation is running ({holder}); `run` and `service` resume the same "
                "MQTT session and must not run at once", source=self.path, field="data_dir",
                fix="stop it first (`systemctl stop wildfed-coordinator` for the service, Ctrl-C for `run`), or let "
                    "the service run the rounds (schedule: in the config)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)}\n".encode("utf-8", "replace"), 0)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (the file stays; its content is rewritten by the next holder). Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
