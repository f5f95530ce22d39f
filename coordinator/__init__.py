"""WildFed coordinator: the cloud side of the federation (registry, ingest, ledger, rounds, aggregation, CLI).

Public API (everything else is reachable through its module)::

    from coordinator import Coordinator, CoordinatorConfig, load_config

The coordinator never imports ``edge_sdk`` and never imports torch at module import time.
"""

from coordinator.config import CoordinatorConfig, config_from_dict, load_config, save_config
from coordinator.service import BudgetRow, Coordinator, StatusReport

__all__ = ["Coordinator", "CoordinatorConfig", "StatusReport", "BudgetRow", "load_config", "config_from_dict",
           "save_config"]
