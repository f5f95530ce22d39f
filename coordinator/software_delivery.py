"""SDK versions for the gateways: recorded by the operator, published signed and retained by the coordinator.

``wildfed-coordinator publish-update`` records a release (:func:`record_release`): the SDK wheel (and, optionally,
wheels of its dependencies for gateways without a package index) encoded as a SOFTWARE payload
(:mod:`shared.software`), written to ``<data_dir>/software/`` and named in the strategy-state table
(``software_release``). It does not connect to the broker itself: the coordinator's account is one MQTT session,
which the running ``service`` or ``run`` holds (a second connection under it would take that session over, and a
clean one would discard the detection records queued for it). The coordinator process publishes it instead
(:meth:`SoftwarePublisher.catch_up`): at its start and, in ``service``, at every look at the schedule, to every
enrolled site with a valid key whose recorded release (``software_release/<site>``) is not the current one. As a
model release, it goes sealed per site (one encoding, re-addressed), retained on the site's ``software`` topic,
chunked above ``transfer.chunk_size_bytes`` (:func:`coordinator.retained.publish_retained`).

What the gateway does with it (install beside, check, switch, confirm or roll back) is ``edge_sdk.updates``; which
version each gateway runs comes back in its health record (``wildfed-coordinator fleet``). Nothing here concerns a
site's data: no budget is charged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope, MessageKind, readdress, seal
from shared.errors import ConfigError, PayloadError
from shared.keys import write_file_atomic
from shared.software import SoftwareRelease, decode_software, encode_software
from shared.topics import software_chunk_topic, software_topic
from shared.transfer import piece_size_for

from coordinator.config import CoordinatorConfig
from coordinator.registry import SiteRegistry
from coordinator.retained import publish_retained
from coordinator.storage import Store
from coordinator.transport import Transport

__all__ = ["RecordedRelease", "SoftwarePublisher", "record_release", "current_release", "STATE_KEY",
           "site_state_key", "DEFAULT_CONFIRM_S", "describe"]

log = logging.getLogger(__name__)

STATE_KEY = "software_release"
#: Seconds a new version has to connect to the broker before a gateway rolls back (``--confirm-within``).
DEFAULT_CONFIRM_S = 600


def site_state_key(site_id: str) -> str:
    """The strategy-state key under which the release published to ``site_id`` is recorded."""
    return f"{STATE_KEY}/{site_id}"


@dataclass(frozen=True)
class RecordedRelease:
    """The current release as recorded: the release and the file holding its payload."""

    release: SoftwareRelease
    path: Path


def record_release(store: Store, data_dir: Path, *, federation_id: str, wheels: Mapping[str, bytes],
                   confirm_within_s: int = DEFAULT_CONFIRM_S, now: float | None = None) -> RecordedRelease:
    """Make ``wheels`` (file name -> bytes, exactly one ``wildfed-*.whl``) the federation's current SDK release.

    ``issued`` is the current Unix second, or one more than the previous release's when the clock has not moved
    past it (``issued`` only grows: ``shared.software``).

    Raises:
        ConfigError: not exactly one SDK wheel, or a field out of range (named, with the fix).
    """
    previous = current_release(store)
    issued = int(time.time() if now is None else now)
    if previous is not None:
        issued = max(issued, previous.release.issued + 1)
    try:
        release, payload = encode_software(federation_id=federation_id, issued=issued,
                                           confirm_within_s=int(confirm_within_s), wheels=wheels)
    except PayloadError as exc:
        raise ConfigError(str(exc), field="wheel", fix="pass one wildfed-<version>-*.whl with --wheel (extra "
                          "dependency wheels with --with-wheels) and --confirm-within in seconds") from None
    path = Path(data_dir) / "software" / f"{release.issued}-{release.version}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, payload, 0o644)
    store.set_state(STATE_KEY, {"version": release.version, "issued": release.issued, "path": str(path),
                                "sha256": release.sdk_wheel.sha256})
    log.info("software: version %s recorded (issued %d, %d file(s), %d bytes); published by the coordinator",
             release.version, release.issued, len(release.wheels), len(payload))
    return RecordedRelease(release, path)


def current_release(store: Store) -> RecordedRelease | None:
    """The recorded release, or None when none was published (or its file is gone: logged).

    Raises:
        PayloadError: the recorded file is not a valid release (it was changed on disk).
    """
    state = store.get_state(STATE_KEY)
    if not state:
        return None
    path = Path(state["path"])
    if not path.is_file():
        log.error("software: the recorded release %s is missing (%s); publish it again", state.get("version"), path)
        return None
    release, _ = decode_software(path.read_bytes())
    return RecordedRelease(release, path)


class SoftwarePublisher:
    """Publishes the recorded release to the sites that lack it (module docstring).

    Args:
        config: the coordinator config (federation, chunk size).
        store, registry: coordinator state (the recorded release, the sites and their keys, what each was sent).
        transport: where releases are published (retained).
        signing_key: the coordinator's Ed25519 key.
    """

    def __init__(self, *, config: CoordinatorConfig, store: Store, registry: SiteRegistry, transport: Transport,
                 signing_key: Ed25519PrivateKey) -> None:
        self.config = config
        self._store = store
        self._registry = registry
        self._transport = transport
        self._key = signing_key

    def pending_sites(self, release: SoftwareRelease) -> list[str]:
        """Enrolled sites with a valid key whose recorded release is not ``release``."""
        return [s.site_id for s in self._registry.list() if self._registry.verification_keys(s.site_id)
                and (self._store.get_state(site_state_key(s.site_id)) or {}).get("issued") != release.issued]

    def catch_up(self) -> dict[str, str]:
        """Publish the recorded release to every site that lacks it. Never raises: a failure is logged and tried
        again at the next call.

        Returns:
            ``{site: version published to it}``.
        """
        try:
            recorded = current_release(self._store)
            if recorded is None:
                return {}
            sites = self.pending_sites(recorded.release)
            return self._publish_all(recorded, sites) if sites else {}
        except Exception:  # noqa: BLE001 - an update must never cost a round; the next look tries again
            log.exception("software: the recorded release could not be published; tried again at the next look")
            return {}

    def _publish_all(self, recorded: RecordedRelease, sites: list[str]) -> dict[str, str]:
        cfg, release = self.config, recorded.release
        payload = recorded.path.read_bytes()
        first: Envelope | None = None
        published: dict[str, str] = {}
        for site_id in sites:
            if first is None:
                env = first = seal(private_key=self._key, federation_id=cfg.federation_id, site_id=site_id, round=0,
                                   base_model_hash=release.sdk_wheel.sha256, kind=MessageKind.SOFTWARE,
                                   sequence=release.issued, payload=payload,
                                   piece_size=piece_size_for(cfg.transfer.chunk_size_bytes))
            else:
                env = readdress(first, private_key=self._key, site_id=site_id)
            before = int((self._store.get_state(site_state_key(site_id)) or {}).get("chunks", 0))
            try:
                chunks = publish_retained(
                    self._transport, env, topic=software_topic(cfg.federation_id, site_id),
                    chunk_topic=lambda i, s=site_id: software_chunk_topic(cfg.federation_id, s, i),
                    chunk_size_bytes=cfg.transfer.chunk_size_bytes, signing_key=self._key, previous_chunks=before)
            except Exception as exc:  # noqa: BLE001 - e.g. TransportError: the next look tries again
                log.error("software: version %s not published to %s (%s: %s); tried again at the next look",
                          release.version, site_id, type(exc).__name__, exc)
                continue
            self._store.set_state(site_state_key(site_id), {"version": release.version, "issued": release.issued,
                                                            "chunks": chunks})
            published[site_id] = release.version
        if published:
            log.info("software: version %s published to %d site(s)", release.version, len(published))
        return published


def describe(recorded: RecordedRelease) -> str:
    """One line for the operator: version, issued (UTC), files and size."""
    r = recorded.release
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r.issued))
    return (f"version {r.version}, issued {stamp}, {len(r.wheels)} file(s), "
            f"{sum(w.size for w in r.wheels) / 1e6:.1f} MB, confirm within {r.confirm_within_s} s; "
            f"sha256 {r.sdk_wheel.sha256[:16]}... ({json.dumps(r.sdk_wheel.name)})")
