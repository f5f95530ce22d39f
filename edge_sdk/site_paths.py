"""Where a gateway keeps its state, all derived from its site config.

The state folder is the folder of the site's outbox (``outbox:`` in ``site.yaml``, e.g. ``state/outbox.sqlite``)::

    state/outbox.sqlite              updates waiting for the coordinator's ACK (edge_sdk.uplink.outbox)
    state/global-model.safetensors   the newest global model (edge_sdk.config.global_model_path)
    state/embeddings/                backbone embeddings of every crop (edge_sdk.data.embedding_cache)
    state/field.sqlite               the index of photos, events and verdicts (edge_sdk.field.store)
    state/detections.sqlite          detection records waiting to be published (edge_sdk.field.detection_queue)
    state/review.sqlite              the review page's accounts and sessions (edge_sdk.review), 0600
    state/cohorts.sqlite             the cohort each training record joined (edge_sdk.rounds.cohorts)
"""

from __future__ import annotations

from pathlib import Path

from edge_sdk.config import SiteConfig
from edge_sdk.inference.weights import cache_dir

__all__ = ["state_dir", "embedding_cache_dir", "calibration_cache_dir", "field_index_path", "detection_queue_path",
           "review_accounts_path", "cohort_registry_path"]


def state_dir(config: SiteConfig) -> Path:
    """The folder of the site's outbox."""
    return Path(config.outbox).parent


def embedding_cache_dir(config: SiteConfig) -> Path:
    """The backbone-embedding cache: ``config.embedding_cache``, default ``<state>/embeddings``."""
    return Path(config.embedding_cache) if config.embedding_cache is not None else state_dir(config) / "embeddings"


def calibration_cache_dir(config: SiteConfig) -> Path:
    """The persistent cache of CCDP calibrations: ``config.calibration_cache``, default ``<wildfed cache>/calibration``
    (:func:`edge_sdk.inference.weights.cache_dir`; public values, shared by the sites of one machine)."""
    return Path(config.calibration_cache) if config.calibration_cache is not None else cache_dir() / "calibration"


def field_index_path(config: SiteConfig) -> Path:
    """``<state>/field.sqlite``."""
    return state_dir(config) / "field.sqlite"


def detection_queue_path(config: SiteConfig) -> Path:
    """``<state>/detections.sqlite``."""
    return state_dir(config) / "detections.sqlite"


def review_accounts_path(config: SiteConfig) -> Path:
    """``<state>/review.sqlite``: the review page's accounts and sessions (:mod:`edge_sdk.review.accounts`)."""
    return state_dir(config) / "review.sqlite"


def cohort_registry_path(config: SiteConfig) -> Path:
    """``<state>/cohorts.sqlite``: the cohort each training record joined (:mod:`edge_sdk.rounds.cohorts`)."""
    return state_dir(config) / "cohorts.sqlite"
