"""``wildfed-coordinator places``: the web view's protected places for operators (coordinator/web/places.py).

::

    wildfed-coordinator places list                               every place: members, protection, why, lifts
    wildfed-coordinator places lift ID [ID ...] --reason TEXT     lift earned protection (recorded: who, when, why)
                                             [--by NAME]

Protection a place earned is never lifted by an import (issue 16, item 8); ``lift`` is the one way, and it is
kept on the place's row (``lifted_by``, ``lifted_at``, ``lift_reason``, shown by ``list``) and logged. A place
whose data still records a sensitive species earns protection again at once: ``lift`` says so. Both commands work
on the database alone, so they can run while ``serve`` runs.
"""

from __future__ import annotations

import getpass
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from coordinator.config import load_config
from coordinator.storage import Store

__all__ = ["places_app"]

console = Console()
places_app = typer.Typer(name="places", help="The web view's protected places: list them, lift protection.",
                         no_args_is_help=True, add_completion=False)


def _config_option() -> Path:
    from coordinator.cli import _config_option as option

    return option()


def _evaluate(config: Path):  # noqa: ANN202 - (store, Protection)
    """Open the store and evaluate protection with the config's policy (records what the data earned)."""
    from coordinator.web.deployments import species_table_categories
    from coordinator.web.places import evaluate
    from coordinator.web.views import policy_from_config

    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    with store.session() as s:
        protection = evaluate(s, policy_from_config(cfg), species_table_categories(cfg.species))
    return store, protection


def _state(p) -> str:  # noqa: ANN001 - Place
    if p.earned:
        return "earned"
    return "lifted" if p.lifted_at is not None else "neighbour"


@places_app.command("list")
def list_command(config: Path = _config_option()) -> None:
    """List every protected place: its deployments, whether its protection is earned, why, and any lift."""
    from coordinator.cli import _friendly
    from coordinator.web.places import list_places

    @_friendly
    def body() -> None:
        store, protection = _evaluate(config)
        try:
            places = list_places(store)
        finally:
            store.dispose()
        shown = {p.place_id for p in protection.place_of.values()}
        table = Table(title=f"{len(places)} place(s)")
        for col in ("place", "anchor (true)", "deployments", "protection", "shown fuzzed", "why", "lifted"):
            table.add_column(col)
        for p in places:
            lifted = (f"{p.lifted_at:%Y-%m-%d %H:%M}Z by {p.lifted_by}: {p.lift_reason}" if p.lifted_at else "")
            table.add_row(str(p.place_id), f"{p.latitude:.6f}, {p.longitude:.6f}", escape(", ".join(p.members)),
                          _state(p), "yes" if p.place_id in shown else "no", escape(p.earned_reason), escape(lifted))
        console.print(table)

    body()


@places_app.command("lift")
def lift_command(place_ids: list[int] = typer.Argument(..., help="place ids (`places list`)"),
                 reason: str = typer.Option(..., "--reason", help="why the protection is lifted (kept on record)"),
                 by: str = typer.Option("", "--by", help="who lifts it (default: the login name)"),
                 config: Path = _config_option()) -> None:
    """Lift the earned protection of places; recorded (who, when, why) and logged. A place whose data still
    records a sensitive species is protected again at once."""
    from coordinator.cli import _friendly, err_console
    from coordinator.web.places import lift

    @_friendly
    def body() -> None:
        cfg = load_config(config)
        store = Store(cfg.database_url or "", cfg.data_dir)
        try:
            lifted = lift(store, place_ids, by=by or getpass.getuser(), reason=reason)
        finally:
            store.dispose()
        store, protection = _evaluate(config)  # what the data still calls for
        store.dispose()
        again = {p.place_id: p for p in protection.place_of.values() if p.earned}
        for p in lifted:
            console.print(f"[green]lifted[/] place {p.place_id} ({escape(', '.join(p.members))}) by "
                          f"{escape(p.lifted_by)}: {escape(p.lift_reason)}")
            if p.place_id in again:
                err_console.print(f"[yellow]warning:[/] place {p.place_id} is protected again: "
                                  f"{escape(again[p.place_id].earned_reason)} (fix: correct the data or the "
                                  "species table first, then lift it)")

    body()
