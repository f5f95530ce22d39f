"""Empirical privacy audit of CCDP: white-box gradient canaries and a one-run epsilon lower bound.

Method (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run", NeurIPS 2023; the
white-box setting of their DP-SGD experiments, with Dirac gradient canaries):

1. **Canaries.** ``m`` canary records per audited IUCN category are added to one site's dataset. Canary ``i`` of
   category ``c`` owns one parameter coordinate ``j_i`` (distinct for every canary; chosen before anything random
   about the canaries is drawn, as the coordinates where a probe batch of the site's real records has the smallest
   mean clipped per-example gradient magnitude, so that real training drifts them least).
2. **Secret inclusion.** Each canary is independently "in" with probability 1/2 (``S_i`` in {+1, -1}). An "in"
   canary's per-example gradient is ``C e_{j_i}`` (L2 norm exactly C, the clipping norm; clipping leaves it as it is);
   an "out" canary's slot holds a record whose gradient is exactly zero. A zero-gradient record changes nothing in the
   released update (its clipped gradient adds 0 to the sum; the normaliser is the *expected* batch size), so "out"
   is exactly "record removed", while the number of records, hence the sampling rate q = B / N_active and the
   normaliser q N_active, stays the same whatever S is. The audited mechanism's public parameters therefore do not
   depend on S, which the theorem needs.
3. **Training.** The gateway's real code runs unchanged: :func:`edge_sdk.training.train_locally` per round (Poisson
   sampling of every record, canaries included, by :func:`edge_sdk.privacy.sampling.poisson_sample`; noise
   calibration with the RDP accountant; :class:`edge_sdk.privacy.ccdp.CCDPMechanism` clipping and noising; the SGD
   step). Only the training backend is wrapped (:class:`CanaryBackend`): it computes the real rows' per-example
   gradients with the real backend (the torch backend's ghost-clipping path) and substitutes the canary rows.
4. **Observation** (the coordinator's view). The auditor sees what the site uploads, the per-round deltas (local
   minus global weights); the federation is this one site, so global_{r+1} = global_r + delta_r. The score of
   canary i is ``-sum_r delta_r[j_i]`` (a sampled "in" canary pushes its weight down by lr C / (q N_active)).
5. **Guess.** Per category, with ``k = floor(guess_fraction * m / 2)`` fixed before training: "in" for the k
   highest scores, "out" for the k lowest, abstain on the rest (``r = 2k`` guesses; ties broken by index).
   Nothing is searched over, so no multiple-testing correction is needed.
6. **Bound.** :func:`epsilon_lower_bound`: the largest epsilon for which ``v`` or more correct guesses out of ``r``
   would have probability below ``beta`` under (epsilon, delta)-DP, by Steinke et al.'s Theorem 3.1:

       P[W >= v] <= f(v) + 2 m delta max_{i=1..m} (f(v - i) - f(v)) / i,
       f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v],

   with ``delta`` the claim's delta (the task's ``target_delta``). With probability at least ``1 - beta`` over the
   canaries' inclusion and the mechanism's randomness, a mechanism that is (eps, delta)-DP for each canary's
   add/remove gives a bound <= eps.

The claimed epsilon of a category is what the ledger would record for the site: the RDP (or PLD) epsilon of the
DP events the rounds actually reported (:func:`shared.privacy.accounting.epsilon_spent`), at the task's delta.

Why per category is valid: a canary of category c lies only in c's sum, so its claimed guarantee is eps_c. The
other categories' canaries are independent of c's, and Theorem 3.1 holds conditionally on them (they are part of
the fixed rest of the dataset), hence for category c's ``m`` canaries alone.

What the bound is and is not: a *lower* bound on the epsilon of the implementation, valid with confidence
``1 - beta``. A bound above the claim is evidence of a privacy bug (or of bad luck with probability <= beta per
category). A bound below the claim proves nothing about privacy: one-run audits of Gaussian mechanisms are loose
(Steinke et al.'s own DP-SGD experiments; Keinan, Shenfeld & Ligett 2025, "How well can differential privacy be
audited in one run?"). Under CCDP (individualized DP-SGD, ``edge_sdk.privacy.ccdp``) a canary of category c goes
through exactly the mechanism its claim is computed for (its category's rate q_c and noise multiplier), so the
claim is not loosened by other categories' noise. ``break_noise`` (test/diagnostic only) silences the Gaussian
draws of the real mechanism to show that the
audit does detect a mechanism that adds no noise.

Imports: the audit's purpose is to run the gateway's own mechanism code, so it imports ``edge_sdk`` (this package,
the laboratory, stands above both sides). It does so, with torch, only inside :func:`run_audit` and the wrapper
classes' factory: the statistics above need neither, and their tests stay fast.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory, parse_category
from shared.protocol import CCDP_VARIANTS
from shared.privacy.accounting import AccountantName, epsilon_spent
from shared.privacy.events import DPSGDEvent

__all__ = [
    "one_run_p_value",
    "epsilon_lower_bound",
    "guess_sizes",
    "membership_guesses",
    "AuditSettings",
    "CanaryDesign",
    "design_canaries",
    "rank_coordinates",
    "CanaryBackend",
    "SilencedNoise",
    "CategoryAudit",
    "AuditResult",
    "run_audit",
    "load_audit_site",
]

REFERENCE = ("Steinke, Nasr & Jagielski 2023, 'Privacy Auditing with One (1) Training Run' (NeurIPS 2023), "
             "Theorem 3.1; white-box Dirac gradient canaries")


# ------------------------------------------------------------------------------------------------ statistics
def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    for name, value in (("num_canaries", num_canaries), ("num_guesses", num_guesses), ("num_correct", num_correct)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise ValueError(f"need 0 <= num_correct ({num_correct}) <= num_guesses ({num_guesses}) "
                         f"<= num_canaries ({num_canaries})")


def one_run_p_value(*, num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float) -> float:
    """Upper bound on ``P[W >= v]`` for an (epsilon, delta)-DP mechanism (Steinke et al. 2023, Theorem 3.1).

    ``W`` is the number of correct guesses out of ``r`` non-abstaining guesses on ``m`` canaries, each included
    independently with probability 1/2. The bound is ``f(v) + 2 m delta max_{1<=i<=m} (f(v-i) - f(v)) / i`` with
    ``f(v) = P[Binomial(r, p) >= v]``, ``p = e^eps / (1 + e^eps)``, capped at 1. For ``i > v``, ``f(v-i) = 1``
    and the ratio is smaller than at ``i = v``, so the maximum is taken over ``1 <= i <= v``. Tails come from
    ``scipy.stats.binom.sf``; ``p`` from ``scipy.special.expit``.

    Args:
        num_canaries: m >= 0.
        num_guesses: r, 0 <= r <= m.
        num_correct: v, 0 <= v <= r.
        epsilon: eps >= 0 of the null hypothesis.
        delta: delta in [0, 1] of the null hypothesis.

    Returns:
        float in [0, 1], the p-value of observing ``v`` or more correct guesses.

    Raises:
        ValueError: counts not integers or not ordered as above; eps < 0 or not finite; delta outside [0, 1].
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    m, r, v = int(num_canaries), int(num_guesses), int(num_correct)
    p = float(scipy.special.expit(epsilon))
    f_v = float(scipy.stats.binom.sf(v - 1, r, p))  # P[Bin(r, p) >= v]
    if delta == 0 or v == 0:
        return min(1.0, f_v)
    i = np.arange(1, v + 1)
    f_v_minus_i = scipy.stats.binom.sf(v - i - 1, r, p)  # P[Bin(r, p) >= v - i]
    alpha = float(np.max((f_v_minus_i - f_v) / i))
    return min(1.0, f_v + 2.0 * m * delta * alpha)


