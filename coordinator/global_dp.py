"""Global DP rounds: sites send clipped, unnoised gradient sums under secure aggregation; the coordinator unmasks
only their sum and adds the Gaussian noise once.

One Global DP round ``r`` (``privacy: global``; docs/privacy.md "Global DP mode", docs/secagg.md):

1. **Halt check and selection**: as in CCDP mode (:meth:`coordinator.rounds.RoundManager.select`); secure
   aggregation needs at least 2 sites.
2. **TASK** to each selected site: ``privacy: global``, ``local_steps: 1`` and :class:`shared.protocol.SecAggSettings`
   (U = the selected sites, threshold t, d, box B, scale, modulus 2^k).
3. Bonawitz et al. 2017, Fig. 4, over MQTT. Every message is a signed SECAGG envelope: a site's on its
   ``secagg`` topic, the coordinator's on the site's ``task`` topic. So a key advertisement is bound to the
   site's enrolled Ed25519 key (the PKI of the paper's §3), and the coordinator cannot be handed substituted keys.

   ======================  =================================================  ==========================
    stage (site sends)      coordinator                                        waits
   ======================  =================================================  ==========================
    ``keys``                U1 = sites that advertised; sends ``key_list``     ``secagg.stage_timeout_s``
    ``shares``              U2 = senders; sends each its ``share_inbox``       ``round_deadline_s`` (the
                                                                               sites train first)
    ``masked``              adds each masked sum mod 2^k; U3 = arrivals        ``secagg.stage_timeout_s``
    ``recovery``            charges the ledger, THEN unmasks sum_{U3}          ``secagg.stage_timeout_s``
   ======================  =================================================  ==========================

   A stage with fewer than t sites abandons the round: status ``failed``, no model, and nothing charged (the
   coordinator saw only uniformly random masked vectors; see "Charging" below). Every site of U1 then gets a
   ``round_end`` message.
4. **Noise, once.** With ``S = sum_{k in U3} Q(clip-sum_k)`` dequantised, the coordinator releases::

       g~ = (S + N(0, (z C_eff)^2 I_d)) / sum_{k in U3} q_k N_k

   with ``C_eff = C + sqrt(d) / scale`` (the L2 sensitivity of one record after rounding to the secagg grid:
   docs/secagg.md) and ``q_k = min(1, B / N_k)`` (1 under distributed noise, which credits no subsampling:
   :func:`shared.privacy.distributed.site_sampling_rate`). The model then takes one SGD step
   ``theta <- theta - learning_rate * g~`` through the server optimizer.
5. **Store and close** as in CCDP mode.

Calibration: individualized DP-SGD "Sample" (Boenisch et al., NeurIPS 2023, Sec. 4.1), one draw, one z. Before
the tasks go out, z is the largest over the selected sites of the noise multiplier at which the federation's
largest budget (every round the same anchor, so every round runs at one z) spends exactly that budget at q_k over
``planned_rounds`` rounds
(:func:`global_noise_multiplier`; q_k from the site's public record count, 1.0 where it is not enrolled with one).
The task carries z; each site samples its category-c records at
``q_kc = individual_sampling_rates(z, ...)[c] <= q_k``, the largest rate at which c's budget lasts the planned
rounds, and the coordinator computes the same q_kc from the same public values. A record of category c at site k
is in the sum with probability q_kc and moves it by at most C_eff, against noise z C_eff: its round is exactly
``DPSGDEvent(z, q_kc, 1)``.

Charging. Each survivor k is charged ``DPSGDEvent(z, q_kc, 1)`` per active category c, durably, after the
recovery shares are in and BEFORE the sum is unmasked. That is, before the coordinator sees any function of the
data. A round abandoned before that point charges nothing; a crash after it leaves the spend charged exactly once
(ledger rows are idempotent) and the round ``failed`` at restart: secure-aggregation state lives in memory only,
so the round cannot be finished and is re-run under the next round number.

Threat model: honest-but-curious coordinator. It learns the sum over at least t sites, never a single site's
update (tests/coordinator/test_global_dp.py and tests/shared/test_secagg.py). The released model is
(eps_c, delta)-DP per record against anyone who sees only the released models, participants and their coalitions
included (none of them knows the coordinator's draw). The coordinator itself sees the unnoised sum (docs/secagg.md,
"Interplay with the DP guarantee"). Under distributed noise (``global_noise: distributed``) the charged epsilon holds
against the coordinator, non-participants and up to ``secagg.colluding_sites`` colluding participants
(:mod:`shared.privacy.observers`; docs/privacy.md "Who the guarantee holds against").

This module holds the maths (pure functions). The round's plan is :class:`coordinator.round_plan.GlobalRoundPlan`;
the sites' stage messages are collected by :class:`coordinator.secagg_collector.SecAggCollector`; stages 3-4 are
driven by :class:`coordinator.secagg_round.SecureAggregationRound`; steps 1-2 and 5 by
:meth:`coordinator.rounds.RoundManager.run_global_round`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from shared.errors import ConfigError, PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.accounting import AccountantName
from shared.privacy.distributed import distributed_plan, skellam_event
from shared.privacy.events import DPSGDEvent, SkellamEvent
from shared.privacy.individualized import anchor_noise_multiplier, individual_sampling_rates
from shared.protocol import SecAggSettings
from shared.secagg import SecAggParams, max_power_of_two_scale

__all__ = ["secagg_settings", "plan_global_round", "effective_sensitivity", "global_noise_multiplier",
           "global_events", "distributed_events"]


# ---- the maths: pure functions --------------------------------------------------------------------------------

def secagg_settings(*, site_ids: Iterable[str], vector_length: int, clipping_norm: float, expected_batch_size: int,
                    threshold: int | None = None, modulus_bits: int = 32,
                    max_abs_value: float | None = None, colluding_sites: int = 0) -> SecAggSettings:
    """Secure-aggregation parameters for one Global DP round.

    Args:
        site_ids: the round's selected sites (n >= 2).
        vector_length: d, number of model parameters.
        clipping_norm: C (L2, per example). expected_batch_size: B (records per step in expectation).
        threshold: t; None -> floor(n/2) + 1, the smallest majority (tolerates n - t dropouts).
        modulus_bits: k. max_abs_value: per-coordinate box B_box of a site's clipped sum; None -> C * B.
            A site's sum has per-coordinate magnitude at most C * (its realised batch size). Box clipping is a
            projection, so it never raises the sensitivity; it only loses accuracy where it binds.
        colluding_sites: f (distributed noise only): the shares are calibrated so that t - f of them carry the
            whole noise (:class:`shared.protocol.SecAggSettings`); 0 <= f < t.

    Returns:
        Settings with ``scale`` = the largest power of two that cannot wrap (shared.secagg.max_power_of_two_scale).

    Raises:
        ConfigError: fewer than 2 sites, or a threshold out of range (from ``shared.secagg.SecAggParams``), or
            f >= t (field ``secagg.colluding_sites``).
    """
    sites = tuple(sorted(site_ids))
    box = float(max_abs_value) if max_abs_value is not None else float(clipping_norm) * float(expected_batch_size)
    t = threshold if threshold is not None else len(sites) // 2 + 1
    scale = max_power_of_two_scale(num_sites=max(len(sites), 1), max_abs_value=box, modulus_bits=modulus_bits)
    t = min(t, max(len(sites), 2))
    if not 0 <= int(colluding_sites) < t:
        raise ConfigError(f"secagg.colluding_sites = {colluding_sites} needs a threshold above it; this round's is "
                          f"t = {t} ({len(sites)} sites)", field="secagg.colluding_sites",
                          fix=f"use colluding_sites <= {t - 1}, or select more sites / raise secagg.threshold")
    settings = SecAggSettings(site_ids=sites, threshold=t, vector_length=int(vector_length),
                              max_abs_value=box, scale=scale, modulus_bits=modulus_bits,
                              colluding_sites=int(colluding_sites))
    SecAggParams(federation_id="check", round=0, site_ids=sites, threshold=settings.threshold,
                 vector_length=settings.vector_length, max_abs_value=box, scale=scale, modulus_bits=modulus_bits)
    return settings


def plan_global_round(*, budgets: Mapping[IUCNCategory, float], sampling_rates: Mapping[str, float],
                      vector_length: int, clipping_norm: float, expected_batch_size: int, target_delta: float,
                      planned_rounds: int, distributed: bool, threshold: int | None = None, modulus_bits: int = 32,
                      max_abs_value: float | None = None, accountant: AccountantName = "rdp",
                      colluding_sites: int = 0) -> tuple[SecAggSettings, float]:
    """The secure-aggregation settings and the one noise multiplier z of a Global DP round, from public values only
    (the same every round, so every round runs at one z and each category's rate stays what its budget was planned
    for).

    Trusted-server: z from :func:`global_noise_multiplier` with the federation's largest budget as every site's
    anchor at its ``q_k``. Distributed: z (and the per-category clipping norms the sites use) from
    :func:`shared.privacy.distributed.distributed_plan`; each site's Skellam share has variance ``mu / (t - f)``
    (:func:`shared.privacy.distributed.skellam_share_variance`, which the gateway computes from the settings, where
    ``colluding_sites`` = f rides), and the box is widened by 12 of its standard deviations so that the noise stays
    on the grid.

    Args:
        budgets: epsilon per category. sampling_rates: ``{site: q_k}`` for the selected sites (q_k from
            :func:`shared.privacy.distributed.site_sampling_rate`: ``min(1, B/N_k)`` from the enrolled record count,
            1.0 where unknown or under distributed noise). vector_length: d. clipping_norm: C.
        expected_batch_size: B. target_delta, planned_rounds: as the federation's. distributed: the sites add the
            noise. threshold, modulus_bits, max_abs_value: as :func:`secagg_settings`. colluding_sites: f, distributed
            noise only (ignored, 0 in the settings, for the trusted server, whose noise no participant knows).

    Raises:
        ConfigError / PayloadError: as :func:`secagg_settings` and :func:`global_noise_multiplier`.
    """
    sites = tuple(sampling_rates)
    f = int(colluding_sites) if distributed else 0
    settings = secagg_settings(site_ids=sites, vector_length=vector_length, clipping_norm=clipping_norm,
                               expected_batch_size=expected_batch_size, threshold=threshold,
                               modulus_bits=modulus_bits, max_abs_value=max_abs_value, colluding_sites=f)
    if distributed:
        z0, _ = distributed_plan(budgets=budgets, target_delta=float(target_delta), planned_rounds=planned_rounds,
                                 clipping_norm=float(clipping_norm), vector_length=vector_length,
                                 scale=settings.scale)
        # a share's standard deviation in gradient units, sqrt(mu / (t - f)) / scale = z C_eff / sqrt(t - f), with
        # 10 % on z (the second plan's grid is finer) and C_eff = C + sqrt(d)/scale taken as at most C + 1
        share_sd = 1.1 * z0 * (float(clipping_norm) + 1.0) / math.sqrt(settings.threshold - f)
        settings = secagg_settings(site_ids=sites, vector_length=vector_length, clipping_norm=clipping_norm,
                                   expected_batch_size=expected_batch_size, threshold=threshold,
                                   modulus_bits=modulus_bits, max_abs_value=settings.max_abs_value + 12.0 * share_sd,
                                   colluding_sites=f)
        z, _ = distributed_plan(budgets=budgets, target_delta=float(target_delta), planned_rounds=planned_rounds,
                                clipping_norm=float(clipping_norm), vector_length=vector_length,
                                scale=settings.scale)
        return settings, z
    z = global_noise_multiplier(budgets=budgets, sites={s: (q, tuple(budgets)) for s, q in sampling_rates.items()},
                                target_delta=float(target_delta), planned_rounds=planned_rounds,
                                accountant=accountant)
    return settings, z


def effective_sensitivity(clipping_norm: float, vector_length: int, scale: float) -> float:
    """``C + sqrt(d) / scale``: L2 sensitivity of one site's quantised clipped sum to adding or removing one record
    (docs/secagg.md "Interplay with the DP guarantee": box clipping is non-expansive; deterministic rounding moves
    each of the d coordinates by at most 1/(2 scale) per input, so two neighbouring inputs differ by at most
    sqrt(d)/scale more after rounding)."""
    return float(clipping_norm) + math.sqrt(vector_length) / float(scale)


def _budgeted(site: str, categories: Iterable[IUCNCategory], budgets: Mapping[IUCNCategory, float]
              ) -> tuple[IUCNCategory, ...]:
    """``tuple(categories)``; raises PayloadError naming the site's categories that have no budget."""
    cats = tuple(categories)
    missing = [c.value for c in cats if c not in budgets]
    if missing:
        raise PayloadError(f"site {site!r} trained categories {missing}, which have no budget")
    return cats


