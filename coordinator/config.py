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

Relative paths are resolved against the config file's folder. Privacy-relevant fields are validated here, so a bad
value fails at load time with a :class:`shared.errors.ConfigError` naming the file, the field and the fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES, check_broker_fields, check_chunk_fits
from shared.config import StrictModel, load_yaml, validation_errors
from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory

__all__ = ["BudgetFromMax", "BudgetFromAnchor", "SecAggConfig", "RadioConfig", "FedAvgConfig", "NiraConfig", "SpeciesEntry",
           "ServerSGDConfig", "FedSOFIMConfig", "FedAdamConfig", "TransferConfig", "GroupCommitConfig", "ScheduleConfig",
           "CoordinatorConfig", "load_config", "save_config"]


class BudgetFromMax(StrictModel):
    """CCDP budget in the seed's form: ``eps_c = eps_max * (rank(c)/6) ** gamma`` (shared.iucn.CCDPBudget)."""

    kind: Literal["from_max"] = "from_max"
    eps_max: float = Field(2.0, gt=0, description="NE budget (total epsilon per record over the federation)")
    gamma: float = Field(1.0, ge=0)

    def to_budget(self) -> CCDPBudget:
        """The :class:`shared.iucn.CCDPBudget`."""
        return CCDPBudget.from_max(eps_max=self.eps_max, gamma=self.gamma)


class BudgetFromAnchor(StrictModel):
    """CCDP budget pinned at one category: ``eps_c = epsilon * (rank(c)/rank(category)) ** gamma``.

    Defaults are the documented CCDP setting (README, docs/privacy.md): VU = 1.0 with gamma = 1, i.e. CR 0.33,
    EN 0.67, VU 1.00, NT 1.33, LC 1.67, NE 2.00; ``gamma: 2`` must be asked for (NE 4.00)."""

    kind: Literal["from_anchor"] = "from_anchor"
    category: IUCNCategory = IUCNCategory.VU
    epsilon: float = Field(1.0, gt=0)
    gamma: float = Field(1.0, ge=0, description="steepness; 1 (default) is linear in rank, 2 quadratic")

    def to_budget(self) -> CCDPBudget:
        """The :class:`shared.iucn.CCDPBudget`."""
        return CCDPBudget.from_anchor(category=self.category, epsilon=self.epsilon, gamma=self.gamma)


Budget = Annotated[BudgetFromMax | BudgetFromAnchor, Field(discriminator="kind")]


class FedAvgConfig(StrictModel):
    """Plain FedAvg over all sites (McMahan et al. 2017)."""

    kind: Literal["fedavg"] = "fedavg"


