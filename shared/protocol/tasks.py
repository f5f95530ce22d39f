"""TASK payloads (coordinator -> site): :class:`TrainingTask` (a radio task's part, :class:`RadioTask`, is in
:mod:`shared.protocol.radio_tasks`) and the global weights and artifacts it rides with (:mod:`shared.protocol`)."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.codec import encode_tensors
from shared.errors import PayloadError
from shared.iucn import IUCNCategory

from shared.protocol.common import (ARTIFACT_PREFIX, _ARTIFACT_NAME, _SHA256_HEX, PrivacyMode, PRIVACY_MODES,
                                    CCDP_VARIANTS, _category, _positive, _metadata, _read, _check_weights)
from shared.protocol.radio_tasks import RadioTask
from shared.protocol.secagg_messages import SecAggSettings


def _cohorts(value: Any, round_: int) -> dict[int, tuple[IUCNCategory, ...]]:
    """``TrainingTask.cohorts`` checked: keys are rounds <= the task's (JSON gives them as strings), values lists of
    IUCN codes; sorted by cohort, each list by rank."""
    if not isinstance(value, Mapping):
        raise PayloadError(f"cohorts must map cohort rounds to halted IUCN categories, got {value!r}")
    out: dict[int, tuple[IUCNCategory, ...]] = {}
    for key, halted in value.items():
        try:
            cohort = int(key)
        except (TypeError, ValueError):
            raise PayloadError(f"cohorts: {key!r} is not a round number") from None
        if isinstance(key, bool) or not 0 <= cohort <= round_:
            raise PayloadError(f"cohorts: cohort {key!r} is not a round in 0..{round_}")
        if isinstance(halted, (str, bytes)) or not isinstance(halted, Sequence):
            raise PayloadError(f"cohorts[{key}] must list IUCN categories, got {halted!r}")
        out[cohort] = tuple(sorted({_category(c) for c in halted}, key=lambda c: c.rank))
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class TrainingTask:
    """One site's instructions for one round (the payload tensors are the global weights).

    Attributes:
        federation_id, round, model_hash: identify the round and the global model version (hex SHA-256).
        local_steps: DP-SGD steps to run this round.
        expected_batch_size: B; the site samples at rate q = min(1, B / N_k), N_k its declared ``capacity``
            (below; a public constant, never its record count); q = 1 for a distributed-noise task
            (``shared.privacy.distributed.site_sampling_rate``).
        learning_rate: local SGD step size.
        clipping_norm: C, L2 bound of each per-example gradient.
        target_delta: delta of every category's (eps, delta) guarantee.
        planned_rounds: rounds the federation plans; noise is calibrated so that ``planned_rounds * local_steps``
            steps spend each category's whole budget.
        privacy: ``"ccdp"`` (local DP: the gateway clips and adds its categories' noise every step), ``"global"``
            (Global DP: the gateway sends the clipped, unnoised gradient sum of ONE Poisson-sampled batch under
            secure aggregation and the coordinator adds the noise once to the aggregate; ``local_steps`` must be 1
            and ``secagg`` given; docs/privacy.md) or ``"none"`` (non-private reference runs only).
        budgets: total epsilon budget per IUCN category (whole federation, per record).
        halted: categories whose records this site must not sample any more (the ledger halted them; under
            ``cohorts``, those halted in every cohort).
        cohorts: record-level budgets (coordinator.cohorts): ``{cohort: categories halted in it}`` for every cohort
            of the site that trains this round, a cohort named by the round its records joined training; the
            site's records that have not joined yet join cohort ``round`` (always listed unless even one round
            would pass a budget). A record trains only if its cohort is listed and its category is not halted
            there. None (left out of the JSON): every record of a non-halted category trains.
        seed: a seed for reproducible runs, or None. A gateway honours it only when its own site config sets
            ``allow_seeded_noise`` (whoever knows the seed can subtract the noise); it then warns loudly.
        artifacts: ``{file name: hex SHA-256}`` of the opaque files that ride in the payload as uint8 tensors
            named ``ARTIFACT_PREFIX + file name`` (ONNX Runtime training artifacts of this model version); empty
            when none are shipped (then the field is left out of the JSON, so older gateways still read the task).
        secagg: the secure-aggregation parameters of a ``"global"`` round (left out of the JSON otherwise).
        count_noise_multiplier: when not None, the site also releases its per-class record counts (every class of
            the model, records of active categories only) with Gaussian noise of this standard deviation (the L2
            sensitivity of the count vector to one record is 1), for NIRA's species-embedding weights; the noise
            multipliers of the DP-SGD steps are calibrated so that both together stay within each budget. 0 only
            with privacy ``"none"`` (exact counts). Left out of the JSON when None.
        ccdp_variant: how a ``"ccdp"`` task meets each category's budget with one noise draw per step
            (individualized DP-SGD, ``edge_sdk.privacy.ccdp``): ``"sample"`` (per-category sampling rates, one
            clipping norm) or ``"scale"`` (per-category clipping norms, one rate). Left out of the JSON for other
            modes; a ``"ccdp"`` task without it reads as ``"sample"``.
        noise_multiplier: a ``"global"`` task's z (required there, absent otherwise): the coordinator adds one
            Gaussian draw of standard deviation ``z * C_eff`` to the unmasked sum, and the site samples each active
            category c at ``shared.privacy.individualized.individual_sampling_rates(z, ...)`` (at most its
            q = min(1, B / N_site)), the rate at which c's budget is spent over the planned rounds.
        distributed_noise: a ``"global"`` task only: True = distributed DP (the site adds its share of Skellam noise
            to its quantised sum before masking, clips category c at ``C_c`` of
            ``shared.privacy.distributed.distributed_plan`` and takes every record (q = 1); the coordinator adds
            nothing); False (default, left out of the JSON) = the trusted-server mode.
        feature_centre: a ``"global"`` task only: hex SHA-256 of the public feature centre c
            (``shared.models.feature_centre.centre_digest``) on whose centred embeddings the site takes its
            gradients; the coordinator folds the noisy sum back with the same c. A site without that centre
            refuses the task. None (left out of the JSON): gradients of the plain form.
        class_reweighting: a ``"ccdp"`` task only: the exponent p in [0, 1] of the post-processing that scales
            each class row of the head's delta (``psi.weight[k]``, ``psi.bias[k]``) by ``w_c^-p``, with ``w_c``
            the public relative weight of a record of the class's IUCN category c in a step
            (``CCDPPlan.relative_weights``): under individualized DP-SGD a threatened category's records are
            sampled (or clipped) less, so its rows learn less per step; p = 1 undoes that in expectation and
            multiplies the noise on those rows by the same factor, p = 0.5 (square-root re-weighting) halfway.
            0 (default, left out of the JSON) = off. Post-processing of the DP release with public constants:
            the events are unchanged.
        radio: a radio-map task (:class:`RadioTask`) for base-station gateways; privacy is then ``"grouped"``
            (budgets under IUCN NE: a radio map has no species) or ``"none"``, and ``artifacts`` must carry
            ``radio.city_artifact``. Left out of the JSON when None (camera tasks).
        prediction_offsets: camera tasks only: float (K,) ``tau (log pi_k - mean log pi)``, the post-hoc logit
            adjustment (Menon et al. 2021, sec. 4) the coordinator computed from public registry metadata
            (:mod:`shared.models.logit_adjustment`). The site trains on the global model as sent and keeps for
            ``detect`` the model with ``psi.bias - offsets``. None (default, left out of the JSON) = no adjustment.
        capacity: camera tasks: N_k, the site's declared capacity (an integer >= 1 the operator declared at
            enrolment, public and independent of the site's data, docs/privacy.md "No uncharged counts"): the base
            sampling rate is min(1, B / N_k), a step is normalised by its expected batch q N_k, and the site reports
            N_k as its ``UpdateReport.num_examples``. A gateway refuses a camera task without it. None (left out
            of the JSON): radio tasks, and in-process simulations where the dataset's own size stands in.
        round_duration_s: D, seconds >= 0: the site releases what it sends for this round (the update; a Global DP
            round's replies after its keys) at ``accepted + k D``, the first such slot (k >= 1) after its local
            work, so that the release time tells nothing of its records (:mod:`edge_sdk.privacy.timing`). Public
            and the same for every site of the round. 0 (default, left out of the JSON) = no padding.
        model_digest: camera tasks only: the model is not in the payload but published once for every site,
            retained on ``shared.topics.digest_topic(federation_id, model_digest)``; equal to ``model_hash``
            (hex SHA-256 of the weights). The payload then holds no weight tensor (artifacts still ride in it).
            None (default, left out of the JSON): the weights are in the payload. An older gateway rejects a task
            with this field (unknown field), so the coordinator sends it only when ``transfer.models_by_digest``.
        max_staleness: buffered rounds only (FedBuff): the coordinator still aggregates this round's update while
            at most this many newer rounds have opened; a gateway that knows of a round more than this many
            rounds newer does not train this task (its budget would buy nothing). None (default, left out of the
            JSON): synchronous rounds. An older gateway rejects a task with this field (unknown field).
    """

    federation_id: str
    round: int
    model_hash: str
    local_steps: int
    expected_batch_size: int
    learning_rate: float
    clipping_norm: float
    target_delta: float
    planned_rounds: int
    privacy: PrivacyMode = "ccdp"
    budgets: Mapping[IUCNCategory, float] = field(default_factory=dict)
    halted: tuple[IUCNCategory, ...] = ()
    seed: int | None = None
    artifacts: Mapping[str, str] = field(default_factory=dict)
    secagg: SecAggSettings | None = None
    count_noise_multiplier: float | None = None
    radio: RadioTask | None = None
    ccdp_variant: str = "sample"
    noise_multiplier: float | None = None
    distributed_noise: bool = False
    feature_centre: str | None = None
    class_reweighting: float = 0.0
    prediction_offsets: tuple[float, ...] | None = None
    capacity: int | None = None
    round_duration_s: float = 0.0
    cohorts: Mapping[int, tuple[IUCNCategory, ...]] | None = None
    model_digest: str | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        _positive("round", self.round, integer=True, allow_zero=True)
        if self.max_staleness is not None:
            _positive("max_staleness", self.max_staleness, integer=True, allow_zero=True)
        if self.model_digest is not None and (self.model_digest != self.model_hash or self.radio is not None
                                              or not _SHA256_HEX.match(str(self.model_digest))):
            raise PayloadError(f"model_digest {self.model_digest!r} must equal model_hash {self.model_hash!r} (64 "
                               "lowercase hex) in a camera task (radio tasks carry their weights)")
        if self.cohorts is not None:
            object.__setattr__(self, "cohorts", _cohorts(self.cohorts, self.round))
        if self.capacity is not None:
            _positive("capacity", self.capacity, integer=True)
        d = self.round_duration_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise PayloadError(f"round_duration_s must be a finite number of seconds >= 0, got {d!r}")
        object.__setattr__(self, "round_duration_s", float(d))
        offsets = self.prediction_offsets
        if offsets is not None:
            if (isinstance(offsets, (str, bytes, Mapping)) or not isinstance(offsets, Sequence) or len(offsets) < 2
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                           for v in offsets)):
                raise PayloadError(f"prediction_offsets must be a list of >= 2 finite numbers (one per class), "
                                   f"got {offsets!r}")
            if self.radio is not None:
                raise PayloadError("prediction_offsets are for camera (species) tasks, not radio tasks")
            object.__setattr__(self, "prediction_offsets", tuple(float(v) for v in offsets))
        p = self.class_reweighting
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
            raise PayloadError(f"class_reweighting must be a number in [0, 1], got {p!r}")
        if p and self.privacy != "ccdp":
            raise PayloadError(f"class_reweighting is only for ccdp tasks, not {self.privacy!r}")
        if self.ccdp_variant not in CCDP_VARIANTS:
            raise PayloadError(f"ccdp_variant must be one of {CCDP_VARIANTS}, got {self.ccdp_variant!r}")
        _positive("local_steps", self.local_steps, integer=True)
        _positive("expected_batch_size", self.expected_batch_size, integer=True)
        _positive("learning_rate", self.learning_rate)
        _positive("clipping_norm", self.clipping_norm)
        _positive("planned_rounds", self.planned_rounds, integer=True)
        if not (isinstance(self.target_delta, float) and 0 < self.target_delta < 1):
            raise PayloadError(f"target_delta must be in (0, 1), got {self.target_delta!r}")
        if self.privacy not in PRIVACY_MODES:
            raise PayloadError(f"privacy must be one of {PRIVACY_MODES}, got {self.privacy!r}")
        budgets = {_category(k): v for k, v in dict(self.budgets).items()}
        for cat, eps in budgets.items():
            _positive(f"budgets[{cat.value}]", eps)
        if self.privacy != "none" and not budgets:
            raise PayloadError(f"a {self.privacy} task must give budgets")
        if self.privacy == "global":
            if not isinstance(self.secagg, SecAggSettings):
                raise PayloadError("a global task must carry secagg parameters")
            if self.local_steps != 1:
                raise PayloadError(f"a global task runs exactly 1 local step (the coordinator noises the sum of "
                                   f"one batch), got local_steps={self.local_steps}")
            self.secagg.params(self.federation_id, self.round)  # validates
            z = self.noise_multiplier
            if isinstance(z, bool) or not isinstance(z, (int, float)) or not (0 < z < math.inf):
                raise PayloadError(f"a global task must carry a positive noise_multiplier, got {z!r}")
        elif self.noise_multiplier is not None:
            raise PayloadError(f"noise_multiplier is only for global tasks, not {self.privacy!r}")
        if type(self.distributed_noise) is not bool:
            raise PayloadError(f"distributed_noise must be true or false, got {self.distributed_noise!r}")
        if self.distributed_noise and self.privacy != "global":
            raise PayloadError(f"distributed_noise is only for global tasks, not {self.privacy!r}")
        if isinstance(self.secagg, SecAggSettings) and self.secagg.colluding_sites and not self.distributed_noise:
            raise PayloadError("secagg.colluding_sites is only for distributed-noise tasks (the sites' shares are "
                               "what it calibrates)")
        if self.feature_centre is not None:
            if self.privacy != "global":
                raise PayloadError(f"feature_centre is only for global tasks, not {self.privacy!r}")
            if not (isinstance(self.feature_centre, str) and re.fullmatch(r"[0-9a-f]{64}", self.feature_centre)):
                raise PayloadError(f"feature_centre must be a hex SHA-256, got {self.feature_centre!r}")
        if self.privacy != "global" and self.secagg is not None:
            raise PayloadError(f"secagg parameters are only for global tasks, not {self.privacy!r}")
        z = self.count_noise_multiplier
        if z is not None:
            if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
                raise PayloadError(f"count_noise_multiplier must be a non-negative number, got {z!r}")
            if self.privacy == "global":
                raise PayloadError("count releases are not part of global tasks (secure aggregation hides them)")
            if self.privacy == "ccdp" and z == 0:
                raise PayloadError("a private task cannot ask for exact counts (count_noise_multiplier 0)")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "halted", tuple(sorted({_category(c) for c in self.halted}, key=lambda c: c.rank)))
        if self.seed is not None and type(self.seed) is not int:
            raise PayloadError(f"seed must be an integer or null, got {self.seed!r}")
        if not isinstance(self.artifacts, Mapping):
            raise PayloadError(f"artifacts must map file names to SHA-256 hex digests, got {self.artifacts!r}")
        for name, digest in self.artifacts.items():
            if not isinstance(name, str) or not _ARTIFACT_NAME.match(name):
                raise PayloadError(f"artifact name {name!r} is not a plain file name")
            if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
                raise PayloadError(f"artifact {name!r} digest {digest!r} is not a lowercase hex SHA-256")
        object.__setattr__(self, "artifacts", dict(self.artifacts))
        if self.radio is not None:
            if not isinstance(self.radio, RadioTask):
                raise PayloadError("radio must be a RadioTask")
            if self.privacy not in ("grouped", "none"):
                raise PayloadError(f"a radio task's privacy is 'grouped' or 'none', not {self.privacy!r}")
            if (self.privacy == "grouped") != self.radio.guaranteed:
                raise PayloadError(f"radio defence {self.radio.defence!r} needs privacy "
                                   f"{'grouped' if self.radio.guaranteed else 'none'}, got {self.privacy!r}")
            if self.radio.city_artifact not in self.artifacts:
                raise PayloadError(f"a radio task must carry its city raster as artifact {self.radio.city_artifact!r}")
            if self.count_noise_multiplier is not None:
                raise PayloadError("a radio task has no species counts")
        elif self.privacy == "grouped":
            raise PayloadError("privacy 'grouped' is the radio tasks' mechanism: the task must carry radio settings")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"federation_id": self.federation_id, "round": self.round, "model_hash": self.model_hash,
                "local_steps": self.local_steps, "expected_batch_size": self.expected_batch_size,
                "learning_rate": self.learning_rate, "clipping_norm": self.clipping_norm,
                "target_delta": self.target_delta, "planned_rounds": self.planned_rounds,
                "privacy": self.privacy, "budgets": {c.value: v for c, v in self.budgets.items()},
                "halted": [c.value for c in self.halted], "seed": self.seed,
                **({"artifacts": dict(sorted(self.artifacts.items()))} if self.artifacts else {}),
                **({"secagg": self.secagg.to_json()} if self.secagg is not None else {}),
                **({"count_noise_multiplier": self.count_noise_multiplier}
                   if self.count_noise_multiplier is not None else {}),
                **({"radio": self.radio.to_json()} if self.radio is not None else {}),
                **({"ccdp_variant": self.ccdp_variant} if self.privacy == "ccdp" else {}),
                **({"noise_multiplier": self.noise_multiplier} if self.noise_multiplier is not None else {}),
                **({"distributed_noise": True} if self.distributed_noise else {}),
                **({"feature_centre": self.feature_centre} if self.feature_centre is not None else {}),
                **({"class_reweighting": float(self.class_reweighting)} if self.class_reweighting else {}),
                **({"prediction_offsets": list(self.prediction_offsets)}
                   if self.prediction_offsets is not None else {}),
                **({"capacity": self.capacity} if self.capacity is not None else {}),
                **({"round_duration_s": self.round_duration_s} if self.round_duration_s else {}),
                **({"cohorts": {str(c): [x.value for x in h] for c, h in self.cohorts.items()}}
                   if self.cohorts is not None else {}),
                **({"model_digest": self.model_digest} if self.model_digest is not None else {}),
                **({"max_staleness": self.max_staleness} if self.max_staleness is not None else {})}


def encode_task(task: TrainingTask, weights: Mapping[str, np.ndarray],
                artifacts: Mapping[str, bytes] | None = None) -> bytes:
    """Payload of a TASK: the global weights (float32 arrays) with the task as metadata, plus the files of
    ``artifacts`` (``{file name: bytes}``) as uint8 tensors; their names and SHA-256 must be those listed in
    ``task.artifacts`` (the signature over the payload then covers them). A task with ``model_digest`` carries no
    weights: pass ``weights={}``.

    Raises:
        PayloadError: ``artifacts`` and ``task.artifacts`` disagree, a weight name uses the artifact prefix, or
            weights given with a ``model_digest``.
    """
    if task.model_digest is not None and weights:
        raise PayloadError("a task with model_digest carries no weights (they are published on its digest topic)")
    artifacts = dict(artifacts or {})
    listed = {name: hashlib.sha256(data).hexdigest() for name, data in artifacts.items()}
    if listed != dict(task.artifacts):
        raise PayloadError("the artifact files do not match task.artifacts (names and SHA-256 must agree)")
    tensors = _check_weights(weights)
    if any(name.startswith(ARTIFACT_PREFIX) for name in tensors):
        raise PayloadError(f"weight names must not start with {ARTIFACT_PREFIX!r}")
    for name, data in artifacts.items():
        tensors[ARTIFACT_PREFIX + name] = np.frombuffer(bytes(data), dtype=np.uint8)
    return encode_tensors(tensors, _metadata(task.to_json()))


def decode_task_with_artifacts(payload: bytes) -> tuple[TrainingTask, dict[str, np.ndarray], dict[str, bytes]]:
    """Inverse of :func:`encode_task`: ``(task, weights, {artifact file name: bytes})``; ``weights`` is ``{}`` for
    a task with ``model_digest`` (the receiver fetches them by digest).

    Raises:
        PayloadError: as :func:`decode_task`, or an artifact missing, unlisted, not uint8 or with another SHA-256
            than ``task.artifacts`` lists.
    """
    tensors, body = _read(payload, set(TrainingTask.__dataclass_fields__))
    try:
        secagg = SecAggSettings.from_json(body["secagg"]) if body.get("secagg") is not None else None
        radio = RadioTask.from_json(body["radio"]) if body.get("radio") is not None else None
        task = TrainingTask(**{**body, "halted": tuple(body.get("halted", ())), "secagg": secagg, "radio": radio})
    except TypeError as exc:
        raise PayloadError(f"task fields wrong: {exc}") from exc
    files: dict[str, bytes] = {}
    for name in [n for n in tensors if n.startswith(ARTIFACT_PREFIX)]:
        array = tensors.pop(name)
        file_name = name[len(ARTIFACT_PREFIX):]
        if array.dtype != np.uint8 or array.ndim != 1:
            raise PayloadError(f"artifact {file_name!r} must be a 1-D uint8 tensor")
        if file_name not in task.artifacts:
            raise PayloadError(f"artifact {file_name!r} is not listed in the task")
        data = array.tobytes()
        if hashlib.sha256(data).hexdigest() != task.artifacts[file_name]:
            raise PayloadError(f"artifact {file_name!r} does not match its SHA-256 in the task")
        files[file_name] = data
    missing = sorted(set(task.artifacts) - set(files))
    if missing:
        raise PayloadError(f"artifact(s) {missing} listed in the task are missing from the payload")
    if task.model_digest is not None and tensors:
        raise PayloadError("a task with model_digest must carry no weight tensors")
    return task, _check_weights(tensors), files


def decode_task(payload: bytes) -> tuple[TrainingTask, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_task`, without the artifact files (they are still checked).

    Raises:
        PayloadError: not safetensors, missing/unknown fields, values out of range, non-float32 or non-finite
            weights, bad artifacts.
    """
    task, weights, _ = decode_task_with_artifacts(payload)
    return task, weights
