"""The gateway agent: the front door of the edge side (DESIGN.md "Data flow", steps 2-3).

Loop: wait for signed TASK envelopes on the site's task topic; verify the coordinator's signature, the federation,
the addressee and the model hash; ignore stale and duplicate rounds (durably: a restarted gateway never trains
twice for one round, which would release two noisy views of the same data); train ``local_steps`` CCDP steps (or
non-private steps, only if the site allows it) from the global weights; seal the delta in an UPDATE envelope with
the site key; write it to the outbox; publish it (QoS 1). A verified ACK removes it from the outbox; every
(re)connect resends what is pending.

Transport callbacks only enqueue; all work happens on the thread that calls :meth:`EdgeAgent.run`, so nothing
blocks the network thread.

Asking for the open round's task (a gateway that was away when the round opened: the broker keeps nothing for a
clean session): after every (re)connect, whatever the outbox holds, and again each time the outbox drains (the
last pending update ACKed, refused or given up), :meth:`EdgeAgent.request_downloads` sends a "no transfer" receipt
and the coordinator resends the open round's task if the site was selected and has not delivered yet.

Chunks that never arrive: a chunk of an upload that ``max_chunk_requests`` receipts list although it was sent
before the probe each answers (shared.transfer.ResendTracker), or a chunk of a task download still missing after
``max_chunk_requests`` requests for a stalled download (no new chunk for ``resend_interval_s``; requests made on
reconnecting do not count), is being dropped on the way, typically by a broker whose message limit is below the
chunk size. The transfer is then given up with an error naming ``chunk_size_bytes`` (the coordinator's
``transfer.chunk_size_bytes`` for downloads) instead of being retried forever: the update leaves the outbox (the
reason stays in the agent state as ``abandoned/<message id>``), the download is dropped.

Privacy defaults the coordinator cannot override: tasks with ``privacy: none`` are refused unless the site config
sets ``allow_non_private``; a task's ``seed`` is ignored (secure randomness is used) unless the site config sets
``allow_seeded_noise`` (whoever knows the seed can reproduce and subtract the noise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.codec import encode_tensors, model_hash
from shared.envelope import Envelope, MessageKind, seal, verify
from shared.errors import EnvelopeError, MalformedEnvelopeError, PayloadError, PrivacyBudgetError
from shared.keys import load_private_key, load_public_key
from shared.models.backbone import BACKBONE_METADATA_KEY, EMBEDDING_DIM
from shared.models.kinds import ModelSpec, spec_from_weights
from shared.models.logit_adjustment import adjusted_for_prediction
from shared.radio import RadioMapSet
from shared.protocol import (COORDINATOR_STAGES, SecAggMessage, TrainingTask, UpdateReport, canonical_flatten,
                             decode_ack, decode_secagg, decode_task_with_artifacts, encode_secagg, encode_update)
from shared.privacy.calibration_cache import CalibrationCache
from shared.privacy.distributed import skellam_noise, skellam_share_variance
from shared.secagg import AdvertisedKeys, EncryptedShare, RecoveryRequest, SecAggClient, SecAggError
from shared.topics import ack_topic, secagg_topic, task_topic, update_topic
from shared.broker import MQTT_PUBLISH_OVERHEAD
from shared.transfer import (NO_TRANSFER, Chunk, Reassembly, Receipt, ResendTracker, TransferError,
                             check_manifest_header, decode_manifest, decode_receipt, encode_receipt, is_chunk,
                             piece_size_for, send, transfer_id_of, verify_manifest)

from edge_sdk.backends.base import TrainingBackend, create_backend
from edge_sdk.backends.ort_backend import ArtifactCache, ort_training_importable
from edge_sdk.config import SiteConfig, global_model_path, load_site_config
from edge_sdk.data.camtrap_dp import LocalDataset, load_camtrap_dp
from edge_sdk.data.embedding import embed_dataset
from edge_sdk.inference.weights import cache_dir
from shared.models.feature_centre import centre_digest, load_feature_centre
from edge_sdk.profiles import load_profile
from edge_sdk.privacy.randomness import RandomSource, SecureRandom, SeededRandom
from edge_sdk.radio import RadioSiteTrainer, run_radio_task
from edge_sdk.training import TrainingInputs, clipped_sum_locally, train_locally
from edge_sdk.uplink.outbox import Outbox
from edge_sdk.uplink.transport import MessageRefusedError, Transport, TransportError

__all__ = ["EdgeAgent", "build_backend", "requested_backend", "update_message_id"]

log = logging.getLogger(__name__)

_LAST_ROUND = "last_round"
_CRASH_ENV = "WILDFED_TEST_CRASH_AT"


def _test_crash_point(name: str) -> None:
    """TEST ONLY: SIGKILL this process here when ``$WILDFED_TEST_CRASH_AT == name``. The one point is
    ``mid_upload``: after the manifest and two chunks of a chunked upload went out (tests/test_faults.py). Never set
    it in production."""
    if os.environ.get(_CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


_SEQUENCE = "sequence"


def _profile_value(profile: object, name: str) -> object:
    """A profile's flat attribute; for ``backend`` the raw requested value (``auto`` unresolved) when the profile
    has a ``training`` section, so that the agent can decide ``auto`` per task."""
    if name == "backend":
        raw = getattr(getattr(profile, "training", None), "backend", None)
        if raw is not None:
            return getattr(raw, "value", raw)
    return getattr(profile, name, None)


def requested_backend(config: SiteConfig) -> str:
    """The backend name the site asks for (``torch``, ``ort``, ``auto``, or another registered name): the site
    config's, else its profile's, else ``torch``.

    Raises:
        ConfigError: unknown profile.
    """
    if config.backend is not None:
        return str(config.backend)
    if config.profile:
        value = _profile_value(load_profile(config.profile), "backend")
        if value is not None:
            return str(value)
    return "torch"


def embedding_cache_dir(config: SiteConfig) -> Path:
    """Where the site's backbone embeddings are cached: ``config.embedding_cache``, default
    ``<outbox folder>/embeddings``."""
    return Path(config.embedding_cache) if config.embedding_cache is not None else Path(config.outbox).parent / \
        "embeddings"


def calibration_cache_dir(config: SiteConfig) -> Path:
    """Where the site keeps its CCDP calibrations across restarts: ``config.calibration_cache``, default
    ``<wildfed cache>/calibration`` (:func:`edge_sdk.inference.weights.cache_dir`; public values, shared by the sites
    of one machine)."""
    return Path(config.calibration_cache) if config.calibration_cache is not None else cache_dir() / "calibration"


def save_global_model(path: Path, weights: dict[str, np.ndarray], *, round_: int, model_hash_hex: str,
                      prediction_offsets: tuple[float, ...] | None = None, backbone_id: str | None = None) -> None:
    """Write ``weights`` (float32 arrays) to ``path`` atomically (a temporary file, then ``os.replace``), as
    safetensors (``shared.codec.encode_tensors``, the wire's encoding) with metadata ``round`` and ``model_hash``
    (the global model version it comes from), and ``backbone_id`` (``shared.models.backbone.BACKBONE_METADATA_KEY``:
    the site's backbone, whose embeddings the head takes; ``detect`` refuses the model on another) when given.

    ``prediction_offsets`` (the task's, float (K,)): the model kept is the one ``detect`` should predict with, the
    global model with ``psi.bias - offsets`` (post-hoc logit adjustment, :mod:`shared.models.logit_adjustment`);
    the metadata then also holds ``prediction_offsets`` (JSON list).

    Raises:
        ValueError: offsets that do not fit the model's ``psi.bias``. OSError: the file could not be written.
    """
    metadata = {"round": str(int(round_)), "model_hash": model_hash_hex}
    if backbone_id is not None:
        metadata[BACKBONE_METADATA_KEY] = backbone_id
    if prediction_offsets is not None:
        weights = adjusted_for_prediction(weights, prediction_offsets)
        metadata["prediction_offsets"] = json.dumps([float(v) for v in prediction_offsets])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_tensors({k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
                                   metadata=metadata))
    os.replace(tmp, path)


def build_backend(config: SiteConfig, name: str | None = None, *, model: ModelSpec | None = None
                  ) -> TrainingBackend:
    """The training backend a site config asks for (or ``name``): its own settings first, then its firmware
    profile's, then defaults (torch, cpu, 1 thread, micro-batch 64). ``auto`` builds ``ort`` where
    ``onnxruntime.training`` imports and the device is the CPU, ``torch`` otherwise; the agent refines ``auto`` per
    task (ORT only when the task carries artifacts, :meth:`EdgeAgent.select_backend`). An ``ort`` backend is built
    without artifacts; they are loaded per task. ``model``: the architecture to build (the spec of the task's
    weights, ``shared.models.kinds.spec_from_weights``); default ``shared.models.kinds.DEFAULT_KIND``.

    Raises:
        ConfigError: unknown backend or profile, or a framework that is not installed.
    """
    profile = load_profile(config.profile) if config.profile else None

    def pick(field: str, default: object) -> object:
        value = getattr(config, field)
        if value is None and profile is not None:
            value = _profile_value(profile, field)
        return default if value is None else value

    backend = name if name is not None else requested_backend(config)
    settings = {"threads": pick("threads", 1), "device": pick("device", "cpu"),
                "microbatch_size": pick("microbatch_size", 64)}
    if backend == "auto":
        backend = "ort" if settings["device"] == "cpu" and ort_training_importable() else "torch"
    log.info("site %s: backend %s %s (profile %s)", config.site_id, backend, settings, config.profile or "none")
    if model is not None:
        return create_backend(backend, model=model, **settings)
    return create_backend(backend, num_classes=config.model_classes, **settings)


@dataclass
class _SecAggRound:
    """This site's state in one Global DP round (memory only)."""

    round: int
    model_hash: str
    client: SecAggClient
    gradient: np.ndarray | None  # float32 (d,), canonical order; dropped once masked
    num_examples: int
    categories: tuple[str, ...]
    noise: np.ndarray | None = None  # int64 (d,): this site's Skellam share (distributed DP); dropped once masked


def _transfer_id(message: bytes) -> str:
    """The transfer id a pending outbox message travels under when chunked (``shared.transfer.transfer_id_of``: a
    hash of its header and signature, not of its payload), or ``""`` for bytes that are not an envelope."""
    try:
        return transfer_id_of(message)
    except MalformedEnvelopeError:
        return ""


def update_message_id(round_: int) -> str:
    """Outbox id of this site's update for ``round_``."""
    return f"update/{round_}"


class EdgeAgent:
    """A site's agent. Build it with :meth:`from_config` (production) or directly (tests).

    Args (all keyword-only):
        config: the site config.
        transport: the uplink (e.g. :class:`~edge_sdk.uplink.mqtt.MqttTransport`).
        signing_key: the site's Ed25519 private key (signs updates).
        coordinator_key: the coordinator's Ed25519 public key (tasks and acks must verify with it).
        dataset: the site's records (camera), or its radio maps (a ``radiomap`` site).
        backend: the training backend, used for every task (an ``ort`` one gets each task's artifacts); default:
            chosen per task from the site config / profile (:meth:`select_backend`).
        outbox: the persistent outbox; default ``Outbox(config.outbox)``.

    Attributes:
        stats: ``Counter`` of what happened (``tasks_trained``, ``updates_published``, ``acks_accepted``,
            ``rejected:<reason>``, ...).
    """

    def __init__(self, *, config: SiteConfig, transport: Transport, signing_key: Ed25519PrivateKey,
                 coordinator_key: Ed25519PublicKey, dataset: LocalDataset | RadioMapSet,
                 backend: TrainingBackend | None = None, outbox: Outbox | None = None) -> None:
        self.config = config
        self.transport = transport
        self._signing_key = signing_key
        self._coordinator_key = coordinator_key
        self.dataset = dataset
        self._requested = backend.name if backend is not None else requested_backend(config)
        self.backend = backend if backend is not None else build_backend(config)
        self._backends: dict[str, TrainingBackend] = {self.backend.name: self.backend, self._requested: self.backend}
        self.artifact_cache = ArtifactCache(config.artifact_cache if config.artifact_cache is not None
                                            else Path(config.outbox).parent / "ort-artifacts")
        self.outbox = outbox if outbox is not None else Outbox(config.outbox)
        self.calibration_cache = CalibrationCache(calibration_cache_dir(config))
        self.feature_centre = (load_feature_centre(config.feature_centre, dim=EMBEDDING_DIM)
                               if config.feature_centre is not None and config.task == "camera" else None)
        self._inputs: TrainingInputs | None = None  # the camera dataset as the training steps read it
        self.stats: Counter[str] = Counter()
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._started = False
        self._task_topic = task_topic(config.federation_id, config.site_id)
        self._ack_topic = ack_topic(config.federation_id, config.site_id)
        self._update_topic = update_topic(config.federation_id, config.site_id)
        self._secagg_topic = secagg_topic(config.federation_id, config.site_id)
        self._secagg: _SecAggRound | None = None
        self._radio_trainer: RadioSiteTrainer | None = None
        self._downloads: dict[str, Reassembly] = {}  # transfer id -> chunked task download in progress
        self._completed_downloads: deque[str] = deque(maxlen=16)  # recent transfer ids (repeats are ignored)
        self._upload_requests = ResendTracker(config.max_chunk_requests)  # receipts listing chunks sent before
        self._download_requests: dict[str, Counter[int]] = {}  # stalled download -> requests per missing chunk
        self._next_resend = time.monotonic() + self._resend_delay()

    @classmethod
    def from_config(cls, config: SiteConfig | str | Path, *, transport: Transport | None = None) -> EdgeAgent:
        """Build an agent from a site config (object or YAML path): load keys and dataset, build the backend.

        Args:
            config: a :class:`SiteConfig` or the path of its YAML file.
            transport: default: an :class:`~edge_sdk.uplink.mqtt.MqttTransport` to ``config.broker_url``.

        Raises:
            ConfigError: bad config, keys or backend. DatasetError: bad Camtrap DP package or radio-map file.
        """
        if not isinstance(config, SiteConfig):
            config = load_site_config(config)
        signing_key = load_private_key(config.private_key)
        coordinator_key = load_public_key(config.coordinator_public_key)
        dataset: LocalDataset | RadioMapSet
        if config.task == "radiomap":
            dataset = RadioMapSet.load(config.dataset)
        else:
            dataset = load_camtrap_dp(config.dataset, config.species_table, image_size=config.image_size,
                                      missing_media=config.missing_media)
            # the frozen backbone embeds each record once; later starts read the cache (edge_sdk.data.embedding)
            dataset = embed_dataset(dataset, embedding_cache_dir(config), input_size=config.embedding_input_size,
                                    backbone=config.backbone, threads=config.threads)
        log.info("site %s: %d %s loaded from %s", config.site_id, len(dataset),
                 "radio maps" if config.task == "radiomap" else "records", config.dataset)
        if transport is None:
            from edge_sdk.uplink.mqtt import transport_from_config

            transport = transport_from_config(config)  # TLS, credentials, last will (docs/security.md)
        return cls(config=config, transport=transport, signing_key=signing_key, coordinator_key=coordinator_key,
                   dataset=dataset)

    # -- transport callbacks (network thread: enqueue only) ------------------------------------------------
    def _on_task(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("task", payload))

    def _on_ack(self, topic: str, payload: bytes) -> None:
        self._inbox.put(("ack", payload))

    def _on_connect(self) -> None:
        self._inbox.put(("connected", b""))

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Subscribe to the task and ack topics and connect (idempotent).

        Raises:
            TransportError: the broker cannot be reached.
        """
        if self._started:
            return
        self.transport.subscribe(self._task_topic, self._on_task)
        self.transport.subscribe(self._ack_topic, self._on_ack)
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

    def run(self, *, max_rounds: int | None = None, idle_timeout_s: float | None = None) -> int:
        """Process messages until stopped.

        Returns after :meth:`stop`, or once ``max_rounds`` rounds were trained and the outbox is empty (every
        update acknowledged), or after ``idle_timeout_s`` seconds without any message.

        Returns:
            number of rounds trained by this call.

        Raises:
            TransportError: the first connection fails.
        """
        self.start()
        trained = 0
        last_activity = time.monotonic()
        while not self._stop.is_set():
            if (max_rounds is not None and trained >= max_rounds and not self.outbox.count()
                    and self._secagg is None):
                break
            try:
                kind, payload = self._inbox.get(timeout=0.1)
            except queue.Empty:
                # Resend only when idle (an ACK waiting in the inbox is read first), and only an update that has
                # waited a whole interval since it was last sent (_publish restarts the interval).
                if time.monotonic() >= self._next_resend:
                    self._next_resend = time.monotonic() + self._resend_delay()
                    if self.outbox.count():
                        self.resend_pending()
                    if self._stalled_downloads():
                        self.request_downloads(open_round=False, only_stalled=True)
                if idle_timeout_s is not None and time.monotonic() - last_activity > idle_timeout_s:
                    log.info("site %s: idle for %.1f s, stopping", self.config.site_id, idle_timeout_s)
                    break
                continue
            last_activity = time.monotonic()
            if kind == "task":
                trained += int(self.handle_task_message(payload))
            elif kind == "ack" and self._kind_of(payload) == MessageKind.RECEIPT:
                self.handle_receipt(payload)
            elif kind == "ack":
                self.handle_ack(payload)
            elif kind == "connected":
                self.resend_pending()
                self.request_downloads()
        return trained

    def _resend_delay(self) -> float:
        """Seconds to the next periodic resend of unacknowledged updates: the interval with +-50 % jitter, so that
        gateways cut off together do not all resend at once (AWS Architecture Blog, "Exponential Backoff And
        Jitter", 2015)."""
        return self.config.resend_interval_s * random.uniform(0.5, 1.5)

    @staticmethod
    def _kind_of(data: bytes) -> MessageKind | None:
        """The kind an envelope claims (verified later, by its handler), or None for anything else."""
        try:
            return Envelope.from_bytes(data).header.kind
        except MalformedEnvelopeError:
            return None

    def handle_task_message(self, data: bytes) -> bool:
        """One message from the task topic: a whole TASK, the manifest or a chunk of a chunked one
        (``shared.transfer``), or a secure-aggregation stage. Returns True if the site trained."""
        if is_chunk(data):
            return self._download_chunk(data)
        kind = self._kind_of(data)
        if kind == MessageKind.MANIFEST:
            self._download_manifest(data)
            return False
        if kind == MessageKind.SECAGG:
            self.handle_secagg(data)
            return False
        return self.handle_task(data)

    # -- chunked task downloads ----------------------------------------------------------------------------
    def _download_manifest(self, data: bytes) -> None:
        envelope = self._open(data, MessageKind.MANIFEST, "manifest")
        if envelope is None:
            return
        try:
            manifest = decode_manifest(envelope.payload)
        except TransferError as exc:
            self._reject("manifest", exc.reason, str(exc))
            return
        try:  # the inner task: announced by this manifest's header, signed by the coordinator (before any chunk)
            check_manifest_header(manifest, envelope.header)
            verify_manifest(manifest, self._coordinator_key)
        except EnvelopeError as exc:
            self._reject("manifest", exc.reason, str(exc))
            return
        if manifest.kind != MessageKind.TASK or manifest.total_length > self.config.max_task_bytes:
            self._reject("manifest", "oversized" if manifest.kind == MessageKind.TASK else "wrong_kind",
                         f"{manifest.kind.value} of {manifest.total_length} bytes (this site takes tasks of at most "
                         f"{self.config.max_task_bytes} bytes)")
            return
        last = int(self.outbox.get_state(_LAST_ROUND, "-1"))
        if envelope.header.round <= last:
            self._reject("manifest", "stale_round", f"round {envelope.header.round} <= last trained round {last}")
            return
        for tid in [t for t, r in self._downloads.items() if r.expired()]:
            del self._downloads[tid]
            self.stats["downloads_expired"] += 1
        if manifest.transfer_id in self._downloads or manifest.transfer_id in self._completed_downloads:
            return  # a repeat: the chunks held are kept
        self._downloads[manifest.transfer_id] = Reassembly(manifest, envelope, ttl_s=self.config.download_ttl_s)
        log.info("site %s: round %d task announced (%d bytes in %d chunks)", self.config.site_id,
                 envelope.header.round, manifest.total_length, manifest.num_chunks)

    def _download_chunk(self, data: bytes) -> bool:
        try:
            chunk = Chunk.from_bytes(data, max_data_bytes=max(self.config.chunk_size_bytes, 1 << 20))
            reassembly = self._downloads.get(chunk.transfer_id)
            if reassembly is None:
                if chunk.transfer_id not in self._completed_downloads:
                    self._reject("chunk", "unknown_transfer", f"chunk {chunk.index} of {chunk.transfer_id[:12]}")
                return False
            if not reassembly.add(chunk):  # one BLAKE3 over the chunk against its signed leaf
                return False
            inner = reassembly.assemble()  # verified piece by piece: not hashed again
        except TransferError as exc:
            self._reject("chunk", exc.reason, str(exc))
            return False
        del self._downloads[chunk.transfer_id]
        self._download_requests.pop(chunk.transfer_id, None)
        self._completed_downloads.append(chunk.transfer_id)
        return self._handle_task_envelope(self._addressed(inner, MessageKind.TASK, "task"))

    def _stalled_downloads(self) -> list[str]:
        """Unexpired downloads with no new chunk for ``resend_interval_s`` (their transfer ids)."""
        now = time.monotonic()
        return [t for t, r in self._downloads.items()
                if not r.expired() and now - r.last_progress > self.config.resend_interval_s]

    def _abandon_download(self, transfer_id: str, index: int, times: int) -> None:
        """Give up a task download whose chunk ``index`` never arrives although asked for ``times`` times."""
        r = self._downloads.pop(transfer_id)
        self._download_requests.pop(transfer_id, None)
        self._completed_downloads.append(transfer_id)  # repeats of its manifest and chunks are ignored
        self.stats["downloads_abandoned"] += 1
        log.error("site %s: round %d task download given up: chunk %d (%d bytes + 40 of header) was asked for %d "
                  "times and never arrived; the broker drops it, most likely because the coordinator's "
                  "transfer.chunk_size_bytes (%d) is above the broker's message size limit (fix: lower "
                  "transfer.chunk_size_bytes and set broker_max_packet_bytes to the broker's limit in the coordinator "
                  "config)", self.config.site_id, r.envelope.header.round, index, r.manifest.chunk_size, times,
                  r.manifest.chunk_size)

    def request_downloads(self, *, open_round: bool = True, only_stalled: bool = False) -> int:
        """Ask the coordinator for the missing chunks of every unfinished task download (``only_stalled``: of those
        with no new chunk for ``resend_interval_s``), and, when none is in progress and no secure-aggregation round
        is running, for the open round's task (``open_round``; a site that was offline when the round opened or
        whose outbox just drained). Called after every (re)connect, whatever the outbox holds, when the outbox
        drains, and for stalled downloads every ``resend_interval_s``. Requests for a stalled download are counted
        per missing chunk; one asked for ``max_chunk_requests`` times gives the download up instead (module
        docstring). Returns the number of receipts sent."""
        stalled = set(self._stalled_downloads()) if only_stalled else None
        receipts = []
        for tid, r in list(self._downloads.items()):
            if r.expired() or (stalled is not None and tid not in stalled):
                continue
            missing = r.missing()
            if stalled is not None:  # nothing came for a whole interval: this request is evidence, count it
                counts = self._download_requests.setdefault(tid, Counter())
                counts.update(missing)
                index, times = max(counts.items(), key=lambda kv: (kv[1], -kv[0]), default=(0, 0))
                if times >= self.config.max_chunk_requests:
                    self._abandon_download(tid, index, times)
                    continue
            receipts.append((r.envelope.header.round, r.envelope.header.base_model_hash, Receipt(tid, missing)))
        if open_round and not self._downloads and self._secagg is None:
            nxt = int(self.outbox.get_state(_LAST_ROUND, "-1")) + 1
            receipts.append((nxt, "", Receipt(NO_TRANSFER, ())))
        sent = 0
        for round_, base_hash, receipt in receipts:
            envelope = seal(private_key=self._signing_key, federation_id=self.config.federation_id,
                            site_id=self.config.site_id, round=round_, base_model_hash=base_hash,
                            kind=MessageKind.RECEIPT, sequence=self._next_sequence(), payload=encode_receipt(receipt))
            try:
                self.transport.publish(self._update_topic, envelope.to_bytes(), qos=1)
                sent += 1
            except TransportError as exc:
                log.warning("site %s: receipt not sent (%s); asked again at the next reconnect", self.config.site_id,
                            exc)
        return sent

    # -- message handling ----------------------------------------------------------------------------------
    def _reject(self, what: str, reason: str, detail: str) -> None:
        self.stats[f"rejected:{reason}"] += 1
        log.warning("site %s: %s rejected (%s): %s", self.config.site_id, what, reason, detail)

    def _open(self, data: bytes, kind: MessageKind, what: str) -> Envelope | None:
        """Parse and verify an envelope from the coordinator addressed to this site; None if rejected."""
        try:
            envelope = Envelope.from_bytes(data)
            verify(envelope, self._coordinator_key)
        except EnvelopeError as exc:
            self._reject(what, exc.reason, str(exc))
            return None
        return self._addressed(envelope, kind, what)

    def _addressed(self, envelope: Envelope, kind: MessageKind, what: str) -> Envelope | None:
        """``envelope`` (verified) if it is of ``kind`` and addressed to this site in our federation; None if
        rejected."""
        header = envelope.header
        if header.kind != kind:
            self._reject(what, "wrong_kind", f"kind {header.kind.value}, expected {kind.value}")
            return None
        if header.federation_id != self.config.federation_id:
            self._reject(what, "wrong_federation", f"federation {header.federation_id!r}")
            return None
        if header.site_id != self.config.site_id:
            self._reject(what, "wrong_site", f"addressed to {header.site_id!r}")
            return None
        return envelope

    def _randomness(self, task: TrainingTask) -> RandomSource:
        if task.seed is None:
            return SecureRandom()
        if not self.config.allow_seeded_noise:
            log.warning("site %s: round %d task carries seed %d; ignored (allow_seeded_noise is false), "
                        "using secure randomness", self.config.site_id, task.round, task.seed)
            return SecureRandom()
        digest = hashlib.sha256(f"{task.seed}/{self.config.site_id}/{task.round}".encode()).digest()
        return SeededRandom(int.from_bytes(digest[:8], "big"))

    def select_backend(self, task: TrainingTask, artifacts: dict[str, bytes],
                       weights: dict[str, np.ndarray] | None = None) -> TrainingBackend | None:
        """Pick (and build on first use) the backend for ``task`` and set :attr:`backend`; None if rejected.

        ``auto``: ``ort`` when ``onnxruntime.training`` imports and ORT artifacts for the task's model hash are in
        the task or in the gateway's artifact cache, ``torch`` otherwise. An ``ort`` backend loads the artifacts
        (stored in the cache, keyed by model hash, after the task's signature and SHA-256 checks).
        ``weights``: the task's global model; a torch backend of another architecture (e.g. the coordinator's
        head-only model, ``adapter_width`` 0) is rebuilt for the weights' spec.
        """
        want = self._requested
        cached = self.artifact_cache.path(task.model_hash)
        if want == "auto" and not (artifacts or cached):
            want = "torch"  # no artifacts for this model version: ORT cannot train it
        spec = None
        if weights is not None:
            try:
                spec = spec_from_weights(weights)
            except ValueError as exc:
                self._reject("task", "model_mismatch", str(exc))
                return None
        backend = self._backends.get(want)
        if backend is not None and spec is not None and getattr(backend, "spec", spec) != spec \
                and backend.name != "ort":  # ORT takes its architecture from the task's artifacts
            backend = None
        if backend is None:
            try:  # "auto": ort where it imports (cpu), else torch
                backend = build_backend(self.config, name=want, model=spec if want != "ort" else None)
            except (ValueError, PayloadError) as exc:  # ConfigError: framework not installed
                self._reject("task", "backend_unavailable", str(exc))
                return None
            self._backends[want] = backend
        if backend.name == "ort":
            try:
                folder = self.artifact_cache.store(task.model_hash, artifacts) if artifacts else cached
                if folder is None:
                    self._reject("task", "ort_artifacts_missing",
                                 f"backend ort needs ORT training artifacts for model {task.model_hash[:12]}; the "
                                 "task carries none (coordinator: ship_ort_artifacts: true; or backend: auto)")
                    return None
                backend.load_artifacts(folder)  # type: ignore[attr-defined]
            except (ValueError, OSError) as exc:
                self._reject("task", "model_mismatch", f"ORT artifacts unusable: {exc}")
                return None
        if backend is not self.backend:
            log.info("site %s: round %d trains with backend %s", self.config.site_id, task.round, backend.name)
        self.backend = backend
        return backend

    def handle_task(self, data: bytes) -> bool:
        """Verify, train and upload for one TASK envelope; returns True if the site trained.

        Every rejection is logged with its reason and counted in :attr:`stats`; nothing here raises for bad
        input from the wire.
        """
        return self._handle_task_envelope(self._open(data, MessageKind.TASK, "task"))

    def _handle_task_envelope(self, envelope: Envelope | None) -> bool:
        """:meth:`handle_task` for an envelope already verified and addressed (None: rejected already): a whole
        task, or one reassembled from a chunked download whose chunks were checked against the signed manifest."""
        if envelope is None:
            return False
        header = envelope.header
        last = int(self.outbox.get_state(_LAST_ROUND, "-1"))
        if header.round <= last:
            self._reject("task", "stale_round", f"round {header.round} <= last trained round {last}")
            return False
        try:
            task, weights, artifacts = decode_task_with_artifacts(envelope.payload)
        except PayloadError as exc:
            self._reject("task", exc.reason, str(exc))
            return False
        if task.round != header.round or task.federation_id != header.federation_id:
            self._reject("task", "header_mismatch", "task round/federation differ from the envelope header")
            return False
        actual_hash = model_hash(weights)
        if not (task.model_hash == header.base_model_hash == actual_hash):
            self._reject("task", "model_hash", f"weights hash {actual_hash[:12]} does not match the task")
            return False
        if task.privacy == "none" and not self.config.allow_non_private:
            self._reject("task", "non_private_refused",
                         "privacy 'none' requested but the site config does not set allow_non_private")
            return False
        if task.privacy == "global" and not self.config.allow_global_dp:
            self._reject("task", "global_dp_refused",
                         "privacy 'global' requested (the coordinator would add the noise) but the site config "
                         "does not set allow_global_dp")
            return False
        is_radio_site = self.config.task == "radiomap"
        if (task.radio is not None) != is_radio_site:
            self._reject("task", "task_kind", f"a {'radio' if task.radio is not None else 'camera'} task for a "
                         f"{self.config.task} site")
            return False
        if task.radio is not None:
            return self._train_radio(task, weights, artifacts)
        if self.select_backend(task, artifacts, weights) is None:
            return False
        try:  # the newest accepted model, for detect (a failure here must not cost the round)
            save_global_model(global_model_path(self.config), weights, round_=task.round, model_hash_hex=actual_hash,
                              prediction_offsets=task.prediction_offsets, backbone_id=self.config.backbone_id)
        except (OSError, ValueError) as exc:
            log.warning("site %s: could not keep the global model of round %d for detect: %s", self.config.site_id,
                        task.round, exc)
        if task.privacy == "global":
            return self._start_global_round(task, weights)

        # Record the round durably before training: after a crash the round is skipped, never trained twice.
        self.outbox.set_state(_LAST_ROUND, str(task.round))
        log.info("site %s: round %d: training %d %s step(s)", self.config.site_id, task.round, task.local_steps,
                 task.privacy)
        started = time.monotonic()
        try:
            if self._inputs is None:  # centred and measured once, reused every round
                self._inputs = TrainingInputs(self.dataset, self.feature_centre)
            result = train_locally(backend=self.backend, dataset=self._inputs, task=task, global_weights=weights,
                                   site_categories=self.config.categories, randomness=self._randomness(task),
                                   num_classes=self.config.model_classes,
                                   class_categories=({s.class_index: s.iucn_category for s in self.config.species}
                                                     if self.config.logit_adjustment else None),
                                   calibration_cache=self.calibration_cache)
        except PrivacyBudgetError as exc:
            self._reject("task", "privacy_budget", str(exc))
            return False
        except (ValueError, PayloadError) as exc:  # weights that do not fit the model (ConfigError is a ValueError)
            self._reject("task", "model_mismatch", str(exc))
            return False

        return self._send_update(task, result.report, result.delta, started=started,
                                 detail=f"N={result.report.num_examples}, base rate q={result.sampling_rate:.4g}"
                                 + (f", class re-weighting {task.class_reweighting:g}"
                                    if task.class_reweighting and result.plan is not None
                                    and self.config.logit_adjustment else ""))

    def _train_radio(self, task: TrainingTask, weights: dict[str, np.ndarray], artifacts: dict[str, bytes]) -> bool:
        """A radio round (edge_sdk.radio): allocator refresh when due, local RadioUNet training, grouped noise."""
        if not isinstance(self.dataset, RadioMapSet):
            self._reject("task", "task_kind", "a radio task for a site without radio maps")
            return False
        self.outbox.set_state(_LAST_ROUND, str(task.round))  # durable before training, as for camera rounds
        started = time.monotonic()
        try:
            trainer = self._radio_trainer
            if trainer is None or not trainer.matches(task):
                store = self.artifact_cache.root / "radio"  # the allocator beside the cached model artifacts
                trainer = RadioSiteTrainer.for_task(task, maps=self.dataset, model_store=store,
                                                    noise=self._randomness(task))
                self._radio_trainer = trainer
            trainer.noise = self._randomness(task)
            report, delta = run_radio_task(trainer, task, weights, artifacts, rng=np.random.default_rng())
        except (ValueError, PayloadError) as exc:  # bad city artifact, weights of another model
            self._reject("task", "model_mismatch", str(exc))
            return False
        return self._send_update(task, report, delta, started=started,
                                 detail=f"N={report.num_examples} maps, {task.radio.defence}")

    def _send_update(self, task: TrainingTask, report: UpdateReport, delta: dict[str, np.ndarray], *,
                     started: float, detail: str) -> bool:
        """Encode, sign, store in the outbox (durable before publishing), publish."""
        try:
            payload = encode_update(report, delta)
        except PayloadError as exc:  # e.g. training diverged to non-finite weights
            self._reject("task", "bad_update", f"the trained update cannot be encoded: {exc}")
            return False
        sequence = int(self.outbox.get_state(_SEQUENCE, "0")) + 1
        self.outbox.set_state(_SEQUENCE, str(sequence))
        update = seal(private_key=self._signing_key, federation_id=self.config.federation_id,
                      site_id=self.config.site_id, round=task.round, base_model_hash=task.model_hash,
                      kind=MessageKind.UPDATE, sequence=sequence, payload=payload,
                      piece_size=piece_size_for(self.config.chunk_size_bytes))  # its chunks are its pieces
        message_id = update_message_id(task.round)
        self.outbox.put(message_id, self._update_topic, update.to_bytes())  # durable before publishing
        self.stats["tasks_trained"] += 1
        log.info("site %s: round %d trained in %.1f s (%s); update stored in outbox",
                 self.config.site_id, task.round, time.monotonic() - started, detail)
        self._publish(message_id, self._update_topic, update)  # the envelope: its leaves are not hashed again
        return True

    def _drained(self) -> None:
        """The outbox just became empty: ask for the open round's task (the site may have missed it while its
        updates were pending, e.g. after a restart)."""
        if not self.outbox.count():
            self.request_downloads()

    def _abandon_upload(self, message_id: str, detail: str) -> None:
        """Give up an outbox message that cannot get through (``detail`` names the setting to change): drop it,
        keep the reason in the agent state (``abandoned/<id>``), count it, log it as an error."""
        entry = self.outbox.get_state(f"abandoned/{message_id}")
        self.outbox.set_state(f"abandoned/{message_id}", detail if entry is None else f"{entry}; {detail}")
        removed = self.outbox.remove(message_id)
        self.stats["uploads_abandoned"] += 1
        log.error("site %s: %s given up: %s", self.config.site_id, message_id, detail)
        if removed:
            self._drained()

    # -- Global DP: secure aggregation --------------------------------------------------------------------
    def _next_sequence(self) -> int:
        sequence = int(self.outbox.get_state(_SEQUENCE, "0")) + 1
        self.outbox.set_state(_SEQUENCE, str(sequence))
        return sequence

    def _send_secagg(self, state: _SecAggRound, message: SecAggMessage) -> bool:
        envelope = seal(private_key=self._signing_key, federation_id=self.config.federation_id,
                        site_id=self.config.site_id, round=state.round, base_model_hash=state.model_hash,
                        kind=MessageKind.SECAGG, sequence=self._next_sequence(), payload=encode_secagg(message))
        try:
            self.transport.publish(self._secagg_topic, envelope.to_bytes(), qos=1)
        except TransportError as exc:
            self.stats["publish_failed"] += 1
            log.warning("site %s: round %d secagg %s not sent (%s); the site drops out of this round",
                        self.config.site_id, state.round, message.stage, exc)
            self._secagg = None
            return False
        self.stats[f"secagg_sent:{message.stage}"] += 1
        return True

    def _start_global_round(self, task: TrainingTask, weights: dict[str, np.ndarray]) -> bool:
        """Global DP: advertise fresh keys, then compute the clipped gradient sum (kept in memory until masked)."""
        assert task.secagg is not None  # decode_task checked it
        params = task.secagg.params(task.federation_id, task.round)
        if self.config.site_id not in params.site_ids:
            self._reject("task", "wrong_site", f"site not among the round's secagg sites {list(params.site_ids)}")
            return False
        if params.vector_length != sum(int(np.asarray(w).size) for w in weights.values()):
            self._reject("task", "model_mismatch", f"secagg vector_length {params.vector_length} != model size")
            return False
        centre = None
        if task.feature_centre is not None:  # the coordinator folds the sum back with this c: use the same one
            if self.feature_centre is None or centre_digest(self.feature_centre) != task.feature_centre:
                have = "none" if self.feature_centre is None else centre_digest(self.feature_centre)[:12]
                self._reject("task", "feature_centre_mismatch",
                             f"the task's gradients are taken on embeddings centred by {task.feature_centre[:12]}, "
                             f"this site's feature_centre is {have}: give the site the coordinator's centre file")
                return False
            centre = self.feature_centre
        self.outbox.set_state(_LAST_ROUND, str(task.round))  # durable before any data is touched
        client = SecAggClient(self.config.site_id, params)
        state = _SecAggRound(round=task.round, model_hash=task.model_hash, client=client, gradient=None,
                             num_examples=0, categories=())
        self._secagg = state
        if not self._send_secagg(state, SecAggMessage("keys", client.public_keys().to_json())):
            return False
        started = time.monotonic()
        if self.feature_centre is not None and centre is None:
            log.info("site %s: round %d: the global task names no feature centre: plain (uncentred) gradients",
                     self.config.site_id, task.round)
        try:
            result = clipped_sum_locally(backend=self.backend, dataset=self.dataset, task=task, global_weights=weights,
                                         site_categories=self.config.categories, randomness=self._randomness(task),
                                         feature_centre=centre)
        except PrivacyBudgetError as exc:
            self._secagg = None
            self._reject("task", "privacy_budget", str(exc))
            return False
        except (ValueError, PayloadError) as exc:
            self._secagg = None
            self._reject("task", "model_mismatch", str(exc))
            return False
        state.gradient = canonical_flatten(result.gradient_sum)
        if task.distributed_noise:  # distributed DP: this site's share of the noise, added before masking
            assert task.noise_multiplier is not None  # a global task carries it (TrainingTask checks)
            state.noise = skellam_noise(skellam_share_variance(
                noise_multiplier=task.noise_multiplier, clipping_norm=task.clipping_norm,
                vector_length=params.vector_length, scale=params.scale, threshold=params.threshold),
                params.vector_length)
        state.num_examples = result.num_examples
        state.categories = tuple(c.value for c in result.categories)
        self.stats["tasks_trained"] += 1
        log.info("site %s: round %d (global DP) clipped sum ready in %.1f s (N=%d, q=%.4g); waiting for the key "
                 "list", self.config.site_id, task.round, time.monotonic() - started, result.num_examples,
                 result.sampling_rate)
        return True

    def handle_secagg(self, data: bytes) -> bool:
        """Answer one secure-aggregation stage from the coordinator (key list, share inbox, recovery request, round
        end); returns True if it was handled. Bad or out-of-order messages are rejected, logged and counted; a
        protocol error drops the site out of the round (its masks are then recovered by the others)."""
        envelope = self._open(data, MessageKind.SECAGG, "secagg")
        if envelope is None:
            return False
        state = self._secagg
        if state is None or envelope.header.round != state.round:
            self._reject("secagg", "stale_round", f"round {envelope.header.round} is not a secure-aggregation round "
                         "in progress here")
            return False
        try:
            message = decode_secagg(envelope.payload, stages=COORDINATOR_STAGES)
            body = message.body
            if message.stage == "key_list":
                keys = [AdvertisedKeys.from_json(k) for k in body.get("keys", [])]
                shares = state.client.shares_for({k.site_id: k for k in keys})
                self._send_secagg(state, SecAggMessage("shares", {"shares": [s.to_json() for s in shares.values()]}))
            elif message.stage == "share_inbox":
                if state.gradient is None:
                    raise SecAggError("share inbox before the gradient sum was ready, or a second inbox")
                inbox = [EncryptedShare.from_json(x) for x in body.get("shares", [])]
                state.client.receive_shares({x.sender: x for x in inbox})
                masked = state.client.mask(state.gradient, integer_noise=state.noise)
                state.gradient = state.noise = None  # the unmasked sum is not kept once it has left masked
                self._send_secagg(state, SecAggMessage(
                    "masked", {"num_examples": state.num_examples, "categories": list(state.categories)}, masked))
            elif message.stage == "recovery_request":
                shares = state.client.reveal_for_recovery(RecoveryRequest.from_json(body))
                self._send_secagg(state, SecAggMessage("recovery", shares.to_json()))
            else:  # round_end
                log.info("site %s: round %d secure aggregation ended: %s %s", self.config.site_id, state.round,
                         body.get("status"), body.get("reason", ""))
                self._secagg = None
        except (SecAggError, PayloadError) as exc:
            self._secagg = None
            self._reject("secagg", getattr(exc, "reason", "secagg_error"), f"{exc}; the site leaves this round")
            return False
        return True

    def _publish(self, message_id: str, topic: str, payload: bytes | Envelope, *, resume: bool = False,
                 missing: tuple[int, ...] | None = None) -> bool:
        """Publish an outbox message (its bytes, or the envelope just sealed): whole, or as a manifest and chunks
        when it is larger than ``config.chunk_size_bytes``; ``resume`` sends only the manifest (the coordinator
        answers with a receipt), ``missing`` only those chunks (``shared.transfer.send``)."""
        published = [0]

        def publish(t: str, p: bytes) -> None:
            self.transport.publish(t, p, qos=1)
            published[0] += 1
            if published[0] == 3 and is_chunk(p):
                _test_crash_point("mid_upload")

        try:
            send(publish, topic, payload, private_key=self._signing_key, chunk_size=self.config.chunk_size_bytes,
                 resume=resume, missing=missing,
                 max_message_bytes=self.config.broker_max_packet_bytes - MQTT_PUBLISH_OVERHEAD,
                 on_chunk=lambda tid, index: self._upload_requests.sent(tid, (index,)),
                 on_probe=self._upload_requests.probed)
        except TransferError as exc:  # a message the broker would drop (e.g. a manifest of too many chunks)
            self._abandon_upload(message_id, f"{exc} (broker_max_packet_bytes {self.config.broker_max_packet_bytes})")
            return False
        except MessageRefusedError as exc:  # the broker keeps dropping the link on it (edge_sdk.uplink.mqtt)
            self._abandon_upload(message_id, str(exc))
            return False
        except TransportError as exc:
            self.stats["publish_failed"] += 1
            log.warning("site %s: publish of %s failed (%s); it stays in the outbox", self.config.site_id,
                        message_id, exc)
            return False
        self.stats["updates_published"] += 1
        self._next_resend = time.monotonic() + self._resend_delay()  # the interval counts from the last send
        log.info("site %s: published %s (%d bytes)", self.config.site_id, message_id,
                 payload.wire_length if isinstance(payload, Envelope) else len(payload))
        return True

    def handle_ack(self, data: bytes) -> bool:
        """Verify an ACK envelope and drop the acknowledged update from the outbox; returns True if one was."""
        envelope = self._open(data, MessageKind.ACK, "ack")
        if envelope is None:
            return False
        try:
            ack = decode_ack(envelope.payload)
        except PayloadError as exc:
            self._reject("ack", exc.reason, str(exc))
            return False
        if ack.round != envelope.header.round:
            self._reject("ack", "header_mismatch", f"ack round {ack.round} != header round {envelope.header.round}")
            return False
        pending = self.outbox.get(update_message_id(ack.round))
        if pending is not None and Envelope.from_bytes(pending.payload).header.sequence != envelope.header.sequence:
            self._reject("ack", "stale_ack", f"ack for sequence {envelope.header.sequence}, the pending update of round "
                         f"{ack.round} has another sequence")
            return False
        removed = self.outbox.remove(update_message_id(ack.round))
        if pending is not None:
            self._upload_requests.forget(_transfer_id(pending.payload))
        if ack.accepted:
            self.stats["acks_accepted"] += 1
            log.info("site %s: round %d update acknowledged%s", self.config.site_id, ack.round,
                     "" if removed else " (was not pending)")
        else:
            self.stats["acks_refused"] += 1
            log.error("site %s: round %d update refused by the coordinator: %s", self.config.site_id, ack.round,
                      ack.reason or "no reason given")
        if removed:
            self._drained()
        return removed

    def handle_receipt(self, data: bytes) -> bool:
        """Verify the coordinator's RECEIPT for a chunked upload and send the chunks it lists as missing; returns
        True if chunks were sent."""
        envelope = self._open(data, MessageKind.RECEIPT, "receipt")
        if envelope is None:
            return False
        try:
            receipt = decode_receipt(envelope.payload)
        except TransferError as exc:
            self._reject("receipt", exc.reason, str(exc))
            return False
        for entry in self.outbox.pending():
            message = self.outbox.get(entry.message_id)
            if message is None or _transfer_id(message.payload) != receipt.transfer_id:
                continue
            stuck = self._upload_requests.answered(receipt.transfer_id, receipt.missing)
            if stuck is not None:
                index, times = stuck
                self._upload_requests.forget(receipt.transfer_id)
                self._abandon_upload(entry.message_id, (
                    f"chunk {index} ({self.config.chunk_size_bytes} bytes + 40 of header) was sent {times} times "
                    f"and the coordinator asked for it again each time: the broker drops it, most likely because "
                    f"chunk_size_bytes ({self.config.chunk_size_bytes}) is above the broker's message size limit "
                    f"(fix: lower chunk_size_bytes and set broker_max_packet_bytes to the broker's limit, now "
                    f"{self.config.broker_max_packet_bytes})"))
                return False
            log.info("site %s: resuming %s: %d chunk(s) missing", self.config.site_id, message.message_id,
                     len(receipt.missing))
            self.stats["uploads_resumed"] += 1
            return self._publish(message.message_id, message.topic, message.payload, missing=receipt.missing)
        self._reject("receipt", "unknown_transfer", f"no pending upload {receipt.transfer_id[:12]}")
        return False

    def resend_pending(self) -> int:
        """Publish every pending outbox message again (after a (re)connect, and every ``resend_interval_s``):
        a small one whole, a chunked one as a resume manifest (only the missing chunks follow, on the coordinator's
        receipt). Returns how many went out."""
        sent = 0
        for entry in self.outbox.pending():
            message = self.outbox.get(entry.message_id)
            if message is None:  # acknowledged meanwhile
                continue
            log.info("site %s: resending %s", self.config.site_id, message.message_id)
            sent += int(self._publish(message.message_id, message.topic, message.payload,
                                      resume=entry.size > self.config.chunk_size_bytes))
        return sent

