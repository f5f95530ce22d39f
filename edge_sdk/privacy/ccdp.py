"""CCDP: conservation-calibrated DP-SGD as individualized DP-SGD (written once, backend-agnostic).

Each IUCN category c has its own budget eps_c (``shared.iucn``). CCDP meets every budget exactly with ONE Gaussian
draw per step, as individualized DP-SGD does (Boenisch, Mühl, Dziedzic, Rinberg and Papernot, "Have it your way:
individualized privacy assignment for DP-SGD", NeurIPS 2023, Sec. 4; docs/privacy.md). Two
variants, both behind :class:`CCDPMechanism`:

- **Sample** (the paper's Sec. 4.1): one noise multiplier z and one clipping norm C for every record; the records
  of category c are Poisson-sampled at their own rate q_c. Category c's records go through
  ``PoissonSampled(q_c, Gaussian(z))`` per step.
- **Scale** (Sec. 4.2): one sampling rate q and one noise standard deviation sigma for every record; the records of
  category c are clipped at their own norm ``C_c = sigma / z_c``. Category c's records go through
  ``PoissonSampled(q, Gaussian(z_c))`` per step (a record's sensitivity is C_c, the noise sigma = z_c C_c).

One step, for per-example gradients g_i (B, d) of the batch (Abadi et al. 2016, Alg. 1, with per-record rates
and clipping norms)::

    sample:  record i joins the batch with probability q_{cat(i)}         (independently, every step)
    clip:    g_i <- g_i * min(1, C_{cat(i)} / ||g_i||_2)
    noise:   g~  = (sum_{i in batch} g_i + N(0, sigma^2 I_d)) / (q N_site)

Formal guarantee (per record, add/remove-one): adding or removing one record x of category c changes the clipped
sum by at most C_c in L2 norm, and x is in the batch with probability q_c independently of every other record, so
each step is, for x, the Poisson-subsampled Gaussian mechanism with rate q_c and noise multiplier sigma / C_c; over
the steps run this is the :class:`shared.privacy.events.DPSGDEvent` ``(sigma / C_c, q_c, steps)`` that
:meth:`CCDPPlan.events` reports for category c (the individualized analysis of the paper's Thm 4.1 and 4.2:
the privacy loss of a record depends only on its own rate and sensitivity). The ledger records exactly that event,
so the epsilon it prints for category c is the epsilon of what category c's records went through.

Calibration (:func:`plan_ccdp`, with dp-accounting; the gateway uses only public values: the budgets, the site's
species table, the halted list, B and N_site):

- the *anchor* is the category of the site's species table with the largest budget (halted or not, so z does not
  change when a category halts); it is sampled at the base rate q = min(1, B/N_site) with clipping norm C (the
  task's), and z is calibrated so that it spends exactly its budget over the planned steps;
- Sample: for every other active category, q_c = the largest rate <= q at which ``PoissonSampled(q_c,
  Gaussian(z))`` over the planned steps spends eps_c (``shared.privacy.accounting.calibrate_sampling_rate``);
- Scale: for every other active category, z_c is calibrated at rate q for eps_c and ``C_c = z C / z_c``.

The searches take seconds and their answer is the same every round of a federation (and at every restart of the
gateway): it is memoised in the process and, given a
:class:`~shared.privacy.calibration_cache.CalibrationCache`, kept on disk as JSON keyed by
:func:`calibration_inputs` and the library versions and calibration code (:func:`calibration_environment`). A cached
z and q_c / z_c are used only after each active category's event has been re-checked within its budget by one
accountant evaluation; the plan is then the same arithmetic on them as on fresh ones, so it is bit-identical.

Normaliser. The step is divided by q N_site, the expected batch size of the anchor's rate over all the site's
records: a public number. The paper normalises by the expected batch size ``sum_c q_c N_c``, which is a function of
the site's per-category record counts; those are private (one record of category c changes N_c), so dividing by it
would release a function of the data that no noise covers. With Scale the two agree; with Sample the step is
smaller by the factor ``sum_c q_c N_c / (q N_site)``, which the learning rate absorbs (docs/privacy.md).

Active categories are the categories of the site's species table that the ledger has not halted: decided by
configuration, never by which records a batch holds. Noise is drawn and added in float64 and the result is cast to
float32 once (the backends' parameter dtype).

=====================================  ===================================================
batch empty                            output is pure noise / (q N_site); still a step
record of a non-active category        :class:`PrivacyBudgetError` (sampling must exclude it)
all categories halted                  :class:`PrivacyBudgetError` (the site stops training)
=====================================  ===================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.protocol import CCDP_VARIANTS

from edge_sdk.privacy.ccdp_plan import (CALIBRATION_KIND, CCDPPlan, _NUM_RANKS, calibration_environment,
                                       calibration_inputs, plan_ccdp, rank_table)
from edge_sdk.privacy.per_example import MaterialisedGradients, PerExampleGradients
from edge_sdk.privacy.randomness import RandomSource

__all__ = [
    "CCDPVariant",
    "CCDP_VARIANTS",
    "clip_factors",
    "clip_factors_from_norms",
    "clip_per_example",
    "CCDPPlan",
    "CCDPMechanism",
    "active_categories",
    "plan_ccdp",
    "calibration_inputs",
    "calibration_environment",
    "CALIBRATION_KIND",
    "rank_table",
]

CCDPVariant = Literal["sample", "scale"]

# Clipping scales by C/||g|| times this, so float32 rounding (of the gradient or of a norm computed without
# materialising it) cannot push a clipped norm above C.
_CLIP_SAFETY = 1.0 - 1e-5


def clip_factors_from_norms(norms: np.ndarray, clipping_norm: float | np.ndarray) -> np.ndarray:
    """Per-example scale factors ``min(1, C_i / ||g_i||_2)`` (Abadi et al. 2016, Alg. 1, "clip gradient").

    Args:
        norms: float (B,), L2 norms of the per-example gradients.
        clipping_norm: C > 0 (L2), one for every example, or float (B,) one per example (individualized clipping,
            the "Scale" variant).

    Returns:
        float32 (B,), in (0, 1]. When clipping is active the factor is shrunk by a relative 1e-5 so that float32
        rounding cannot push a clipped norm above C_i.

    Raises:
        ValueError: a clipping norm not positive, or a per-example array of the wrong shape.
    """
    norms = np.asarray(norms, dtype=np.float64)
    bound = np.asarray(clipping_norm, dtype=np.float64)
    if bound.ndim == 0:
        if not bound > 0:
            raise ValueError(f"clipping_norm must be > 0, got {clipping_norm}")
        bound = np.full(norms.shape, float(bound))
    elif bound.shape != norms.shape:
        raise ValueError(f"expected clipping norms {norms.shape}, got {bound.shape}")
    elif not np.all(bound > 0):
        raise ValueError("every clipping norm must be > 0")
    factors = np.ones_like(norms)
    over = norms > bound
    factors[over] = (bound[over] / norms[over]) * _CLIP_SAFETY
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
    """The CCDP step for one site: per-category clipping, one Gaussian draw, the public normaliser (module
    docstring).

    Attributes:
        clipping_norms: ``{category: C_c}`` for exactly the active categories (L2, > 0).
        noise_std: sigma (> 0), the standard deviation per coordinate of the one draw.
        expected_batch_size: q N_site (> 0), the public normaliser.
        noise: the random source of the Gaussian noise (a :class:`~edge_sdk.privacy.randomness.SecureRandom` in
            production).

    Raises:
        PrivacyBudgetError: no active category.
        ValueError: a C_c, sigma or the expected batch size not positive.
    """

    clipping_norms: Mapping[IUCNCategory, float]
    noise_std: float
    expected_batch_size: float
    noise: RandomSource = field(repr=False)
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.clipping_norms:
            raise PrivacyBudgetError("no active IUCN category: every category is halted, the site stops training")
        if not self.noise_std > 0:
            raise ValueError(f"noise_std must be > 0, got {self.noise_std}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")
        for category, c in self.clipping_norms.items():
            if not c > 0:
                raise ValueError(f"clipping norm of {category.value} must be > 0, got {c}")
        object.__setattr__(self, "_table", rank_table(self.clipping_norms))

    @classmethod
    def from_plan(cls, plan: CCDPPlan, *, expected_batch_size: float, noise: RandomSource) -> "CCDPMechanism":
        """The mechanism that runs ``plan`` (its clipping norms and sigma; the sampling is the caller's, with
        :meth:`CCDPPlan.inclusion_rates`)."""
        return cls(clipping_norms=dict(plan.clipping_norms), noise_std=plan.noise_std,
                   expected_batch_size=float(expected_batch_size), noise=noise)

    @property
    def categories(self) -> tuple[IUCNCategory, ...]:
        """Active categories in IUCN rank order."""
        return tuple(sorted(self.clipping_norms, key=lambda c: c.rank))

    def clipped_sum(self, per_example_grads: np.ndarray | PerExampleGradients, categories: np.ndarray) -> np.ndarray:
        """``sum_i g_i min(1, C_{cat(i)} / ||g_i||)`` as float64 (d,), one weighted sum (no noise).

        Args:
            per_example_grads: float32 (B, d) array, B >= 0, or a
                :class:`~edge_sdk.privacy.per_example.PerExampleGradients` (norms + weighted sums).
            categories: int (B,), IUCN rank of each example.

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        grads = (per_example_grads if isinstance(per_example_grads, PerExampleGradients)
                 else MaterialisedGradients(per_example_grads))
        ranks = np.asarray(categories).astype(np.int64)
        if ranks.shape != (grads.batch_size,):
            raise ValueError(f"expected categories ({grads.batch_size},), got {ranks.shape}")
        bound = np.zeros(ranks.shape, dtype=np.float64)  # the lookup table doubles as the category check
        in_range = (ranks >= 0) & (ranks < _NUM_RANKS)
        bound[in_range] = self._table[ranks[in_range]]
        stray = ~(bound > 0)
        if np.any(stray):
            raise PrivacyBudgetError(
                f"{int(stray.sum())} example(s) of IUCN rank(s) {sorted(set(ranks[stray].tolist()))} are in the batch "
                "but their category is not active (halted or not in the species table); sampling must exclude them"
            )
        factors = clip_factors_from_norms(grads.norms, bound)
        return np.asarray(grads.weighted_sum(factors[None, :]), dtype=np.float64).reshape(-1)

    def privatize(self, per_example_grads: np.ndarray | PerExampleGradients, categories: np.ndarray) -> np.ndarray:
        """The whole step, as training runs it: per-example gradients ((B, d) array or implicit) -> float32 (d,)
        private mean gradient ``(sum_i clip_{C_cat(i)}(g_i) + N(0, sigma^2 I)) / (q N_site)``.

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        total = self.clipped_sum(per_example_grads, categories)
        total += self.noise_std * self.noise.standard_normal(total.shape[0])
        total *= 1.0 / self.expected_batch_size
        return total.astype(np.float32)


def active_categories(
    site_categories: Iterable[IUCNCategory], halted: Iterable[IUCNCategory]
) -> tuple[IUCNCategory, ...]:
    """The site's categories (from its species table) that are not halted, in IUCN rank order."""
    halted_set = set(halted)
    return tuple(sorted({c for c in site_categories if c not in halted_set}, key=lambda c: c.rank))
