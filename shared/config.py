"""Configuration base: strict pydantic models loaded from YAML, with errors that name file, field and fix."""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from shared.errors import ConfigError

__all__ = ["StrictModel", "error_field", "explain_error", "load_yaml", "validation_errors"]

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every WildFed config: unknown keys are errors (a typo must not silently fall back to a default),
    values are validated on assignment, and models are immutable once built."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold: itself, the members of ``X | Y`` / ``X | None``, the items of
    ``list[X]`` / ``tuple[X, ...]`` / ``dict[str, X]`` (one level)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        else:
            found += [m for m in _models_in(arg) if m not in found]
    return found


def _tag_of(model: type[BaseModel], tag: str) -> bool:
    """Whether one of ``model``'s ``Literal`` fields admits ``tag`` (how pydantic names a discriminated union's
    member in an error's location: ``budget.from_anchor.gama``)."""
    return any(typing.get_origin(f.annotation) is typing.Literal and tag in typing.get_args(f.annotation)
               for f in model.model_fields.values())


def _model_at(model: type[Any], loc: tuple[Any, ...]) -> tuple[type[Any] | None, Any]:
    """``(the model class holding the last part of loc, that field's annotation)``; ``(None, None)`` off the schema.
    List indices and discriminated-union tags in ``loc`` are stepped over."""
    current: list[type[BaseModel]] = _models_in(model)
    for i, part in enumerate(loc):
        if isinstance(part, int) or not current:
            continue
        last = i == len(loc) - 1
        holder = next((m for m in current if part in m.model_fields), None)
        if holder is None:
            tagged = [m for m in current if _tag_of(m, str(part))]
            if tagged and not last:
                current = tagged
                continue
            return (current[0], None) if last and len(current) == 1 else (None, None)
        annotation = holder.model_fields[part].annotation
        if last:
            return holder, annotation
        current = _models_in(annotation)
    return None, None


def _choices(annotation: Any) -> list[str]:
    """The allowed values of an Enum or Literal annotation (``X | None`` too); empty for anything else."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Enum):
            return [str(m.value) for m in candidate]
        if typing.get_origin(candidate) is typing.Literal:
            return [str(v) for v in typing.get_args(candidate)]
    return []


def explain_error(model: type[Any] | None, error: Any, *, docs: str = "docs/configuration.md",
                  pattern_words: Mapping[str, str] | None = None) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) in words that name the allowed fields or values
    and the fix: pydantic's own text says only "Extra inputs are not permitted", "Field required", prints a regular
    expression, or prefixes our validators' messages with "Value error, ". Used for every config and profile
    (coordinator config, site config, gateway profiles).

    Args:
        model: the top-level model validated (``None``: only the generic rewording).
        error: one item of ``exc.errors()``.
        docs: where the fields are documented, named in the fix of an unknown field.
        pattern_words: per field name, what a pattern-checked string must look like, in words.

    Returns:
        The message (no field name: callers pair it with :func:`error_field`).
    """
    import difflib

    loc = tuple(error["loc"])
    kind, got = error["type"], error.get("input")
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # our own check: it already says what is wrong and the fix
        return cause.message + (f"; fix: {cause.fix}" if cause.fix else "")
    last = str(loc[-1]) if loc else "<root>"
    holder, annotation = _model_at(model, loc) if model is not None else (None, None)
    fields = list(getattr(holder, "model_fields", {}) or {})
    named = [str(p) for p in loc[:-1] if not isinstance(p, int)]
    section = f"in {'.'.join(named)}" if named else "at the top level"
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(last, fields, n=1)
        hint = f"rename it to {close[0]!r}" if close else "remove it"
        allowed = f"; allowed fields there: {', '.join(fields)}" if fields else ""
        return f"unknown field {last!r} {section}{allowed}; fix: {hint} ({docs})"
    if kind == "union_tag_invalid":
        ctx = error.get("ctx") or {}
        return (f"{last}.{str(ctx.get('discriminator', 'kind')).strip(chr(39))}: {ctx.get('tag')!r} is not allowed; "
                f"allowed values: {str(ctx.get('expected_tags', '')).replace(chr(39), '')}; fix: use one of them")
    choices = _choices(annotation)
    if kind == "missing":
        values = f" (one of: {', '.join(choices)})" if choices else ""
        return f"required field {last!r} is missing; fix: add `{last}: ...`{values}"
    if kind in ("enum", "literal_error") or (choices and kind.endswith("_type")):
        allowed = ", ".join(choices) if choices else str((error.get("ctx") or {}).get("expected", ""))
        return f"{got!r} is not allowed; allowed values: {allowed}; fix: use one of them"
    if kind == "string_pattern_mismatch" and pattern_words and last in pattern_words:
        return f"{got!r} is not allowed: it must be {pattern_words[last]}; fix: correct the value"
    nested = getattr(annotation, "model_fields", None)
    if kind in ("model_type", "dict_type", "model_attributes_type") and nested is not None:
        return (f"must be a mapping (key: value lines) with some of: {', '.join(nested)}; got {got!r}; fix: write "
                f"`{last}:` and the fields below it, indented")
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind.startswith(("int_", "float_", "bool_", "greater_", "less_", "string_")):
        return f"{message} (got {got!r}); fix: correct the value"
    return message


def error_field(error: Any) -> str:
    """The dotted field of one pydantic error: its location, or, for one of our checks across fields (a
    :class:`ConfigError` raised in a model validator, whose location is the model itself), the field it names;
    ``<root>`` when neither says."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError) and cause.field and not error["loc"]:
        return cause.field
    return ".".join(str(p) for p in error["loc"]) or "<root>"


def validation_errors(exc: ValidationError, model: type[Any] | None = None, *,
                      docs: str = "docs/configuration.md",
                      pattern_words: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``[(dotted field, message), ...]`` for every error pydantic found, each message in words that name the
    allowed fields or values and the fix (:func:`explain_error`; ``model`` is the top-level model validated;
    without it pydantic's text is kept, less its "Value error, " prefix)."""
    if model is None:  # already worded (e.g. a profile's combined errors): keep the text
        return [(error_field(err), str(err["msg"]).removeprefix("Value error, ")) for err in exc.errors()]
    return [(error_field(err), explain_error(model, err, docs=docs, pattern_words=pattern_words))
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
        problems = validation_errors(exc, model)
        first_field, _ = problems[0]
        detail = "; ".join(f"{f}: {m}" for f, m in problems)
        raise ConfigError(f"{len(problems)} invalid field(s): {detail}", source=path, field=first_field,
                          fix="correct the listed fields (see docs/configuration.md)") from exc
