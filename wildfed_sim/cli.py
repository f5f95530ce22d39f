"""``wildfed``: the laboratory's command line (typer + rich): a whole federation on one machine, and the experiments.

Commands::

    wildfed demo ...                        the whole-federation demo (wildfed_sim.demo; --task radiomap:
                                            wildfed_sim.radio_demo)
    wildfed experiment privacy-utility ...  the privacy-utility table (tuned per configuration)
    wildfed experiment nira ...             FedAvg vs NIRA on the demo federation
    wildfed experiment nira-head ...        NIRA vs FedAvg baselines on the head under CCDP (in-process)
    wildfed experiment fedbuff ...          sync rounds with a deadline vs FedBuff on intermittent links
    wildfed experiment fedsofim ...         DP-FedSOFIM vs DP-FedGD/AvgM/Adam, frozen extractor, 20/100 clients
    wildfed experiment radiomap ...         radio maps: adaptive grouped noise vs the seed's defences
    wildfed experiment real-photos ...      leave-one-site-out on the real camera-trap photos, over MQTT
    wildfed audit [--break-noise] ...       empirical epsilon lower bound from canaries (one-run audit,
                                            Steinke et al. 2023) beside the claimed epsilon per category
    wildfed observers [--markdown]          the epsilon each observer of the demo faces, per privacy mode
    wildfed plan-budgets [--config ...]     what each category's records go through under a coordinator config
    wildfed clusters check-metadata         cluster the real Wildlife Insights / Snapshot Serengeti deployments
                                            (../shared/data) and compare with their projects
    wildfed radio-data tiles                the radio-map experiment's disjoint 256 m tiles of each city
    wildfed radio-data sionna ...           ray-trace a radio-map set with Sionna RT (wildfed_sim.radio_data)

Each runs both sides in this machine's processes (gateways, coordinator, broker) and reads no operator config. The
operator's commands against a real federation are ``wildfed-coordinator``'s (coordinator/cli/). User errors
(:class:`shared.errors.WildFedError`) print one red line naming the field and fix, and exit with status 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from coordinator.cli.common import console, err_console, friendly

__all__ = ["app"]

app = typer.Typer(name="wildfed", help="WildFed's laboratory: the demo federation on one machine, the experiments, "
                  "the privacy audit.", no_args_is_help=True, add_completion=False)


@app.command()
@friendly
def demo(
    sites: int | None = typer.Option(None, help="gateway sites, one process each (default: 8; 6 with --task "
                                     "radiomap)"),
    rounds: int = typer.Option(10, help="federated rounds"),
    privacy: str | None = typer.Option(None, help="global (secure aggregation, the noise added once to the sum "
                                       "over sites; needs --local-steps 1; the default with --strategy fedavg), "
                                       "ccdp (per-IUCN-category DP-SGD at each gateway, local DP; the default with "
                                       "--strategy nira) or none (non-private reference)"),
    gamma: float = typer.Option(1.0, help="CCDP steepness: eps_c = eps_anchor * (rank(c)/rank(anchor))^gamma"),
    ccdp_variant: str = typer.Option("sample", help="CCDP as individualized DP-SGD: sample (each category's "
                                     "records sampled at their own rate) or scale (clipped at their own norm)"),
    class_reweighting: float = typer.Option(0.5, help="with --privacy ccdp: scale each class row of a site's "
                                            "head update by w_c^-p (w_c: how much less its IUCN category is "
                                            "sampled; post-processing, no privacy cost); 0 = off"),
    posthoc_logit_adjustment: float | None = typer.Option(
        None, help="tau of the post-hoc logit adjustment of the served model: predict argmax f_k(x) - tau log pi_k, "
        "pi from the sites' public metadata (no privacy cost); default 1 with --strategy fedavg, 0 (off) with nira"),
    global_noise: str = typer.Option("distributed", help="with --privacy global: distributed (each gateway "
                                     "adds a Skellam share before secure aggregation masks its sum: the "
                                     "coordinator never sees an unnoised sum) or trusted-server (the coordinator "
                                     "adds the noise)"),
    tolerated_dropouts: int | None = typer.Option(None, help="with --privacy global: sites that may drop out of "
                                                  "a round and its secure sum still open; the threshold is sites "
                                                  "minus this, and distributed noise is calibrated for it (default "
                                                  "1: t = 7 of 8)"),
    anchor_category: str = typer.Option("VU", help="IUCN category pinned to --anchor-epsilon"),
    anchor_epsilon: float = typer.Option(1.0, help="total epsilon of the anchor category over the federation"),
    local_steps: int | None = typer.Option(None, help="(DP-)SGD steps per site per round (default: 1 with DP, "
                                           "60 with --privacy none)"),
    expected_batch_size: int | None = typer.Option(None, help="records per step in expectation (q = B / N_site; "
                                                   "default 1024 with DP, 128 with --privacy none)"),
    learning_rate: float | None = typer.Option(None, help="SGD step size (default 12 with --privacy global, 4 "
                                               "with ccdp, 10 with none: no clipping there)"),
    server_momentum: float | None = typer.Option(None, help="coordinator's server SGD momentum (FedAvgM; 0 = "
                                                 "FedAvg; default 0.5, the tuned value)"),
    clipping_norm: float = typer.Option(1.0, help="L2 clipping norm C of per-example gradients"),
    adapter_width: int = typer.Option(0, help="head model: phi adapter width (1280 -> H, tanh); 0 = the linear "
                                      "head psi alone on the frozen backbone embeddings"),
    target_delta: float = typer.Option(1e-5, help="delta of every category's guarantee"),
    seed: int = typer.Option(0, help="data split, site design and model initialisation (noise stays random)"),
    broker: str | None = typer.Option(None, help="mqtt://host:port of a running broker (default: embedded amqtt)"),
    models_by_digest: bool = typer.Option(True, "--models-by-digest/--no-models-by-digest",
                                          help="the coordinator's transfer.models_by_digest: tasks name a retained "
                                          "model by digest; --no-models-by-digest: every task carries its model "
                                          "(brokers without retained delivery on wildcards, e.g. RabbitMQ 3.10)"),
    out: Path | None = typer.Option(None, help="run folder (default runs/demo-<UTC time>)"),
    centralised_epochs: int = typer.Option(0, help="also train on the pooled data for N epochs as a reference"),
    round_deadline_s: float | None = typer.Option(None, help="seconds a round waits for its sites (default 300; "
                                                  "with --links, what covers the model's gaps in compressed time)"),
    round_duration_s: float | None = typer.Option(None, help="each reply leaves this long after its task (timing "
                                                  "padding; default 0; with --links, 20 simulated minutes)"),
    links: str = typer.Option("always-on", help="gateways' links, played over the real broker in compressed time "
                              "(wildfed_sim/demo_links.py): always-on, satellite (10 min every 90), solar-night or "
                              "cellular"),
    link_minute_s: float = typer.Option(0.25, help="with --links: real seconds per simulated minute"),
    buffered: int = typer.Option(0, help="0: synchronous rounds; K > 0: buffered rounds (FedBuff) closing at K "
                                 "updates, stale ones folded with a staleness weight (local DP: --privacy ccdp)"),
    max_staleness: int = typer.Option(10, help="with --buffered: the oldest stale update folded, in rounds"),
    pretrain_epochs: int = typer.Option(0, help="first pretrain the model (non-private) on the public split, the "
                                        "training images no site holds, for N epochs (0: start from scratch)"),
    strategy: str = typer.Option("fedavg", help="aggregation: fedavg, or nira (ecological clusters, shared phi, "
                                 "one head per cluster)"),
    recluster_every: int = typer.Option(0, help="nira: re-cluster from the sites' phi-updates every N rounds "
                                        "(0: never)"),
    embedding_merging: bool = typer.Option(True, "--embedding-merging/--no-embedding-merging",
                                           help="nira: species-embedding merging (once per cluster and species, "
                                           "aligned to the head; docs/nira.md)"),
    feature_centre: bool = typer.Option(True, "--feature-centre/--no-feature-centre",
                                        help="gateways train on embeddings centred by the public split's mean "
                                        "(images no site holds; shared/models/feature_centre.py)"),
    task: str = typer.Option("camera", help="camera (camera traps, real images) or radiomap (base stations learn "
                             "a radio map; uses --sites (default 6 then), --rounds, --seed, --broker, --out, "
                             "--round-deadline-s, --defence, --city; docs/radiomap.md)"),
    defence: str = typer.Option("adaptive", help="radiomap: none, clip-only, uniform, steered-uniform, adaptive "
                                "or grouped-clipping"),
    city: str = typer.Option("procedural", help="radiomap: procedural, or a sionna-rt scene (munich, florence, "
                             "san_francisco, etoile; pip install --no-deps sionna-rt==2.2.0)"),
) -> None:
    """A whole federation on one machine, on real images: MQTT broker, coordinator and one gateway process per
    site; prints accuracy and epsilon per IUCN category and writes report.json + report.png. With --task radiomap:
    radio base stations learning a radio map with grouped-noise uploads."""
    if task == "radiomap":
        from wildfed_sim.radio_demo import RadioDemoSettings, run_radio_demo

        radio_settings = RadioDemoSettings(sites=6 if sites is None else sites, rounds=rounds, defence=defence,
                                           city=city, seed=seed, broker=broker, out_dir=out,
                                           round_deadline_s=300.0 if round_deadline_s is None
                                           else round_deadline_s)
        try:
            run_radio_demo(radio_settings, console=console)
        except KeyboardInterrupt:
            err_console.print("[bold yellow]interrupted:[/] broker and gateway processes stopped")
            raise typer.Exit(code=130) from None
        return
    if task != "camera":
        raise ConfigError(f"unknown task {task!r}", field="task", fix="use camera or radiomap")
    from wildfed_sim.demo import DemoSettings, run_demo

    settings = DemoSettings(sites=8 if sites is None else sites, rounds=rounds, privacy=privacy, gamma=gamma,
                            ccdp_variant=ccdp_variant, global_noise=global_noise,
                            tolerated_dropouts=tolerated_dropouts,
                            class_reweighting=class_reweighting, posthoc_logit_adjustment=posthoc_logit_adjustment,
                            anchor_category=anchor_category.upper(), anchor_epsilon=anchor_epsilon,
                            local_steps=local_steps, expected_batch_size=expected_batch_size,
                            learning_rate=learning_rate, server_momentum=server_momentum,
                            clipping_norm=clipping_norm, target_delta=target_delta,
                            adapter_width=adapter_width,
                            seed=seed, broker=broker, models_by_digest=models_by_digest, out_dir=out, centralised_epochs=centralised_epochs,
                            round_deadline_s=round_deadline_s, pretrain_epochs=pretrain_epochs,
                            strategy=strategy, nira_recluster_every=recluster_every,
                            nira_embedding_merging=embedding_merging, feature_centre=feature_centre,
                            round_duration_s=round_duration_s, links=links, link_minute_s=link_minute_s,
                            buffered=buffered,
                            max_staleness=max_staleness)
    try:
        run_demo(settings, console=console)
    except KeyboardInterrupt:
        err_console.print("[bold yellow]interrupted:[/] broker and gateway processes stopped; the run folder keeps "
                          "what was written so far")
        raise typer.Exit(code=130) from None


experiment_app = typer.Typer(name="experiment", help="Laboratory experiments: the demo federation replayed or run "
                             "(privacy-utility, nira, nira-head), the seed's DP-FedSOFIM setting, radio maps.",
                             no_args_is_help=True, add_completion=False)
app.add_typer(experiment_app, name="experiment")


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


@app.command()
@friendly
def audit(
    out: Path | None = typer.Option(None, help="output folder for audit.json and canaries.csv (default "
                                    "runs/audit-<UTC time>; must be new or empty)"),
    canaries_per_category: int = typer.Option(100, help="canary records added per audited IUCN category (m)"),
    categories: str = typer.Option(",".join(c.value for c in IUCNCategory),
                                   help="comma-separated IUCN categories to audit"),
    site_records: int = typer.Option(500, help="real Animal-MNIST training images at the audited site"),
    rounds: int = typer.Option(5, help="rounds (also the planned rounds the noise is calibrated for)"),
    local_steps: int = typer.Option(10, help="DP-SGD steps per round"),
    expected_batch_size: int = typer.Option(128, help="records per step in expectation (q = B / N_active)"),
    learning_rate: float = typer.Option(0.5, help="local SGD step size"),
    clipping_norm: float = typer.Option(1.0, help="L2 clipping norm C (an 'in' canary's gradient has norm C)"),
    target_delta: float = typer.Option(1e-5, help="delta of the claims and of the lower bounds"),
    gamma: float = typer.Option(1.0, help="CCDP steepness: eps_c = eps_anchor * (rank(c)/rank(anchor))^gamma"),
    anchor_category: str = typer.Option("VU", help="IUCN category pinned to --anchor-epsilon"),
    anchor_epsilon: float = typer.Option(1.0, help="total epsilon of the anchor category"),
    guess_fraction: float = typer.Option(0.6, help="share of each category's canaries guessed (half in, half out; "
                                         "fixed in advance, no search)"),
    confidence: float = typer.Option(0.95, help="confidence 1 - beta of the lower bound"),
    accountant: str = typer.Option("rdp", help="accountant of the claimed epsilon: rdp or pld"),
    ccdp_variant: str = typer.Option("sample", help="individualized DP-SGD variant: sample (per-category rates) "
                                     "or scale (per-category clipping norms)"),
    break_noise: bool = typer.Option(False, "--break-noise", help="DIAGNOSTIC ONLY: silence the mechanism's "
                                     "Gaussian noise, to show the audit detects a broken mechanism"),
    seed: int | None = typer.Option(None, help="seed canaries, sampling and noise for a reproducible run (no "
                                    "privacy guarantee then; default: secure randomness)"),
    threads: int | None = typer.Option(None, help="torch threads"),
) -> None:
    """Empirical privacy audit (one run, Steinke et al. 2023): canaries per IUCN category in one site, the gateway's
    own CCDP training, and an epsilon lower bound from a membership test, beside the claimed epsilon. Exit status 1
    when a lower bound exceeds its claim on the real mechanism (a privacy bug, or a beta-probability fluke)."""
    from wildfed_sim.audit import AuditSettings, load_audit_site, run_audit
    from wildfed_sim.common.runs import new_run_dir
    from shared.iucn import CCDPBudget, parse_category

    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence must be in (0, 1), got {confidence}", field="confidence", fix="e.g. 0.95")
    cats = tuple(parse_category(c, field="categories") for c in categories.split(",") if c.strip())
    settings = AuditSettings(
        canaries_per_category=canaries_per_category, categories=cats,
        budget=CCDPBudget.from_anchor(anchor_category, anchor_epsilon, gamma), rounds=rounds,
        local_steps=local_steps, expected_batch_size=expected_batch_size, learning_rate=learning_rate,
        clipping_norm=clipping_norm, target_delta=target_delta, guess_fraction=guess_fraction,
        beta=1.0 - confidence, accountant=accountant, ccdp_variant=ccdp_variant,  # type: ignore[arg-type]
        break_noise=break_noise, seed=seed)
    if isinstance(site_records, bool) or site_records < 1:
        raise ConfigError(f"--site-records must be >= 1, got {site_records}", field="site-records",
                          fix="e.g. --site-records 500")
    run_dir = new_run_dir(out, "audit")
    with console.status("loading Animal-MNIST for the audited site"):
        features, labels, ranks = load_audit_site(site_records, seed=seed)
    with console.status(f"training {rounds} round(s) x {local_steps} step(s) with "
                        f"{canaries_per_category * len(settings.categories)} canaries"
                        + (" [bold red](noise OFF)[/]" if break_noise else "")):
        result = run_audit(settings, features=features, labels=labels, categories=ranks, threads=threads)
    (run_dir / "audit.json").write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    with (run_dir / "canaries.csv").open("w", encoding="utf-8") as fh:
        fh.write("category,coordinate,included,score\n")
        for rank, coord, inc, score in zip(result.design.categories, result.design.coordinates,
                                           result.design.included, result.scores):
            fh.write(f"{[c for c in IUCNCategory if c.rank == int(rank)][0].value},{int(coord)},{int(bool(inc))},"
                     f"{float(score)!r}\n")

    level = f"{confidence:.0%}"
    table = Table(title=f"empirical privacy audit ({'NOISE OFF, diagnostic' if break_noise else 'real mechanism'}; "
                        f"delta={target_delta:g}, q={result.sampling_rate:.4g}, "
                        f"{rounds * local_steps} steps, N_active={result.num_active})",
                  caption="m canaries (in: secretly included), r guesses, v correct; q: the category's sampling "
                          "rate; z: its noise multiplier; ceiling: "
                          "the bound if all r guesses were right (no larger epsilon can be detected). Lower "
                          f"bound: Steinke, Nasr & Jagielski 2023, Thm 3.1, at {level} confidence: a lower bound, not "
                          f"a proof of privacy. Claimed: the ledger's epsilon for the steps run ({accountant}).")
    for col in ("cat.", "m", "in", "r", "v", "q", "z", "claimed ε", f"ε lower bound ({level})", "ceiling", "verdict"):
        table.add_column(col, justify="left" if col in ("cat.", "verdict") else "right")
    for row in result.rows:
        if row.exceeds_claim:
            verdict = "[bold red]EXCEEDS[/]"
        elif row.ceiling < row.claimed_epsilon:
            verdict = "[yellow]inconclusive[/] (ceiling < claim)"
        else:
            verdict = "[green]ok[/]"
        table.add_row(row.category.value, str(row.canaries), str(row.included), str(row.guesses), str(row.correct),
                      f"{row.sampling_rate:.4g}", f"{row.noise_multiplier:.3f}", f"{row.claimed_epsilon:.4f}",
                      f"{row.lower_bound:.4f}",
                      f"{row.ceiling:.2f}", verdict)
    console.print(table)
    console.print(escape(f"written {run_dir / 'audit.json'} and {run_dir / 'canaries.csv'} "
                         f"({result.wall_seconds:.1f} s)"))
    exceeded = [r.category.value for r in result.rows if r.exceeds_claim]
    if break_noise:
        if len(exceeded) == len(result.rows):
            console.print("[green]noise off: the audit detects the broken mechanism in every category[/]")
        else:
            console.print(f"[yellow]noise off, yet no detection for "
                          f"{[r.category.value for r in result.rows if not r.exceeds_claim]}: the audit lacks power "
                          "here (more canaries, steps or a larger --guess-fraction)[/]")
    elif exceeded:
        err_console.print(f"[bold red]privacy audit: the lower bound exceeds the claimed epsilon for {exceeded}: "
                          "investigate the mechanism (or rerun: this happens by chance with probability <= "
                          f"{1 - confidence:.2g} per category)[/]")
        raise typer.Exit(code=1)


@app.command()
@friendly
def observers(
    sites: int = typer.Option(8, help="gateway sites of the demo"),
    rounds: int = typer.Option(10, help="federated rounds"),
    tolerated_dropouts: int | None = typer.Option(None, help="distributed noise: the threshold is sites minus this "
                                                  "(default: the demo's, 1)"),
    markdown: bool = typer.Option(False, "--markdown", help="print the Markdown that docs/privacy.md quotes"),
) -> None:
    """The epsilon each observer faces in the demo (coordinator, non-participant, participants, colluders), per
    privacy mode and IUCN category, from the charges the product plans (wildfed_sim.demo_observers)."""
    from wildfed_sim.demo import DemoSettings
    from wildfed_sim.demo_observers import demo_observer_markdown, demo_observer_tables

    settings = DemoSettings(privacy="global", sites=sites, rounds=rounds, tolerated_dropouts=tolerated_dropouts)
    with console.status("planning each mode's charges and composing them per observer"):
        if markdown:
            console.print(demo_observer_markdown(settings), markup=False, highlight=False, soft_wrap=True)
            return
        tables = demo_observer_tables(settings)
    for mode, rows in tables.items():
        table = Table(title=f"{mode}: epsilon each observer faces (delta={settings.target_delta:g})")
        for col in ("observer", "noise left", "within the charge", *(c.value for c in IUCNCategory)):
            table.add_column(col, justify="left" if col == "observer" else "right", overflow="fold")
        for r in rows:
            table.add_row(escape(r.observer), f"{r.noise_fraction:.3g}x", "yes" if r.charged else "[red]NO[/]",
                          *("none" if r.epsilon[c] == float("inf") else f"{r.epsilon[c]:.3f}" for c in IUCNCategory))
        console.print(table)


@app.command("plan-budgets")
@friendly
def plan_budgets(
    config: Path | None = typer.Option(None, "--config", help="a coordinator config (default: the defaults of "
                                       "`wildfed-coordinator init`, one round a day)"),
    capacity: int = typer.Option(200, help="the site's declared capacity (enrolment metadata)"),
    records: int = typer.Option(20, help="records of each category at the site, for the signal column"),
    sites: int = typer.Option(10, help="sites holding as many, for the federation's signal column"),
    categories: str = typer.Option("CR,EN,VU,NT,LC,NE", help="the IUCN categories of the site's species table "
                                   "(comma-separated): the largest budget among them sets the noise"),
) -> None:
    """What each IUCN category's records go through under a coordinator config: their sampling rate and noise, how
    many rounds (and days) each record trains before it retires, and whether that many records can teach the
    model (wildfed_sim.budget_plan; docs/privacy.md "Planning budgets for a multi-year network")."""
    from coordinator.config import CoordinatorConfig, load_config
    from shared.iucn import parse_category
    from wildfed_sim.budget_plan import budget_plan

    cfg = load_config(config) if config is not None else CoordinatorConfig(federation_id="plan")
    with console.status("calibrating each category's noise and sampling rate (dp-accounting)"):
        rows = budget_plan(cfg, capacity=capacity, records=records, sites=sites,
                           categories=tuple(parse_category(c.strip(), field="--categories")
                                            for c in categories.split(",") if c.strip()))
    table = Table(title=f"per record, capacity {capacity}, {cfg.rounds} rounds of {cfg.local_steps} steps, "
                        f"B={cfg.expected_batch_size}, delta={cfg.target_delta:g}")
    for col in ("category", "budget", "q", "noise multiplier", "rounds trained", "days trained",
                f"signal/noise, {records} records", f"same, {sites} such sites"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for r in rows:
        table.add_row(r.category.value, f"{r.budget:.3f}", f"{r.sampling_rate:.4g}", f"{r.noise_multiplier:.3f}",
                      str(r.rounds), f"{r.days:g}",
                      f"{r.signal.ratio:.3g}", f"{r.federation_ratio:.3g}")
    console.print(table)
    console.print("signal/noise: the best case (every clipped gradient of full norm, all aligned) over a record's "
                  "training life; below 1 even that is lost in the noise (edge_sdk/field/learnability.py)")


clusters_app = typer.Typer(name="clusters", help="NIRA's clustering on real public metadata (../shared/data).",
                           no_args_is_help=True, add_completion=False)
app.add_typer(clusters_app, name="clusters")


def _sizes(sizes: object) -> str:
    """Cluster sizes, largest first (a dict label -> size or a list), at most 12 shown."""
    values = sorted((sizes.values() if isinstance(sizes, dict) else list(sizes or [])), reverse=True)
    return ", ".join(str(v) for v in values[:12]) + (f", ... ({len(values)} clusters)" if len(values) > 12 else "")


@clusters_app.command("check-metadata")
def check_metadata(data: Path = typer.Option(None, help="folder holding wildlife-insights/ and snapshot-serengeti/ "
                                             "(default: ../shared/data of the repository)"),
                   out: Path | None = typer.Option(None, help="also write metadata_checks.json and heatmaps here")
                   ) -> None:
    """Cluster the real deployments of ../shared/data from their species lists: Wildlife Insights (38 deployments,
    two projects: how the clusters line up with them) and Snapshot Serengeti (223 locations: the Jaccard spread).
    Exit status 2 when neither dataset is found."""
    from wildfed_sim.nira_metadata import DEFAULT_DATA_ROOT, run_metadata_checks

    result = run_metadata_checks(data if data is not None else DEFAULT_DATA_ROOT, out_dir=out)
    for name, report in result.items():
        if "skipped" in report:
            skipped = f"{name}: skipped: {report['skipped']}"
            console.print(f"[yellow]{escape(skipped)}[/]")
            continue
        j = report["jaccard"]
        units = report.get("num_deployments", report.get("num_locations"))
        console.print(f"[bold]{escape(name)}[/]: " + escape(
            f"{units} sites, pairwise Jaccard min {j['min']:.3f}, median {j['median']:.3f}, max {j['max']:.3f}; "
            f"sensitive species left out: {', '.join(report.get('removed_sensitive') or []) or 'none'}"))
        cuts = report.get("cuts") or [{k: report[k] for k in ("cut", "num_clusters", "cluster_sizes") if k in report}]
        table = Table(title=escape(f"{name}: clusters"))
        for col in ("cut", "clusters", "sizes", "purity", "ARI"):
            table.add_column(col)
        for c in cuts:
            table.add_row(escape(json.dumps(c.get("cut"))), str(c.get("num_clusters")),
                          _sizes(c.get("cluster_sizes")),
                          "-" if c.get("purity") is None else f"{c['purity']:.3f}",
                          "-" if c.get("adjusted_rand_index") is None else f"{c['adjusted_rand_index']:.3f}")
        console.print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metadata_checks.json").write_text(json.dumps(result, indent=2, default=str) + "\n",
                                                  encoding="utf-8")
        console.print(escape(f"written {out / 'metadata_checks.json'} (every number, the clusters and the heatmaps)"))
    if all("skipped" in r for r in result.values()):
        raise typer.Exit(code=2)


radio_data_app = typer.Typer(name="radio-data", help="Radio-map data: the cities' disjoint 256 m tiles, and a "
                             "ray-traced Sionna RT set (docs/radiomap-data.md).", no_args_is_help=True,
                             add_completion=False)
app.add_typer(radio_data_app, name="radio-data")


def _sionna_settings(**fields: Any) -> Any:
    from shared.radio.sionna_maps import SionnaSettings

    return SionnaSettings(**fields)


@radio_data_app.command("tiles")
@friendly
def radio_data_tiles(
    scene: list[str] = typer.Option(None, help="a sionna-rt scene (repeat the option; default: all four)"),
    tx_step_px: int = typer.Option(2, help="grid step of the transmitter positions a Sionna set traces"),
) -> None:
    """Each city's disjoint 256 m tiles (64 x 64 px at 4 m/px; building coverage 0.15-0.6), their building coverage
    and the transmitter positions a Sionna set traces on each (outdoor pixels of a grid of --tx-step-px)."""
    from shared.radio import SCENES
    from wildfed_sim.radio_data import tiles_report

    rows = tiles_report(list(scene or SCENES), _sionna_settings(tx_step_px=tx_step_px))
    table = Table(title="radio-map tiles (wildfed experiment radiomap: clients and held-out tiles of the city, "
                        "another city's, public tiles of the rest)")
    for col in ("scene", "index", "tile", "coverage", "transmitters"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["scene"], str(r["index"]), r["tile"], f"{r['coverage']:.2f}", str(r["transmitters"]))
    console.print(table)


@radio_data_app.command("sionna")
@friendly
def radio_data_sionna(
    out: Path = typer.Option(..., help="the set's folder: DIR/<scene>/*.npz (one per tile) and DIR/manifest.json; "
                             "one settings per folder, tiles already traced are kept"),
    scene: list[str] = typer.Option(["munich"], help="a sionna-rt scene: munich, florence, san_francisco, etoile "
                                    "(repeat the option for several)"),
    tiles: str = typer.Option("all", help="all, or a count N: the first N tiles of each scene"),
    tile: list[int] = typer.Option(None, help="a tile index instead (repeat the option; wildfed radio-data tiles "
                                   "lists them)"),
    tx_step_px: int = typer.Option(2, help="transmitters on the outdoor pixels of a grid of this step (px)"),
    tx_per_tile: int | None = typer.Option(None, help="at most this many of them per tile (a seeded subset)"),
    samples_per_tx: int = typer.Option(1_000_000, help="rays per transmitter of the first trace"),
    max_samples_per_tx: int = typer.Option(8_000_000, help="doubling the rays stops here"),
    min_coverage: float = typer.Option(0.9, help="double the rays until this fraction of outdoor pixels has a value "
                                       "(mean over a batch of transmitters)"),
    max_depth: int = typer.Option(20, help="most interactions (reflections, refractions) per path"),
    tx_height_m: float = typer.Option(6.0, help="transmitter height above ground (m)"),
    rx_height_m: float = typer.Option(1.5, help="height of the measurement surface above ground (m)"),
    frequency_hz: float = typer.Option(3.5e9, help="carrier frequency (Hz)"),
    diffraction: bool = typer.Option(False, help="Sionna's diffraction (slower; off by default)"),
    seed: int = typer.Option(0, help="the solver's seed and the --tx-per-tile subset's"),
    batch: int = typer.Option(8, help="transmitters per solver call"),
) -> None:
    """Ray-trace path-gain maps with Sionna RT on the real city scenes sionna-rt ships: every transmitter position of
    each chosen 256 m tile, on the experiment's 64 x 64 px grid (4 m/px). Needs sionna-rt with mitsuba and drjit,
    Debian's libllvm19 and DRJIT_LIBLLVM_PATH (docs/radiomap-data.md); about 1-6 s per map on 2 CPU cores at the
    defaults. Prints the time and the fraction of outdoor pixels with a value."""
    from wildfed_sim.radio_data import run_sionna

    settings = _sionna_settings(tx_step_px=tx_step_px, tx_per_tile=tx_per_tile, samples_per_tx=samples_per_tx,
                                max_samples_per_tx=max_samples_per_tx, min_coverage=min_coverage,
                                max_depth=max_depth, tx_height_m=tx_height_m, rx_height_m=rx_height_m,
                                frequency_hz=frequency_hz, diffraction=diffraction, seed=seed, batch=batch)
    report = run_sionna(out, list(scene), tiles, settings, indices=list(tile or []) or None, console=console)
    table = Table(title=f"Sionna RT radio maps in {out}")
    for col in ("tile", "maps", "outdoor pixels with a value (mean, min)", "rays per transmitter", "seconds", "cached"):
        table.add_column(col)
    for r in report["tiles"]:
        table.add_row(r["tile"], str(r["transmitters"]), f"{r['coverage_mean']:.3f}, {r['coverage_min']:.3f}",
                      ", ".join(f"{s:,}" for s in r["samples_per_tx"]), f"{r['elapsed_s']:.0f}",
                      "yes" if r["cached"] else "no")
    console.print(table)
    per_map = report["seconds_per_map"]
    console.print(escape(f"{report['maps']} maps on {len(report['tiles'])} tiles; outdoor pixels with a value: "
                         f"{report['coverage_mean']:.3f} (mean over maps); {report['elapsed_s']:.0f} s in all"
                         + (f", {per_map:.1f} s per traced map" if per_map else "")))


if __name__ == "__main__":  # pragma: no cover
    app()
