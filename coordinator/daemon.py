"""``wildfed-coordinator service``: the coordinator as one long-lived process (one systemd unit).

:class:`CoordinatorService` starts a :class:`~coordinator.service.Coordinator` and keeps it running:

* **Ingest at all times.** The coordinator's handlers are subscribed for the whole life of the process: updates
  (and chunked uploads), Global DP secure-aggregation messages and detection records are verified and stored as
  they come, between rounds too. Its MQTT session is persistent (coordinator.transport), so what gateways
  published while the service was stopped is delivered when it starts.
* **Rounds on a schedule** (``schedule:`` in the config, :class:`~coordinator.config_operations.ScheduleConfig`): a
  slot every ``round_interval_s`` seconds after the start of the last round (its ``opened_at`` in the database, so a
  restart keeps the rhythm) or after the last slot in which no round could run; no round once ``max_rounds``
  rounds exist. A round that cannot run (no site enrolled or selectable, every site's budget halted, fewer than
  two sites for Global DP) is logged with the reason and the next slot, and the service waits for that slot instead
  of exiting.
* **Models and fleet health.** Every round that makes a new model releases it, retained, to the camera gateways
  (coordinator.model_delivery; the last one too, once ``max_rounds`` rounds exist), and at every look at the
  schedule the current model goes to the sites that lack it (a site enrolled while the service runs). Presence
  and health records are stored as they come (coordinator.fleet; ``wildfed-coordinator fleet``).
* **The rangers' web view** (coordinator.web.app) in the same process, served by uvicorn on a thread, unless
  ``web=False`` (``--no-web``).
* **Clean stops.** SIGTERM (systemd's stop) and SIGINT (Ctrl-C) set the stop event: between rounds the service
  leaves its wait at once; during a round the round is interrupted the way Ctrl-C interrupts ``run`` (its row stays
  ``open``, and the next start closes it from its durably stored updates, ``RoundManager.recover``: nothing is
  half-written, since every write is a transaction and every blob an fsync-ed rename). Then the web view stops,
  ingest makes what it checked durable and acknowledges it, and the transport disconnects.

One process per federation: the coordinator's lock (coordinator.instance_lock) refuses a ``run`` beside the service
and a second service.
"""

from __future__ import annotations

import datetime as _dt
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select

from shared.errors import ConfigError

from coordinator.config import CoordinatorConfig
from coordinator.fleet import format_age
from coordinator.rounds import RoundResult
from coordinator.service import Coordinator
from coordinator.storage import RoundRow, Store, utcnow

__all__ = ["CoordinatorService", "next_round_at", "install_stop_signals", "WAKE_S", "SERVICE_UNIT_TEMPLATE",
           "render_service_unit"]

log = logging.getLogger(__name__)

WAKE_S = 60.0
"""Longest single wait between looks at the schedule, seconds (the wall clock may be set while the service waits)."""


def next_round_at(store: Store, config: CoordinatorConfig, *, last_attempt: _dt.datetime | None = None
                  ) -> _dt.datetime | None:
    """When the next round is due (naive UTC), or None when ``schedule.max_rounds`` rounds exist.

    The slot follows the later of the newest round's ``opened_at`` and ``last_attempt`` (a slot in which no round
    could run, so nothing was recorded) by ``schedule.round_interval_s``; with neither, it is now.
    """
    with store.session() as s:
        count, opened = s.execute(select(func.count(RoundRow.round), func.max(RoundRow.opened_at))).one()
    limit = config.schedule.max_rounds
    if limit is not None and int(count or 0) >= limit:
        return None
    last = max((t for t in (opened, last_attempt) if t is not None), default=None)
    if last is None:
        return utcnow()
    return last + _dt.timedelta(seconds=config.schedule.round_interval_s)


