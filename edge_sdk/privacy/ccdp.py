"""CCDP: conservation-calibrated DP-SGD, the per-category Gaussian mechanism (written once, backend-agnostic).

One step, for per-example gradients g_i (B, d) of a Poisson-sampled batch (DESIGN.md, "Privacy semantics";
DP-SGD of Abadi et al. 2016, Alg. 1, with one noisy sum per IUCN category):

1. clip:      g_i <- g_i * min(1, C / ||g_i||_2)                       so every ||g_i||_2 <= C
2. sum:       S_c  = sum_{i in batch, cat(i) = c} g_i                  for every ACTIVE category c
3. noise:     S~_c = S_c + N(0, (z_c C)^2 I_d)                         independently per category
4. combine:   g~   = (sum_c S~_c) / (q * N_active)                     post-processing; expected batch size

Active categories are the categories of the site's species table that the ledger has not halted. They are decided
by configuration and the task, never by which records the batch happens to hold: a category with no record in the
batch still gets its noise, so the noise magnitude reveals nothing about the data.

Formal guarantee: a record lies in exactly one category's sum, and adding/removing it changes that sum by at most
C in L2 norm and no other sum; so (parallel composition) the record's privacy is that of the Poisson-subsampled
Gaussian mechanism with noise multiplier z_c and rate q, composed over the steps run, i.e. the
:class:`shared.privacy.events.DPSGDEvent` ``(z_c, q, steps)`` reported for its category. Step 4 is
post-processing. Dividing by the expected (public) batch size instead of the realised (private) one keeps the
output a function of the noisy sums alone.

Implementation note: one draw with the summed variance. The released value is
g~ = (sum_c (S_c + N_c)) / (q N_active) with N_c ~ N(0, (z_c C)^2 I_d) independent. A sum of independent Gaussians
is Gaussian with the summed covariance, so sum_c N_c ~ N(0, sigma_tot^2 I_d) with sigma_tot^2 = sum_c (z_c C)^2, and

    g~  =_d  (sum_c S_c + N(0, sigma_tot^2 I_d)) / (q N_active) = (total clipped sum + one draw) / (q N_active):

the two expressions have the same distribution for every batch, so they are the same mechanism (the same output
distribution on every pair of neighbouring datasets, hence the same per-category guarantee: a record's
influence is still bounded by C and it is still covered by its own category's z_c C share of the noise).
:meth:`CCDPMechanism.privatize`, the production path, draws that one vector (K times fewer secure Gaussians for
K active categories, and one weighted sum instead of K); :meth:`CCDPMechanism.noisy_category_sums` with
:meth:`CCDPMechanism.combine` is the per-category reference implementation, and the tests check that both agree
(exactly without noise, in per-coordinate standard deviation with it). Only the released g~ is computed: the
per-category noisy sums S~_c are never released, so nothing needs them individually.

Noise is drawn and added in float64 and the result is cast to float32 once (the backends' parameter dtype).

Edge cases:

=====================================  ===================================================
batch empty                            output is pure noise / (q N_active); still a step
category active but not in the batch   its noise is added anyway
record of a non-active category        :class:`PrivacyBudgetError` (sampling must exclude it)
all categories halted                  :class:`PrivacyBudgetError` (the site stops training)
=====================================  ===================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import calibrated_noise_multiplier
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.per_example import MaterialisedGradients, PerExampleGradients
from edge_sdk.privacy.randomness import RandomSource

__all__ = [
    "clip_factors",
    "clip_factors_from_norms",
    "clip_per_example",
    "CCDPMechanism",
    "active_categories",
    "calibrate_category_noise",
    "category_events",
]

# Clipping scales by C/||g|| times this, so float32 rounding (of the gradient or of a norm computed without
# materialising it) cannot push a clipped norm above C.
_CLIP_SAFETY = 1.0 - 1e-5


def clip_factors_from_norms(norms: np.ndarray, clipping_norm: float) -> np.ndarray:
    """Per-example scale factors ``min(1, C / ||g_i||_2)`` (Abadi et al. 2016, Alg. 1, "clip gradient").

    Args:
        norms: float (B,), L2 norms of the per-example gradients.
        clipping_norm: C > 0, L2.

    Returns:
        float32 (B,), in (0, 1]. When clipping is active the factor is shrunk by a relative 1e-5 so that float32
        rounding cannot push a clipped norm above C.

    Raises:
        ValueError: C not positive.
    """
    if not clipping_norm > 0:
        raise ValueError(f"clipping_norm must be > 0, got {clipping_norm}")
    norms = np.asarray(norms, dtype=np.float64)
    factors = np.ones_like(norms)
    over = norms > clipping_norm
    factors[over] = (clipping_norm / norms[over]) * _CLIP_SAFETY
    return factors.astype(np.float32)


def clip_factors(per_example_grads: np.ndarray, clipping_norm: float) -> np.ndarray:
    """:func:`clip_factors_from_norms` of the rows of a float (B, d) array (norms computed in float64)."""
    return clip_factors_from_norms(MaterialisedGradients(per_example_grads).norms, clipping_norm)


def clip_per_example(per_example_grads: np.ndarray, clipping_norm: float) -> np.ndarray:
    """Clipped per-example gradients, float32 (B, d), each with L2 norm <= C (see :func:`clip_factors`)."""
    grads = np.asarray(per_example_grads, dtype=np.float32)
    return grads * clip_factors(grads, clipping_norm)[:, None]


@dataclass(frozen=True)
class CCDPMechanism:
    """The CCDP step for one site (see the module docstring for the maths and the guarantee).

    Attributes:
        clipping_norm: C, L2 bound of each example's contribution.
        noise_multipliers: ``{category: z_c}`` for exactly the active categories; z_c = sigma_c / C > 0.
        expected_batch_size: q * N_active (> 0), the public normaliser.
        noise: the random source of the Gaussian noise (a :class:`~edge_sdk.privacy.randomness.SecureRandom` in
            production).

    Raises:
        PrivacyBudgetError: no active category.
        ValueError: C, a z_c or the expected batch size not positive.
    """

    clipping_norm: float
    noise_multipliers: Mapping[IUCNCategory, float]
    expected_batch_size: float
    noise: RandomSource = field(repr=False)

    def __post_init__(self) -> None:
        if not self.noise_multipliers:
            raise PrivacyBudgetError("no active IUCN category: every category is halted, the site stops training")
        if not self.clipping_norm > 0:
            raise ValueError(f"clipping_norm must be > 0, got {self.clipping_norm}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")
        for category, z in self.noise_multipliers.items():
            if not z > 0:
                raise ValueError(f"noise multiplier of {category.value} must be > 0, got {z}")

    @property
    def categories(self) -> tuple[IUCNCategory, ...]:
        """Active categories in IUCN rank order; row k of :meth:`noisy_category_sums` is ``categories[k]``."""
        return tuple(sorted(self.noise_multipliers, key=lambda c: c.rank))

    def noisy_category_sums(self, per_example_grads: np.ndarray | PerExampleGradients,
                            categories: np.ndarray) -> np.ndarray:
        """Stages 1-3: clip, sum per active category, add that category's Gaussian noise.

        Args:
            per_example_grads: float32 (B, d) array, B >= 0, or a
                :class:`~edge_sdk.privacy.per_example.PerExampleGradients` (norms + weighted sums).
            categories: int (B,), IUCN rank of each example.

        Returns:
            float64 (K, d), K = number of active categories, rows ordered as :attr:`categories`.

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        grads, ranks, factors = self._clip(per_example_grads, categories)
        order = self.categories
        active_ranks = np.asarray([c.rank for c in order], dtype=np.int64)
        # Clip and sum in one weighted sum: weights[k, i] = factor_i if cat(i) == k else 0.
        weights = (ranks[None, :] == active_ranks[:, None]).astype(np.float32) * factors[None, :]
        sums = np.asarray(grads.weighted_sum(weights), dtype=np.float64)
        stds = np.asarray([self.noise_multipliers[c] * self.clipping_norm for c in order], dtype=np.float64)
        return sums + stds[:, None] * self.noise.standard_normal((len(order), sums.shape[1]))

    def combine(self, noisy_sums: np.ndarray) -> np.ndarray:
        """Stage 4 (post-processing): ``sum_c S~_c / expected_batch_size`` as float32 (d,)."""
        return (np.sum(noisy_sums, axis=0) / self.expected_batch_size).astype(np.float32)

    @property
    def total_noise_std(self) -> float:
        """``sigma_tot = sqrt(sum_c (z_c C)^2)`` over the active categories: the std of the one Gaussian draw of
        :meth:`privatize` (see "Implementation note" in the module docstring)."""
        return float(np.sqrt(sum((z * self.clipping_norm) ** 2 for z in self.noise_multipliers.values())))

    def privatize(self, per_example_grads: np.ndarray | PerExampleGradients, categories: np.ndarray) -> np.ndarray:
        """The whole step, as training runs it: per-example gradients ((B, d) array or implicit) -> float32 (d,)
        private mean gradient ``(sum_i clip(g_i) + N(0, sigma_tot^2 I)) / (q N_active)``.

        Same output distribution as :meth:`privatize_reference` (``combine(noisy_category_sums(...))``), with one
        weighted sum and one Gaussian draw instead of K (module docstring, "Implementation note").

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        grads, _, factors = self._clip(per_example_grads, categories)
        total = np.asarray(grads.weighted_sum(factors[None, :]), dtype=np.float64).reshape(-1)
        total += self.total_noise_std * self.noise.standard_normal(total.shape[0])
        total *= 1.0 / self.expected_batch_size
        return total.astype(np.float32)

    def privatize_reference(self, per_example_grads: np.ndarray | PerExampleGradients,
                            categories: np.ndarray) -> np.ndarray:
        """Stages 1-4 literally (K noisy category sums, then combined): the reference :meth:`privatize` is
        tested against."""
        return self.combine(self.noisy_category_sums(per_example_grads, categories))

    def _clip(self, per_example_grads: np.ndarray | PerExampleGradients,
              categories: np.ndarray) -> tuple[PerExampleGradients, np.ndarray, np.ndarray]:
        """Checks shapes and categories; returns (gradients, int64 ranks (B,), float32 clip factors (B,))."""
        grads = (per_example_grads if isinstance(per_example_grads, PerExampleGradients)
                 else MaterialisedGradients(per_example_grads))
        ranks = np.asarray(categories).astype(np.int64)
        if ranks.shape != (grads.batch_size,):
            raise ValueError(f"expected categories ({grads.batch_size},), got {ranks.shape}")
        # a lookup table over the IUCN ranks instead of np.isin: the same test, a fraction of the per-step cost
        active = np.zeros(max(c.rank for c in IUCNCategory) + 1, dtype=bool)
        active[[c.rank for c in self.noise_multipliers]] = True
        in_range = (ranks >= 0) & (ranks < active.shape[0])
        stray = ~in_range
        stray[in_range] = ~active[ranks[in_range]]
        if np.any(stray):
            raise PrivacyBudgetError(
                f"{int(stray.sum())} example(s) of IUCN rank(s) {sorted(set(ranks[stray].tolist()))} are in the batch "
                "but their category is not active (halted or not in the species table); sampling must exclude them"
            )
        return grads, ranks, clip_factors_from_norms(grads.norms, self.clipping_norm)


def active_categories(
    site_categories: Iterable[IUCNCategory], halted: Iterable[IUCNCategory]
) -> tuple[IUCNCategory, ...]:
    """The site's categories (from its species table) that are not halted, in IUCN rank order."""
    halted_set = set(halted)
    return tuple(sorted({c for c in site_categories if c not in halted_set}, key=lambda c: c.rank))


