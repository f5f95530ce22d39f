"""Server optimizers: turn a round's aggregate delta into the next global model (one file per method)."""

from coordinator.optimizers.base import ServerOptimizer
from coordinator.optimizers.server_sgd import ServerSGD, sgd_step

__all__ = ["ServerOptimizer", "ServerSGD", "sgd_step"]
