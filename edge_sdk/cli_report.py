"""``wildfed-edge check-config``'s report on a camera site's training records: records per species and IUCN
category, and each category's best-case signal against its noise (:mod:`edge_sdk.field.training_report`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["print_training_report"]


def print_training_report(out: Console, site_yaml: Path) -> None:
    """Print the report for the site config at ``site_yaml`` (a camera site whose package loads; radio sites and
    packages that do not load print nothing: check-config lists those problems already)."""
    from shared.errors import ConfigError

    from edge_sdk.config import load_site_config
    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from edge_sdk.field.training_report import category_signals, species_counts

    cfg = load_site_config(site_yaml)
    if cfg.task != "camera":
        return
    try:
        data = load_camtrap_dp(cfg.dataset, cfg.species_table, missing_media=cfg.missing_media, train_on=cfg.train_on,
                               machine_threshold=cfg.machine_threshold)
    except ConfigError:
        return
    table = Table(title=escape(f"training records (train_on: {cfg.train_on}; {len(data)} in all)"))
    for col in ("species", "IUCN", "records"):
        table.add_column(col, justify="right" if col == "records" else "left")
    for row in species_counts(cfg, data):
        table.add_row(escape(row.scientific_name), row.category.value, str(row.records))
    out.print(table)
    if not len(data):
        out.print("[yellow]no training records yet:[/] rounds are refused until rangers verify photos "
                  "(wildfed-edge review) or the package holds human labels (wildfed-edge package)")
        return
    try:
        rows, source = category_signals(cfg, data)
    except ConfigError as exc:
        out.print(f"[yellow]signal-to-noise not computed:[/] {escape(str(exc))}")
        return
    out.print(escape(f"best-case signal against noise per IUCN category, for {source}:"))
    for row in rows:
        style = "green" if row.learns else "yellow"
        out.print(f"  [{style}]{'ok' if row.learns else 'warning'}[/] {escape(row.describe())}")