class _WebThread:
    """The web view served by uvicorn on a daemon thread, on a socket bound here (so a port in use is an error the
    caller sees, not a dead thread)."""

    def __init__(self, config: CoordinatorConfig, coordinator: Coordinator, host: str | None, port: int | None) -> None:
        import uvicorn

        from coordinator.web.app import create_app

        self.host, self.port = host or config.web.host, port or config.web.port
        try:
            self._socket = socket.create_server((self.host, self.port), reuse_port=False)
        except OSError as exc:
            raise ConfigError(f"the web view cannot listen on {self.host}:{self.port}: {exc.strerror or exc}",
                              field="web.port", fix="free the port, set web.port (or --port), or run the service "
                              "with --no-web and the web view with `serve`") from None
        ssl: dict[str, Any] = {}
        if config.web.tls_cert_file is not None:
            ssl = {"ssl_certfile": str(config.web.tls_cert_file), "ssl_keyfile": str(config.web.tls_key_file)}
        app = create_app(config, store=coordinator.store)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="info", proxy_headers=False, **ssl))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="wildfed-web", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start serving; returns once uvicorn has started.

        Raises:
            ConfigError: uvicorn did not start (its log says why, e.g. an unreadable TLS key).
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError("the web view did not start (see the log above)", field="web",
                                  fix="correct the web settings, or run the service with --no-web")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to finish its requests and stop; wait for its thread."""
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)
        self._socket.close()


class CoordinatorService:
    """The long-lived coordinator (module docstring). :meth:`run` blocks until :meth:`request_stop`.

    Args:
        config: a resolved coordinator config.
        coordinator: the coordinator to drive (default: built from ``config``, MQTT on ``broker_url``).
        web: serve the web view in this process.
        host, port: the web view's address (default ``web.host``, ``web.port``).
        clock: naive-UTC now (tests).
    """

    def __init__(self, config: CoordinatorConfig, *, coordinator: Coordinator | None = None, web: bool = True,
                 host: str | None = None, port: int | None = None,
                 clock: Callable[[], _dt.datetime] = utcnow) -> None:
        self.config = config
        self.coordinator = coordinator if coordinator is not None else Coordinator(config)
        self.stop_event = threading.Event()
        self.rounds_run: list[RoundResult] = []
        self._web_wanted, self._host, self._port = web, host, port
        self._web: _WebThread | None = None
        self._clock = clock
        self._last_attempt: _dt.datetime | None = None
        self.in_round = False
        """True while a round runs on the main thread (a stop signal then interrupts it)."""

    def request_stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe; what a signal handler calls)."""
        self.stop_event.set()

    def run(self) -> None:
        """Start the coordinator (recovering an interrupted round) and the web view, then run rounds on the
        schedule until :meth:`request_stop`; stops both cleanly on the way out (module docstring).

        Raises:
            CoordinatorRunning: another coordinator process of this federation is running.
            TransportError: the broker cannot be reached at start.
            ConfigError: the web view cannot listen on its address.
        """
        coord = self.coordinator
        try:
            for r in coord.start():
                log.warning("service: round %d was interrupted before; closed now from its stored updates: %s",
                            r.round, r.status)
            if self._web_wanted:
                self._web = _WebThread(self.config, coord, self._host, self._port)
                self._web.start()
                log.info("service: web view on %s:%d", self._web.host, self._web.port)
            log.info("service: federation %s: ingesting updates, secure aggregation and detection records; rounds "
                     "every %s", self.config.federation_id, _duration(self.config.schedule.round_interval_s))
            self._loop()
        except KeyboardInterrupt:
            log.warning("service: stopped during a round; a round left open is closed at the next start from its "
                        "durably stored updates")
        finally:
            if self._web is not None:
                self._web.stop()
            coord.close()
            log.info("service: stopped")

    def _loop(self) -> None:
        announced: _dt.datetime | None = None
        idle_logged = False
        while not self.stop_event.is_set():
            self.coordinator.release_models()  # sites enrolled while it runs get the current model (cheap if none)
            self.coordinator.publish_software()  # an SDK version recorded by `publish-update` meanwhile
            due = next_round_at(self.coordinator.store, self.config, last_attempt=self._last_attempt)
            if due is None:
                if not idle_logged:
                    log.info("service: %d rounds exist (schedule.max_rounds): no more rounds; still ingesting",
                             self.config.schedule.max_rounds)
                    idle_logged = True
                self.stop_event.wait(WAKE_S)
                continue
            wait_s = (due - self._clock()).total_seconds()
            if wait_s > 0:
                if announced != due:
                    log.info("service: round %d due at %sZ (in %s)", self.coordinator.rounds.next_round(),
                             due.isoformat(timespec="seconds"), _duration(wait_s))
                    announced = due
                self.stop_event.wait(min(wait_s, WAKE_S))
                continue
            self._run_round()

    def _run_round(self) -> None:
        attempt = self._clock()
        self.in_round = True
        try:
            result = self.coordinator.run_round()
        finally:
            self.in_round = False
        self.rounds_run.append(result)
        if result.status == "skipped":
            self._last_attempt = attempt
            log.warning("service: round %d could not run: %s; next attempt in %s", result.round, _why_skipped(
                self.coordinator, result), _duration(self.config.schedule.round_interval_s))
        else:
            log.info("service: round %d %s: %d/%d updates%s, model %s", result.round, result.status,
                     len(result.accepted), len(result.selected),
                     f" + {len(result.stale)} stale" if result.stale else "", result.model_hash[:12])


