"""``wildfed-coordinator fleet`` and ``publish-update``: the gateways' health (coordinator/fleet.py) and their SDK.

::

    wildfed-coordinator publish-update [--wheel W]   record a new SDK version for every gateway; the coordinator
                                                     publishes it (coordinator/software_delivery.py)
    wildfed-coordinator fleet [--silent-hours H]     per site: online/offline, last seen, SDK version, model held
                                                     (and whether it is the one released to it), last round trained,
                                                     outbox, photo and detection backlogs, disk free, last error;
                                                     sites not heard from for more than H hours (default 1) flagged

Both work on the database alone (``fleet`` reads what ``run`` or ``service`` stored), so they run beside a running
``service``. Exit status 0 (1 with
``--fail-if-silent`` when a site is silent, for monitoring scripts).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from coordinator.cli.common import config_option, console, friendly, open_state
from shared.errors import ConfigError
from shared.software import MAX_CONFIRM_S

from coordinator.config import load_config
from coordinator.fleet import DEFAULT_SILENT_AFTER_S, FleetRow, fleet_rows, format_age, format_gib
from coordinator.software_delivery import DEFAULT_CONFIRM_S

__all__ = ["app"]

app = typer.Typer()


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _model(row: FleetRow) -> str:
    rec = row.record
    if rec is None or rec.model_round is None:
        return "-"
    mark = {True: " (released)", False: " (behind)", None: ""}[row.model_current]
    return f"r{rec.model_round} {rec.model_hash[:12]}{mark}"


def _state(row: FleetRow) -> str:
    state = row.presence or "unknown"
    if row.silent:
        return f"[red]{state}, silent {format_age(row.silent_s)}[/]" if row.silent_s is not None else \
            "[red]never heard[/]"
    return state


@app.command()
@friendly
def fleet(config: Path = config_option(),
          silent_hours: float = typer.Option(DEFAULT_SILENT_AFTER_S / 3600, "--silent-hours",
                                             help="flag a site not heard from for more than this many hours"),
          fail_if_silent: bool = typer.Option(False, "--fail-if-silent",
                                              help="exit with status 1 when a site is silent (monitoring)")) -> None:
    """Each gateway's health: presence, last seen, SDK version, model, last round, backlogs, disk free, last
    error; sites silent for more than --silent-hours are flagged."""
    cfg = load_config(config)
    store, registry, _ = open_state(cfg)
    try:
        rows = fleet_rows(store, registry, silent_after_s=silent_hours * 3600)
    finally:
        store.dispose()
    now = _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None)
    silent = [r.site_id for r in rows if r.silent]
    console.print(f"federation [bold]{escape(cfg.federation_id)}[/]: {len(rows)} gateway(s), "
                  f"{sum(r.presence == 'online' for r in rows)} online, {len(silent)} silent "
                  f"(nothing heard for more than {silent_hours:g} h) at {now.isoformat(timespec='seconds')}Z")
    table = Table(title="fleet")
    for col in ("site", "state", "last seen", "SDK", "model", "last round", "outbox", "photos waiting",
                "records waiting", "disk free", "last error"):
        table.add_column(col, overflow="fold")
    for row in rows:
        rec = row.record
        error = ""
        if rec is not None and rec.last_error:
            at = _dt.datetime.fromtimestamp(rec.last_error_at or 0, tz=_dt.timezone.utc).replace(tzinfo=None)
            error = f"{format_age((now - at).total_seconds())} ago: {rec.last_error}"
        table.add_row(escape(row.site_id), _state(row),
                      "never" if row.last_seen is None else f"{format_age(row.silent_s)} ago",
                      escape(rec.sdk_version) if rec else "-", _model(row),
                      "-" if rec is None else ("none" if rec.last_round < 0 else str(rec.last_round)),
                      _count(rec.outbox_backlog if rec else None), _count(rec.incoming_backlog if rec else None),
                      _count(rec.detection_backlog if rec else None),
                      format_gib(rec.disk_free_bytes if rec else None), escape(error))
    console.print(table)
    unreported = [r.site_id for r in rows if r.record is None and r.last_seen is not None]
    if unreported:
        console.print(f"no health record yet from {', '.join(unreported)}: one comes at each (re)connect, when a "
                      "gateway keeps a new model and every health_interval_s (a record sent before this coordinator's "
                      "first start is not kept)")
    if silent:
        console.print(f"[red]silent: {', '.join(silent)}[/] (check the gateway, its power and its link; "
                      "`journalctl -u wildfed-edge` on it)")
    if fail_if_silent and silent:
        raise typer.Exit(code=1)


@app.command("publish-update")
@friendly
def publish_update(config: Path = config_option(),
                   wheel: Path | None = typer.Option(None, "--wheel", help="the SDK wheel wildfed-<version>-*.whl "
                                                     "(default: build it from this coordinator's source)"),
                   with_wheels: Path | None = typer.Option(None, "--with-wheels", help="a folder of dependency "
                                                           "wheels to ship too (gateways without a package index)"),
                   confirm_within: int = typer.Option(DEFAULT_CONFIRM_S, "--confirm-within", min=1, max=MAX_CONFIRM_S,
                                                      help="seconds the new version has, from its start, to reach "
                                                      "the broker before a gateway rolls back")) -> None:
    """Publish a new SDK version to every gateway (signed, retained): each installs it beside the running one,
    checks it (check-config), switches, and rolls back when it fails its check or does not come back in time
    (docs/gateways.md, "Updating the gateways"). The running coordinator publishes it at its next look at the
    schedule (at its next start when none runs)."""
    from coordinator.provisioning import build_sdk_wheel
    from coordinator.software_delivery import describe, record_release

    cfg = load_config(config)
    if wheel is None:
        with console.status("building the SDK wheel from this coordinator's source"):
            wheel = build_sdk_wheel(Path(cfg.data_dir) / "wheels")
    if not wheel.is_file():
        raise ConfigError("wheel file not found", source=wheel, field="wheel", fix="pass the path of a .whl file")
    files = {wheel.name: wheel.read_bytes()}
    if with_wheels is not None:
        if not with_wheels.is_dir():
            raise ConfigError("not a folder", source=with_wheels, field="with_wheels", fix="pass a folder of .whl "
                              "files (pip download on a connected machine of the gateways' platform)")
        files.update({p.name: p.read_bytes() for p in sorted(with_wheels.glob("*.whl")) if p.name != wheel.name})
    store, _, _ = open_state(cfg)
    try:
        recorded = record_release(store, Path(cfg.data_dir), federation_id=cfg.federation_id, wheels=files,
                                  confirm_within_s=confirm_within)
    finally:
        store.dispose()
    console.print(escape(f"recorded SDK {describe(recorded)}"))
    console.print("the coordinator publishes it to every enrolled gateway at its next look at the schedule (or "
                  "its next start); `wildfed-coordinator fleet` shows each gateway's SDK version as it moves")