def epsilon_lower_bound(*, num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                        beta: float = 0.05, xtol: float = 1e-9) -> float:
    """Empirical epsilon lower bound at confidence ``1 - beta`` (Steinke et al. 2023, Theorem 3.1).

    The largest eps >= 0 with :func:`one_run_p_value` ``(eps) <= beta``: every (eps', delta)-DP claim with
    eps' below it is rejected at level beta. The p-value is increasing in eps, so the root is found by bracketing
    and ``scipy.optimize.brentq``. Returns 0.0 when even eps = 0 is not rejected.

    Args:
        num_canaries: m.
        num_guesses: r (guesses that did not abstain).
        num_correct: v (correct guesses among them).
        delta: the claim's delta, in [0, 1).
        beta: significance in (0, 1); 0.05 gives a 95 % lower bound.
        xtol: absolute tolerance on eps (the result is the lower end of the final bracket, so never above the
            exact root).

    Returns:
        float >= 0, epsilon (dimensionless, natural log).

    Raises:
        ValueError: as :func:`one_run_p_value`; beta outside (0, 1); delta outside [0, 1).
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta!r}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")

    def excess(eps: float) -> float:  # < 0 while the claim eps is rejected
        return one_run_p_value(num_canaries=num_canaries, num_guesses=num_guesses, num_correct=num_correct,
                               epsilon=eps, delta=delta) - beta

    if excess(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) < 0:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # unreachable for r >= 1: p(eps) -> >= P[Bin(r,1) >= v] = 1 > beta
            raise ValueError("no upper bracket for the epsilon lower bound")
    root = scipy.optimize.brentq(excess, lo, hi, xtol=xtol)
    # brentq may land a hair past the root; step back so the returned eps is still rejected.
    while root > 0 and excess(root) >= 0:
        root = max(0.0, root - xtol)
    return float(root)


def guess_sizes(num_canaries: int, guess_fraction: float) -> tuple[int, int]:
    """``(k_plus, k_minus)``, both ``floor(guess_fraction * m / 2)``: guess "in" for the k_plus highest scores and
    "out" for the k_minus lowest, fixed before training (no search, so no multiple-testing correction).

    Raises:
        ValueError: m < 0 or guess_fraction outside (0, 1].
    """
    if num_canaries < 0:
        raise ValueError(f"num_canaries must be >= 0, got {num_canaries}")
    if not 0 < guess_fraction <= 1:
        raise ValueError(f"guess_fraction must be in (0, 1], got {guess_fraction}")
    k = int(math.floor(guess_fraction * num_canaries / 2))
    return k, k


def membership_guesses(scores: np.ndarray, *, k_plus: int, k_minus: int) -> np.ndarray:
    """Guesses for canaries from their scores (higher score = more likely "in").

    Args:
        scores: float (m,).
        k_plus: number of "in" guesses (+1), given to the highest scores.
        k_minus: number of "out" guesses (-1), given to the lowest scores.

    Returns:
        int8 (m,) in {-1, 0, +1} (0 = abstain). Ties are broken by canary index (stable sort).

    Raises:
        ValueError: scores not 1-D or not finite, k's negative, or k_plus + k_minus > m.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError("scores must be a finite 1-D array")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.shape[0]:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m, got {k_plus}, {k_minus}, "
                         f"m={scores.shape[0]}")
    order = np.argsort(scores, kind="stable")  # ascending
    guesses = np.zeros(scores.shape[0], dtype=np.int8)
    guesses[order[:k_minus]] = -1
    if k_plus:
        guesses[order[-k_plus:]] = 1
    return guesses


