"""The ``site.yaml`` a provisioning bundle ships (:func:`render_site_config`), with the federation plan the
gateway's learnability report uses before its first round.

:mod:`coordinator.provisioning` writes the rendered file into the bundle; the paths in it come from the gateway
profile (relative to the install prefix), the model settings and the plan from the coordinator's config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from shared import bundle as fmt
from shared.models.backbone_variants import DEFAULT_BACKBONE, get_variant
from shared.profiles import GatewayProfile

from coordinator.config import CoordinatorConfig

__all__ = ["render_site_config"]


def render_site_config(*, config: CoordinatorConfig, profile: GatewayProfile, profile_file: str, site_id: str,
                       broker_url: str, species: Sequence[Mapping[str, Any]] | None, dataset: str | None,
                       backbone: str = DEFAULT_BACKBONE, embedding_input_size: int | None = None,
                       capacity: int | None = None) -> str:
    """The ``site.yaml`` of a bundle: ids, broker, identity and storage paths from the profile (relative to the
    install prefix), privacy defaults from the profile, the federation's model size, the backbone and its input
    size (whose graph the bundle ships, installed under ``model_dir``), the species table (or an empty one with
    a note to fill it in), and, where the coordinator config has the federation's species table, every class's
    scientific name (``class_names``)."""
    body: dict[str, Any] = {
        "federation_id": config.federation_id,
        "site_id": site_id,
        "dataset": dataset or (profile.storage.data / "camtrap").as_posix(),
        "species": [dict(s) for s in species or []],
        "private_key": profile.identity.private_key.as_posix(),
        "coordinator_public_key": profile.identity.coordinator_public_key.as_posix(),
        "broker_url": broker_url,
        "outbox": profile.storage.outbox.as_posix(),
        "artifact_cache": profile.storage.artifact_cache.as_posix(),
        "profile": profile_file,
        "backbone": backbone,
        "embedding_input_size": embedding_input_size or get_variant(backbone).default_input_size,
        "model_dir": fmt.MODELS_DIR,
        "num_classes": config.num_classes,
        # every class of the federation's model by name, so that `detect` and the field loop name a predicted
        # species the site does not list itself (public: the coordinator's species table)
        **({"class_names": _class_names(config)} if config.species else {}),
        "federation_plan": _federation_plan(config, capacity),
        "allow_non_private": profile.privacy.allow_non_private,
        "allow_seeded_noise": profile.privacy.allow_seeded_noise,
    }
    head = (f"# WildFed site config for {site_id} (federation {config.federation_id}), written by "
            "`wildfed-coordinator provision`.\n"
            "# Relative paths are relative to this file (the install prefix). Training settings (backend, device,\n"
            f"# threads, micro-batch) come from {profile_file}; set them here to override.\n")
    if not species:
        head += ("# TODO before starting: fill in `species` (scientific_name, class_index, iucn_category per row;\n"
                 "# class indices are the federation's) and put the site's Camtrap DP package at `dataset`.\n")
    return head + yaml.safe_dump(body, sort_keys=False, allow_unicode=True)


def _class_names(config: CoordinatorConfig) -> dict[int, str]:
    """``{class index: scientific name}`` of the coordinator's species table, in class order."""
    return {e.class_index: e.scientific_name for e in sorted(config.species or [], key=lambda e: e.class_index)}


def _federation_plan(config: CoordinatorConfig, capacity: int | None = None) -> dict[str, Any] | None:
    """The plan the site's learnability report uses before its first round (``edge_sdk.federation_plan``): public
    values every task carries, with the site's declared ``capacity`` (enrolment metadata) when it has one; None where
    the gateway's local CCDP plan is not what runs (``privacy: none`` or ``global``, radio maps)."""
    if config.privacy in ("none", "global") or config.model == "radio_unet":
        return None
    plan = {"rounds": config.planned_updates(), "local_steps": config.local_steps,
            "expected_batch": config.expected_batch_size, "target_delta": config.target_delta,
            "clipping_norm": config.clipping_norm, "variant": config.ccdp_variant,
            "budgets": {c.value: float(e) for c, e in config.budgets().items()}}
    return plan if capacity is None else {**plan, "capacity": int(capacity)}
