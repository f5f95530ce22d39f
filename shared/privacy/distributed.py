"""Distributed DP for Global DP rounds: each site adds its share of Skellam noise to its quantised clipped sum
before secure aggregation masks it, so the opened sum carries the central noise and the coordinator is never
trusted to add it (Agarwal, Kairouz and Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021; the accounting of :class:`shared.privacy.events.SkellamEvent`).

The sum of independent symmetric Skellam variables is Skellam with the summed variance, exactly. A round is
calibrated for the minimum number of survivors t (the secure-aggregation threshold) less the f participants that
may collude (``colluding_sites``, f < t): each site adds variance ``mu / (t - f)`` per coordinate
(:func:`skellam_share_variance`), so the shares of any t - f sites carry at least ``mu``. A participant knows its
own share and f colluding participants know the sum of theirs; what the noise of the other survivors (at least
t - f of them) leaves is still ``mu``, which is what the ledger charges (``shared.privacy.observers`` gives the
epsilon every observer faces). Dropouts mean less noise, never less than planned. Per-category budgets are met as in individualized DP-SGD's "Scale" variant (Boenisch et al.,
NeurIPS 2023, Sec. 4.2): one noise level, category c's records clipped at ``C_c <= C``. Subsampling is not
credited (dp-accounting has no subsampled-Skellam accounting), so every round is charged as a full release, and
so every site takes every record of an active category each round (:func:`site_sampling_rate` is 1): sampling
that the accountant does not credit would only discard signal at the same noise.

Integer units: with the secure-aggregation ``scale``, a record clipped at ``C_c`` moves its site's quantised sum by
at most ``D2 = C_c scale + sqrt(d)`` in L2 (deterministic rounding moves each of d coordinates by at most 1/2 per
input) and ``D1 = sqrt(d) D2`` in L1. The sites sum in float64 and clip at ``C_c`` less a float64 rounding margin, so
that this holds for the sum as computed, not only for the exact one (the proof: :mod:`shared.privacy.sum_rounding`). ``z`` is the noise multiplier against the anchor's ``C_eff = C +
sqrt(d)/scale``: ``mu = (z C_eff scale)^2``.

The noise is sampled with numpy's Poisson sampler on the secure keystream of
:func:`shared.privacy.randomness.secure_generator` (AES-128-CTR or ChaCha20, keyed from ``os.urandom`` afresh for
each share), the source of the Gaussian draws of the other modes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import dp_accounting
import numpy as np

from shared.errors import ConfigError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import epsilon_spent, make_accountant
from shared.privacy.events import SkellamEvent
from shared.privacy.randomness import secure_generator

__all__ = ["skellam_event", "skellam_share_variance", "distributed_plan", "skellam_noise", "site_sampling_rate"]


def site_sampling_rate(expected_batch_size: int, num_examples: int | None, *, distributed: bool = False) -> float:
    """A site's base Poisson rate q_k, computed alike by the gateway (which samples) and the coordinator (which
    normalises by ``sum_k q_k N_k`` and charges the ledger): ``min(1, B / N_k)`` from the task's expected batch
    size B and the site's public record count N_k (1.0 where N_k is unknown or 0, which only raises z); under
    distributed noise 1.0 for every site, because the Skellam accounting credits no subsampling (module
    docstring): a record left out of a round would cost the same epsilon as one put in.

    Args:
        expected_batch_size: B >= 1 (records per step in expectation). num_examples: N_k, or None.
        distributed: the round's noise is the sites' Skellam shares (``TrainingTask.distributed_noise``).

    Returns:
        q_k in (0, 1].

    Raises:
        ConfigError (field ``expected_batch_size``): B < 1.
    """
    if not expected_batch_size >= 1:
        raise ConfigError(f"expected_batch_size must be >= 1, got {expected_batch_size}",
                          field="expected_batch_size", fix="use e.g. 1024")
    if distributed or not num_examples:
        return 1.0
    return min(1.0, float(expected_batch_size) / float(num_examples))


def _sensitivities(clipping_norm: float, vector_length: int, scale: float) -> tuple[float, float]:
    d2 = float(clipping_norm) * float(scale) + math.sqrt(vector_length)
    return d2, math.sqrt(vector_length) * d2


def skellam_event(*, noise_multiplier: float, anchor_clipping_norm: float, clipping_norm: float,
                  vector_length: int, scale: float, steps: int = 1) -> SkellamEvent:
    """The :class:`~shared.privacy.events.SkellamEvent` of ``steps`` rounds for records clipped at
    ``clipping_norm`` (C_c), when the total noise is ``mu = (z C_eff scale)^2`` with ``C_eff`` the anchor's
    (module docstring)."""
    mu = (float(noise_multiplier) * _sensitivities(anchor_clipping_norm, vector_length, scale)[0]) ** 2
    d2, d1 = _sensitivities(clipping_norm, vector_length, scale)
    return SkellamEvent(mu, d2, d1, int(steps))


def skellam_share_variance(*, noise_multiplier: float, clipping_norm: float, vector_length: int, scale: float,
                           threshold: int, colluding_sites: int = 0) -> float:
    """``mu / (t - f)``: the per-coordinate variance each site adds (integer units), so that the shares of any
    t - f sites carry ``mu = (z C_eff scale)^2`` (module docstring). The gateway (its share) and the coordinator
    (the grid's headroom) both call this.

    Args:
        noise_multiplier: z. clipping_norm: the anchor's C. vector_length: d. scale: the secure-aggregation grid's
            steps per unit. threshold: t >= 1. colluding_sites: f, 0 <= f < t (``SecAggSettings.colluding_sites``).

    Raises:
        ConfigError (field ``secagg.colluding_sites``): f out of range.
    """
    t, f = int(threshold), int(colluding_sites)
    if not 0 <= f < t:
        raise ConfigError(f"colluding_sites must be from 0 to threshold - 1 = {t - 1}, got {f}",
                          field="secagg.colluding_sites", fix=f"use at most {max(t - 1, 0)}, or raise the threshold")
    mu = (float(noise_multiplier) * _sensitivities(clipping_norm, vector_length, scale)[0]) ** 2
    return mu / (t - f)


@functools.lru_cache(maxsize=256)
def _plan(budgets: tuple[tuple[IUCNCategory, float], ...], target_delta: float, rounds: int, clipping_norm: float,
          vector_length: int, scale: float) -> tuple[float, tuple[tuple[IUCNCategory, float], ...]]:
    table = dict(budgets)
    anchor = max(table, key=lambda c: (table[c], c.rank))
    eps_max = table[anchor]

    def spent(z: float, c_c: float) -> float:
        return epsilon_spent([skellam_event(noise_multiplier=z, anchor_clipping_norm=clipping_norm,
                                            clipping_norm=c_c, vector_length=vector_length, scale=scale,
                                            steps=rounds)], target_delta=target_delta)

    z = float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant("rdp"),
        lambda z_: skellam_event(noise_multiplier=z_, anchor_clipping_norm=clipping_norm, clipping_norm=clipping_norm,
                                 vector_length=vector_length, scale=scale, steps=rounds).to_dp_event(),
        eps_max, target_delta, bracket_interval=dp_accounting.LowerEndpointAndGuess(0.05, 1.0), tol=1e-4))
    while spent(z, clipping_norm) > eps_max:
        z += 1e-4
    norms = {}
    for c, eps in table.items():
        if spent(z, clipping_norm) <= eps:
            norms[c] = float(clipping_norm)
            continue
        lo = float(clipping_norm) * 1e-6
        if spent(z, lo) > eps:
            raise PrivacyBudgetError(f"category {c.value}: no clipping norm meets eps={eps:.4g} at z={z:.4g} "
                                     "(the rounding to the secure-aggregation grid alone exceeds it)")
        c_c = float(dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant("rdp"),
            lambda x, z=z: skellam_event(noise_multiplier=z, anchor_clipping_norm=clipping_norm, clipping_norm=x,
                                         vector_length=vector_length, scale=scale, steps=rounds).to_dp_event(),
            eps, target_delta, bracket_interval=dp_accounting.ExplicitBracketInterval(lo, float(clipping_norm)),
            tol=1e-6 * clipping_norm))
        while spent(z, c_c) > eps:
            c_c *= 1.0 - 1e-6
        norms[c] = c_c
    return z, tuple(sorted(norms.items(), key=lambda kv: kv[0].rank))


def distributed_plan(*, budgets: Mapping[IUCNCategory, float], target_delta: float, planned_rounds: int,
                     clipping_norm: float, vector_length: int, scale: float
                     ) -> tuple[float, dict[IUCNCategory, float]]:
    """``(z, {category: C_c})`` of a distributed Global DP federation, from public values only (the coordinator and
    every site compute the same numbers): z makes ``planned_rounds`` rounds of the federation's largest budget's
    category, clipped at C, spend exactly that budget; each other category c is clipped at the largest
    ``C_c <= C`` whose rounds spend exactly eps_c (dp-accounting's RDP accountant, ``calibrate_dp_mechanism``;
    every result re-checked, never over budget).

    Raises:
        ConfigError: no budgets, or out-of-range values.
        PrivacyBudgetError: a budget that no clipping norm can meet at that z.
    """
    if not budgets:
        raise ConfigError("distributed DP needs per-category budgets", field="budget")
    if not (clipping_norm > 0 and scale > 0 and vector_length >= 1 and planned_rounds >= 1):
        raise ConfigError("distributed DP needs C > 0, scale > 0, d >= 1 and planned rounds >= 1",
                          field="clipping_norm")
    key = tuple(sorted(((c, float(e)) for c, e in budgets.items()), key=lambda kv: kv[0].rank))
    z, norms = _plan(key, float(target_delta), int(planned_rounds), float(clipping_norm), int(vector_length),
                     float(scale))
    return z, dict(norms)


def skellam_noise(variance: float, size: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """int64 (size,) symmetric Skellam noise of per-coordinate ``variance``: ``Poisson(mu/2) - Poisson(mu/2)``
    (variance mu), by numpy's Poisson sampler. ``rng`` defaults to a fresh
    :func:`~shared.privacy.randomness.secure_generator` (a cipher keystream keyed from ``os.urandom``); pass one
    only for tests and simulations.

    Raises:
        ValueError: variance not positive.
    """
    if not variance > 0:
        raise ValueError(f"variance must be > 0, got {variance}")
    rng = rng if rng is not None else secure_generator()
    lam = float(variance) / 2.0
    return rng.poisson(lam, size).astype(np.int64) - rng.poisson(lam, size).astype(np.int64)
