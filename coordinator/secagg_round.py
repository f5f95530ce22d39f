"""Driving one Global DP round's secure aggregation: stages 3-4 of :mod:`coordinator.global_dp`.

:class:`SecureAggregationRound` runs the round from its :class:`coordinator.round_plan.GlobalRoundPlan`: it sends the
coordinator's stage messages, waits for the sites' replies in a :class:`coordinator.secagg_collector.SecAggCollector`,
charges the survivors before unmasking, unmasks their sum and adds the noise once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import MessageKind, seal
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.distributed import site_sampling_rate
from shared.privacy.events import DPSGDEvent
from shared.privacy.randomness import RandomSource, SecureRandom
from shared.protocol import SecAggMessage, canonical_unflatten, encode_secagg
from shared.secagg import NotEnoughSharesError, SecAggError, SecAggServer
from shared.topics import task_topic

from coordinator.global_dp import distributed_events, effective_sensitivity, global_events
from coordinator.round_plan import GlobalRoundPlan
from coordinator.secagg_collector import SecAggCollector, StageInbox
from coordinator.transport import Transport, TransportError

__all__ = ["GlobalRoundOutcome", "SecureAggregationRound"]

log = logging.getLogger("coordinator.global_dp")  # Global DP's log, whichever of its modules writes


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
    """Drives stages 3-4 of the :mod:`coordinator.global_dp` docstring for one round: publishes the coordinator's
    stage messages, waits for the sites' replies through a :class:`SecAggCollector`, unmasks, charges and adds the
    noise.

    Args:
        plan: the round's fixed parameters (:class:`coordinator.round_plan.GlobalRoundPlan`: the round, its
            settings as sent in the tasks, calibration, who is halted and declared what, capacities, waits).
        collector: the open collector (``open_round`` already called for this round).
        transport: where stage messages go (each site's task topic). signing_key: the coordinator's key.
        charge: ``charge(site, events)`` writes a survivor's events to the ledger durably (called before the sum
            is unmasked). over_budget: ``over_budget(site, events)`` returns a reason if charging would pass a
            budget (the round is then abandoned before anything is charged or unmasked), else None.
        noise: secure source of the coordinator's one Gaussian draw (default :class:`SecureRandom`).
        after_charge: called after charging, before unmasking (the crash-test hook).
        clock: monotonic clock in seconds for the waits.
    """

    def __init__(self, plan: GlobalRoundPlan, *, collector: SecAggCollector, transport: Transport,
                 signing_key: Ed25519PrivateKey,
                 charge: Callable[[str, Mapping[IUCNCategory, DPSGDEvent]], None],
                 over_budget: Callable[[str, Mapping[IUCNCategory, DPSGDEvent]], str | None],
                 noise: RandomSource | None = None, after_charge: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.federation_id, self.round, self.model_hash = plan.federation_id, plan.round, plan.model_hash
        self.template = plan.template
        self.settings = plan.settings
        self.params = plan.settings.params(plan.federation_id, plan.round)
        self._collector = collector
        self._transport = transport
        self._key = signing_key
        self._charge = charge
        self._over_budget = over_budget
        self._budgets = plan.budgets
        self._halted = plan.halted
        self._declared = plan.declared
        self._delta, self._rounds, self._accountant = plan.target_delta, plan.planned_rounds, plan.accountant
        self._c, self._b, self._z = plan.clipping_norm, plan.expected_batch_size, float(plan.noise_multiplier)
        self._distributed = bool(plan.distributed)
        self._shares_timeout, self._stage_timeout = plan.shares_timeout_s, plan.stage_timeout_s
        self._noise = noise if noise is not None else SecureRandom()
        self._after_charge = after_charge
        self._clock = clock
        self._n: dict[str, int] = {}
        self._capacities = dict(plan.capacities or {})
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
