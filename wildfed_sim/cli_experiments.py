"""``wildfed experiment ...``: the laboratory's experiments (privacy-utility, real-photos, nira, nira-head,
fedbuff, fedsofim, radiomap); mounted on ``wildfed`` by :mod:`wildfed_sim.cli`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from shared.errors import ConfigError

from coordinator.cli.common import console, err_console, friendly

__all__ = ["experiment_app"]

experiment_app = typer.Typer(name="experiment", help="Laboratory experiments: the demo federation replayed or run "
                             "(privacy-utility, nira, nira-head), the seed's DP-FedSOFIM setting, radio maps.",
                             no_args_is_help=True, add_completion=False)


def _parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--seeds {text!r} is not a comma-separated list of integers", field="seeds",
                          fix="e.g. --seeds 0,1,2") from None
    return seeds


@experiment_app.command("privacy-utility")
@friendly
def privacy_utility(
    seeds: str = typer.Option("0,1,2,3,4", help="comma-separated reported seeds (the protocol asks for >= 5)"),
    tuning_seeds: str = typer.Option("101,103", help="comma-separated seeds every configuration is tuned on "
                                     "(never reported)"),
    configurations: str | None = typer.Option(None, "--configurations", help="comma-separated subset of: none, "
                                              "uniform-eps0.33, uniform-eps1, uniform-eps2, uniform-eps0.67, "
                                              "uniform-eps1.33, uniform-eps1.67, ccdp-g1-sample, ccdp-g1-sample-rw, "
                                              "ccdp-g1-scale, ccdp-g2-sample, ccdp-g2-sample-rw, ccdp-g2-scale, "
                                              "global-ccdp-g1-trusted, "
                                              "global-ccdp-g1-distributed, global-uniform-eps0.33-distributed, "
                                              "global-ccdp-g1-distributed-1dropout (default all)"),
    grid: str = typer.Option("full", help="tuning grid: full (25 points per configuration) or tiny (1 point)"),
    processes: int = typer.Option(2, help="worker processes"),
    sites: int = typer.Option(8, help="sites of the demo's design"),
    out: Path | None = typer.Option(None, help="output folder (default runs/privacy-utility-<UTC time>); an "
                                    "existing one is resumed from its runs.jsonl"),
    posthoc_logit_adjustment: float = typer.Option(
        1.0, help="tau of the post-hoc logit adjustment every configuration's model is evaluated (and tuned) with, "
        "the prior from the sites' public metadata, as the demo's coordinator serves it; 0 = the model as trained "
        "(each run records both)"),
) -> None:
    """The privacy-utility table (docs/results/privacy-utility.md): no privacy, uniform DP at each of CCDP gamma 1's
    budgets (0.33 to 2), CCDP gamma 1 and 2 in both individualized DP-SGD variants, Global DP with trusted-server and
    distributed noise (the latter also calibrated for one dropout); every configuration tuned on the tuning seeds, then
    run on the reported seeds; paired differences with 95 % intervals; CCDP against the per-category mixture of uniform
    runs; accuracy per IUCN category against its epsilon. Writes privacy_utility.md, .json, .png and runs.jsonl."""
    from wildfed_sim.privacy_utility import CONFIGURATIONS, PrivacyUtilitySettings, run_privacy_utility

    names = (tuple(c.strip() for c in configurations.split(",") if c.strip()) if configurations
             else tuple(c.name for c in CONFIGURATIONS))
    settings = PrivacyUtilitySettings(seeds=_parse_seeds(seeds), tuning_seeds=_parse_seeds(tuning_seeds),
                                      configurations=names, grid=grid, processes=processes, sites=sites,
                                      prediction_tau=posthoc_logit_adjustment, out_dir=out)
    try:
        run_privacy_utility(settings, console=console)
    except KeyboardInterrupt:
        err_console.print("[bold yellow]interrupted:[/] finished runs are kept in runs.jsonl; rerun with the same "
                          "--out to resume")
        raise typer.Exit(code=130) from None


@experiment_app.command("real-photos")
@friendly
def real_photos(
    reserves: str = typer.Option("ena24,camtrapr", help="comma-separated: ena24 (21 photos, three sites of one photo "
                                 "per species), camtrapr (68 photos, three stations)"),
    dp_seeds: int = typer.Option(5, min=1, help="runs of the DP federation per fold (its noise is secure)"),
    broker: str | None = typer.Option(None, help="mqtt://host:port (default: an embedded broker per federation)"),
    out: Path | None = typer.Option(None, help="output folder (default runs/real-photos-<UTC time>)"),
) -> None:
    """Leave-one-site-out on the real camera-trap photos of ../shared/data: sites built with `wildfed-edge package`,
    federations run over MQTT on verified crops (no privacy, and the default CCDP), against a central head on the
    same crops; every choice tuned on the training sites only. Writes results.json."""
    from wildfed_sim.common.runs import new_run_dir
    from wildfed_sim.real_photos_run import run_experiment

    names = [r.strip() for r in reserves.split(",") if r.strip()]
    run_experiment(names, dp_seeds=dp_seeds, broker=broker, out=out or new_run_dir(None, "real-photos"),
                   console=console)


@experiment_app.command("nira")
@friendly
def nira_experiment(
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds; one full grid per seed"),
    rounds: int = typer.Option(10, help="federated rounds per run"),
    sites: int = typer.Option(8, help="gateway sites per run"),
    local_steps: int = typer.Option(10, help="local (DP-)SGD steps per site per round"),
    expected_batch_size: int = typer.Option(128, help="records per step in expectation"),
    learning_rate: float = typer.Option(0.5, help="local SGD step size"),
    clipping_norm: float = typer.Option(1.0, help="L2 clipping norm C"),
    target_delta: float = typer.Option(1e-5, help="delta of every guarantee"),
    round_deadline_s: float = typer.Option(300.0, help="seconds a round waits for its sites"),
    recluster_every: int = typer.Option(3, help="R: NIRA re-clusters every R rounds (in the configurations "
                                        "with re-clustering)"),
    distance_threshold: float | None = typer.Option(None, help="NIRA's Jaccard-distance cut of the species "
                                                    "lists (default 0.7)"),
    configurations: str | None = typer.Option(None, "--configurations", help="comma-separated subset of fedavg, "
                                              "nira, nira-no-recluster, nira-no-merging, nira-plain (default: all "
                                              "but nira-plain)"),
    privacy: str = typer.Option("none,ccdp", help="comma-separated subset of none, ccdp (CCDP gamma 1, VU = 1)"),
    broker: str | None = typer.Option(None, help="mqtt://host:port of a running broker that no other demo uses "
                                      "(default: an embedded amqtt broker per run)"),
    out: Path | None = typer.Option(None, help="output folder (default runs/nira-<UTC time>)"),
) -> None:
    """FedAvg vs NIRA (with and without re-clustering, with and without embedding merging), each without privacy
    and with CCDP gamma 1, on the demo's ecological Animal-MNIST federation; macro, per-site (mean, worst decile)
    and rare-species accuracy, mean ± std over seeds. Writes nira.json, .md and .png."""
    from wildfed_sim.nira import DEFAULT_CONFIGURATIONS, NiraSettings, run_nira_experiment

    names = (tuple(c.strip() for c in configurations.split(",") if c.strip()) if configurations
             else DEFAULT_CONFIGURATIONS)
    settings = NiraSettings(seeds=_parse_seeds(seeds), rounds=rounds, sites=sites, local_steps=local_steps,
                            expected_batch_size=expected_batch_size, learning_rate=learning_rate,
                            clipping_norm=clipping_norm, target_delta=target_delta,
                            round_deadline_s=round_deadline_s, recluster_every=recluster_every,
                            distance_threshold=distance_threshold, broker=broker, out_dir=out,
                            configurations=names,
                            privacy=tuple(p.strip() for p in privacy.split(",") if p.strip()))
    try:
        run_nira_experiment(settings, console=console)
    except KeyboardInterrupt:
        err_console.print("[bold yellow]interrupted:[/] broker and gateway processes stopped; finished runs are kept")
        raise typer.Exit(code=130) from None


@experiment_app.command("nira-head")
@friendly
def nira_head_experiment(
    seeds: str = typer.Option("0,1,2,3,4,5,6,7,8,9", help="reported seeds (comma-separated)"),
    tuning_seeds: str = typer.Option("101,103", help="tuning seeds, never reported"),
    methods: str | None = typer.Option(None, help="comma-separated subset of: fedavg, fedavg+mask, "
                                       "fedavg+fine-tune (local fine-tuning, never released), nira, nira+mask, "
                                       "nira-head-only, nira-inverse-variance, nira-clusters, nira-no-merging, "
                                       "nira-min-records, nira-recluster, nira-noisy-counts (default: all; "
                                       "docs/nira.md)"),
    sites: int = typer.Option(8, help="sites of the demo's design"),
    structure: str = typer.Option("demo", help="demo (the demo's ecological site design), wildlife-insights or "
                                  "serengeti (one site per real deployment / camera location of ../shared/data, "
                                  "its species in its own proportions, Animal-MNIST images standing in)"),
    rounds: int = typer.Option(10, help="federated rounds per run"),
    out: Path | None = typer.Option(None, help="output folder (default runs/nira-head-<UTC time>); an existing "
                                    "one resumes from its runs.jsonl"),
) -> None:
    """NIRA against FedAvg, FedAvg + species mask and FedAvg + local fine-tuning under CCDP gamma 1, on the demo's
    federation replayed in one process (docs/nira.md): every method tuned on the tuning seeds, paired 95 % intervals
    on the reported ones, round 0 and the non-private ceiling. Writes nira-head.json, .md, .png and runs.jsonl."""
    from wildfed_sim.nira_sim import METHODS, NiraHeadSettings, run_nira_head_experiment

    names = (tuple(m.strip() for m in methods.split(",") if m.strip()) if methods else tuple(m.name for m in METHODS))
    settings = NiraHeadSettings(seeds=_parse_seeds(seeds), tuning_seeds=_parse_seeds(tuning_seeds), methods=names,
                                sites=sites, structure=structure, rounds=rounds, out_dir=out)
    result = run_nira_head_experiment(settings, console=console)
    console.print((result.out_dir / "nira-head.md").read_text())
    console.print(f"wrote {result.out_dir} in {result.elapsed_s / 60:.1f} min")


@experiment_app.command("fedbuff")
@friendly
def fedbuff_experiment(
    grid: str = typer.Option("large", help="tuning grid per arm: large (3 x 3 configurations) or small (2 x 2)"),
    seeds: str = typer.Option("0,1,2,3,4,5,6,7,8,9", help="reported seeds (comma-separated; the protocol asks for "
                              ">= 5)"),
    tuning_seeds: str = typer.Option("101,103,104,105", help="tuning seeds, never reported"),
    links: str = typer.Option("always-on,satellite,solar-night,cellular", help="comma-separated link models "
                              "(wildfed_sim/link_models.py)"),
    arms: str = typer.Option("sync,fedbuff,fedbuff-paper,fedbuff-examples", help="comma-separated: sync (rounds "
                             "with a deadline), fedbuff (fixed denominator), fedbuff-paper (FedBuff's / K), "
                             "fedbuff-examples (n_i / sum n_i in the buffer)"),
    training_minutes: float = typer.Option(20.0, help="minutes a gateway trains per update"),
    out: Path | None = typer.Option(None, help="output folder (default runs/fedbuff-<UTC time>); an existing one "
                                    "resumes from its runs.jsonl"),
) -> None:
    """Synchronous rounds with a deadline vs buffered asynchronous aggregation (FedBuff) under satellite, solar,
    cellular and always-on links, on the demo's federation replayed in one process under CCDP (docs/results/
    fedbuff.md): each arm tuned with the same number of configurations on the tuning seeds, paired 95 % intervals
    on the reported ones at equal wall-clock and at equal budget. Writes fedbuff.md, .json, .png and runs.jsonl."""
    from wildfed_sim.fedbuff_experiment import FedBuffSettings, run_fedbuff_experiment

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    settings = FedBuffSettings(seeds=_parse_seeds(seeds), tuning_seeds=_parse_seeds(tuning_seeds),
                               links=names(links), arms=names(arms), grid=grid, training_minutes=training_minutes,
                               out_dir=out)
    out_dir = run_fedbuff_experiment(settings, console=console)
    console.print(escape((out_dir / "fedbuff.md").read_text()))


@experiment_app.command("fedsofim", add_help_option=False,
                        context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def fedsofim(ctx: typer.Context) -> None:
    """DP-FedSOFIM (on G and on M) vs DP-FedGD, DP-FedAvgM and DP-FedAdam on a frozen, publicly pretrained feature
    extractor (docs/fedsofim.md): 20 and 100 clients, eps 0.5-10, each optimizer tuned per cell on tuning seeds, 5
    reported seeds; writes fedsofim.json, .md and .png (options: --help)."""
    # The experiment runs gateway-side DP code in-process (edge_sdk, torch); it is imported only when this command
    # runs, so that `wildfed --help` and the other commands start without loading it.
    from wildfed_sim.fedsofim import fedsofim_command

    _run_inner_command(ctx, fedsofim_command, "wildfed experiment fedsofim")


def _run_inner_command(ctx: typer.Context, command: Any, prog_name: str) -> None:
    """Run a lazily imported command function with the outer command's raw arguments (so its module, which may
    import edge_sdk and torch, loads only when the command runs); a non-zero exit code is passed on."""
    inner = typer.Typer(add_completion=False)
    inner.command()(friendly(command))
    code = typer.main.get_command(inner).main(args=list(ctx.args), prog_name=prog_name, standalone_mode=False)
    if isinstance(code, int) and code != 0:
        raise typer.Exit(code=code)


@experiment_app.command("radiomap", add_help_option=False,
                        context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def radiomap(ctx: typer.Context) -> None:
    """Federated RadioUNet radio maps with adaptive grouped noise (docs/radiomap.md): 14 base-station sites, 6 per
    round, 50 rounds, 6 defences (grouped-clipping included), 3 seeds; attacker localisation RMSE (m) and validation MSE
    (dB); writes radiomap.json, .md and .png (options: --help)."""
    # Runs gateway-side code (edge_sdk: the mechanism and allocator) in-process; imported only when it runs.
    from wildfed_sim.radiomap import radiomap_command

    _run_inner_command(ctx, radiomap_command, "wildfed experiment radiomap")
