"""Adaptive grouped noise: one upload's clipped model delta, Gaussian noise per parameter group from a fixed budget.

docs/radiomap.md, "The mechanism" (radio maps, base-station gateways). The upload is the
flat model delta u (d,) of a site's local training round (:func:`shared.protocol.canonical_flatten` order), split
into the groups of a :class:`shared.models.radio_unet.GroupLayout` (transmitter-sensitive weights of each stage and
each stage's residual). With clipping norm C, noise multiplier z and group sizes d_g (sum d):

1. clip:    u <- u * min(1, C / ||u||_2)                               (one L2 clip of the whole update)
2. budget:  B = d (z C)^2                                              (total noise variance of the upload)
3. shares:  a_g >= 0 with sum_g a_g = 1                                (the defence decides them)
4. noise:   u~_g = u_g + N(0, sigma_g^2 I_{d_g}),  sigma_g^2 = a_g B / d_g

so every defence spends the same total variance B; ``uniform`` (a_g = d_g / d) is the plain Gaussian mechanism
N(0, (zC)^2 I_d). The defences (:data:`DEFENCES`):

=================  ===========================================================  ==================================
defence            shares a_g                                                   (eps, delta) stated by the ledger
=================  ===========================================================  ==================================
none               no clipping, no noise                                        none (no guarantee)
clip-only          clipping, no noise                                           none (no guarantee)
uniform            d_g / d                                                      Gaussian, z_eff = z / 2
steered-uniform    d_g / d_S on the sensitive groups (d_S their total), 0 else  none: the residual is not noised
adaptive           phi d_g / d + (1 - phi) softmax(f_eta(s))_g                  Gaussian, z_eff = sqrt(phi) z / 2
grouped-clipping   per-group clipping norms and noise (below)                   Gaussian, z_eff = z / 2
=================  ===========================================================  ==================================

Grouped clipping allocates clipping as well as noise, from public data only. A public *clipping
profile* m_g > 0 (the typical norm of group g's update: :func:`clipping_profile`, the median over public proxy sites
at the global model) gives per-group norms ``C_g = C m_g / ||m||`` (so sum_g C_g^2 = C^2), each group is clipped to
its own C_g, and group g gets Gaussian noise of per-coordinate std sigma_g with::

    sigma_g^2 = z^2 S C_g / sqrt(d_g),   S = sum_h C_h sqrt(d_h)

Two neighbouring datasets give group-clipped updates at most 2 C_g apart in group g, so after scaling each group
by 1 / sigma_g the mechanism is the Gaussian mechanism with unit noise and L2 sensitivity
``2 sqrt(sum_g (C_g / sigma_g)^2) = 2 / z``: the same privacy profile as ``uniform`` (z_eff = z / 2), exactly.
Among all sigma_g with that sensitivity, these minimise the total noise variance sum_g d_g sigma_g^2 (a Lagrange
multiplier: d_g sigma_g proportional to C_g^2 / sigma_g^3); with one group they are uniform's z C.

The adaptive defence and its floor. ``floor_fraction`` phi in (0, 1] reserves the part phi of the budget for a
uniform floor, so every coordinate's variance is at least sigma_floor^2 = phi (zC)^2 whatever the allocator says.
It is drawn in two parts, which is what makes the stated guarantee honest:

a. y = u + N(0, sigma_floor^2 I_d): the Gaussian mechanism; this is the only step that touches the private data.
b. statistics s = :func:`upload_statistics` (y): computed from y, never from u.
c. allocator shares softmax(f_eta(s)); the allocator's weights eta are trained on public maps only
   (:mod:`edge_sdk.privacy.noise_allocator`), never on the site's records.
d. u~ = y + N(0, (sigma_g^2 - sigma_floor^2) I_{d_g}) per group: fresh noise whose variance depends only on (b, c).

Steps b-d are post-processing of y (Dwork and Roth 2014, Prop. 2.1), so u~ has y's guarantee. The seed computes
the statistics from the un-noised update and states no guarantee; doing so would make the noise variance itself a
function of the private data (a d_g-dimensional sample estimates its variance to a relative sqrt(2 / d_g), so the
variance would be released almost exactly), which is why the statistics are taken from y here.

Formal guarantee (adaptive and uniform): any two datasets of the site (in particular add/remove one record) give
clipped updates at most 2C apart in L2, so y is the Gaussian mechanism with L2 sensitivity 2C and standard deviation
sigma_floor; its privacy profile equals that of sensitivity 1 and noise multiplier z_eff = sigma_floor / (2C)
(Balle and Wang 2018, Thm. 8: the Gaussian mechanism's profile depends on sensitivity / sigma only). One upload is
``DPSGDEvent(z_eff, sampling_rate=1, steps=1)`` (:meth:`AdaptiveGroupedNoise.dp_event`), composed per site over its
uploads by the ledger's accountant. The guarantee covers the whole local dataset of the upload, so it is also a
site-level guarantee for that upload. Noise is drawn in float64 from the injected :class:`RandomSource` (a
:class:`~shared.privacy.randomness.SecureRandom` in production) and the result is cast to float32 once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.models.radio_unet import GroupLayout
from shared.privacy.events import DPSGDEvent
from shared.protocol import GUARANTEED_RADIO_DEFENCES, RADIO_DEFENCES

from edge_sdk.privacy.randomness import RandomSource

__all__ = ["DEFENCES", "GUARANTEED_DEFENCES", "STATISTICS", "clip_update", "uniform_shares", "steered_shares",
           "floored_shares", "group_noise_std", "upload_statistics", "PrivatisedUpload", "AdaptiveGroupedNoise",
           "clipping_profile", "grouped_clipping_norms", "grouped_clipping_noise_std", "clip_groups"]

DEFENCES = RADIO_DEFENCES
"""The defences of the seed's evaluation, weakest first (the wire names of :class:`shared.protocol.RadioTask`)."""
GUARANTEED_DEFENCES = GUARANTEED_RADIO_DEFENCES
"""The defences for which the ledger states an (eps, delta): every coordinate gets Gaussian noise."""
STATISTICS = ("signal_norm", "mean_magnitude", "std", "size_ratio", "round", "stage", "sensitive")
"""The upload statistics s_{k,r} per group (columns of :func:`upload_statistics`)."""

