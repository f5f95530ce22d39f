"""Gateway (firmware) profiles: the schema both sides read, and its cross-field rules.

A profile says what kind of gateway a site runs on and how hard the agent may push it: training backend and
device, inference engine and precision, batch sizes, memory cap, threads, where state lives, how to reach the
broker, where the site's identity files are, and the privacy defaults a freshly provisioned site starts with.
One YAML file per gateway kind lives in ``firmware_configs/`` at the repository root (docs/architecture.md, "Layout").

The schema lives in ``shared`` because two sides read it and they never import each other: the coordinator
validates a profile and copies it into a provisioning bundle (``coordinator.provisioning``); the gateway
validates it again, installs it (``edge_sdk.bundle``) and runs from it (``edge_sdk.profiles`` adds the
machine-dependent parts: resolving ``backend: auto``, probing hardware).

Paths: relative paths are relative to the gateway's install prefix (``wildfed-edge install-bundle --prefix``,
default ``/opt/wildfed``). Storage paths may be absolute (e.g. a data disk); identity files and the broker CA are
installed from the bundle and must stay inside the prefix (relative, no ``..``).

Validation reports every problem at once, each with its dotted field (``training.backend``, ...): field errors from
pydantic and the cross-field rules below (:func:`shared.profiles.profile_problems`), so ``wildfed-edge
check-config`` can list them all. Pydantic's own wording ("Extra inputs are not permitted", a regular expression)
is rewritten to name the allowed fields or values and the fix (``_explain``). A profile read from a file must carry
the file's stem as its ``name`` (``x86-cpu-gateway.yaml`` holds ``name: x86-cpu-gateway``), except the installed
copy ``profile.yaml`` in a gateway's install prefix (:mod:`shared.profiles`). Cross-field rules:

====================================  =======================================================================
rule                                   why
====================================  =======================================================================
Jetson kinds: ``training.backend``     onnxruntime-training publishes no aarch64 wheel; use ``torch`` or
is not ``ort``                         ``auto`` (which picks torch there)
CPU-only kinds (x86 CPU, radio base    there is no GPU to train or infer on
station): ``training.device`` is
``cpu``; ``inference.engine`` is
``ort-cpu``
``training.backend: ort`` runs on      the pinned ``onnxruntime-training-cpu`` wheel has no CUDA provider
``device: cpu``
``ort-cpu`` precision is fp32 or int8  ORT's CPU provider has no fast fp16 kernels
``ort-cuda`` precision is fp32 or      int8 on NVIDIA GPUs needs a TensorRT engine with calibration
fp16
``broker.client_cert`` and             mutual TLS needs both
``broker.client_key`` come together
====================================  =======================================================================

Compatibility (as for wire formats): never remove a field, new fields are optional, meanings never change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from shared.config import StrictModel, explain_error

__all__ = ["GPU_KINDS", "JETSON_KINDS", "BrokerSettings", "GatewayKind", "GatewayProfile", "IdentityFiles",
           "InferenceEngine", "InferenceSettings", "Precision", "PrivacyDefaults", "StoragePaths",
           "TrainingBackendName", "TrainingSettings"]


class GatewayKind(str, Enum):
    """The hardware families WildFed targets."""

    JETSON_ORIN_NANO = "jetson_orin_nano"
    JETSON_XAVIER_NX = "jetson_xavier_nx"
    X86_GPU = "x86_gpu"
    X86_CPU = "x86_cpu"
    RADIO_BASE_STATION = "radio_base_station"


JETSON_KINDS = frozenset({GatewayKind.JETSON_ORIN_NANO, GatewayKind.JETSON_XAVIER_NX})
GPU_KINDS = JETSON_KINDS | {GatewayKind.X86_GPU}


class TrainingBackendName(str, Enum):
    """Training backend: ``auto`` picks ``ort`` where ``onnxruntime.training`` imports, ``torch`` otherwise; on a
    ``cuda`` device, ``torch`` where it sees CUDA, else ``ort`` on the CPU (``edge_sdk.profiles.resolve_training``)."""

    AUTO = "auto"
    TORCH = "torch"
    ORT = "ort"


class InferenceEngine(str, Enum):
    """Detector/classifier runtime: a TensorRT engine, ONNX Runtime on CUDA, or ONNX Runtime on CPU."""

    TENSORRT = "tensorrt"
    ORT_CUDA = "ort-cuda"
    ORT_CPU = "ort-cpu"


class Precision(str, Enum):
    """Numeric precision of the inference engine."""

    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"


def _inside_prefix(value: Path | None) -> Path | None:
    if value is not None and (value.is_absolute() or ".." in PurePosixPath(value.as_posix()).parts):
        raise ValueError("must be a relative path inside the install prefix (no leading '/', no '..')")
    return value


def _no_parent_refs(value: Path) -> Path:
    if ".." in PurePosixPath(value.as_posix()).parts:
        raise ValueError("must not contain '..' (write an absolute path, or one relative to the install prefix)")
    return value


class TrainingSettings(StrictModel):
    """Local training.

    Attributes:
        backend: ``auto``, ``torch`` or ``ort`` (edge_sdk.backends).
        device: torch device, ``cpu`` or ``cuda[:N]`` (``ort`` trains on CPU).
        microbatch_size: examples per per-example-gradient chunk (>= 1). Memory: about
            ``microbatch_size * d * 8`` bytes for ``d`` parameters (torch's gradients plus the numpy copy);
            33,194-parameter camera CNN at 64: ~17 MB.
    """

    backend: TrainingBackendName = TrainingBackendName.AUTO
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    microbatch_size: int = Field(default=64, ge=1, le=65536)


class InferenceSettings(StrictModel):
    """Detector + species classifier.

    Attributes:
        engine: ``tensorrt`` (engine cache, ORT fallback), ``ort-cuda`` or ``ort-cpu``.
        precision: ``fp16``, ``fp32`` or ``int8``.
        batch_size: images per detector batch (>= 1); one 640x640x3 float32 input is 4.9 MB.
    """

    engine: InferenceEngine = InferenceEngine.ORT_CPU
    precision: Precision = Precision.FP32
    batch_size: int = Field(default=1, ge=1, le=1024)


class StoragePaths(StrictModel):
    """Where the agent keeps state (relative to the install prefix unless absolute).

    Attributes:
        outbox: SQLite outbox file (updates wait here until acknowledged).
        artifact_cache: ONNX Runtime training artifacts, keyed by model hash.
        engine_cache: TensorRT engines, keyed by GPU, TensorRT version and model hash.
        data: the site's data folder (the Camtrap DP package lives below it by default).
    """

    outbox: Path = Path("state/outbox.sqlite")
    artifact_cache: Path = Path("cache/artifacts")
    engine_cache: Path = Path("cache/engines")
    data: Path = Path("data")

    _check = field_validator("outbox", "artifact_cache", "engine_cache", "data")(_no_parent_refs)


class BrokerSettings(StrictModel):
    """MQTT broker.

    Attributes:
        url: ``mqtt://host:port`` or ``mqtts://host:port``; ``None``: the coordinator's broker, filled in at
            provisioning.
        ca_file: CA bundle that signs the broker's certificate (installed from the provisioning bundle; inside
            the prefix).
        client_cert, client_key: this gateway's TLS client certificate and key (mutual TLS; from the operator's
            PKI, may be absolute). Both or neither.
    """

    url: str | None = None
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("mqtt://", "mqtts://")):
            raise ValueError("must look like mqtt://host:port or mqtts://host:port")
        return value

    _ca_inside = field_validator("ca_file")(_inside_prefix)


class IdentityFiles(StrictModel):
    """The site's identity (installed from the provisioning bundle; inside the prefix).

    Attributes:
        private_key: the site's Ed25519 private key (PEM, mode 0600).
        coordinator_public_key: the coordinator's Ed25519 public key (PEM); tasks and acks must verify with it.
    """

    private_key: Path = Path("keys/site.key")
    coordinator_public_key: Path = Path("keys/coordinator.pub")

    _inside = field_validator("private_key", "coordinator_public_key")(_inside_prefix)


class PrivacyDefaults(StrictModel):
    """Privacy switches a provisioned site starts with (copied into its ``site.yaml``; a task never changes them).

    Attributes:
        allow_non_private: accept tasks with ``privacy: none``.
        allow_seeded_noise: honour a task's ``seed`` (whoever chose it can reproduce and subtract the noise).
    """

    allow_non_private: bool = False
    allow_seeded_noise: bool = False


Getter = Callable[[str], Any]


def _cross_field_rules(get: Getter) -> list[tuple[str, str]]:
    """The cross-field rules of the module docstring; ``get(dotted)`` returns a valid value or ``None``."""
    problems: list[tuple[str, str]] = []
    kind, backend, device = get("kind"), get("training.backend"), get("training.device")
    engine, precision = get("inference.engine"), get("inference.precision")
    if kind in JETSON_KINDS and backend is TrainingBackendName.ORT:
        problems.append(("training.backend", f"'ort' is not available on {kind.value}: onnxruntime-training "
                         "publishes no aarch64 wheel (use torch or auto)"))
    if kind is not None and kind not in GPU_KINDS:
        if isinstance(device, str) and device.startswith("cuda"):
            problems.append(("training.device", f"{kind.value} has no GPU: use cpu"))
        if engine in (InferenceEngine.TENSORRT, InferenceEngine.ORT_CUDA):
            problems.append(("inference.engine", f"{kind.value} has no GPU: use ort-cpu"))
    if backend is TrainingBackendName.ORT and isinstance(device, str) and device != "cpu":
        problems.append(("training.device", "the ort backend trains on CPU (onnxruntime-training-cpu): use cpu"))
    if engine is InferenceEngine.ORT_CPU and precision is Precision.FP16:
        problems.append(("inference.precision", "ort-cpu has no fast fp16 kernels: use fp32 or int8"))
    if engine is InferenceEngine.ORT_CUDA and precision is Precision.INT8:
        problems.append(("inference.precision", "int8 on an NVIDIA GPU needs a calibrated TensorRT engine: use "
                         "engine tensorrt, or precision fp16/fp32"))
    cert, key = get("broker.client_cert"), get("broker.client_key")
    if (cert is None) != (key is None):
        missing = "broker.client_key" if key is None else "broker.client_cert"
        problems.append((missing, "mutual TLS needs both client_cert and client_key"))
    return problems


_RAW_TYPES: dict[str, Callable[[Any], Any]] = {
    "kind": GatewayKind, "training.backend": TrainingBackendName, "inference.engine": InferenceEngine,
    "inference.precision": Precision,
}


def _raw_getter(data: Any) -> Getter:
    """Read dotted fields from raw (possibly invalid) data; ``None`` for absent or unparsable values."""

    def get(dotted: str) -> Any:
        node = data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        convert = _RAW_TYPES.get(dotted)
        if convert is None:
            return node if isinstance(node, str) else None
        try:
            return convert(node)
        except (ValueError, TypeError):
            return None

    return get


def _model_getter(model: Any) -> Getter:
    def get(dotted: str) -> Any:
        node = model
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    return get


class GatewayProfile(StrictModel):
    """A gateway kind's profile (see the module docstring; one YAML file in ``firmware_configs/``).

    Attributes:
        name: profile name (the YAML file stem), letters, digits, ``_.-``.
        kind: hardware family.
        description: one line for operators.
        training: backend, device, per-example-gradient micro-batch.
        inference: engine, precision, batch size.
        memory_cap_mib: memory the agent process may use, in MiB (>= 128); the provisioning bundle's systemd
            unit enforces it (``MemoryMax=``), and batch sizes are chosen to fit under it.
        threads: CPU threads for training and CPU inference (>= 1).
        storage: outbox, artifact cache, engine cache, data.
        broker: broker URL and TLS files.
        identity: site private key and coordinator public key.
        privacy: privacy defaults of a freshly provisioned site.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    kind: GatewayKind
    description: str = ""
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    memory_cap_mib: int = Field(default=1024, ge=128)
    threads: int = Field(default=1, ge=1, le=1024)
    storage: StoragePaths = Field(default_factory=StoragePaths)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    identity: IdentityFiles = Field(default_factory=IdentityFiles)
    privacy: PrivacyDefaults = Field(default_factory=PrivacyDefaults)

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        """Run field validation and the cross-field rules, and report all their problems in one error."""
        try:
            model = handler(data)
        except ValidationError as exc:
            field_errors = exc.errors()
            cross = _cross_field_rules(_raw_getter(data)) if isinstance(data, dict) else []
            # a field that already failed is not reported twice
            failed = {".".join(str(p) for p in e["loc"]) for e in field_errors}
            extra = [(f, m) for f, m in cross if f not in failed]
            raise _combined(cls.__name__, field_errors, extra, data, cls) from None
        cross = _cross_field_rules(_model_getter(model))
        if cross:
            raise _combined(cls.__name__, [], cross, data)
        return model


