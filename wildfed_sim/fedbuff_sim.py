"""Synchronous rounds with a deadline vs buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022) on the
demo's federation, replayed in one process over simulated wall-clock time with intermittent links.

The learning problem is :mod:`wildfed_sim.demo_sim`'s: the demo's data and site design
(:func:`wildfed_sim.demo_sim.load_federation`), each gateway's own round of training
(:func:`edge_sdk.training.train_locally`: Poisson sampling, CCDP calibrated with dp-accounting, one Gaussian draw
per step), the coordinator's server SGD (:class:`coordinator.optimizers.server_sgd.ServerSGD`) and the demo's
held-out evaluation with its post-hoc logit adjustment (:func:`wildfed_sim.evaluation.evaluate`). Local DP only.

Time (minutes) is simulated; gateways are online per :mod:`wildfed_sim.link_models`. Training model: a gateway
that takes a model trains for ``training_minutes`` (fixed; counted in wall-clock time, or in online time where
offline means powered off, ``powered_offline``), then holds the update in its outbox and uploads it the next
moment it is online. Transfers take no time (a head update is about 50 kB). Each site's budget is planned for
``planned_updates`` updates (the CCDP plan's ``planned_rounds``); the ledger charges every update sent, and a site
takes no more work once its updates sent and in hand reach that number.

* ``sync`` (today's coordinator, docs/transport.md, "Stragglers"): the coordinator opens a round, selecting every
  site with budget left; a selected gateway gets the task when it is online during the round and idle; the round
  closes when every selected site's update is in, or at ``deadline_minutes``; it aggregates what arrived (FedAvg,
  ``n_k / n``; no update: no new model) and the next round opens at once. An update for a closed round is charged
  and discarded.
* ``fedbuff``: an idle gateway with budget left, when online, fetches the newest model and trains; the coordinator
  puts every update it receives into a :class:`coordinator.buffered.StalenessBuffer` (K updates, each weighted
  ``s(t_i) n_i / (K n_mean)``: the fixed denominator, so that a buffer of small, noisy sites takes a small step and
  K = all sites without staleness is one FedAvg round) and steps at every K-th. A gateway learns the current
  version when it is online, and drops (never sends, so is never charged for) an update it knows is older than
  ``max_staleness``. When no site can send again, the coordinator drains the partial buffer.

``run_async`` returns the accuracy after every new model against wall-clock time and against each category's
epsilon (the largest over sites: the guarantee of the worst-placed record), and the budget charged and discarded.
``tests/sim/test_fedbuff_sim.py`` checks that one FedBuff buffer of every site on always-on links equals one
synchronous round, and the charging of late updates.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory

from coordinator.buffered import StalenessBuffer, StalenessWeight

__all__ = ["AsyncConfig", "run_async", "MODES"]

MODES = ("sync", "fedbuff")


@dataclass(frozen=True)
class AsyncConfig:
    """One configuration (module docstring for the two modes).

    ``privacy``: ``"ccdp"`` (the demo's default budgets, gamma 1, VU = 1) or ``"none"``; the local training
    settings default to the demo's tuned DP ones (``wildfed_sim.demo.DP_DEFAULTS``) with its class re-weighting
    0.5 and post-hoc logit adjustment tau 1. ``server_learning_rate`` / ``server_momentum``: the server SGD,
    both modes. ``deadline_minutes``: sync only. ``buffer_size`` (K), ``max_staleness`` and ``staleness``:
    FedBuff only; ``weighting``: the buffer's (:mod:`coordinator.buffered`), default ``"fixed"`` with the sites'
    mean declared capacity as reference weight. ``horizon_minutes``: the run stops there even with budget left.

    Raises:
        ConfigError: an unknown mode or privacy, or a non-positive count or time.
    """

    mode: str = "fedbuff"
    link: str = "always-on"
    privacy: str = "ccdp"
    budgets: Mapping[IUCNCategory, float] = dataclasses.field(
        default_factory=lambda: CCDPBudget.from_anchor("VU", 1.0, 1.0).table())
    planned_updates: int = 10
    local_steps: int = 1
    expected_batch_size: int = 1024
    learning_rate: float = 4.0
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    class_reweighting: float = 0.5
    prediction_tau: float = 1.0
    server_learning_rate: float = 1.0
    server_momentum: float = 0.5
    training_minutes: float = 20.0
    horizon_minutes: float = 7 * 24 * 60.0
    deadline_minutes: float = 180.0
    buffer_size: int = 4
    max_staleness: int = 10
    staleness: StalenessWeight = StalenessWeight()
    weighting: str = "fixed"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}", field="mode", fix="use sync or fedbuff")
        if self.privacy not in ("ccdp", "none"):
            raise ConfigError(f"privacy {self.privacy!r} is not a local-DP mode", field="privacy",
                              fix="use ccdp or none")
        for name in ("planned_updates", "local_steps", "buffer_size", "training_minutes", "horizon_minutes",
                     "deadline_minutes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}", field=name,
                                  fix="see AsyncConfig's defaults")


@dataclass
class _Update:
    delta: dict[str, np.ndarray]
    base: int  # sync: the round; fedbuff: the model version
    events: dict[IUCNCategory, Any]


@dataclass
class _Gateway:
    site: Any
    schedule: Any
    sent: int = 0
    training: _Update | None = None
    ready_at: float = math.inf
    outbox: list[_Update] = dataclasses.field(default_factory=list)
    last_round: int = -1
    events: dict[IUCNCategory, Any] = dataclasses.field(default_factory=dict)  # one update's, per category

    def in_hand(self) -> int:
        return len(self.outbox) + (self.training is not None)


@lru_cache(maxsize=None)
def _epsilon(z: float, q: float, steps: int, delta: float) -> float:
    from shared.privacy.accounting import epsilon_spent
    from shared.privacy.events import DPSGDEvent

    return epsilon_spent([DPSGDEvent(z, q, steps)], target_delta=delta) if steps else 0.0


class _Run:
    """The state of one run: the model, the gateways, the coordinator's round or buffer, the event queue."""

    def __init__(self, fed: Any, config: AsyncConfig, seed: int) -> None:
        from coordinator.optimizers.server_sgd import ServerSGD
        from coordinator.strategies.fedavg import FedAvg
        from edge_sdk.backends.torch_backend import TorchBackend
        from edge_sdk.training import TrainingInputs
        from shared.models.feature_centre import public_centre
        from shared.models.kinds import model_spec
        from shared.privacy.randomness import InsecureRandomnessWarning, SeededRandom
        from wildfed_sim.demo_sim import prediction_offsets_for
        from wildfed_sim.link_models import link_model

        self.fed, self.config = fed, config
        spec = model_spec("head", len(fed.class_categories), adapter_width=0)  # the demo's linear head
        self.weights = spec.initial_weights(seed)
        self.backend = TorchBackend(model=spec, threads=1)
        self.server = ServerSGD(config.server_learning_rate, momentum=config.server_momentum)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureRandomnessWarning)
            self.rngs = {s.site_id: SeededRandom(seed * 1000 + k) for k, s in enumerate(fed.sites)}  # as demo_sim
        centre = public_centre(fed.public_features)
        self.inputs = {s.site_id: TrainingInputs(s, centre) for s in fed.sites}
        self.offsets = prediction_offsets_for(fed, config.prediction_tau)
        self.link = link_model(config.link)
        self.gateways = [_Gateway(s, self.link.schedule(seed, k, config.horizon_minutes))
                         for k, s in enumerate(fed.sites)]
        self.version = 0
        self.queue: list[tuple[float, int, str, int]] = []
        self._seq = 0
        for k, g in enumerate(self.gateways):
            for start, _ in g.schedule.intervals:
                self.push(start, "visit", k)
        self.points: list[dict[str, Any]] = []
        self.charged = self.discarded = self.dropped = 0
        self.budget_spent_at: float | None = None
        self.fedavg = FedAvg()
        self.round = -1
        self.round_open = False
        self.selected: set[int] = set()
        self.arrived = 0
        self.round_weights = self.weights
        mean_capacity = sum(len(s) for s in fed.sites) / len(fed.sites)  # declared capacities: public
        self.buffer = StalenessBuffer(self.weights, size=config.buffer_size, max_staleness=config.max_staleness,
                                      staleness=config.staleness, weighting=config.weighting,
                                      reference_weight=mean_capacity)
        self.record(0.0)

    def push(self, t: float, kind: str, k: int) -> None:
        self._seq += 1
        heapq.heappush(self.queue, (t, self._seq, kind, k))

    # -- the gateway side
    def train(self, k: int, t: float, base_weights: Mapping[str, np.ndarray], base: int) -> None:
        from edge_sdk.training import train_locally
        from shared.protocol import TrainingTask

        c, g = self.config, self.gateways[k]
        budgets = dict(c.budgets) if c.privacy != "none" else {}
        task = TrainingTask(federation_id="sim", round=base, model_hash="0" * 64, local_steps=c.local_steps,
                            expected_batch_size=c.expected_batch_size, learning_rate=c.learning_rate,
                            clipping_norm=c.clipping_norm, target_delta=c.target_delta,
                            planned_rounds=c.planned_updates, privacy=c.privacy, budgets=budgets,
                            class_reweighting=c.class_reweighting if c.privacy == "ccdp" else 0.0)
        result = train_locally(backend=self.backend, dataset=self.inputs[g.site.site_id], task=task,
                               global_weights=base_weights, site_categories=g.site.species_categories,
                               randomness=self.rngs[g.site.site_id],
                               class_categories=dict(enumerate(self.fed.class_categories)))
        g.training = _Update(result.delta, base, dict(result.report.events))
        g.ready_at = (t + c.training_minutes if self.link.powered_offline
                      else g.schedule.after_online_minutes(t, c.training_minutes))
        self.push(g.ready_at, "visit", k)

    def visit(self, k: int, t: float) -> None:
        """Gateway k at time t: a finished update goes to the outbox; online, it sends and takes new work."""
        g = self.gateways[k]
        if g.training is not None and g.ready_at <= t:
            g.outbox.append(g.training)
            g.training = None
        if not g.schedule.online(t):
            return
        while g.outbox:  # one at a time, so that a round opened meanwhile sees what is still in hand
            self.deliver(k, g.outbox.pop(0), t)
        if g.training is None and g.sent + g.in_hand() < self.config.planned_updates:
            if self.config.mode == "fedbuff":
                self.train(k, t, self.weights, self.version)
            elif self.round_open and k in self.selected and g.last_round != self.round:
                g.last_round = self.round
                self.train(k, t, self.round_weights, self.round)

    # -- the coordinator side
    def deliver(self, k: int, update: _Update, t: float) -> None:
        c, g = self.config, self.gateways[k]
        if c.mode == "fedbuff" and self.version - update.base > c.max_staleness:
            self.dropped += 1  # the gateway knows it is too old: never sent, never charged
            return
        g.sent += 1
        self.charged += 1
        g.events = update.events
        n = len(g.site)
        if c.mode == "fedbuff":
            offer = self.buffer.offer(update.delta, base_version=update.base, weight=n)
            assert offer.accepted, offer.reason  # the gateway checked the staleness before sending
            if offer.aggregate is not None:
                self.step(offer.aggregate, t)
            if self.exhausted() and len(self.buffer):
                self.step(self.buffer.flush(), t)  # nothing more can come: drain the partial buffer
        elif self.round_open and update.base == self.round:
            self.fedavg.accumulate(g.site.site_id, update.delta, num_examples=n)
            self.arrived += 1
            if self.arrived == len(self.selected):
                self.close(t)
        else:
            self.discarded += 1  # late: charged, then NACKed
        if self.exhausted() and self.budget_spent_at is None:
            self.budget_spent_at = t
        self.record(t)  # the charge (after any new model it paid for)

    def exhausted(self) -> bool:
        return all(g.sent >= self.config.planned_updates for g in self.gateways)

    def step(self, aggregate: Mapping[str, np.ndarray], t: float) -> None:
        self.weights = self.server.step(self.weights, aggregate)
        self.version += 1
        self.record(t)

    def open_round(self, t: float) -> None:
        P = self.config.planned_updates
        self.selected = {k for k, g in enumerate(self.gateways) if g.sent + g.in_hand() < P}
        if not self.selected:
            return  # every site's budget is spent or in hand: no more rounds
        self.round += 1
        self.round_open, self.arrived, self.round_weights = True, 0, self.weights
        self.fedavg.begin_round(self.weights)
        self.push(t + self.config.deadline_minutes, "deadline", self.round)
        for k in self.selected:
            self.push(t, "visit", k)

    def close(self, t: float) -> None:
        self.round_open = False
        if self.arrived:
            self.step(self.fedavg.aggregate(), t)
        self.open_round(t)

    def record(self, t: float) -> None:
        from shared.models.logit_adjustment import adjusted_for_prediction
        from wildfed_sim.evaluation import evaluate

        if not self.points or self.points[-1]["version"] != self.version:  # a new model: evaluate it
            served = self.weights if self.offsets is None else adjusted_for_prediction(self.weights, self.offsets)
            by_group = dict(evaluate(served, self.fed.test_features, self.fed.test_labels,
                                     self.fed.class_categories).by_group)
        else:  # a charge only: the same model, more epsilon
            by_group = self.points[-1]["by_group"]
        self.points.append({"minutes": t, "version": self.version, "accuracy": by_group["overall"],
                            "sent": [g.sent for g in self.gateways], "epsilon": self.epsilon(),
                            "by_group": by_group})

    def epsilon(self) -> dict[str, float]:
        """``{category: epsilon}`` spent so far, the largest over the sites (each charged for its sends)."""
        out: dict[str, float] = {}
        for g in self.gateways:
            for cat, ev in g.events.items():
                eps = _epsilon(float(ev.noise_multiplier), float(ev.sampling_rate), int(ev.steps) * g.sent,
                               self.config.target_delta)
                out[cat.value] = max(out.get(cat.value, 0.0), eps)
        return out

    def run(self) -> None:
        if self.config.mode == "sync":
            self.open_round(0.0)
        while self.queue:
            t, _, kind, k = heapq.heappop(self.queue)
            if t > self.config.horizon_minutes:
                break
            if kind == "visit":
                self.visit(k, t)
            elif self.round_open and k == self.round:  # this round's deadline
                self.close(t)


