"""Aggregation strategies: one file per algorithm behind :class:`coordinator.strategies.base.Strategy`."""

from coordinator.strategies.base import Strategy
from coordinator.strategies.fedavg import FedAvg, RunningWeightedSum

__all__ = ["Strategy", "FedAvg", "RunningWeightedSum"]