def global_noise_multiplier(*, budgets: Mapping[IUCNCategory, float],
                            sites: Mapping[str, tuple[float, Iterable[IUCNCategory]]], target_delta: float,
                            planned_rounds: int, accountant: AccountantName = "rdp") -> float:
    """The one noise multiplier z of a Global DP round (individualized DP-SGD "Sample", Boenisch et al. 2023,
    Sec. 4.1): the largest over the sites of the z at which the site's anchor category (its largest active budget),
    sampled at the site's q_k, spends exactly its budget over ``planned_rounds`` rounds of one step
    (:func:`shared.privacy.individualized.anchor_noise_multiplier`). Every other category c of site k is then
    sampled at the rate its budget allows at that z (:func:`global_events`), so no site's spend passes a budget.

    Args:
        budgets: total epsilon per category. sites: ``{site: (q_k, active categories)}`` (q_k from the site's
            public record count; 1.0 where that is unknown, which only raises z).
        target_delta: delta. planned_rounds: the federation's planned rounds (one step each).

    Raises:
        PayloadError: a site holds a category with no budget, or no site is given.
        ConfigError: a budget, delta or rate out of range (from ``shared.privacy.accounting``).
    """
    if not sites:
        raise PayloadError("a Global DP round needs at least one site to calibrate its noise for")
    out = 0.0
    for site, (q, categories) in sites.items():
        cats = _budgeted(site, categories, budgets)
        out = max(out, anchor_noise_multiplier(budgets=budgets, categories=cats, target_delta=float(target_delta),
                                               max_rate=float(q), steps=int(planned_rounds), accountant=accountant))
    return out


