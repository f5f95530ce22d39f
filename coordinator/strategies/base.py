"""The aggregation-strategy interface (Flower's ``Strategy`` idea, reduced to what a streaming coordinator needs).

A strategy sees updates one at a time (``accumulate``) and produces one aggregate at the end of a round
(``aggregate``). It never sees the transport, the ledger or the database, and it must not keep a list of the K
full updates: aggregation is a running sum (docs/transport.md, "Scale-out"), so partial sums from several ingest workers
can be merged (associativity; see :func:`coordinator.strategies.fedavg.merge`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Strategy", "Tensors", "update_noise_variance"]

#: name -> array, e.g. ``{"phi.conv1.weight": float32 (16, 1, 3, 3), ...}``.
Tensors = Mapping[str, np.ndarray]


def update_noise_variance(events: Mapping[Any, Any], *, clipping_norm: float, learning_rate: float,
                          expected_batch_size: int, num_examples: int, local_steps: int) -> float | None:
    """The variance per coordinate of the DP noise in one site's update (its delta), from public quantities only.

    Each of the ``local_steps`` steps adds one Gaussian draw of std sigma = C * min_c z_c to the clipped sum (CCDP,
    both variants: under "sample" every z_c is equal; under "scale" sigma = z_c C_c with C_c = C for the category of
    the smallest z_c, ``edge_sdk.privacy.ccdp.CCDPPlan``), normalises it by q N_k = min(B, N_k) and multiplies by the
    learning rate (``edge_sdk.training``, module docstring). So ``v_k = local_steps * (lr * sigma / min(B, N_k))^2``.

    Args:
        events: the update's ``{category: DPSGDEvent}`` (``UpdateReport.events``); empty: no privacy.
        clipping_norm: C of the task (L2). learning_rate: the task's local learning rate.
        expected_batch_size: B of the task. num_examples: N_k (declared, public). local_steps: steps actually run.

    Returns:
        v_k (float, squared model units), 0.0 without privacy, or None when ``num_examples`` or ``local_steps`` is
        not positive (nothing to estimate).
    """
    if not events:
        return 0.0
    if num_examples <= 0 or local_steps <= 0 or expected_batch_size <= 0:
        return None
    sigma = clipping_norm * min(float(ev.noise_multiplier) for ev in events.values())
    return float(local_steps * (learning_rate * sigma / min(expected_batch_size, num_examples)) ** 2)


class Strategy(ABC):
    """Streaming aggregation of model deltas for one round at a time.

    The stored global model is the strategy's *bundle*. FedAvg's bundle is the model itself. NIRA's holds the shared
    phi and one head psi per cluster. Four hooks, identity by default, let a strategy keep such a bundle:
    :meth:`prepare` (before a round), :meth:`site_weights` (what one site trains from), :meth:`after_step`
    (after the server optimizer) and :meth:`end_round` (after the model is stored). ``begin_round`` receives the
    bundle. ``accumulate`` receives a site's delta in site-weights shape. ``aggregate`` returns a delta in bundle
    shape.
    """

    def prepare(self, bundle: Tensors, *, round: int) -> dict[str, np.ndarray]:
        """The bundle round ``round`` trains from (e.g. with a head for every current cluster); default: as is."""
        return dict(bundle)

    def site_weights(self, bundle: Tensors, site_id: str) -> dict[str, np.ndarray]:
        """The model ``site_id`` trains from this round (what its TASK carries); default: the bundle."""
        return dict(bundle)

    def after_step(self, bundle: Tensors) -> dict[str, np.ndarray]:
        """Post-process the new bundle after the server optimizer (e.g. species-embedding merging); default: as is."""
        return dict(bundle)

    def end_round(self, round: int) -> list[str]:
        """Called once the round's new model is stored (e.g. re-clustering); returns log lines. Default: none."""
        return []

    @abstractmethod
    def begin_round(self, template: Tensors) -> None:
        """Reset state for a new round; ``template`` gives the global model's names, shapes and dtypes."""

    @abstractmethod
    def accumulate(self, site_id: str, delta: Tensors, *, num_examples: int,
                   species_counts: Mapping[int, float] | None = None, noise_variance: float | None = None) -> None:
        """Fold one site's delta (local minus global, same names/shapes as ``template``) into the running state.

        Args:
            site_id: the sender (strategies that cluster sites use it; FedAvg ignores it).
            delta: name -> array, float, finite.
            num_examples: the weight N_k (>= 1).
            species_counts: the site's noisy per-class counts when the round asked for them (NIRA's embedding
                weights), else None.
            noise_variance: the variance per coordinate of the DP noise in ``delta``
                (:func:`update_noise_variance`: 0 without privacy, None unknown); FedAvg ignores it.
        """

    def count_noise_multiplier(self) -> float | None:
        """The noise multiplier of the per-class count release this strategy asks sites for, or None (default)."""
        return None

    @abstractmethod
    def aggregate(self) -> dict[str, np.ndarray]:
        """The round's aggregate delta, name -> array with the template's dtypes.

        Raises:
            ValueError: nothing was accumulated this round.
        """

    @property
    @abstractmethod
    def count(self) -> int:
        """Number of updates accumulated in the current round."""
