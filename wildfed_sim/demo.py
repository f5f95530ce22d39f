"""The main job: a whole WildFed federation on one machine, on real images.

``wildfed demo`` (README's first command) runs, as separate processes:

- an MQTT broker: the embedded amqtt broker on a free loopback port, unless ``--broker mqtt://host:port`` names one;
- N gateway agents (``python -m edge_sdk.cli run``), one per site, each reading its own Camtrap DP package through
  the same loader a field gateway uses, training with CCDP and uploading signed updates;
- the coordinator (this process): registry, signed tasks, ingest, privacy ledger, streaming FedAvg.

With ``--links`` other than always-on, each gateway reaches the broker through its own link relay, cut outside the
link model's windows in compressed time once round 1 opens (:mod:`wildfed_sim.demo_links`); ``--buffered K`` runs
buffered rounds (FedBuff) instead of synchronous ones.

Data: Animal-MNIST (``animal-mnist==0.4``, 10,000 real 28x28 silhouettes, 10 classes), fetched and verified by
:mod:`wildfed_sim.animal_mnist`; a stratified held-out test split stays at the coordinator; the rest is
partitioned into sites by the ecological design of :mod:`wildfed_sim.ecology` (docs/demo-data.md) and
written as one Camtrap DP package per site.

Output (in the run folder): ``report.json`` (settings, per-round accuracy and epsilon, final table), ``report.png``
(accuracy and epsilon per round), ``logs/`` (broker and gateway logs), the sites' packages and configs, and the
coordinator's database, blobs and models.
"""

from __future__ import annotations

import secrets
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, save_private_key, save_public_key

from wildfed_sim.common.runs import new_run_dir, sigterm_unwinds
from wildfed_sim.demo_links import DemoLinks
from wildfed_sim.demo_prep import (coordinator_config, demo_budget, load_weights, prepare_sites,
                                   pretrain_on_public_split, round0_weights, save_weights, write_feature_centre,
                                   write_site_config)
from wildfed_sim.demo_settings import (DP_DEFAULTS, GLOBAL_DP_DEFAULTS, NON_PRIVATE_DEFAULTS, DemoResult, DemoSettings,
                                        demo_embedding_cache, header_label, secagg_threshold)
from wildfed_sim.demo_report import epsilon_by_category, print_summary, print_web_commands, write_report
from wildfed_sim.gateway_processes import spawned_gateways

__all__ = ["DP_DEFAULTS", "GLOBAL_DP_DEFAULTS", "NON_PRIVATE_DEFAULTS", "demo_embedding_cache", "DemoSettings",
           "DemoResult", "run_demo", "secagg_threshold", "pretrain_on_public_split", "load_weights", "save_weights"]


# ------------------------------------------------------------------------------------------ evaluation
def _nira_state(coordinator: Any) -> dict[str, Any]:
    """NIRA's clusters (``{label: [sites]}``) and its logged cluster changes."""
    strategy = coordinator.rounds._strategy  # the demo's own coordinator; the strategy NIRA built from config
    assignment = strategy.assignment()
    return {"clusters": {k: list(v) for k, v in (assignment.clusters.items() if assignment else ())},
            "changes": list(strategy.state().get("changes", []))}