# ------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class AuditSettings:
    """What the audit runs (one site, ``rounds`` rounds of ``local_steps`` CCDP steps).

    Attributes:
        canaries_per_category: m, canary records added per audited category (>= 2).
        categories: audited IUCN categories (default all six).
        budget: the CCDP budgets the task carries (per-category total epsilon at ``target_delta``).
        rounds: rounds run; also the task's ``planned_rounds`` (noise is calibrated for ``rounds * local_steps``).
        local_steps, expected_batch_size, learning_rate, clipping_norm, target_delta: the training task's values
            (``clipping_norm`` C is L2; q = expected_batch_size / N_active with N_active = real records + canaries).
        guess_fraction: share of each category's canaries that get a guess (half "in", half "out").
        beta: significance of the lower bound (0.05 = 95 % confidence).
        accountant: the ledger's accountant for the claimed epsilon (``"rdp"`` or ``"pld"``).
        ccdp_variant: the individualized DP-SGD variant (``"sample"`` or ``"scale"``), as the task carries it.
        break_noise: TEST/DIAGNOSTIC ONLY: the Gaussian draws of the mechanism return zeros (no privacy at all), to
            show the audit catches a broken mechanism.
        seed: None (default) draws canary design and inclusion from OS entropy and the mechanism's sampling and
            noise from the secure source; an integer seeds all of them for reproducible tests, with the
            :class:`~edge_sdk.privacy.randomness.InsecureRandomnessWarning` (no privacy guarantee holds then).
        probe_size: real records whose per-example gradients choose the canary coordinates.

    Raises:
        ConfigError: a value out of range (``field`` names the CLI option).
    """

    canaries_per_category: int = 100
    categories: tuple[IUCNCategory, ...] = tuple(IUCNCategory)
    budget: CCDPBudget = field(default_factory=lambda: CCDPBudget.from_anchor(IUCNCategory.VU, 1.0, 1.0))
    rounds: int = 5
    local_steps: int = 10
    expected_batch_size: int = 128
    learning_rate: float = 0.5
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    guess_fraction: float = 0.6
    beta: float = 0.05
    accountant: AccountantName = "rdp"
    ccdp_variant: str = "sample"
    break_noise: bool = False
    seed: int | None = None
    probe_size: int = 512

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                option = name.replace("_", "-")
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}", field=option,
                                  fix=f"pass --{option} {minimum} or more")

        positive_int("canaries_per_category", self.canaries_per_category, 2)
        positive_int("rounds", self.rounds)
        positive_int("local_steps", self.local_steps)
        positive_int("expected_batch_size", self.expected_batch_size)
        positive_int("probe_size", self.probe_size)
        for name in ("learning_rate", "clipping_norm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}",
                                  field=name.replace("_", "-"), fix="use e.g. 0.5 (learning rate) or 1.0 (C)")
        if not (isinstance(self.target_delta, float) and 0 < self.target_delta < 1):
            raise ConfigError(f"target_delta must be in (0, 1), got {self.target_delta!r}", field="target-delta",
                              fix="use e.g. 1e-5")
        if not (isinstance(self.guess_fraction, (int, float)) and 0 < self.guess_fraction <= 1):
            raise ConfigError(f"guess_fraction must be in (0, 1], got {self.guess_fraction!r}",
                              field="guess-fraction", fix="use e.g. 0.6")
        if guess_sizes(self.canaries_per_category, float(self.guess_fraction))[0] < 1:
            raise ConfigError(f"guess_fraction {self.guess_fraction} of {self.canaries_per_category} canaries "
                              "leaves no guess", field="guess-fraction",
                              fix="raise --guess-fraction or --canaries-per-category")
        if not (isinstance(self.beta, float) and 0 < self.beta < 1):
            raise ConfigError(f"beta must be in (0, 1), got {self.beta!r}", field="confidence",
                              fix="use a confidence such as 0.95")
        if self.accountant not in ("rdp", "pld"):
            raise ConfigError(f"unknown accountant {self.accountant!r}", field="accountant", fix="use rdp or pld")
        if self.ccdp_variant not in CCDP_VARIANTS:
            raise ConfigError(f"unknown CCDP variant {self.ccdp_variant!r}", field="ccdp-variant",
                              fix=f"use one of {', '.join(CCDP_VARIANTS)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", field="seed")
        cats = tuple(parse_category(c, field="categories") for c in self.categories)
        if not cats or len(set(cats)) != len(cats):
            raise ConfigError(f"categories must be non-empty and distinct, got {[c.value for c in cats]}",
                              field="categories", fix="e.g. --categories CR,EN,LC")
        object.__setattr__(self, "categories", tuple(sorted(cats, key=lambda c: c.rank)))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict of every setting (budgets as the per-category table)."""
        return {"canaries_per_category": self.canaries_per_category,
                "categories": [c.value for c in self.categories],
                "budget": {"eps_max": self.budget.eps_max, "gamma": self.budget.gamma,
                           "per_category": {c.value: e for c, e in self.budget.table().items()}},
                "rounds": self.rounds, "local_steps": self.local_steps,
                "expected_batch_size": self.expected_batch_size, "learning_rate": self.learning_rate,
                "clipping_norm": self.clipping_norm, "target_delta": self.target_delta,
                "guess_fraction": self.guess_fraction, "beta": self.beta, "confidence": 1.0 - self.beta,
                "accountant": self.accountant, "ccdp_variant": self.ccdp_variant, "break_noise": self.break_noise,
                "seed": self.seed,
                "probe_size": self.probe_size}


# ----------------------------------------------------------------------------------------------- canaries
@dataclass(frozen=True)
class CanaryDesign:
    """The canaries of one audit (M = total canaries over all audited categories).

    Attributes:
        categories: int8 (M,), IUCN rank of each canary.
        coordinates: int64 (M,), distinct indices into the flat parameter vector (backend layout order).
        included: bool (M,), the secret S (True = "in": gradient C e_j; False = zero-gradient slot).
        images: (M, *record shape), distinct keys that identify each canary's record: random embeddings
            (float32 (M, E), uniform in the backbone's [0, 6] range) for the head model's float32 inputs, random
            pixels for uint8 ones; none equal to a real record's.
    """

    categories: np.ndarray
    coordinates: np.ndarray
    included: np.ndarray
    images: np.ndarray

    def __post_init__(self) -> None:
        m = self.categories.shape[0]
        if self.coordinates.shape != (m,) or self.included.shape != (m,) or self.images.shape[0] != m:
            raise ValueError("canary arrays disagree in length")
        if np.unique(self.coordinates).size != m:
            raise ValueError("canary coordinates must be distinct")

    def __len__(self) -> int:
        return int(self.categories.shape[0])


def design_canaries(*, categories: Sequence[IUCNCategory], per_category: int, num_parameters: int,
                    coordinate_order: np.ndarray, real_images: np.ndarray,
                    rng: np.random.Generator) -> CanaryDesign:
    """Build the canaries: categories, coordinates, the secret inclusion S and the key images.

    Args:
        categories: audited categories; ``per_category`` canaries each.
        per_category: m >= 1.
        num_parameters: d, length of the flat parameter vector.
        coordinate_order: int (d,) permutation of ``range(d)``, most preferred coordinate first (see
            :func:`rank_coordinates`); the first ``len(categories) * m`` are used, shuffled among canaries.
        real_images: the site's real records as the model takes them (float32 (N, E) backbone embeddings, or
            uint8 images); canary keys have their shape and dtype and differ from all of them.
        rng: draws the assignment, the inclusion bits (each "in" with probability 1/2) and the key images.

    Returns:
        A :class:`CanaryDesign` with M = ``len(categories) * per_category`` canaries, grouped by category.

    Raises:
        ValueError: more canaries than parameters, or ``coordinate_order`` not of length d.
    """
    total = len(categories) * int(per_category)
    if total > num_parameters:
        raise ValueError(f"{total} canaries need {total} distinct coordinates, the model has {num_parameters}")
    order = np.asarray(coordinate_order, dtype=np.int64)
    if order.shape != (num_parameters,):
        raise ValueError(f"coordinate_order must have shape ({num_parameters},), got {order.shape}")
    coords = rng.permutation(order[:total])
    ranks = np.repeat(np.asarray([c.rank for c in categories], dtype=np.int8), per_category)
    included = rng.random(total) < 0.5
    shape = real_images.shape[1:]
    real_keys = {img.tobytes() for img in real_images}
    if real_images.dtype == np.uint8:
        images = rng.integers(0, 256, size=(total, *shape), dtype=np.uint8)
    else:
        images = (6.0 * rng.random((total, *shape))).astype(real_images.dtype)
    keys = [img.tobytes() for img in images]
    if len(set(keys)) != total or any(k in real_keys for k in keys):  # astronomically unlikely for 28x28 noise
        raise ValueError("canary key images collide; draw again")
    return CanaryDesign(categories=ranks, coordinates=coords, included=included, images=images)


def rank_coordinates(per_example_grads: Any, clipping_norm: float, rng: np.random.Generator) -> np.ndarray:
    """Coordinates ordered by mean |clipped per-example gradient| over a probe batch, smallest first.

    Args:
        per_example_grads: a :class:`~edge_sdk.privacy.per_example.PerExampleGradients` of the probe batch (B, d).
        clipping_norm: C; each probe gradient is clipped to C first, as the mechanism would.
        rng: random tie-break (many coordinates can share a magnitude, e.g. exact zeros).

    Returns:
        int64 (d,), a permutation of ``range(d)``.
    """
    b = per_example_grads.batch_size
    factors = np.minimum(1.0, clipping_norm / np.maximum(per_example_grads.norms, 1e-30)).astype(np.float32)
    grads = per_example_grads.weighted_sum(np.diag(factors))  # (B, d), row i = clip(g_i)
    magnitude = np.abs(np.asarray(grads, dtype=np.float64)).sum(axis=0) / max(1, b)
    return np.lexsort((rng.random(magnitude.shape[0]), magnitude)).astype(np.int64)


@functools.cache
def _canary_gradients_class() -> type:
    """The :class:`~edge_sdk.privacy.per_example.PerExampleGradients` subclass of :class:`CanaryBackend` (built on
    first use so that importing this module imports no ``edge_sdk``)."""
    from edge_sdk.privacy.per_example import PerExampleGradients

    class CanaryGradients(PerExampleGradients):
        """Real rows from the wrapped backend, canary rows as Dirac vectors ``C e_j`` ("in") or zeros ("out")."""

        def __init__(self, real: PerExampleGradients | None, real_rows: np.ndarray, canary_rows: np.ndarray,
                     canary_coords: np.ndarray, canary_norms: np.ndarray, batch_size: int, dim: int) -> None:
            self._real, self._real_rows = real, real_rows
            self._canary_rows, self._coords, self._canary_norms = canary_rows, canary_coords, canary_norms
            self._dim = dim
            norms = np.zeros(batch_size, dtype=np.float64)
            if real is not None:
                norms[real_rows] = real.norms
            norms[canary_rows] = canary_norms
            self.norms = norms

        def weighted_sum(self, weights: np.ndarray) -> np.ndarray:
            w = np.asarray(weights, dtype=np.float32)
            out = (self._real.weighted_sum(w[:, self._real_rows]).astype(np.float32, copy=True)
                   if self._real is not None else np.zeros((w.shape[0], self._dim), dtype=np.float32))
            # Canary row i contributes W[k, i] * norm_i at its own coordinate (norm_i = C "in", 0 "out").
            np.add.at(out, (slice(None), self._coords),
                      w[:, self._canary_rows] * self._canary_norms.astype(np.float32)[None, :])
            return out

    return CanaryGradients


class CanaryBackend:
    """A training backend wrapper that substitutes the canary records' per-example gradients.

    Conforms to :class:`edge_sdk.backends.base.TrainingBackend` (what :func:`edge_sdk.training.train_locally`
    calls) and delegates everything to ``inner`` except per-example gradients: rows whose image is a canary key get
    ``C e_j`` ("in") or the zero vector ("out"); the other rows get the inner backend's own per-example gradients
    (its ghost-clipping path for the torch backend), unchanged. Not registered: it exists only for the audit.

    Args:
        inner: the real backend.
        design: the canaries.
        clipping_norm: C; an "in" canary's gradient has L2 norm exactly C (not above, so clipping keeps it whole).
    """

    def __init__(self, inner: Any, design: CanaryDesign, clipping_norm: float) -> None:
        self.inner = inner
        self.design = design
        self.clipping_norm = float(clipping_norm)
        self._slot = {img.tobytes(): i for i, img in enumerate(design.images)}
        self.name = f"canary({getattr(inner, 'name', 'backend')})"

    @property
    def parameter_layout(self) -> Any:
        """The inner backend's layout."""
        return self.inner.parameter_layout

    @property
    def num_parameters(self) -> int:
        """d."""
        return int(self.inner.num_parameters)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Delegated."""
        self.inner.set_weights(weights)

    def get_weights(self) -> dict[str, np.ndarray]:
        """Delegated."""
        return self.inner.get_weights()

    def apply_gradient(self, flat_grad: np.ndarray, learning_rate: float) -> None:
        """Delegated."""
        self.inner.apply_gradient(flat_grad, learning_rate)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Delegated."""
        return self.inner.predict(x)

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(real row indices, canary row indices, canary slot per canary row), all int64."""
        slots = np.asarray([self._slot.get(img.tobytes(), -1) for img in np.asarray(x)], dtype=np.int64)
        canary_rows = np.flatnonzero(slots >= 0)
        return np.flatnonzero(slots < 0), canary_rows, slots[canary_rows]

    def per_example(self, x: np.ndarray, y: np.ndarray, *, input_sq_norms: np.ndarray | None = None) -> Any:
        """Per-example gradients of the batch (B, d), implicit: norms and weighted sums (see the class docstring).

        Returns:
            a :class:`~edge_sdk.privacy.per_example.PerExampleGradients`.
        """
        real_rows, canary_rows, slots = self._split(x)
        sq = None if input_sq_norms is None else np.asarray(input_sq_norms)[real_rows]
        real = self.inner.per_example(x[real_rows], y[real_rows], input_sq_norms=sq) if real_rows.size else None
        norms = np.where(self.design.included[slots], self.clipping_norm, 0.0)
        return _canary_gradients_class()(real, real_rows, canary_rows, self.design.coordinates[slots], norms,
                                         int(np.asarray(y).shape[0]), self.num_parameters)

    def per_example_gradients(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (B, d), the materialised form of :meth:`per_example`."""
        b = int(np.asarray(y).shape[0])
        return self.per_example(x, y).weighted_sum(np.eye(b, dtype=np.float32))

    def gradient(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (d,), mean of :meth:`per_example_gradients` (the non-private path; unused by the audit)."""
        return self.per_example_gradients(x, y).mean(axis=0).astype(np.float32)


class SilencedNoise:
    """TEST/DIAGNOSTIC ONLY: a random source whose Gaussian draws are all zero (the mechanism adds no noise).

    Uniforms (the Poisson sampling) come from ``inner`` unchanged, so only the noise is broken. Used by
    ``run_audit(break_noise=True)`` to show that the audit detects a mechanism without noise.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms from the wrapped source."""
        return self.inner.random(size)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 zeros of shape ``size`` (NOT Gaussian: this is the deliberate break)."""
        return np.zeros(size, dtype=np.float64)


# ------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class CategoryAudit:
    """The audit of one IUCN category.

    Attributes:
        category: the IUCN category.
        canaries: m; included: how many were "in" (secret until the audit ends).
        guesses: r = k_plus + k_minus; correct: v.
        claimed_epsilon: the ledger's epsilon for the steps run (accountant of the settings, at ``delta``).
        lower_bound: empirical epsilon lower bound at confidence ``1 - beta``.
        ceiling: the bound had all ``guesses`` been correct: the largest epsilon this audit's size can certify
            (claims above it cannot be caught, whatever the mechanism does).
        noise_multiplier: sigma / C_c, the noise multiplier the category's records saw.
        delta: the claim's delta (the task's target_delta).
        sampling_rate: q_c, the category's Poisson rate (below the base rate under CCDP "sample").
    """

    category: IUCNCategory
    canaries: int
    included: int
    guesses: int
    correct: int
    claimed_epsilon: float
    lower_bound: float
    ceiling: float
    noise_multiplier: float
    delta: float
    sampling_rate: float = float("nan")

    @property
    def exceeds_claim(self) -> bool:
        """True when the lower bound is above the claim: evidence of a privacy bug (or a beta-probability fluke)."""
        return self.lower_bound > self.claimed_epsilon

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"category": self.category.value, "canaries": self.canaries, "included": self.included,
                "guesses": self.guesses, "correct": self.correct, "claimed_epsilon": self.claimed_epsilon,
                "lower_bound": self.lower_bound, "ceiling": self.ceiling,
                "noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
                "delta": self.delta, "exceeds_claim": self.exceeds_claim}


