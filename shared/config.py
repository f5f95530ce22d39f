"""Configuration base: strict pydantic models loaded from YAML, with errors that name file, field and fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from shared.errors import ConfigError

__all__ = ["StrictModel", "load_yaml", "validation_errors"]

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every WildFed config: unknown keys are errors (a typo must not silently fall back to a default),
    values are validated on assignment, and models are immutable once built."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """``[(dotted field, message), ...]`` for every error pydantic found (pydantic's "Value error, " prefix of our
    own validators' messages is dropped: the message says what is wrong)."""
    return [(".".join(str(p) for p in err["loc"]) or "<root>", str(err["msg"]).removeprefix("Value error, "))
            for err in exc.errors()]


def load_yaml(path: str | os.PathLike[str], model: type[M]) -> M:
    """Load and validate a YAML file into ``model``.

    Raises:
        ConfigError: file missing or not YAML, or validation failed; the message lists every bad field.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file not found", source=path,
                          fix="check the path, pass --config, or create one (wildfed-coordinator init / the README)")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot be read as a UTF-8 YAML file ({type(exc).__name__})", source=path,
                          fix="pass the YAML config (e.g. coordinator.yaml or site.yaml), not a database or key "
                              "file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=path, fix="fix the YAML syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError("top level must be a mapping", source=path, fix="write key: value pairs")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = validation_errors(exc)
        first_field, _ = problems[0]
        detail = "; ".join(f"{f}: {m}" for f, m in problems)
        raise ConfigError(f"{len(problems)} invalid field(s): {detail}", source=path, field=first_field,
                          fix="correct the listed fields (see docs/configuration.md)") from exc