def _why_skipped(coord: Coordinator, result: RoundResult) -> str:
    """Why no round could run, from the registry and the ledger (the round manager logged it too)."""
    sites = coord.registry.list()
    if not sites:
        return "no site is enrolled"
    if coord.config.privacy == "global" and len(result.selected) == 1:
        return "Global DP needs at least 2 sites for secure aggregation and 1 can train"
    halted = [s.site_id for s in sites if coord.ledger.halted(s.site_id)]
    return (f"no site can train ({len(sites)} enrolled; {len(halted)} with halted categories: their budgets are "
            "spent, see `wildfed-coordinator budget`; a site without a valid key is not selected either)")


def _duration(seconds: float) -> str:
    """``seconds`` as a short text: 45 s, 12 min, 3.5 h, 2.0 d (:func:`coordinator.fleet.format_age`)."""
    return format_age(seconds)


def install_stop_signals(service: CoordinatorService) -> None:
    """SIGTERM and SIGINT stop ``service`` (call on the main thread): the stop event is set, and a round in progress
    is interrupted (KeyboardInterrupt on the main thread, as Ctrl-C interrupts ``run``)."""

    def handler(signum: int, _frame: object) -> None:
        log.info("service: %s received: stopping", signal.Signals(signum).name)
        service.request_stop()
        if service.in_round:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


#: The systemd unit of ``wildfed-coordinator service`` (docs/service.md shows it as it is here);
#: :func:`render_service_unit` fills in @FEDERATION@, @USER@, @WORKDIR@, @EXEC@, @CONFIG@ and @DATA_DIR@. Exit status
#: 2 is a configuration error (a bad config, another coordinator already running): restarting cannot fix it, so it is
#: not retried; any other failure (the broker or the database not up yet, a crash) is restarted after 10 s.
SERVICE_UNIT_TEMPLATE = """\
[Unit]
Description=WildFed coordinator (federation @FEDERATION@): ingest, rounds on a schedule, web view
Wants=network-online.target
After=network-online.target time-sync.target mosquitto.service postgresql.service

[Service]
Type=simple
User=@USER@
WorkingDirectory=@WORKDIR@
ExecStart=@EXEC@ service --config @CONFIG@
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=2
KillSignal=SIGTERM
TimeoutStopSec=90
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=full
ReadWritePaths=@DATA_DIR@

[Install]
WantedBy=multi-user.target
"""


def render_service_unit(config: CoordinatorConfig, config_path: str, *, executable: str, user: str) -> str:
    """:data:`SERVICE_UNIT_TEMPLATE` for one coordinator: its federation, the account it runs as, the command
    (``executable``, e.g. the virtual environment's ``wildfed-coordinator``), the absolute config path (the working
    directory is its folder) and its data folder (the one folder it writes)."""
    from pathlib import Path

    path = Path(config_path).resolve()
    values = {"@FEDERATION@": config.federation_id, "@USER@": user, "@WORKDIR@": str(path.parent),
              "@EXEC@": executable, "@CONFIG@": str(path), "@DATA_DIR@": str(Path(config.data_dir).resolve())}
    text = SERVICE_UNIT_TEMPLATE
    for key, value in values.items():
        text = text.replace(key, value)
    return text
