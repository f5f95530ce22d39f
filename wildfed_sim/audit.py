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

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import epsilon_spent
from shared.privacy.events import DPSGDEvent

from wildfed_sim.audit_canaries import (CanaryBackend, CanaryDesign, SilencedNoise, design_canaries,
                                        rank_coordinates)
from wildfed_sim.audit_records import AuditResult, AuditSettings, CategoryAudit
from wildfed_sim.audit_stats import epsilon_lower_bound, guess_sizes, membership_guesses, one_run_p_value

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