def calibrate_category_noise(
    *,
    budgets: Mapping[IUCNCategory, float],
    active: Iterable[IUCNCategory],
    target_delta: float,
    sampling_rate: float,
    steps: int,
    fixed_events: tuple[DPSGDEvent, ...] = (),
) -> dict[IUCNCategory, float]:
    """Noise multiplier per active category from its epsilon budget, with the real (RDP) accountant.

    ``z_c = calibrate_noise_multiplier(target_epsilon=budgets[c], target_delta, q, steps)`` where ``steps`` is the
    number of DP-SGD steps planned for the whole federation (``planned_rounds * local_steps``), so running them
    all spends at most ``budgets[c]`` (dp-accounting ``calibrate_dp_mechanism``; never the textbook single-release
    Gaussian formula, shown only beside the ledger in `budget`; it holds only for eps < 1 and one step).
    ``fixed_events`` are other releases about every record whose noise is already set (NIRA's noisy counts over the
    planned rounds): the steps are calibrated so that they and those releases together stay within the budget.

    Raises:
        PrivacyBudgetError: an active category has no budget in ``budgets``.
        ConfigError: a budget, delta, q or steps out of range (from ``shared.privacy.accounting``).
    """
    out: dict[IUCNCategory, float] = {}
    for category in active:
        if category not in budgets:
            raise PrivacyBudgetError(
                f"the task gives no epsilon budget for active category {category.value}; refusing to train it "
                "(the coordinator must send a budget for every category of the site, or halt it)"
            )
        out[category] = calibrated_noise_multiplier(float(budgets[category]), float(target_delta),
                                                    float(sampling_rate), int(steps), "rdp", tuple(fixed_events))
    return out


def category_events(
    noise_multipliers: Mapping[IUCNCategory, float], *, sampling_rate: float, steps_run: int
) -> dict[IUCNCategory, DPSGDEvent]:
    """The DP events of what actually ran: ``DPSGDEvent(z_c, q, steps_run)`` per active category."""
    return {c: DPSGDEvent(float(z), float(sampling_rate), int(steps_run)) for c, z in noise_multipliers.items()}
