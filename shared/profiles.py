"""Gateway (firmware) profiles: finding, reading and checking profile files.

The schema (:class:`GatewayProfile`, its sections and cross-field rules) is in :mod:`shared.profile_schema`, and is
exported here as before. One YAML file per gateway kind lives in ``firmware_configs/`` at the repository root
(:data:`PROFILES_DIR`, ``$WILDFED_PROFILES_DIR`` overrides it); a profile read from a file must carry the file's stem
as its ``name``, except the installed copy ``profile.yaml`` in a gateway's install prefix.

Compatibility (as for wire formats): never remove a field, new fields are optional, meanings never change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from shared.config import validation_errors
from shared.errors import ConfigError
from shared.profile_schema import (GPU_KINDS, JETSON_KINDS, BrokerSettings, GatewayKind, GatewayProfile, IdentityFiles,
                                   InferenceEngine, InferenceSettings, Precision, PrivacyDefaults, StoragePaths,
                                   TrainingBackendName, TrainingSettings)

__all__ = [
    "GatewayKind",
    "TrainingBackendName",
    "InferenceEngine",
    "Precision",
    "TrainingSettings",
    "InferenceSettings",
    "StoragePaths",
    "BrokerSettings",
    "IdentityFiles",
    "PrivacyDefaults",
    "GatewayProfile",
    "PROFILES_DIR",
    "GPU_KINDS",
    "JETSON_KINDS",
    "profiles_dir",
    "available_profiles",
    "profile_path",
    "read_profile_yaml",
    "load_profile",
    "profile_problems",
    "check_profile_data",
    "INSTALLED_PROFILE_STEM",
]

#: The shipped profiles (repository checkout). ``$WILDFED_PROFILES_DIR`` overrides it (see :func:`profiles_dir`).
PROFILES_DIR = Path(__file__).resolve().parents[1] / "firmware_configs"

M = TypeVar("M", bound=GatewayProfile)


#: The file name a bundle installs its profile under (``shared.bundle.PROFILE``): its stem is not the profile's name.
INSTALLED_PROFILE_STEM = "profile"


def _name_problems(data: Any, file_stem: str | None) -> list[tuple[str, str]]:
    """``name`` must be the file's stem (profiles are looked up by file name; the coordinator copies ``name`` into
    bundles and the ledger of provisioned sites). The installed copy ``<prefix>/profile.yaml`` is exempt."""
    if file_stem is None or file_stem == INSTALLED_PROFILE_STEM or not isinstance(data, dict):
        return []
    name = data.get("name")
    if isinstance(name, str) and name != file_stem:
        return [("name", f"{name!r} differs from the file name {file_stem + '.yaml'!r}; fix: set `name: "
                 f"{file_stem}`, or rename the file to {name + '.yaml'!r}")]
    return []


def profile_problems(data: Any, model: type[GatewayProfile] = GatewayProfile, *,
                     file_stem: str | None = None) -> list[tuple[str, str]]:
    """Every problem of raw profile data as ``[(dotted field, message), ...]`` (empty: valid); each message names
    the allowed fields or values and the fix. With ``file_stem`` (the YAML file's name without ``.yaml``), ``name``
    must equal it (:func:`_name_problems`)."""
    if not isinstance(data, dict):
        return [("<root>", "a profile is a YAML mapping of key: value pairs")]
    problems: list[tuple[str, str]] = []
    try:
        model.model_validate(data)
    except ValidationError as exc:
        problems = validation_errors(exc)
    failed = {f for f, _ in problems}
    return problems + [p for p in _name_problems(data, file_stem) if p[0] not in failed]


def check_profile_data(data: Any, *, source: object = None, model: type[M] = GatewayProfile,  # type: ignore[assignment]
                       file_stem: str | None = None) -> M:
    """Validate raw profile data (:func:`profile_problems`); a :class:`~pathlib.Path` ``source`` gives the
    ``file_stem`` that ``name`` must equal.

    Raises:
        ConfigError: naming the source, every bad field (in the message) and the first one (``.field``).
    """
    if file_stem is None and isinstance(source, Path):
        file_stem = source.stem
    profile: M | None = None
    problems: list[tuple[str, str]] = []
    try:
        profile = model.model_validate(data)
    except ValidationError as exc:
        problems = validation_errors(exc)
    failed = {f for f, _ in problems}
    problems += [p for p in _name_problems(data, file_stem) if p[0] not in failed]
    if problems or profile is None:
        detail = "; ".join(f"{f}: {m}" for f, m in problems)
        raise ConfigError(f"invalid gateway profile, {len(problems)} problem(s): {detail}", source=source,
                          field=problems[0][0], fix="correct the listed fields (see docs/gateways.md)")
    return profile


def profiles_dir() -> Path:
    """Where named profiles are looked up: ``$WILDFED_PROFILES_DIR`` if set, else :data:`PROFILES_DIR`."""
    env = os.environ.get("WILDFED_PROFILES_DIR")
    return Path(env) if env else PROFILES_DIR


def available_profiles(directory: Path | None = None) -> tuple[str, ...]:
    """Names of the profiles in ``directory`` (YAML stems), sorted."""
    directory = profiles_dir() if directory is None else directory
    return tuple(sorted(p.stem for p in directory.glob("*.yaml"))) if directory.is_dir() else ()


def profile_path(name_or_path: str | os.PathLike[str], directory: Path | None = None) -> Path:
    """The file of a profile given by name (``<directory>/<name>.yaml``) or by path.

    Raises:
        ConfigError: no such profile.
    """
    directory = profiles_dir() if directory is None else directory
    path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"gateway profile {str(name_or_path)!r} not found", source=path, field="profile",
                          fix=f"use one of {', '.join(available_profiles(directory)) or '(none found)'} or a path")
    return path


def read_profile_yaml(path: Path) -> Any:
    """The raw YAML data of a profile file.

    Raises:
        ConfigError: not valid YAML.
    """
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=path, fix="fix the YAML syntax") from exc


def load_profile(name_or_path: str | os.PathLike[str], directory: Path | None = None, *,
                 model: type[M] = GatewayProfile) -> M:  # type: ignore[assignment]
    """Load a profile by name (``firmware_configs/<name>.yaml``) or by path.

    Raises:
        ConfigError: no such profile, or the file is invalid (names the file, every bad field, and the fix).
    """
    path = profile_path(name_or_path, directory)
    data = read_profile_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("a profile is a YAML mapping at the top level", source=path, fix="write key: value pairs")
    return check_profile_data(data, source=path, model=model)
