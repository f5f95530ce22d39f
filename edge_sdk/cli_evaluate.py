"""``wildfed-edge evaluate``: how well the model a gateway keeps names labelled photos, per species.

The photos are the training records of a Camtrap DP package (its labelled, verified photos, each embedded as its
crops exactly as training and ``detect`` embed them): by default the site's own package, which the model was
trained on (so the figure is optimistic), or ``--package`` another site's labelled package (a held-out test).
Each record is named by the arg-max of the kept model (post-hoc logit adjustment included, as ``detect`` uses it)
and read as the field loop reads it (the site prior, the confidence threshold: a name below it is "unknown").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["evaluate"]


def evaluate(
    config: Annotated[Path, typer.Option("--config", "-c", help="the site config")],
    package: Annotated[Optional[Path], typer.Option(help="score another labelled Camtrap DP package (held out) "
                                                         "instead of the site's own")] = None,
    weights: Annotated[Optional[Path], typer.Option(help="a global model .safetensors (default: the one the "
                                                         "gateway keeps)")] = None,
) -> None:
    """Score the model this gateway keeps on labelled photos, per species: the site's own package (optimistic: it
    trained on them), or --package a held-out one (docs/field-loop.md)."""
    import numpy as np

    from shared.errors import WildFedError

    from edge_sdk.config import global_model_path, load_site_config
    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from edge_sdk.data.embedding import embed_dataset
    from edge_sdk.cli_common import error
    from edge_sdk.field.predictions import site_reader
    from edge_sdk.global_model import KeptModel
    from edge_sdk.inference.classifier import head_logits
    from edge_sdk.site_paths import embedding_cache_dir

    out = Console()
    try:
        cfg = load_site_config(config)
        source = package or cfg.dataset
        model = KeptModel.load(weights or global_model_path(cfg), backbone_id=cfg.backbone_id)
        if model is None:
            raise typer.BadParameter("this gateway keeps no global model yet (it arrives with the first task); "
                                     "pass --weights FILE")
        data = load_camtrap_dp(source, cfg.species_table, missing_media="skip")
        data = embed_dataset(data, embedding_cache_dir(cfg), input_size=cfg.embedding_input_size,
                             backbone=cfg.backbone, threads=cfg.threads)
    except WildFedError as exc:
        error(exc)
        raise typer.Exit(code=2) from None
    logits = head_logits(model.weights, data.features).astype(np.float64) if len(data) else np.zeros((0, 1))
    read = site_reader(cfg)
    names = cfg.names_by_class
    totals: Counter[int] = Counter(int(y) for y in data.labels)
    argmax_ok: Counter[int] = Counter()
    named_ok: Counter[int] = Counter()
    unknown: Counter[int] = Counter()
    for row, y in zip(logits, data.labels):
        p = np.exp(row - row.max())
        p /= p.sum()
        argmax_ok[int(y)] += int(np.argmax(p) == y)
        reading = read(p)
        named_ok[int(y)] += int(reading.named and reading.index == y)
        unknown[int(y)] += int(not reading.named)
    what = "held-out package" if package else "the site's own training records: optimistic"
    table = Table(title=escape(f"model of round {model.round} on {source} ({what})"))
    for col in ("species", "records", "arg-max right", "named right", "unknown"):
        table.add_column(col, justify="left" if col == "species" else "right")
    for k in sorted(totals, key=lambda c: names.get(c, "")):
        table.add_row(escape(names.get(k, f"class_{k}")), str(totals[k]), str(argmax_ok[k]), str(named_ok[k]),
                      str(unknown[k]))
    n = sum(totals.values())
    table.add_row("[bold]all[/]", str(n), str(sum(argmax_ok.values())), str(sum(named_ok.values())),
                  str(sum(unknown.values())))
    out.print(table)
    if n:
        out.print(f"chance: {n / max(1, len(totals)):.1f} of {n} (one species in {len(totals)}); 'named right' reads "
                  f"the model as the field loop does (threshold {cfg.field.confidence_threshold:g}, site prior)")
