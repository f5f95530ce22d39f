"""Message payloads: what rides inside an envelope.

Every payload is safetensors (:mod:`shared.codec`) whose metadata key ``"wildfed"`` holds the JSON of one of the
frozen dataclasses below; the tensors are model weights (TASK), a model delta (UPDATE) or none (ACK, DETECTION).

Compatibility rules: fields are never removed and never change meaning; new fields are optional with defaults
that keep the old meaning; decoders reject unknown fields so a misread is loud, not silent.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shared.codec import decode_tensors, encode_tensors
from shared.errors import PayloadError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.secagg import SecAggParams

__all__ = ["CCDP_VARIANTS", "SPECIES_STATUSES", "TrainingTask", "UpdateReport", "Ack", "encode_task", "decode_task", "encode_update",
           "decode_update", "encode_ack", "decode_ack", "METADATA_KEY", "ARTIFACT_PREFIX",
           "decode_task_with_artifacts", "Detection", "DetectionRecord",
           "encode_detection", "decode_detection", "SecAggSettings", "SecAggMessage", "SITE_STAGES",
           "COORDINATOR_STAGES", "encode_secagg", "decode_secagg", "canonical_flatten", "canonical_unflatten",
           "RadioTask", "RADIO_DEFENCES", "GUARANTEED_RADIO_DEFENCES", "RADIO_CATEGORY"]

METADATA_KEY = "wildfed"
# TASK tensors whose name starts with this are opaque files (uint8), not weights: e.g. ONNX Runtime training
# artifacts (``coordinator.artifacts``); ``TrainingTask.artifacts`` lists each one's SHA-256.
ARTIFACT_PREFIX = "artifact/"
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # a plain file name: no path, no leading dot
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
PrivacyMode = Literal["ccdp", "global", "grouped", "none"]
PRIVACY_MODES = ("ccdp", "global", "grouped", "none")
#: CCDP's individualized DP-SGD variants (Boenisch et al., NeurIPS 2023, Sec. 4.1 "Sample", 4.2 "Scale")
CCDP_VARIANTS = ("sample", "scale")
RADIO_DEFENCES = ("none", "clip-only", "uniform", "steered-uniform", "adaptive", "grouped-clipping")
"""The upload defences of a radio task (edge_sdk.privacy.adaptive_noise), weakest first."""
GUARANTEED_RADIO_DEFENCES = ("uniform", "adaptive", "grouped-clipping")
"""The radio defences that noise every coordinate, hence state an (eps, delta): privacy ``"grouped"``."""
RADIO_CATEGORY = IUCNCategory.NE
"""The IUCN key of a radio upload's DP event and budget: the ledger keeps one stream per (site, IUCN category) and a
radio map has no species, so its stream is NE, "Not Evaluated"."""


def _category(value: Any) -> IUCNCategory:
    try:
        return IUCNCategory(value)
    except ValueError:
        raise PayloadError(f"{value!r} is not an IUCN category") from None


def _positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = (type(value) is int) if integer else (isinstance(value, (int, float)) and not isinstance(value, bool))
    if not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise PayloadError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} "
                           f"{'integer' if integer else 'number'}, got {value!r}")


def canonical_flatten(tensors: Mapping[str, np.ndarray], *, dtype: type = np.float32) -> np.ndarray:
    """Concatenate float tensors in sorted-name order into one vector (d,) of ``dtype``: the coordinate order of a
    secure-aggregation vector, fixed so that every site and the coordinator agree without exchanging layouts. A site
    flattens its clipped sum with ``dtype=np.float64``, so that nothing rounds it before it is quantised
    (``shared.privacy.sum_rounding``)."""
    if not tensors:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(tensors[name], dtype=dtype).reshape(-1) for name in sorted(tensors)])


def canonical_unflatten(flat: np.ndarray, template: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`canonical_flatten`: a (d,) vector back to ``{name: array of template[name]'s shape}``
    (the vector's dtype is kept).

    Raises:
        PayloadError: ``flat`` is not 1-D of length ``sum(size of template tensors)``.
    """
    flat = np.asarray(flat)
    sizes = {name: int(np.asarray(template[name]).size) for name in sorted(template)}
    if flat.ndim != 1 or flat.shape[0] != sum(sizes.values()):
        raise PayloadError(f"a flat vector of {sum(sizes.values())} values is needed, got shape {flat.shape}")
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = flat[offset:offset + size].reshape(np.asarray(template[name]).shape)
        offset += size
    return out


