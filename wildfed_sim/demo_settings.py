"""The demo's settings (the flags of ``wildfed demo``, checked when built), its tuned defaults per privacy mode,
and what a run returns (:class:`DemoResult`); the run itself is :mod:`wildfed_sim.demo`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from wildfed_sim.demo_links import check_link_settings

__all__ = ["DP_DEFAULTS", "GLOBAL_DP_DEFAULTS", "NON_PRIVATE_DEFAULTS", "demo_embedding_cache", "DemoSettings",
           "DemoResult", "secagg_threshold", "privacy_label", "header_label"]


#: Demo defaults under DP (ccdp, global), tuned with the in-process simulation on seeds 101-103 (docs/demo-data.md)
DP_DEFAULTS: dict[str, Any] = {"local_steps": 1, "expected_batch_size": 1024, "learning_rate": 4.0,
                               "server_momentum": 0.5}
#: Demo defaults under Global DP (one step per round; the coordinator's server step): learning rate 12, chosen with
#: the demo's secure-aggregation threshold (7 of 8 sites, DemoSettings.tolerated_dropouts) on tuning seeds 101, 103,
#: 104 and 105 (3 noise draws each, 10 rounds): distributed 83.5 % at lr 8 with the majority threshold, 84.8 % at
#: lr 8, 85.6 % at lr 12 and 85.4 % at lr 16 with threshold 7; the trusted server 86.4 % at lr 8, 86.0 % at lr 12
#: (one default for both modes: their difference is within the draws' spread)
GLOBAL_DP_DEFAULTS: dict[str, Any] = {**DP_DEFAULTS, "local_steps": 1, "learning_rate": 12.0}
#: Demo defaults without privacy (no clipping: the mean gradient's norm is ~20, hence the larger step); same sweep
NON_PRIVATE_DEFAULTS: dict[str, Any] = {"local_steps": 60, "expected_batch_size": 128, "learning_rate": 10.0,
                                        "server_momentum": 0.5}


def demo_embedding_cache(site_id: str) -> Path:
    """The persistent embedding cache of demo site ``site_id``: ``<wildfed cache>/embeddings/demo/<site_id>``
    (records are keyed by mediaID and content hash, so a stale entry is never served)."""
    from edge_sdk.inference.weights import cache_dir

    return cache_dir() / "embeddings" / "demo" / site_id


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of the demo (CLI flags of ``wildfed demo``).

    Attributes:
        sites: number of gateway sites K (>= 2). rounds: federated rounds (>= 1).
        privacy: ``"ccdp"`` (local DP at each gateway), ``"global"`` (secure aggregation, the noise added once per
            round to the sum, by the sites' shares or the coordinator: ``global_noise``; needs ``local_steps`` 1) or
            ``"none"`` (non-private reference). None (the default): ``"global"`` with FedAvg, ``"ccdp"`` with NIRA
            (whose per-cluster heads need the sites' own updates). Global DP with distributed noise is the default
            because it is the most accurate mode at these budgets in which the coordinator never sees an unnoised
            sum: the privacy-utility experiment measured it +4.9 points [+3.4, +6.5] over local CCDP with class
            re-weighting at the same per-category epsilons, level on CR/EN (README "Privacy-utility").
        gamma: CCDP steepness; budgets are ``from_anchor(anchor_category, anchor_epsilon, gamma)``.
        ccdp_variant: how CCDP meets each category's budget with one noise draw per step (individualized DP-SGD,
            :mod:`edge_sdk.privacy.ccdp`): ``"sample"`` (per-category Poisson rates; default) or ``"scale"``
            (per-category clipping norms). Global DP rounds always sample.
        global_noise: with ``privacy="global"``: ``"distributed"`` (default: each gateway adds its share of
            Skellam noise before masking, ``shared.privacy.distributed``) or ``"trusted-server"`` (the coordinator
            adds the noise to the unmasked sum).
        tolerated_dropouts: with ``privacy="global"``: how many of the round's sites may drop out and the secure
            sum still open; the secure-aggregation threshold is ``t = sites - tolerated_dropouts`` (coordinator
            config ``secagg.threshold``), which must stay a majority (``2t > sites``, Bonawitz et al. 2017).
            Distributed noise is calibrated so that t surviving shares carry the whole noise, so each site that
            does not drop adds noise no one needed: None (the default) means 1, or 0 with too few sites (t = 7 of 8 sites: 8/7 of the needed noise
            variance, where the coordinator's default majority t = 5 gives 8/5). Chosen on tuning seeds 101, 103,
            104 and 105 (3 noise draws each, 10 rounds): 83.5 % overall with t = 5 at lr 8, 85.6 % with t = 7 at
            lr 12 (84.8 % at lr 8), against 86.4 % for the trusted server. A round with more dropouts than this is
            abandoned (the sum cannot be opened), never released with less noise.
        class_reweighting: with ``privacy="ccdp"``: the exponent p of the post-processing that scales each class
            row of a site's head delta by ``w_c^-p`` (``TrainingTask.class_reweighting``; 0 = off). 0.5 (square-root
            re-weighting), chosen on tuning seeds 101, 103, 104 and 105 (2 draws each, CCDP gamma 1 at the demo's
            defaults): overall 76.2 -> 77.1 %, CR/EN 69.6 -> 77.6 %; p = 1 gave CR/EN 81.6 % at 75.0 % overall.
        posthoc_logit_adjustment: tau of the coordinator's post-hoc logit adjustment (coordinator config
            ``posthoc_logit_adjustment``; Menon et al. 2021, sec. 4): the model the demo evaluates, the sites keep for
            ``detect`` and the end-of-demo detections use predicts ``argmax f_k(x) - tau log pi_k``, pi estimated
            from the public metadata the sites enrol with (:mod:`shared.models.logit_adjustment`; no privacy
            cost). None (the default) means 1 (the balanced-error rule) with ``strategy="fedavg"`` and 0 with NIRA
            (per-cluster heads: not supported). Chosen on tuning seeds 101, 103, 104 and 105 (3 draws each,
            distributed Global DP at the demo's defaults): tau 0 (as trained) 85.6 % overall, CR/EN 83.1 %; tau
            0.5 / 1 / 1.5: 86.2 / 86.4 / 86.1 % overall, CR/EN 86.1 / 88.8 / 90.8 %.
        anchor_category, anchor_epsilon: the category pinned to a budget (default VU = 1.0, the seed's table).
        local_steps: DP-SGD steps per site per round. expected_batch_size: records per step in expectation.
        learning_rate: local SGD step; server_momentum: the coordinator's server SGD momentum (FedAvgM, Hsu et
            al. 2019; 0 = FedAvg; post-processing of the aggregate, so free under DP); clipping_norm: C;
            target_delta: delta of every guarantee. None (the default) for local_steps, expected_batch_size,
            learning_rate or server_momentum: the privacy mode's tuned value
            (:data:`DP_DEFAULTS`, :data:`GLOBAL_DP_DEFAULTS`, :data:`NON_PRIVATE_DEFAULTS`; tuned on seeds
            101-103, never on seed 0). Under DP each per-example gradient is clipped to C, so the step is about
            lr * C; without DP the raw mean gradient (norm ~30 on these embeddings) is used, hence the larger
            non-private lr.
        adapter_width: the head model's phi adapter width (1280 -> H, tanh); 0 (default, the better one in the
            tuning runs, docs/demo-data.md) trains the linear head psi alone on the frozen embeddings.
        round_deadline_s: seconds a round waits for all selected sites; None (the default): 300, or on
            intermittent links the model's covering deadline in real seconds (:mod:`wildfed_sim.demo_links`).
        round_duration_s: each reply leaves this long after its task (coordinator config, docs/privacy.md
            "Timing"); None (the default): 0, or on intermittent links 20 simulated minutes in real seconds.
        links: the gateways' link model (:mod:`wildfed_sim.link_models`): ``"always-on"`` (the default: no
            relay, as before), ``"satellite"``, ``"solar-night"`` or ``"cellular"``, played over the real broker
            (:mod:`wildfed_sim.demo_links`, :mod:`wildfed_sim.link_driver`). link_minute_s: real seconds per
            simulated minute of the link model.
        buffered: 0 (the default): synchronous rounds; K > 0: buffered rounds (FedBuff) that close at K updates,
            stale ones included (coordinator config ``buffered``; needs ``privacy="ccdp"``, the default then).
            max_staleness: the oldest stale update folded, in rounds.
        seed: data split, site design, model initialisation (privacy noise stays cryptographically random).
        broker: ``mqtt://host:port`` of a running broker, or None for the embedded one.
        models_by_digest: the coordinator's ``transfer.models_by_digest`` (default True: each round's model is
            retained once by digest and tasks name it); False: every task carries its model, for brokers that do not
            deliver retained messages on wildcard filters (RabbitMQ 3.10, docs/brokers.md).
        out_dir: run folder; default ``runs/demo-<UTC timestamp>``.
        centralised_epochs: also train the same model on the pooled training data for this many epochs
            (0 = skip) as the reference a federation is compared with.
        threads_per_site: torch threads of each gateway process.
        pretrain_epochs: before round 1, train the head model centrally (non-private) for this many epochs on the
            public split -- the training images that no site holds (:func:`public_split_indices`; about 3,600 of
            the 8,000 at K=8) -- and start the federation from those weights (DP transfer learning). 0 = start
            from the seeded random initialisation. pretrain_batch_size, pretrain_learning_rate: its SGD (the demo's
            lr 0.5 diverges at small batches; 64 / 0.1 reach ~50 % on the held-out split in 5 epochs at K=8).
        initial_weights_path: start the federation from these weights (a safetensors file of
            head-model arrays, ``shared.models.head``, e.g. written by :func:`save_weights`) instead; excludes
            ``pretrain_epochs``.
        public_per_class: 0 (default) = the public split is what no site holds (not class-balanced: the site
            design takes every image of some species). N > 0 = reserve N training images of every class as a
            class-balanced public split *before* the sites are designed on the rest
            (:func:`design_sites_with_public_split`; this changes the sites a little), and pretrain on it.
        strategy: ``"fedavg"`` (one global model) or ``"nira"`` (ecological clusters from the sites' public
            species lists, shared phi, one head per cluster: coordinator/strategies/nira.py). Both are evaluated
            per site (:func:`~wildfed_sim.evaluation.evaluate_sites`).
        nira_recluster_every: NIRA re-clusters from the sites' phi-updates every this many rounds (0 = never).
        nira_embedding_merging: NIRA species-embedding merging on/off.
        nira_distance_threshold: NIRA's Jaccard-distance cut of the species-list dendrogram (None = 0.7).
        feature_centre: give every gateway the mean backbone embedding of the public split (the training images
            no site holds, less duplicates of site images) as its ``feature_centre``
            (:mod:`shared.models.feature_centre`): local steps train on centred embeddings (Global DP: the
            coordinator is given the same file and the sites' gradients are centred). On by default
            (chosen by the tuning sweep, docs/demo-data.md "Tuning"); ``--no-feature-centre`` for the plain head.
    """

    sites: int = 8
    rounds: int = 10
    privacy: str | None = None
    gamma: float = 1.0
    ccdp_variant: str = "sample"
    global_noise: str = "distributed"
    tolerated_dropouts: int | None = None
    class_reweighting: float = 0.5
    posthoc_logit_adjustment: float | None = None
    anchor_category: str = "VU"
    anchor_epsilon: float = 1.0
    local_steps: int | None = None
    expected_batch_size: int | None = None
    learning_rate: float | None = None
    server_momentum: float | None = None
    clipping_norm: float = 1.0
    adapter_width: int = 0
    target_delta: float = 1e-5
    round_deadline_s: float | None = None
    round_duration_s: float | None = None
    seed: int = 0
    broker: str | None = None
    models_by_digest: bool = True
    out_dir: Path | None = None
    centralised_epochs: int = 0
    threads_per_site: int = 1
    pretrain_epochs: int = 0
    pretrain_batch_size: int = 64
    pretrain_learning_rate: float = 0.1
    initial_weights_path: Path | None = None
    public_per_class: int = 0
    strategy: str = "fedavg"
    nira_recluster_every: int = 0
    nira_embedding_merging: bool = True
    nira_distance_threshold: float | None = None
    feature_centre: bool = True
    links: str = "always-on"
    link_minute_s: float = 0.25
    buffered: int = 0
    max_staleness: int = 10

    def __post_init__(self) -> None:
        if self.privacy is None:  # Global DP with FedAvg; NIRA and buffered rounds need the sites' own updates
            object.__setattr__(self, "privacy", "ccdp" if self.strategy == "nira" or self.buffered else "global")
        check_link_settings(self)  # links, compression, round mode; the round's deadline and padding resolved
        # None: the tuned defaults of this privacy mode (DP_DEFAULTS / GLOBAL_DP_DEFAULTS / NON_PRIVATE_DEFAULTS)
        defaults = (NON_PRIVATE_DEFAULTS if self.privacy == "none"
                    else GLOBAL_DP_DEFAULTS if self.privacy == "global" else DP_DEFAULTS)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if not (0 <= self.server_momentum < 1):
            raise ConfigError(f"server_momentum must be in [0, 1), got {self.server_momentum}",
                              field="server_momentum", fix="use 0 (FedAvg) or e.g. 0.5")
        if type(self.adapter_width) is not int or self.adapter_width < 0:
            raise ConfigError(f"adapter_width must be an integer >= 0, got {self.adapter_width!r}",
                              field="adapter_width", fix="use 0 (head only) or e.g. 256")
        if self.sites < 2:
            raise ConfigError(f"sites must be >= 2, got {self.sites}", field="sites", fix="use --sites 8")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}", field="rounds", fix="use --rounds 10")
        if self.posthoc_logit_adjustment is None:
            object.__setattr__(self, "posthoc_logit_adjustment", 1.0 if self.strategy == "fedavg" else 0.0)
        if not (math.isfinite(self.posthoc_logit_adjustment) and 0.0 <= self.posthoc_logit_adjustment <= 4.0):
            raise ConfigError(f"posthoc_logit_adjustment must be in [0, 4], got {self.posthoc_logit_adjustment}",
                              field="posthoc_logit_adjustment", fix="use 1 (default) or 0 (off)")
        if self.posthoc_logit_adjustment > 0 and self.strategy != "fedavg":
            raise ConfigError("the logit adjustment is for one global head (strategy fedavg); NIRA keeps a head "
                              "per cluster", field="posthoc_logit_adjustment",
                              fix="use --posthoc-logit-adjustment 0 with --strategy nira")
        if not (0.0 <= self.class_reweighting <= 1.0):
            raise ConfigError(f"class_reweighting must be in [0, 1], got {self.class_reweighting}",
                              field="class_reweighting", fix="use 0 (off), 0.5 (default) or 1")
        if self.ccdp_variant not in ("sample", "scale"):
            raise ConfigError(f"ccdp_variant must be 'sample' or 'scale', got {self.ccdp_variant!r}",
                              field="ccdp_variant", fix="use --ccdp-variant sample or --ccdp-variant scale")
        if self.global_noise not in ("trusted-server", "distributed"):
            raise ConfigError(f"global_noise must be 'trusted-server' or 'distributed', got {self.global_noise!r}",
                              field="global_noise", fix="use --global-noise trusted-server or distributed")
        most = self.sites - (self.sites // 2 + 1)  # the threshold may not fall below the smallest majority
        if self.tolerated_dropouts is None:
            object.__setattr__(self, "tolerated_dropouts", min(1, most))
        if type(self.tolerated_dropouts) is not int or not 0 <= self.tolerated_dropouts <= most:
            raise ConfigError(f"must be an integer from 0 to {most} with {self.sites} sites "
                              f"(the secure-aggregation threshold, sites minus tolerated dropouts, must stay a "
                              f"majority), got {self.tolerated_dropouts!r}", field="tolerated_dropouts",
                              fix="use --tolerated-dropouts 1, or at most half the sites less one")
        if self.privacy not in ("ccdp", "global", "none"):
            raise ConfigError(f"privacy must be 'ccdp', 'global' or 'none', got {self.privacy!r}", field="privacy",
                              fix="use --privacy ccdp, --privacy global or --privacy none")
        if self.privacy == "global" and self.local_steps != 1:
            raise ConfigError(f"privacy 'global' runs one clipped-gradient step per round (the coordinator adds "
                              f"the noise to each round's secure sum), got local_steps={self.local_steps}",
                              field="local_steps", fix="use --local-steps 1 and more --rounds")
        if self.broker is not None and not self.broker.startswith("mqtt://"):
            raise ConfigError(f"broker {self.broker!r} is not an mqtt:// URL", field="broker",
                              fix="pass --broker mqtt://127.0.0.1:1883")
        # Everything that reaches the coordinator's config or the budget is checked here, before any data is
        # fetched or any process started.
        try:
            IUCNCategory(str(self.anchor_category).upper())
        except ValueError:
            raise ConfigError(f"{self.anchor_category!r} is not an IUCN category", field="anchor_category",
                              fix="use one of " + ", ".join(c.value for c in IUCNCategory)) from None
        positive = {"anchor_epsilon": (self.anchor_epsilon, "--anchor-epsilon 1.0"),
                    "learning_rate": (self.learning_rate, "--learning-rate 0.5"),
                    "clipping_norm": (self.clipping_norm, "--clipping-norm 1.0"),
                    "round_deadline_s": (self.round_deadline_s, "--round-deadline-s 300"),
                    "local_steps": (self.local_steps, "--local-steps 1"),
                    "expected_batch_size": (self.expected_batch_size, "--expected-batch-size 128")}
        for name, (value, example) in positive.items():
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be positive and finite, got {value}", field=name, fix=f"e.g. {example}")
        if not (self.gamma >= 0 and math.isfinite(self.gamma)):
            raise ConfigError(f"gamma must be >= 0, got {self.gamma}", field="gamma",
                              fix="use 1 (budgets linear in IUCN rank), 2, or 0 (uniform DP)")
        if not 0 < self.target_delta < 1:
            raise ConfigError(f"target_delta must be in (0, 1), got {self.target_delta}", field="target_delta",
                              fix="use a delta well below 1/records, e.g. 1e-5")
        if self.centralised_epochs < 0:
            raise ConfigError("centralised_epochs must be >= 0", field="centralised_epochs", fix="use 0 to skip")
        if self.pretrain_epochs < 0:
            raise ConfigError("pretrain_epochs must be >= 0", field="pretrain_epochs",
                              fix="use 0 to start from scratch")
        if self.pretrain_batch_size < 1 or not (self.pretrain_learning_rate > 0
                                                and math.isfinite(self.pretrain_learning_rate)):
            raise ConfigError("pretrain_batch_size must be >= 1 and pretrain_learning_rate positive",
                              field="pretrain_learning_rate", fix="use 64 and 0.1")
        if self.public_per_class < 0:
            raise ConfigError("public_per_class must be >= 0", field="public_per_class",
                              fix="use 0 (public split = images no site holds) or e.g. 100")
        if self.initial_weights_path is not None and self.pretrain_epochs > 0:
            raise ConfigError("initial_weights_path and pretrain_epochs exclude each other", field="pretrain_epochs",
                              fix="pass one of them")
        if self.strategy not in ("fedavg", "nira"):
            raise ConfigError(f"strategy must be 'fedavg' or 'nira', got {self.strategy!r}", field="strategy",
                              fix="use --strategy fedavg or --strategy nira")
        if self.strategy == "nira" and self.privacy == "global":
            raise ConfigError("strategy 'nira' needs each site's update, which secure aggregation (privacy "
                              "'global') hides", field="strategy", fix="use --privacy ccdp or none with nira")
        if self.nira_recluster_every < 0:
            raise ConfigError(f"nira_recluster_every must be >= 0, got {self.nira_recluster_every}",
                              field="nira_recluster_every", fix="use 0 (never re-cluster) or e.g. 3")
        if self.nira_distance_threshold is not None and not 0 < self.nira_distance_threshold <= 1:
            raise ConfigError(f"nira_distance_threshold must be in (0, 1], got {self.nira_distance_threshold}",
                              field="nira_distance_threshold", fix="use e.g. 0.7, or None for the default")


@dataclass
class DemoResult:
    """What a demo run produced: the run folder, per-round history and the final numbers."""

    run_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    final_accuracy: dict[str, float] = field(default_factory=dict)
    epsilon: dict[str, dict[str, float]] = field(default_factory=dict)
    centralised_accuracy: dict[str, float] | None = None
    rejections: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    pretraining: dict[str, Any] | None = None
    per_site: dict[str, Any] | None = None
    nira: dict[str, Any] | None = None
    final_accuracy_unadjusted: dict[str, float] | None = None
    prediction_offsets: list[float] | None = None
    final_models: dict[str, Any] | None = None
    links: dict[str, Any] | None = None


def privacy_label(settings: DemoSettings) -> str:
    """The privacy mode as the demo's header and table name it, e.g. ``privacy global (distributed noise)``."""
    if settings.privacy == "global":
        if settings.global_noise == "distributed":
            return (f"privacy global (distributed noise, threshold {secagg_threshold(settings)} of {settings.sites} "
                    f"sites)")
        return f"privacy global ({settings.global_noise} noise)"
    if settings.privacy == "ccdp":
        rw = settings.class_reweighting
        return f"privacy ccdp (local, {settings.ccdp_variant}, class re-weighting {rw:g})" if rw else \
            f"privacy ccdp (local, {settings.ccdp_variant})"
    return f"privacy {settings.privacy}"


def header_label(settings: DemoSettings) -> str:
    """The privacy label plus the logit adjustment when it is on (the demo's header and table title)."""
    tau = settings.posthoc_logit_adjustment
    return privacy_label(settings) + (f", logit adjustment tau {tau:g}" if tau else "")


def secagg_threshold(settings: DemoSettings) -> int:
    """Global DP's secure-aggregation threshold t of the demo: ``sites - tolerated_dropouts``, the fewest surviving
    sites whose shares open the round's sum (and carry its whole distributed noise); a majority by
    :class:`DemoSettings`' check (Bonawitz et al., CCS 2017, Section 4)."""
    return int(settings.sites) - int(settings.tolerated_dropouts)
