"""The demo's federation in one process, for tuning its hyper-parameters (every mode tuned
with the same effort, on tuning seeds that are not the reported one).

``wildfed demo`` runs a real coordinator, real gateways and a broker; a tuning sweep needs hundreds of runs, so this
module replays the same learning problem without the transport: the demo's data and site design
(:func:`wildfed_sim.common.demo_data.design_sites_with_public_split` on the split of
:func:`wildfed_sim.animal_mnist.split_holdout`, duplicates dropped as the demo drops them), the gateways' own round of training
(:func:`edge_sdk.training.train_locally`, so the same Poisson sampling, calibration of the noise multipliers with
dp-accounting and the same CCDP mechanism), FedAvg weights ``n_k / n`` (McMahan et al. 2017, Alg. 1) and the
coordinator's server optimizer (:class:`coordinator.optimizers.server_sgd.ServerSGD`, FedAvgM when momentum > 0),
then the demo's held-out evaluation (:func:`wildfed_sim.evaluation.evaluate`). Randomness is seeded
(:class:`~shared.privacy.randomness.SeededRandom`): these are laboratory runs, never a deployment.

What it leaves out is what does not change the learning: signing, chunking, the ledger's refusals (no site is
halted in a planned run) and secure randomness. ``tests/sim/test_demo_sim.py`` checks one round against the
hand-worked FedAvg of one full-batch step;
``wildfed_sim/tune_demo.py`` is the sweep that picked the demo's defaults (docs/demo-data.md, "Tuning").
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.iucn import CCDPBudget, IUCNCategory

__all__ = ["SimSite", "SimFederation", "load_federation", "SimConfig", "simulate", "prediction_offsets_for"]


@dataclass(frozen=True)
class SimSite:
    """One site's records as its gateway trains on them.

    Attributes:
        site_id: ``site-00``... features: float32 (N, 1280) backbone embeddings. labels: int64 (N,) class indices.
        categories: int8 (N,) IUCN ranks of the records' species. species_categories: the categories of the site's
            species table (public configuration: they decide which categories get noise).
        species: the class indices of the site's species table, sorted (CR/EN included: the site knows them; only
            the others are on its public list, :meth:`public_metadata`).
    """

    site_id: str
    features: np.ndarray
    labels: np.ndarray
    categories: np.ndarray
    species_categories: tuple[IUCNCategory, ...]
    species: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def public_metadata(self, class_names: Sequence[str], class_categories: Sequence[IUCNCategory]
                        ) -> dict[str, Any]:
        """The registry metadata the demo enrols this site with: ``{"capacity": N_k, "species": [scientific
        names]}``, sensitive (CR/EN) species left out (docs/privacy.md, "Public metadata")."""
        return {"capacity": len(self),
                "species": [class_names[c] for c in self.species if not class_categories[c].is_sensitive]}


@dataclass(frozen=True)
class SimFederation:
    """The demo's federation for one seed: sites, the held-out test split, and the public split (training images
    no site holds; only its embedding mean is used, never its labels) with ``class_categories[k]`` the IUCN
    category of class k and ``class_names[k]`` its scientific name (empty: the demo's species table)."""

    sites: tuple[SimSite, ...]
    test_features: np.ndarray
    test_labels: np.ndarray
    public_features: np.ndarray
    class_categories: tuple[IUCNCategory, ...]
    class_names: tuple[str, ...] = ()


def load_federation(seed: int, *, num_sites: int = 8) -> SimFederation:
    """The demo's data for ``seed`` (the same split, site design and de-duplication as ``wildfed demo --seed``),
    with every image embedded by the gateway's backbone (cached: :func:`wildfed_sim.embeddings.embed_grayscale`)."""
    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.common.demo_data import demo_sites, public_images
    from wildfed_sim.embeddings import embed_grayscale

    train, test, specs, _ = demo_sites(seed, num_sites)
    public = public_images(train, specs, public_per_class=0, seed=seed)  # as the demo's feature centre
    class_categories = tuple(SPECIES_TABLE[k].iucn for k in range(len(SPECIES_TABLE)))
    ranks = np.asarray([c.rank for c in class_categories], dtype=np.int8)
    sites = []
    for s in specs:
        idx = np.asarray(s.indices, dtype=np.int64)
        feats = embed_grayscale(train.images[idx], train.source_indices[idx])
        labels = train.labels[idx].astype(np.int64)
        sites.append(SimSite(s.site_id, feats, labels, ranks[labels],
                             tuple(sorted({class_categories[c] for c in s.species}, key=lambda c: c.rank)),
                             tuple(sorted(int(c) for c in s.species))))
    test_features = embed_grayscale(test.images, test.source_indices)
    public_features = (embed_grayscale(train.images[public], train.source_indices[public]) if len(public)
                       else np.zeros((0, test_features.shape[1]), np.float32))
    return SimFederation(tuple(sites), test_features, test.labels.astype(np.int64), public_features,
                         class_categories)


@dataclass(frozen=True)
class SimConfig:
    """One configuration: the demo's settings of the same names (``wildfed demo --help``).

    ``privacy``: ``"ccdp"`` (local DP at each gateway), ``"global"`` (one step per round: each site's clipped sum,
    the noise added once to their sum; ``global_noise`` ``"trusted-server"`` or ``"distributed"``, as the demo's
    ``--global-noise``) or ``"none"``; ``budgets``: epsilon per category (ignored for ``"none"``);
    ``server_learning_rate`` and ``server_momentum``: the coordinator's server SGD (1 and 0 are FedAvg);
    ``centre``: the gateways train on embeddings centred by the public split's mean (site config
    ``feature_centre``, :mod:`shared.models.feature_centre`); ``secagg_threshold``: Global DP's secure-aggregation
    threshold t, which the distributed noise is calibrated for (None: the coordinator's default, coordinator config
    ``secagg.threshold``); ``colluding_sites``: how many colluding participants the distributed noise survives (each
    site adds mu / (t - f); coordinator config ``secagg.colluding_sites``, whose default it shares);
    ``class_reweighting``: local CCDP's class-row re-weighting exponent
    (``TrainingTask.class_reweighting``; needs ``logit_adjustment``, which hands the gateway the species table);
    ``prediction_tau``: the coordinator's post-hoc logit adjustment (coordinator config
    ``posthoc_logit_adjustment``, the demo's ``--posthoc-logit-adjustment``): the model is evaluated with
    ``psi.bias - tau (log pi - mean log pi)``, pi estimated from the sites' public metadata
    (:mod:`shared.models.logit_adjustment`); 0 = off.
    """

    privacy: str = "ccdp"
    budgets: Mapping[IUCNCategory, float] = dataclasses.field(
        default_factory=lambda: CCDPBudget.from_anchor("VU", 1.0, 1.0).table())
    rounds: int = 10
    local_steps: int = 5
    expected_batch_size: int = 256
    learning_rate: float = 0.5
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0
    adapter_width: int = 0
    centre: bool = True
    ccdp_variant: str = "sample"
    logit_adjustment: bool = True
    global_noise: str = "trusted-server"
    secagg_threshold: int | None = None
    colluding_sites: int = 1
    class_reweighting: float = 0.0
    prediction_tau: float = 0.0


def prediction_offsets_for(fed: SimFederation, tau: float) -> np.ndarray | None:
    """float64 (K,) offsets of the post-hoc logit adjustment with ``tau`` from the sites' public metadata
    (:meth:`SimSite.public_metadata`, as the demo enrols them; the coordinator's
    ``RoundManager.prediction_offsets``), or None for tau 0."""
    from shared.models.logit_adjustment import metadata_offsets
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    if not tau > 0:
        return None
    num_classes = len(fed.class_categories)
    names = fed.class_names or tuple(SPECIES_TABLE[j].scientific_name for j in range(num_classes))
    metadata = {s.site_id: s.public_metadata(names, fed.class_categories) for s in fed.sites}
    index = {name: k for k, name in enumerate(names)}
    return metadata_offsets(metadata, index, num_classes, tau)


def simulate(fed: SimFederation, config: SimConfig, *, seed: int, noise_seed: int | None = None,
             strategy: Any = None) -> dict[str, Any]:
    """Run ``config.rounds`` rounds of the demo's federation on ``fed`` and evaluate the global model.

    ``seed`` fixes the initial model and, unless ``noise_seed`` is given, the sampling and noise of every site
    (``noise_seed``: another draw of them for the same initial model). ``strategy``: the coordinator's aggregation
    strategy (:class:`coordinator.strategies.base.Strategy`, e.g. :class:`coordinator.strategies.nira.NIRA`; None:
    FedAvg), driven as :class:`coordinator.rounds.RoundManager` drives it (prepare, site_weights, accumulate with
    each update's DP noise variance, aggregate, server step, after_step, end_round); not with ``"global"``.

    Returns:
        ``{"round0": Accuracy.by_group, "final": Accuracy.by_group, "final_by_category": {code: accuracy},
        "noise_multipliers": {site: {code: z}}, "sampling_rates": {site: {code: q_c}}, "events": {site: {category:
        event}} (what each category's records went through over all rounds, as the ledger composes it: a
        ``DPSGDEvent`` or, distributed Global DP, a ``SkellamEvent``; empty without privacy), "weights": the final
        global model (the strategy's bundle), "site_models": {site: the model it would receive}, "count_events":
        {site: {category: DPSGDEvent}} of the noisy class counts a NIRA strategy asked for (empty otherwise)}``
        (accuracies
        are fractions; ``"final"`` evaluates ``"weights"`` under FedAvg, logit-adjusted when
        ``config.prediction_tau`` > 0, and is empty under another strategy), ``"final_unadjusted"``: ``"weights"``
        as trained (equal to ``"final"`` for tau 0).

    Raises:
        ConfigError / PrivacyBudgetError: from :func:`edge_sdk.training.train_locally` on a bad configuration.
    """
    from coordinator.optimizers.server_sgd import ServerSGD
    from coordinator.strategies.base import update_noise_variance
    from coordinator.strategies.fedavg import FedAvg
    from edge_sdk.backends.torch_backend import TorchBackend
    from shared.models.feature_centre import public_centre
    from edge_sdk.training import TrainingInputs, train_locally
    from shared.models.kinds import model_spec
    from shared.privacy.randomness import InsecureRandomnessWarning, SeededRandom
    from shared.protocol import TrainingTask
    from wildfed_sim.evaluation import evaluate

    num_classes = len(fed.class_categories)
    spec = model_spec("head", num_classes, adapter_width=config.adapter_width)
    weights = spec.initial_weights(seed)
    backend = TorchBackend(model=spec, threads=1)
    server = ServerSGD(config.server_learning_rate, momentum=config.server_momentum)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureRandomnessWarning)
        base = seed if noise_seed is None else noise_seed
        rngs = {s.site_id: SeededRandom(base * 1000 + k) for k, s in enumerate(fed.sites)}
    round0 = evaluate(weights, fed.test_features, fed.test_labels, fed.class_categories)
    budgets = dict(config.budgets) if config.privacy != "none" else {}
    zs: dict[str, dict[str, float]] = {}
    rates: dict[str, dict[str, float]] = {}
    centre = public_centre(fed.public_features) if config.centre else None
    inputs = {s.site_id: TrainingInputs(s, centre) for s in fed.sites}  # as each gateway prepares them once
    table = dict(enumerate(fed.class_categories))  # the species table every demo gateway holds (public)
    if config.privacy == "global":
        weights, events = _simulate_global(fed, config, weights, backend, server, rngs, centre, inputs)
        final, plain_final = _final(fed, weights, config.prediction_tau)
        return {"round0": round0.by_group, "final": final.by_group, "final_unadjusted": plain_final.by_group,
                "final_by_category": {c.value: a for c, a in final.by_category.items()}, "noise_multipliers": {},
                "sampling_rates": {}, "events": events, "weights": weights}
    events: dict[str, dict[IUCNCategory, Any]] = {}
    count_events: dict[str, dict[IUCNCategory, Any]] = {}
    plain = strategy is None
    strategy = FedAvg() if strategy is None else strategy
    for r in range(config.rounds):
        task = TrainingTask(federation_id="sim", round=r, model_hash="0" * 64, local_steps=config.local_steps,
                            expected_batch_size=config.expected_batch_size, learning_rate=config.learning_rate,
                            clipping_norm=config.clipping_norm, target_delta=config.target_delta,
                            planned_rounds=config.rounds, privacy=config.privacy, budgets=budgets,
                            ccdp_variant=config.ccdp_variant,
                            class_reweighting=config.class_reweighting if config.privacy == "ccdp" else 0.0,
                            count_noise_multiplier=strategy.count_noise_multiplier() if budgets else None)
        bundle = strategy.prepare(weights, round=r + 1)  # the coordinator's rounds count from 1
        strategy.begin_round(bundle)
        for site in fed.sites:
            site_weights = strategy.site_weights(bundle, site.site_id)
            result = train_locally(backend=backend, dataset=inputs[site.site_id], task=task,
                                   global_weights=site_weights,
                                   site_categories=site.species_categories, randomness=rngs[site.site_id],
                                   class_categories=table if config.logit_adjustment else None)
            zs[site.site_id] = {c.value: z for c, z in result.noise_multipliers.items()}
            _compose_into(events, site.site_id, result.report.events)  # what the ledger would charge
            rates[site.site_id] = {c.value: q for c, q in result.sampling_rates.items()}
            variance = update_noise_variance(result.report.events, clipping_norm=config.clipping_norm,
                                             learning_rate=config.learning_rate,
                                             expected_batch_size=config.expected_batch_size,
                                             num_examples=len(site), local_steps=int(result.report.local_steps))
            strategy.accumulate(site.site_id, result.delta, num_examples=len(site), noise_variance=variance,
                                species_counts=result.report.species_counts or None)
            _compose_into(count_events, site.site_id, result.report.count_events)  # NIRA's noisy counts
        weights = strategy.after_step(server.step(bundle, strategy.aggregate()))
        strategy.end_round(r + 1)
    site_models = {s.site_id: strategy.site_weights(weights, s.site_id) for s in fed.sites}
    final, plain_final = _final(fed, weights, config.prediction_tau) if plain else (None, None)
    return {"round0": round0.by_group, "final": final.by_group if final else {},
            "final_unadjusted": plain_final.by_group if plain_final else {},
            "final_by_category": {c.value: a for c, a in final.by_category.items()} if final else {},
            "noise_multipliers": zs, "sampling_rates": rates, "events": events, "count_events": count_events,
            "weights": weights, "site_models": site_models}