def _evaluate_model(settings: DemoSettings, coordinator: Any, bundle: Any, specs: Any, train: Any, test: Any,
                    class_categories: Any, test_features: np.ndarray) -> tuple[Any, dict[str, Any]]:
    """Held-out evaluation of the stored model on ``test_features``, the backbone embeddings of the held-out
    test split (float32 (N, 1280), embedded once and cached: :func:`wildfed_sim.embeddings.embed_grayscale`).

    Per site (both strategies): the model the site receives (``strategy.site_weights``) on the test images of the
    classes it holds (:func:`~wildfed_sim.evaluation.evaluate_sites`). By IUCN group: FedAvg's global
    model on the whole held-out split (unchanged); NIRA has no single global model, so its groups pool every
    site's predictions on the test images of that site's classes (a test image counts once per site holding
    its class). Returns (Accuracy, ``{"summary": ..., "sites": [...]}``).
    """
    from wildfed_sim.evaluation import (accuracy_from_predictions, evaluate, evaluate_sites,
                                                    summarise_sites)

    strategy = coordinator.rounds._strategy
    site_models = {s.site_id: strategy.site_weights(bundle, s.site_id) for s in specs}
    site_counts = {s.site_id: {int(c): int(n) for c, n in zip(*np.unique(train.labels[s.indices], return_counts=True))}
                   for s in specs}
    per_site = evaluate_sites(site_models, site_counts, test_features, test.labels, len(class_categories))
    sites = [acc for acc, _ in per_site.values()]
    details = {"summary": summarise_sites(sites), "sites": [a.to_json() for a in sites]}
    if settings.strategy == "fedavg":
        return evaluate(bundle, test_features, test.labels, class_categories), details
    preds, labels = [], []
    for acc, predictions in per_site.values():
        mask = np.isin(test.labels, acc.species)
        preds.append(predictions[mask])
        labels.append(test.labels[mask])
    return accuracy_from_predictions(np.concatenate(preds), np.concatenate(labels), class_categories), details


def _served_and_trained(coordinator: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the model as served, logit-adjusted when the coordinator is configured so; the same model as trained),
    from one read of the current global model."""
    _, trained = coordinator.rounds.current_model()
    return coordinator.rounds.served_model(trained), trained


# ------------------------------------------------------------------------------------------ the run
def run_demo(settings: DemoSettings, *, console: Any = None) -> DemoResult:
    """Run the whole federation described in the module docstring.

    SIGTERM and Ctrl-C stop the broker and every gateway before the exception propagates.

    Raises:
        ConfigError: bad settings. WildFedError: a gateway failed to start, or the data could not be fetched.
        KeyboardInterrupt: interrupted (after clean-up).
    """
    with sigterm_unwinds():
        return _run_demo(settings, console=console)


def _run_demo(settings: DemoSettings, *, console: Any = None) -> DemoResult:
    """The demo's steps in order (the order of the seeded draws and of the processes' starts is the demo's)."""
    from rich.console import Console

    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.embeddings import embed_grayscale

    console = console or Console()
    t0 = time.monotonic()
    run_dir = _open_run_dir(settings, console)
    specs, train, test, design = prepare_sites(settings, run_dir, console)

    class_categories = [e.iucn for e in SPECIES_TABLE]
    held = {SPECIES_TABLE[int(c)].iucn for spec in specs for c in spec.species}  # categories of the sites' tables
    # the gateways read the feature centre when they start: written first, the coordinator's own preparation
    # (held-out embeddings, pretraining, its database) then runs while they start
    centre_path = write_feature_centre(settings, run_dir, train, specs, console) if settings.feature_centre else None
    # One federation id per run: two demos on one broker (--broker) must not see each other's topics (a shared id
    # made them exchange updates that the signature checks then rejected).
    federation_id = f"wildfed-demo-{secrets.token_hex(4)}"
    coord_dir = run_dir / "coordinator"
    coordinator_pub = _coordinator_keys(coord_dir)
    budget = demo_budget(settings)

    result = DemoResult(run_dir=run_dir)
    with ExitStack() as stack:
        broker_url = _start_broker(settings, stack, run_dir, console)
        links = stack.enter_context(DemoLinks(settings, broker_url, len(specs)))  # a relay per gateway, or none
        site_configs, site_pems = [], []
        for k, spec in enumerate(specs):
            path, pem = write_site_config(settings, run_dir, spec, federation_id, links.site_url(k),
                                          coordinator_pub, centre_path)
            site_configs.append(path)
            site_pems.append(pem)
        # Start the gateways now: each spends seconds importing, loading and embedding its data and connecting,
        # which overlaps the coordinator's preparation below. They only subscribe until the first task, so nothing
        # they do depends on it (the results are those of starting them last).
        gateways = stack.enter_context(spawned_gateways(site_configs, run_dir / "logs", run_dir / "ready"))
        console.log(f"started {len(site_configs)} gateway agents")

        t_embed = time.monotonic()
        # the coordinator's held-out evaluation set, embedded once by the frozen backbone (cached for later runs)
        test_features = embed_grayscale(test.images, test.source_indices)
        console.log(f"held-out test split: {len(test)} backbone embeddings ({time.monotonic() - t_embed:.1f} s)")
        start_weights = round0_weights(settings, result, train, specs, test, test_features, class_categories,
                                       console)
        config = coordinator_config(settings, run_dir, coord_dir, federation_id, broker_url, coordinator_pub,
                                    centre_path, budget, links.coordinator_section())
        coordinator = _start_coordinator(stack, config, start_weights, gateways, specs, site_pems, run_dir, console)

        console.log("waiting for the gateways to connect (each imports its libraries, loads its Camtrap DP "
                    "package and embeds its images; about a minute, longer on a first run or a busy machine)")
        gateways.wait_ready(console)
        budgets = config.budgets()
        links.start(stack, gateways.procs)  # minute 0 of the link schedules: round 1 opens now
        _run_rounds(settings, coordinator, result, specs, train, test, test_features, class_categories, held,
                    console)
        links.stop()  # every link up: the final models reach every gateway
        final_weights = _final_results(settings, coordinator, result, specs, train, test, test_features,
                                       class_categories)
        # while broker, coordinator and gateways still run: detections on real photos (wildfed_sim.detections)
        end_of_demo_detections(run_dir=run_dir, specs=specs, site_configs=site_configs, coordinator=coordinator,
                               weights=final_weights, model_round=len(result.history), console=console)
        from wildfed_sim.fleet_check import wait_for_final_models

        result.final_models = wait_for_final_models(coordinator, console=console)  # released, kept, reported
        result.links = links.summary(coordinator.store, result.history, [s.site_id for s in specs])

    _centralised_reference(settings, result, specs, train, test, test_features, class_categories, console)
    result.elapsed_s = time.monotonic() - t0
    print_summary(settings, result, budgets, held, console)
    write_report(settings, result, design, specs, budgets, run_dir, console)
    print_web_commands(coord_dir, console)
    return result


