"""``wildfed clusters ...`` and ``wildfed radio-data ...``: the laboratory's data commands (NIRA's clustering on
real public metadata, the radio maps' tiles and ray-traced sets); mounted on ``wildfed`` by :mod:`wildfed_sim.cli`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table


from coordinator.cli.common import console, friendly

__all__ = ["clusters_app", "radio_data_app"]

clusters_app = typer.Typer(name="clusters", help="NIRA's clustering on real public metadata (../shared/data).",
                           no_args_is_help=True, add_completion=False)


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
