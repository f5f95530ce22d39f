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

import typer
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from coordinator.cli.common import console, err_console, friendly

from wildfed_sim.cli_data import clusters_app, radio_data_app
from wildfed_sim.cli_experiments import experiment_app

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
                            seed=seed, broker=broker, models_by_digest=models_by_digest, out_dir=out,
                            centralised_epochs=centralised_epochs,
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
                      str(r.rounds), f"{r.days:.2f}" if r.days >= 0.1 else f"{r.days * 24:.2g} h",
                      f"{r.signal.ratio:.3g}", f"{r.federation_ratio:.3g}")
    console.print(table)
    console.print("signal/noise: the best case (every clipped gradient of full norm, all aligned) over a record's "
                  "training life; below 1 even that is lost in the noise (edge_sdk/field/learnability.py)")


app.add_typer(experiment_app, name="experiment")
app.add_typer(clusters_app, name="clusters")
app.add_typer(radio_data_app, name="radio-data")


if __name__ == "__main__":  # pragma: no cover
    app()
