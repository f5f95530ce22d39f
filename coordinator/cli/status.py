"""``wildfed-coordinator status``: rounds, accepted updates, rejections by reason, detection records, halted
categories and why, the models retained by digest, and each gateway's link with the round mode it fits.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from coordinator.buffered_store import buffer_counts
from coordinator.cli.common import config_option, console, friendly, open_state
from coordinator.config import CoordinatorConfig, load_config
from coordinator.detections import DetectionCounts
from coordinator.ledger_streams import base_site
from coordinator.model_digests import STATE_KEY as DIGESTS_KEY
from coordinator.selection import known_categories
from coordinator.service import status_report

__all__ = ["app"]

app = typer.Typer()


@app.command()
@friendly
def status(config: Path = config_option()) -> None:
    """Rounds, accepted updates, rejections counted by reason, and halted categories per site with the reason."""
    cfg = load_config(config)
    store, registry, ledger = open_state(cfg)
    try:
        rep = status_report(store, registry)
        halts = ledger.halts()
        left = [site.site_id for site in registry.list()
                if (known := known_categories(site, ledger)) and known <= ledger.halted(site.site_id)]
        site_ids = [site.site_id for site in registry.list()]
        buffer = buffer_counts(store) if cfg.buffered is not None else None
        digests = store.get_state(DIGESTS_KEY) or {}  # {digest: {"round", "chunks"}}: retained by digest now
    finally:
        store.dispose()
    console.print(f"federation [bold]{escape(cfg.federation_id)}[/]: {rep.sites} site(s), {len(rep.rounds)} round(s), "
                  f"{rep.accepted} accepted update(s), model {(rep.model_hash or '-')[:12]}")
    if site_ids:
        shown = ", ".join(site_ids[:30]) + (f", ... (+{len(site_ids) - 30})" if len(site_ids) > 30 else "")
        console.print(f"enrolled sites: {shown}")
    table = Table(title="rounds")
    for col in ("round", "status", "accepted", "new model", "privacy", "note"):
        table.add_column(col, overflow="fold")
    for r, st, n, h in rep.rounds:
        mode, detail = rep.details.get(r, (None, None))
        table.add_row(str(r), escape(st), str(n), (h or "-")[:12], escape(mode or "-"), escape(detail or ""))
    console.print(table)
    if buffer is not None:
        console.print(f"buffered rounds (K={cfg.buffered.buffer_size}, max_staleness {cfg.buffered.max_staleness}): "
                      f"{buffer[1]} stale update(s) folded, {buffer[0]} waiting for the next close")
    if digests:
        newest = max(digests.items(), key=lambda kv: int(kv[1]["round"]))
        later = ("" if rep.model_hash in (None, newest[0]) else
                 f"; the current model {rep.model_hash[:12]} went to the gateways as a release, and is published "
                 "by digest only when a round's tasks train from it")
        console.print(f"models by digest: {len(digests)} retained on the broker, the newest {newest[0][:12]} (the "
                      f"model round {newest[1]['round']}'s tasks trained from){later}; one is cleared once no task of "
                      f"the last {cfg.transfer.model_retention_rounds} round(s) named it")
    if cfg.strategy.kind == "nira":
        console.print("strategy NIRA: see `wildfed-coordinator clusters show` for the clusters and their changes")
    rej = Table(title="rejections by reason")
    rej.add_column("reason")
    rej.add_column("count", justify="right")
    for reason, n in sorted(rep.rejections.items()):
        rej.add_row(escape(reason), str(n))
    if not rep.rejections:
        rej.add_row("(none)", "0")
    console.print(rej)
    if rep.detections is not None:
        _print_detections(rep.detections)
    hal = Table(title="halted categories (records no longer sampled; under record-level budgets, per cohort: "
                      "the latest halt of each site and category, with how many cohorts have spent it)")
    for col in ("site", "category", "from round", "why"):
        hal.add_column(col, overflow="fold")
    latest: dict[tuple[str, str], tuple[object, int]] = {}
    for h in halts:  # a cohort's halt names its stream (site@c<round>): one row per site and category
        key = (base_site(h.site_id), h.category.value)
        prev = latest.get(key)
        latest[key] = (h if prev is None or h.round >= prev[0].round else prev[0], (prev[1] if prev else 0) + 1)
    for (site_id, cat), (h, n) in sorted(latest.items()):
        where = "" if h.site_id == site_id else f"{n} cohort(s); latest cohort {h.site_id.rsplit('@c', 1)[1]}: "
        hal.add_row(site_id, cat, str(h.round), escape(where + (h.reason or "(no reason recorded)")))
    if not halts:
        hal.add_row("(none)", "-", "-", "-")
    console.print(hal)
    for site_id in left:
        console.print(f"[red]site {site_id} has every category halted: it is no longer selected[/]")
    _print_links(cfg, site_ids)


def _print_links(cfg: CoordinatorConfig, site_ids: list[str]) -> None:
    """The links table of ``status`` (coordinator/link_stats.py): each site's online fraction and offline gaps over
    the last 7 days, as the coordinator heard its presence, and what to change for them."""
    from coordinator.link_stats import DEFAULT_WINDOW_S, duration_text, fleet_link_stats, link_advice
    from coordinator.storage import Store, utcnow

    store = Store(cfg.database_url, cfg.data_dir)
    try:
        stats = fleet_link_stats(store, site_ids, now=utcnow())
    finally:
        store.dispose()
    known = [s for s in stats if s.online_fraction is not None]
    if not known:
        return
    table = Table(title=f"links over the last {DEFAULT_WINDOW_S / 86400:.0f} days (presence heard by the coordinator; "
                        "advisory)")
    for col in ("site", "online", "offline gaps", "longest gap", "90th pct gap"):
        table.add_column(col, justify="left" if col == "site" else "right")
    for st in known:
        table.add_row(escape(st.site_id), f"{st.online_fraction:.0%}", str(len(st.gaps_s)),
                      duration_text(st.longest_gap_s), duration_text(st.gap_p90_s))
    console.print(table)
    advice = link_advice(stats, privacy=cfg.privacy, round_deadline_s=cfg.round_deadline_s,
                         secagg_threshold=cfg.secagg.threshold, buffered=cfg.buffered is not None)
    for line in advice:
        console.print(f"[yellow]links:[/] {escape(line)}")
    if not advice:
        console.print("links: the round mode in use fits these links, nothing to change (docs/transport.md, "
                      "\"Intermittent links\")")


def _print_detections(counts: DetectionCounts) -> None:
    """The detection records table of ``status``: rows held, what each gateway delivery did, refusals by reason."""
    table = Table(title=f"detection records: {counts.rows} stored ({counts.from_gateways} from gateways, "
                        f"{counts.rows - counts.from_gateways} imported)")
    table.add_column("gateway deliveries")
    table.add_column("count", justify="right")
    meaning = {"stored": "stored (a new record)", "duplicate": "duplicate (delivered again: nothing written)",
               "replaced": "replaced (a newer record of the same photo)", "stale": "stale (older: ignored)"}
    for outcome, n in counts.outcomes.items():
        table.add_row(meaning.get(outcome, outcome), str(n))
    for reason, n in sorted(counts.refused.items()):
        table.add_row(f"refused: {escape(reason)}", f"[red]{n}[/]")
    console.print(table)


#: ``budget --help``: one line per paragraph (typer keeps a docstring's line breaks after its first paragraph).
