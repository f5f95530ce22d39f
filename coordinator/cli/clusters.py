"""``wildfed-coordinator clusters``: NIRA's ecological clusters for operators (coordinator/strategies/nira.py).

::

    wildfed-coordinator clusters show [--heatmap FILE]   clusters, members, mean Jaccard, recent changes
    wildfed-coordinator clusters recluster               re-cluster from the species lists before the next round
    wildfed-coordinator clusters pin SITE CLUSTER        keep SITE in CLUSTER (applied at the next round)

They read ``--config`` and need ``strategy: {kind: nira}`` in it. They work on the database
alone, so they can run while the coordinator runs; requests take effect before its next round. (Clustering the
real public metadata of ../shared/data is lab work: ``wildfed clusters check-metadata``, wildfed_sim/cli.py.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError

from coordinator.cli.common import config_option, console, friendly
from coordinator.config import CoordinatorConfig, load_config
from coordinator.registry import SiteRegistry
from coordinator.storage import Store

__all__ = ["app"]

app = typer.Typer(name="clusters", help="NIRA's ecological clusters: show, re-cluster, pin a site.",
               no_args_is_help=True, add_completion=False)


def _nira(config_path: Path):
    """``(config, store, NIRA strategy)`` for a config whose strategy is NIRA.

    Raises:
        ConfigError: the config's strategy is not NIRA.
    """
    from coordinator.service import build_strategy

    cfg: CoordinatorConfig = load_config(config_path)
    if cfg.strategy.kind != "nira":
        raise ConfigError(f"the strategy is {cfg.strategy.kind!r}, not NIRA", source=config_path, field="strategy",
                          fix="set strategy: {kind: nira} in the config to use clusters")
    store = Store(cfg.database_url or "", cfg.data_dir)
    return cfg, store, build_strategy(cfg, store, SiteRegistry(store))


@app.command("show")
@friendly
def show(config: Path = config_option(),
         heatmap: Path | None = typer.Option(None, help="write the Jaccard heatmap (sites grouped by cluster) here"),
         changes: int = typer.Option(10, help="how many of the latest cluster changes to list")) -> None:
    """The current clusters (or, before round 1, the clustering the species lists give), their members and mean
    within-cluster Jaccard similarity, and the latest changes with their reasons."""
    from coordinator.strategies.ecological_clustering import plot_similarity_heatmap

    _, store, nira = _nira(config)
    assignment = nira.assignment()
    preview = assignment is None
    if preview:
        assignment = nira.cluster_from_species(nira.state()["pins"])
    index = {s: i for i, s in enumerate(assignment.site_ids)}
    table = Table(title="NIRA clusters" + (" (preview from species lists: no round has run)" if preview else ""))
    for col in ("cluster", "sites", "members", "mean Jaccard within"):
        table.add_column(col, justify="right" if col in ("sites", "mean Jaccard within") else "left")
    for label, members in assignment.clusters.items():
        idx = [index[m] for m in members if m in index]
        sub = assignment.similarity[np.ix_(idx, idx)]
        within = (sub.sum() - np.trace(sub)) / (len(idx) * (len(idx) - 1)) if len(idx) > 1 else float("nan")
        pins = [m for m in members if m in assignment.pinned]
        shown = ", ".join(members[:8]) + (f", ... (+{len(members) - 8})" if len(members) > 8 else "")
        table.add_row(escape(label), str(len(members)),
                      escape(shown + (f"  [pinned: {', '.join(pins)}]" if pins else "")),
                      "-" if np.isnan(within) else f"{within:.3f}")
    console.print(table)
    state = nira.state()
    if state.get("recluster_requested"):
        console.print("[yellow]a re-cluster from the species lists is requested: it runs before the next "
                      "round[/]")
    for change in state["changes"][-changes:] if changes > 0 else []:
        console.print(escape(f"round {change['round']}: {change['site']} {change['from'] or '(new)'} -> "
                             f"{change['to']}: {change['reason']}"))
    if heatmap is not None:
        console.print(escape(f"heatmap written to {plot_similarity_heatmap(assignment, heatmap)}"))
    store.dispose()


@app.command("recluster")
@friendly
def recluster(config: Path = config_option()) -> None:
    """Re-cluster from the species lists (and pins) before the next round; prints the clusters it will give."""
    _, store, nira = _nira(config)
    nira.request_recluster()
    preview = nira.cluster_from_species(nira.state()["pins"])
    console.print(f"re-cluster requested: {len(preview.clusters)} cluster(s) from the species lists "
                  "(labels are matched to the current heads by membership when it runs)")
    for label, members in preview.clusters.items():
        console.print(escape(f"  {label}: {', '.join(members)}"))
    store.dispose()


@app.command("pin")
@friendly
def pin(site: str = typer.Argument(..., help="enrolled site id"),
        cluster: str = typer.Argument(..., help="cluster label (e.g. c0; a new label makes a new cluster)"),
        config: Path = config_option()) -> None:
    """Keep SITE in CLUSTER from the next round on (re-clustering never moves a pinned site)."""
    _, store, nira = _nira(config)
    if site not in {s.site_id for s in SiteRegistry(store).list()}:
        raise ConfigError(f"site {site!r} is not enrolled", field="site",
                          fix="see `wildfed-coordinator status` for the enrolled sites")
    nira.pin(site, cluster)
    console.print(escape(f"{site} pinned to {cluster}; applied before the next round"))
    store.dispose()
