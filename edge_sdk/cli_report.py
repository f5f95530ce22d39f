"""``wildfed-edge check-config``'s report on a camera site's training records: records per species and IUCN
category, and each category's best-case signal against its noise (:mod:`edge_sdk.field.training_report`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["print_training_report"]


def print_training_report(out: Console, site_yaml: Path, dataset: object | None) -> None:
    """Print the report for the site config at ``site_yaml`` and its training records ``dataset`` (a
    ``LocalDataset``, as check-config loaded it; None: a radio site or a package that did not load, whose problems
    check-config lists already: nothing is printed)."""
    from shared.errors import ConfigError

    from edge_sdk.config import load_site_config
    from edge_sdk.field.training_report import category_signals, species_counts

    cfg = load_site_config(site_yaml)
    if cfg.task != "camera" or dataset is None:
        return
    data = dataset
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
    if not rows:
        out.print(escape(f"signal against noise: {source}"))
        return
    out.print(escape(f"best-case signal against noise per IUCN category, for {source}:"))
    for row in rows:
        style = "green" if row.learns else "yellow"
        out.print(f"  [{style}]{'ok' if row.learns else 'warning'}[/] {escape(row.describe())}")