def _open_run_dir(settings: DemoSettings, console: Any) -> Path:
    """The run folder (new and empty) with its ``logs`` and ``ready`` folders; the run's header printed."""
    run_dir = new_run_dir(settings.out_dir, "demo")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").mkdir(parents=True, exist_ok=True)
    console.rule(f"WildFed demo: {settings.sites} sites, {settings.rounds} round{'s' * (settings.rounds != 1)}, "
                 f"{header_label(settings)}, strategy {settings.strategy}")
    console.log(f"run folder {run_dir}")
    return run_dir


def _coordinator_keys(coord_dir: Path) -> Path:
    """A fresh coordinator signing key under ``coord_dir/keys``; returns the public key's path."""
    coord_key = generate_signing_key()
    save_private_key(coord_key, coord_dir / "keys" / "coordinator.key")
    return save_public_key(coord_key.public_key(), coord_dir / "keys" / "coordinator.pub")


def _start_broker(settings: DemoSettings, stack: ExitStack, run_dir: Path, console: Any) -> str:
    """The broker's URL: ``settings.broker``, else an embedded amqtt broker that ``stack`` stops."""
    from wildfed_sim.embedded_broker import embedded_broker

    broker_url = settings.broker
    if broker_url is None:
        broker_url = stack.enter_context(embedded_broker(log_path=run_dir / "logs" / "broker.log"))
        console.log(f"embedded MQTT broker (amqtt) at {broker_url}")
    else:
        console.log(f"using MQTT broker {broker_url}")
    return broker_url



