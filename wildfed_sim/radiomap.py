"""Federated RadioUNet radio maps with adaptive grouped noise: the seed's evaluation (docs/radiomap.md),
on per-client tiles with two validation sets.

Protocol (per seed; the seed fixes the tiles' roles, the transmitter positions, the initial model and the client
schedule; privacy noise is never seeded: it comes from :class:`shared.privacy.randomness.SecureRandom`):

1. Data (:mod:`wildfed_sim.radio_tiles`, cached under ``<out>/data``): 64 x 64 px maps at 4 m/px (256 m x 256 m
   tiles), RadioMapSeer-style normalised gain, from COST 231 multi-wall path loss (``data = cost231``) or from a
   Sionna RT set (``data = sionna``, ``wildfed radio-data sionna``). The tiles (:func:`wildfed_sim.radio_tiles.plan_tiles`):
   with a sionna-rt scene as the city (default munich), its disjoint grid of tiles (munich: 19) is permuted by the
   seed; each of the 14 clients (base-station sites) gets its own tile, and the remaining tiles are held out for
   validation. A second validation set lies on another city (default florence: 9 tiles), and the public tiles
   (pretraining, the gateways' allocator proxies, the ridge attacker's shadows) on the remaining cities
   (san_francisco and etoile: 16 tiles), so no tile has two roles. Client k has a secret site centre c_k (uniform
   over its tile's transmitter pixels: every outdoor pixel for COST 231) and 50 maps whose transmitters are drawn
   from the transmitter pixels within ``site_radius_m`` (20 m) of c_k (the site's antennas and small cells): 700
   maps. Validation: ``validation_maps`` (100) maps spread evenly over the held-out tiles, and as many over the
   other city's tiles, transmitters anywhere. Building data is public (OpenStreetMap); transmitter sites are not.
   ``city = procedural`` draws every role's tiles from its own generator stream, the other city being a procedural
   old town (:data:`wildfed_sim.radio_tiles.OLD_TOWN`).
2. Federation: FedAvg over the clients, 6 of 14 active per round (drawn uniformly without replacement), 50 rounds;
   each active client runs ``local_epochs`` of Adam (lr ``local_lr``, batch 16, the radio base-station profile's
   micro-batch) on mse(stage 1) + mse(stage 2) from the global model, and uploads its delta through the defence
   (:class:`edge_sdk.privacy.adaptive_noise.AdaptiveGroupedNoise`: none, clip-only, uniform, steered-uniform,
   adaptive, grouped-clipping, all at noise multiplier z and one clipping norm C). The server adds ``server_lr`` x
   the mean of the released deltas. Each upload's DP event (uniform, adaptive, grouped-clipping) is recorded in a
   real :class:`coordinator.ledger.PrivacyLedger` before the server uses it.
3. Adaptive defence and grouped clipping: every ``allocator_every`` rounds the allocator (or the clipping profile)
   is computed from public proxy sites on the public tiles at the current global model. Its inputs are public, so
   every gateway of the round would compute the same; the simulation computes it once per round and hands it to all.
4. Attackers, at round 1 and every ``attack_every``-th round (``attacker``: ridge, template or both):
   - ridge (:func:`fit_attacker`): ``shadow_sites`` shadow sites on random public tiles (the same number of maps,
     the same local training from the same global model, the same defence), kernel ridge regression from the
     released update to the site centre in tile pixels, applied to each active client's real upload;
   - template (:mod:`wildfed_sim.radio_attack`): the attacker knows each client's tile (public building data) and
     computes the update of a shadow site at every candidate of a grid on that tile, without noise, through the
     defence's clipping (``template_shadow``: :mod:`wildfed_sim.radio_shadows`, first-order by default, the
     gateways' own training with ``sequential``); each upload's profile log-likelihood is summed over the site's
     uploads.
   Privacy RMSE = root mean squared Euclidean error in metres. The ridge attacker's naive baseline predicts the
   shadow centres' mean.
5. Utility: validation MSE of stage 2's normalised map, in dB (10 log10 MSE, as the seed reports it), every round,
   on the held-out tiles of the same city (``val_mse_db``) and on the other city (``val_other_mse_db``).

Deviation from the product's transport: the clients run in one process (the same mechanism, allocator and ledger
code as a base-station gateway, no MQTT), so the grid of defences x seeds fits 2 cores.

Output (``out_dir``): ``radiomap.json`` (settings, every run's curves, summary), ``radiomap.md`` (the table),
``radiomap.png`` (validation MSE per round and attacker RMSE per attack round, per defence), ``ledger.db``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.protocol import RADIO_CATEGORY
from shared.radio import SCENES

from edge_sdk.privacy.adaptive_noise import DEFENCES

from wildfed_sim.common.options import opt, parse_list
from wildfed_sim.radiomap_data import ExperimentData, SiteData, make_site, prepare_data
from wildfed_sim.radiomap_model import local_update, pretrain, validation_mse_db
from wildfed_sim.radiomap_report import HEADERS, markdown_table, plot, summarise, table_row
from wildfed_sim.radiomap_run import fit_attacker, run_federation, shadow_updates, template_candidates
from wildfed_sim.radiomap_settings import RadioMapSettings

__all__ = ["RadioMapSettings", "SiteData", "ExperimentData", "prepare_data", "pretrain", "make_site", "local_update", "fit_attacker",
           "run_federation", "summarise", "markdown_table", "run_radiomap_experiment", "radiomap_command",
           "RADIO_CATEGORY", "validation_mse_db", "template_candidates"]


# --------------------------------------------------------------------------------------------- the driver
@dataclass
class RadioMapResult:
    """Runs (one dict per (seed, defence)), the summary and where the files are."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None
    elapsed_s: float = 0.0


