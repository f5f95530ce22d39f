"""The main job: a whole WildFed federation on one machine, on real images.

``wildfed demo`` (README's first command) runs, as separate processes:

- an MQTT broker: the embedded amqtt broker on a free loopback port, unless ``--broker mqtt://host:port`` names one;
- N gateway agents (``python -m edge_sdk.cli run``), one per site, each reading its own Camtrap DP package through
  the same loader a field gateway uses, training with CCDP and uploading signed updates;
- the coordinator (this process): registry, signed tasks, ingest, privacy ledger, streaming FedAvg.

With ``--links`` other than always-on, each gateway reaches the broker through its own link relay, cut outside the
link model's windows in compressed time once round 1 opens (:mod:`wildfed_sim.demo_links`); ``--buffered K`` runs
buffered rounds (FedBuff) instead of synchronous ones.

Data: Animal-MNIST (``animal-mnist==0.4``, 10,000 real 28x28 silhouettes, 10 classes), fetched and verified by
:mod:`wildfed_sim.animal_mnist`; a stratified held-out test split stays at the coordinator; the rest is
partitioned into sites by the ecological design of :mod:`wildfed_sim.ecology` (docs/demo-data.md) and
written as one Camtrap DP package per site.

Output (in the run folder): ``report.json`` (settings, per-round accuracy and epsilon, final table), ``report.png``
(accuracy and epsilon per round), ``logs/`` (broker and gateway logs), the sites' packages and configs, and the
coordinator's database, blobs and models.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key

from wildfed_sim.common.demo_data import demo_sites, public_images
from wildfed_sim.common.runs import new_run_dir, sigterm_unwinds
from wildfed_sim.demo_links import DemoLinks, check_link_settings, print_links_summary
from wildfed_sim.gateway_processes import spawned_gateways

__all__ = ["DP_DEFAULTS", "GLOBAL_DP_DEFAULTS", "NON_PRIVATE_DEFAULTS", "demo_embedding_cache", "DemoSettings",
           "DemoResult", "run_demo", "secagg_threshold", "pretrain_on_public_split", "load_weights", "save_weights"]


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


# ------------------------------------------------------------------------------------------ preparation
def _prepare_sites(settings: DemoSettings, run_dir: Path, console: Any) -> tuple[list[Any], Any, Any, Any]:
    """Fetch data, split, design sites, write each site's Camtrap DP package.

    Returns:
        (site specs, train split, held-out test split, design summary).
    """
    from wildfed_sim.camtrap_writer import write_camtrap_dp

    console.log("loading Animal-MNIST (animal-mnist==0.4; downloaded on first use, verified by SHA-256)")
    train, test, specs, summary = demo_sites(settings.seed, settings.sites, public_per_class=settings.public_per_class)
    sizes = [s.num_images for s in specs]
    console.log(f"{settings.sites} sites: sizes {min(sizes)}..{max(sizes)} distinct images "
                f"({sum(sizes)} in all; {summary.size_min}..{summary.size_max} as designed, before byte-identical "
                f"repeats were dropped), species-list Jaccard {summary.jaccard_min:.2f}..{summary.jaccard_max:.2f}, "
                f"held-out test {len(test)} images")
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    for k, spec in enumerate(specs):
        write_camtrap_dp(run_dir / "sites" / spec.site_id / "camtrap-dp", site=spec,
                         images=train.images[spec.indices], labels=train.labels[spec.indices],
                         source_indices=train.source_indices[spec.indices],
                         start_time=start - timedelta(days=30 * spec.monitoring_months), seed=settings.seed + k)
    return specs, train, test, summary


def _write_feature_centre(settings: DemoSettings, run_dir: Path, train: Any, specs: Any, console: Any) -> Path:
    """The gateways' public feature centre (:mod:`shared.models.feature_centre`): the mean embedding of the
    training images no site holds, less byte-duplicates of site images (:func:`public_split_indices`), written to
    ``<run>/public/feature-centre.safetensors``."""
    from shared.models.feature_centre import public_centre, save_feature_centre
    from wildfed_sim.embeddings import embed_grayscale

    public = public_images(train, specs, public_per_class=settings.public_per_class, seed=settings.seed)
    if len(public) == 0:
        raise ConfigError("every training image is held by a site: no public images for the feature centre",
                          field="feature_centre", fix="use --no-feature-centre or fewer sites")
    t0 = time.monotonic()
    centre = public_centre(embed_grayscale(train.images[public], train.source_indices[public]))
    path = save_feature_centre(run_dir / "public" / "feature-centre.safetensors", centre, num_images=len(public),
                               source="Animal-MNIST training images no demo site holds")
    console.log(f"feature centre: mean embedding of {len(public)} public images (no site holds them), "
                f"{time.monotonic() - t0:.1f} s")
    return path


def _write_site_config(settings: DemoSettings, run_dir: Path, spec: Any, federation_id: str,
                       broker_url: str, coordinator_pub: Path, feature_centre: Path | None = None
                       ) -> tuple[Path, str]:
    """Keys and YAML config of one gateway; returns (config path, public key PEM)."""
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    site_dir = run_dir / "sites" / spec.site_id
    key = generate_signing_key()
    save_private_key(key, site_dir / "keys" / "site.key")
    save_public_key(key.public_key(), site_dir / "keys" / "site.pub")
    config = {
        "federation_id": federation_id,
        "site_id": spec.site_id,
        "dataset": "camtrap-dp",
        # The site's species table: the species it monitors. Its IUCN categories are the ones it noises.
        "species": [{"scientific_name": SPECIES_TABLE[c].scientific_name, "class_index": c,
                     "iucn_category": SPECIES_TABLE[c].iucn.value} for c in spec.species],
        "num_classes": len(SPECIES_TABLE),
        # every class of the federation's model by name (public), so detect names species the site does not list
        "class_names": {c: SPECIES_TABLE[c].scientific_name for c in range(len(SPECIES_TABLE))},
        "private_key": "keys/site.key",
        "coordinator_public_key": str(coordinator_pub),
        "broker_url": broker_url,
        "outbox": "state/outbox.sqlite",
        "backend": "torch",
        # the 28x28 silhouettes are embedded by Lite0 at 128 px (measured on Animal-MNIST: shared.models.backbone);
        # set here, not left to the site config's defaults, which are chosen for real camera-trap photos
        "backbone": "efficientnet-lite0",
        "embedding_input_size": 128,
        # backbone embeddings cached outside the run folder: a second demo of the same seed embeds nothing
        "embedding_cache": str(demo_embedding_cache(spec.site_id)),
        "threads": settings.threads_per_site,
        "allow_non_private": settings.privacy == "none",
        "allow_global_dp": settings.privacy == "global",
    }
    if feature_centre is not None:  # public: computed from images no site holds
        config["feature_centre"] = str(feature_centre)
    path = site_dir / "site.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, public_key_to_pem(key.public_key())


def _privacy_label(settings: DemoSettings) -> str:
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


def _header_label(settings: DemoSettings) -> str:
    """The privacy label plus the logit adjustment when it is on (the demo's header and table title)."""
    tau = settings.posthoc_logit_adjustment
    return _privacy_label(settings) + (f", logit adjustment tau {tau:g}" if tau else "")


# ------------------------------------------------------------------------------------------ public pretraining
def pretrain_on_public_split(train: Any, specs: Any, *, epochs: int, batch_size: int, learning_rate: float,
                             seed: int, public_per_class: int = 0, adapter_width: int = 0
                             ) -> tuple[dict[str, np.ndarray], int]:
    """Non-private central SGD of the head model (``adapter_width``; phi and psi) on the backbone embeddings of
    the public split, from its seeded initial weights: :func:`balanced_public_split` when ``public_per_class > 0`` (the
    sites must come from :func:`design_sites_with_public_split` with the same value), else
    :func:`public_split_indices`. Returns (weights, number of public images)."""
    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.evaluation import train_centralised

    public = public_images(train, specs, public_per_class=public_per_class, seed=seed)
    if len(public) == 0:
        raise ConfigError("every training image is held by a site: there is no public split to pretrain on",
                          field="pretrain_epochs", fix="use --pretrain-epochs 0 or fewer sites")
    from wildfed_sim.embeddings import embed_grayscale

    features = embed_grayscale(train.images[public], train.source_indices[public])
    weights = train_centralised(features, train.labels[public], num_classes=len(SPECIES_TABLE),
                                epochs=epochs, batch_size=batch_size, learning_rate=learning_rate, seed=seed,
                                adapter_width=adapter_width)
    return weights, int(len(public))


def save_weights(weights: Any, path: Path) -> Path:
    """Write head-model weights as safetensors (float32)."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}, str(path))
    return path


def load_weights(path: Path) -> dict[str, np.ndarray]:
    """Read head-model weights written by :func:`save_weights` (no pickle)."""
    from safetensors.numpy import load_file

    if not Path(path).is_file():
        raise ConfigError(f"initial weights file {path} not found", field="initial_weights_path",
                          fix="pass a safetensors file written by save_weights")
    return {k: np.asarray(v, dtype=np.float32) for k, v in load_file(str(path)).items()}


# ------------------------------------------------------------------------------------------ strategies
def secagg_threshold(settings: DemoSettings) -> int:
    """Global DP's secure-aggregation threshold t of the demo: ``sites - tolerated_dropouts``, the fewest surviving
    sites whose shares open the round's sum (and carry its whole distributed noise); a majority by
    :class:`DemoSettings`' check (Bonawitz et al., CCS 2017, Section 4)."""
    return int(settings.sites) - int(settings.tolerated_dropouts)


def _strategy_config(settings: DemoSettings) -> dict[str, Any]:
    """The coordinator config's ``strategy`` block for the demo's settings."""
    if settings.strategy == "fedavg":
        return {"kind": "fedavg"}
    return {"kind": "nira", "distance_threshold": settings.nira_distance_threshold,
            "recluster_every": settings.nira_recluster_every,
            "embedding_merging": settings.nira_embedding_merging}


def _nira_state(coordinator: Any) -> dict[str, Any]:
    """NIRA's clusters (``{label: [sites]}``) and its logged cluster changes."""
    strategy = coordinator.rounds._strategy  # the demo's own coordinator; the strategy NIRA built from config
    assignment = strategy.assignment()
    return {"clusters": {k: list(v) for k, v in (assignment.clusters.items() if assignment else ())},
            "changes": list(strategy.state().get("changes", []))}


def _evaluate_model(settings: DemoSettings, coordinator: Any, bundle: Any, specs: Any, train: Any, test: Any,
                    class_categories: Any, test_features: np.ndarray) -> tuple[Any, dict[str, Any]]:
    """Held-out evaluation of the stored model on ``test_features``, the backbone embeddings of the held-out
    test split (float32 (N, 1280), embedded once and cached: :func:`wildfed_sim.embeddings.embed_grayscale`).

    Per site (both strategies): the model the site receives (``strategy.site_weights``) on the test images of the
    classes it holds (:func:`~wildfed_sim.evaluation.evaluate_sites`). By IUCN group: FedAvg's global
    model on the whole held-out split (unchanged); NIRA has no single global model, so its groups pool every
    site's predictions on the test images of that site's classes (a test image counts once per site holding
    its class). Returns (Accuracy, ``{"summary": ..., "sites": [...]}``).
    """
    from wildfed_sim.evaluation import (accuracy_from_predictions, evaluate, evaluate_sites,
                                                    summarise_sites)

    strategy = coordinator.rounds._strategy
    site_models = {s.site_id: strategy.site_weights(bundle, s.site_id) for s in specs}
    site_counts = {s.site_id: {int(c): int(n) for c, n in zip(*np.unique(train.labels[s.indices], return_counts=True))}
                   for s in specs}
    per_site = evaluate_sites(site_models, site_counts, test_features, test.labels, len(class_categories))
    sites = [acc for acc, _ in per_site.values()]
    details = {"summary": summarise_sites(sites), "sites": [a.to_json() for a in sites]}
    if settings.strategy == "fedavg":
        return evaluate(bundle, test_features, test.labels, class_categories), details
    preds, labels = [], []
    for acc, predictions in per_site.values():
        mask = np.isin(test.labels, acc.species)
        preds.append(predictions[mask])
        labels.append(test.labels[mask])
    return accuracy_from_predictions(np.concatenate(preds), np.concatenate(labels), class_categories), details


def _served_and_trained(coordinator: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the model as served, logit-adjusted when the coordinator is configured so; the same model as trained),
    from one read of the current global model."""
    _, trained = coordinator.rounds.current_model()
    return coordinator.rounds.served_model(trained), trained


# ------------------------------------------------------------------------------------------ reporting
def _epsilon_by_category(coordinator: Any) -> dict[str, dict[str, float]]:
    """Per IUCN category: the largest spend over sites (the worst-off record's epsilon) and the budget."""
    out: dict[str, dict[str, float]] = {}
    for row in coordinator.budget_rows():
        entry = out.setdefault(row.category.value, {"spent_max": 0.0, "budget": row.budget, "halted_sites": 0})
        entry["spent_max"] = max(entry["spent_max"], row.spent)
        entry["halted_sites"] += int(row.halted)
    return out


def _plot(history: list[dict[str, Any]], budgets: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for group, style in (("overall", "-o"), ("CR/EN", "-s"), ("LC", "-^")):
        ax1.plot(rounds, [100 * h["accuracy"][group] for h in history], style, label=group)
    ax1.set_xlabel("round")
    ax1.set_ylabel("held-out test accuracy (%)")
    ax1.set_title("Accuracy of the global model")
    ax1.grid(alpha=0.3)
    ax1.legend()
    colours = plt.get_cmap("viridis")
    for i, cat in enumerate(c.value for c in IUCNCategory):
        colour = colours(i / 5)
        ax2.plot(rounds, [h["epsilon"].get(cat, {}).get("spent_max", 0.0) for h in history], "-o",
                 color=colour, label=cat)
        if cat in budgets:
            ax2.axhline(budgets[cat], color=colour, linestyle="--", linewidth=0.8)
    ax2.set_xlabel("round")
    ax2.set_ylabel("epsilon spent (max over sites; dashed: budget)")
    ax2.set_title("Privacy ledger (RDP, delta per config)")
    ax2.grid(alpha=0.3)
    ax2.legend(ncol=2, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the run
def run_demo(settings: DemoSettings, *, console: Any = None) -> DemoResult:
    """Run the whole federation described in the module docstring.

    SIGTERM and Ctrl-C stop the broker and every gateway before the exception propagates.

    Raises:
        ConfigError: bad settings. WildFedError: a gateway failed to start, or the data could not be fetched.
        KeyboardInterrupt: interrupted (after clean-up).
    """
    with sigterm_unwinds():
        return _run_demo(settings, console=console)


def _run_demo(settings: DemoSettings, *, console: Any = None) -> DemoResult:
    """The demo's steps in order (the order of the seeded draws and of the processes' starts is the demo's)."""
    from rich.console import Console

    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.embeddings import embed_grayscale

    console = console or Console()
    t0 = time.monotonic()
    run_dir = _open_run_dir(settings, console)
    specs, train, test, design = _prepare_sites(settings, run_dir, console)

    class_categories = [e.iucn for e in SPECIES_TABLE]
    held = {SPECIES_TABLE[int(c)].iucn for spec in specs for c in spec.species}  # categories of the sites' tables
    # the gateways read the feature centre when they start: written first, the coordinator's own preparation
    # (held-out embeddings, pretraining, its database) then runs while they start
    centre_path = _write_feature_centre(settings, run_dir, train, specs, console) if settings.feature_centre else None
    # One federation id per run: two demos on one broker (--broker) must not see each other's topics (a shared id
    # made them exchange updates that the signature checks then rejected).
    federation_id = f"wildfed-demo-{secrets.token_hex(4)}"
    coord_dir = run_dir / "coordinator"
    coordinator_pub = _coordinator_keys(coord_dir)
    budget = _budget(settings)

    result = DemoResult(run_dir=run_dir)
    with ExitStack() as stack:
        broker_url = _start_broker(settings, stack, run_dir, console)
        links = stack.enter_context(DemoLinks(settings, broker_url, len(specs)))  # a relay per gateway, or none
        site_configs, site_pems = [], []
        for k, spec in enumerate(specs):
            path, pem = _write_site_config(settings, run_dir, spec, federation_id, links.site_url(k),
                                           coordinator_pub, centre_path)
            site_configs.append(path)
            site_pems.append(pem)
        # Start the gateways now: each spends seconds importing, loading and embedding its data and connecting,
        # which overlaps the coordinator's preparation below. They only subscribe until the first task, so nothing
        # they do depends on it (the results are those of starting them last).
        gateways = stack.enter_context(spawned_gateways(site_configs, run_dir / "logs", run_dir / "ready"))
        console.log(f"started {len(site_configs)} gateway agents")

        t_embed = time.monotonic()
        # the coordinator's held-out evaluation set, embedded once by the frozen backbone (cached for later runs)
        test_features = embed_grayscale(test.images, test.source_indices)
        console.log(f"held-out test split: {len(test)} backbone embeddings ({time.monotonic() - t_embed:.1f} s)")
        start_weights = _start_weights(settings, result, train, specs, test, test_features, class_categories,
                                       console)
        config = _coordinator_config(settings, run_dir, coord_dir, federation_id, broker_url, coordinator_pub,
                                     centre_path, budget, links.coordinator_section())
        coordinator = _start_coordinator(stack, config, start_weights, gateways, specs, site_pems, run_dir, console)

        console.log("waiting for the gateways to connect (each imports its libraries, loads its Camtrap DP "
                    "package and embeds its images; about a minute, longer on a first run or a busy machine)")
        gateways.wait_ready(console)
        budgets = config.budgets()
        links.start(stack, gateways.procs)  # minute 0 of the link schedules: round 1 opens now
        _run_rounds(settings, coordinator, result, specs, train, test, test_features, class_categories, held,
                    console)
        links.stop()  # every link up: the final models reach every gateway
        final_weights = _final_results(settings, coordinator, result, specs, train, test, test_features,
                                       class_categories)
        # while broker, coordinator and gateways still run: detections on real photos (wildfed_sim.detections)
        end_of_demo_detections(run_dir=run_dir, specs=specs, site_configs=site_configs, coordinator=coordinator,
                               weights=final_weights, model_round=len(result.history), console=console)
        from wildfed_sim.fleet_check import wait_for_final_models

        result.final_models = wait_for_final_models(coordinator, console=console)  # released, kept, reported
        result.links = links.summary(coordinator.store, result.history, [s.site_id for s in specs])

    _centralised_reference(settings, result, specs, train, test, test_features, class_categories, console)
    result.elapsed_s = time.monotonic() - t0
    _print_summary(settings, result, budgets, held, console)
    _write_report(settings, result, design, specs, budgets, run_dir, console)
    _print_web_commands(coord_dir, console)
    return result


def _open_run_dir(settings: DemoSettings, console: Any) -> Path:
    """The run folder (new and empty) with its ``logs`` and ``ready`` folders; the run's header printed."""
    run_dir = new_run_dir(settings.out_dir, "demo")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").mkdir(parents=True, exist_ok=True)
    console.rule(f"WildFed demo: {settings.sites} sites, {settings.rounds} round{'s' * (settings.rounds != 1)}, "
                 f"{_header_label(settings)}, strategy {settings.strategy}")
    console.log(f"run folder {run_dir}")
    return run_dir


def _coordinator_keys(coord_dir: Path) -> Path:
    """A fresh coordinator signing key under ``coord_dir/keys``; returns the public key's path."""
    coord_key = generate_signing_key()
    save_private_key(coord_key, coord_dir / "keys" / "coordinator.key")
    return save_public_key(coord_key.public_key(), coord_dir / "keys" / "coordinator.pub")


def _start_broker(settings: DemoSettings, stack: ExitStack, run_dir: Path, console: Any) -> str:
    """The broker's URL: ``settings.broker``, else an embedded amqtt broker that ``stack`` stops."""
    from wildfed_sim.embedded_broker import embedded_broker

    broker_url = settings.broker
    if broker_url is None:
        broker_url = stack.enter_context(embedded_broker(log_path=run_dir / "logs" / "broker.log"))
        console.log(f"embedded MQTT broker (amqtt) at {broker_url}")
    else:
        console.log(f"using MQTT broker {broker_url}")
    return broker_url


def _start_weights(settings: DemoSettings, result: DemoResult, train: Any, specs: Any, test: Any,
                   test_features: np.ndarray, class_categories: list[IUCNCategory], console: Any) -> Any:
    """The federation's round-0 weights: loaded (``initial_weights_path``), pretrained on the public split
    (``pretrain_epochs``), or None (the coordinator's seeded initial model); recorded in ``result.pretraining``."""
    from wildfed_sim.evaluation import evaluate

    start_weights = None
    if settings.initial_weights_path is not None:
        start_weights = load_weights(Path(settings.initial_weights_path))
        result.pretraining = {"source": str(settings.initial_weights_path)}
        console.log(f"starting the federation from {settings.initial_weights_path}")
    elif settings.pretrain_epochs > 0:
        start_weights, n_public = pretrain_on_public_split(
            train, specs, epochs=settings.pretrain_epochs, batch_size=settings.pretrain_batch_size,
            learning_rate=settings.pretrain_learning_rate, seed=settings.seed,
            public_per_class=settings.public_per_class, adapter_width=settings.adapter_width)
        result.pretraining = {"source": "public split (training images no site holds)", "num_images": n_public,
                              "epochs": settings.pretrain_epochs}
        console.log(f"pretrained on the public split ({n_public} training images no site holds), "
                    f"{settings.pretrain_epochs} epochs, non-private")
    if start_weights is not None:
        pre = evaluate(start_weights, test_features, test.labels, class_categories)
        result.pretraining["accuracy"] = dict(pre.by_group)
        console.log(f"round-0 model: {100 * pre.by_group['overall']:.1f}% overall on the held-out test split")
    return start_weights


def _budget(settings: DemoSettings) -> Any:
    """The federation's CCDP budget, anchored as the settings say (coordinator.config_privacy.BudgetFromAnchor)."""
    from coordinator.config_privacy import BudgetFromAnchor

    return BudgetFromAnchor(category=IUCNCategory(settings.anchor_category), epsilon=settings.anchor_epsilon,
                            gamma=settings.gamma)


def _coordinator_config(settings: DemoSettings, run_dir: Path, coord_dir: Path, federation_id: str, broker_url: str,
                        coordinator_pub: Path, centre_path: Path | None, budget: Any,
                        round_mode: dict[str, Any]) -> Any:
    """The coordinator's resolved config for this run, also saved as ``coordinator.yaml`` in ``coord_dir`` (so that
    the operator commands work on a finished demo); ``round_mode``: ``{"buffered": {...}}`` or empty."""
    from coordinator.config import config_from_dict, save_config
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    config = config_from_dict({
        "federation_id": federation_id, "data_dir": str(coord_dir), "broker_url": broker_url,
        "signing_key_path": str(coord_dir / "keys" / "coordinator.key"),
        "public_key_path": str(coordinator_pub), "rounds": settings.rounds,
        "round_deadline_s": settings.round_deadline_s, "round_duration_s": settings.round_duration_s,
        "local_steps": settings.local_steps,
        "expected_batch_size": settings.expected_batch_size, "learning_rate": settings.learning_rate,
        "clipping_norm": settings.clipping_norm, "target_delta": settings.target_delta,
        "privacy": settings.privacy, "ccdp_variant": settings.ccdp_variant, "global_noise": settings.global_noise,
        "class_reweighting": settings.class_reweighting if settings.privacy == "ccdp" else 0.0,
        "posthoc_logit_adjustment": settings.posthoc_logit_adjustment,
        "budget": budget.model_dump(), "num_classes": len(SPECIES_TABLE),
        "model": "head", "adapter_width": settings.adapter_width,
        # Global DP: the sites take centred gradients, the coordinator folds the noisy sum with the same file
        **({"feature_centre": str(centre_path)} if settings.privacy == "global" and centre_path else {}),
        "server_optimizer": {"kind": "sgd", "momentum": settings.server_momentum},
        **({"secagg": {"threshold": secagg_threshold(settings)}} if settings.privacy == "global" else {}),
        "seed": settings.seed, "strategy": _strategy_config(settings),
        "transfer": {"models_by_digest": settings.models_by_digest},
        "species": [{"scientific_name": e.scientific_name, "class_index": c, "iucn_category": e.iucn.value}
                    for c, e in enumerate(SPECIES_TABLE)], **round_mode}).resolved(run_dir)
    # the operator commands (status, budget, clusters show) work on a finished demo with --config this file
    save_config(config, coord_dir / "coordinator.yaml")
    return config


def _start_coordinator(stack: ExitStack, config: Any, start_weights: Any, gateways: Any, specs: Any,
                       site_pems: list[Any], run_dir: Path, console: Any) -> Any:
    """The coordinator, entered on ``stack`` (the gateways stop before it closes), with every site enrolled (public
    key and public metadata, CR/EN species left out) and the sites' deployments imported for the web view."""
    from coordinator.service import Coordinator
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    coordinator = stack.enter_context(Coordinator(config, initial_weights=start_weights))
    stack.callback(gateways.stop)  # on the way out the gateways stop before the coordinator closes, as before
    for spec, pem in zip(specs, site_pems):
        public_species = [SPECIES_TABLE[c].scientific_name for c in spec.species
                          if not SPECIES_TABLE[c].iucn.is_sensitive]
        coordinator.enrol(spec.site_id, pem, {"capacity": spec.num_images, "biome": spec.biome,
                                              "species": public_species,
                                              "monitoring_months": spec.monitoring_months})
    console.log(f"enrolled {len(specs)} sites (public keys + public metadata; CR/EN species left out)")
    _import_demo_deployments(coordinator.store, run_dir, specs, config, console)
    return coordinator


def _run_rounds(settings: DemoSettings, coordinator: Any, result: DemoResult, specs: Any, train: Any, test: Any,
                test_features: np.ndarray, class_categories: list[IUCNCategory], held: set[IUCNCategory],
                console: Any) -> None:
    """Every round of the federation, each evaluated as it closes and appended to ``result.history``, with a
    progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from wildfed_sim.evaluation import evaluate

    columns = (TextColumn("[bold]round {task.completed}/{task.total}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("rounds", total=settings.rounds, info="training...")
        closed_at = None  # monotonic time the previous round's result came back (just after its close)
        for round_result in coordinator.iter_rounds():
            got_at = time.monotonic()
            # the gap: from the previous round's close to this round's last task published (the sites idle)
            gap_s = (None if closed_at is None
                     else got_at - round_result.duration_s + round_result.open_s - closed_at)
            weights, trained = _served_and_trained(coordinator)  # as served: logit-adjusted when configured
            acc, sites_eval = _evaluate_model(settings, coordinator, weights, specs, train, test,
                                              class_categories, test_features)
            unadjusted = (evaluate(trained, test_features, test.labels, class_categories)
                          if settings.posthoc_logit_adjustment else None)
            eps = _epsilon_by_category(coordinator)
            entry = {"round": round_result.round, "status": round_result.status,
                     "selected": list(round_result.selected), "accepted": list(round_result.accepted),
                     "duration_s": round_result.duration_s, "accuracy": dict(acc.by_group), "epsilon": eps,
                     "per_site": sites_eval["summary"], "gap_s": gap_s,
                     "open_s": round_result.open_s, "stale": list(round_result.stale)}
            if unadjusted is not None:
                entry["accuracy_unadjusted"] = dict(unadjusted.by_group)
            if settings.strategy == "nira":
                entry["clusters"] = _nira_state(coordinator)["clusters"]
            result.history.append(entry)
            info = (f"{len(round_result.accepted)}/{len(round_result.selected)} sites"
                    f"{f' + {len(round_result.stale)} stale' if round_result.stale else ''}, "
                    f"acc {100 * acc.by_group['overall']:.1f}% (CR/EN {100 * acc.by_group['CR/EN']:.1f}%)")
            if not round_result.selected:  # a buffered run's last round: no task, it folds what came late
                progress.update(task, total=round_result.round)
            if settings.privacy != "none" and IUCNCategory.CR in held:
                info += f", eps CR {eps['CR']['spent_max']:.2f}/{eps['CR']['budget']:.2f}"
            progress.update(task, advance=1, info=info)
            closed_at = got_at


def _final_results(settings: DemoSettings, coordinator: Any, result: DemoResult, specs: Any, train: Any, test: Any,
                   test_features: np.ndarray, class_categories: list[IUCNCategory]) -> Any:
    """The final model's accuracy, epsilon and rejections into ``result``; returns the final (served) weights."""
    from wildfed_sim.evaluation import evaluate

    status = coordinator.status()
    result.rejections = dict(status.rejections)
    result.epsilon = _epsilon_by_category(coordinator)
    final_weights, trained = _served_and_trained(coordinator)
    final, final_sites = _evaluate_model(settings, coordinator, final_weights, specs, train, test,
                                         class_categories, test_features)
    result.final_accuracy = {**final.by_group, **{c.value: v for c, v in final.by_category.items()}}
    if settings.posthoc_logit_adjustment:
        plain = evaluate(trained, test_features, test.labels, class_categories)
        result.final_accuracy_unadjusted = {**plain.by_group,
                                            **{c.value: v for c, v in plain.by_category.items()}}
        result.prediction_offsets = list(coordinator.rounds.prediction_offsets() or ())
    result.per_site = final_sites
    if settings.strategy == "nira":
        result.nira = _nira_state(coordinator)
    return final_weights


def _centralised_reference(settings: DemoSettings, result: DemoResult, specs: Any, train: Any, test: Any,
                           test_features: np.ndarray, class_categories: list[IUCNCategory], console: Any) -> None:
    """With ``centralised_epochs``: the same head trained on the sites' pooled data, non-privately, into
    ``result.centralised_accuracy``."""
    if settings.centralised_epochs <= 0:
        return
    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.embeddings import embed_grayscale
    from wildfed_sim.evaluation import evaluate, train_centralised

    console.log(f"centralised reference: {settings.centralised_epochs} epochs on the pooled training data")
    used = np.concatenate([s.indices for s in specs])
    weights = train_centralised(embed_grayscale(train.images[used], train.source_indices[used]),
                                train.labels[used], num_classes=len(SPECIES_TABLE),
                                epochs=settings.centralised_epochs, batch_size=settings.expected_batch_size,
                                learning_rate=NON_PRIVATE_DEFAULTS["learning_rate"], seed=settings.seed,
                                adapter_width=settings.adapter_width)
    result.centralised_accuracy = dict(evaluate(weights, test_features, test.labels, class_categories).by_group)


def _print_summary(settings: DemoSettings, result: DemoResult, budgets: Any, held: set[IUCNCategory],
                   console: Any) -> None:
    """The final table (accuracy and epsilon per IUCN category), the rejections and the gaps between rounds."""
    from rich.table import Table

    table = Table(title=f"WildFed demo: {settings.sites} sites, {len(result.history)} "
                        f"round{'s' * (len(result.history) != 1)}, {_header_label(settings)}, "
                        f"strategy {settings.strategy}"
                        + (" (accuracy: each site's own model on the classes it holds, pooled; per-site macro "
                           "accuracy and the clusters are in report.json)" if settings.strategy == "nira" else ""))
    table.add_column("IUCN category")
    table.add_column("test accuracy", justify="right")
    table.add_column("epsilon spent (max over sites)", justify="right")
    table.add_column("budget", justify="right")
    for cat in IUCNCategory:
        e = result.epsilon.get(cat.value, {"spent_max": 0.0, "budget": budgets[cat]})
        spent = (("- (no DP)" if settings.privacy == "none" else f"{e['spent_max']:.3f}") if cat in held
                 else "- (no site holds it)")
        acc = result.final_accuracy.get(cat.value, math.nan)
        table.add_row(cat.value, "n/a" if math.isnan(acc) else f"{100 * acc:.1f}%", spent,
                      f"{budgets[cat]:.2f}" if settings.privacy != "none" else "-")
    for group in ("overall", "CR/EN", "VU/NT"):
        table.add_row(f"[bold]{group}", f"[bold]{100 * result.final_accuracy[group]:.1f}%", "", "")
    if result.final_accuracy_unadjusted:
        table.add_row("overall as trained", f"{100 * result.final_accuracy_unadjusted['overall']:.1f}%", "", "")
    if result.centralised_accuracy:
        table.add_row("centralised (pooled, non-private)", f"{100 * result.centralised_accuracy['overall']:.1f}%",
                      "", "")
    console.print(table)
    if result.final_accuracy_unadjusted:
        console.log(f"accuracy is the served model's: the head's logits less tau log(prior), tau "
                    f"{settings.posthoc_logit_adjustment:g}, the prior from the sites' public metadata (no privacy "
                    f"cost); 'overall as trained' is the same model without it")
    console.log(f"rejected updates by reason: {result.rejections or 'none'}")
    print_links_summary(result.links, console)
    gaps = [h["gap_s"] for h in result.history if h.get("gap_s") is not None]
    if gaps:
        console.log(f"gaps between rounds (from the end of one round until every task of the next is sent, this "
                    f"demo's evaluation of each round included): median {statistics.median(gaps):.2f} s, "
                    f"max {max(gaps):.2f} s")


def _write_report(settings: DemoSettings, result: DemoResult, design: Any, specs: Any, budgets: Any, run_dir: Path,
                  console: Any) -> None:
    """``report.json`` (settings, sites, per-round history, final table) and ``report.png`` in the run folder."""
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.__dict__.items()},
        "design": dataclasses.asdict(design),
        "sites": [{"site_id": s.site_id, "biome": s.biome, "num_images": s.num_images,
                   "species": list(s.species_names()), "monitoring_months": s.monitoring_months} for s in specs],
        "history": result.history, "final_accuracy": result.final_accuracy, "epsilon": result.epsilon,
        "centralised_accuracy": result.centralised_accuracy, "rejections": result.rejections,
        "pretraining": result.pretraining, "elapsed_s": result.elapsed_s,
        "strategy": settings.strategy, "per_site": result.per_site, "nira": result.nira,
        "final_accuracy_unadjusted": result.final_accuracy_unadjusted,
        "prediction_offsets": result.prediction_offsets, "final_models": result.final_models,
        "links": result.links,
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, default=float))
    _plot(result.history, {c.value: b for c, b in budgets.items()} if settings.privacy != "none" else {},
          run_dir / "report.png", f"WildFed demo, {settings.sites} sites, privacy {settings.privacy}")
    console.log(f"report: {run_dir / 'report.json'}, plot: {run_dir / 'report.png'} "
                f"({result.elapsed_s:.0f} s in all)")


def _print_web_commands(coord_dir: Path, console: Any) -> None:
    """The two commands that open this run's web view (one per line, never wrapped, so each copies whole)."""
    import shlex

    coord_yaml = shlex.quote(str(coord_dir / "coordinator.yaml"))
    # the operator's commands of this run are wildfed-coordinator's: the one beside this `wildfed`, when known
    here = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    exe = shlex.quote(str(here.with_name("wildfed-coordinator")) if here is not None and here.name == "wildfed"
                      else "wildfed-coordinator")
    console.log("web view of this run (map of the sites' deployments, budgets, rounds): make an account, serve, "
                "then open http://127.0.0.1:8080/")
    # one command per line, never wrapped, so that each can be copied whole
    console.print(f"{exe} user add me --role operator --config {coord_yaml}", soft_wrap=True, markup=False,
                  highlight=False)
    console.print(f"{exe} serve --config {coord_yaml}", soft_wrap=True, markup=False, highlight=False)


def end_of_demo_detections(*, run_dir: Path, specs: Any, site_configs: list[Path], coordinator: Any,
                           weights: dict[str, np.ndarray], model_round: int, console: Any) -> None:
    """The demo's call point for the end-of-demo detections on real camera-trap photos (docs/inference.md), run
    while broker, coordinator and gateways are still up: ``wildfed_sim.detections.run_demo_detections`` (another
    change's module) with each site's model (``strategy.site_weights``), output under ``<run_dir>/detections``.
    Where that module or function is not present, the demo logs that no detections ran."""
    import importlib.util

    spec = importlib.util.find_spec("wildfed_sim.detections")
    module = importlib.import_module("wildfed_sim.detections") if spec is not None else None
    run = getattr(module, "run_demo_detections", None)
    if run is None:
        console.log("end-of-demo detections: wildfed_sim.detections.run_demo_detections is absent; none ran")
        return
    strategy = coordinator.rounds._strategy
    run(coordinator=coordinator, site_configs=site_configs, out_dir=run_dir / "detections",
        weights_for_site=lambda site_id: strategy.site_weights(weights, site_id), model_round=model_round,
        console=console)


def _import_demo_deployments(store: Any, run_dir: Path, specs: Any, config: Any, console: Any) -> None:
    """Put every demo site's deployments (the fictional but plausible coordinates of its Camtrap DP package,
    wildfed_sim.ecology) on the web view's map: coordinates only. The package's observations are the site's
    training records, whose species and IUCN categories per deployment (and the fuzzing a CR/EN/VU record earns its
    place) no DP noise covers; the map takes species only from the detection records the sites publish."""
    from coordinator.web.deployments import import_camtrap_dp, species_table_categories

    category_of = species_table_categories(config.species)
    n = sum(import_camtrap_dp(store, run_dir / "sites" / spec.site_id / "camtrap-dp", category_of,
                              site_id=spec.site_id, species=False) for spec in specs)
    console.log(f"{n} deployments on the web view's map (wildfed-coordinator serve): coordinates only; species "
                "come from the sites' detection records")
