"""Durable coordinator state: SQLAlchemy 2.x tables plus a content-addressed blob directory.

One idea: *where the coordinator's state lives*. Every other module (registry, ledger, ingest, rounds) reads and
writes through :class:`Store`; none of them builds an engine or touches the blob directory itself.

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
``rejections``  every rejected message: round (when known), site (when known), reason code, the typed error
                that caused it, a human-readable detail, time
``ledger``      immutable privacy-ledger rows: one DP-SGD event per (site, round, IUCN category)
``model_versions`` model hash -> safetensors file, round that produced it
``halts``       (site, IUCN category) pairs whose budget is exhausted, with the round that halted them
``detections``  verified detection records from gateways (coordinator.detections): one row per (site, media id),
                the record as JSON plus indexed columns for the ranger view
``detection_tallies`` per site, how often a gateway's record was stored, a duplicate, replaced, or stale
``transfers``   incomplete chunked uploads (coordinator.transfers): the signed manifest and its expiry time
``deployments`` camera deployments for the web view's map, one per (site, deployment id): coordinates, name, IUCN
                categories recorded
``protected_places`` places the web view protects (coordinator.web.places): the fixed anchor of each one's
                displaced point, its deployments, and when its protection was earned and (by an operator) lifted
``users``       accounts of the rangers' web view: Argon2id password hash, role, disabled (coordinator.web.auth)
``web_sessions`` logged-in web-view sessions: SHA-256 of the cookie token, account, CSRF token, expiry
``partial_sums`` per round and ingest worker, its partial FedAvg sum (blob) and the sites it covers
                (coordinator.workers)
``registry_version`` one row: a counter every change of a site's keys increments in the same transaction
                (coordinator.registry caches verification keys and re-reads them when it moves)
``site_health`` per site, the newest verified health record and its times, and the latest presence message
                (online/offline, advisory) with when it arrived (coordinator.fleet; ``wildfed-coordinator fleet``)
============== ===========================================================================================

Blobs are written to a temporary file, ``fsync``-ed and atomically renamed, so a file that exists under its hash
name is complete. A blob is named by a 64-hex digest of its content: the SHA-256 the store computes, or a digest its
caller verified, such as an update's payload digest (envelope format 2: a BLAKE3 hash list, ``shared.envelope``), so
that a verified payload is not hashed again. The column ``payload_sha256`` keeps its name from envelope format 1,
when that digest was a SHA-256; rows written since hold the format-2 payload digest. Rows are committed before
:class:`Store` methods return ("durable" in the rest of the package means: committed to the database and, for
payloads, fsync-ed to disk). :meth:`Store.put_blobs` and
:meth:`Store.add_updates_if_open` are the batched forms ingest's group commit uses (coordinator.group_commit):
several blobs written before their fsyncs are issued, several updates' rows in one transaction.

SQLite runs in write-ahead-log mode with ``synchronous=FULL`` (set and checked on every new connection): a commit
appends to the WAL and fsyncs it, so it survives power loss, and readers never block the writer nor the writer them
(SQLite, "Write-Ahead Logging", https://www.sqlite.org/wal.html; "PRAGMA synchronous": in WAL mode FULL syncs the
WAL at every commit, NORMAL does not and may lose the last commits on power loss). WAL needs the database on a
local file system (its index is shared memory): a database file on a network share is refused with a clear error.

PostgreSQL isolation for tests or shared servers: ``Store(url, schema="wf_x")`` maps every table into that schema
through SQLAlchemy's ``schema_translate_map`` (the schema must exist).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

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
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

from shared.errors import ConfigError

from coordinator.schema_upgrade import upgrade_schema

__all__ = [
    "Base",
    "SiteRow",
    "SiteKeyRow",
    "RoundRow",
    "StrategyStateRow",
    "UpdateRow",
    "RejectionRow",
    "LedgerRow",
    "ModelVersionRow",
    "HaltRow",
    "DetectionRow",
    "DetectionTallyRow",
    "TransferRow",
    "PartialSumRow",
    "SiteHealthRow",
    "UserRow",
    "WebSessionRow",
    "DeploymentRow",
    "PlaceRow",
    "RegistryVersionRow",
    "Store",
    "UpdateOutcome",
    "DatabaseUnavailable",
    "deployment_key",
    "utcnow",
]


class DatabaseUnavailable(ConfigError):
    """The database did not answer when the store opened it: a wrong URL, or a server that is not (yet) running.
    A long-lived process may try again later (``wildfed-coordinator service`` exits so that systemd restarts it)."""


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


class RejectionRow(Base):
    """A rejected message: ``reason`` is a stable code (see ``coordinator.ingest.RejectReason``)."""

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
    """An incomplete chunked upload (coordinator.transfers): the verified manifest payload and its expiry. The
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


