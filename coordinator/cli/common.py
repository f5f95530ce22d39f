"""What every group of ``wildfed-coordinator`` commands shares: the consoles, the ``--config`` option, the error
presentation (:func:`friendly`), the federation's state for one command, and the parsing of shared options.

It imports no command module (they import it), so the package has no import circle.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from shared.errors import ConfigError, WildFedError

from coordinator.config import CoordinatorConfig
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import Store

__all__ = ["DEFAULT_CONFIG", "console", "err_console", "config_option", "friendly", "open_state", "parse_metadata",
           "parse_utc_offset", "warn_plain_http"]


F = TypeVar("F", bound=Callable[..., Any])
#: The config file name ``init`` writes and every other command reads by default.
DEFAULT_CONFIG = "coordinator.yaml"

#: Columns of the consoles when their stream is not a terminal and ``$COLUMNS`` is not set (rich would assume 80
#: and cut rules, titles and table cells in a log file or a pipe).
PIPE_WIDTH = 160


def _console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr): the terminal's width on a terminal, ``$COLUMNS`` where set, else
    :data:`PIPE_WIDTH` columns."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        tty = False
    width = None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(stderr=stderr, width=width)


#: Where the commands print (tests swap them for wide consoles).
console = _console()
err_console = _console(stderr=True)


def config_option() -> Any:
    """The ``--config`` / ``-c`` option every command but ``init`` takes: the coordinator's YAML config, by default
    ``$WILDFED_COORDINATOR_CONFIG`` or ``./coordinator.yaml`` (read when the command module is imported)."""
    return typer.Option(Path(os.environ.get("WILDFED_COORDINATOR_CONFIG", DEFAULT_CONFIG)), "--config", "-c",
                        help="coordinator YAML config")


def friendly(fn: F) -> F:
    """Turn WildFed's typed errors into one red line and exit status 2 (anything else is a bug: traceback)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WildFedError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(code=2) from exc

    return wrapper  # type: ignore[return-value]


def warn_plain_http(host: str, tls: bool) -> None:
    """Warn (stderr) when the web view would serve plain HTTP on an address other than loopback."""
    if not tls and host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/] serving plain HTTP on {escape(host)}: passwords and session cookies "
                          "cross the network in the clear, and browsers drop Secure cookies over HTTP. Put a TLS "
                          "proxy in front or set web.tls_cert_file and web.tls_key_file.")


def parse_utc_offset(text: str) -> Any:
    """The ``--utc-offset`` option: ``+HH:MM`` or ``-HH:MM`` (``Z`` for UTC) as a :class:`datetime.timezone`.

    Raises:
        ConfigError: not that form, or outside UTC-12:00 .. UTC+14:00.
    """
    import datetime as _dt
    import re

    value = (text or "").strip()
    if value.upper() in ("Z", "UTC"):
        return _dt.timezone.utc
    m = re.fullmatch(r"([+-])([0-9]{2}):?([0-9]{2})", value)
    fix = "give the camera clock's offset from UTC as +HH:MM or -HH:MM, e.g. --utc-offset -05:00"
    if m is None:
        raise ConfigError(f"--utc-offset {text!r} is not +HH:MM or -HH:MM", field="utc-offset", fix=fix)
    sign, hours, minutes = (-1 if m.group(1) == "-" else 1), int(m.group(2)), int(m.group(3))
    offset = sign * _dt.timedelta(hours=hours, minutes=minutes)
    if minutes >= 60 or not _dt.timedelta(hours=-12) <= offset <= _dt.timedelta(hours=14):
        raise ConfigError(f"--utc-offset {text!r} is not a UTC offset (-12:00 to +14:00, minutes below 60)",
                          field="utc-offset", fix=fix)
    return _dt.timezone(offset)


def open_state(config: CoordinatorConfig) -> tuple[Store, SiteRegistry, PrivacyLedger]:
    """The federation's state for one command: ``(store, registry, ledger)``; the caller disposes of the store.

    The coordinator's own public key (when written) is reserved in the registry, so that no site can be enrolled
    with it.
    """
    store = Store(config.database_url or "", config.data_dir)
    registry = SiteRegistry(store)
    if config.public_key_path.is_file():  # no site may be enrolled with the coordinator's own key
        from shared.keys import load_public_key

        registry.reserve(load_public_key(config.public_key_path))
    return store, registry, PrivacyLedger(store, target_delta=config.target_delta, accountant=config.accountant,
                                          max_pending=config.pending_rounds_cap())


def parse_metadata(text: str) -> dict[str, Any]:
    """The ``--metadata`` option: a JSON object of public site metadata.

    Raises:
        ConfigError: not JSON, or not an object.
    """
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--metadata is not JSON: {exc}", field="metadata",
                          fix='quote it for the shell: --metadata \'{"capacity": 500}\'') from exc
    if not isinstance(meta, dict):
        raise ConfigError("--metadata must be a JSON object", field="metadata", fix='use {"key": value, ...}')
    return meta
