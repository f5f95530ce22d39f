"""A whole radio-map federation on one machine: ``wildfed demo --task radiomap`` (docs/radiomap.md).

An MQTT broker (embedded ``amqtt`` unless ``--broker``), the coordinator with ``model: radio_unet``, and one
``wildfed-edge run`` process per base-station site, each with the ``radio-base-station`` profile and
``task: radiomap``. The data is the radio-map experiment's (:mod:`wildfed_sim.radiomap`): each site on its own
256 m tile of the city with a secret centre and 50 maps of transmitters within 20 m of it, validation maps on
held-out tiles of the same city, and a round-0 RadioUNet pretrained on public maps of other tiles. Each round the
coordinator sends signed tasks carrying one public tile of the city (:func:`coordinator.radio.city_raster`); the
gateways retrain their allocators on public proxy sites drawn on it when due, train locally, noise their uploads
with the chosen defence and report its DP event, which the ledger records under NE.

Output (run folder): ``report.json`` (per round: validation MSE in dB, accepted sites, epsilon per site) and
``<run folder>/coordinator/coordinator.yaml`` (the operator commands work on the finished run with ``--config``).
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key
from shared.protocol import GUARANTEED_RADIO_DEFENCES, RADIO_DEFENCES

__all__ = ["RadioDemoSettings", "run_radio_demo"]


@dataclass(frozen=True)
class RadioDemoSettings:
    """Settings of the radio demo (defaults: 6 sites, 10 rounds, adaptive defence at z = 3, a procedural city).

    Raises:
        ConfigError: an unknown defence, a non-positive count, or an unknown city.
    """

    sites: int = 6
    rounds: int = 10
    defence: str = "adaptive"
    noise_multiplier: float = 3.0
    floor_fraction: float = 0.5
    clipping_norm: float = 0.005
    epsilon: float = 30.0
    city: str = "procedural"
    seed: int = 0
    broker: str | None = None
    out_dir: Path | None = None
    round_deadline_s: float = 300.0
    pretrain_epochs: int = 10
    maps_per_site: int = 50

    def __post_init__(self) -> None:
        if self.defence not in RADIO_DEFENCES:
            raise ConfigError(f"unknown defence {self.defence!r}", field="defence",
                              fix=f"use one of {', '.join(RADIO_DEFENCES)}")
        for name in ("sites", "rounds", "maps_per_site"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer", field=name)

    @property
    def privacy(self) -> str:
        """``grouped`` for the defences with a guarantee, ``none`` otherwise."""
        return "grouped" if self.defence in GUARANTEED_RADIO_DEFENCES else "none"


@dataclass
class RadioDemoResult:
    """What the demo measured."""

    run_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    initial_mse_db: float | None = None
    rejections: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0


def run_radio_demo(settings: RadioDemoSettings, *, console: Any = None) -> RadioDemoResult:
    """Run the radio federation of the module docstring. SIGTERM and Ctrl-C stop the broker and every gateway.

    Raises:
        ConfigError: bad settings (e.g. a sionna-rt city whose files are not installed). WildFedError: a gateway
            failed to start. KeyboardInterrupt: interrupted (after clean-up).
    """
    from wildfed_sim.common.runs import sigterm_unwinds

    with sigterm_unwinds():
        return _run(settings, console=console)


def _run(settings: RadioDemoSettings, *, console: Any = None) -> RadioDemoResult:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.config import config_from_dict, save_config
    from wildfed_sim.common.runs import new_run_dir
    from wildfed_sim.gateway_processes import running_gateways
    from wildfed_sim.embedded_broker import embedded_broker
    from wildfed_sim.radiomap import RadioMapSettings, prepare_data, pretrain, validation_mse_db
    from coordinator.radio import city_raster
    from coordinator.service import Coordinator
    from edge_sdk.radio import set_flat_weights
    from shared.models import radio_unet
    from shared.protocol import canonical_flatten, canonical_unflatten

    console = console or Console()
    t0 = time.monotonic()
    run_dir = new_run_dir(settings.out_dir, "demo-radio")
    for sub in ("logs", "ready", "data"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    console.rule(f"WildFed radio demo: {settings.sites} base stations, {settings.rounds} rounds, defence "
                 f"{settings.defence} (z = {settings.noise_multiplier})")
    console.log(f"run folder {run_dir}")
    data_settings = RadioMapSettings(seeds=(settings.seed,), clients=settings.sites, active=settings.sites,
                                     maps_per_client=settings.maps_per_site, city=settings.city,
                                     pretrain_epochs=settings.pretrain_epochs)
    data = prepare_data(data_settings, settings.seed, cache_dir=run_dir / "data")
    console.log(f"city: {settings.city}, {settings.sites} sites x {settings.maps_per_site} maps, each site on its own "
                f"tile ({100 * data.tiles.clients.buildings.mean():.0f} % buildings), {len(data.validation)} "
                f"validation maps on {len(data.tiles.validation)} held-out tiles (64 x 64 px, 4 m/px)")
    console.log(f"public pretraining: {len(data.pretraining)} maps of other tiles, {settings.pretrain_epochs} epochs "
                f"(about 40 s on 2 idle cores)")
    initial = pretrain(data_settings, data, settings.seed, cache_dir=run_dir / "data", console=console)
    model = radio_unet.build_model(width=data_settings.width)
    set_flat_weights(model, initial)
    template = radio_unet.to_numpy_state(model)
    result = RadioDemoResult(run_dir=run_dir)
    result.initial_mse_db = validation_mse_db(model, initial, data.validation)
    console.log(f"round-0 model: validation MSE {result.initial_mse_db:.2f} dB")

    federation_id = f"wildfed-radio-{secrets.token_hex(4)}"
    coord_dir = run_dir / "coordinator"
    coord_key = generate_signing_key()
    save_private_key(coord_key, coord_dir / "keys" / "coordinator.key")
    coordinator_pub = save_public_key(coord_key.public_key(), coord_dir / "keys" / "coordinator.pub")
    radio = {"defence": settings.defence, "noise_multiplier": settings.noise_multiplier,
             "floor_fraction": settings.floor_fraction, "clipping_norm": settings.clipping_norm,
             "epsilon": settings.epsilon, "city": settings.city, "city_seed": settings.seed,
             "local_epochs": data_settings.local_epochs, "batch_size": data_settings.batch_size,
             "learning_rate": data_settings.local_lr, "width": data_settings.width,
             "max_walls": data_settings.max_walls}
    with ExitStack() as stack:
        broker_url = settings.broker
        if broker_url is None:
            broker_url = stack.enter_context(embedded_broker(log_path=run_dir / "logs" / "broker.log"))
            console.log(f"embedded MQTT broker (amqtt) at {broker_url}")
        config = config_from_dict({
            "federation_id": federation_id, "data_dir": str(coord_dir), "broker_url": broker_url,
            "signing_key_path": str(coord_dir / "keys" / "coordinator.key"),
            "public_key_path": str(coordinator_pub), "rounds": settings.rounds,
            "round_deadline_s": settings.round_deadline_s, "privacy": settings.privacy, "model": "radio_unet",
            "radio": radio, "seed": settings.seed}).resolved(run_dir)
        public_tile = city_raster(config.radio)  # the gateways' proxy sites are drawn on this public tile
        console.log(f"the tasks carry a public {settings.city} tile ({100 * public_tile.mean():.0f} % buildings) for "
                    "the gateways' allocator proxies")
        save_config(config, coord_dir / "coordinator.yaml")
        start = canonical_unflatten(initial.astype(np.float32), template)
        coordinator = stack.enter_context(Coordinator(config, initial_weights=start))
        site_configs = _enrol_sites(coordinator, data.clients, run_dir, federation_id=federation_id,
                                    coordinator_pub=coordinator_pub, broker_url=broker_url,
                                    allow_non_private=settings.privacy == "none")
        console.log(f"enrolled {len(site_configs)} base-station sites (their centres stay on the sites)")
        stack.enter_context(running_gateways(site_configs, run_dir / "logs", run_dir / "ready", console))
        columns = (TextColumn("[bold]round {task.completed}/{task.total}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("rounds", total=settings.rounds, info="training...")
            for round_result in coordinator.iter_rounds():
                _, weights = coordinator.rounds.current_model()
                mse = validation_mse_db(model, canonical_flatten(weights).astype(np.float64), data.validation)
                spent = {s.site_id: coordinator.ledger.spent(s.site_id, IUCNCategory.NE)
                         for s in coordinator.registry.list()}
                result.history.append({"round": round_result.round, "status": round_result.status,
                                       "accepted": list(round_result.accepted), "val_mse_db": mse,
                                       "epsilon": spent, "duration_s": round_result.duration_s})
                info = (f"{len(round_result.accepted)}/{len(round_result.selected)} sites, validation MSE "
                        f"{mse:.2f} dB, eps max {max(spent.values(), default=0.0):.2f}/{settings.epsilon:g}")
                progress.update(bar, advance=1, info=info)
        result.rejections = dict(coordinator.status().rejections)
    result.elapsed_s = time.monotonic() - t0
    _report(settings, result, console)
    return result


def _enrol_sites(coordinator: Any, clients: Any, run_dir: Path, *, federation_id: str, coordinator_pub: Path,
                 broker_url: str, allow_non_private: bool) -> list[Path]:
    """Give each client of the data set a site folder ``<run>/sites/bs-<k>`` (its maps, a fresh key pair, a
    ``site.yaml``) and enrol it with ``coordinator``; returns the ``site.yaml`` paths."""
    site_configs = []
    for k, site in enumerate(clients):
        site_id = f"bs-{k:02d}"
        site_dir = run_dir / "sites" / site_id
        site_dir.mkdir(parents=True, exist_ok=True)
        site.maps.save(site_dir / "maps.safetensors")
        key = generate_signing_key()
        save_private_key(key, site_dir / "keys" / "site.key")
        save_public_key(key.public_key(), site_dir / "keys" / "site.pub")
        site_config = {"federation_id": federation_id, "site_id": site_id, "task": "radiomap",
                       "dataset": "maps.safetensors", "profile": "radio-base-station",
                       "private_key": "keys/site.key", "coordinator_public_key": str(coordinator_pub),
                       "broker_url": broker_url, "outbox": "state/outbox.sqlite",
                       "allow_non_private": allow_non_private}
        (site_dir / "site.yaml").write_text(yaml.safe_dump(site_config, sort_keys=False))
        coordinator.enrol(site_id, public_key_to_pem(key.public_key()),
                          {"capacity": len(site.maps), "categories": ["NE"]})
        site_configs.append(site_dir / "site.yaml")
    return site_configs


def _report(settings: RadioDemoSettings, result: RadioDemoResult, console: Any) -> None:
    """Print the per-round table and write ``<run>/report.json``."""
    from rich.table import Table

    table = Table(title=f"WildFed radio demo: {settings.sites} sites, defence {settings.defence}, "
                        f"z = {settings.noise_multiplier}, C = {settings.clipping_norm}")
    table.add_column("round", justify="right")
    table.add_column("sites", justify="right")
    table.add_column("validation MSE (dB)", justify="right")
    table.add_column("eps per site (max, NE)", justify="right")
    table.add_row("0", "-", f"{result.initial_mse_db:.2f}", "0")
    for h in result.history:
        eps = max(h["epsilon"].values(), default=0.0)
        table.add_row(str(h["round"]), str(len(h["accepted"])), f"{h['val_mse_db']:.2f}",
                      f"{eps:.2f}" if settings.privacy != "none" else "- (no guarantee)")
    console.print(table)
    console.log(f"rejected updates by reason: {result.rejections or 'none'}")
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.__dict__.items()},
              "initial_val_mse_db": result.initial_mse_db, "history": result.history,
              "rejections": result.rejections, "elapsed_s": result.elapsed_s}
    (result.run_dir / "report.json").write_text(json.dumps(report, indent=2, default=float))
    console.log(f"report: {result.run_dir / 'report.json'} ({result.elapsed_s:.0f} s in all)")