def run_async(fed: Any, config: AsyncConfig, *, seed: int) -> dict[str, Any]:
    """Run one configuration on ``fed`` (:func:`wildfed_sim.demo_sim.load_federation`) with links, model and noise
    seeded by ``seed`` (the same draws for both modes: paired runs).

    Returns:
        ``{"points": [{"minutes", "version", "accuracy" (served, overall), "sent": [updates charged per site],
        "epsilon": {category: epsilon so far}, "by_group"}, ...]`` (round 0 first, then one per new model and one
        per update charged, in time order),
        ``"charged"``, ``"discarded"`` (sync: late updates), ``"dropped_unsent"`` (FedBuff: too stale, never
        sent), ``"pending"`` (charged, not yet aggregated when the run stopped), ``"budget_spent_minutes"`` (when
        the last site sent its last update; None if the horizon came first), ``"versions"``, ``"weights"`` (the
        final model).

    Raises:
        ConfigError / PrivacyBudgetError: from :func:`edge_sdk.training.train_locally` on a bad configuration.
    """
    run = _Run(fed, config, seed)
    run.run()
    pending = len(run.buffer) if config.mode == "fedbuff" else (run.arrived if run.round_open else 0)
    return {"points": run.points, "weights": run.weights, "charged": run.charged, "discarded": run.discarded,
            "dropped_unsent": run.dropped, "pending": pending, "budget_spent_minutes": run.budget_spent_at,
            "versions": run.version}
