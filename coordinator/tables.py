"""The coordinator's tables: SQLAlchemy 2.x declarative rows (:class:`coordinator.storage.Store` opens and queries them).

Tables (SQLite by default, PostgreSQL by URL):

============== ===========================================================================================
``sites``       enrolled gateways: site id, current Ed25519 public key (PEM), public metadata (JSON), enrol time
``site_keys``   every key a site has had since rotation/revocation began (coordinator.registry): fingerprint,
                PEM, created, ``valid_until`` (end of a rotation's grace period), ``revoked_at``; a site with no
                row here (enrolled before this table existed, or by provisioning) has exactly its ``sites`` key
``rounds``      one row per round: status (``open`` / ``closed`` / ``failed``), base and new model hash,
                selected sites, accepted count, open/close times
``updates``     accepted updates: round, site, envelope sequence, ``num_examples``, the payload's digest (the
                payload itself is a file in the blob directory named by it); unique per (round, site)
``buffered_updates`` the updates of buffered rounds that came for an earlier round than the open one (stale, FedBuff):
                one row per such ``updates`` row, with the round whose aggregate folded it (null while it waits)
``rejections``  every rejected message: round (when known), site (when known), reason code, the typed error
                that caused it, a human-readable detail, time
``ledger``      immutable privacy-ledger rows: one DP-SGD event per (site, round, IUCN category)
``model_versions`` model hash -> safetensors file, round that produced it
``halts``       (site, IUCN category) pairs whose budget is exhausted, with the round that halted them
``detections``  verified detection records from gateways (coordinator.detections): one row per (site, media id),
                the record as JSON plus indexed columns for the ranger view
``detection_tallies`` per site, how often a gateway's record was stored, a duplicate, replaced, or stale
``transfers``   incomplete chunked uploads (coordinator.inbound.transfers): the signed manifest and its expiry time
``deployments`` camera deployments for the web view's map, one per (site, deployment id): coordinates, name, IUCN
                categories recorded
``protected_places`` places the web view protects (coordinator.web.places): the fixed anchor of each one's
                displaced point, its deployments, and when its protection was earned and (by an operator) lifted
``users``       accounts of the rangers' web view: Argon2id password hash, role, disabled (coordinator.web.auth)
``web_sessions`` logged-in web-view sessions: SHA-256 of the cookie token, account, CSRF token, expiry
``partial_sums`` per round and ingest worker, its partial FedAvg sum (blob) and the sites it covers
                (coordinator.inbound.workers)
``registry_version`` one row: a counter every change of a site's keys increments in the same transaction
                (coordinator.registry caches verification keys and re-reads them when it moves)
``site_health`` per site, the newest verified health record and its times, and the latest presence message
                (online/offline, advisory) with when it arrived (coordinator.fleet; ``wildfed-coordinator fleet``)
============== ===========================================================================================
"""

from __future__ import annotations

import datetime as _dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "SiteRow", "SiteKeyRow", "RoundRow", "StrategyStateRow", "UpdateRow", "BufferedUpdateRow",
           "RejectionRow", "LedgerRow",
           "ModelVersionRow", "HaltRow", "CohortRow", "CohortRoundRow", "DetectionRow", "DetectionTallyRow",
           "TransferRow", "PartialSumRow", "SiteHealthRow", "PresenceEventRow", "UserRow", "WebSessionRow", "DeploymentRow", "PlaceRow",
           "RegistryVersionRow", "deployment_key", "utcnow"]


