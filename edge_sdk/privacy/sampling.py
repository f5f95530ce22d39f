"""Poisson sampling of training records, with halted IUCN categories excluded.

DP-SGD's privacy amplification by subsampling (Abadi et al. 2016, Sec. 3.1; Mironov, Talwar & Zhang 2019,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism") assumes each record joins each step's batch
independently with probability q. The realised batch size is therefore random; the mechanism normalises by the
expected batch size (``edge_sdk.privacy.ccdp``), never by the realised one.

A record whose category the ledger has halted (docs/privacy.md, "What halting reveals") is never eligible: its
inclusion probability is exactly 0, so it takes no further part in training.

Individualized DP-SGD's "Sample" variant (Boenisch et al., NeurIPS 2023, Sec. 4.1) gives each record its own rate
(its IUCN category's q_c): :func:`sample_at_rates` takes the per-record inclusion probabilities.

Randomness comes from an injected generator (``numpy.random.Generator`` or any object with ``random(size)``
returning float64 in [0, 1)), so the caller decides between a seeded generator (tests, demos) and a secure one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from shared.iucn import IUCNCategory

__all__ = ["UniformSource", "eligible_mask", "poisson_sample", "poisson_sample_mask", "sample_at_rates_mask",
           "sample_at_rates"]


class UniformSource(Protocol):
    """Anything that draws float64 uniforms in [0, 1): ``numpy.random.Generator`` qualifies."""

    def random(self, size: int) -> np.ndarray:  # pragma: no cover - protocol
        """Return ``size`` float64 uniforms in [0, 1)."""
        ...


def eligible_mask(categories: np.ndarray, halted: Iterable[IUCNCategory]) -> np.ndarray:
    """Which records may be sampled.

    Args:
        categories: int8/int array (N,) of IUCN ranks (``IUCNCategory.rank``).
        halted: categories the ledger has halted.

    Returns:
        bool array (N,): True where the record's category is not halted.
    """
    halted_ranks = np.asarray([c.rank for c in halted], dtype=np.int64)
    return ~np.isin(np.asarray(categories).astype(np.int64), halted_ranks)


def poisson_sample_mask(eligible: np.ndarray, sampling_rate: float, rng: UniformSource) -> np.ndarray:
    """One Poisson-sampled batch as a mask (the static-shape form for padded-batch backends).

    Every record draws a uniform (so the number of draws does not depend on which records are eligible), and is
    included iff it is eligible and its uniform is ``< sampling_rate``.

    Args:
        eligible: bool array (N,).
        sampling_rate: q in [0, 1].
        rng: the injected uniform source.

    Returns:
        bool array (N,), the batch mask.

    Raises:
        ValueError: q outside [0, 1].
    """
    if not 0.0 <= sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in [0, 1], got {sampling_rate}")
    eligible = np.asarray(eligible, dtype=bool)
    return sample_at_rates_mask(np.where(eligible, float(sampling_rate), 0.0), rng)


def poisson_sample(eligible: np.ndarray, sampling_rate: float, rng: UniformSource) -> np.ndarray:
    """One Poisson-sampled batch as sorted int64 record indices (B,), B random with mean q * sum(eligible).

    See :func:`poisson_sample_mask` for arguments and raises.
    """
    return np.flatnonzero(poisson_sample_mask(eligible, sampling_rate, rng)).astype(np.int64)


def sample_at_rates_mask(rates: np.ndarray, rng: UniformSource) -> np.ndarray:
    """One Poisson-sampled batch with a rate per record: record i is included independently with probability
    ``rates[i]`` (0 for a record that must never be sampled).

    Every record draws a uniform, whatever its rate, so the number of draws reveals nothing.

    Args:
        rates: float (N,) inclusion probabilities in [0, 1].
        rng: the injected uniform source.

    Returns:
        bool array (N,), the batch mask.

    Raises:
        ValueError: a rate outside [0, 1] (or NaN).
    """
    rates = np.asarray(rates, dtype=np.float64)
    if rates.size and not (np.all(rates >= 0.0) and np.all(rates <= 1.0)):
        raise ValueError("inclusion rates must be in [0, 1]")
    draws = np.asarray(rng.random(rates.shape[0]), dtype=np.float64)
    return draws < rates


def sample_at_rates(rates: np.ndarray, rng: UniformSource) -> np.ndarray:
    """:func:`sample_at_rates_mask` as sorted int64 record indices (B,), B random with mean ``sum(rates)``."""
    return np.flatnonzero(sample_at_rates_mask(rates, rng)).astype(np.int64)
