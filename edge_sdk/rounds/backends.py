"""Which training backend trains a task: the site's own setting, else its firmware profile's, else torch; ``auto``
is decided per task (ONNX Runtime where ``onnxruntime.training`` imports and the task's model version has training
artifacts, torch otherwise); a backend is built once and reused, rebuilt only for another architecture.
"""

from __future__ import annotations

import logging

import numpy as np

from shared.errors import PayloadError
from shared.models.kinds import ModelSpec, spec_from_weights
from shared.protocol import TrainingTask

from edge_sdk.backends.base import TrainingBackend, create_backend
from edge_sdk.backends.ort_backend import ArtifactCache
from edge_sdk.config import SiteConfig
from edge_sdk.profiles import load_profile, resolve_training
from edge_sdk.rounds.context import AgentContext

__all__ = ["requested_backend", "build_backend", "BackendChooser"]

log = logging.getLogger(__name__)


def _profile_value(profile: object, name: str) -> object:
    """A profile's flat attribute; for ``backend`` the raw requested value (``auto`` unresolved) when the profile
    has a ``training`` section, so that the agent can decide ``auto`` per task."""
    if name == "backend":
        raw = getattr(getattr(profile, "training", None), "backend", None)
        if raw is not None:
            return getattr(raw, "value", raw)
    return getattr(profile, name, None)


def requested_backend(config: SiteConfig) -> str:
    """The backend name the site asks for (``torch``, ``ort``, ``auto``, or another registered name): the site
    config's, else its profile's, else ``torch``.

    Raises:
        ConfigError: unknown profile.
    """
    if config.backend is not None:
        return str(config.backend)
    if config.profile:
        value = _profile_value(load_profile(config.profile), "backend")
        if value is not None:
            return str(value)
    return "torch"


def build_backend(config: SiteConfig, name: str | None = None, *, model: ModelSpec | None = None
                  ) -> TrainingBackend:
    """The training backend a site config asks for (or ``name``): its own settings first, then its firmware
    profile's, then defaults (torch, cpu, 1 thread, micro-batch 64). ``auto`` builds ``ort`` where
    ``onnxruntime.training`` imports and the device is the CPU, ``torch`` otherwise; the agent refines ``auto`` per
    task (ORT only when the task carries artifacts, :meth:`BackendChooser.select`). An ``ort`` backend is built
    without artifacts; they are loaded per task. ``model``: the architecture to build (the spec of the task's
    weights, ``shared.models.kinds.spec_from_weights``); default ``shared.models.kinds.DEFAULT_KIND``.

    Raises:
        ConfigError: unknown backend or profile, or a framework that is not installed.
    """
    profile = load_profile(config.profile) if config.profile else None

    def pick(field: str, default: object) -> object:
        value = getattr(config, field)
        if value is None and profile is not None:
            value = _profile_value(profile, field)
        return default if value is None else value

    backend = name if name is not None else requested_backend(config)
    settings = {"threads": pick("threads", 1), "device": pick("device", "cpu"),
                "microbatch_size": pick("microbatch_size", 64)}
    if backend == "auto":
        backend, settings["device"], note = resolve_training("auto", str(settings["device"]))
        if note is not None:
            log.warning("site %s: %s", config.site_id, note)
    log.info("site %s: training backend %s on %s, %d thread(s), micro-batch %d (profile %s)", config.site_id, backend,
             settings["device"], settings["threads"], settings["microbatch_size"], config.profile or "none")
    if model is not None:
        return create_backend(backend, model=model, **settings)
    return create_backend(backend, num_classes=config.model_classes, **settings)


class BackendChooser:
    """The backends of one site, built on first use (module docstring).

    Args:
        ctx: the agent's shared state.
        backend: a backend to use for every task (tests), or None to choose per task.
        artifact_cache: where ONNX Runtime training artifacts are kept by model hash.

    Attributes:
        current: the backend of the latest task.
        requested: what the site asks for (``torch``, ``ort``, ``auto``, ...).
    """

    def __init__(self, ctx: AgentContext, *, backend: TrainingBackend | None, artifact_cache: ArtifactCache) -> None:
        self.ctx = ctx
        self.requested = backend.name if backend is not None else requested_backend(ctx.config)
        self.current = backend if backend is not None else build_backend(ctx.config)
        self.built: dict[str, TrainingBackend] = {self.current.name: self.current, self.requested: self.current}
        self.artifact_cache = artifact_cache

    def select(self, task: TrainingTask, artifacts: dict[str, bytes],
               weights: dict[str, np.ndarray] | None = None) -> TrainingBackend | None:
        """Pick (and build on first use) the backend for ``task`` and set :attr:`current`; None if rejected.

        ``auto``: ``ort`` when ``onnxruntime.training`` imports and ORT artifacts for the task's model hash are in
        the task or in the gateway's artifact cache, ``torch`` otherwise. An ``ort`` backend loads the artifacts
        (stored in the cache, keyed by model hash, after the task's signature and SHA-256 checks).
        ``weights``: the task's global model; a torch backend of another architecture (e.g. the coordinator's
        head-only model, ``adapter_width`` 0) is rebuilt for the weights' spec.
        """
        want = self.requested
        cached = self.artifact_cache.path(task.model_hash)
        if want == "auto" and not (artifacts or cached):
            want = "torch"  # no artifacts for this model version: ORT cannot train it
        spec = None
        if weights is not None:
            try:
                spec = spec_from_weights(weights)
            except ValueError as exc:
                self.ctx.reject("task", "model_mismatch", str(exc))
                return None
        backend = self.built.get(want)
        if backend is not None and spec is not None and getattr(backend, "spec", spec) != spec \
                and backend.name != "ort":  # ORT takes its architecture from the task's artifacts
            backend = None
        if backend is None:
            try:  # "auto": ort where it imports (cpu), else torch
                backend = build_backend(self.ctx.config, name=want, model=spec if want != "ort" else None)
            except (ValueError, PayloadError) as exc:  # ConfigError: framework not installed
                self.ctx.reject("task", "backend_unavailable", str(exc))
                return None
            self.built[want] = backend
        if backend.name == "ort":
            try:
                folder = self.artifact_cache.store(task.model_hash, artifacts) if artifacts else cached
                if folder is None:
                    self.ctx.reject("task", "ort_artifacts_missing",
                                    f"backend ort needs ORT training artifacts for model {task.model_hash[:12]}; the "
                                    "task carries none (coordinator: ship_ort_artifacts: true; or backend: auto)")
                    return None
                backend.load_artifacts(folder)  # type: ignore[attr-defined]
            except (ValueError, OSError) as exc:
                self.ctx.reject("task", "model_mismatch", f"ORT artifacts unusable: {exc}")
                return None
        if backend is not self.current:
            log.info("site %s: round %d trains with backend %s", self.ctx.config.site_id, task.round, backend.name)
        self.current = backend
        return backend

