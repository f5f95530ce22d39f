"""``wildfed-coordinator`` commands for the rangers' web view: ``serve``, ``user ...``, ``import-deployments``,
``import-detections``, ``export-camtrap-dp``, ``places ...`` (docs/web.md).

::

    wildfed-coordinator serve [--host H] [--port P]    the rangers' web view (FastAPI; docs/web.md)
    wildfed-coordinator user add|list|set-role|set-password|disable|enable
                                                        web-view accounts (Argon2id; coordinator/web/auth.py)
    wildfed-coordinator import-deployments PATH [--site S] [--format camtrap-dp|wildlife-insights]
                                                        one site's deployments for the map
    wildfed-coordinator import-detections FILE --site S --deployment D [--images DIR] [--utc-offset +HH:MM]
                                                        MegaDetector batch output for the web view
    wildfed-coordinator export-camtrap-dp OUT --role R  the detections as a Camtrap DP 1.0 package, as role R sees
                                                        them (sensitive locations fuzzed for partner/public)
    wildfed-coordinator places list                               every place: members, protection, why, lifts
    wildfed-coordinator places lift ID [ID ...] --reason TEXT     lift earned protection (recorded: who, when, why)
                                             [--by NAME]

Protection a place earned is never lifted by an import; ``places lift`` is the one way, and it is
kept on the place's row (``lifted_by``, ``lifted_at``, ``lift_reason``, shown by ``places list``) and logged. A place
whose data still records a sensitive species earns protection again at once: ``lift`` says so. ``user`` and
``places`` work on the database alone, so they can run while ``serve`` runs.
"""

from __future__ import annotations

import getpass
import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.errors import ConfigError

from coordinator.cli.common import config_option, console, err_console, friendly, parse_utc_offset, warn_plain_http
from coordinator.cli.users import user_app
from coordinator.config import load_config
from coordinator.storage import Store

__all__ = ["app", "user_app", "places_app"]

app = typer.Typer()


@app.command()
@friendly
def serve(config: Path = config_option(),
          host: str | None = typer.Option(None, help="address to listen on (default: web.host, 127.0.0.1)"),
          port: int | None = typer.Option(None, help="TCP port (default: web.port, 8080)")) -> None:
    """Serve the rangers' web view (map, detections, species, sites; budgets and rounds for operators) until
    interrupted. Make accounts first with `user add`; docs/web.md. Listens on the config's web.host and web.port
    (defaults 127.0.0.1 and 8080: http://127.0.0.1:8080/); --host and --port override them. For HTTPS set
    web.tls_cert_file and web.tls_key_file (PEM files) in the config; without them it serves plain HTTP, safe only
    on loopback or behind a TLS proxy."""
    from coordinator.web.app import serve as serve_web

    cfg = load_config(config)
    where = host or cfg.web.host
    scheme = "https" if cfg.web.tls_cert_file else "http"
    warn_plain_http(where, scheme == "https")
    console.print(escape(f"web view on {scheme}://{where}:{port or cfg.web.port}/ (Ctrl-C stops it)"))
    serve_web(cfg, host=host, port=port)


@app.command("import-deployments")
@friendly
def import_deployments(path: Path = typer.Argument(..., help="a Camtrap DP package folder or a Wildlife Insights "
                                                   "project export folder"),
                       source: str = typer.Option("camtrap-dp", "--format", help="camtrap-dp or wildlife-insights"),
                       site: str | None = typer.Option(None, "--site", help="the enrolled site the package belongs "
                                                       "to (may be left out while exactly one site is enrolled)"),
                       coordinates_only: bool = typer.Option(False, "--coordinates-only", help="read only the "
                                                             "deployments table: no species or categories (for a "
                                                             "package of a site's training records)"),
                       config: Path = config_option()) -> None:
    """Import one site's deployments (coordinates and the IUCN categories of what they recorded, from the config's
    species table) for the web view's map; sensitive ones are shown fuzzed to partners (docs/location-privacy.md).
    Deployments are keyed by site: another site's deployment of the same id keeps its own coordinates. With
    --coordinates-only the species come from detection records alone (a gateway's own package holds its training
    records, which the map must not publish)."""
    from coordinator.web.deployments import (import_camtrap_dp, import_wildlife_insights, resolve_site,
                                             species_table_categories, unknown_species)

    cfg = load_config(config)
    importer = {"camtrap-dp": import_camtrap_dp, "wildlife-insights": import_wildlife_insights}.get(source)
    if importer is None:
        raise ConfigError(f"format {source!r} is unknown", field="--format", fix="use camtrap-dp or wildlife-insights")
    from coordinator.web.views import policy_from_config

    category_of = species_table_categories(cfg.species)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:  # with the policy: protection the stored data earned is kept (docs/location-privacy.md)
        site_id = resolve_site(store, site)
        skipped: list[str] = []
        extra = {"skipped": skipped} if source == "camtrap-dp" else {}
        n = importer(store, path, category_of, site_id=site_id, policy=policy_from_config(cfg),
                     species=not coordinates_only, **extra)
        # the importer's source string (coordinator.web.deployments): "<format>:<folder name>"
        unknown = unknown_species(store, category_of, source=f"{source}:{Path(path).name}", site_id=site_id)
    finally:
        store.dispose()
    console.print(f"[green]imported[/] {n} deployment(s) of site {escape(site_id)} from {escape(str(path))}")
    if skipped:
        err_console.print(f"[yellow]not on the map yet:[/] {len(skipped)} deployment(s) have no coordinates: "
                          f"{escape(', '.join(skipped))} (fix: give them in the gateway's site.yaml, field.deployments,"
                          " or in deployments.csv, and import again)")
    if unknown:
        names = ", ".join(f"{escape(name)} ({k} deployment{'s' * (k != 1)})" for name, k in unknown.items())
        if getattr(cfg.web, "unknown_species", "protect") == "ne":
            effect = ("they count as NE (web.unknown_species: ne), so the web view shows the places that recorded "
                      "them exactly to partners and the public, until you add them")
        else:
            effect = ("the web view protects the places that recorded them (web.unknown_species: protect) until "
                      "you add them")
        err_console.print(f"[yellow]warning:[/] {len(unknown)} species {'is' if len(unknown) == 1 else 'are'} not "
                          f"in the species table; {effect} to `species:` with their IUCN category: {names}")