@dataclass(frozen=True)
class AuditResult:
    """Everything one audit measured.

    Attributes:
        settings: what ran.
        rows: one :class:`CategoryAudit` per audited category, most threatened first.
        num_real_records: real records at the audited site; num_active: N_active (real + canary slots).
        sampling_rate: the base rate q = min(1, B / N_active) (the anchor category's; each row has its own q_c).
        scores: float64 (M,) canary scores, aligned with ``design``.
        design: the canaries (with the now-revealed inclusion bits).
        wall_seconds: training + audit time.
    """

    settings: AuditSettings
    rows: tuple[CategoryAudit, ...]
    num_real_records: int
    num_active: int
    sampling_rate: float
    scores: np.ndarray
    design: CanaryDesign
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the content of ``audit.json``)."""
        return {"method": REFERENCE, "confidence": 1.0 - self.settings.beta,
                "settings": self.settings.to_json(), "num_real_records": self.num_real_records,
                "num_active": self.num_active, "sampling_rate": self.sampling_rate,
                "noise_broken": self.settings.break_noise, "seeded": self.settings.seed is not None,
                "categories": [r.to_json() for r in self.rows],
                "any_bound_exceeds_claim": any(r.exceeds_claim for r in self.rows),
                "wall_seconds": self.wall_seconds}


# ------------------------------------------------------------------------------------------------- running
def load_audit_site(num_records: int, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The audited site's real records: ``num_records`` images drawn uniformly without replacement from the
    Animal-MNIST training split (the demo's 80/20 split with seed 0), as their backbone embeddings (embedded once
    and cached, :func:`wildfed_sim.embeddings.embed_grayscale`), categories from the demo's species table.

    Returns:
        (features float32 (N, 1280), labels int64 (N,), categories int8 (N,) IUCN ranks).

    Raises:
        ConfigError: ``num_records`` < 1 or above the training split's size.
        wildfed_sim.animal_mnist.AnimalMNISTError: the data set cannot be fetched or verified.
    """
    from wildfed_sim.animal_mnist import SPECIES_TABLE, fetch_animal_mnist, split_holdout

    train, _ = split_holdout(fetch_animal_mnist(), 0.2, seed=0)
    if isinstance(num_records, bool) or not isinstance(num_records, int) or not 1 <= num_records <= len(train):
        raise ConfigError(f"site_records must be in 1..{len(train)}, got {num_records!r}", field="site-records",
                          fix="use e.g. --site-records 1000")
    pick = np.sort(np.random.default_rng(seed).choice(len(train), size=num_records, replace=False))
    labels = train.labels[pick].astype(np.int64)
    ranks = np.asarray([SPECIES_TABLE[int(k)].iucn.rank for k in labels], dtype=np.int8)
    from wildfed_sim.embeddings import embed_grayscale

    return embed_grayscale(train.images[pick], train.source_indices[pick]), labels, ranks


