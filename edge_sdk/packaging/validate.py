"""Validate a package folder with frictionless, offline: every table against its local schema (types, required
fields, enums, ranges, patterns, unique and primary keys, foreign keys between the tables) and the descriptor.

The package must name local schemas and a registered profile (``shared.camtrap_dp_schema``): frictionless fetches
any URL it is given, and a gateway has no internet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["Problem", "validate_package"]


@dataclass(frozen=True)
class Problem:
    """One validation error: the table (``""`` for the descriptor), the row number in the CSV (header = 1; None
    for a whole-table or descriptor error), the field (or None), frictionless's error type and its message."""

    table: str
    row: int | None
    field: str | None
    kind: str
    message: str


def validate_package(package_dir: Path) -> list[Problem]:
    """Every problem frictionless finds in ``package_dir/datapackage.json`` and its tables (empty: valid).

    Raises:
        ConfigError: frictionless is not installed (it comes with the ``edge`` extra).
    """
    try:
        from frictionless import FrictionlessException, system, validate
    except ImportError as exc:
        raise ConfigError("validating a package needs frictionless", field="frictionless",
                          fix="pip install 'wildfed[edge]' (or pip install frictionless)") from exc
    descriptor = Path(package_dir) / "datapackage.json"
    problems: list[Problem] = []
    if not descriptor.is_file():
        return [Problem("", None, None, "missing", f"{descriptor} does not exist")]
    try:
        with system.use_context(trusted=False):
            report = validate(str(descriptor))
    except FrictionlessException as exc:
        return [Problem("", None, None, exc.error.type, exc.error.message)]
    for error in report.errors:
        problems.append(Problem("", None, None, error.type, error.message))
    for task in report.tasks:
        for error in task.errors:
            problems.append(Problem(task.name or "", getattr(error, "row_number", None),
                                    getattr(error, "field_name", None), error.type, error.message))
    return problems
