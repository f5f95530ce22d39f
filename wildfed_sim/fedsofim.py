"""DP-FedSOFIM against DP-FedGD, DP-FedAvgM and DP-FedAdam on real images (docs/fedsofim.md).

The seed's setting: a frozen feature extractor, only the last linear layer federated, full-batch DP gradient descent
on every client in every round.

Protocol (per seed; the seed fixes the data splits only, privacy noise is never seeded):

1. Animal-MNIST (10,000 images) -> stratified train (80 %) / held-out test (20 %) split
   (:func:`wildfed_sim.animal_mnist.split_holdout`).
2. Public split: :func:`wildfed_sim.common.demo_data.balanced_public_split` takes ``public_per_class`` training
   images of every class (default 100). No client holds them. The frozen backbone is the public ImageNet
   EfficientNet-Lite0 (:mod:`shared.models.backbone`); a linear head trained on the public split's embeddings,
   non-privately, is reported as the public-data reference (``public_model_test_accuracy``); the federation does not start from it.
3. Validation split: ``val_per_class`` further training images per class (default 70), for tuning only; no client
   holds them, and the test split is never used for tuning.
4. Clients: the remaining training images (the pool), cut into K near-equal IID shards.
5. The backbone maps every image to its 1280-d embedding once (cached). The federated model is the head ``psi``
   (weight (10, 1280), bias (10,): d = 12,810), started at zero (round 0 = the zero head).
6. Round t, client k (N_k records): per-example cross-entropy gradients of the head, clipped to L2 norm C, summed,
   Gaussian noise N(0, (z C)^2 I_d), divided by N_k (the project's :class:`edge_sdk.privacy.ccdp.CCDPMechanism`
   with one category; q = 1, one step per round). z is calibrated for T rounds with
   :func:`shared.privacy.accounting.calibrate_noise_multiplier` (RDP).
7. Server: ``G_t = sum_k N_k g~_k / N`` with ``N = sum_k N_k``, ``avg_delta = -G_t``, then one of the server
   optimizers (:data:`OPTIMIZERS`), all post-processing (no privacy cost).

The pooled simulation (:func:`released_aggregates`, :func:`run_batch`). Because every client releases
``sum_{i in k} clip(g_i) + n_k`` with independent ``n_k ~ N(0, (zC)^2 I)`` and the server weights by N_k,
``G_t = (sum_i clip(g_i) + sum_k n_k) / N`` and ``sum_k n_k ~ N(0, K (zC)^2 I)``: the released aggregate has exactly
the same distribution as one clipped sum over the whole pool plus one Gaussian of std ``sqrt(K) z C``. The
experiment draws it that way (the same clipping, :func:`edge_sdk.privacy.ccdp.clip_factors_from_norms`, and
:class:`~shared.privacy.randomness.SecureRandom` noise), for many configurations at once in float32 matrix
products; ``tests/sim/test_fedsofim_experiment.py`` checks it against the per-client path (:func:`run_federation`).
K enters only through the noise. Each client's privacy is still that of its own release, ``DPSGDEvent(z, 1, 1)``
per round; the ledger records those events (every client, every round) for one reported run per (K, eps): they are
the same for every run of that cell.

Tuning (:func:`tune_grids`): every optimizer separately in every (K, eps) cell on the tuning seeds (never a reported
seed), by validation accuracy (mean of the last 10 rounds, then over tuning seeds), over the grids of
:data:`GRIDS`; a grid whose best point lies on an edge of a widenable axis (the step sizes, rho, tau) is extended by
one decade beyond that edge, up to ``max_widenings`` times per edge; every widening is recorded.

Metrics (reported seeds): test accuracy after round T ("final"), the mean of the last 10 rounds ("last-10"), the
first round that reaches DP-FedGD's final accuracy of the same seed, and paired differences against DP-FedAvgM with
95 % Student-t intervals (:func:`wildfed_sim.common.stats.paired_interval`). For DP-FedSOFIM, ``|M_t|^2`` per
round (to compare with rho). The non-private ceiling is the same head trained by FedGD without noise, tuned the
same way (the clipping stays; K does not matter without noise).

Deviation from the product's transport: the clients are simulated in one process (no MQTT, no gateway processes).

Output (``out_dir``): ``fedsofim.json`` (settings, every tuning score and widening, every reported run's curves,
summary), ``fedsofim.md`` (the tables), ``fedsofim.png`` (test accuracy per round, one panel per (K, eps)),
``ledger.db`` (the ledger); all rewritten after every cell.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared.privacy.events import DPSGDEvent

from wildfed_sim.common.options import opt, parse_list
from wildfed_sim.common.runs import new_run_dir
from wildfed_sim.fedsofim_head import (
    BIAS, CEILING, OPTIMIZERS, UNIFORM_CATEGORY, WEIGHT, HeadData, LinearHeadGradients, accuracy,
    client_private_gradient, flatten_head, head_residuals, make_optimizer, per_example_head_gradients,
    run_federation, server_pseudo_gradient, step_size, unflatten_head,
)
from wildfed_sim.fedsofim_pool import Pool, released_aggregates, run_batch
from wildfed_sim.fedsofim_report import (
    BASELINE, format_pct, last10_mean, markdown_tables, rounds_to_reach, summarise_cell, write_outputs,
)
from wildfed_sim.fedsofim_settings import FedSofimResult, FedSofimSettings, SeedData, prepare_seed
from wildfed_sim.fedsofim_tuning import GRIDS, Axis, grid_points, tune_grids

__all__ = [
    "LinearHeadGradients", "HeadData", "head_residuals", "per_example_head_gradients", "flatten_head",
    "unflatten_head", "accuracy", "client_private_gradient", "server_pseudo_gradient", "make_optimizer",
    "run_federation", "Pool", "released_aggregates", "run_batch", "Axis", "grid_points", "tune_grids",
    "rounds_to_reach", "summarise_cell", "markdown_tables", "FedSofimSettings", "FedSofimResult",
    "SeedData", "prepare_seed", "run_fedsofim_experiment", "fedsofim_command", "OPTIMIZERS", "GRIDS", "BASELINE",
    "CEILING", "UNIFORM_CATEGORY", "WEIGHT", "BIAS", "step_size",
]


def _ledger_recorder(ledger: Any, prefix: str, k: int, z: float) -> Callable[[int], None]:
    """A ``before_step`` that records every client's ``DPSGDEvent(z, 1, 1)`` of round t (site ids
    ``f"{prefix}client{i:03d}"``) before the server uses the round's aggregate."""
    event = DPSGDEvent(float(z), 1.0, 1)

    def record(t: int) -> None:
        for i in range(k):
            ledger.record_round(f"{prefix}client{i:03d}", t, {UNIFORM_CATEGORY: event})

    return record


