"""How the coordinator service runs: chunked transfers (``transfer:``), group commit (``group_commit:``), the round
schedule (``schedule:``) and the rangers' web view (``web:``).

Parts of :class:`coordinator.config.CoordinatorConfig`; the check that chunks fit the broker's packet limit lives
there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.config import StrictModel
from shared.iucn import IUCNCategory

__all__ = ["TransferConfig", "GroupCommitConfig", "ScheduleConfig", "WebConfig"]


class TransferConfig(StrictModel):
    """Chunked transfers, size limits and the replay window (``coordinator.inbound.transfers``, ``shared.transfer``)."""

    chunk_size_bytes: int = Field(256 * 1024, ge=1024, description="chunk size of task downloads (bytes); well "
                                  "under the broker's packet limit (EMQX 1 MB by default); tasks are sealed with "
                                  "the largest power of two not above it as their piece size, and travel in chunks "
                                  "of that size (shared.transfer.piece_size_for)")
    max_chunk_bytes: int = Field(1 << 20, ge=1024, description="largest upload chunk accepted (bytes)")
    max_update_bytes: int = Field(256 << 20, ge=1024, description="largest update a manifest may announce (bytes)")
    max_message_bytes: int = Field((1 << 20) + 65536, ge=2048, description="largest MQTT payload looked at, "
                                   "checked before parsing (bytes); at least max_chunk_bytes + 40")
    ttl_s: float = Field(48 * 3600.0, gt=0, description="seconds after which an incomplete upload expires")
    max_clock_skew_s: float = Field(300.0, ge=0, description="seconds a message may be signed in the future")
    max_message_age_s: float = Field(7 * 24 * 3600.0, gt=0, description="seconds after signing at which a "
                                     "message is refused as stale")
    max_dropped_sends: int = Field(3, ge=1, description="link drops in a row while one message waited for its "
                                   "PUBACK after which the broker is taken to refuse it (over its packet limit): it "
                                   "is no longer re-sent (coordinator.transport, docs/transport.md)")
    memory_limit_bytes: int = Field(256 << 20, ge=0, description="announced bytes of the uploads in progress "
                                    "held in memory, together (bytes); an upload whose size does not fit in what is "
                                    "left is staged on disk (coordinator.inbound.staging); 0: every upload on disk")
    spill_above_bytes: int = Field(64 << 20, ge=0, description="an upload announcing more bytes than this is "
                                   "staged on disk from its first chunk, so it resumes after a coordinator restart "
                                   "(smaller ones held in memory start over then)")
    models_by_digest: bool = Field(True, description="publish each round's model (each NIRA cluster's model) "
                                   "once, signed and retained on wildfed/v1/<fed>/models/<digest>, and send every "
                                   "camera task without weights, naming the digest (coordinator.model_digests, "
                                   "docs/protocol.md 'Models by digest'); false: every task carries its model, for "
                                   "gateways whose SDK predates the model_digest field (they refuse such a task, "
                                   "naming the field)")
    model_retention_rounds: int = Field(3, ge=1, description="a model published by digest is cleared (an empty "
                                        "retained message on its topics) once no task of the last this many rounds "
                                        "named it; a gateway away longer gets the open round's task, whose model is "
                                        "still retained")

    @model_validator(mode="after")
    def _fits(self) -> "TransferConfig":
        if self.max_message_bytes < self.max_chunk_bytes + 40:
            raise ValueError("transfer.max_message_bytes must be at least max_chunk_bytes + 40 (fix: raise it)")
        if self.chunk_size_bytes > self.max_chunk_bytes:
            raise ValueError("transfer.chunk_size_bytes must not exceed max_chunk_bytes (fix: lower it)")
        return self


class GroupCommitConfig(StrictModel):
    """Group commit of accepted updates (``coordinator.inbound.group_commit``): several updates made durable by one
    batch of fsyncs and one database commit, each ACKed only after its group is durable. The ingest path takes its
    bounds as :meth:`coordinator.inbound.group_commit.GroupCommitPolicy.from_config`."""

    max_updates: int = Field(32, ge=1, description="updates per group (1: every update committed alone)")
    max_delay_s: float = Field(0.005, ge=0, le=1.0, description="seconds the first update of a group may wait for "
                               "others (the most an ACK is delayed by grouping; 0: commit whenever ingest is idle)")
    max_bytes: int = Field(128 << 20, ge=1024, description="payload bytes per group (they wait in memory until "
                           "the group is durable)")


class ScheduleConfig(StrictModel):
    """When ``wildfed-coordinator service`` runs rounds (coordinator.daemon; ``run`` ignores it)."""

    round_interval_s: float = Field(86_400.0, gt=0, description="seconds from the start of one round (or of a slot "
                                    "in which no round could run) to the next slot; default one round a day")
    max_rounds: int | None = Field(None, ge=1, description="open no round once this many rounds exist (null: no "
                                   "limit; each record retires from training once its budget is spent); the "
                                   "service keeps ingesting")

    @field_validator("round_interval_s")
    @classmethod
    def _finite_interval(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class WebConfig(StrictModel):
    """The rangers' web view (``wildfed-coordinator serve``, coordinator.web; docs/web.md)."""

    host: str = Field("127.0.0.1", description="address to listen on (put a TLS proxy in front, or give "
                      "tls_cert_file/tls_key_file, before exposing it)")
    port: int = Field(8080, ge=1, le=65535)
    tls_cert_file: Path | None = Field(None, description="PEM certificate: serve HTTPS directly (with tls_key_file)")
    tls_key_file: Path | None = Field(None, description="PEM key of tls_cert_file")
    cookie_secure: bool = Field(True, description="mark the session cookie Secure (sent over HTTPS only; browsers "
                                "also send it to http://localhost and 127.0.0.1). false only for plain HTTP on a "
                                "trusted network")
    session_ttl_s: float = Field(8 * 3600.0, gt=0, description="seconds a login lasts (absolute)")
    session_idle_s: float = Field(3600.0, gt=0, description="seconds without a request after which a login ends")
    login_max_failures: int = Field(5, ge=1, description="failed logins per (account, client address) allowed "
                                    "within login_window_s before that account is refused from that address")
    login_max_failures_per_address: int = Field(50, ge=1, description="failed logins per client address, all "
                                                "accounts together, within login_window_s before the address is "
                                                "refused (against password spraying; keep it well above "
                                                "login_max_failures: a ranger station shares one NAT address)")
    login_window_s: float = Field(900.0, gt=0, description="seconds of the login-throttle window")
    location_method: Literal["displace", "grid"] = Field("displace", description="how sensitive deployments are "
                                                         "shown to partner/public: displace (random point within "
                                                         "location_radius_m, fixed per deployment) or grid (cell "
                                                         "centre; stronger, docs/location-privacy.md)")
    location_radius_m: float = Field(1000.0, gt=0, description="displacement radius (metres)")
    location_cell_m: float = Field(10_000.0, gt=0, description="grid cell side (metres)")
    sensitive_categories: list[IUCNCategory] = Field(
        default_factory=lambda: [IUCNCategory.CR, IUCNCategory.EN, IUCNCategory.VU],
        description="IUCN categories whose deployments are protected for viewers without the ranger role")
    unknown_species: Literal["protect", "ne"] = Field("protect", description="a species the species table does not "
                                                      "list: protect (its places are shown like a sensitive "
                                                      "species', failing closed) or ne (IUCN Not Evaluated: shown "
                                                      "exactly)")
    location_secret_path: Path | None = Field(None, description="0600 file with the displacement key; None -> "
                                              "data_dir/location-secret (created on first use)")

    @model_validator(mode="after")
    def _tls_pair(self) -> "WebConfig":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("web.tls_cert_file and web.tls_key_file go together (fix: give both, or neither)")
        return self