def _final(fed: SimFederation, weights: Mapping[str, np.ndarray], tau: float) -> tuple[Any, Any]:
    """(the served model's held-out Accuracy, logit-adjusted with ``tau``; the trained model's Accuracy)."""
    from shared.models.logit_adjustment import adjusted_for_prediction
    from wildfed_sim.evaluation import evaluate

    plain = evaluate(weights, fed.test_features, fed.test_labels, fed.class_categories)
    offsets = prediction_offsets_for(fed, tau)
    if offsets is None:
        return plain, plain
    served = adjusted_for_prediction(weights, offsets)
    return evaluate(served, fed.test_features, fed.test_labels, fed.class_categories), plain


def _compose_into(into: dict[str, dict[IUCNCategory, Any]], site_id: str, events: Mapping[IUCNCategory, Any]) -> None:
    """Add one round's ``{category: event}`` of ``site_id`` to the composition over rounds in ``into`` (a site's
    events repeat the same mechanism every round, so composing is adding steps)."""
    if not events:
        return  # no privacy: nothing charged, no entry
    per_site = into.setdefault(site_id, {})
    for c, ev in events.items():
        prev = per_site.get(c)
        per_site[c] = ev if prev is None else prev.with_steps(prev.steps + ev.steps)


def _simulate_global(fed: SimFederation, config: SimConfig, weights: dict[str, np.ndarray], backend: Any, server: Any,
                     rngs: Mapping[str, Any], centre: np.ndarray | None, inputs: Mapping[str, Any]
                     ) -> dict[str, np.ndarray]:
    """The demo's Global DP rounds without the transport (``coordinator.rounds.RoundManager.run_global_round``):
    the same round plan (:func:`coordinator.global_dp.plan_global_round`), each site's
    :func:`edge_sdk.training.clipped_sum_locally` quantised to the secure-aggregation grid
    (:func:`shared.secagg.quantise`; the masks cancel in the sum, so they are left out) with its Skellam share
    when the noise is distributed, the sum dequantised, the trusted server's Gaussian draw of std z C_eff
    otherwise, the normaliser sum_k q_k N_k, the fold with the public centre and the server step. Every site
    survives (the distributed noise is calibrated so that t - f shares carry it, so n > t - f survivors carry
    more).

    Returns ``(weights, {site: {category: event over all rounds}})`` (the coordinator's charges,
    :func:`coordinator.global_dp.global_events` / ``distributed_events``, composed over the rounds)."""
    from coordinator.global_dp import distributed_events, effective_sensitivity, global_events, plan_global_round
    from edge_sdk.training import clipped_sum_locally
    from shared.models.feature_centre import centre_digest, uncentred_gradient
    from shared.privacy.distributed import site_sampling_rate, skellam_noise, skellam_share_variance
    from shared.protocol import TrainingTask, canonical_flatten, canonical_unflatten
    from shared.secagg import dequantise_sum, quantise

    budgets = dict(config.budgets)
    d = sum(int(np.asarray(w).size) for w in weights.values())
    distributed = config.global_noise == "distributed"
    rates = {s.site_id: site_sampling_rate(config.expected_batch_size, len(s), distributed=distributed)
             for s in fed.sites}
    settings, z = plan_global_round(budgets=budgets, sampling_rates=rates, vector_length=d,
                                    clipping_norm=config.clipping_norm, expected_batch_size=config.expected_batch_size,
                                    target_delta=config.target_delta, planned_rounds=config.rounds,
                                    distributed=distributed, threshold=config.secagg_threshold,
                                    colluding_sites=config.colluding_sites)
    params = settings.params("sim", 0)
    sigma = z * effective_sensitivity(config.clipping_norm, d, settings.scale)
    share_variance = skellam_share_variance(noise_multiplier=z, clipping_norm=config.clipping_norm, vector_length=d,
                                            scale=settings.scale, threshold=settings.threshold,
                                            colluding_sites=settings.colluding_sites)
    normaliser = sum(rates[s.site_id] * len(s) for s in fed.sites)
    first = fed.sites[0].site_id
    for r in range(config.rounds):
        task = TrainingTask(federation_id="sim", round=r, model_hash="0" * 64, local_steps=1,
                            expected_batch_size=config.expected_batch_size, learning_rate=config.learning_rate,
                            clipping_norm=config.clipping_norm, target_delta=config.target_delta,
                            planned_rounds=config.rounds, privacy="global", budgets=budgets, secagg=settings,
                            noise_multiplier=z, distributed_noise=distributed,
                            feature_centre=None if centre is None else centre_digest(centre))
        total = np.zeros(d, dtype=np.uint64)
        for site in fed.sites:
            part = clipped_sum_locally(backend=backend, dataset=inputs[site.site_id],
                                       task=task, global_weights=weights, site_categories=site.species_categories,
                                       randomness=rngs[site.site_id], feature_centre=centre)
            y = quantise(canonical_flatten(part.gradient_sum, dtype=np.float64), params).astype(np.uint64)
            if distributed:
                share_rng = np.random.default_rng(int(rngs[site.site_id].random(1)[0] * 2**53))
                share = skellam_noise(share_variance, d, share_rng)
                y = y + share.view(np.uint64)
            total = (total + y) & np.uint64(params.modulus - 1)
        summed = dequantise_sum(total.astype(params.dtype), params)
        noisy = summed if distributed else summed + sigma * rngs[first].standard_normal(d)
        gradient = canonical_unflatten((noisy / normaliser).astype(np.float32), weights)
        if centre is not None:
            gradient = uncentred_gradient(gradient, centre)
        weights = server.step(weights, {k: (-config.learning_rate * v).astype(np.float32) for k, v in gradient.items()})
    sites = {s.site_id: (rates[s.site_id], s.species_categories) for s in fed.sites}
    per_round = (distributed_events(z, budgets=budgets, sites=sites, target_delta=config.target_delta,
                                    planned_rounds=config.rounds, clipping_norm=config.clipping_norm,
                                    vector_length=d, scale=settings.scale) if distributed
                 else global_events(z, budgets=budgets, sites=sites, target_delta=config.target_delta,
                                    planned_rounds=config.rounds))
    return weights, {s: {c: ev.with_steps(ev.steps * config.rounds) for c, ev in evs.items()}
                     for s, evs in per_round.items()}
