"""What a site must have before ``wildfed-edge run`` starts: the one list of checks that ``run`` makes at start-up
(and exits with status 2 on, before it connects) and that ``wildfed-edge check-config`` reports in full.

:func:`check_site` returns every problem as ``(dotted field, message with the fix)`` and the warnings (fallbacks the
gateway takes and logs). Checks, in order:

1. **schema**: the site config, and its profile's (``profile.<field>``);
2. **profile vs this machine** (:func:`edge_sdk.doctor.kind_fit`): a Jetson profile needs that Jetson, the x86
   profiles an x86_64 machine (field ``profile.kind``); the x86 GPU profile without a GPU is a warning;
3. **training backend**: its framework imports (``torch``, ``onnxruntime.training``; the site's ``backend`` else the
   profile's), and ``torch`` on ``cuda`` sees CUDA (``auto`` on ``cuda`` falls back to ONNX Runtime on the CPU:
   a warning; :func:`edge_sdk.doctor.device_fit`);
4. **keys**: the private key (mode 0600) and the coordinator key load;
5. **broker**: the transport is built as ``run`` builds it, without connecting (URL, TLS CA / client certificate
   files, the credentials file);
6. **models** (camera sites): the backbone's ONNX graph for ``backbone`` at ``embedding_input_size`` is in the
   site's ``model_dir`` (its bundle's) or the WildFed cache and loads in ONNX Runtime with the expected input,
   output and backbone id, or (no graph) torch is here to export it; the detector's graph likewise when the site
   watches an ``incoming`` folder (the field loop detects);
7. **dataset**: the Camtrap DP folder (or radio-map file) exists; with ``load_dataset`` (``check-config``) it is
   read as ``run`` reads it at start-up, so a species missing from the table is reported here.

Exit status 2 means "a configuration error: restarting will not fix it", which is why the systemd unit of a bundle
has ``RestartPreventExitStatus=2``.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError, WildFedError

__all__ = ["Preflight", "check_site", "backend_problems"]

log = logging.getLogger(__name__)

Problem = tuple[str, str]


@dataclass
class Preflight:
    """What :func:`check_site` found.

    Attributes:
        problems: ``(dotted field, message)`` for each problem; empty when ``run`` would start.
        warnings: fallbacks the gateway will take (and log), e.g. ONNX Runtime on the CPU for a GPU profile.
        config: the loaded site config (None when it does not load).
        dataset: the site's training records when they were loaded (``load_dataset``; camera sites).
    """

    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    config: Any = None
    dataset: Any = None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module marked absent
        return False


def check_site(path: str | Path, *, schema_only: bool = False, load_dataset: bool = True) -> Preflight:
    """Every problem of the site config at ``path`` (module docstring); ``schema_only`` stops after step 1,
    ``load_dataset=False`` (what ``run`` uses: it reads the package itself right after) only checks that the
    dataset exists."""
    from pydantic import ValidationError

    from edge_sdk.config import load_site_config, site_config_problems

    result = Preflight()
    try:
        cfg = load_site_config(path)
    except ConfigError as exc:
        if isinstance(exc.__cause__, ValidationError):
            result.problems += site_config_problems(exc.__cause__)
        else:
            result.problems.append((exc.field or "<file>", exc.message + (f"; fix: {exc.fix}" if exc.fix else "")))
        return result
    result.config = cfg
    profile = _profile(cfg, result)
    if schema_only:
        return result
    _machine(cfg, profile, result)
    _keys(cfg, result)
    _broker(cfg, result)
    if cfg.task == "camera":
        _models(cfg, result)
    _dataset(cfg, result, load=load_dataset)
    return result


def _profile(cfg: Any, result: Preflight) -> Any:
    """Step 1 for the profile: its problems as ``profile.<field>``; the loaded profile or None."""
    from shared.profiles import read_profile_yaml

    from edge_sdk.profiles import FirmwareProfile, load_profile, profile_path, profile_problems

    if not cfg.profile:
        return None
    try:
        ppath = profile_path(cfg.profile)
        found = profile_problems(read_profile_yaml(ppath), FirmwareProfile, file_stem=ppath.stem)
    except ConfigError as exc:
        result.problems.append(("profile", exc.message))
        return None
    result.problems += [(f"profile.{f}", m) for f, m in found]
    return None if found else load_profile(ppath)


def _machine(cfg: Any, profile: Any, result: Preflight) -> None:
    """Steps 2 and 3: the profile's kind against this machine, the backend's import, the training device."""
    from shared.profiles import TrainingBackendName

    from edge_sdk.doctor import device_fit, kind_fit, probe_hardware

    device = cfg.device or (profile.training.device if profile is not None else "cpu")
    report = probe_hardware(cuda=device.startswith("cuda"))
    if profile is not None:
        problems, warnings = kind_fit(profile.kind, report)
        result.problems += [("profile.kind", f"profile {profile.name} {p}; fix: install a bundle provisioned with a "
                                             "profile that fits this machine (`wildfed-edge doctor` names one, e.g. "
                                             "`wildfed-coordinator provision SITE --profile x86-cpu-gateway`)")
                            for p in problems]
        result.warnings += warnings
    import_problems = backend_problems(cfg)
    result.problems += import_problems
    if import_problems:
        return
    from edge_sdk.profiles import ort_training_importable
    from edge_sdk.rounds.backends import requested_backend

    try:
        backend = TrainingBackendName(requested_backend(cfg))
    except ValueError:
        return  # another registered backend: it is built when the agent starts
    problems, warnings = device_fit(backend, device, torch_cuda=report.torch_cuda,
                                    ort_training=ort_training_importable())
    result.problems += [("device" if cfg.device else "profile.training.device",
                         f"{p}; fix: install torch with CUDA (`pip install 'wildfed[torch]'`) or set device: cpu")
                        for p in problems]
    result.warnings += warnings


def backend_problems(cfg: Any) -> list[Problem]:
    """The site's training backend (its own ``backend``, else its profile's) must import here: ``[("backend",
    message naming the backend and the install command)]`` or ``[]``."""
    from edge_sdk.profiles import TrainingBackendName, backend_import_problem, load_profile
    from edge_sdk.rounds.backends import requested_backend

    try:
        backend = requested_backend(cfg)
        device = getattr(cfg, "device", None)
        if device is None and getattr(cfg, "profile", None):
            device = load_profile(cfg.profile).training.device
    except ConfigError:
        return []  # the profile's own problems are listed already
    if backend not in {b.value for b in TrainingBackendName}:
        from edge_sdk.backends import available_backends

        if backend in available_backends():
            return []  # another registered backend: it is built when the agent starts
        # the error `run` stops with (edge_sdk.backends.base.create_backend), plus `auto`
        return [("backend", f"unknown training backend {backend!r}; fix: use one of "
                            f"{', '.join(['auto', *available_backends()])}")]
    problem = backend_import_problem(backend, device=device or "cpu")
    return [("backend", problem)] if problem else []


def _keys(cfg: Any, result: Preflight) -> None:
    from shared.keys import load_private_key, load_public_key

    for name, loader in (("private_key", load_private_key), ("coordinator_public_key", load_public_key)):
        try:
            loader(getattr(cfg, name))
        except ConfigError as exc:
            result.problems.append((name, f"{exc.message} ({getattr(cfg, name)})"
                                          + (f"; fix: {exc.fix}" if exc.fix else "")))


def _broker(cfg: Any, result: Preflight) -> None:
    """Step 5: the transport ``run`` builds (TLS files, credentials), built and dropped without connecting."""
    try:
        from edge_sdk.uplink.site_transport import transport_from_config

        transport_from_config(cfg)
    except ConfigError as exc:
        result.problems.append((exc.field or "broker_url", exc.message + (f"; fix: {exc.fix}" if exc.fix else "")))
    except ImportError as exc:
        result.problems.append(("broker_url", f"the MQTT client does not import ({exc}); fix: reinstall the site's "
                                              "bundle (`wildfed-edge install-bundle --force`)"))


def _models(cfg: Any, result: Preflight) -> None:
    """Step 6: the backbone's graph (always) and the detector's (with ``incoming``) are found and load."""
    from shared.models.backbone import backbone_id

    from edge_sdk.inference.detector import find_detector_onnx
    from edge_sdk.inference.embedder import find_embedder_onnx

    where = f"{cfg.model_dir} (model_dir) or the WildFed cache" if cfg.model_dir else "the WildFed cache (no model_dir)"
    fix = ("fix: reinstall the site's bundle (`wildfed-edge install-bundle --force`; a bundle made by "
           "`wildfed-coordinator provision` ships the graphs for the backbone and size it names), or install torch "
           "here to export them (`pip install 'wildfed[torch]'`)")
    torch_here = _installed("torch")
    try:
        backbone = find_embedder_onnx(cfg.embedding_input_size, cfg.backbone, model_dir=cfg.model_dir)
    except ConfigError as exc:
        result.problems.append((exc.field or "backbone", f"{exc.message}; fix: {exc.fix}"))
        backbone = None
    else:
        if backbone is None and not torch_here:
            result.problems.append(("model_dir", f"no ONNX graph of the backbone {cfg.backbone} at "
                                                 f"{cfg.embedding_input_size} px in {where}, and no torch to export "
                                                 f"one: run cannot embed the site's photos; {fix}"))
        elif backbone is None:
            result.warnings.append(f"the backbone's ONNX graph is not in {where}: it is exported at the first start "
                                   "(torch is here)")
    if backbone is not None:
        problem = _graph_problem(backbone, input_shape=[3, cfg.embedding_input_size, cfg.embedding_input_size],
                                 output_width=1280, backbone_id=backbone_id(cfg.backbone, cfg.embedding_input_size),
                                 torch_here=torch_here)
        if problem:
            result.problems.append(("model_dir", f"{problem}; {fix}"))
    if cfg.incoming is None:
        return
    import os

    detector = (Path(os.environ["WILDFED_DETECTOR_ONNX"]) if os.environ.get("WILDFED_DETECTOR_ONNX")
                else find_detector_onnx(model_dir=cfg.model_dir))
    if detector is None and not torch_here:
        result.problems.append(("model_dir", f"no ONNX graph of the detector in {where}, and no torch to export one: "
                                             f"the field loop (incoming) cannot detect; {fix}"))
    elif detector is not None:
        problem = _graph_problem(detector, input_shape=[3, 640, 640], output_width=6, backbone_id=None,
                                 torch_here=False)
        if problem:
            result.problems.append(("model_dir", f"{problem}; {fix}"))


def _graph_problem(path: Path, *, input_shape: list[int], output_width: int, backbone_id: str | None,
                   torch_here: bool) -> str | None:
    """Open ``path`` in ONNX Runtime on the CPU and check its one input (batch, *input_shape), its output's last
    axis and, for a backbone, the backbone id it records; a message or None. Without ONNX Runtime: TensorRT (which
    builds from the file at start) or torch (the embedder's fallback) will do, else that is the problem."""
    if not _installed("onnxruntime"):
        if _installed("tensorrt") or torch_here:
            return None
        return ("no inference runtime here: onnxruntime does not import (install the site's bundle again, or "
                "`pip install onnxruntime`)")
    from edge_sdk.inference.engines import _import_onnxruntime

    try:
        session = _import_onnxruntime().InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own untyped errors for a broken or foreign file
        return f"{path} does not load in ONNX Runtime ({type(exc).__name__}: {str(exc)[:200]})"
    inputs, outputs = session.get_inputs(), session.get_outputs()
    shape = list(inputs[0].shape[1:]) if len(inputs) == 1 else None
    width = outputs[0].shape[-1] if len(outputs) == 1 else None
    symbolic = len(outputs) == 1 and not isinstance(width, int)  # a named dynamic axis: known only when it runs
    if shape != input_shape or (width != output_width and not symbolic):
        return (f"{path} takes {[i.shape for i in inputs]} and gives {[o.shape for o in outputs]}, not (batch, "
                f"{', '.join(map(str, input_shape))}) -> (..., {output_width})")
    if backbone_id is not None:
        from shared.models.gateway_graphs import BACKBONE_ID_KEY

        recorded = session.get_modelmeta().custom_metadata_map.get(BACKBONE_ID_KEY)
        if recorded is not None and recorded != backbone_id:
            return f"{path} computes {recorded}, but the site config asks for {backbone_id}"
    return None


def _dataset(cfg: Any, result: Preflight, *, load: bool) -> None:
    """Step 7: the dataset exists; with ``load`` it is read as ``run`` reads it."""
    if cfg.task == "radiomap":
        if not Path(cfg.dataset).is_file():
            result.problems.append(("dataset", f"radio-map file {cfg.dataset} does not exist"))
        return
    if not cfg.dataset.is_dir() and cfg.incoming is not None:
        return  # `run` creates the site's package on its first start (docs/field-loop.md)
    if not cfg.dataset.is_dir():
        result.problems.append(("dataset", f"Camtrap DP folder {cfg.dataset} does not exist; fix: put the site's "
                                           "package there, or set `incoming:` to start an empty one"))
        return
    if not load:
        return
    from edge_sdk.data.camtrap_dp import load_camtrap_dp

    try:
        result.dataset = load_camtrap_dp(cfg.dataset, cfg.species_table, missing_media=cfg.missing_media,
                                         train_on=cfg.train_on, machine_threshold=cfg.machine_threshold)
    except WildFedError as exc:
        result.problems.append(("dataset", str(exc)))