@dataclass(frozen=True)
class SecAggSettings:
    """Secure-aggregation parameters of a Global DP round, sent in the task (``shared.secagg.SecAggParams`` minus
    the federation id and round, which the task already holds).

    Attributes:
        site_ids: the round's selected sites (U of Bonawitz et al. 2017, Fig. 4), sorted.
        threshold: t (2 <= t <= n, 2t > n). vector_length: d (model parameters, :func:`canonical_flatten` order).
        max_abs_value: B, per-coordinate box of a site's clipped gradient sum (same unit as the gradient).
        scale: quantisation steps per unit. modulus_bits: k (masks and sums in Z_{2^k}).
        colluding_sites: f, distributed-noise tasks only: how many colluding participants the noise must survive.
            Each site adds Skellam variance ``mu / (t - f)`` (``shared.privacy.distributed.skellam_share_variance``),
            so the shares of any t - f survivors carry the whole planned noise mu: t survivors less the f shares
            that colluders know of still do. 0 <= f < t. 0 (the default, left out of the JSON, so a task without
            the field reads as it was written) = shares of ``mu / t``, whose guarantee holds against the
            coordinator and non-participants but not against a participant, which knows its own share.
    """

    site_ids: tuple[str, ...]
    threshold: int
    vector_length: int
    max_abs_value: float
    scale: float
    modulus_bits: int = 32
    colluding_sites: int = 0

    _OPTIONAL = frozenset({"colluding_sites"})  # fields a sender may leave out (their default keeps the old meaning)

    def __post_init__(self) -> None:
        if not isinstance(self.site_ids, (tuple, list)) or not all(isinstance(x, str) for x in self.site_ids):
            raise PayloadError(f"secagg.site_ids must be a list of site ids, got {self.site_ids!r}")
        object.__setattr__(self, "site_ids", tuple(sorted(self.site_ids)))
        f = self.colluding_sites
        if type(f) is not int or f < 0 or (type(self.threshold) is int and f >= self.threshold):
            raise PayloadError(f"secagg.colluding_sites must be an integer from 0 to threshold - 1 "
                               f"({self.threshold!r} - 1), got {f!r}")

    def params(self, federation_id: str, round: int) -> SecAggParams:
        """The full parameters of round ``round``.

        Raises:
            PayloadError: the values do not form valid parameters (``SecAggParams`` refuses them).
        """
        try:
            return SecAggParams(federation_id=federation_id, round=round, site_ids=tuple(self.site_ids),
                                threshold=self.threshold, vector_length=self.vector_length,
                                max_abs_value=self.max_abs_value, scale=self.scale, modulus_bits=self.modulus_bits)
        except ValueError as exc:  # ConfigError
            raise PayloadError(f"secagg parameters invalid: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``colluding_sites`` left out when 0)."""
        return {"site_ids": sorted(self.site_ids), "threshold": self.threshold, "vector_length": self.vector_length,
                "max_abs_value": self.max_abs_value, "scale": self.scale, "modulus_bits": self.modulus_bits,
                **({"colluding_sites": self.colluding_sites} if self.colluding_sites else {})}

    @classmethod
    def from_json(cls, body: Any) -> "SecAggSettings":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: not an object, unknown or missing fields, wrong types.
        """
        fields_ = set(cls.__dataclass_fields__)
        required = fields_ - cls._OPTIONAL
        if not isinstance(body, Mapping) or not required <= set(body) <= fields_:
            raise PayloadError(f"secagg must be an object with fields {sorted(required)} "
                               f"(optional: {sorted(cls._OPTIONAL)})")
        if not isinstance(body["site_ids"], list) or not all(isinstance(x, str) for x in body["site_ids"]):
            raise PayloadError("secagg.site_ids must be a list of site ids")
        return cls(**{**body, "site_ids": tuple(body["site_ids"])})


@dataclass(frozen=True)
class RadioTask:
    """The radio-map part of a task for base-station gateways (docs/radiomap.md).

    A radio task trains the two-stage RadioUNet (``shared.models.radio_unet``) on the site's radio maps and uploads
    the whole clipped delta through the grouped-noise defence. It reuses the task's generic fields with these
    meanings: ``local_steps`` = local epochs over the site's maps, ``expected_batch_size`` = mini-batch,
    ``learning_rate`` = local Adam step size, ``clipping_norm`` = C of the whole update (L2).

    Attributes:
        defence: one of :data:`RADIO_DEFENCES`; the task's privacy is ``"grouped"`` exactly when it is one of
            :data:`GUARANTEED_RADIO_DEFENCES`, else ``"none"``.
        noise_multiplier: z; each upload's noise budget is d (zC)^2.
        floor_fraction: phi in (0, 1], the adaptive defence's uniform floor.
        width: the RadioUNet's base width (the model's shape).
        allocator_every: the gateway retrains its allocator every this many rounds (round 1 included).
        proxy_sites, proxy_maps: public proxy sites on the city raster for the allocator's training, maps each.
        site_radius_m: radius (metres) of a proxy site's transmitter cluster.
        metres_per_pixel: the maps' resolution.
        max_walls: the path-loss model's wall cap for the proxies' maps (None: no cap).
        city_artifact: file name of the task artifact holding the public city raster (safetensors, ``buildings``
            uint8 (H, W), 1 inside buildings).

    Raises:
        PayloadError: a value out of range.
    """

    defence: str
    noise_multiplier: float
    floor_fraction: float = 0.5
    width: int = 8
    allocator_every: int = 5
    proxy_sites: int = 12
    proxy_maps: int = 8
    site_radius_m: float = 20.0
    metres_per_pixel: float = 4.0
    max_walls: int | None = 4
    city_artifact: str = "radio-city.safetensors"

    def __post_init__(self) -> None:
        if self.defence not in RADIO_DEFENCES:
            raise PayloadError(f"radio defence must be one of {RADIO_DEFENCES}, got {self.defence!r}")
        _positive("radio.noise_multiplier", self.noise_multiplier)
        _positive("radio.floor_fraction", self.floor_fraction)
        if self.floor_fraction > 1:
            raise PayloadError(f"radio.floor_fraction must be in (0, 1], got {self.floor_fraction!r}")
        for name in ("width", "allocator_every", "proxy_sites", "proxy_maps"):
            _positive(f"radio.{name}", getattr(self, name), integer=True)
        if self.proxy_sites < 3:
            raise PayloadError(f"radio.proxy_sites must be >= 3, got {self.proxy_sites}")
        _positive("radio.site_radius_m", self.site_radius_m)
        _positive("radio.metres_per_pixel", self.metres_per_pixel)
        if self.max_walls is not None:
            _positive("radio.max_walls", self.max_walls, integer=True)
        if not isinstance(self.city_artifact, str) or not _ARTIFACT_NAME.match(self.city_artifact):
            raise PayloadError(f"radio.city_artifact {self.city_artifact!r} is not a plain file name")

    @property
    def guaranteed(self) -> bool:
        """Whether the defence states an (eps, delta) (privacy ``"grouped"``)."""
        return self.defence in GUARANTEED_RADIO_DEFENCES

    def floor_noise_multiplier(self) -> float:
        """z_eff of one upload: sqrt(phi) z / 2 (adaptive), z / 2 (uniform, and grouped-clipping, whose per-group
        norms and noise are calibrated to it) (edge_sdk.privacy.adaptive_noise, "Formal guarantee").

        Raises:
            PayloadError: the defence states no guarantee.
        """
        if self.defence == "adaptive":
            return math.sqrt(self.floor_fraction) * self.noise_multiplier / 2.0
        if self.defence in ("uniform", "grouped-clipping"):
            return self.noise_multiplier / 2.0
        raise PayloadError(f"the {self.defence} defence states no guarantee")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"defence": self.defence, "noise_multiplier": float(self.noise_multiplier),
                "floor_fraction": float(self.floor_fraction), "width": self.width,
                "allocator_every": self.allocator_every, "proxy_sites": self.proxy_sites,
                "proxy_maps": self.proxy_maps, "site_radius_m": float(self.site_radius_m),
                "metres_per_pixel": float(self.metres_per_pixel), "max_walls": self.max_walls,
                "city_artifact": self.city_artifact}

    @classmethod
    def from_json(cls, data: Any) -> "RadioTask":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: not an object, unknown fields, or values out of range.
        """
        if not isinstance(data, dict):
            raise PayloadError("radio must be an object")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise PayloadError(f"unknown radio task fields {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise PayloadError(f"radio task fields wrong: {exc}") from exc


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

    def __post_init__(self) -> None:
        _positive("round", self.round, integer=True, allow_zero=True)
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
                   if self.cohorts is not None else {})}