def _start_coordinator(stack: ExitStack, config: Any, start_weights: Any, gateways: Any, specs: Any,
                       site_pems: list[Any], run_dir: Path, console: Any) -> Any:
    """The coordinator, entered on ``stack`` (the gateways stop before it closes), with every site enrolled (public
    key and public metadata, CR/EN species left out) and the sites' deployments imported for the web view."""
    from coordinator.service import Coordinator
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    coordinator = stack.enter_context(Coordinator(config, initial_weights=start_weights))
    stack.callback(gateways.stop)  # on the way out the gateways stop before the coordinator closes, as before
    for spec, pem in zip(specs, site_pems):
        public_species = [SPECIES_TABLE[c].scientific_name for c in spec.species
                          if not SPECIES_TABLE[c].iucn.is_sensitive]
        coordinator.enrol(spec.site_id, pem, {"capacity": spec.num_images, "biome": spec.biome,
                                              "species": public_species,
                                              "monitoring_months": spec.monitoring_months})
    console.log(f"enrolled {len(specs)} sites (public keys + public metadata; CR/EN species left out)")
    _import_demo_deployments(coordinator.store, run_dir, specs, config, console)
    return coordinator


def _run_rounds(settings: DemoSettings, coordinator: Any, result: DemoResult, specs: Any, train: Any, test: Any,
                test_features: np.ndarray, class_categories: list[IUCNCategory], held: set[IUCNCategory],
                console: Any) -> None:
    """Every round of the federation, each evaluated as it closes and appended to ``result.history``, with a
    progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from wildfed_sim.evaluation import evaluate

    columns = (TextColumn("[bold]round {task.completed}/{task.total}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("rounds", total=settings.rounds, info="training...")
        closed_at = None  # monotonic time the previous round's result came back (just after its close)
        for round_result in coordinator.iter_rounds():
            got_at = time.monotonic()
            # the gap: from the previous round's close to this round's last task published (the sites idle)
            gap_s = (None if closed_at is None
                     else got_at - round_result.duration_s + round_result.open_s - closed_at)
            weights, trained = _served_and_trained(coordinator)  # as served: logit-adjusted when configured
            acc, sites_eval = _evaluate_model(settings, coordinator, weights, specs, train, test,
                                              class_categories, test_features)
            unadjusted = (evaluate(trained, test_features, test.labels, class_categories)
                          if settings.posthoc_logit_adjustment else None)
            eps = epsilon_by_category(coordinator)
            entry = {"round": round_result.round, "status": round_result.status,
                     "selected": list(round_result.selected), "accepted": list(round_result.accepted),
                     "duration_s": round_result.duration_s, "accuracy": dict(acc.by_group), "epsilon": eps,
                     "per_site": sites_eval["summary"], "gap_s": gap_s,
                     "open_s": round_result.open_s, "stale": list(round_result.stale)}
            if unadjusted is not None:
                entry["accuracy_unadjusted"] = dict(unadjusted.by_group)
            if settings.strategy == "nira":
                entry["clusters"] = _nira_state(coordinator)["clusters"]
            result.history.append(entry)
            info = (f"{len(round_result.accepted)}/{len(round_result.selected)} sites"
                    f"{f' + {len(round_result.stale)} stale' if round_result.stale else ''}, "
                    f"acc {100 * acc.by_group['overall']:.1f}% (CR/EN {100 * acc.by_group['CR/EN']:.1f}%)")
            if not round_result.selected:  # a buffered run's last round: no task, it folds what came late
                progress.update(task, total=round_result.round)
            if settings.privacy != "none" and IUCNCategory.CR in held:
                info += f", eps CR {eps['CR']['spent_max']:.2f}/{eps['CR']['budget']:.2f}"
            progress.update(task, advance=1, info=info)
            closed_at = got_at


def _final_results(settings: DemoSettings, coordinator: Any, result: DemoResult, specs: Any, train: Any, test: Any,
                   test_features: np.ndarray, class_categories: list[IUCNCategory]) -> Any:
    """The final model's accuracy, epsilon and rejections into ``result``; returns the final (served) weights."""
    from wildfed_sim.evaluation import evaluate

    status = coordinator.status()
    result.rejections = dict(status.rejections)
    result.epsilon = epsilon_by_category(coordinator)
    final_weights, trained = _served_and_trained(coordinator)
    final, final_sites = _evaluate_model(settings, coordinator, final_weights, specs, train, test,
                                         class_categories, test_features)
    result.final_accuracy = {**final.by_group, **{c.value: v for c, v in final.by_category.items()}}
    if settings.posthoc_logit_adjustment:
        plain = evaluate(trained, test_features, test.labels, class_categories)
        result.final_accuracy_unadjusted = {**plain.by_group,
                                            **{c.value: v for c, v in plain.by_category.items()}}
        result.prediction_offsets = list(coordinator.rounds.prediction_offsets() or ())
    result.per_site = final_sites
    if settings.strategy == "nira":
        result.nira = _nira_state(coordinator)
    return final_weights