@app.command("import-detections")
@friendly
def import_detections(path: Path = typer.Argument(..., help="a MegaDetector batch output .json (format 1.x)"),
                      site: str = typer.Option(..., "--site", help="the enrolled site the images come from"),
                      deployment: str = typer.Option(..., "--deployment", help="the Camtrap DP deployment (camera "
                                                     "placement) of every image in the file"),
                      images: Path | None = typer.Option(None, "--images", help="the folder the detector ran on: "
                                                         "images found there are stored for the web view (never "
                                                         "those with a person or vehicle)"),
                      utc_offset: str = typer.Option("+00:00", "--utc-offset", help="the camera clock's offset from "
                                                     "UTC as +HH:MM or -HH:MM, for capture times written without "
                                                     "one (e.g. -05:00)"),
                      config: Path = config_option()) -> None:
    """Import detections from a MegaDetector results file for the web view (coordinator/web/megadetector_import.py);
    the whole file is checked before anything is written, and re-importing it changes nothing. Import the deployment's
    coordinates with `import-deployments` too: without them the map cannot place its records and
    `export-camtrap-dp` leaves them out."""
    from coordinator.storage import DeploymentRow
    from coordinator.web.deployments import species_table_categories
    from coordinator.web.formats import import_megadetector
    from coordinator.web.views import policy_from_config

    zone = parse_utc_offset(utc_offset)
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        with Progress(TextColumn("importing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("import", total=None)
            summary = import_megadetector(store, path, site_id=site, deployment_id=deployment, images_dir=images,
                                          category_of=species_table_categories(cfg.species), utc_offset=zone,
                                          policy=policy_from_config(cfg),
                                          progress=lambda done, total: bar.update(task, completed=done,
                                                                                  total=total))
        with store.session() as s:
            placed = s.get(DeploymentRow, (site, deployment)) is not None
    finally:
        store.dispose()
    console.print(f"[green]imported[/] {summary.images} image(s) from {escape(str(path))}: {summary.stored} new, "
                  f"{summary.replaced} replaced, {summary.unchanged} unchanged, {summary.kept_gateway} kept "
                  f"(gateway rows), {summary.duplicates} duplicate(s), {summary.failures} failure(s), "
                  f"{summary.boxes} box(es)")
    if images is not None:
        console.print(f"images: {summary.images_stored} held ({summary.images_new} new), "
                      f"{summary.images_missing} missing, {summary.images_unreadable} unreadable, "
                      f"{summary.images_withheld} withheld (person/vehicle)")
    if summary.categories:
        console.print("boxes per IUCN category: " + ", ".join(f"{k} {v}" for k, v in summary.categories.items()))
    if not placed:
        err_console.print(f"[yellow]warning:[/] deployment {escape(repr(deployment))} of site {escape(site)} is not "
                          "in the deployments table: its records have no coordinates, so the map cannot place them "
                          "and export-camtrap-dp leaves them out (fix: import the site's deployments: "
                          f"`wildfed-coordinator import-deployments PATH --site {escape(site)}`, from the Camtrap DP "
                          "package or Wildlife Insights export that lists it; the records are placed as soon as it "
                          "is there)")


@app.command("export-camtrap-dp")
@friendly
def export_camtrap_dp_command(out_dir: Path = typer.Argument(..., help="folder for the Camtrap DP package"),
                              role: str = typer.Option(..., "--role", help="operator or ranger (exact locations), "
                                                       "partner or public (sensitive locations fuzzed, their "
                                                       "times cut to dates)"),
                              config: Path = config_option()) -> None:
    """Export the detections as a Camtrap DP 1.0 package, as the given role sees them in the web view."""
    from coordinator.web.auth import Role
    from coordinator.web.formats import export_camtrap_dp
    from coordinator.web.views import Viewer

    try:
        viewer_role = Role(role.strip().lower())
    except ValueError:
        raise ConfigError(f"role {role!r} is unknown", field="--role",
                          fix=f"use one of {[r.value for r in Role]}") from None
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    try:
        viewer = Viewer.for_config(store, viewer_role, cfg)
        with console.status("exporting"):
            package = export_camtrap_dp(viewer, out_dir)
    finally:
        store.dispose()
    console.print(f"[green]wrote[/] {escape(str(package))} (as {viewer_role.value})")
    extra = json.loads(package.read_text(encoding="utf-8")).get("wildfed", {})
    left_out, unplaced = int(extra.get("recordsLeftOut", 0)), list(extra.get("unplacedDeployments", []))
    if left_out:
        err_console.print(f"[yellow]warning:[/] {left_out} record(s) left out: their deployment(s) "
                          f"{escape(', '.join(map(str, unplaced)))} have no coordinates (Camtrap DP requires them; "
                          "fix: `wildfed-coordinator import-deployments PATH` for them, then export again)")


app.add_typer(user_app, name="user")
places_app = typer.Typer(name="places", help="The web view's protected places: list them, lift protection.",
                         no_args_is_help=True, add_completion=False)
app.add_typer(places_app, name="places")


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


def _state(p, shown: dict[str, int]) -> str:  # noqa: ANN001 - Place
    """The protection column: earned / lifted / neighbour (of which places) / none, and whether it is shown."""
    if p.earned:
        return "earned"
    others = sorted({q for q in shown.values() if q != p.place_id})
    if others:
        return f"neighbour of {', '.join(map(str, others))}"
    if shown:
        return "neighbour"
    return "lifted" if p.lifted_at is not None else "none"


@places_app.command("list")
@friendly
def places_list(config: Path = config_option()) -> None:
    """List every protected place: its deployments, whether its protection is earned, why, and any lift.

    A table of four columns that fits 80 columns (ids fold onto further lines, never cut), then one line per
    place for why it earned protection and any lift."""
    from rich.text import Text

    from coordinator.web.places import list_places, shown_by

    store, protection = _evaluate(config)
    try:
        places = list_places(store)
    finally:
        store.dispose()
    table = Table(title=f"{len(places)} place(s)")
    table.add_column("place", no_wrap=True, justify="right")
    table.add_column("anchor (true)", no_wrap=True)
    table.add_column("protection", overflow="fold", min_width=9)
    table.add_column("deployments (shown fuzzed)", overflow="fold", ratio=1)
    notes = []
    for p in places:
        shown = shown_by(protection, p)
        members = ", ".join(p.members) or "-"
        table.add_row(str(p.place_id), f"{p.latitude:.6f}, {p.longitude:.6f}", Text(_state(p, shown)),
                      Text(f"{members} ({len(shown)} of {len(p.members)})"))
        if p.earned_reason:
            notes.append(f"place {p.place_id}: {'earned' if p.earned else 'was earned'}: {p.earned_reason}")
        if p.lifted_at:
            notes.append(f"place {p.place_id}: lifted {p.lifted_at:%Y-%m-%d %H:%M}Z by {p.lifted_by}: "
                         f"{p.lift_reason}")
    console.print(table)
    for line in notes:
        console.print(Text(line))


@places_app.command("lift")
@friendly
def places_lift(place_ids: list[int] = typer.Argument(..., help="place ids (`places list`)"),
                reason: str = typer.Option(..., "--reason", help="why the protection is lifted (kept on record)"),
                by: str = typer.Option("", "--by", help="who lifts it (default: the login name)"),
                config: Path = config_option()) -> None:
    """Lift the earned protection of places; recorded (who, when, why) and logged. A place whose data still
    records a sensitive species is protected again at once."""
    from coordinator.web.places import lift, shown_by

    store, before = _evaluate(config)  # which places protect which (a neighbour's place has nothing to lift)
    try:
        lifted = lift(store, place_ids, by=by or getpass.getuser(), reason=reason, protection=before)
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
            continue
        still = {d: q for d, q in shown_by(protection, p).items() if q != p.place_id}
        if still:
            err_console.print(f"[yellow]warning:[/] {escape(', '.join(sorted(still)))} of place {p.place_id} "
                              f"are still shown fuzzed, as neighbours of place "
                              f"{', '.join(map(str, sorted(set(still.values()))))} (fix: lift that place too)")