_CLIP_SAFETY = 1.0 - 1e-6


def clip_update(update: np.ndarray, clipping_norm: float) -> tuple[np.ndarray, float]:
    """``update * min(1, C / ||update||_2)`` (McMahan et al. 2018, "Learning differentially private recurrent
    language models", Alg. 1, flat clipping).

    Args:
        update: float (d,), a flat model delta.
        clipping_norm: C > 0 (L2, in the model's parameter units).

    Returns:
        (float64 (d,) clipped update with L2 norm <= C, the L2 norm before clipping). The clip factor is shrunk by a
        relative 1e-6 so float rounding cannot leave the norm above C.

    Raises:
        ValueError: C not positive and finite, or the update is not a finite 1-D array.
    """
    if not (isinstance(clipping_norm, (int, float)) and 0 < clipping_norm < math.inf):
        raise ValueError(f"clipping_norm must be positive and finite, got {clipping_norm!r}")
    u = np.asarray(update, dtype=np.float64)
    if u.ndim != 1 or not np.all(np.isfinite(u)):
        raise ValueError(f"update must be a finite 1-D array, got shape {u.shape}")
    norm = float(np.linalg.norm(u))
    if norm > clipping_norm:
        u = u * (clipping_norm / norm * _CLIP_SAFETY)
    return u, norm


def uniform_shares(layout: GroupLayout) -> np.ndarray:
    """float64 (G,): a_g = d_g / d, the shares that give every coordinate the same variance."""
    sizes = layout.sizes.astype(np.float64)
    return sizes / sizes.sum()


