"""The coordinator's configuration: one pydantic model, loaded from YAML.

Example (``wildfed-coordinator init`` writes this)::

    federation_id: wildfed-demo
    data_dir: ./coordinator-data          # blobs/, models/ and the default SQLite database
    database_url: null                    # null -> sqlite:///<data_dir>/coordinator.db; or postgresql+psycopg2://...
    signing_key_path: keys/coordinator.key
    public_key_path: keys/coordinator.pub
    broker_url: mqtt://127.0.0.1:1883     # or mqtts://host:8883 with the broker_* files below (docs/security.md)
    broker_ca_file: null                  # PEM CA of the broker's certificate (broker-config: tls/ca.crt)
    broker_cert_file: null                # mutual TLS: coordinator/client.crt (and broker_key_file)
    broker_key_file: null
    broker_username: null                 # default: the one in broker_password_file
    broker_password_file: null            # broker-config: coordinator/broker-credentials.yaml (0600)
    broker_max_packet_bytes: 1115136      # the broker's message limit (broker-config's max_packet_size)
    rounds: 10                            # `run` runs until this many rounds exist (`service`: schedule below)
    quorum_fraction: 1.0                  # fraction of selected sites whose updates close a round early
    round_deadline_s: 600
    round_duration_s: 300                 # the sites' replies leave this long after each task (timing padding;
                                          # 0 = none; below round_deadline_s; docs/privacy.md "Timing")
    local_steps: 20
    expected_batch_size: 32               # records per step in expectation (q = B / N_k at each site)
    learning_rate: 0.1                    # local SGD step size
    server_learning_rate: 1.0             # 1.0 = FedAvg
    clipping_norm: 1.0                    # L2 norm C of each per-example gradient
    target_delta: 1.0e-5
    privacy: ccdp                         # local CCDP; "global" (secure aggregation, coordinator noises once;
                                          # needs local_steps: 1); "none" (no DP; comparison runs only)
    ccdp_variant: sample                  # individualized DP-SGD: sample (per-category rates) or scale (norms)
    class_reweighting: 0.0                # privacy: ccdp: head rows scaled by w_c^-p after training (0 = off)
    posthoc_logit_adjustment: 0.0         # tau: predict with psi.bias - tau log(public-metadata prior); 0 = off
    budget: {kind: from_anchor, category: VU, epsilon: 1.0, gamma: 1.0}   # or {kind: from_max, eps_max: 2, gamma: 1}
    num_classes: 10
    seed: 0                               # model init and site sampling only
    task_seed: null                       # a seed in tasks makes gateway noise reproducible: tests only
    ship_ort_artifacts: null              # ONNX Runtime training artifacts in every task; null: if ORT training imports
    release_models: true                  # publish each new global model (retained) to every camera site for detect
    secagg: {threshold: null, modulus_bits: 32, max_abs_value: null, stage_timeout_s: 60, colluding_sites: 1}
                                          # privacy: global only; colluding_sites: distributed noise only
    global_noise: trusted-server          # privacy: global: trusted-server (the coordinator adds the noise) or
                                          # distributed (each site adds a Skellam share under the masks)
    feature_centre: null                  # privacy: global: the gateways' public feature centre file (centred
                                          # gradients, folded back here); local CCDP centres at the gateways
    strategy: {kind: fedavg}              # or {kind: nira, distance_threshold: 0.7, recluster_every: 5, ...}
    server_optimizer: {kind: sgd, momentum: 0.0}   # or {kind: fedsofim, beta: 0.9, rho: 1.0, warmup_rounds: 0,
                                          #  precondition: gradient}, or {kind: fedadam, beta1: 0.9, beta2: 0.99,
                                          #  tau: 0.001}
    species: null                         # [{scientific_name, class_index, iucn_category}, ...] (NIRA merging)
    model: head                           # phi adapter + psi head on backbone embeddings; or radio_unet (radio maps):
    adapter_width: 0                      # head model: 0 = psi only (linear head), H > 0 = a 1280 -> H tanh adapter
    radio: null                           # {defence: adaptive, noise_multiplier: 3, floor_fraction: 0.5,
                                          #  clipping_norm: 0.005, epsilon: 30, city: procedural, ...}
    transfer: {chunk_size_bytes: 262144, max_update_bytes: 268435456, ttl_s: 172800, max_clock_skew_s: 300,
               memory_limit_bytes: 268435456, spill_above_bytes: 67108864}   # chunk staging (inbound.staging)
    group_commit: {max_updates: 32, max_delay_s: 0.005, max_bytes: 134217728}   # coordinator.inbound.group_commit
    ingest_workers: 0                     # N >= 1: updates go to N `ingest-worker` processes (shared subscription)
    schedule: {round_interval_s: 86400, max_rounds: null}   # `service`: a round a day, no limit (run: `rounds`)
    buffered: null                        # intermittent links: {buffer_size: 4, max_staleness: 10, staleness:
                                          #  polynomial, exponent: 0.5, normalisation: fixed} (docs/transport.md)

Relative paths are resolved against the config file's folder. Privacy-relevant fields are validated here, so a bad
value fails at load time with a :class:`shared.errors.ConfigError` naming the file, the field and the fix.

The sections are defined beside this module, one idea each: :mod:`coordinator.config_privacy` (budget, secagg),
:mod:`coordinator.config_learning` (strategy, server_optimizer, species, radio) and
:mod:`coordinator.config_operations` (transfer, group_commit, schedule, web). This module holds the whole
:class:`CoordinatorConfig`, the rules that span sections, and loading, resolving and saving.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from coordinator.config_learning import (BufferedConfig, FedAvgConfig, RadioConfig, ServerOptimizerConfig,
                                         ServerSGDConfig, SpeciesEntry, Strategy)
from coordinator.config_operations import GroupCommitConfig, ScheduleConfig, TransferConfig, WebConfig
from coordinator.config_privacy import Budget, BudgetFromAnchor, SecAggConfig
from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES, check_broker_fields, check_chunk_fits
from shared.config import StrictModel, load_yaml, validation_errors
from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory

__all__ = ["CoordinatorConfig", "config_from_dict", "load_config", "save_config"]


class CoordinatorConfig(StrictModel):
    """Everything a :class:`coordinator.service.Coordinator` is built from (units in field descriptions).

    Immutable (shared.config.StrictModel: unknown keys are errors). Build with :func:`load_config` (YAML) or
    :func:`config_from_dict`.
    """

    federation_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    data_dir: Path = Path("coordinator-data")
    database_url: str | None = Field(None, description="SQLAlchemy URL; None -> SQLite in data_dir")
    signing_key_path: Path = Path("keys/coordinator.key")
    public_key_path: Path = Path("keys/coordinator.pub")
    broker_url: str = "mqtt://127.0.0.1:1883"
    broker_ca_file: Path | None = Field(None, description="PEM CA bundle of the broker's TLS certificate (mqtts://)")
    broker_cert_file: Path | None = Field(None, description="PEM client certificate (mutual TLS; with "
                                          "broker_key_file)")
    broker_key_file: Path | None = Field(None, description="PEM key of broker_cert_file")
    broker_username: str | None = Field(None, min_length=1, description="MQTT username (default: the one in "
                                        "broker_password_file)")
    broker_password_file: Path | None = Field(None, description="YAML {username, password}, mode 0600, written by "
                                              "`wildfed-coordinator broker-config` (coordinator/broker-credentials.yaml)")
    broker_max_packet_bytes: int = Field(DEFAULT_BROKER_MAX_PACKET_BYTES, ge=2048, description="the broker's limit "
                                         "on one MQTT message (bytes; Mosquitto max_packet_size, EMQX "
                                         "mqtt.max_packet_size): transfer.chunk_size_bytes must fit in it; "
                                         "broker-config writes it as max_packet_size")
    rounds: int = Field(10, ge=1)
    sites_per_round: int | None = Field(None, ge=1, description="None -> every non-halted site")
    quorum_fraction: float = Field(1.0, gt=0, le=1)
    round_deadline_s: float = Field(600.0, gt=0, description="seconds a round waits for its quorum")
    round_duration_s: float = Field(0.0, ge=0, description="seconds from a task's acceptance to the public time "
                                    "slot at which every site releases its update (and a Global DP round's "
                                    "replies after the keys), so that arrival times do not reveal record counts "
                                    "(TrainingTask.round_duration_s, edge_sdk.privacy.timing); the same for every "
                                    "site; above the slowest site's local work, below round_deadline_s. 0 = no "
                                    "padding (tests, demos); `init` writes 300")
    local_steps: int = Field(20, ge=1)
    expected_batch_size: int = Field(32, ge=1, description="expected records per local step")
    learning_rate: float = Field(0.1, gt=0, description="local SGD step size")
    server_learning_rate: float = Field(1.0, gt=0, description="server SGD step; 1.0 = FedAvg")
    clipping_norm: float = Field(1.0, gt=0, description="L2 clipping norm C of per-example gradients")
    target_delta: float = Field(1e-5, gt=0, lt=1)
    privacy: Literal["ccdp", "global", "grouped", "none"] = Field(
        "ccdp", description="ccdp: local DP at each gateway; global: secure aggregation, noise added once here; "
        "grouped: radio tasks' grouped-noise uploads (model: radio_unet)")
    ccdp_variant: Literal["sample", "scale"] = Field(
        "sample", description="how privacy: ccdp meets each category's budget with one noise draw per step "
        "(individualized DP-SGD, Boenisch et al. 2023): sample = per-category Poisson rates, scale = per-category "
        "clipping norms (Global DP rounds always sample)")
    class_reweighting: float = Field(
        0.0, ge=0, le=1, description="privacy: ccdp only. Exponent p of the post-processing that scales each class "
        "row of the head's delta by w_c^-p, w_c the public relative weight of the class's IUCN category in a step "
        "(TrainingTask.class_reweighting; 0 = off, 0.5 = square-root re-weighting, the demo's tuned value)")
    posthoc_logit_adjustment: float = Field(
        0.0, ge=0, le=4, description="tau of the post-hoc logit adjustment (Menon et al. 2021): the model the sites "
        "keep for detect, and the coordinator's inference model, predict argmax f_k(x) - tau log pi_k, pi the class "
        "prior estimated from the enrolled sites' public metadata (species lists, num_examples; "
        "shared.models.logit_adjustment). Post-processing of public values, no privacy cost; training is "
        "unchanged. 0 = off; 1 = the balanced-error Bayes rule (the demo's default). model: head, strategy: "
        "fedavg and a species table only")
    global_noise: Literal["trusted-server", "distributed"] = Field(
        "trusted-server", description="privacy: global only. trusted-server: the coordinator adds one Gaussian "
        "draw to the unmasked sum (it sees the unnoised sum); distributed: each site adds its share of Skellam "
        "noise to its quantised sum before masking, calibrated so that secagg.threshold - secagg.colluding_sites "
        "survivors carry it (Agarwal et al. "
        "2021), so the coordinator only ever opens a noised sum")
    budget: Budget = Field(default_factory=lambda: BudgetFromAnchor(category=IUCNCategory.VU, epsilon=1.0,
                                                                      gamma=1.0))
    feature_centre: Path | None = Field(
        None, description="privacy: global, model: head only: the public feature centre file "
        "(shared.models.feature_centre, the same file the gateways hold): Global DP tasks name it, the sites take "
        "their gradients on centred embeddings and the coordinator folds the noisy sum back (local CCDP rounds "
        "centre at the gateways without it)")
    accountant: Literal["rdp", "pld"] = "rdp"
    num_classes: int = Field(10, ge=2)
    seed: int | None = Field(0, description="round-0 model initialisation and site sampling (never privacy noise)")
    task_seed: int | None = Field(None, description="seed sent to gateways in every task for reproducible local "
                                  "training INCLUDING privacy noise; tests only (gateways ignore it unless they "
                                  "allow seeded noise)")
    ship_ort_artifacts: bool | None = Field(None, description="put ONNX Runtime training artifacts of the global "
                                            "model in every task (coordinator.artifacts); None: yes where "
                                            "onnxruntime.training imports at the coordinator")
    release_models: bool = Field(True, description="model: head: after every round that makes a new global "
                                 "model, publish it signed and retained on each camera site's model topic (NIRA: "
                                 "its cluster's), so that every gateway's detect and field loop use it "
                                 "(coordinator.model_delivery)")
    secagg: SecAggConfig = Field(default_factory=SecAggConfig)
    strategy: Strategy = Field(default_factory=FedAvgConfig)
    server_optimizer: ServerOptimizerConfig = Field(default_factory=ServerSGDConfig)
    species: list[SpeciesEntry] | None = Field(None, description="the federation's species table (class index, "
                                               "scientific name, IUCN category); NIRA uses it to map species to "
                                               "head rows")
    model: Literal["head", "radio_unet"] = Field("head", description="camera traps (the head model on frozen "
                                                 "EfficientNet-Lite0 embeddings, shared.models.head) or radio maps")
    adapter_width: int = Field(0, ge=0, le=4096, description="head model: width H of the phi adapter "
                               "(1280 -> H, tanh); 0 = head only (psi on the embedding)")
    radio: RadioConfig | None = Field(None, description="radio-map settings (model: radio_unet)")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="chunked transfers, size limits, "
                                     "replay window")
    web: WebConfig = Field(default_factory=WebConfig, description="the rangers' web view (serve)")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="when `service` runs rounds "
                                     "(round_interval_s, max_rounds)")
    group_commit: GroupCommitConfig = Field(default_factory=GroupCommitConfig, description="group commit of "
                                            "accepted updates (max_updates, max_delay_s, max_bytes)")
    buffered: BufferedConfig | None = Field(None, description="buffered rounds for intermittent links (FedBuff): a "
                                            "round closes at buffer_size updates, stale ones included")
    ingest_workers: int = Field(0, ge=0, description="0: this process ingests updates; N >= 1: N processes run "
                                "`wildfed-coordinator ingest-worker` on an MQTT shared subscription and this one "
                                "only opens, finalises (merges their partial sums) and closes rounds")

    @field_validator("learning_rate", "server_learning_rate", "clipping_norm", "round_deadline_s", "round_duration_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("privacy")
    @classmethod
    def _global_needs_one_step(cls, v: str, info: ValidationInfo) -> str:
        steps = info.data.get("local_steps")
        if v == "global" and steps is not None and steps != 1:
            raise ValueError(f"privacy 'global' runs one clipped-gradient step per round (the coordinator noises "
                             f"each round's sum once), so it needs local_steps: 1, got {steps}; set local_steps: 1 "
                             "(and raise rounds) or use privacy: ccdp")
        return v

    @field_validator("strategy")
    @classmethod
    def _nira_not_global(cls, v: Any, info: ValidationInfo) -> Any:
        if getattr(v, "kind", None) == "nira" and info.data.get("privacy") == "global":
            raise ValueError("NIRA needs each site's update (per-cluster heads, phi-update similarity), which "
                             "secure aggregation hides: use privacy ccdp (or none) with strategy nira, or strategy "
                             "fedavg with privacy global")
        return v

    @model_validator(mode="after")
    def _padding_fits_the_deadline(self) -> "CoordinatorConfig":
        if self.round_duration_s and self.round_duration_s >= self.round_deadline_s:
            raise ValueError(f"round_duration_s {self.round_duration_s:g} must be below round_deadline_s "
                             f"{self.round_deadline_s:g}: the sites' updates leave round_duration_s after the task, "
                             "so the round would close before any arrived; lower round_duration_s or raise "
                             "round_deadline_s")
        return self

    @model_validator(mode="after")
    def _broker_tls_consistent(self) -> "CoordinatorConfig":
        check_broker_fields(self.broker_url, self.broker_ca_file, self.broker_cert_file, self.broker_key_file)
        return self

    @model_validator(mode="after")
    def _chunks_fit_the_broker(self) -> "CoordinatorConfig":
        check_chunk_fits(self.transfer.chunk_size_bytes, self.broker_max_packet_bytes,
                         field="transfer.chunk_size_bytes", limit_field="broker_max_packet_bytes")
        return self

    @model_validator(mode="after")
    def _radio_consistent(self) -> "CoordinatorConfig":
        if self.model == "radio_unet":
            if self.radio is None:
                raise ValueError("model radio_unet needs a radio: block (defence, noise_multiplier, ...)")
            want = "grouped" if self.radio.guaranteed else "none"
            if self.privacy != want:
                raise ValueError(f"radio defence {self.radio.defence!r} needs privacy: {want} (uniform and adaptive "
                                 f"state an epsilon, the others do not), got privacy: {self.privacy}")
            if getattr(self.strategy, "kind", "fedavg") != "fedavg":
                raise ValueError("radio maps use strategy fedavg (NIRA's heads are the camera model's)")
        elif self.privacy == "grouped" or self.radio is not None:
            raise ValueError("privacy grouped and the radio: block are for model: radio_unet")
        return self

    @model_validator(mode="after")
    def _feature_centre_consistent(self) -> "CoordinatorConfig":
        if self.feature_centre is not None and (self.privacy != "global" or self.model != "head"):
            raise ValueError("feature_centre is for privacy: global with model: head (local CCDP rounds centre at "
                             "the gateways): remove it")
        return self

    @model_validator(mode="after")
    def _posthoc_logit_adjustment_consistent(self) -> "CoordinatorConfig":
        if self.posthoc_logit_adjustment > 0:
            if not math.isfinite(self.posthoc_logit_adjustment):
                raise ValueError("posthoc_logit_adjustment must be finite")
            if self.model != "head" or getattr(self.strategy, "kind", "fedavg") != "fedavg":
                raise ValueError("posthoc_logit_adjustment adjusts one global head for the whole federation's "
                                 "prior: it needs model: head and strategy {kind: fedavg} (NIRA's per-cluster "
                                 "heads are not supported); set posthoc_logit_adjustment: 0")
            if not self.species:
                raise ValueError("posthoc_logit_adjustment needs the species table (species: [{scientific_name, "
                                 "class_index, iucn_category}, ...]) to read the sites' species lists; add it or "
                                 "set posthoc_logit_adjustment: 0")
        return self

    @model_validator(mode="after")
    def _workers_consistent(self) -> "CoordinatorConfig":
        if self.ingest_workers > 0:
            if getattr(self.strategy, "kind", "fedavg") != "fedavg":
                raise ValueError("ingest_workers merge FedAvg partial sums only: use strategy {kind: fedavg}, or "
                                 "ingest_workers: 0 with NIRA")
            if self.privacy == "global":
                raise ValueError("privacy global runs secure aggregation in this process: use ingest_workers: 0")
        return self

    @model_validator(mode="after")
    def _buffered_consistent(self) -> "CoordinatorConfig":
        if self.buffered is None:
            return self
        if self.privacy not in ("ccdp", "none") or self.model != "head":
            raise ValueError("buffered rounds are for local DP camera federations (privacy: ccdp, model: head): "
                             "secure aggregation needs a synchronous cohort (docs/transport.md); remove buffered:")
        if getattr(self.strategy, "kind", "fedavg") != "fedavg":
            raise ValueError("buffered rounds fold stale updates into FedAvg's sum: use strategy {kind: fedavg} or "
                             "remove buffered:")
        if self.ingest_workers > 0:
            raise ValueError("buffered rounds store stale updates in this process: use ingest_workers: 0 or remove "
                             "buffered:")
        return self

    # -- derived -------------------------------------------------------------------------------------------------
    def ccdp_budget(self) -> CCDPBudget:
        """The per-category budget object (shared.iucn.CCDPBudget)."""
        return self.budget.to_budget()

    def planned_updates(self) -> int:
        """The rounds each site's records are planned for (tasks' ``planned_rounds``): ``rounds``, or in buffered
        rounds ``buffered.updates_per_site`` when set (a site there trains only the rounds it reaches)."""
        if self.buffered is not None and self.buffered.updates_per_site is not None:
            return int(self.buffered.updates_per_site)
        return int(self.rounds)

    def pending_rounds_cap(self) -> int | None:
        """The most pending rounds per site the ledger's forecasts count: 1 in buffered rounds (a buffered gateway
        holds at most one trained, uncharged update: docs/transport.md "Buffered rounds"), else None (all)."""
        return 1 if self.buffered is not None else None

    def budgets(self) -> dict[IUCNCategory, float]:
        """``{category: total epsilon}`` for all six IUCN categories; for radio maps ``{NE: radio.epsilon}`` (a radio
        map has no species; the ledger files its uploads under NE, "Not Evaluated")."""
        if self.model == "radio_unet" and self.radio is not None:
            return {IUCNCategory.NE: self.radio.epsilon}
        return self.ccdp_budget().table()

    def resolved(self, base_dir: str | os.PathLike[str]) -> "CoordinatorConfig":
        """A copy with relative paths made absolute against ``base_dir`` and ``database_url`` filled in."""
        base = Path(base_dir)

        def fix(p: Path) -> Path:
            return p if p.is_absolute() else (base / p).resolve()

        data_dir = fix(self.data_dir)
        url = self.database_url or f"sqlite:///{data_dir / 'coordinator.db'}"
        broker_files = {name: fix(getattr(self, name)) for name in ("broker_ca_file", "broker_cert_file",
                                                                   "broker_key_file", "broker_password_file")
                        if getattr(self, name) is not None}
        web_files = {name: fix(getattr(self.web, name)) for name in ("tls_cert_file", "tls_key_file")
                     if getattr(self.web, name) is not None}
        web_files["location_secret_path"] = (fix(self.web.location_secret_path)
                                             if self.web.location_secret_path is not None
                                             else data_dir / "location-secret")
        return self.model_copy(update={"data_dir": data_dir, "signing_key_path": fix(self.signing_key_path),
                                       "public_key_path": fix(self.public_key_path), "database_url": url,
                                       "web": self.web.model_copy(update=web_files), **broker_files})


def load_config(path: str | os.PathLike[str]) -> CoordinatorConfig:
    """Read a YAML config (shared.config.load_yaml) and resolve its paths against the file's folder.

    Raises:
        ConfigError: missing file, bad YAML, or invalid fields (names file, every bad field, and the fix).
    """
    path = Path(path)
    return load_yaml(path, CoordinatorConfig).resolved(path.parent)


def config_from_dict(data: dict[str, Any], *, source: object = "<config>") -> CoordinatorConfig:
    """Validate a dict into a :class:`CoordinatorConfig` (paths left as given).

    Raises:
        ConfigError: an invalid field.
    """
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        problems = validation_errors(exc, CoordinatorConfig)
        detail = "; ".join(f"{f}: {m}" for f, m in problems)
        raise ConfigError(f"{len(problems)} invalid field(s): {detail}", source=source, field=problems[0][0],
                          fix="correct the listed fields (see coordinator/config.py and the config_* modules beside it "
                          "for units and ranges)") from exc


def save_config(config: CoordinatorConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` as YAML (JSON-mode dump, so enums and paths are plain strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path