def _centralised_reference(settings: DemoSettings, result: DemoResult, specs: Any, train: Any, test: Any,
                           test_features: np.ndarray, class_categories: list[IUCNCategory], console: Any) -> None:
    """With ``centralised_epochs``: the same head trained on the sites' pooled data, non-privately, into
    ``result.centralised_accuracy``."""
    if settings.centralised_epochs <= 0:
        return
    from wildfed_sim.animal_mnist import SPECIES_TABLE
    from wildfed_sim.embeddings import embed_grayscale
    from wildfed_sim.evaluation import evaluate, train_centralised

    console.log(f"centralised reference: {settings.centralised_epochs} epochs on the pooled training data")
    used = np.concatenate([s.indices for s in specs])
    weights = train_centralised(embed_grayscale(train.images[used], train.source_indices[used]),
                                train.labels[used], num_classes=len(SPECIES_TABLE),
                                epochs=settings.centralised_epochs, batch_size=settings.expected_batch_size,
                                learning_rate=NON_PRIVATE_DEFAULTS["learning_rate"], seed=settings.seed,
                                adapter_width=settings.adapter_width)
    result.centralised_accuracy = dict(evaluate(weights, test_features, test.labels, class_categories).by_group)


def end_of_demo_detections(*, run_dir: Path, specs: Any, site_configs: list[Path], coordinator: Any,
                           weights: dict[str, np.ndarray], model_round: int, console: Any) -> None:
    """The demo's call point for the end-of-demo detections on real camera-trap photos (docs/inference.md), run
    while broker, coordinator and gateways are still up: ``wildfed_sim.detections.run_demo_detections`` (another
    change's module) with each site's model (``strategy.site_weights``), output under ``<run_dir>/detections``.
    Where that module or function is not present, the demo logs that no detections ran."""
    import importlib.util

    spec = importlib.util.find_spec("wildfed_sim.detections")
    module = importlib.import_module("wildfed_sim.detections") if spec is not None else None
    run = getattr(module, "run_demo_detections", None)
    if run is None:
        console.log("end-of-demo detections: wildfed_sim.detections.run_demo_detections is absent; none ran")
        return
    strategy = coordinator.rounds._strategy
    run(coordinator=coordinator, site_configs=site_configs, out_dir=run_dir / "detections",
        weights_for_site=lambda site_id: strategy.site_weights(weights, site_id), model_round=model_round,
        console=console)


def _import_demo_deployments(store: Any, run_dir: Path, specs: Any, config: Any, console: Any) -> None:
    """Put every demo site's deployments (the fictional but plausible coordinates of its Camtrap DP package,
    wildfed_sim.ecology) on the web view's map: coordinates only. The package's observations are the site's
    training records, whose species and IUCN categories per deployment (and the fuzzing a CR/EN/VU record earns its
    place) no DP noise covers; the map takes species only from the detection records the sites publish."""
    from coordinator.web.deployments import import_camtrap_dp, species_table_categories

    category_of = species_table_categories(config.species)
    n = sum(import_camtrap_dp(store, run_dir / "sites" / spec.site_id / "camtrap-dp", category_of,
                              site_id=spec.site_id, species=False) for spec in specs)
    console.log(f"{n} deployments on the web view's map (wildfed-coordinator serve): coordinates only; species "
                "come from the sites' detection records")