def steered_shares(layout: GroupLayout) -> np.ndarray:
    """float64 (G,): the whole budget spread evenly over the coordinates of the transmitter-sensitive groups
    (a_g = d_g / d_S there, 0 elsewhere).

    Raises:
        ValueError: the layout has no sensitive group.
    """
    sensitive = np.asarray(layout.sensitive, dtype=bool)
    if not sensitive.any():
        raise ValueError("steered-uniform needs at least one transmitter-sensitive group")
    sizes = np.where(sensitive, layout.sizes, 0).astype(np.float64)
    return sizes / sizes.sum()


def floored_shares(allocator_shares: np.ndarray, layout: GroupLayout, floor_fraction: float) -> np.ndarray:
    """a = phi * d_g / d + (1 - phi) * allocator_shares: sums to 1 and never gives a coordinate less than the
    fraction phi of the uniform variance, whatever the allocator outputs.

    Args:
        allocator_shares: float (G,), non-negative, summing to 1 (a softmax output).
        layout: the groups.
        floor_fraction: phi in (0, 1].

    Raises:
        ValueError: phi out of range, or the shares are not a probability vector of length G (within 1e-6).
    """
    if not (isinstance(floor_fraction, (int, float)) and 0 < floor_fraction <= 1):
        raise ValueError(f"floor_fraction must be in (0, 1], got {floor_fraction!r}")
    p = np.asarray(allocator_shares, dtype=np.float64)
    if p.shape != (len(layout.names),) or np.any(p < 0) or not np.all(np.isfinite(p)) or abs(p.sum() - 1) > 1e-6:
        raise ValueError(f"allocator shares must be {len(layout.names)} non-negative numbers summing to 1, got {p}")
    return floor_fraction * uniform_shares(layout) + (1.0 - floor_fraction) * p / p.sum()


def group_noise_std(shares: np.ndarray, layout: GroupLayout, *, noise_multiplier: float,
                    clipping_norm: float) -> np.ndarray:
    """float64 (G,): sigma_g = sqrt(a_g B / d_g) with B = d (z C)^2, per-coordinate noise standard deviation of
    each group (in parameter units); sum_g d_g sigma_g^2 = B."""
    sizes = layout.sizes.astype(np.float64)
    budget = layout.dimension * (noise_multiplier * clipping_norm) ** 2
    return np.sqrt(np.asarray(shares, dtype=np.float64) * budget / sizes)


def clipping_profile(updates: np.ndarray, layout: GroupLayout) -> np.ndarray:
    """float64 (G,): the median over public proxy updates of each group's L2 norm (floored at 1e-3 of the largest,
    so no group gets a zero clipping norm): the grouped-clipping defence's public profile m_g.

    Args:
        updates: float (n, d), un-clipped updates of public proxy sites at the global model (n >= 1).

    Raises:
        ValueError: not (n, d) with n >= 1, or not finite.
    """
    u = np.asarray(updates, dtype=np.float64)
    if u.ndim != 2 or u.shape[0] < 1 or u.shape[1] != layout.dimension or not np.all(np.isfinite(u)):
        raise ValueError(f"updates must be finite (n >= 1, {layout.dimension}), got {u.shape}")
    g = len(layout.names)
    norms = np.sqrt(np.stack([np.bincount(layout.index, weights=row * row, minlength=g) for row in u]))
    m = np.median(norms, axis=0)
    return np.maximum(m, 1e-3 * float(m.max()) if m.max() > 0 else 1.0)


def grouped_clipping_norms(profile: np.ndarray, clipping_norm: float) -> np.ndarray:
    """float64 (G,): ``C_g = C m_g / ||m||_2`` (module docstring, "Grouped clipping"); sum_g C_g^2 = C^2.

    Raises:
        ValueError: a profile entry not positive and finite, or C not positive.
    """
    m = np.asarray(profile, dtype=np.float64)
    if m.ndim != 1 or not np.all(np.isfinite(m)) or np.any(m <= 0) or not clipping_norm > 0:
        raise ValueError("the clipping profile must be positive and finite, and C positive")
    return clipping_norm * m / float(np.linalg.norm(m))


