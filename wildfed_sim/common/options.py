"""The experiments' own command lines (``wildfed experiment fedsofim``, ``... radiomap``): typer options and
comma-separated lists."""

from __future__ import annotations

from typing import Any

from shared.errors import ConfigError

__all__ = ["opt", "parse_list"]


def parse_list(text: str, kind: type, name: str, example: str) -> tuple:
    """``"1,2,3"`` as a tuple of ``kind`` (empty items skipped).

    Raises:
        ConfigError: an item is not a ``kind``, or the list is empty (naming ``--name`` and an example).
    """
    try:
        values = tuple(kind(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--{name} {text!r} is not a comma-separated list of {kind.__name__}s", field=name,
                          fix=f"e.g. --{name} {example}") from None
    if not values:
        raise ConfigError(f"--{name} is empty", field=name, fix=f"e.g. --{name} {example}")
    return values


def opt(default: Any, help: str, *names: str) -> Any:
    """A ``typer.Option`` with ``default``, ``help`` and optional flag ``names`` (typer imported on use)."""
    import typer

    return typer.Option(default, *names, help=help)
