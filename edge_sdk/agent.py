"""The gateway agent: the front door of the edge side, a loop that dispatches.

Loop: wait for messages on the site's task, ack, model and software topics; dispatch each to the part that handles it
(:mod:`edge_sdk.rounds`): a chunk or manifest of a task download, a TASK (checked by
:func:`~edge_sdk.rounds.tasks.accept_task`, then trained by the camera, radio or Global DP part), a secure-aggregation
stage, an ACK or a RECEIPT for an upload (:class:`~edge_sdk.uplink.uploader.Uploader`), a released global model or
its chunks (:class:`~edge_sdk.rounds.releases.ModelReleases`, kept for ``detect`` and the field loop), a published
SDK version (:class:`~edge_sdk.updates.receiver.SoftwareUpdates`: installed beside this one when idle, after which
:meth:`EdgeAgent.run` returns and ``wildfed-edge run`` switches to it). The site's
signed health record (:class:`~edge_sdk.uplink.health.HealthReporter`) goes out after every (re)connect, when a new
model is kept, and every ``health_interval_s``. Transport callbacks only
enqueue; all work happens on the thread that calls :meth:`EdgeAgent.run`, so nothing blocks the network thread.
When idle, unacknowledged updates are resent every ``resend_interval_s`` and stalled downloads are asked for again;
after every (re)connect the outbox is resent and the open round's task is asked for.

The task handling is :class:`edge_sdk.rounds.dispatch.TaskDispatch`, a base of the agent. Of several tasks
waiting, only the newest is trained (:mod:`edge_sdk.rounds.superseded`); a buffered round's task
(``max_staleness`` set) that comes while the previous update is still unacknowledged waits until it is (a newer
task replaces it), so that at most one trained update is ever uncharged (docs/transport.md, "Buffered rounds").

A round's update (and a Global DP round's secure-aggregation replies) leave at the round's public time slot
(:mod:`edge_sdk.privacy.timing`, the task's ``round_duration_s`` counted from the task's acceptance). The loop does
not sleep until then: it blocks on its inbox for at most the time left to the next slot and releases what is due
every turn, so ACKs, receipts and tasks are handled while a release waits.

A camera site whose config names an ``incoming`` folder also runs its field loop (:mod:`edge_sdk.field.service`)
on a second thread while :meth:`EdgeAgent.run` runs: new photos are detected, classified, stored in the site's
package and their detection records published.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.envelope import Envelope, MessageKind
from shared.keys import load_private_key, load_public_key
from shared.models.backbone import EMBEDDING_DIM
from shared.models.feature_centre import load_feature_centre
from shared.privacy.calibration_cache import CalibrationCache
from shared.radio import RadioMapSet
from shared.topics import ack_topic, model_filter, software_filter, task_topic

from edge_sdk.backends.base import TrainingBackend
from edge_sdk.backends.ort_backend import ArtifactCache
from edge_sdk.config import SiteConfig, load_site_config
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.timing import RoundPacer
from edge_sdk.rounds.backends import BackendChooser
from edge_sdk.rounds.camera import CameraRound, SiteRecords
from edge_sdk.rounds.context import AgentContext, kind_of
from edge_sdk.rounds.dispatch import TaskDispatch
from edge_sdk.rounds.downloads import TaskDownloads
from edge_sdk.rounds.model_cache import DigestModels
from edge_sdk.rounds.radio_round import RadioRound
from edge_sdk.rounds.releases import ModelReleases
from edge_sdk.rounds.secagg_client import SecAggRoundState, SecAggSiteClient
from edge_sdk.rounds.superseded import too_stale
from edge_sdk.rounds.tasks import AcceptedTask
from edge_sdk.site_paths import calibration_cache_dir
from edge_sdk.updates.receiver import SoftwareUpdates
from edge_sdk.updates.stage import StagedVersion
from edge_sdk.uplink.health import ErrorLog, HealthReporter
from edge_sdk.uplink.outbox import Outbox
from edge_sdk.uplink.transport import Transport
from edge_sdk.uplink.uploader import Uploader

__all__ = ["EdgeAgent"]

log = logging.getLogger(__name__)


class EdgeAgent(TaskDispatch):
    """A site's agent. Build it with :meth:`from_config` (production) or directly (tests).

    Args (all keyword-only):
        config: the site config.
        transport: the uplink (e.g. :class:`~edge_sdk.uplink.mqtt.MqttTransport`).
        signing_key: the site's Ed25519 private key (signs updates).
        coordinator_key: the coordinator's Ed25519 public key (tasks and acks must verify with it).
        dataset: the site's records (camera: fixed records, or None to read the site's package before each
            round), or its radio maps (a ``radiomap`` site).
        backend: the training backend, used for every task (an ``ort`` one gets each task's artifacts); default:
            chosen per task from the site config / profile (:class:`~edge_sdk.rounds.backends.BackendChooser`).
        outbox: the persistent outbox; default ``Outbox(config.outbox)``.
        clock: monotonic seconds of the rounds' time slots (default ``time.monotonic``; tests inject one).
        site_config_path: the ``site.yaml`` the config was read from; its folder is the install prefix, which signed
            SDK updates need (:mod:`edge_sdk.updates`). None: updates are received but not installed.

    Attributes:
        stats: ``Counter`` of what happened (``tasks_trained``, ``updates_published``, ``acks_accepted``,
            ``rejected:<reason>``, ...).
        field: the field loop (:class:`edge_sdk.field.service.FieldService`) while :meth:`run` runs one, else None.
        staged: a new SDK version installed and checked beside this one (:mod:`edge_sdk.updates`), set when
            :meth:`run` returned to switch to it; else None.
    """

    def __init__(self, *, config: SiteConfig, transport: Transport, signing_key: Ed25519PrivateKey,
                 coordinator_key: Ed25519PublicKey, dataset: LocalDataset | RadioMapSet | None = None,
                 backend: TrainingBackend | None = None, outbox: Outbox | None = None,
                 clock: Callable[[], float] = time.monotonic, site_config_path: Path | None = None) -> None:
        self.config = config
        self.transport = transport
        self.outbox = outbox if outbox is not None else Outbox(config.outbox)
        self.ctx = AgentContext(config, transport, signing_key, coordinator_key, self.outbox)
        self.stats = self.ctx.stats
        self.ctx.pacer = RoundPacer(clock=clock, stats=self.stats)
        self.artifact_cache = ArtifactCache(config.artifact_cache if config.artifact_cache is not None
                                            else Path(config.outbox).parent / "ort-artifacts")
        self.calibration_cache = CalibrationCache(calibration_cache_dir(config))
        self.feature_centre = (load_feature_centre(config.feature_centre, dim=EMBEDDING_DIM)
                               if config.feature_centre is not None and config.task == "camera" else None)
        self.backends = BackendChooser(self.ctx, backend=backend, artifact_cache=self.artifact_cache)
        self.secagg = SecAggSiteClient(self.ctx, self.backends, self.feature_centre)
        self.downloads = TaskDownloads(self.ctx, busy=lambda: self.secagg.state is not None)
        self.uploader = Uploader(self.ctx, on_drained=self.request_downloads)
        self.records: SiteRecords | None = None
        self.radio: RadioRound | None = None
        if config.task == "radiomap":
            if not isinstance(dataset, RadioMapSet):
                dataset = RadioMapSet.load(config.dataset)
            self.radio = RadioRound(self.ctx, uploader=self.uploader, maps=dataset, artifact_cache=self.artifact_cache)
        else:
            self.records = SiteRecords(config, dataset if isinstance(dataset, LocalDataset) else None)
        self.camera = (CameraRound(self.ctx, backends=self.backends, uploader=self.uploader, records=self.records,
                                   feature_centre=self.feature_centre, calibration_cache=self.calibration_cache)
                       if self.records is not None else None)
        self.field = None
        self.errors = ErrorLog()  # the newest ERROR line, for the health record
        self.health = HealthReporter(self.ctx, field_queue_pending=self._detections_waiting, errors=self.errors)
        self.digests = DigestModels(self.ctx, transport, lambda topic, payload: self._inbox.put(("digest", payload)))
        self.releases = ModelReleases(self.ctx, on_kept=lambda version: self.health.send("new model"),
                                      cache=self.digests.store)
        self.software = SoftwareUpdates(self.ctx, site_config=site_config_path, running_version=self.health.version)
        self.staged: StagedVersion | None = None
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._stop = threading.Event()
        #: a buffered round's task that waits until the previous update is acknowledged (:meth:`_train`)
        self._deferred: tuple[Envelope, AcceptedTask] | None = None
        self._started = False
        self._task_topic = task_topic(config.federation_id, config.site_id)
        self._ack_topic = ack_topic(config.federation_id, config.site_id)
        self._model_filter = model_filter(config.federation_id, config.site_id)
        self._software_filter = software_filter(config.federation_id, config.site_id)

    @classmethod
    def from_config(cls, config: SiteConfig | str | Path, *, transport: Transport | None = None,
                    site_config_path: Path | None = None) -> EdgeAgent:
        """Build an agent from a site config (object or YAML path): load keys, read and embed the site's records
        (or radio maps), build the backend.

        Args:
            config: a :class:`SiteConfig` or the path of its YAML file.
            transport: default: an :class:`~edge_sdk.uplink.mqtt.MqttTransport` to ``config.broker_url``.
            site_config_path: the file a config object was read from (a path ``config`` is its own); updates need it.

        Raises:
            ConfigError: bad config, keys or backend. DatasetError: bad Camtrap DP package or radio-map file.
        """
        path = site_config_path
        if not isinstance(config, SiteConfig):
            path = Path(config)
            config = load_site_config(config)
        signing_key = load_private_key(config.private_key)
        coordinator_key = load_public_key(config.coordinator_public_key)
        if config.task == "camera" and config.incoming is not None:
            from edge_sdk.field.site_package import SitePackage

            SitePackage(config.dataset, site_id=config.site_id).ensure()  # a new site starts with an empty package
        if transport is None:
            from edge_sdk.uplink.site_transport import transport_from_config

            transport = transport_from_config(config)  # TLS, credentials, last will (docs/security.md)
        return cls(config=config, transport=transport, signing_key=signing_key, coordinator_key=coordinator_key,
                   site_config_path=path)

    # -- what tests and tools look at ---------------------------------------------------------------------------
    @property
    def dataset(self) -> LocalDataset | RadioMapSet:
        """The site's records as last read (camera), or its radio maps."""
        return self.records.dataset if self.records is not None else self.radio.maps  # type: ignore[union-attr]

    @property
    def backend(self) -> TrainingBackend:
        """The backend of the latest task."""
        return self.backends.current

    @property
    def _secagg(self) -> SecAggRoundState | None:
        return self.secagg.state

    @property
    def _downloads(self) -> dict:
        return self.downloads.active

    @property
    def _signing_key(self) -> Ed25519PrivateKey:
        return self.ctx.signing_key

    # -- transport callbacks (network thread: enqueue only) ------------------------------------------------
    def _on_task(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("task", payload))

    def _on_ack(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("ack", payload))

    def _on_model(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("model", payload))

    def _on_software(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("software", payload))

    def _on_connect(self) -> None:
        self._inbox.put(("connected", b""))

    def _detections_waiting(self) -> int | None:
        """Detection records waiting in the running field loop's queue (None: no field loop running)."""
        field = self.field
        return field.queue.pending() if field is not None and field.queue is not None else None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Subscribe to the task, ack, model and software topics and connect (idempotent).

        Raises:
            TransportError: the broker cannot be reached.
        """
        if self._started:
            return
        self.transport.subscribe(self._task_topic, self._on_task)
        self.transport.subscribe(self._ack_topic, self._on_ack)
        if self.config.task == "camera":  # a released model is for detect and the field loop
            self.transport.subscribe(self._model_filter, self._on_model)
        self.transport.subscribe(self._software_filter, self._on_software)
        self.transport.add_connect_listener(self._on_connect)
        self.transport.connect()
        self._started = True
        log.info("site %s: listening on %s", self.config.site_id, self._task_topic)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Close the transport and the outbox."""
        self.transport.close()
        self.outbox.close()
        self.errors.close()

    def run(self, *, max_rounds: int | None = None, idle_timeout_s: float | None = None) -> int:
        """Process messages until stopped (and run the field loop meanwhile, when the site has an incoming folder).

        Returns after :meth:`stop`, or once ``max_rounds`` rounds were trained, nothing waits for its time slot and
        the outbox is empty (every update acknowledged), or after ``idle_timeout_s`` seconds without any message.

        Returns:
            number of rounds trained by this call.

        Raises:
            TransportError: the first connection fails.
        """
        self.start()
        field_thread = self._start_field_loop()
        try:
            return self._loop(max_rounds, idle_timeout_s)
        finally:
            if field_thread is not None:
                self._stop.set()
                field_thread.join()

    def _loop(self, max_rounds: int | None, idle_timeout_s: float | None) -> int:
        trained = 0
        last_activity = time.monotonic()
        pacer = self.ctx.pacer
        while not self._stop.is_set():
            if pacer.run_due():  # what waited for its time slot leaves now (edge_sdk.privacy.timing)
                last_activity = time.monotonic()
            trained += int(self._train_deferred())
            if self.health.due():
                self.health.send("interval")
            if max_rounds is not None and trained >= max_rounds and not pacer.pending() \
                    and not self.outbox.count() and self.secagg.state is None:
                break
            try:
                kind, payload = self._inbox.get(timeout=pacer.wait_s(0.1))
            except queue.Empty:
                # Resend only when idle (an ACK waiting in the inbox is read first), and only an update that has
                # waited a whole interval since it was last sent (the uploader restarts the interval).
                if self.uploader.due():
                    if self.outbox.count():
                        self.uploader.resend_pending()
                    if self.downloads.stalled():
                        self.downloads.request(open_round=False, only_stalled=True)
                if self.software.pending is not None and self._idle():
                    self.staged = self.software.stage()  # blocks while pip and check-config run
                    if self.staged is not None:
                        break  # `wildfed-edge run` switches to it (edge_sdk.updates.trial)
                if idle_timeout_s is not None and time.monotonic() - last_activity > idle_timeout_s \
                        and not pacer.pending():
                    log.info("site %s: idle for %.1f s, stopping", self.config.site_id, idle_timeout_s)
                    break
                continue
            last_activity = time.monotonic()
            trained += int(self._train_deferred())
            if kind == "task":
                trained += int(self.handle_task_message(payload))
            elif kind == "ack" and kind_of(payload) == MessageKind.RECEIPT:
                self.uploader.handle_receipt(payload)
            elif kind == "ack":
                self.uploader.handle_ack(payload)
            elif kind == "model":
                self.releases.handle(payload)
            elif kind == "digest":
                trained += int(self._digest_message(payload))
            elif kind == "software":
                self.software.handle(payload)
            elif kind == "connected":
                self.uploader.resend_pending()
                self.request_downloads()
                self.health.send("connected")
        return trained

    def _update_in_flight(self) -> bool:
        """Whether an update this site trained is not acknowledged yet (waiting for its time slot, or in the
        outbox)."""
        return bool(self.ctx.pacer.pending() or self.outbox.count())

    def _train_deferred(self) -> bool:
        """Train the deferred buffered task once no update is in flight, unless it became too stale meanwhile."""
        if self._deferred is None or self._update_in_flight():
            return False
        envelope, accepted = self._deferred
        self._deferred = None
        if too_stale(accepted.task, self.ctx.newest_round_seen) or accepted.task.round <= self.ctx.last_round():
            self.ctx.reject("task", "too_stale", f"round {accepted.task.round}'s task waited for an ACK and is now "
                            "too old to count")
            return False
        return self._train(envelope, accepted)

    def _idle(self) -> bool:
        """Nothing in flight: no reply waiting for its time slot, no secure-aggregation round, an empty outbox."""
        return not self.ctx.pacer.pending() and not self.outbox.count() and self.secagg.state is None

    def _start_field_loop(self) -> threading.Thread | None:
        if self.config.task != "camera" or self.config.incoming is None:
            return None
        thread = threading.Thread(target=self._field_loop, name=f"field-{self.config.site_id}", daemon=True)
        thread.start()
        return thread

    def _field_loop(self) -> None:
        """The field loop's thread: open the models, then poll the incoming folder and publish detection records
        until :meth:`stop`. A failure to open the models is logged and retried (the photos wait in the folder)."""
        from edge_sdk.field.service import FieldService

        interval = self.config.field.poll_interval_s
        while self.field is None and not self._stop.is_set():
            try:
                self.field = FieldService.from_config(self.config, signing_key=self.ctx.signing_key)
            except Exception as exc:  # noqa: BLE001 - logged, retried; the training loop goes on
                log.error("site %s: the field loop cannot start (%s: %s); photos wait in %s, retrying in %.0f s",
                          self.config.site_id, type(exc).__name__, exc, self.config.incoming, 6 * interval)
                self._stop.wait(6 * interval)
        try:
            while not self._stop.is_set():
                self.field.poll()  # type: ignore[union-attr]
                self.field.flush(self.transport)  # type: ignore[union-attr]
                self._stop.wait(interval)
        finally:
            if self.field is not None:
                self.field.close()

    # -- delegates kept as the agent's public surface ----------------------------------------------------------
    def handle_secagg(self, data: bytes) -> bool:
        """Answer one secure-aggregation stage (:meth:`SecAggSiteClient.handle`)."""
        return self.secagg.handle(data)

    def handle_ack(self, data: bytes) -> bool:
        """Verify an ACK and drop the acknowledged update (:meth:`Uploader.handle_ack`)."""
        return self.uploader.handle_ack(data)

    def handle_receipt(self, data: bytes) -> bool:
        """Send the chunks a RECEIPT lists as missing (:meth:`Uploader.handle_receipt`)."""
        return self.uploader.handle_receipt(data)

    def resend_pending(self) -> int:
        """Publish every pending outbox message again (:meth:`Uploader.resend_pending`)."""
        return self.uploader.resend_pending()

    def request_downloads(self, *, open_round: bool = True, only_stalled: bool = False) -> int:
        """Ask for missing chunks and the open round's task (:meth:`TaskDownloads.request`)."""
        return self.downloads.request(open_round=open_round, only_stalled=only_stalled)