def grouped_clipping_noise_std(norms: np.ndarray, layout: GroupLayout, *, noise_multiplier: float) -> np.ndarray:
    """float64 (G,): ``sigma_g = z sqrt(S C_g / sqrt(d_g))``, ``S = sum_h C_h sqrt(d_h)`` (module docstring): the
    per-coordinate noise std that gives the whitened sensitivity 2 / z with the least total variance."""
    c = np.asarray(norms, dtype=np.float64)
    roots = np.sqrt(layout.sizes.astype(np.float64))
    total = float((c * roots).sum())
    return noise_multiplier * np.sqrt(total * c / roots)


def clip_groups(update: np.ndarray, layout: GroupLayout, norms: np.ndarray) -> tuple[np.ndarray, float]:
    """Each group scaled to at most its own norm: ``u_g * min(1, C_g / ||u_g||)`` (the clip factor shrunk by a
    relative 1e-6 as in :func:`clip_update`). Returns (float64 (d,), the whole update's L2 norm before clipping).

    Raises:
        ValueError: the update is not a finite (d,) array, or a norm is not positive.
    """
    u = np.asarray(update, dtype=np.float64)
    if u.shape != (layout.dimension,) or not np.all(np.isfinite(u)):
        raise ValueError(f"update must be a finite ({layout.dimension},) array, got {u.shape}")
    c = np.asarray(norms, dtype=np.float64)
    if c.shape != (len(layout.names),) or np.any(c <= 0):
        raise ValueError("the group clipping norms must be positive, one per group")
    g_norms = np.sqrt(np.bincount(layout.index, weights=u * u, minlength=len(layout.names)))
    factor = np.where(g_norms > c, c / np.maximum(g_norms, np.finfo(np.float64).tiny) * _CLIP_SAFETY, 1.0)
    return u * factor[layout.index], float(np.linalg.norm(u))


def upload_statistics(noisy_update: np.ndarray, layout: GroupLayout, *, floor_std: float, clipping_norm: float,
                      round_index: int, total_rounds: int) -> np.ndarray:
    """The allocator's input s_{k,r}: float32 (G, len(STATISTICS)), one row per group, columns :data:`STATISTICS`:

    - signal_norm: sqrt(max(||y_g||^2 - d_g sigma_floor^2, 0)) / C, the masked L2 norm of the group with the floor
      noise's expected energy removed (an estimate of ||u_g|| / C);
    - mean_magnitude: mean |y_g| / sigma_floor;  std: std(y_g) / sigma_floor;
    - size_ratio: d_g / d;  round: round_index / total_rounds;  stage: 0 for stage 1, 1 for stage 2;
    - sensitive: 1 for a transmitter-sensitive group.

    ``noisy_update`` must be the floor-noised update y (step a of the module docstring), never u.

    Raises:
        ValueError: shapes disagree or floor_std / clipping_norm not positive.
    """
    y = np.asarray(noisy_update, dtype=np.float64)
    if y.shape != (layout.dimension,):
        raise ValueError(f"noisy_update must have shape ({layout.dimension},), got {y.shape}")
    if not (floor_std > 0 and clipping_norm > 0):
        raise ValueError("floor_std and clipping_norm must be positive")
    g = len(layout.names)
    sizes = layout.sizes.astype(np.float64)
    energy = np.bincount(layout.index, weights=y * y, minlength=g)
    total = np.bincount(layout.index, weights=y, minlength=g)
    magnitude = np.bincount(layout.index, weights=np.abs(y), minlength=g)
    mean = total / sizes
    std = np.sqrt(np.maximum(energy / sizes - mean ** 2, 0.0))
    stats = np.stack([
        np.sqrt(np.maximum(energy - sizes * floor_std ** 2, 0.0)) / clipping_norm,
        magnitude / sizes / floor_std,
        std / floor_std,
        sizes / sizes.sum(),
        np.full(g, round_index / max(total_rounds, 1)),
        np.asarray([s - 1 for s in layout.stage], dtype=np.float64),
        np.asarray(layout.sensitive, dtype=np.float64),
    ], axis=1)
    return stats.astype(np.float32)