class NiraConfig(StrictModel):
    """NIRA: ecological clusters, shared phi, one head psi per cluster (coordinator/strategies/nira.py, docs/nira.md).

    At most one of ``distance_threshold`` / ``num_clusters`` cuts the species-list dendrogram; with neither, the
    cut is at Jaccard distance 0.7 (sites sharing less than 30 % of their species lists fall apart)."""

    kind: Literal["nira"] = "nira"
    distance_threshold: float | None = Field(None, gt=0, le=1, description="cut at this Jaccard distance 1 - J "
                                             "(average linkage)")
    num_clusters: int | None = Field(None, ge=1, description="or cut into this many clusters")
    exclude_categories: list[IUCNCategory] = Field(default_factory=lambda: [IUCNCategory.CR, IUCNCategory.EN],
                                                   description="IUCN categories left out of the species lists used "
                                                   "for clustering (sensitive species)")
    recluster_every: int = Field(0, ge=0, description="re-cluster from the cosine similarity of the sites' "
                                 "phi-updates every this many rounds (0: never)")
    recluster_margin: float = Field(0.1, ge=0, le=2, description="a site moves only if its mean cosine similarity "
                                    "to another cluster beats its own cluster's by this much")
    min_rounds_between_moves: int = Field(3, ge=1, description="a site moves at most once per this many rounds")
    embedding_merging: bool = Field(True, description="initialise (once, aligned) the head rows of species a "
                                    "cluster lacks with the weighted mean of the sites' embeddings of that species; "
                                    "on by default; under CCDP gamma 1 it changed nothing measurable (66.5 vs "
                                    "66.4 % macro over 10 seeds, docs/nira.md)")
    head_prefix: str = Field("psi.", min_length=1, description="tensor-name prefix of the classification head")
    embedding_weights: Literal["public", "noisy_counts"] = Field(
        "public", description="weights w_ks of the merged embeddings: the sites' public N_k (no cost), or per-species "
        "counts each site releases with Gaussian noise every round (charged to its ledger; DP-SGD noise is "
        "calibrated so that both stay within each budget)")
    count_noise_multiplier: float = Field(100.0, gt=0, description="noise std of each released count (records; "
                                          "sensitivity 1), for embedding_weights: noisy_counts. One release per "
                                          "round: 10 rounds at 100 cost about eps 0.1 at delta 1e-5, which the "
                                          "DP-SGD calibration leaves room for; too little noise for a budget stops "
                                          "the site with a clear error")

    phi_weighting: Literal["records", "inverse_variance", "clusters"] = Field(
        "records", description="weights of the clusters' mean deltas in the shared phi's step: records (N_m / N, "
        "FedAvg's), inverse_variance (1 / the DP noise variance of each cluster's mean), or clusters (|C_m| / K, "
        "the seed's rule, which multiplied the noise on phi by up to 2.9x under CCDP: docs/nira.md)")
    min_cluster_records: int = Field(0, ge=0, description="a cluster from the species lists with fewer declared "
                                     "records joins its most similar cluster (0: off)")
    recluster_min_snr: float = Field(1.0, ge=0, description="re-cluster only in rounds whose similarity "
                                     "signal-to-noise ratio (estimated from the updates and their DP noise "
                                     "variance; docs/nira.md) is at least this; 0: always")

    @model_validator(mode="after")
    def _one_cut(self) -> "NiraConfig":
        if self.distance_threshold is not None and self.num_clusters is not None:
            raise ValueError("give at most one of distance_threshold and num_clusters")
        return self

    @property
    def cut(self) -> dict[str, float | int | None]:
        """Keyword arguments of the dendrogram cut: ``distance_threshold`` or ``num_clusters``."""
        if self.num_clusters is not None:
            return {"distance_threshold": None, "num_clusters": self.num_clusters}
        return {"distance_threshold": self.distance_threshold if self.distance_threshold is not None else 0.7,
                "num_clusters": None}


Strategy = Annotated[FedAvgConfig | NiraConfig, Field(discriminator="kind")]


class ServerSGDConfig(StrictModel):
    """Server SGD (DP-FedGD baseline), optionally with server momentum; step size ``server_learning_rate``."""

    kind: Literal["sgd"] = "sgd"
    momentum: float = Field(0.0, ge=0, lt=1, description="server momentum mu (FedAvgM); 0 = plain")


class FedSOFIMConfig(StrictModel):
    """DP-FedSOFIM (coordinator/optimizers/fedsofim.py, docs/fedsofim.md); step size ``server_learning_rate``."""

    kind: Literal["fedsofim"] = "fedsofim"
    beta: float = Field(0.9, ge=0, lt=1, description="momentum of M_t = beta M + (1 - beta) G")
    rho: float = Field(1.0, gt=0, description="ridge of the Fisher proxy M M^T + rho I (large: SGD with eta/rho)")
    warmup_rounds: int = Field(0, ge=0, description="first steps taken as SGD with step eta/rho while M fills")
    precondition: Literal["gradient", "momentum"] = Field(
        "gradient", description="precondition the round's aggregate G (the seed's step) or the momentum M")


class FedAdamConfig(StrictModel):
    """FedAdam (Reddi et al. 2021, Alg. 2; coordinator/optimizers/fedadam.py); step size ``server_learning_rate``
    (typically far below 1, e.g. 0.01)."""

    kind: Literal["fedadam"] = "fedadam"
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay")
    tau: float = Field(1e-3, gt=0, description="adaptivity (large: momentum SGD with step eta/tau)")


ServerOptimizerConfig = Annotated[ServerSGDConfig | FedSOFIMConfig | FedAdamConfig, Field(discriminator="kind")]


class SpeciesEntry(StrictModel):
    """One class of the federation's model (public): its scientific name, class index and IUCN category."""

    scientific_name: str = Field(min_length=1)
    class_index: int = Field(ge=0)
    iucn_category: IUCNCategory