def global_events(noise_multiplier: float, *, budgets: Mapping[IUCNCategory, float],
                  sites: Mapping[str, tuple[float, Iterable[IUCNCategory]]], target_delta: float,
                  planned_rounds: int, accountant: AccountantName = "rdp"
                  ) -> dict[str, dict[IUCNCategory, DPSGDEvent]]:
    """What each site is charged for one Global DP round: ``DPSGDEvent(z, q_kc, 1)`` per active category c, where
    q_kc is the rate the site sampled c at (:func:`shared.privacy.individualized.individual_sampling_rates` at z
    and the site's q_k: the gateway's ``edge_sdk.training.clipped_sum_locally`` computes the same values).

    Raises:
        PayloadError: a site holds a category with no budget.
    """
    out: dict[str, dict[IUCNCategory, DPSGDEvent]] = {}
    for site, (q, categories) in sites.items():
        cats = _budgeted(site, categories, budgets)
        rates = individual_sampling_rates(noise_multiplier=float(noise_multiplier), budgets=budgets, categories=cats,
                                          target_delta=float(target_delta), max_rate=float(q),
                                          steps=int(planned_rounds), accountant=accountant)
        out[site] = {c: DPSGDEvent(float(noise_multiplier), float(rate), 1) for c, rate in rates.items()}
    return out