@dataclass(frozen=True)
class UpdateReport:
    """What a site reports with its model delta (the payload tensors).

    Attributes:
        num_examples: N_k, the weight the site is counted with in FedAvg: its declared capacity (the task's
            ``capacity``), a public constant that does not depend on the site's data (docs/privacy.md, "No uncharged
            counts"); the coordinator refuses a report whose N_k is not the site's enrolled capacity. (In-process
            simulations without a capacity report the dataset's size.)
        local_steps: steps actually run.
        events: per IUCN category, the DP-SGD event that was run (empty for privacy "none").
        species_counts: ``{class index: noisy record count}`` for every class of the model when the task asked
            for counts (``TrainingTask.count_noise_multiplier``), else empty (then left out of the JSON).
        count_events: per active IUCN category, the event of that count release: ``DPSGDEvent(z_count, 1.0, 1)``
            (one Gaussian release, no subsampling); empty when none (left out of the JSON).
    """

    num_examples: int
    local_steps: int
    events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)
    species_counts: Mapping[int, float] = field(default_factory=dict)
    count_events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("num_examples", self.num_examples, integer=True, allow_zero=True)
        _positive("local_steps", self.local_steps, integer=True, allow_zero=True)
        for name in ("events", "count_events"):
            parsed = {_category(k): v for k, v in dict(getattr(self, name)).items()}
            for v in parsed.values():
                if not isinstance(v, DPSGDEvent):
                    raise PayloadError(f"event {v!r} is not a DPSGDEvent")
            object.__setattr__(self, name, parsed)
        counts: dict[int, float] = {}
        for k, v in dict(self.species_counts).items():
            try:
                index = int(k)
            except (TypeError, ValueError):
                raise PayloadError(f"species_counts key {k!r} is not a class index") from None
            if index < 0 or str(index) != str(k).strip() or isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v):
                raise PayloadError(f"species_counts[{k!r}] = {v!r}: need a class index and a finite number")
            counts[index] = float(v)
        object.__setattr__(self, "species_counts", counts)
        if bool(counts) != bool(self.count_events) and self.count_events:
            raise PayloadError("count_events without species_counts")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"num_examples": self.num_examples, "local_steps": self.local_steps,
                "events": {c.value: e.to_json() for c, e in self.events.items()},
                **({"species_counts": {str(k): v for k, v in sorted(self.species_counts.items())}}
                   if self.species_counts else {}),
                **({"count_events": {c.value: e.to_json() for c, e in self.count_events.items()}}
                   if self.count_events else {})}