def utcnow() -> _dt.datetime:
    """Current time, timezone-aware UTC (stored as a naive UTC timestamp for SQLite portability)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    """Declarative base of the coordinator tables."""


class SiteRow(Base):
    """An enrolled gateway. ``metadata_json`` holds only public metadata (species list, biome, declared capacity)."""

    __tablename__ = "sites"
    site_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    public_key_pem: Mapped[str] = mapped_column(Text)
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    enrolled_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class SiteKeyRow(Base):
    """One Ed25519 key of a site, for rotation and revocation (coordinator.registry.SiteRegistry).

    ``valid_until`` (naive UTC) is set on the *old* key when the site rotates (end of the grace period; None: no
    end); ``revoked_at`` (naive UTC) ends it at once. Rows are added by the registry only when a key is rotated
    or revoked, so databases written before this table existed stay readable: their ``sites`` key is valid.
    """

    __tablename__ = "site_keys"
    __table_args__ = (UniqueConstraint("site_id", "fingerprint", name="uq_site_keys_site_fp"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), ForeignKey("sites.site_id"), index=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    public_key_pem: Mapped[str] = mapped_column(Text)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    valid_until: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    revoked_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)


class RoundRow(Base):
    """One federated round. ``status`` is ``open``, ``closed`` (new model stored) or ``failed`` (no quorum)."""

    __tablename__ = "rounds"
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(16), default="open")
    base_model_hash: Mapped[str] = mapped_column(String(64))
    new_model_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    selected_json: Mapped[str] = mapped_column(Text, default="[]")
    num_accepted: Mapped[int] = mapped_column(Integer, default=0)
    opened_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    closed_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    privacy: Mapped[str | None] = mapped_column(String(16), nullable=True)  # ccdp / global / none
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)  # e.g. how a Global DP round went


class UpdateRow(Base):
    """An accepted update; the payload (safetensors bytes) is the blob named ``payload_sha256`` (the envelope's
    payload digest; the column's name is from envelope format 1, module docstring)."""

    __tablename__ = "updates"
    __table_args__ = (UniqueConstraint("round", "site_id", name="uq_updates_round_site"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round: Mapped[int] = mapped_column(Integer, index=True)
    site_id: Mapped[str] = mapped_column(String(128), ForeignKey("sites.site_id"))
    sequence: Mapped[int] = mapped_column(BigInteger)
    num_examples: Mapped[int] = mapped_column(Integer)
    payload_sha256: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class BufferedUpdateRow(Base):
    """A stored update that joins a later round's buffer (``buffered:`` rounds, :mod:`coordinator.buffered_store`):
    ``update_id`` names its ``updates`` row (stored under the round it was trained for, so (round, site) stays
    unique); ``buffer_round`` is the round whose aggregate folded it, null while it waits for the next close."""

    __tablename__ = "buffered_updates"
    update_id: Mapped[int] = mapped_column(Integer, ForeignKey("updates.id"), primary_key=True)
    buffer_round: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class RejectionRow(Base):
    """A rejected message: ``reason`` is a stable code (see ``coordinator.inbound.reject.RejectReason``)."""

    __tablename__ = "rejections"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    site_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    topic: Mapped[str] = mapped_column(String(512), default="")
    reason: Mapped[str] = mapped_column(String(64), index=True)
    error_kind: Mapped[str] = mapped_column(String(128))
    detail: Mapped[str] = mapped_column(Text, default="")
    received_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class LedgerRow(Base):
    """One immutable DP event (shared.privacy.events.DPSGDEvent) charged to (site, round, category, mechanism):
    ``mechanism`` is ``"dpsgd"`` (the round's training steps) or ``"counts"`` (NIRA's noisy per-class counts)."""

    __tablename__ = "ledger"
    __table_args__ = (UniqueConstraint("site_id", "round", "category", "mechanism", name="uq_ledger_site_round_cat"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    round: Mapped[int] = mapped_column(Integer)
    category: Mapped[str] = mapped_column(String(4))
    noise_multiplier: Mapped[float] = mapped_column(Float)
    sampling_rate: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    event_json: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    mechanism: Mapped[str] = mapped_column(String(16), default="dpsgd")


class ModelVersionRow(Base):
    """A global model version: hash (shared.codec.model_hash) -> safetensors file under ``data_dir/models``."""

    __tablename__ = "model_versions"
    model_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    round: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class StrategyStateRow(Base):
    """Persistent state of the aggregation strategy (e.g. NIRA's clusters), JSON under a key; never pickled."""

    __tablename__ = "strategy_state"
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value_json: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class HaltRow(Base):
    """A (site, IUCN category) whose next round would pass its budget; never un-halted."""

    __tablename__ = "halts"
    __table_args__ = (UniqueConstraint("site_id", "category", name="uq_halts_site_cat"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    category: Mapped[str] = mapped_column(String(4))
    round: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text, default="")
    halted_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class CohortRow(Base):
    """A cohort of a site: the records that joined its training in round ``cohort`` (one per round a camera site was
    sent a task; its size is never known here). ``retired_round``: the round from which its records train no
    more (every category's budget spent), or None while it is active (coordinator.cohorts)."""

    __tablename__ = "cohorts"
    __table_args__ = (UniqueConstraint("site_id", "cohort", name="uq_cohorts_site_cohort"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    cohort: Mapped[int] = mapped_column(Integer)
    retired_round: Mapped[int | None] = mapped_column(Integer, nullable=True)


class CohortRoundRow(Base):
    """Which cohorts of a site took part in a round, and the categories halted in each (JSON ``{cohort: [IUCN
    codes]}``): written before the round's tasks, it is what the site's charges for that round are fanned out to
    (one ledger stream per cohort)."""

    __tablename__ = "cohort_rounds"
    __table_args__ = (UniqueConstraint("site_id", "round", name="uq_cohort_rounds_site_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    round: Mapped[int] = mapped_column(Integer)
    active_json: Mapped[str] = mapped_column(Text)


class DetectionRow(Base):
    """A verified detection record (shared.protocol.DetectionRecord) from a site; one per (site, media id).

    ``record_json`` is the whole record; the other columns are copies for queries. ``captured_at`` is the
    record's ISO 8601 capture time as sent (with its UTC offset); ``sent_at`` is the envelope's timestamp.
    ``species_json`` lists the distinct species of its boxes (they decide which deployments are sensitive).
    ``source`` is ``gateway`` for a record that came in a verified signed envelope, ``import:<file>`` for one an
    operator imported (coordinator.web.formats; ``sequence`` 0, ``payload_sha256`` the record's own SHA-256); for a
    gateway's record ``payload_sha256`` is the envelope's payload digest (a BLAKE3 hash list since envelope format 2).
    ``image_sha256`` names the image in the blob directory when the coordinator holds a copy (imports), else None
    (gateways keep their images).
    """

    __tablename__ = "detections"
    __table_args__ = (UniqueConstraint("site_id", "media_id", name="uq_detections_site_media"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), ForeignKey("sites.site_id"), index=True)
    media_id: Mapped[str] = mapped_column(String(64))
    deployment_id: Mapped[str] = mapped_column(String(128), index=True)
    file: Mapped[str] = mapped_column(Text)
    captured_at: Mapped[str] = mapped_column(String(40))
    num_detections: Mapped[int] = mapped_column(Integer)
    max_confidence: Mapped[float | None] = mapped_column(Float, nullable=True)
    top_species: Mapped[str | None] = mapped_column(String(256), nullable=True)
    top_species_confidence: Mapped[float | None] = mapped_column(Float, nullable=True)
    failure: Mapped[str | None] = mapped_column(Text, nullable=True)
    record_json: Mapped[str] = mapped_column(Text)
    sequence: Mapped[int] = mapped_column(BigInteger)
    payload_sha256: Mapped[str] = mapped_column(String(64))
    sent_at: Mapped[_dt.datetime] = mapped_column(DateTime)
    received_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    species_json: Mapped[str] = mapped_column(Text, default="[]")
    source: Mapped[str] = mapped_column(String(256), default="gateway")
    image_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)


class DetectionTallyRow(Base):
    """How often each outcome of the verified detection ingest (coordinator.detections) happened, per site:
    ``stored`` (a new row), ``duplicate`` (the same payload again, e.g. a broker's re-delivery), ``replaced`` (a
    newer record for the same media) or ``stale`` (an older one, ignored). Incremented in the transaction that
    writes the record, so the counts are those of the database (``wildfed-coordinator status``); refused records
    are in ``rejections``."""

    __tablename__ = "detection_tallies"
    site_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)


class TransferRow(Base):
    """An incomplete chunked upload (coordinator.inbound.transfers): the verified manifest payload and its expiry. The
    chunk data lives in ``<data_dir>/transfers/<transfer_id>/``; the row is deleted once the update is reassembled
    and handed to ingest, or when it expires."""

    __tablename__ = "transfers"
    transfer_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    round: Mapped[int] = mapped_column(Integer)
    sequence: Mapped[int] = mapped_column(BigInteger)
    manifest_payload: Mapped[bytes] = mapped_column(LargeBinary)
    num_chunks: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[_dt.datetime] = mapped_column(DateTime, index=True)


class RegistryVersionRow(Base):
    """The registry's change counter (one row, ``id`` 1): every enrolment, key rotation, revocation and removal of
    a site increments ``version`` in the transaction that makes the change (coordinator.registry), so a process
    that caches verification keys sees a change committed by any process by reading this one integer. A database
    without the row reads as version 0."""

    __tablename__ = "registry_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class SiteHealthRow(Base):
    """What the coordinator last heard from a gateway (coordinator.fleet): its newest verified health record
    (``record_json``, ``shared.health.HealthRecord``) with the envelope's signing time ``sent_at`` and the arrival
    time ``received_at``, and the latest presence message (``presence``: ``online``/``offline``, unsigned and
    advisory) with its arrival time ``presence_at``. Times are naive UTC. One row per site, replaced in place."""

    __tablename__ = "site_health"
    site_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    record_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    sent_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    received_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    presence: Mapped[str | None] = mapped_column(String(16), nullable=True)
    presence_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)


class PresenceEventRow(Base):
    """A change of a gateway's presence as the coordinator heard it (coordinator.inbound.health): ``state``
    (``online``/``offline``) and the arrival time ``at`` (naive UTC). Presence is unsigned and advisory; a change
    that happened while no coordinator ran is heard late (the retained message, at the next start). The link
    statistics (coordinator.link_stats) are read from these rows."""

    __tablename__ = "presence_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[str] = mapped_column(String(128), index=True)
    state: Mapped[str] = mapped_column(String(16))
    at: Mapped[_dt.datetime] = mapped_column(DateTime, index=True)


class PartialSumRow(Base):
    """One ingest worker's partial FedAvg sum for one round (coordinator.inbound.workers): the running weighted sum as a
    blob (float64 safetensors), the sites it covers with what their updates reported (JSON), and its total weight.
    The finaliser merges the rows of a round (aggregation is associative)."""

    __tablename__ = "partial_sums"
    __table_args__ = (UniqueConstraint("round", "worker_id", name="uq_partial_round_worker"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round: Mapped[int] = mapped_column(Integer, index=True)
    worker_id: Mapped[str] = mapped_column(String(64))
    blob_sha256: Mapped[str] = mapped_column(String(64))
    sites_json: Mapped[str] = mapped_column(Text)
    total_weight: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class UserRow(Base):
    """An account of the rangers' web view (coordinator.web.auth): the Argon2id hash of its password (never the
    password), its role, and whether it is disabled."""

    __tablename__ = "users"
    username: Mapped[str] = mapped_column(String(64), primary_key=True)
    password_hash: Mapped[str] = mapped_column(String(256))
    role: Mapped[str] = mapped_column(String(16))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)


class WebSessionRow(Base):
    """A logged-in web-view session (coordinator.web.sessions): the SHA-256 of its cookie token (the token itself
    is never stored), the account, its CSRF token, and when it was created, last used and expires (naive UTC)."""

    __tablename__ = "web_sessions"
    token_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    username: Mapped[str] = mapped_column(String(64), ForeignKey("users.username"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    last_seen_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[_dt.datetime] = mapped_column(DateTime, index=True)


class DeploymentRow(Base):
    """A camera deployment for the web view's map (coordinator.web.deployments): true WGS 84 coordinates (shown
    exactly only to rangers and operators), a name, where it was imported from, and the species it recorded with
    their IUCN categories at import (JSON lists); the view re-reads the species against the current species table,
    which decides whether its location is protected.

    Keyed by (site, deployment): deployment ids are unique within one site's package only (two reserves both have
    a ``StationA``), and a detection record joins the deployment of its own site. ``site_id`` is ``""`` only for a
    row the schema upgrade could not give a site (coordinator.schema_upgrade): it joins no records until an
    ``import-deployments --site`` of the same deployment id takes it over."""

    __tablename__ = "deployments"
    site_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    latitude: Mapped[float] = mapped_column(Float)
    longitude: Mapped[float] = mapped_column(Float)
    location_name: Mapped[str] = mapped_column(String(256), default="")
    source: Mapped[str] = mapped_column(String(256), default="")
    categories_json: Mapped[str] = mapped_column(Text, default="[]")
    species_json: Mapped[str] = mapped_column(Text, default="[]")
    start: Mapped[str | None] = mapped_column(String(40), nullable=True)  # ISO 8601 with offset, as imported
    end: Mapped[str | None] = mapped_column(String(40), nullable=True)


def deployment_key(site_id: str, deployment_id: str) -> str:
    """The one string that names a deployment across sites, ``"<site>/<deployment>"`` (a :class:`DeploymentRow`'s
    key): site ids never contain ``/`` (``coordinator.registry.SITE_ID_PATTERN``), so the first ``/`` splits it.
    Protected places list their members by it (``protected_places.members_json``)."""
    return f"{site_id}/{deployment_id}"


class PlaceRow(Base):
    """A place the web view protects (coordinator.web.places): the true WGS 84 position of the deployment that
    first made it protected (the fixed anchor of its one displaced point), its deployments (JSON list of
    :func:`deployment_key` strings), why and when its protection was earned (``earned_at`` None: protected only as
    a neighbour) and the operator's last lift of it (``lifted_at``, ``lifted_by``, ``lift_reason``; protection
    earned again later has a later ``earned_at``). Rows are never deleted."""

    __tablename__ = "protected_places"
    __table_args__ = (UniqueConstraint("latitude", "longitude", name="uq_protected_places_anchor"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    latitude: Mapped[float] = mapped_column(Float)
    longitude: Mapped[float] = mapped_column(Float)
    location_name: Mapped[str] = mapped_column(String(256), default="")
    members_json: Mapped[str] = mapped_column(Text, default="[]")
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime, default=utcnow)
    earned_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    earned_reason: Mapped[str] = mapped_column(Text, default="")
    lifted_at: Mapped[_dt.datetime | None] = mapped_column(DateTime, nullable=True)
    lifted_by: Mapped[str] = mapped_column(String(256), default="")
    lift_reason: Mapped[str] = mapped_column(Text, default="")