class PartialSumRow(Base):
    """One ingest worker's partial FedAvg sum for one round (coordinator.workers): the running weighted sum as a
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


class UpdateOutcome(str, Enum):
    """What :meth:`Store.add_updates_if_open` did with one update row."""

    STORED = "stored"  #: inserted (committed with its group)
    DUPLICATE = "duplicate"  #: an update of this (round, site) was already stored: nothing written
    CLOSED = "closed"  #: the round is no longer open: nothing written (ingest charges the update as late)


def _fsync_dir(folder: Path) -> None:
    """fsync a folder, so the renames into it survive power loss (POSIX: fsync of the file is not enough)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _is_file_sqlite(url: str) -> bool:
    """Whether ``url`` is SQLite on a file (in-memory databases have no journal to put in WAL mode)."""
    if not url.startswith("sqlite"):
        return False
    database = make_url(url).database
    return bool(database) and database != ":memory:" and "mode=memory" not in url


def _sqlite_wal_durable(dbapi_connection: Any, _record: Any) -> None:
    """SQLAlchemy ``connect`` listener: put a new SQLite connection in WAL mode with ``synchronous=FULL`` and check
    that both took (https://www.sqlite.org/wal.html, https://www.sqlite.org/pragma.html#pragma_synchronous).

    Raises:
        ConfigError: SQLite refused WAL (e.g. the file is on a network file system without shared memory) or
            FULL (field ``database_url``).
    """
    cursor = dbapi_connection.cursor()
    try:
        mode = str(cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        if mode != "wal":
            raise ConfigError(f"SQLite kept journal_mode {mode!r} instead of 'wal'", field="database_url",
                              fix="put the SQLite file on a local file system (WAL needs shared memory), or use "
                                  "PostgreSQL")
        cursor.execute("PRAGMA synchronous=FULL")
        level = int(cursor.execute("PRAGMA synchronous").fetchone()[0])
        if level < 2:  # 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA
            raise ConfigError(f"SQLite synchronous is {level}, not FULL (2)", field="database_url",
                              fix="do not override PRAGMA synchronous below FULL: commits would not survive power "
                                  "loss")
    finally:
        cursor.close()


def _fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


class Store:
    """The coordinator's database and blob directory.

    Args:
        url: SQLAlchemy URL (``sqlite:///path.db``, ``sqlite://`` for in-memory,
            ``postgresql+psycopg2://user@host:5432/db``).
        data_dir: folder for blobs (``blobs/``) and model files (``models/``); created if absent.
        schema: optional PostgreSQL schema that every table is mapped into (must already exist).
        create: upgrade existing tables whose shape changed (coordinator.schema_upgrade), then create missing
            tables (``create_all``), on construction.

    Raises:
        ConfigError: the URL does not parse or the database cannot be reached (names ``database_url``).
    """

    def __init__(self, url: str, data_dir: str | os.PathLike[str], *, schema: str | None = None,
                 create: bool = True) -> None:
        self.url = url
        self.data_dir = Path(data_dir)
        self.blob_dir = self.data_dir / "blobs"
        self.model_dir = self.data_dir / "models"
        kwargs: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False}
            if url in ("sqlite://", "sqlite:///:memory:"):
                kwargs["poolclass"] = StaticPool
        try:
            engine = create_engine(url, **kwargs)
        except (ArgumentError, ImportError) as exc:
            raise ConfigError(f"cannot build a database engine from {url!r}: {exc}", field="database_url",
                              fix="use sqlite:///path/to/coordinator.db or postgresql+psycopg2://user@host/db"
                              ) from exc
        if _is_file_sqlite(url):
            event.listen(engine, "connect", _sqlite_wal_durable)
        if schema is not None:
            engine = engine.execution_options(schema_translate_map={None: schema})
        self.engine: Engine = engine
        self.schema = schema
        self._sessions = sessionmaker(bind=self.engine, expire_on_commit=False)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if create:
            try:
                upgrade_schema(self.engine, schema=schema)  # reshape existing tables first (no row is lost)
                Base.metadata.create_all(self.engine)
            except OperationalError as exc:
                raise DatabaseUnavailable(f"cannot reach the database at {url!r}: {exc.orig}", field="database_url",
                                          fix="start the database server or correct the URL") from exc
            try:  # the registry's change counter exists from the start, so key changes only ever update it
                with self.session() as s:
                    if s.get(RegistryVersionRow, 1) is None:
                        s.add(RegistryVersionRow(id=1, version=0))
            except IntegrityError:
                pass  # another process created it at the same moment

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on any exception (the exception propagates)."""
        with self._sessions() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        """Close every pooled connection (call before dropping a test schema)."""
        self.engine.dispose()

    # ---- blobs ---------------------------------------------------------------------------------------------------
    def blob_path(self, sha256_hex: str) -> Path:
        """Path of the blob named ``sha256_hex`` (two-character fan-out folder)."""
        return self.blob_dir / sha256_hex[:2] / f"{sha256_hex}.bin"

    def put_blob(self, data: bytes, *, sha256_hex: str | None = None) -> str:
        """Store ``data`` durably (fsync + atomic rename) and return its name (hex digest); idempotent.

        Args:
            data: the bytes. sha256_hex: a 64-hex digest of them the caller has just verified, to name the blob by
                without hashing again (an envelope's payload digest, checked against its signed header, or a
                SHA-256); None: their SHA-256 is computed.
        """
        digest = sha256_hex if sha256_hex is not None else hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            _fsync_write(path, data)
        return digest

    def put_blobs(self, blobs: Sequence[tuple[bytes, str]]) -> None:
        """Store several blobs durably, their syncs batched (group commit, coordinator.group_commit): every new file
        is written first, then each is fsync-ed, renamed into place, and each folder they went into is fsync-ed
        once. A file that exists under its name is complete, as with :meth:`put_blob`; idempotent.

        Batching lets the file system commit its journal once for the group where it can (ext4 and XFS merge the
        metadata of files synced back to back into one journal transaction), instead of once per blob.

        Args:
            blobs: ``(data, 64-hex digest of data)`` pairs, the digests already verified by the caller (e.g. an
                envelope's payload against its signed header).

        Raises:
            OSError: a write, fsync or rename failed (disk full, I/O error); files already renamed are complete
                blobs, temporary files are removed.
        """
        written: list[tuple[int, str, Path]] = []
        open_fds: set[int] = set()
        seen: set[Path] = set()
        try:
            for data, digest in blobs:
                path = self.blob_path(digest)
                if path in seen or path.exists():
                    continue
                seen.add(path)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
                open_fds.add(fd)
                written.append((fd, tmp, path))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            for fd, _, _ in written:
                os.fsync(fd)
            for fd, tmp, path in written:
                open_fds.discard(fd)
                os.close(fd)
                os.replace(tmp, path)
        except BaseException:
            for fd, tmp, _ in written:
                if fd in open_fds:
                    os.close(fd)
                if os.path.exists(tmp):
                    os.unlink(tmp)
            raise
        for folder in {path.parent for _, _, path in written}:
            _fsync_dir(folder)

    def get_blob(self, sha256_hex: str) -> bytes:
        """Read a blob back; raises ``FileNotFoundError`` if it was never stored."""
        return self.blob_path(sha256_hex).read_bytes()

    # ---- model versions ------------------------------------------------------------------------------------------
    def put_model(self, model_hash: str, data: bytes, *, round: int) -> Path:
        """Store a global model's safetensors bytes under ``models/<hash>.safetensors`` and record the version.

        Idempotent: storing the same hash twice keeps the first row.
        """
        path = self.model_dir / f"{model_hash}.safetensors"
        if not path.exists():
            _fsync_write(path, data)
        with self.session() as s:
            if s.get(ModelVersionRow, model_hash) is None:
                s.add(ModelVersionRow(model_hash=model_hash, path=str(path), round=round))
        return path

    def get_state(self, key: str, default: Any = None) -> Any:
        """The JSON value stored under ``key`` (strategy state), or ``default``."""
        with self.session() as s:
            row = s.get(StrategyStateRow, key)
            return default if row is None else json.loads(row.value_json)

    def set_state(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key`` (committed before return)."""
        text = json.dumps(value, sort_keys=True)
        with self.session() as s:
            row = s.get(StrategyStateRow, key)
            if row is None:
                s.add(StrategyStateRow(key=key, value_json=text))
            else:
                row.value_json, row.updated_at = text, utcnow()

    def get_model(self, model_hash: str) -> bytes:
        """Safetensors bytes of a stored model version; raises ``KeyError`` if the hash is unknown."""
        with self.session() as s:
            row = s.get(ModelVersionRow, model_hash)
            if row is None:
                raise KeyError(model_hash)
            return Path(row.path).read_bytes()

    def latest_model_hash(self) -> str | None:
        """Hash of the newest model version (highest round, then newest), or None if none is stored."""
        with self.session() as s:
            row = s.scalars(select(ModelVersionRow).order_by(ModelVersionRow.round.desc(),
                                                             ModelVersionRow.created_at.desc())).first()
            return None if row is None else row.model_hash

    # ---- rejections / status -------------------------------------------------------------------------------------
    def add_rejection(self, *, round: int | None, site_id: str | None, topic: str, reason: str,
                      error_kind: str, detail: str) -> None:
        """Record one rejected message (committed before return)."""
        with self.session() as s:
            s.add(RejectionRow(round=round, site_id=site_id, topic=topic[:512], reason=reason,
                               error_kind=error_kind, detail=detail))

    def rejection_counts(self) -> dict[str, int]:
        """Rejections counted per reason code, e.g. ``{"bad_signature": 2}``."""
        with self.session() as s:
            rows = s.execute(select(RejectionRow.reason, func.count()).group_by(RejectionRow.reason)).all()
            return {reason: int(n) for reason, n in rows}

    def rounds(self) -> list[RoundRow]:
        """All round rows, oldest first."""
        with self.session() as s:
            return list(s.scalars(select(RoundRow).order_by(RoundRow.round)))

    def add_update_if_open(self, row: UpdateRow) -> bool:
        """Insert an accepted update's row only while its round is ``open``, under a lock on the round's row
        (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises writers anyway), so that an ingest worker and
        the finaliser closing the round agree on which updates the round holds.

        Returns:
            False when the round is no longer open (nothing is written).

        Raises:
            sqlalchemy.exc.IntegrityError: an update of this (round, site) is already stored.
        """
        with self.session() as s:
            status = s.scalars(select(RoundRow.status).where(RoundRow.round == row.round).with_for_update()).first()
            if status is not None and status != "open":
                return False
            s.add(row)
        return True

    def add_updates_if_open(self, rows: Sequence[UpdateRow]) -> list[UpdateOutcome]:
        """Insert several accepted updates' rows in ONE transaction (one commit: one WAL fsync on SQLite), each only
        while its round is ``open`` (under a lock on the round rows, as :meth:`add_update_if_open`) and only if no
        update of its (round, site) is stored; the ``transfers`` rows of those (round, site) pairs are deleted in
        the same transaction (their uploads are consumed: stored, or refused as duplicate or late). For a group
        spanning several rounds, every (round, site) combination of the group's rounds and sites counts as consumed.

        Read once: the round statuses and the stored (round, site) pairs of the whole group are each read by one
        query inside the transaction.

        Args:
            rows: new :class:`UpdateRow` objects (not yet added to any session); at most one per (round, site) is
                stored, a later one of the same pair is a duplicate.

        Returns:
            one :class:`UpdateOutcome` per row, in order.

        Raises:
            sqlalchemy.exc.IntegrityError: another process stored an update of one of these (round, site) pairs
                between the read and the commit (PostgreSQL, several ingest workers); nothing of the group is
                written, and the caller retries row by row.
        """
        if not rows:
            return []
        rounds = sorted({r.round for r in rows})
        sites = sorted({r.site_id for r in rows})
        outcomes: list[UpdateOutcome] = []
        new: list[dict[str, Any]] = []
        # SQLAlchemy Core in one transaction (no ORM unit of work), with statements whose shape does not depend on
        # the group's size (expanding IN parameters), so their compiled form is cached. A group holds one round in
        # practice (a round's close commits the group first), so round IN x site IN is the group's pairs.
        with self.engine.begin() as conn:
            status = {r: st for r, st in conn.execute(
                select(RoundRow.round, RoundRow.status).where(RoundRow.round.in_(rounds)).with_for_update())}
            stored = {(r, site) for r, site in conn.execute(
                select(UpdateRow.round, UpdateRow.site_id).where(UpdateRow.round.in_(rounds),
                                                                 UpdateRow.site_id.in_(sites)))}
            for row in rows:
                key = (row.round, row.site_id)
                st = status.get(row.round)
                if st is not None and st != "open":
                    outcomes.append(UpdateOutcome.CLOSED)
                elif key in stored:
                    outcomes.append(UpdateOutcome.DUPLICATE)
                else:
                    new.append({"round": row.round, "site_id": row.site_id, "sequence": row.sequence,
                                "num_examples": row.num_examples, "payload_sha256": row.payload_sha256,
                                "received_at": row.received_at or utcnow()})
                    stored.add(key)
                    outcomes.append(UpdateOutcome.STORED)
            if new:
                conn.execute(insert(UpdateRow), new)
            conn.execute(delete(TransferRow).where(TransferRow.round.in_(rounds), TransferRow.site_id.in_(sites)))
        return outcomes

    def updates_for_round(self, round: int) -> list[UpdateRow]:
        """Accepted-update rows of one round, in arrival order."""
        with self.session() as s:
            return list(s.scalars(select(UpdateRow).where(UpdateRow.round == round).order_by(UpdateRow.id)))

    def count_updates(self) -> int:
        """Total number of accepted updates over all rounds."""
        with self.session() as s:
            return int(s.scalar(select(func.count()).select_from(UpdateRow)) or 0)


def dumps(obj: Any) -> str:
    """Canonical JSON used for metadata columns (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
