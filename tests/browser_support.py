"""What the browser tests share: Debian's chromium driven by Playwright with ``executable_path`` (Playwright's own
browser download is never used), its launch arguments, and an app served by uvicorn on 127.0.0.1 in a thread.

A browser test module calls :func:`require_chromium` at import, which skips the module with a reason when no
chromium is found (``chromium``/``chromium-browser`` on PATH, or env ``WILDFED_CHROMIUM``) or playwright or
uvicorn is not importable. The same setup as tests/coordinator/test_web_browser.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

__all__ = ["LAUNCH_ARGS", "find_chromium", "require_chromium", "UvicornServer", "artifacts_dir"]

LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]  # we run as root in CI containers
REPO = Path(__file__).resolve().parents[1]


def find_chromium() -> str | None:
    """The chromium executable: ``$WILDFED_CHROMIUM``, else ``chromium`` or ``chromium-browser`` on PATH."""
    env = os.environ.get("WILDFED_CHROMIUM")
    if env:
        return env if Path(env).is_file() and os.access(env, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> tuple[Any, str]:
    """``(playwright.sync_api, chromium path)``, or skip the calling module with the reason."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                   "playwright; the browser itself is Debian's chromium, never Playwright's download)")
    pytest.importorskip("uvicorn", reason="uvicorn is not installed")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium executable: install Debian's chromium (apt-get install chromium) or set "
                    "WILDFED_CHROMIUM to its path", allow_module_level=True)
    return sync_api, chromium


def artifacts_dir(name: str) -> Path:
    """``$WILDFED_ARTIFACTS/<name>`` or ``test-artifacts/<name>`` (screenshots for a person to look at)."""
    d = Path(os.environ.get("WILDFED_ARTIFACTS") or REPO / "test-artifacts") / name
    d.mkdir(parents=True, exist_ok=True)
    return d


class UvicornServer:
    """``app`` served by uvicorn on 127.0.0.1 and a free port (the socket is bound here, so there is no race)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     access_log=False, lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name=f"uvicorn-{self.port}")

    def start(self) -> "UvicornServer":
        """Start, and return once ``/healthz`` answers ``{"status": "ok"}`` (RuntimeError after 20 s)."""
        self._thread.start()
        deadline = time.monotonic() + 20.0
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/healthz", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read()) == {"status": "ok"}:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"uvicorn did not answer /healthz on {self.base}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Shut down and join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn did not shut down"
