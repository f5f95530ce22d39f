"""The demo's intermittent links and round mode (``wildfed demo --links NAME --link-minute-s S --buffered K``): the
settings' checks and defaults, one :class:`~wildfed_sim.link_relay.LinkRelay` per gateway, the
:class:`~wildfed_sim.link_driver.LinkDriver` that plays the link model over the real broker, and the report's
``links`` section (the online fractions applied, and what became of every charged update).

``--links always-on`` (the default) changes nothing: no relay, no driver, the gateways talk to the broker directly.
Any other model routes each gateway through its relay from the start (all links up while the gateways start and
connect), and starts the schedules when round 1 opens: minute 0 of gateway k's schedule is then, drawn as
``link_model(name).schedule(seed, k, horizon)`` from the demo's seed, so two runs of one seed see the same outages
whatever their round mode. Every link comes back up once the last round has closed (the final models are then
delivered as in any demo).

Times in compressed time: ``round_deadline_s`` and ``round_duration_s`` are real seconds at the coordinator and
the gateways, and the gateways' own computing is not compressed (a second of training is 1 / ``link_minute_s``
simulated minutes). Unless given, a link run sets

- ``round_duration_s`` (each reply leaves this long after its task: the timing padding, docs/privacy.md "Timing")
  to :data:`TRAINING_MINUTES` simulated minutes, the time a gateway takes per update in the laboratory's replay
  (wildfed_sim/fedbuff_sim.py), so a gateway trains as long there as here whatever its real speed, and a reply
  that outlasts its pass leaves at the next one (it waits in the outbox);
- ``round_deadline_s`` to :data:`COVERING_MINUTES` of the model: long enough for a gateway that has just lost its
  link when a task goes out to get it at its next window, and for its reply to leave at the window after its
  training and still arrive, so a synchronous round closes with every site and discards nothing
  (docs/results/fedbuff.md: at a deadline shorter than the gaps, sync discarded every update under satellite
  passes). A shorter ``--round-deadline-s`` shows that waste.

On always-on links both stay as before (300 s and 0).
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

from sqlalchemy import select

from shared.errors import ConfigError

from wildfed_sim.link_driver import GateGroup, LinkDriver, ProcessGate, RelayGate
from wildfed_sim.link_models import LINK_MODELS, link_model
from wildfed_sim.link_relay import LinkRelay

__all__ = ["COVERING_MINUTES", "TRAINING_MINUTES", "HORIZON_MIN", "check_link_settings", "DemoLinks",
           "update_accounting", "print_links_summary"]

#: simulated minutes a synchronous round's deadline covers, per link model (module docstring): three satellite
#: periods (up to one to the pass that brings the task, one from the reply's slot to the pass that carries it, one
#: of margin for a missed pass), a day and a night for solar gateways, five mean outages under cellular (an outage
#: that long has probability e^-5) plus the training time
COVERING_MINUTES = {"satellite": 3 * 90.0, "solar-night": 24 * 60.0 + 20.0, "cellular": 5 * 60.0 + 20.0}
#: simulated minutes from a task to its reply on intermittent links (the laboratory replay's training time)
TRAINING_MINUTES = 20.0
#: the schedules' horizon, simulated minutes (30 days); past it every gateway stays online
HORIZON_MIN = 30 * 24 * 60.0
DEFAULT_DEADLINE_S = 300.0


def check_link_settings(settings: Any) -> None:
    """Check and resolve the link and round-mode fields of :class:`wildfed_sim.demo.DemoSettings` in place (its
    ``__post_init__`` calls this before its own checks): ``links``, ``link_minute_s``, ``buffered``,
    ``max_staleness``; ``round_deadline_s`` None -> 300 s on always-on links, else the model's covering deadline in
    real seconds; ``round_duration_s`` None -> 0 on always-on links, else :data:`TRAINING_MINUTES` in real seconds.

    Raises:
        ConfigError: an unknown link model, a non-positive compression, a negative buffer or padding, a padding not
            below the deadline, or buffered rounds with a privacy mode or strategy they do not support.
    """
    if settings.links not in LINK_MODELS:
        raise ConfigError(f"unknown link model {settings.links!r}", field="links",
                          fix=f"use --links {' or '.join(LINK_MODELS)}")
    if not (isinstance(settings.link_minute_s, (int, float)) and settings.link_minute_s > 0
            and math.isfinite(settings.link_minute_s)):
        raise ConfigError(f"link_minute_s must be positive seconds, got {settings.link_minute_s!r}",
                          field="link_minute_s", fix="use --link-minute-s 0.25 (a satellite pass: 2.5 s every 22.5 s)")
    if type(settings.buffered) is not int or settings.buffered < 0:
        raise ConfigError(f"buffered must be an integer >= 0, got {settings.buffered!r}", field="buffered",
                          fix="use --buffered 0 (synchronous rounds) or e.g. --buffered 4")
    if type(settings.max_staleness) is not int or settings.max_staleness < 0:
        raise ConfigError(f"max_staleness must be an integer >= 0, got {settings.max_staleness!r}",
                          field="max_staleness", fix="use --max-staleness 10")
    if settings.buffered and (settings.privacy != "ccdp" or settings.strategy != "fedavg"):
        raise ConfigError(f"buffered rounds fold stale updates into FedAvg's sum under local DP; got privacy "
                          f"{settings.privacy!r}, strategy {settings.strategy!r} (secure aggregation needs a "
                          f"synchronous cohort)", field="buffered",
                          fix="use --privacy ccdp --strategy fedavg with --buffered, or --buffered 0")
    always_on = settings.links == "always-on"
    if settings.round_deadline_s is None:
        deadline = DEFAULT_DEADLINE_S if always_on else COVERING_MINUTES[settings.links] * settings.link_minute_s
        object.__setattr__(settings, "round_deadline_s", float(deadline))
    if settings.round_duration_s is None:
        padding = 0.0 if always_on else TRAINING_MINUTES * settings.link_minute_s
        object.__setattr__(settings, "round_duration_s", float(padding))
    if not (settings.round_duration_s >= 0 and math.isfinite(settings.round_duration_s)):
        raise ConfigError(f"round_duration_s must be >= 0 seconds, got {settings.round_duration_s}",
                          field="round_duration_s", fix="use 0 (no padding) or leave it unset")
    if settings.round_duration_s and settings.round_duration_s >= settings.round_deadline_s:
        raise ConfigError(f"round_duration_s {settings.round_duration_s:g} s must be below round_deadline_s "
                          f"{settings.round_deadline_s:g} s: every reply leaves round_duration_s after its task",
                          field="round_duration_s", fix="lower --round-duration-s or raise --round-deadline-s")


class DemoLinks:
    """The demo's links for ``sites`` gateways on ``broker_url`` (module docstring); a context manager that closes
    the relays.

    Args:
        settings: the demo's settings (``links``, ``link_minute_s``, ``buffered``, ``max_staleness``, ``seed``).
        broker_url: the broker the relays forward to.
        sites: the number of gateways.
    """

    def __init__(self, settings: Any, broker_url: str, sites: int) -> None:
        self.settings, self.broker_url, self.sites = settings, broker_url, int(sites)
        self.model = link_model(settings.links)
        self.relays = ([] if settings.links == "always-on" else [LinkRelay(broker_url) for _ in range(sites)])
        self.driver: LinkDriver | None = None

    def site_url(self, k: int) -> str:
        """The broker URL gateway ``k`` connects to: its relay's, or the broker's on always-on links."""
        return self.relays[k].url if self.relays else self.broker_url

    def coordinator_section(self) -> dict[str, Any]:
        """The coordinator config's round-mode section: ``{"buffered": {...}}`` for buffered rounds, else empty.
        Each site's noise is planned for the updates it sends in expectation, ``rounds x K / sites`` (at least 1,
        at most ``rounds``: a site trains a round at most once): a round takes K updates of the ``sites``, so that a
        site spends its budget over the rounds it reaches."""
        if not self.settings.buffered:
            return {}
        k = self.settings.buffered
        updates = min(self.settings.rounds, max(1, round(self.settings.rounds * k / max(1, self.sites))))
        return {"buffered": {"buffer_size": k, "max_staleness": self.settings.max_staleness,
                             "updates_per_site": updates}}

    def start(self, stack: ExitStack, processes: list[Any]) -> None:
        """Start the schedules now (round 1 is about to open); ``stack`` stops the driver before it stops the
        gateways (a stopped process must be continued before it can be terminated). No-op on always-on links."""
        if not self.relays:
            return
        gates: list[Any] = [RelayGate(r) for r in self.relays]
        if not self.model.powered_offline:  # powered off offline: the process is stopped too
            gates = [GateGroup([gate, ProcessGate(p)]) for gate, p in zip(gates, processes)]
        schedules = [self.model.schedule(self.settings.seed, k, HORIZON_MIN) for k in range(len(self.relays))]
        self.driver = LinkDriver(gates, schedules, minute_s=self.settings.link_minute_s, horizon_min=HORIZON_MIN)
        stack.callback(self.stop)
        self.driver.start()

    def stop(self) -> None:
        """Every link up and every gateway continued; idempotent."""
        if self.driver is not None:
            self.driver.stop()

    def summary(self, store: Any, history: list[dict[str, Any]], site_ids: list[str]) -> dict[str, Any]:
        """The report's ``links`` section: model, compression, simulated hours, online fractions applied and
        scheduled per site, the round mode, and :func:`update_accounting`."""
        out: dict[str, Any] = {"model": self.settings.links, "duty_cycle": self.model.duty_cycle(),
                               "minute_s": self.settings.link_minute_s,
                               "round_deadline_s": self.settings.round_deadline_s,
                               "round_duration_s": self.settings.round_duration_s,
                               "buffered": self.coordinator_section().get("buffered"),
                               "stale_folded_by_round": {h["round"]: h.get("stale", []) for h in history
                                                         if h.get("stale")},
                               "updates": update_accounting(store)}
        if self.driver is not None:
            applied = self.driver.applied
            out["simulated_hours"] = applied[0].elapsed_s / self.settings.link_minute_s / 60 if applied else 0.0
            out["online_fraction"] = {site: {"applied": a.applied_fraction, "scheduled": a.scheduled_fraction,
                                             "windows": sum(1 for _, up in a.toggles if up)}
                                      for site, a in zip(site_ids, applied)}
            out["driver_error"] = repr(self.driver.error) if self.driver.error is not None else None
        return out

    def close(self) -> None:
        """Stop the driver and close every relay (idempotent)."""
        self.stop()
        for relay in self.relays:
            relay.close()

    def __enter__(self) -> "DemoLinks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def update_accounting(store: Any) -> dict[str, int]:
    """What became of every update the coordinator charged, from its database: ``charged`` (distinct (site,
    round) pairs in the ledger), ``aggregated`` (folded into a closed round: its own, or stale into a later one),
    ``stale_folded`` (of those, the stale ones), ``waiting`` (stale, stored, no round closed after it arrived),
    ``discarded`` (charged, neither aggregated nor waiting: late, or in a failed round) and ``late`` (refused as
    late)."""
    from coordinator.ledger_streams import base_site
    from coordinator.tables import BufferedUpdateRow, LedgerRow, RejectionRow, RoundRow, UpdateRow

    with store.session() as s:
        charged = {(base_site(site), r) for site, r in s.execute(select(LedgerRow.site_id, LedgerRow.round))}
        closed = set(s.scalars(select(RoundRow.round).where(RoundRow.status == "closed")))
        buffered = dict(s.execute(select(BufferedUpdateRow.update_id, BufferedUpdateRow.buffer_round)).all())
        updates = s.execute(select(UpdateRow.id, UpdateRow.site_id, UpdateRow.round)).all()
        late = len(s.scalars(select(RejectionRow.id).where(RejectionRow.reason == "late")).all())
    aggregated, waiting, stale = set(), set(), 0
    for uid, site, r in updates:
        if uid in buffered:
            if buffered[uid] is None:
                waiting.add((site, r))
            elif buffered[uid] in closed:
                aggregated.add((site, r))
                stale += 1
        elif r in closed:
            aggregated.add((site, r))
    return {"charged": len(charged), "aggregated": len(aggregated), "stale_folded": stale, "waiting": len(waiting),
            "discarded": len(charged - aggregated - waiting), "late": late}


def print_links_summary(links: dict[str, Any] | None, console: Any) -> None:
    """The demo summary's lines on links and updates (nothing on always-on links with synchronous rounds)."""
    if not links or (links["model"] == "always-on" and not links["buffered"]):
        return
    mode = (f"buffered rounds (K = {links['buffered']['buffer_size']}, max staleness "
            f"{links['buffered']['max_staleness']})" if links["buffered"] else "synchronous rounds")
    line = (f"links: {links['model']} (duty cycle {links['duty_cycle']:.3f}), one simulated minute = "
            f"{links['minute_s']:g} s, {mode}, round deadline {links['round_deadline_s']:g} s, replies "
            f"{links['round_duration_s']:g} s after their task")
    if "simulated_hours" in links:
        line += f"; rounds ran {links['simulated_hours']:.1f} simulated hours"
    console.log(line)
    if links.get("online_fraction"):
        fractions = ", ".join(f"{site} {v['applied']:.2f}/{v['scheduled']:.2f}"
                              for site, v in links["online_fraction"].items())
        console.log(f"online fraction applied/scheduled per site: {fractions}")
    u = links["updates"]
    console.log(f"updates: {u['charged']} charged, {u['aggregated']} aggregated ({u['stale_folded']} of them stale, "
                f"folded into a later round), {u['waiting']} waiting (arrived after the last round), "
                f"{u['discarded']} discarded ({u['late']} refused as late)")
    if links.get("driver_error"):
        console.log(f"[red]the link driver stopped on an error: {links['driver_error']}[/]")