@dataclass(frozen=True, eq=False)
class PrivatisedUpload:
    """What :meth:`AdaptiveGroupedNoise.privatise` released and how.

    Attributes:
        update: float32 (d,), the released (clipped, noised) update.
        shares: float64 (G,) budget shares a_g, or None for none / clip-only.
        noise_std: float64 (G,) per-coordinate noise standard deviation of each group (0 for none / clip-only).
        norm_before_clipping: L2 norm of the local update before clipping.
        statistics: float32 (G, len(STATISTICS)) the allocator's input (adaptive only, else None).
    """

    update: np.ndarray
    shares: np.ndarray | None
    noise_std: np.ndarray
    norm_before_clipping: float
    statistics: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class AdaptiveGroupedNoise:
    """The grouped Gaussian mechanism of one upload (module docstring); keyword-only and privacy-relevant.

    Attributes:
        layout: the parameter groups.
        defence: one of :data:`DEFENCES`.
        clipping_norm: C (L2) for every defence but ``none``.
        noise_multiplier: z; the budget is B = d (zC)^2 (ignored by none / clip-only).
        floor_fraction: phi in (0, 1], the adaptive defence's uniform floor (default 0.5).
        allocator: for ``adaptive``: a callable from statistics float32 (G, len(STATISTICS)) to shares float (G,)
            summing to 1 (:class:`edge_sdk.privacy.noise_allocator.NoiseAllocator`); must not read private data.
        clipping_profile: for ``grouped-clipping``: the public profile m_g, float (G,) (:func:`clipping_profile`);
            :meth:`privatise` refuses to run that defence without one.

    Raises:
        ValueError: unknown defence, non-positive C or z, phi out of (0, 1], or adaptive without an allocator.
    """

    layout: GroupLayout
    defence: str
    clipping_norm: float
    noise_multiplier: float
    floor_fraction: float = 0.5
    allocator: Callable[[np.ndarray], np.ndarray] | None = None
    clipping_profile: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.defence not in DEFENCES:
            raise ValueError(f"defence must be one of {DEFENCES}, got {self.defence!r}")
        if not (isinstance(self.clipping_norm, (int, float)) and 0 < self.clipping_norm < math.inf):
            raise ValueError(f"clipping_norm must be positive and finite, got {self.clipping_norm!r}")
        if self.defence in ("uniform", "steered-uniform", "adaptive", "grouped-clipping") and not (
                isinstance(self.noise_multiplier, (int, float)) and 0 < self.noise_multiplier < math.inf):
            raise ValueError(f"noise_multiplier must be positive and finite, got {self.noise_multiplier!r}")
        if not (isinstance(self.floor_fraction, (int, float)) and 0 < self.floor_fraction <= 1):
            raise ValueError(f"floor_fraction must be in (0, 1], got {self.floor_fraction!r}")
        if self.defence == "adaptive" and self.allocator is None:
            raise ValueError("the adaptive defence needs an allocator (edge_sdk.privacy.noise_allocator)")

    @property
    def floor_std(self) -> float:
        """Per-coordinate noise standard deviation that every coordinate gets at least (parameter units): sqrt(phi)
        z C for adaptive, z C for uniform, 0 for the others."""
        if self.defence == "adaptive":
            return math.sqrt(self.floor_fraction) * self.noise_multiplier * self.clipping_norm
        if self.defence == "uniform":
            return self.noise_multiplier * self.clipping_norm
        return 0.0

    def dp_event(self) -> DPSGDEvent | None:
        """The DP event of one upload, for the ledger: ``DPSGDEvent(floor_std / (2C), 1.0, 1)`` (module docstring,
        "Formal guarantee"), or None for the defences that state no guarantee (none, clip-only, steered-uniform)."""
        if self.defence not in GUARANTEED_DEFENCES:
            return None
        # floor_std / (2C) with C cancelled, so the value is bit-for-bit the one the coordinator expects
        # (shared.protocol.RadioTask.floor_noise_multiplier)
        phi = self.floor_fraction if self.defence == "adaptive" else 1.0  # uniform and grouped-clipping: z / 2
        return DPSGDEvent(math.sqrt(phi) * self.noise_multiplier / 2.0 if phi != 1.0 else self.noise_multiplier / 2.0,
                          1.0, 1)

    def clipped(self, update: np.ndarray) -> np.ndarray:
        """float64 (d,): the defence's deterministic part, the update as clipped before any noise (unchanged for
        ``none``; per group for ``grouped-clipping``): what an attacker's noise-free template simulates."""
        u = np.asarray(update, dtype=np.float64)
        if self.defence == "none":
            return u
        if self.defence == "grouped-clipping":
            return clip_groups(u, self.layout, self._group_norms())[0]
        return clip_update(u, self.clipping_norm)[0]

    def _group_norms(self) -> np.ndarray:
        """The grouped-clipping defence's C_g (:func:`grouped_clipping_norms` of the public profile).

        Raises:
            ValueError: no clipping profile yet.
        """
        if self.clipping_profile is None:
            raise ValueError("grouped-clipping needs a public clipping profile (clipping_profile) before the "
                             "first upload")
        return grouped_clipping_norms(self.clipping_profile, self.clipping_norm)

    def privatise(self, update: np.ndarray, *, round_index: int, total_rounds: int,
                  noise: RandomSource) -> PrivatisedUpload:
        """Clip and noise one flat update (module docstring, steps 1-4 / a-d).

        Args:
            update: float (d,), the local model delta in canonical_flatten order.
            round_index, total_rounds: r and R (statistics "round" = r / R).
            noise: the randomness source (SecureRandom in production).

        Raises:
            ValueError: wrong shape or non-finite update, or the allocator's shares are not a probability vector.
        """
        u = np.asarray(update, dtype=np.float64)
        if u.shape != (self.layout.dimension,):
            raise ValueError(f"update must have shape ({self.layout.dimension},), got {u.shape}")
        g = len(self.layout.names)
        if self.defence == "none":
            if not np.all(np.isfinite(u)):
                raise ValueError("update must be finite")
            return PrivatisedUpload(u.astype(np.float32), None, np.zeros(g), float(np.linalg.norm(u)))
        if self.defence == "grouped-clipping":
            norms = self._group_norms()
            clipped, norm = clip_groups(u, self.layout, norms)
            std = grouped_clipping_noise_std(norms, self.layout, noise_multiplier=self.noise_multiplier)
            out = clipped + std[self.layout.index] * noise.standard_normal(self.layout.dimension)
            return PrivatisedUpload(out.astype(np.float32), None, std, norm)
        clipped, norm = clip_update(u, self.clipping_norm)
        if self.defence == "clip-only":
            return PrivatisedUpload(clipped.astype(np.float32), None, np.zeros(g), norm)
        kw = dict(noise_multiplier=self.noise_multiplier, clipping_norm=self.clipping_norm)
        if self.defence in ("uniform", "steered-uniform"):
            shares = uniform_shares(self.layout) if self.defence == "uniform" else steered_shares(self.layout)
            std = group_noise_std(shares, self.layout, **kw)
            out = clipped + std[self.layout.index] * noise.standard_normal(self.layout.dimension)
            return PrivatisedUpload(out.astype(np.float32), shares, std, norm)
        # adaptive: (a) the floor, the only step that reads the private update
        floor = self.floor_std
        y = clipped + floor * noise.standard_normal(self.layout.dimension)
        # (b) statistics of y, (c) shares from the public allocator, (d) the rest of each group's variance
        stats = upload_statistics(y, self.layout, floor_std=floor, clipping_norm=self.clipping_norm,
                                  round_index=round_index, total_rounds=total_rounds)
        shares = floored_shares(np.asarray(self.allocator(stats), dtype=np.float64), self.layout,
                                self.floor_fraction)
        std = group_noise_std(shares, self.layout, **kw)
        extra = np.sqrt(np.maximum(std ** 2 - floor ** 2, 0.0))
        out = y + extra[self.layout.index] * noise.standard_normal(self.layout.dimension)
        return PrivatisedUpload(out.astype(np.float32), shares, np.maximum(std, floor), norm, stats)