@dataclass(frozen=True)
class Ack:
    """The coordinator's answer to an update: stored durably (``accepted``) or rejected with ``reason``."""

    round: int
    accepted: bool
    reason: str = ""


def _metadata(obj: Any) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(obj, sort_keys=True, separators=(",", ":"))}


def _read(payload: bytes, fields: set[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    tensors, metadata = decode_tensors(payload)
    if METADATA_KEY not in metadata:
        raise PayloadError(f"payload has no '{METADATA_KEY}' metadata")
    try:
        body = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise PayloadError(f"'{METADATA_KEY}' metadata is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise PayloadError("metadata body is not an object")
    unknown = set(body) - fields
    if unknown:
        raise PayloadError(f"unknown fields {sorted(unknown)}")
    return tensors, body


def _check_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        array = np.asarray(value)
        if array.dtype != np.float32:
            raise PayloadError(f"tensor {name!r} has dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise PayloadError(f"tensor {name!r} holds non-finite values")
        out[name] = array
    return out


def encode_task(task: TrainingTask, weights: Mapping[str, np.ndarray],
                artifacts: Mapping[str, bytes] | None = None) -> bytes:
    """Payload of a TASK: the global weights (float32 arrays) with the task as metadata, plus the files of
    ``artifacts`` (``{file name: bytes}``) as uint8 tensors; their names and SHA-256 must be those listed in
    ``task.artifacts`` (the signature over the payload then covers them).

    Raises:
        PayloadError: ``artifacts`` and ``task.artifacts`` disagree, or a weight name uses the artifact prefix.
    """
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
    """Inverse of :func:`encode_task`: ``(task, weights, {artifact file name: bytes})``.

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
    return task, _check_weights(tensors), files


def decode_task(payload: bytes) -> tuple[TrainingTask, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_task`, without the artifact files (they are still checked).

    Raises:
        PayloadError: not safetensors, missing/unknown fields, values out of range, non-float32 or non-finite
            weights, bad artifacts.
    """
    task, weights, _ = decode_task_with_artifacts(payload)
    return task, weights


def encode_update(report: UpdateReport, delta: Mapping[str, np.ndarray]) -> bytes:
    """Payload of an UPDATE: the model delta (local minus global, float32) with the report as metadata."""
    return encode_tensors(_check_weights(delta), _metadata(report.to_json()))


def decode_update(payload: bytes, *, check_weights: bool = True) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """Inverse of :func:`encode_update`.

    Args:
        payload: the UPDATE payload bytes.
        check_weights: refuse non-float32 or non-finite tensors (default). False returns the tensors as stored, for
            a caller that checks them against the model itself (the coordinator's ingest, which gives those
            failures their own reason codes) without decoding the payload twice.

    Raises:
        PayloadError: as :func:`decode_task`, or a malformed DP event.
    """
    tensors, body = _read(payload, set(UpdateReport.__dataclass_fields__))
    events, count_events = body.get("events", {}), body.get("count_events", {})
    counts = body.get("species_counts", {})
    if not isinstance(events, dict) or not isinstance(count_events, dict):
        raise PayloadError("events and count_events must be objects keyed by IUCN category")
    if not isinstance(counts, dict):
        raise PayloadError("species_counts must be an object keyed by class index")
    try:
        report = UpdateReport(num_examples=body.get("num_examples"), local_steps=body.get("local_steps"),
                              events={k: DPSGDEvent.from_json(v) for k, v in events.items()},
                              species_counts=counts,
                              count_events={k: DPSGDEvent.from_json(v) for k, v in count_events.items()})
    except TypeError as exc:
        raise PayloadError(f"update fields wrong: {exc}") from exc
    return report, _check_weights(tensors) if check_weights else tensors


def encode_ack(ack: Ack) -> bytes:
    """Payload of an ACK (no tensors)."""
    return encode_tensors({}, _metadata({"round": ack.round, "accepted": ack.accepted, "reason": ack.reason}))


def decode_ack(payload: bytes) -> Ack:
    """Inverse of :func:`encode_ack`.

    Raises:
        PayloadError: malformed payload.
    """
    _, body = _read(payload, {"round", "accepted", "reason"})
    if type(body.get("round")) is not int or not isinstance(body.get("accepted"), bool):
        raise PayloadError("ack needs an integer round and a boolean accepted")
    return Ack(round=body["round"], accepted=body["accepted"], reason=str(body.get("reason", "")))


# ---- detection records (DETECTION envelopes, site -> coordinator) -------------------------------------------------

#: ``Detection.species_status`` values (see :class:`Detection`).
SPECIES_STATUSES = frozenset({"confident", "unexpected", "unknown"})
_BBOX_SLACK = 1e-6  # rounding slack when checking that a normalised box lies inside the image


def _unit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise PayloadError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Detection:
    """One detected object in an image.

    Attributes:
        category: detector category name (``"animal"``; the YOLOX-tiny detector has this one class).
        confidence: detector confidence in [0, 1] (objectness x class score).
        bbox: ``(x_min, y_min, width, height)`` normalised by the image width and height, origin top-left (the
            MegaDetector and Camtrap DP ``bbox*`` convention); the box lies inside the image.
        species: scientific name (or class label) of the classifier's top class, or None when no classifier ran.
        species_index: the classifier's class index, or None.
        species_confidence: the classifier's softmax probability of that class in [0, 1], or None.
        species_status: how the gateway reads its classifier's answer, or None when no classifier ran (and in
            records from gateways that predate it): ``"confident"`` (the species is above the site's confidence
            threshold and in the site's species table), ``"unexpected"`` (above the threshold but not in the
            site's species table: shown as "unexpected at this site", never suppressed) or ``"unknown"`` (below the
            threshold: ``species`` is None, and ``species_index`` / ``species_confidence`` keep the best guess for
            reference).
    """

    category: str
    confidence: float
    bbox: tuple[float, float, float, float]
    species: str | None = None
    species_index: int | None = None
    species_confidence: float | None = None
    species_status: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.category, str) or not self.category:
            raise PayloadError(f"detection category must be a non-empty string, got {self.category!r}")
        object.__setattr__(self, "confidence", _unit("confidence", self.confidence))
        if not isinstance(self.bbox, (tuple, list)) or len(self.bbox) != 4:
            raise PayloadError(f"bbox must be 4 numbers (x, y, w, h), got {self.bbox!r}")
        x, y, w, h = (_unit(f"bbox[{i}]", v) for i, v in enumerate(self.bbox))
        if x + w > 1.0 + _BBOX_SLACK or y + h > 1.0 + _BBOX_SLACK:
            raise PayloadError(f"bbox {self.bbox!r} extends past the image")
        object.__setattr__(self, "bbox", (x, y, w, h))
        if self.species is not None and not isinstance(self.species, str):
            raise PayloadError(f"species must be a string or null, got {self.species!r}")
        if self.species_index is not None and (type(self.species_index) is not int or self.species_index < 0):
            raise PayloadError(f"species_index must be a non-negative integer or null, got {self.species_index!r}")
        if self.species_confidence is not None:
            object.__setattr__(self, "species_confidence", _unit("species_confidence", self.species_confidence))
        if self.species_status is not None and self.species_status not in SPECIES_STATUSES:
            raise PayloadError(f"species_status must be one of {sorted(SPECIES_STATUSES)} or null, "
                               f"got {self.species_status!r}")
        if self.species_status == "unknown" and self.species is not None:
            raise PayloadError("a detection whose species_status is 'unknown' names no species")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        body = {"category": self.category, "confidence": self.confidence, "bbox": list(self.bbox),
                "species": self.species, "species_index": self.species_index,
                "species_confidence": self.species_confidence}
        if self.species_status is not None:  # written only when set: readers that predate it still parse
            body["species_status"] = self.species_status
        return body


@dataclass(frozen=True)
class DetectionRecord:
    """What a gateway's detector and species classifier made of one image (one DETECTION envelope).

    Attributes:
        media_id: stable id of the image: the first 32 hex digits of the SHA-256 of the file's bytes (the same
            photo always gets the same id, so the coordinator can drop re-deliveries).
        file: path of the image relative to the folder the run was given (POSIX separators).
        deployment_id: Camtrap DP deployment (camera placement) the image belongs to.
        timestamp: capture time, ISO 8601 with a UTC offset (EXIF ``DateTimeOriginal``, else file mtime).
        timestamp_source: ``"exif"``, ``"mtime"``, or ``"run"`` (file unreadable: the time of the run).
        width, height: image size in pixels.
        detections: the detections kept after the confidence threshold and NMS, most confident first; empty
            for an image with none.
        detector: detector id (model name and the first 12 hex digits of its checkpoint SHA-256).
        classifier_hash: ``shared.codec.model_hash`` of the species classifier weights, or ``""``.
        failure: why the image could not be processed, or None (then ``detections`` is empty).
        event_id: the Camtrap DP ``eventID`` of the event (photos of one deployment close in time) the image
            belongs to on its gateway, or None. Written to JSON only when set.

    Compatibility rules: those of the module (fields never removed, new fields optional).
    """

    media_id: str
    file: str
    deployment_id: str
    timestamp: str
    timestamp_source: str
    width: int
    height: int
    detections: tuple[Detection, ...] = ()
    detector: str = ""
    classifier_hash: str = ""
    failure: str | None = None
    event_id: str | None = None

    def __post_init__(self) -> None:
        if self.event_id is not None and (not isinstance(self.event_id, str) or not self.event_id):
            raise PayloadError(f"event_id must be a non-empty string or null, got {self.event_id!r}")
        for name in ("media_id", "file", "deployment_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise PayloadError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("timestamp", "timestamp_source", "detector", "classifier_hash"):
            if not isinstance(getattr(self, name), str):
                raise PayloadError(f"{name} must be a string, got {getattr(self, name)!r}")
        _positive("width", self.width, integer=True, allow_zero=self.failure is not None)
        _positive("height", self.height, integer=True, allow_zero=self.failure is not None)
        detections = tuple(self.detections)
        if not all(isinstance(d, Detection) for d in detections):
            raise PayloadError("detections must be Detection objects")
        if self.failure is not None and (not isinstance(self.failure, str) or detections):
            raise PayloadError("a failed record has a failure string and no detections")
        object.__setattr__(self, "detections", detections)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"media_id": self.media_id, "file": self.file, "deployment_id": self.deployment_id,
                "timestamp": self.timestamp, "timestamp_source": self.timestamp_source, "width": self.width,
                "height": self.height, "detections": [d.to_json() for d in self.detections],
                "detector": self.detector, "classifier_hash": self.classifier_hash, "failure": self.failure,
                **({"event_id": self.event_id} if self.event_id is not None else {})}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "DetectionRecord":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: unknown or missing fields, bad values.
        """
        if not isinstance(body, Mapping):
            raise PayloadError("detection record is not an object")
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise PayloadError(f"unknown fields {sorted(unknown)}")
        raw = body.get("detections", [])
        if not isinstance(raw, list):
            raise PayloadError("detections must be a list")
        detections = []
        for d in raw:
            if not isinstance(d, Mapping) or set(d) - set(Detection.__dataclass_fields__):
                raise PayloadError(f"detection {d!r} is not an object with known fields")
            try:
                detections.append(Detection(**{**d, "bbox": tuple(d.get("bbox", ()))}))
            except TypeError as exc:
                raise PayloadError(f"detection fields wrong: {exc}") from exc
        try:
            return cls(**{**body, "detections": tuple(detections)})
        except TypeError as exc:
            raise PayloadError(f"detection record fields wrong: {exc}") from exc


def encode_detection(record: DetectionRecord) -> bytes:
    """Payload of a DETECTION: no tensors, the record as metadata."""
    return encode_tensors({}, _metadata(record.to_json()))


def decode_detection(payload: bytes) -> DetectionRecord:
    """Inverse of :func:`encode_detection`.

    Raises:
        PayloadError: not safetensors, tensors present, unknown/missing fields, values out of range.
    """
    tensors, body = _read(payload, set(DetectionRecord.__dataclass_fields__))
    if tensors:
        raise PayloadError(f"a detection payload carries no tensors, got {sorted(tensors)[:5]}")
    return DetectionRecord.from_json(body)


# ---- secure aggregation stages (SECAGG envelopes, Global DP mode) --------------------------------------------------

SITE_STAGES = ("keys", "shares", "masked", "recovery")
"""Stages a site sends on its ``secagg`` topic (Bonawitz et al. 2017, Fig. 4 rounds 0, 1, 2 and 4)."""
COORDINATOR_STAGES = ("key_list", "share_inbox", "recovery_request", "round_end")
"""Stages the coordinator sends on a site's ``task`` topic: the U1 key list, the site's share inbox, the recovery
request (U3 and the dropped sites), and the end of the round (the site forgets its secagg state)."""
MASKED_TENSOR = "masked"


@dataclass(frozen=True)
class SecAggMessage:
    """One secure-aggregation message.

    Attributes:
        stage: one of :data:`SITE_STAGES` or :data:`COORDINATOR_STAGES`.
        body: JSON object; per stage: ``keys``: ``AdvertisedKeys.to_json()``; ``shares`` and ``share_inbox``:
            ``{"shares": [EncryptedShare.to_json(), ...]}``; ``masked``: ``{"num_examples": N_k, "categories":
            [IUCN codes of the site's active categories]}`` (both declared public metadata); ``recovery``:
            ``RecoveryShares.to_json()``; ``key_list``: ``{"keys": [AdvertisedKeys.to_json(), ...]}``;
            ``recovery_request``: ``RecoveryRequest.to_json()``; ``round_end``: ``{"status": str, "reason": str}``.
        masked: the masked, quantised gradient sum (uint32 or uint64, shape (d,)) for stage ``masked``; else None.
    """

    stage: str
    body: Mapping[str, Any]
    masked: np.ndarray | None = None


def encode_secagg(message: SecAggMessage) -> bytes:
    """Payload of a SECAGG envelope: the body as metadata, plus the masked vector as tensor ``"masked"``.

    Raises:
        PayloadError: unknown stage, or a masked vector missing / present where it does not belong.
    """
    if message.stage not in SITE_STAGES + COORDINATOR_STAGES:
        raise PayloadError(f"unknown secagg stage {message.stage!r}")
    if (message.masked is not None) != (message.stage == "masked"):
        raise PayloadError("a masked vector travels with stage 'masked' and only with it")
    tensors = {} if message.masked is None else {MASKED_TENSOR: np.ascontiguousarray(message.masked)}
    return encode_tensors(tensors, _metadata({"stage": message.stage, "body": dict(message.body)}))


def decode_secagg(payload: bytes, *, stages: tuple[str, ...]) -> SecAggMessage:
    """Inverse of :func:`encode_secagg`, accepting only ``stages`` (the sender side's stages).

    Raises:
        PayloadError: not safetensors, unknown fields, a stage not in ``stages``, a body that is not an object,
            or a masked vector that is missing, misplaced, not 1-D, or not uint32/uint64.
    """
    tensors, body = _read(payload, {"stage", "body"})
    stage = body.get("stage")
    if stage not in stages:
        raise PayloadError(f"secagg stage {stage!r} is not one of {stages}")
    if not isinstance(body.get("body"), dict):
        raise PayloadError("secagg body must be an object")
    masked = tensors.pop(MASKED_TENSOR, None)
    if tensors:
        raise PayloadError(f"unexpected tensors {sorted(tensors)[:5]} in a secagg message")
    if (masked is not None) != (stage == "masked"):
        raise PayloadError("a masked vector travels with stage 'masked' and only with it")
    if masked is not None and (masked.ndim != 1 or masked.dtype not in (np.uint32, np.uint64)):
        raise PayloadError(f"the masked vector must be 1-D uint32/uint64, got {masked.dtype} {masked.shape}")
    return SecAggMessage(stage=stage, body=body["body"], masked=masked)
