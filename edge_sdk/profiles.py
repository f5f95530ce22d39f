"""Firmware profiles: what kind of gateway this is and how hard the agent may push it.

One YAML file per gateway kind lives in ``firmware_configs/`` at the repository root (DESIGN.md "Top level").
A site config may name a profile (``profile: jetson-orin-nano``); the profile then supplies the backend, the thread
count, the torch device and the per-example-gradient micro-batch (the memory knob) unless the site config sets
them. The schema is small on purpose; later issues extend it (new fields optional, meanings never change).

Memory: per-example gradients of a micro-batch take about ``microbatch_size * d * 4`` bytes twice over (torch's
output and the numpy copy); for the 33,194-parameter camera CNN and ``microbatch_size = 64`` that is ~17 MB.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import Field

from shared.config import StrictModel, load_yaml
from shared.errors import ConfigError

__all__ = ["GatewayKind", "FirmwareProfile", "PROFILES_DIR", "load_profile", "available_profiles"]

PROFILES_DIR = Path(__file__).resolve().parents[1] / "firmware_configs"


class GatewayKind(str, Enum):
    """The hardware families WildFed targets."""

    JETSON_ORIN_NANO = "jetson_orin_nano"
    JETSON_XAVIER_NX = "jetson_xavier_nx"
    X86_GPU = "x86_gpu"
    RADIO_BASE_STATION = "radio_base_station"


class FirmwareProfile(StrictModel):
    """A gateway kind's resource profile.

    Attributes:
        name: profile name (the YAML file stem).
        kind: hardware family.
        description: one line for operators.
        backend: training backend name (``edge_sdk.backends``): ``torch`` everywhere today; ``ort`` later on x86.
        device: torch device, ``cpu`` or ``cuda``.
        threads: CPU threads for training (>= 1).
        memory_cap_mb: memory the agent may use for training, in MiB (>= 64).
        microbatch_size: examples per per-example-gradient chunk (>= 1); keep
            ``microbatch_size * d * 8 bytes`` well under ``memory_cap_mb``.
    """

    name: str = Field(min_length=1)
    kind: GatewayKind
    description: str = ""
    backend: str = "torch"
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    threads: int = Field(default=1, ge=1)
    memory_cap_mb: int = Field(default=1024, ge=64)
    microbatch_size: int = Field(default=64, ge=1)


def available_profiles(directory: Path = PROFILES_DIR) -> tuple[str, ...]:
    """Names of the profiles in ``directory`` (YAML stems), sorted."""
    return tuple(sorted(p.stem for p in directory.glob("*.yaml"))) if directory.is_dir() else ()


def load_profile(name_or_path: str | Path, directory: Path = PROFILES_DIR) -> FirmwareProfile:
    """Load a profile by name (``firmware_configs/<name>.yaml``) or by path.

    Raises:
        ConfigError: no such profile, or the file is invalid (names the file, field and fix).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"firmware profile {str(name_or_path)!r} not found", source=path, field="profile",
                          fix=f"use one of {', '.join(available_profiles(directory)) or '(none found)'} or a path")
    return load_yaml(path, FirmwareProfile)