#: What a pattern-checked string field must look like, in words (pydantic would print the regular expression).
_PATTERN_WORDS = {
    "name": "1-64 characters: letters, digits, '_', '.', '-', starting with a letter or digit (the file's stem)",
    "device": "cpu, cuda or cuda:N (N the GPU index)",
}


def _explain(model: type[Any], error: Any) -> str:
    """A field error in words that name the allowed fields or values and the fix: the one formatter of every config
    (:func:`shared.config.explain_error`), with this schema's docs and pattern words."""
    return explain_error(model, error, docs="docs/gateways.md, Fields", pattern_words=_PATTERN_WORDS)


def _combined(title: str, field_errors: list[Any], cross: Iterable[tuple[str, str]], data: Any,
              model: type[Any] | None = None) -> ValidationError:
    details: list[InitErrorDetails] = []
    for e in field_errors:
        msg = _explain(model, e) if model is not None else e["msg"]
        details.append(InitErrorDetails(type=PydanticCustomError(e["type"], "{msg}", {"msg": msg}),
                                        loc=tuple(e["loc"]), input=e.get("input")))
    raw = _raw_getter(data) if isinstance(data, dict) else (lambda _: None)
    for dotted, message in cross:
        details.append(InitErrorDetails(type=PydanticCustomError("profile_rule", "{msg}", {"msg": message}),
                                        loc=tuple(dotted.split(".")), input=raw(dotted)))
    return ValidationError.from_exception_data(title, details)
