"""The demo's observer tables: the epsilon each observer faces in the default demo, per privacy mode, computed by
:func:`shared.privacy.observers.observer_table` on the charges the coordinator and gateways plan
(docs/privacy.md, "Who the guarantee holds against", quotes :func:`demo_observer_markdown`; ``wildfed observers``
prints it).

The charges per category over the demo's planned rounds, from public values only, by the product's own planners:

- ``"distributed"``: :func:`coordinator.global_dp.plan_global_round` (z, the grid's scale) and
  :func:`coordinator.global_dp.distributed_events` for the demo's model, its secure-aggregation threshold
  (:func:`wildfed_sim.demo.secagg_threshold`) and the coordinator's default ``secagg.colluding_sites``;
- ``"trusted-server"``: :func:`coordinator.global_dp.global_events` at the plan's z;
- ``"ccdp"``: the gateway's individualized DP-SGD plan (``shared.privacy.individualized``: the anchor's z, each
  category's rate) over ``rounds * local_steps`` steps.

The trusted-server and CCDP charges are shown for a site whose records are all in every step (q_k = 1: N <= B):
every site's categories are calibrated to spend their budgets whatever its rate, so the figures are the budgets
(within the calibration's 1 %) at any site.
"""

from __future__ import annotations

from shared.iucn import CCDPBudget, IUCNCategory, parse_category
from shared.privacy.events import DPSGDEvent, PrivacyEvent
from shared.privacy.observers import MODES, Mode, ObserverRow, markdown_table, observer_table

from wildfed_sim.demo import DemoSettings, secagg_threshold

__all__ = ["demo_charges", "demo_observer_tables", "demo_observer_markdown"]

_LABELS = {"ccdp": "Local CCDP (each gateway noises its own update)",
           "trusted-server": "Global DP, trusted server (the coordinator adds the noise to the opened sum)",
           "distributed": "Global DP, distributed noise (the sites' Skellam shares)"}


def _model_size(settings: DemoSettings) -> int:
    from shared.models.kinds import model_spec
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    spec = model_spec("head", len(SPECIES_TABLE), adapter_width=settings.adapter_width)
    return sum(int(w.size) for w in spec.initial_weights(0).values())


def _colluding_sites() -> int:
    from coordinator.config_privacy import SecAggConfig

    return SecAggConfig().colluding_sites


def demo_charges(mode: Mode, settings: DemoSettings) -> dict[IUCNCategory, list[PrivacyEvent]]:
    """``{category: [event over the planned rounds]}`` that the demo's ``settings`` (privacy mode replaced by
    ``mode``) charge a site (module docstring).

    Raises:
        ConfigError / PrivacyBudgetError: as the planners.
    """
    from coordinator.global_dp import distributed_events, global_events, plan_global_round
    from shared.privacy.individualized import anchor_noise_multiplier, individual_sampling_rates

    budgets = CCDPBudget.from_anchor(parse_category(settings.anchor_category), settings.anchor_epsilon,
                                     settings.gamma).table()
    cats = tuple(budgets)
    if mode == "ccdp":
        steps = settings.rounds * int(settings.local_steps)
        z = anchor_noise_multiplier(budgets=budgets, categories=cats, target_delta=settings.target_delta,
                                    max_rate=1.0, steps=steps)
        rates = individual_sampling_rates(noise_multiplier=z, budgets=budgets, categories=cats,
                                          target_delta=settings.target_delta, max_rate=1.0, steps=steps)
        return {c: [DPSGDEvent(z, q, steps)] for c, q in rates.items()}
    sites = {f"site-{k}": 1.0 for k in range(settings.sites)}
    d = _model_size(settings)
    common = dict(budgets=budgets, target_delta=settings.target_delta, planned_rounds=settings.rounds)
    settings_, z = plan_global_round(sampling_rates=sites, vector_length=d, clipping_norm=settings.clipping_norm,
                                     expected_batch_size=int(settings.expected_batch_size),
                                     distributed=mode == "distributed", threshold=secagg_threshold(settings),
                                     colluding_sites=_colluding_sites(), **common)
    one = {"site-0": (1.0, cats)}
    events = (distributed_events(z, sites=one, clipping_norm=settings.clipping_norm, vector_length=d,
                                 scale=settings_.scale, **common) if mode == "distributed"
              else global_events(z, sites=one, **common))["site-0"]
    return {c: [e.with_steps(settings.rounds)] for c, e in events.items()}


def demo_observer_tables(settings: DemoSettings | None = None) -> dict[Mode, list[ObserverRow]]:
    """Per mode, :func:`shared.privacy.observers.observer_table` of :func:`demo_charges` (``settings``: the
    default demo's, with ``privacy="global"``, when None)."""
    settings = settings if settings is not None else DemoSettings(privacy="global")
    t = secagg_threshold(settings)
    return {mode: observer_table(mode=mode, charged=demo_charges(mode, settings), target_delta=settings.target_delta,
                                 threshold=t if mode == "distributed" else None,
                                 colluding_sites=_colluding_sites() if mode == "distributed" else 0)
            for mode in MODES}


def demo_observer_markdown(settings: DemoSettings | None = None) -> str:
    """The Markdown that docs/privacy.md quotes: one table per mode (:func:`shared.privacy.observers.markdown_table`)
    under a heading line naming the demo's settings."""
    settings = settings if settings is not None else DemoSettings(privacy="global")
    t, f = secagg_threshold(settings), _colluding_sites()
    head = (f"Default demo: {settings.sites} sites, {settings.rounds} rounds, budgets from_anchor("
            f"{settings.anchor_category}, {settings.anchor_epsilon:g}, gamma {settings.gamma:g}), delta "
            f"{settings.target_delta:g}; distributed noise with t = {t} of {settings.sites} sites and "
            f"colluding_sites f = {f}, worst case of exactly t survivors.")
    parts = [head]
    for mode, rows in demo_observer_tables(settings).items():
        parts += ["", f"*{_LABELS[mode]}*", "", markdown_table(rows, list(IUCNCategory))]
    return "\n".join(parts)
