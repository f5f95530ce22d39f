"""What the coordinator trains and how: the strategy (``strategy:``), the server optimiser (``server_optimizer:``),
the species table (``species:``), the radio-map settings (``radio:``) and buffered rounds (``buffered:``).

Parts of :class:`coordinator.config.CoordinatorConfig`; the cross-field rules live there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from shared.config import StrictModel
from shared.iucn import IUCNCategory

__all__ = ["FedAvgConfig", "NiraConfig", "Strategy", "ServerSGDConfig", "FedSOFIMConfig", "FedAdamConfig",
           "ServerOptimizerConfig", "SpeciesEntry", "RadioConfig", "BufferedConfig"]


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


class BufferedConfig(StrictModel):
    """Buffered rounds (FedBuff, Nguyen et al. 2022; docs/transport.md "Buffered rounds"): a round closes once
    ``buffer_size`` updates are in (its own, and stale ones: trained for an earlier round, at most ``max_staleness``
    rounds old when they arrive), or at ``round_deadline_s`` with whatever came (at least one). A stale update t
    rounds old is weighted by s(t) (``staleness``: polynomial (1 + t)^-exponent, FedBuff's 1/sqrt(1 + t) at 0.5;
    hinge 1 for t <= knee, else 1 / (exponent (t - knee) + 1); constant 1). ``normalisation``: ``fixed`` divides the
    weighted sum by buffer_size times the sites' mean declared capacity (the fixed-denominator estimator; the one
    measured in docs/results/fedbuff.md), ``examples`` by the buffer's summed capacities (FedAvg's weights)."""

    buffer_size: int = Field(4, ge=1, description="K: updates that close a round (its own and stale ones)")
    max_staleness: int = Field(10, ge=0, description="an update more rounds old than this when it arrives is refused "
                               "(charged: the coordinator has seen it) and gateways do not train such a task")
    staleness: Literal["polynomial", "hinge", "constant"] = "polynomial"
    exponent: float = Field(0.5, ge=0, le=100, description="polynomial: a in (1 + t)^-a; hinge: the slope")
    knee: int = Field(0, ge=0, description="hinge: the staleness up to which s(t) = 1")
    normalisation: Literal["fixed", "examples"] = "fixed"
    updates_per_site: int | None = Field(None, ge=1, description="updates each site's records are planned for (the "
                                         "tasks' planned_rounds: each gateway calibrates its noise to spend its "
                                         "budget over this many updates); null: rounds. A site behind a link misses "
                                         "rounds, so set it to the updates a site can send during the federation")