class SecAggConfig(StrictModel):
    """Secure aggregation of Global DP rounds (Bonawitz et al. 2017; shared.secagg, docs/secagg.md)."""

    threshold: int | None = Field(None, ge=2, description="t: fewest surviving sites that can unmask; None -> the "
                                  "smallest majority of the round's selected sites, floor(n/2) + 1")
    modulus_bits: int = Field(32, ge=16, le=64, description="k: masks and sums live in Z_{2^k}")
    max_abs_value: float | None = Field(None, gt=0, description="B: per-coordinate box of a site's clipped gradient "
                                        "sum; None -> clipping_norm * expected_batch_size (never binding for a "
                                        "batch of at most that size)")
    stage_timeout_s: float = Field(60.0, gt=0, description="seconds each secure-aggregation stage waits for the "
                                   "sites (keys, masked updates, recovery shares); the shares stage, which waits "
                                   "for local training, uses round_deadline_s")
    colluding_sites: int = Field(1, ge=0, description="f, global_noise: distributed only: how many colluding "
                                 "participants the sites' noise must survive. Each site adds variance mu / (t - f), "
                                 "so the shares of t - f survivors carry the whole noise, and the epsilon charged "
                                 "holds against the coordinator, anyone who sees only the released models, and up "
                                 "to f colluding participants (docs/privacy.md, 'Who the guarantee holds against'). "
                                 "1 (the default): every participant knows its own share, so with f = 0 each site "
                                 "would face less noise than charged; must be below the round's threshold t")

    @model_validator(mode="after")
    def _colluders_below_threshold(self) -> "SecAggConfig":
        if self.threshold is not None and self.colluding_sites >= self.threshold:
            raise ValueError(f"colluding_sites ({self.colluding_sites}) must be below threshold ({self.threshold}): "
                             "the noise of threshold - colluding_sites survivors is what carries the guarantee")
        return self


class RadioConfig(StrictModel):
    """A radio-map federation (``model: radio_unet``; docs/radiomap.md): RadioUNet on base-station
    gateways, uploads through the grouped-noise defence. Each selected site trains ``local_epochs`` of Adam over
    its maps and uploads its whole delta clipped to ``clipping_norm``."""

    defence: Literal["none", "clip-only", "uniform", "steered-uniform", "adaptive", "grouped-clipping"] = Field(
        "adaptive", description="uniform, adaptive and grouped-clipping state an (eps, delta) (privacy: grouped); "
        "the others none (privacy: none)")
    noise_multiplier: float = Field(3.0, gt=0, description="z: each upload's noise budget is d (z C)^2")
    floor_fraction: float = Field(0.5, gt=0, le=1, description="phi: the adaptive defence's uniform floor")
    clipping_norm: float = Field(0.005, gt=0, description="C: L2 norm of each upload (model delta)")
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1, description="maps per local Adam step")
    learning_rate: float = Field(5e-4, gt=0, description="local Adam step size")
    epsilon: float = Field(30.0, gt=0, description="total epsilon per site (ledger key NE) before it is halted; "
                           "at z=3, phi=0.5 one upload costs 4.4 and 21 uploads 28.8 (RDP, delta 1e-5)")
    width: int = Field(8, ge=1, description="RadioUNet base width")
    allocator_every: int = Field(5, ge=1, description="rounds between the gateways' allocator retraining")
    proxy_sites: int = Field(12, ge=3)
    proxy_maps: int = Field(8, ge=1)
    site_radius_m: float = Field(20.0, gt=0)
    city: str = Field("procedural", description="procedural, or a sionna-rt scene (munich, florence, "
                      "san_francisco, etoile; pip install --no-deps sionna-rt==2.2.0)")
    city_seed: int = Field(0, description="which tile of the city (public)")
    size_px: int = Field(64, ge=4, multiple_of=4)
    metres_per_pixel: float = Field(4.0, gt=0)
    max_walls: int | None = Field(4, ge=1)

    @property
    def guaranteed(self) -> bool:
        """Whether the defence states an (eps, delta)."""
        return self.defence in ("uniform", "adaptive")


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

    # -- derived -------------------------------------------------------------------------------------------------
    def ccdp_budget(self) -> CCDPBudget:
        """The per-category budget object (shared.iucn.CCDPBudget)."""
        return self.budget.to_budget()

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
                          fix="correct the listed fields (see coordinator/config.py for units and ranges)") from exc


def save_config(config: CoordinatorConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` as YAML (JSON-mode dump, so enums and paths are plain strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path
