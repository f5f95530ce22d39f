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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope, MessageKind, seal
from shared.errors import ConfigError, PayloadError
from shared.iucn import IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName
from shared.privacy.distributed import distributed_plan, site_sampling_rate, skellam_event
from shared.privacy.events import DPSGDEvent, SkellamEvent
from shared.privacy.individualized import anchor_noise_multiplier, individual_sampling_rates
from shared.privacy.randomness import RandomSource, SecureRandom
from shared.protocol import (SITE_STAGES, SecAggMessage, SecAggSettings, canonical_unflatten, decode_secagg,
                             encode_secagg)
from shared.secagg import (AdvertisedKeys, EncryptedShare, NotEnoughSharesError, RecoveryShares, SecAggError,
                           SecAggParams, SecAggServer, max_power_of_two_scale)
from shared.topics import task_topic

from coordinator.inbound.reject import Reject as _Reject, RejectReason
from coordinator.inbound.site_checks import parse_site_envelope, verify_site_envelope
from coordinator.registry import SiteRegistry
from coordinator.storage import Store
from coordinator.transport import Transport, TransportError

__all__ = ["SecAggCollector", "StageInbox", "secagg_settings", "plan_global_round", "effective_sensitivity",
           "global_noise_multiplier", "global_events", "distributed_events", "GlobalRoundOutcome",
           "SecureAggregationRound"]

log = logging.getLogger(__name__)


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


# ---- collecting the sites' stage messages ---------------------------------------------------------------------

@dataclass
class StageInbox:
    """The verified secure-aggregation messages of one round, per stage and site.

    Attributes:
        keys: ``{site: AdvertisedKeys}``. shares: ``{sender: {recipient: EncryptedShare}}``.
        masked: ``{site: (masked vector uint32/uint64 (d,), N_k, active categories)}``, in arrival order.
        recovery: ``{site: RecoveryShares}``.
    """

    round: int
    model_hash: str
    selected: frozenset[str]
    keys: dict[str, AdvertisedKeys] = field(default_factory=dict)
    shares: dict[str, dict[str, EncryptedShare]] = field(default_factory=dict)
    masked: dict[str, tuple[np.ndarray, int, tuple[IUCNCategory, ...]]] = field(default_factory=dict)
    recovery: dict[str, RecoveryShares] = field(default_factory=dict)

    def stage(self, name: str) -> dict:
        """The dict of stage ``name`` (``keys``, ``shares``, ``masked``, ``recovery``)."""
        return {"keys": self.keys, "shares": self.shares, "masked": self.masked, "recovery": self.recovery}[name]