def distributed_events(noise_multiplier: float, *, budgets: Mapping[IUCNCategory, float],
                       sites: Mapping[str, tuple[float, Iterable[IUCNCategory]]], target_delta: float,
                       planned_rounds: int, clipping_norm: float, vector_length: int, scale: float
                       ) -> dict[str, dict[IUCNCategory, SkellamEvent]]:
    """What each site is charged for one distributed Global DP round: per active category c the
    :class:`~shared.privacy.events.SkellamEvent` of one release, for records clipped at the C_c of
    ``shared.privacy.distributed.distributed_plan`` (the gateway's ``clipped_sum_locally`` clips at the same
    values) under the total noise of t survivors.

    Raises:
        PayloadError: a site holds a category with no budget.
    """
    _, norms = distributed_plan(budgets=budgets, target_delta=target_delta, planned_rounds=planned_rounds,
                                clipping_norm=clipping_norm, vector_length=vector_length, scale=scale)
    out: dict[str, dict[IUCNCategory, SkellamEvent]] = {}
    for site, (_, categories) in sites.items():
        cats = _budgeted(site, categories, budgets)
        out[site] = {c: skellam_event(noise_multiplier=noise_multiplier, anchor_clipping_norm=clipping_norm,
                                      clipping_norm=norms[c], vector_length=vector_length, scale=scale)
                     for c in cats}
    return out