def _site_arrays(features: np.ndarray, labels: np.ndarray, categories: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The audited site's records as (features float32 (N, E), labels int64 (N,), IUCN ranks int8 (N,)).

    Raises:
        ConfigError: a wrong dtype or shapes that disagree (field ``site``).
    """
    images = np.asarray(features)  # the records' model inputs (canary keys take their shape and dtype)
    labels = np.asarray(labels, dtype=np.int64)
    real_ranks = np.asarray(categories).astype(np.int8)
    n_real = int(labels.shape[0])
    if images.dtype != np.float32 or images.ndim != 2 or images.shape[0] != n_real or real_ranks.shape != (n_real,):
        raise ConfigError(f"site data shapes disagree: features {images.dtype} {images.shape}, labels {labels.shape}, "
                          f"categories {real_ranks.shape}", field="site",
                          fix="pass float32 (N, 1280) backbone embeddings, (N,), (N,)")
    return images, labels, real_ranks


def _category_rows(settings: AuditSettings, design: CanaryDesign, scores: np.ndarray,
                   events: Mapping[IUCNCategory, list[DPSGDEvent]], z: Mapping[IUCNCategory, float],
                   q_by_category: Mapping[IUCNCategory, float]) -> tuple[CategoryAudit, ...]:
    """Audit each category of ``settings.categories``: guess its canaries' membership from ``scores`` (float64
    (M,), aligned with ``design``), count the correct guesses against the revealed inclusion bits, and set the
    empirical lower bound beside the accountant's claimed epsilon (its ``events``)."""
    rows = []
    for category in settings.categories:
        members = np.flatnonzero(design.categories == category.rank)
        k_plus, k_minus = guess_sizes(members.size, float(settings.guess_fraction))
        guesses = membership_guesses(scores[members], k_plus=k_plus, k_minus=k_minus)
        truth = np.where(design.included[members], 1, -1)
        r_guess = int(np.count_nonzero(guesses))
        v_correct = int(np.count_nonzero(guesses == truth))
        rows.append(CategoryAudit(
            category=category, canaries=int(members.size), included=int(design.included[members].sum()),
            guesses=r_guess, correct=v_correct,
            claimed_epsilon=epsilon_spent(events[category], target_delta=settings.target_delta,
                                          accountant=settings.accountant),
            lower_bound=epsilon_lower_bound(num_canaries=int(members.size), num_guesses=r_guess,
                                            num_correct=v_correct, delta=settings.target_delta, beta=settings.beta),
            ceiling=epsilon_lower_bound(num_canaries=int(members.size), num_guesses=r_guess, num_correct=r_guess,
                                        delta=settings.target_delta, beta=settings.beta),
            noise_multiplier=float(z[category]), delta=settings.target_delta,
            sampling_rate=float(q_by_category[category])))
    return tuple(rows)