class SecAggCollector:
    """Transport callback for ``site/+/secagg``: verify each SECAGG envelope and file it in the open round's
    :class:`StageInbox`.

    Checks, in order (reason codes of :class:`coordinator.ingest.RejectReason`, stored and counted in ``status``):
    envelope, topic, kind, federation, site as in ingest; enrolled site and Ed25519 signature; a Global DP round is
    open and the header names it (``wrong_round``); the site was selected (``not_selected``); the base model is
    the round's (``stale_model``); the payload decodes to a site stage (``malformed_payload``); the body is
    well-formed and names the sender (``secagg_protocol``); one message per site and stage (``duplicate``).
    Never raises for bad input. Thread-safe; ``changed`` is notified after each message.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry) -> None:
        self.federation_id = federation_id
        self._store = store
        self._registry = registry
        self._inbox: StageInbox | None = None
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)

    def open_round(self, round: int, model_hash: str, selected: Iterable[str]) -> StageInbox:
        """Start collecting for ``round``; returns its (live) inbox."""
        with self._lock:
            self._inbox = StageInbox(round=round, model_hash=model_hash, selected=frozenset(selected))
            return self._inbox

    def inbox(self, round: int) -> StageInbox:
        """The live inbox of ``round``.

        Raises:
            SecAggError: ``round`` is not the round being collected.
        """
        inbox = self._inbox
        if inbox is None or inbox.round != round:
            raise SecAggError(f"round {round} is no longer being collected")
        return inbox

    def record_rejection(self, round: int, site: str, detail: str) -> None:
        """Store and count a ``secagg_protocol`` rejection the round driver decided (e.g. an unusable masked sum)."""
        log.warning("secagg: round %d: site %s %s", round, site, detail)
        self._store.add_rejection(round=round, site_id=site, topic="secagg", reason=RejectReason.SECAGG_PROTOCOL.value,
                                  error_kind="check", detail=detail)

    def close_round(self) -> None:
        """Stop collecting (later messages are ``wrong_round``)."""
        with self._lock:
            self._inbox = None
            self.changed.notify_all()

    def wait_for(self, stage: str, expected: Iterable[str], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> set[str]:
        """Block until every site of ``expected`` has sent ``stage`` or ``timeout_s`` passes; return who has."""
        expected = set(expected)
        deadline = clock() + timeout_s
        with self.changed:
            while True:
                inbox = self._inbox
                have = set(inbox.stage(stage)) & expected if inbox is not None else set()
                left = deadline - clock()
                if have >= expected or left <= 0 or inbox is None:
                    return have
                self.changed.wait(timeout=min(left, 0.5))

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    def handle(self, topic: str, raw: bytes) -> str | None:
        """File one message; returns None if it was filed, else the rejection reason code."""
        with self._lock:
            env: Envelope | None = None
            try:
                env = parse_site_envelope(topic, raw, federation_id=self.federation_id, kind=MessageKind.SECAGG)
                verify_site_envelope(env, self._registry)
                self._file(env)
                return None
            except _Reject as rej:
                h = env.header if env is not None else None
                log.warning("secagg: rejected message on %s: %s: %s", topic, rej.reason.value, rej.detail)
                self._store.add_rejection(round=h.round if h else None, site_id=h.site_id if h else None,
                                          topic=topic, reason=rej.reason.value, error_kind=rej.error_kind,
                                          detail=rej.detail)
                return rej.reason.value
            finally:
                self.changed.notify_all()

    def _file(self, env: Envelope) -> None:
        h, inbox = env.header, self._inbox
        if inbox is None or h.round != inbox.round:
            raise _Reject(RejectReason.WRONG_ROUND, f"secagg message for round {h.round}, open Global DP round is "
                          f"{'none' if inbox is None else inbox.round}")
        if h.site_id not in inbox.selected:
            raise _Reject(RejectReason.NOT_SELECTED, f"site {h.site_id!r} was not selected for round {h.round}")
        if h.base_model_hash != inbox.model_hash:
            raise _Reject(RejectReason.STALE_MODEL, f"secagg message for model {h.base_model_hash[:12]}")
        try:
            message = decode_secagg(env.payload, stages=SITE_STAGES)
        except PayloadError as exc:
            raise _Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
        site, stage = h.site_id, message.stage
        if site in inbox.stage(stage):
            raise _Reject(RejectReason.DUPLICATE, f"site {site!r} already sent its {stage} for round {h.round}")
        try:
            self._parse_stage(inbox, site, message)
        except (PayloadError, SecAggError, ValueError) as exc:
            raise _Reject(RejectReason.SECAGG_PROTOCOL, f"{stage}: {exc}", exc) from exc

    @staticmethod
    def _parse_stage(inbox: StageInbox, site: str, message: SecAggMessage) -> None:
        body = message.body
        if message.stage == "keys":
            keys = AdvertisedKeys.from_json(dict(body))
            if keys.site_id != site:
                raise PayloadError(f"keys name site {keys.site_id!r}, the envelope {site!r}")
            inbox.keys[site] = keys
        elif message.stage == "shares":
            raw = body.get("shares")
            if not isinstance(raw, list) or set(body) != {"shares"}:
                raise PayloadError("shares body must be {'shares': [...]}")
            shares = [EncryptedShare.from_json(x) for x in raw]
            if any(s.sender != site for s in shares) or len({s.recipient for s in shares}) != len(shares):
                raise PayloadError("every share must come from the sender, one per recipient")
            inbox.shares[site] = {s.recipient: s for s in shares}
        elif message.stage == "masked":
            n, cats = body.get("num_examples"), body.get("categories")
            if set(body) != {"num_examples", "categories"} or type(n) is not int or n < 1:
                raise PayloadError("masked body must be {'num_examples': positive int, 'categories': [...]}")
            if not isinstance(cats, list) or not cats:
                raise PayloadError("categories must be a non-empty list of IUCN codes")
            categories = tuple(sorted({parse_category(c, field="categories") for c in cats}, key=lambda c: c.rank))
            assert message.masked is not None  # decode_secagg guarantees it for this stage
            inbox.masked[site] = (message.masked, n, categories)
        else:  # recovery
            shares = RecoveryShares.from_json(dict(body))
            if shares.sender != site:
                raise PayloadError(f"recovery shares name sender {shares.sender!r}, the envelope {site!r}")
            inbox.recovery[site] = shares


# ---- one round, driven by the round manager -------------------------------------------------------------------

@dataclass(frozen=True)
class GlobalRoundOutcome:
    """What the secure-aggregation part of a Global DP round produced.

    Attributes:
        status: ``closed`` (``noisy_gradient`` released) or ``failed`` (abandoned; see ``reason``).
        survivors: U3 (whose sums are in the aggregate, and who were charged); for a failed round, the sites
            charged before it failed (normally none).
        noisy_gradient: ``{name: float32 array}``, ``g~`` of the module docstring, or None.
        events: ``{site: {category: DPSGDEvent}}`` charged (empty when nothing was charged).
        noise_std: sigma of the one Gaussian draw (same unit as the gradient sum), 0 when failed.
        reason: why the round failed, or a summary.
    """

    status: str
    survivors: tuple[str, ...]
    noisy_gradient: dict[str, np.ndarray] | None
    events: Mapping[str, Mapping[IUCNCategory, DPSGDEvent]]
    noise_std: float
    reason: str


class SecureAggregationRound:
    """Drives stages 3-4 of the module docstring for one round: publishes the coordinator's stage messages, waits
    for the sites' replies through a :class:`SecAggCollector`, unmasks, charges and adds the noise.

    Args:
        federation_id, round, model_hash: the round. template: the global weights (names and shapes of g~).
        settings: the round's secagg settings (as sent in the tasks).
        collector: the open collector (``open_round`` already called for this round).
        transport: where stage messages go (each site's task topic). signing_key: the coordinator's key.
        charge: ``charge(site, events)`` writes a survivor's events to the ledger durably (called before the sum
            is unmasked). over_budget: ``over_budget(site, events)`` returns a reason if charging would pass a
            budget (the round is then abandoned before anything is charged or unmasked), else None.
        budgets, target_delta, planned_rounds, accountant: calibration. halted: per site, the categories halted
            for this round (a masked sum reporting one is refused). declared: per site, its declared categories
            (registry metadata); the charged and noised categories are the reported ones plus the declared,
            non-halted ones, so a site cannot lower its charge by under-reporting. clipping_norm, expected_batch_size:
            C and B. noise_multiplier: z, as the tasks carried it (:func:`global_noise_multiplier`, or
            ``shared.privacy.distributed.distributed_plan``). distributed: the sites added the noise (Skellam shares
            under the masks, calibrated for t survivors): the coordinator adds none and charges each survivor the
            Skellam event of its categories' clipping norms (:func:`distributed_events`).
            key_timeout_s / shares_timeout_s / stage_timeout_s: waits. noise: secure source.
        after_charge: called after charging, before unmasking (the crash-test hook).
        capacities: per site, its declared capacity N_k (registry metadata; the tasks carried it): the sampling
            rate's denominator and the normaliser's weight. A masked sum reporting another N_k is refused (treated
            as dropped). A site missing here is taken at the N_k it reports.
    """

    def __init__(self, *, federation_id: str, round: int, model_hash: str, template: Mapping[str, np.ndarray],
                 settings: SecAggSettings, collector: SecAggCollector, transport: Transport,
                 signing_key: Ed25519PrivateKey,
                 charge: Callable[[str, Mapping[IUCNCategory, DPSGDEvent]], None],
                 over_budget: Callable[[str, Mapping[IUCNCategory, DPSGDEvent]], str | None],
                 budgets: Mapping[IUCNCategory, float], halted: Mapping[str, frozenset[IUCNCategory]],
                 declared: Mapping[str, frozenset[IUCNCategory]],
                 target_delta: float, planned_rounds: int, accountant: AccountantName, clipping_norm: float,
                 expected_batch_size: int, noise_multiplier: float, shares_timeout_s: float, stage_timeout_s: float,
                 distributed: bool = False,
                 noise: RandomSource | None = None, after_charge: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, capacities: Mapping[str, int] | None = None) -> None:
        self.federation_id, self.round, self.model_hash = federation_id, round, model_hash
        self.template = template
        self.settings = settings
        self.params = settings.params(federation_id, round)
        self._collector = collector
        self._transport = transport
        self._key = signing_key
        self._charge = charge
        self._over_budget = over_budget
        self._budgets = budgets
        self._halted = halted
        self._declared = declared
        self._delta, self._rounds, self._accountant = target_delta, planned_rounds, accountant
        self._c, self._b, self._z = clipping_norm, expected_batch_size, float(noise_multiplier)
        self._distributed = bool(distributed)
        self._shares_timeout, self._stage_timeout = shares_timeout_s, stage_timeout_s
        self._noise = noise if noise is not None else SecureRandom()
        self._after_charge = after_charge
        self._clock = clock
        self._n: dict[str, int] = {}
        self._capacities = dict(capacities or {})
        self._charged: dict[str, Mapping[IUCNCategory, DPSGDEvent]] = {}

    def _send(self, site: str, stage: str, body: Mapping[str, object]) -> None:
        env = seal(private_key=self._key, federation_id=self.federation_id, site_id=site, round=self.round,
                   base_model_hash=self.model_hash, kind=MessageKind.SECAGG, sequence=self.round,
                   payload=encode_secagg(SecAggMessage(stage, dict(body))))
        try:
            self._transport.publish(task_topic(self.federation_id, site), env.to_bytes(), qos=1)
        except TransportError as exc:  # the site then drops out of the round; recovery covers it
            log.warning("secagg: round %d: %s to %s not sent: %s", self.round, stage, site, exc)

    def run(self) -> GlobalRoundOutcome:
        """Run the stages; never raises for what sites send (a failing stage abandons the round)."""
        server = SecAggServer(self.params)
        inbox = self._collector
        try:
            have = inbox.wait_for("keys", self.params.site_ids, self._stage_timeout, self._clock)
            u1 = server.collect_keys(self._inbox().keys[s] for s in sorted(have))
            key_list = {"keys": [u1[s].to_json() for s in sorted(u1)]}
            for site in sorted(u1):
                self._send(site, "key_list", key_list)
            have = inbox.wait_for("shares", u1, self._shares_timeout, self._clock)
            routed = server.route_shares({s: self._inbox().shares[s] for s in sorted(have)})
            for site, shares in sorted(routed.items()):
                self._send(site, "share_inbox", {"shares": [shares[s].to_json() for s in sorted(shares)]})
            inbox.wait_for("masked", routed, self._stage_timeout, self._clock)
            sites = self._add_masked(server, set(routed))
            request = server.recovery_request()  # U3; raises if < t
            sites = {s: sites[s] for s in request.survivors}
            if self._distributed:
                events = distributed_events(self._z, budgets=self._budgets, sites=sites, target_delta=self._delta,
                                            planned_rounds=self._rounds, clipping_norm=self._c,
                                            vector_length=self.params.vector_length, scale=self.params.scale)
            else:
                events = global_events(self._z, budgets=self._budgets, sites=sites, target_delta=self._delta,
                                       planned_rounds=self._rounds, accountant=self._accountant)
            for site, ev in sorted(events.items()):
                reason = self._over_budget(site, ev)
                if reason is not None:
                    return self._fail(f"abandoned before unmasking, nothing charged: {reason}")
            for site in request.survivors:
                self._send(site, "recovery_request", request.to_json())
            have = inbox.wait_for("recovery", request.survivors, self._stage_timeout, self._clock)
            responses = [self._inbox().recovery[s] for s in sorted(have)]
            if len(responses) < self.params.threshold:
                raise NotEnoughSharesError(f"only {len(responses)} recovery responses, threshold "
                                           f"{self.params.threshold}")
            for site, ev in sorted(events.items()):  # durable BEFORE the sum is seen
                self._charge(site, ev)
                self._charged[site] = ev
            if self._after_charge is not None:
                self._after_charge()
            total = server.unmask_sum(responses)
        except (SecAggError, PayloadError) as exc:  # NotEnoughSharesError is a SecAggError
            return self._fail(f"{type(exc).__name__}: {exc}")
        sensitivity = effective_sensitivity(self._c, self.params.vector_length, self.params.scale)
        sigma = self._z * sensitivity
        # distributed: the noise is already in the opened sum (>= t Skellam shares of mu / (t - f) each, so at least
        # mu = (z C_eff scale)^2 in grid units even without the f shares colluders know)
        noisy = total if self._distributed else total + sigma * self._noise.standard_normal(total.shape[0])
        expected_batch = sum(site_sampling_rate(self._b, self._n[s], distributed=self._distributed) * self._n[s]
                             for s in request.survivors)
        gradient = canonical_unflatten((noisy / expected_batch).astype(np.float32), self.template)
        summary = (f"{len(request.survivors)} of {self.params.num_sites} sites unmasked "
                   f"({len(request.dropped)} dropped after sharing); "
                   f"{self._noise_source()}sigma={sigma:.4g} "
                   f"(C_eff={sensitivity:.6g}, z={self._z:.4g}); "
                   f"normaliser sum q_k N_k={expected_batch:.1f}")
        log.info("secagg: round %d: %s", self.round, summary)
        self._end("closed", summary)
        return GlobalRoundOutcome(status="closed", survivors=request.survivors, noisy_gradient=gradient,
                                  events=events, noise_std=sigma, reason=summary)

    def _inbox(self) -> StageInbox:
        return self._collector.inbox(self.round)

    def _add_masked(self, server: SecAggServer, participants: set[str]
                    ) -> dict[str, tuple[float, tuple[IUCNCategory, ...]]]:
        """Add every acceptable masked sum; a site whose report is unusable is treated as dropped."""
        sites: dict[str, tuple[float, tuple[IUCNCategory, ...]]] = {}
        for site, (vector, n, categories) in list(self._inbox().masked.items()):
            if site not in participants:
                continue
            declared = self._capacities.get(site)
            if declared is not None and n != declared:
                self._reject(site, f"reports N_k={n}, its declared capacity is {declared}; treated as dropped")
                continue
            halted = sorted(c.value for c in categories if c in self._halted.get(site, frozenset()))
            if halted:
                self._reject(site, f"reports halted categories {halted} as trained; treated as dropped")
                continue
            try:
                server.add_masked(site, vector)
            except SecAggError as exc:
                self._reject(site, f"masked sum refused ({exc}); treated as dropped")
                continue
            active = set(categories) | (set(self._declared.get(site, frozenset()))
                                        - set(self._halted.get(site, frozenset())))
            sites[site] = (site_sampling_rate(self._b, n, distributed=self._distributed),
                           tuple(sorted(active, key=lambda c: c.rank)))
            self._n[site] = n
        return sites

    def _reject(self, site: str, detail: str) -> None:
        self._collector.record_rejection(self.round, site, detail)

    def _end(self, status: str, reason: str) -> None:
        """Tell every selected site the round is over (it forgets its secagg state)."""
        for site in self.params.site_ids:
            self._send(site, "round_end", {"status": status, "reason": reason[:500]})

    def _noise_source(self) -> str:
        """The round summary's words for who added the noise (the coordinator's draw says nothing)."""
        if not self._distributed:
            return ""
        f = self.settings.colluding_sites
        return (f"distributed Skellam noise from the sites, shares of mu/(t - f) with t={self.params.threshold}, "
                f"f={f} colluding sites covered; ")

    def _fail(self, reason: str) -> GlobalRoundOutcome:
        if self._charged:
            reason += f" (charged before it failed: {sorted(self._charged)})"
        log.warning("secagg: round %d failed: %s", self.round, reason)
        self._end("failed", reason)
        return GlobalRoundOutcome(status="failed", survivors=tuple(sorted(self._charged)), noisy_gradient=None,
                                  events=dict(self._charged), noise_std=0.0, reason=reason)
