"""The demo's preparation (:mod:`wildfed_sim.demo`), before and beside its processes: the sites' Camtrap DP
packages, the public feature centre, each gateway's keys and config, the round-0 weights (loaded, or pretrained on
the public split), the CCDP budget and the coordinator's config.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key

from wildfed_sim.common.demo_data import demo_sites, public_images
from wildfed_sim.demo_settings import DemoResult, DemoSettings, demo_embedding_cache, secagg_threshold


# ------------------------------------------------------------------------------------------ preparation
def prepare_sites(settings: DemoSettings, run_dir: Path, console: Any) -> tuple[list[Any], Any, Any, Any]:
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


def write_feature_centre(settings: DemoSettings, run_dir: Path, train: Any, specs: Any, console: Any) -> Path:
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


def write_site_config(settings: DemoSettings, run_dir: Path, spec: Any, federation_id: str,
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
def _strategy_config(settings: DemoSettings) -> dict[str, Any]:
    """The coordinator config's ``strategy`` block for the demo's settings."""
    if settings.strategy == "fedavg":
        return {"kind": "fedavg"}
    return {"kind": "nira", "distance_threshold": settings.nira_distance_threshold,
            "recluster_every": settings.nira_recluster_every,
            "embedding_merging": settings.nira_embedding_merging}



def round0_weights(settings: DemoSettings, result: DemoResult, train: Any, specs: Any, test: Any,
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


def demo_budget(settings: DemoSettings) -> Any:
    """The federation's CCDP budget, anchored as the settings say (coordinator.config_privacy.BudgetFromAnchor)."""
    from coordinator.config_privacy import BudgetFromAnchor

    return BudgetFromAnchor(category=IUCNCategory(settings.anchor_category), epsilon=settings.anchor_epsilon,
                            gamma=settings.gamma)


def coordinator_config(settings: DemoSettings, run_dir: Path, coord_dir: Path, federation_id: str, broker_url: str,
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