def run_radiomap_experiment(settings: RadioMapSettings, *, console: Any = None) -> RadioMapResult:
    """Every (seed, defence) run with the ledger; writes radiomap.json/.md/.png after each run.

    Raises:
        ConfigError: a city scene is named and sionna-rt, which ships the scenes, is not installed (checked before
            anything is written).
    """
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store
    from shared.radio.scenes import scene_path

    for city in (settings.city, settings.validation_city):  # before any folder, file or progress bar
        if city is not None and city in SCENES:
            scene_path(city)  # ConfigError naming the sionna-rt install when its scenes are absent
    out_dir = settings.out_dir or Path("runs") / time.strftime("radiomap-%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{out_dir / 'ledger.db'}", out_dir / "data")
    ledger = PrivacyLedger(store, target_delta=settings.target_delta)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = RadioMapResult(out_dir=out_dir)
    start = time.monotonic()
    total = len(settings.seeds) * len(settings.defences) * settings.rounds
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=console is None) as progress:
        bar = progress.add_task("radio-map federation rounds", total=total)
        for seed in settings.seeds:
            data = prepare_data(settings, seed, cache_dir=out_dir / "data")
            progress.update(bar, description=f"seed {seed}: public pretraining")
            def epoch_done(e: int, s: int = seed) -> None:
                progress.update(bar, description=f"seed {s}: public pretraining, epoch {e}/{settings.pretrain_epochs}")

            initial = pretrain(settings, data, seed, cache_dir=out_dir / "data", on_epoch=epoch_done)
            shadows = shadow_updates(settings, data) if settings.attacker in ("template", "both") else None
            for defence in settings.defences:
                progress.update(bar, description=f"seed {seed}, {defence}")
                prefix = f"seed{seed}-{defence}-"
                run = run_federation(settings, data, defence, seed, initial=initial, ledger=ledger, site_prefix=prefix,
                                     on_round=lambda _: progress.advance(bar), shadows=shadows)
                spend = [ledger.spent(f"{prefix}client{k:02d}", RADIO_CATEGORY) for k in range(settings.clients)
                         if ledger.events(f"{prefix}client{k:02d}", RADIO_CATEGORY)]
                run.update(seed=seed, defence=defence, epsilon=max(spend) if spend else None)
                result.runs.append(run)
                result.summary = summarise(result.runs, settings)
                result.elapsed_s = time.monotonic() - start
                _write(result, settings, out_dir)
    if console is not None:
        from rich.table import Table

        table = Table(title=f"radio maps: {settings.clients} clients, {settings.active} active, {settings.rounds} "
                            f"rounds, z = {settings.noise_multiplier}, seeds {list(settings.seeds)}")
        for h in HEADERS:
            table.add_column(h)
        for entry in result.summary:
            table.add_row(*table_row(entry))
        console.print(table)
        console.log(f"written {out_dir / 'radiomap.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result


def _write(result: RadioMapResult, settings: RadioMapSettings, out_dir: Path) -> None:
    payload = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
               "runs": result.runs, "summary": result.summary, "elapsed_s": result.elapsed_s}
    (out_dir / "radiomap.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "radiomap.md").write_text(markdown_table(result.summary))
    plot(result.runs, settings, out_dir / "radiomap.png")


def radiomap_command(
    seeds: str = opt("0,1,2", "comma-separated seeds (tiles, transmitters, initial model, schedule; noise is "
                     "never seeded)"),
    defences: str = opt(",".join(DEFENCES), "comma-separated defences, default all six: none, clip-only, uniform, "
                        "steered-uniform, adaptive (learned noise shares over a uniform floor), grouped-clipping "
                        "(per-group clipping norms from a public profile, noise calibrated to uniform's epsilon)"),
    rounds: int = opt(50, "federated rounds"),
    clients: int = opt(14, "clients (base-station sites)"),
    active: int = opt(6, "active clients per round"),
    maps_per_client: int = opt(50, "radio maps per client"),
    noise_multiplier: float = opt(3.0, "z: each upload's noise budget is d (z C)^2"),
    clipping_norm: float = opt(0.005, "C: L2 clipping norm of each upload (model delta)"),
    floor_fraction: float = opt(0.5, "phi: the adaptive defence's uniform noise floor, a fraction of the budget"),
    shadow_sites: int = opt(24, "shadow sites the attacker simulates per attack round"),
    attack_every: int = opt(10, "attack every this many rounds (and at round 1)"),
    attacker: str = opt("ridge", "ridge (regression on shadows, per upload), template (likelihood over a grid of "
                        "candidate centres, summed over a site's uploads: wildfed_sim.radio_attack) or both"),
    template_step_px: int = opt(6, "the template attacker's candidate grid spacing in pixels"),
    template_shadow: str = opt("first-order", "how the template attacker computes its shadow updates "
                               "(wildfed_sim.radio_shadows): first-order (one gradient per transmitter pixel of a "
                               "sub-grid at the global model, Adam replayed on its moments), batched (the gateways' "
                               "training, candidates vectorised) or sequential (one training run per candidate)"),
    template_pixel_stride: int = opt(3, "first-order shadows: the transmitter pixel sub-grid's step"),
    pretrain_epochs: int = opt(10, "epochs of public pretraining on other cities' maps (0: start from scratch)"),
    city: str = opt("munich", "the federation's city: a sionna-rt scene (munich, florence, san_francisco, etoile; "
                    "needs `pip install --no-deps sionna-rt==2.2.0`; each client gets its own disjoint 256 m tile, "
                    "the rest are held out for validation) or procedural"),
    validation_city: str | None = opt(None, "the city of the second validation set (default: florence, or munich "
                                      "when --city florence; procedural-old-town with --city procedural); the "
                                      "remaining cities' tiles are the public ones (pretraining, proxies, shadows)"),
    data: str = opt("cost231", "where the maps come from: cost231 (free space + multi-wall, computed here) or "
                    "sionna (a Sionna RT set made by `wildfed radio-data sionna`; needs --sionna-dir)"),
    sionna_dir: Path | None = opt(None, "with --data sionna: the set's folder (`wildfed radio-data sionna --out`)"),
    validation_tiles: int | None = opt(None, "held-out tiles per validation set (default: every tile of the city "
                                       "that no client has, and every tile of the other city)"),
    pretrain_tiles: int = opt(16, "public tiles (pretraining, proxy and shadow sites), from the remaining cities"),
    out: Path | None = opt(None, "output folder (default runs/radiomap-<UTC time>)"),
) -> None:
    """Federated RadioUNet radio maps with six defences (the seed's none, clip-only, uniform, steered-uniform,
    adaptive, and grouped-clipping) on per-client tiles; attacker localisation RMSE (m) and validation MSE (dB) on
    held-out tiles of the city and on another city, per round, 3 seeds.
    Writes radiomap.json, .md, .png and the ledger. The default grid (18 runs) takes well over an hour on 2 cores
    (15 runs took 104 minutes on busy ones; --attacker template with the default first-order shadows costs about
    25 s per attack round on one thread, its round-1 shadows shared by the defences of a seed);
    --rounds 2 --seeds 0 --pretrain-epochs 1 is a quick look (the real cities need `pip install --no-deps
    sionna-rt==2.2.0`; --city procedural needs nothing more)."""
    from rich.console import Console

    settings = RadioMapSettings(
        seeds=parse_list(seeds, int, "seeds", "0,1,2"), defences=parse_list(defences, str, "defences", "uniform"),
        rounds=rounds, clients=clients, active=active, maps_per_client=maps_per_client,
        noise_multiplier=noise_multiplier, clipping_norm=clipping_norm, floor_fraction=floor_fraction,
        shadow_sites=shadow_sites, attack_every=attack_every, city=city, pretrain_epochs=pretrain_epochs,
        attacker=attacker, template_step_px=template_step_px, template_shadow=template_shadow,
        template_pixel_stride=template_pixel_stride, validation_city=validation_city, data=data,
        sionna_dir=sionna_dir, validation_tiles=validation_tiles, pretrain_tiles=pretrain_tiles, out_dir=out)
    run_radiomap_experiment(settings, console=Console())
