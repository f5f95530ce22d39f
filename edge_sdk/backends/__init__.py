"""Training backends behind one interface (:class:`edge_sdk.backends.base.TrainingBackend`), registered by name.

Use :func:`edge_sdk.backends.base.create_backend`; framework modules (torch) are imported only when chosen.
"""

from edge_sdk.backends.base import (
    ParameterSpec,
    TrainingBackend,
    available_backends,
    create_backend,
    register_backend,
)

__all__ = ["ParameterSpec", "TrainingBackend", "available_backends", "create_backend", "register_backend"]