def run_fedsofim_experiment(settings: FedSofimSettings, console: Any = None) -> FedSofimResult:
    """The whole protocol: the non-private ceiling, then per (K, eps) cell: tune every optimizer on the tuning
    seeds (:func:`tune_grids`), run the chosen points on the reported seeds, summarise; fedsofim.json/.md/.png
    are rewritten after every cell."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store
    from shared.privacy.accounting import calibrate_noise_multiplier
    from shared.privacy.randomness import SecureRandom

    console = console or Console()
    t0 = time.monotonic()
    out_dir = new_run_dir(settings.out_dir, "fedsofim")
    result = FedSofimResult(out_dir=out_dir)
    store = Store(f"sqlite:///{out_dir / 'ledger.db'}", out_dir / "data") if settings.ledger else None
    ledger = PrivacyLedger(store, target_delta=settings.target_delta) if store is not None else None
    z_of = {eps: calibrate_noise_multiplier(target_epsilon=eps, target_delta=settings.target_delta,
                                            sampling_rate=1.0, steps=settings.rounds) for eps in settings.epsilons}
    console.log("noise multipliers (RDP, q = 1, T = %d): %s" % (settings.rounds,
                                                              {e: round(z, 3) for e, z in z_of.items()}))
    data: dict[int, tuple[SeedData, Pool]] = {}
    for seed in settings.tuning_seeds + settings.seeds:
        sd = prepare_seed(settings, seed)
        data[seed] = (sd, Pool.of(sd.pool))
        result.seeds_info[seed] = sd.info
    console.log(f"prepared seeds {list(data)} ({time.monotonic() - t0:.0f} s)")
    methods = settings.optimizers
    n_tune, n_rep, rounds = len(settings.tuning_seeds), len(settings.seeds), settings.rounds
    first_pass = sum(len(grid_points(GRIDS[m])) for m in methods)
    total = rounds * ((len(grid_points(GRIDS[CEILING])) * n_tune + n_rep)
                      + len(settings.clients) * len(settings.epsilons) * (first_pass * n_tune + len(methods) * n_rep))

    def run(opts: list[Any], seed: int, z: float, k: int, evaluate: tuple[str, ...], **kw: Any) -> list[dict]:
        sd, pool = data[seed]
        return run_batch(opts, pool, {name: getattr(sd, name) for name in evaluate}, rounds=rounds,
                         clipping_norm=settings.clipping_norm, noise_multiplier=z, num_clients=k,
                         noise=SecureRandom(), num_classes=10, on_round=lambda p: progress.advance(task, p), **kw)

    def tune(grids: Mapping[str, Sequence[Axis]], z: float, k: int) -> dict[str, Any]:
        calls = [0]

        def score(todo: list[tuple[str, dict[str, float]]]) -> list[float]:
            if calls[0]:
                progress.update(task, total=progress.tasks[0].total + len(todo) * n_tune * rounds)
            calls[0] += 1
            per_seed = []
            for seed in settings.tuning_seeds:
                res = run([make_optimizer(m, pt) for m, pt in todo], seed, z, k, ("val",))
                per_seed.append([last10_mean(r["curves"]["val"]) for r in res])
            return [float(np.mean(col)) for col in zip(*per_seed)]

        return tune_grids(score, grids, max_widenings=settings.max_widenings)

    def report(chosen: Mapping[str, dict[str, float]], z: float, k: int, prefix: str | None) -> list[dict]:
        rows = []
        for seed in settings.seeds:
            before = None
            if ledger is not None and prefix is not None and seed == settings.seeds[0]:
                before = _ledger_recorder(ledger, f"{prefix}seed{seed}/{list(chosen)[0]}/", k, z)
            res = run([make_optimizer(m, hp) for m, hp in chosen.items()], seed, z, k, ("test", "val"),
                      before_step=before)
            for (m, hp), r in zip(chosen.items(), res):
                rows.append({"seed": seed, "optimizer": m, "hyper_parameters": hp, "eta": step_size(m, hp),
                             "test": r["curves"]["test"], "val": r["curves"]["val"],
                             "momentum_sq": r["momentum_sq"], "diverged_round": r["diverged_round"]})
        return rows

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("configuration-rounds", total=total)
        tuning = tune({CEILING: GRIDS[CEILING]}, 0.0, 1)
        runs = report({CEILING: tuning[CEILING]["best"]}, 0.0, 1, None)
        result.ceiling = {"tuning": tuning, "runs": runs, "summary": summarise_cell(runs, tuning, (CEILING,))}
        console.log(f"non-private ceiling: eta {tuning[CEILING]['best']['eta']:g}, test last-10 "
                    f"{format_pct(result.ceiling['summary'][CEILING]['last10'])} %")
        for k in settings.clients:
            for eps in settings.epsilons:
                cell_t0 = time.monotonic()
                z = z_of[eps]
                tuning = tune({m: GRIDS[m] for m in methods}, z, k)
                prefix = f"K{k}/eps{eps:g}/"
                runs = report({m: tuning[m]["best"] for m in methods}, z, k, prefix)
                spent = None
                if ledger is not None:
                    spent = max(ledger.spent(f"{prefix}seed{settings.seeds[0]}/{methods[0]}/client{i:03d}",
                                             UNIFORM_CATEGORY) for i in range(k))
                summary = summarise_cell(runs, tuning, methods)
                mean_curves = {m: np.nanmean([r["test"] for r in runs if r["optimizer"] == m], axis=0).tolist()
                               for m in methods}
                result.cells.append({"clients": k, "epsilon": eps, "noise_multiplier": z, "spent_epsilon": spent,
                                     "tuning": tuning, "runs": runs, "summary": summary,
                                     "mean_curves": mean_curves, "elapsed_s": time.monotonic() - cell_t0})
                result.elapsed_s = time.monotonic() - t0
                write_outputs(settings, result)
                best = {m: f"{format_pct(summary[m]['last10'])}" for m in methods}
                console.log(f"K={k} eps={eps:g}: test last-10 {best} ({time.monotonic() - cell_t0:.0f} s)")
    if store is not None:
        store.dispose()
    result.elapsed_s = time.monotonic() - t0
    write_outputs(settings, result)
    console.log(f"written {out_dir / 'fedsofim.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result


# --------------------------------------------------------------------------------------------------- the CLI
def fedsofim_command(
    seeds: str = opt("0,1,2,3,4", "comma-separated reported seeds (data splits; noise is never seeded)"),
    tuning_seeds: str = opt("101,103", "comma-separated tuning seeds (grids run here only; not reported)"),
    clients: str = opt("20,100", "comma-separated client counts K"),
    epsilons: str = opt("0.5,1,2,5,10", "comma-separated target epsilons (each client's records, delta below)"),
    optimizers: str = opt(",".join(OPTIMIZERS), "comma-separated server optimizers to compare"),
    rounds: int = opt(100, "federated rounds T (one full-batch DP step per client per round)"),
    max_widenings: int = opt(2, "times a grid is widened by a decade beyond an edge its best point lies on"),
    out: Path | None = opt(None, "output folder (default runs/fedsofim-<UTC time>)"),
    target_delta: float = opt(1e-5, "delta of every guarantee"),
    clipping_norm: float = opt(1.0, "L2 clipping norm C of per-example head gradients"),
    public_per_class: int = opt(100, "public images per class (held by no client; the reference head)"),
    val_per_class: int = opt(70, "validation images per class (tuning only; held by no client)"),
    pretrain_epochs: int = opt(30, "epochs of the non-private reference head on the public split's embeddings"),
    ledger: bool = opt(True, "record one reported run per cell (every client, every round) in ledger.db",
                       "--ledger/--no-ledger"),
) -> None:
    """DP-FedSOFIM (preconditioning G or M) vs DP-FedGD, DP-FedAvgM and DP-FedAdam: frozen public
    EfficientNet-Lite0 backbone, linear head federated with full-batch DP gradient descent per client; every
    optimizer tuned per (K, eps) on tuning seeds, reported on other seeds with paired intervals against DP-FedAvgM.
    Writes fedsofim.json, .md, .png (docs/fedsofim.md gives the measured wall time)."""
    from rich.console import Console

    settings = FedSofimSettings(
        seeds=parse_list(seeds, int, "seeds", "0,1,2,3,4"),
        tuning_seeds=parse_list(tuning_seeds, int, "tuning-seeds", "101,103"),
        clients=parse_list(clients, int, "clients", "20,100"),
        epsilons=parse_list(epsilons, float, "epsilons", "0.5,1,2,5,10"),
        optimizers=parse_list(optimizers, str, "optimizers", ",".join(OPTIMIZERS)), rounds=rounds,
        max_widenings=max_widenings, target_delta=target_delta, clipping_norm=clipping_norm,
        public_per_class=public_per_class, val_per_class=val_per_class, pretrain_epochs=pretrain_epochs,
        ledger=ledger, out_dir=out)
    run_fedsofim_experiment(settings, console=Console())