def run_audit(settings: AuditSettings, *, features: np.ndarray, labels: np.ndarray, categories: np.ndarray,
              backend: Any = None, initial_weights: Mapping[str, np.ndarray] | None = None,
              threads: int | None = None) -> AuditResult:
    """Insert canaries into one site, run ``settings.rounds`` rounds of the gateway's CCDP training, and audit.

    See the module docstring for the method. The site's categories (its species table, public) are those of its
    real records plus the audited ones, so every audited category is active and has its noise.

    Args:
        settings: the audit's parameters.
        features: float32 (N, E), the backbone embeddings of the site's real records (what the head model trains
            on, :func:`load_audit_site`); labels: int64 (N,); categories: int (N,) IUCN ranks.
        backend: a training backend (default: a fresh torch backend of the demo's head model, 10 classes,
            ``adapter_width`` 0).
        initial_weights: the round-0 global model (default: the backend's initial weights; with the default
            backend and a seed, ``model_spec("head", 10, adapter_width=0).initial_weights(seed)``).
        threads: torch threads for the default backend.

    Returns:
        The :class:`AuditResult`.

    Raises:
        ConfigError: shapes disagree, or there are more canaries than model parameters.
        PrivacyBudgetError: from training (e.g. no budget for an active category).
    """
    from edge_sdk.backends.base import flatten
    from edge_sdk.data.camtrap_dp import LocalDataset
    from edge_sdk.privacy.randomness import make_random_source
    from edge_sdk.training import train_locally
    from shared.protocol import TrainingTask

    start = time.perf_counter()
    images, labels, real_ranks = _site_arrays(features, labels, categories)
    n_real = int(labels.shape[0])
    if backend is None:
        from edge_sdk.backends.base import create_backend
        from shared.models.kinds import model_spec

        spec = model_spec("head", 10, adapter_width=0)
        backend = create_backend("torch", model=spec, threads=threads)
        if initial_weights is None and settings.seed is not None:  # reproducible round-0 model too
            initial_weights = spec.initial_weights(settings.seed)
    weights = {k: np.asarray(v, dtype=np.float32).copy()
               for k, v in (initial_weights if initial_weights is not None else backend.get_weights()).items()}
    backend.set_weights(weights)

    design_rng = np.random.default_rng(settings.seed)  # canary design + secret inclusion (not privacy noise)
    # Secure sampling and noise unless the caller seeded the audit (then SeededRandom warns loudly).
    randomness = make_random_source(None if settings.seed is None else settings.seed + 1)
    if settings.break_noise:
        randomness = SilencedNoise(randomness)

    probe = np.sort(design_rng.choice(n_real, size=min(settings.probe_size, n_real), replace=False))
    order = rank_coordinates(backend.per_example(images[probe], labels[probe]), settings.clipping_norm, design_rng)
    if len(settings.categories) * settings.canaries_per_category > backend.num_parameters:
        raise ConfigError(f"{len(settings.categories) * settings.canaries_per_category} canaries need as many "
                          f"coordinates; the model has {backend.num_parameters}", field="canaries-per-category",
                          fix="use fewer canaries per category")
    design = design_canaries(categories=settings.categories, per_category=settings.canaries_per_category,
                             num_parameters=backend.num_parameters, coordinate_order=order, real_images=images,
                             rng=design_rng)
    total = len(design)
    all_images = np.concatenate([images, design.images])
    all_labels = np.concatenate([labels, np.zeros(total, dtype=np.int64)])  # canary labels are never used
    all_ranks = np.concatenate([real_ranks, design.categories])
    dataset = LocalDataset(images=np.zeros((len(all_labels), 1, 1), np.uint8), features=all_images,
                           labels=all_labels, categories=all_ranks,
                           media_ids=tuple(f"real-{i}" for i in range(n_real)) + tuple(f"canary-{i}"
                                                                                         for i in range(total)))
    present = set(all_ranks.tolist())
    site_categories = [c for c in IUCNCategory if c.rank in present]
    wrapped = CanaryBackend(backend, design, settings.clipping_norm)
    layout = backend.parameter_layout
    moved = np.zeros(total, dtype=np.float64)  # sum over rounds of delta at each canary's coordinate
    events: dict[IUCNCategory, list[DPSGDEvent]] = {c: [] for c in site_categories}
    z: dict[IUCNCategory, float] = {}
    q_by_category: dict[IUCNCategory, float] = {}
    q = float("nan")
    for r in range(settings.rounds):
        task = TrainingTask(federation_id="audit", round=r, model_hash="0" * 64, local_steps=settings.local_steps,
                            expected_batch_size=settings.expected_batch_size,
                            learning_rate=float(settings.learning_rate), clipping_norm=float(settings.clipping_norm),
                            target_delta=settings.target_delta, planned_rounds=settings.rounds, privacy="ccdp",
                            ccdp_variant=settings.ccdp_variant,
                            budgets=settings.budget.table())
        result = train_locally(backend=wrapped, dataset=dataset, task=task, global_weights=weights,
                               site_categories=site_categories, randomness=randomness)
        moved += flatten(result.delta, layout)[design.coordinates].astype(np.float64)
        weights = {k: (weights[k] + result.delta[k]).astype(np.float32) for k in weights}  # one-site FedAvg
        for c, e in result.report.events.items():
            events[c].append(e)
        z, q = dict(result.noise_multipliers), float(result.sampling_rate)
        q_by_category = result.sampling_rates

    scores = -moved
    rows = _category_rows(settings, design, scores, events, z, q_by_category)
    return AuditResult(settings=settings, rows=rows, num_real_records=n_real, num_active=len(dataset),
                       sampling_rate=q, scores=scores, design=design, wall_seconds=time.perf_counter() - start)
