"""What the ``wildfed-edge`` command modules share: the stderr console, a one-line error and the logging setup."""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

__all__ = ["console", "error", "setup_logging"]

console = Console(stderr=True)


def error(message: object) -> None:
    """Print ``error: <message>`` to stderr; the message is escaped, so ``[...]`` in an exception or a path (an
    extra such as ``wildfed[torch]``) is shown, not taken for rich markup."""
    console.print(f"[bold red]error:[/] {escape(str(message))}", soft_wrap=True)  # one line, whatever the width


def setup_logging(level: str) -> None:
    """Log at ``level`` (DEBUG, INFO, WARNING, ERROR) through rich on stderr."""
    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, rich_tracebacks=False, show_path=False)], force=True)
