"""Site configuration of a gateway: who it is, where its data and keys are, how it reaches the coordinator.

A site config is a YAML file validated by pydantic (docs/configuration.md: configs are pydantic models
loaded from YAML). Relative paths in the file are resolved against the directory of the file, so a site folder
can be moved as a whole.

Example::

    federation_id: wildfed-demo
    site_id: site-03
    dataset: data/camtrap            # a Camtrap DP 1.0 package directory
    species:
      - {scientific_name: Loxodonta cyclotis, class_index: 5, iucn_category: CR}
      - {scientific_name: Equus quagga, class_index: 9, iucn_category: NT}
    private_key: keys/site.key       # Ed25519 PEM, 0600
    coordinator_public_key: keys/coordinator.pub
    broker_url: mqtt://127.0.0.1:1883     # or mqtts://broker.example.org:8883 (TLS) with:
    # broker_ca_file: keys/broker-ca.pem            the CA that signed the broker's certificate
    # broker_password_file: keys/broker-credentials.yaml   {username, password}, mode 0600 (broker-config)
    # broker_cert_file / broker_key_file: keys/client.crt / keys/client.key   (mutual TLS, optional)
    outbox: state/outbox.sqlite
    profile: jetson-orin-nano        # optional: firmware_configs/jetson-orin-nano.yaml
    threads: 2                       # overrides the profile
    backbone: efficientnet-lite0     # the frozen backbone; every site of a federation uses the same one
    embedding_input_size: 128        # its input size in px (default: the backbone's default size)
    model_dir: models                # the backbone's and detector's ONNX graphs from the site's bundle

Privacy-relevant switches are off by default and can only be turned on by the site itself, never by a task:
``allow_non_private`` (accept tasks with ``privacy: none``), ``allow_global_dp`` (accept ``privacy: global``
tasks: the site sends its clipped but unnoised gradient sum, hidden only by secure aggregation, and trusts the
coordinator to add the noise) and ``allow_seeded_noise`` (honour a task's ``seed``, which lets whoever chose the
seed reproduce, and subtract, the privacy noise). ``min_round_duration_s`` is the site's own floor on the
time padding of its replies: a task that pads less is refused, so that a coordinator cannot turn the padding off.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from shared.broker import DEFAULT_BROKER_MAX_PACKET_BYTES, check_broker_fields, check_chunk_fits, check_failover_urls
from shared.envelope import validate_identifier
from shared.errors import ConfigError, MalformedEnvelopeError
from shared.iucn import IUCNCategory
from shared.models.backbone_variants import BACKBONE_NAMES, DEFAULT_BACKBONE, get_variant

from edge_sdk.federation_plan import FederationPlan
from edge_sdk.field.settings import FieldSettings

__all__ = ["SpeciesEntry", "SiteConfig", "load_site_config", "global_model_path", "species_table_from_entries"]


class SpeciesEntry(BaseModel):
    """One row of a site's species table: a scientific name, its model class and its IUCN Red List category.

    The IUCN category is public metadata that decides the record's CCDP budget (docs/privacy.md, "Unit and
    neighbouring relation"; categories per the IUCN Red List Categories and Criteria v3.1).

    Attributes:
        scientific_name: exactly as written in the Camtrap DP ``observations.csv`` ``scientificName`` column.
        class_index: index of the class in the federation's model output, ``>= 0``.
        iucn_category: one of CR, EN, VU, NT, LC, NE.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scientific_name: str = Field(min_length=1)
    class_index: int = Field(ge=0)
    iucn_category: IUCNCategory


def species_table_from_entries(entries: list[SpeciesEntry] | tuple[SpeciesEntry, ...]) -> dict[str, SpeciesEntry]:
    """Index species entries by scientific name.

    Raises:
        ConfigError: a scientific name appears twice.
    """
    table: dict[str, SpeciesEntry] = {}
    for entry in entries:
        if entry.scientific_name in table:
            raise ConfigError(
                f"species {entry.scientific_name!r} is listed twice",
                field="species",
                fix="keep one entry per scientific name",
            )
        table[entry.scientific_name] = entry
    return table


class SiteConfig(BaseModel):
    """A gateway's site configuration (see the module docstring for the YAML form).

    Attributes:
        federation_id, site_id: identities used in envelopes and MQTT topics (``shared.topics``).
        task: ``"camera"`` (camera traps: a Camtrap DP package and a species table) or ``"radiomap"`` (a radio
            base station: ``dataset`` is the site's radio maps, a :class:`shared.radio.RadioMapSet` safetensors file;
            no species table; it trains only tasks that carry ``radio`` settings, docs/radiomap.md).
        dataset: directory of the site's Camtrap DP 1.0 package, or the radio-map file of a ``radiomap`` site.
        species: the site's species table (camera sites, at least one entry); its IUCN categories are the site's
            CCDP categories.
        private_key: the site's Ed25519 private key (PEM).
        coordinator_public_key: the coordinator's Ed25519 public key (PEM); tasks and acks must verify with it.
        broker_url: ``mqtt://host:port``, or ``mqtts://host:port`` for TLS (default port 8883).
        broker_failover_urls: further nodes of a broker cluster, same scheme, tried in turn when the current one
            cannot be reached (docs/brokers.md, "Failover"); default none.
        broker_ca_file: PEM CA bundle that signs the broker's certificate (``mqtts://``; default: system CAs, or the
            installed profile's ``broker.ca_file``).
        broker_cert_file, broker_key_file: PEM client certificate and key (mutual TLS; both or neither).
        broker_username: MQTT username (default: the one in ``broker_password_file``).
        broker_password_file: YAML ``{username, password}`` (mode 0600) written by ``wildfed-coordinator
            broker-config`` as ``sites/<id>/broker-credentials.yaml``; read when the transport is built.
        outbox: path of the SQLite outbox (created if absent).
        profile: a firmware profile name (``firmware_configs/<name>.yaml``) or path; it supplies ``backend``,
            ``device``, ``threads`` and ``microbatch_size`` where this config leaves them unset.
        backend: name of a registered training backend (``edge_sdk.backends``: ``torch``, ``ort``) or ``auto``
            (``ort`` for tasks that carry ONNX Runtime artifacts where ``onnxruntime.training`` imports, ``torch``
            otherwise); default: the profile's, else ``"torch"``.
        artifact_cache: folder where ORT training artifacts are cached by model hash; default
            ``<outbox folder>/ort-artifacts``.
        device: torch device (``cpu``, ``cuda``); default ``cpu``.
        threads: CPU threads the backend may use, ``>= 1``; default 1.
        microbatch_size: per-example gradients are computed this many examples at a time (memory cap);
            default 64.
        embedding_cache: folder of the backbone-embedding cache (``edge_sdk.data.embedding``); default
            ``<outbox folder>/embeddings``.
        calibration_cache: folder of the persistent cache of CCDP calibrations
            (:mod:`shared.privacy.calibration_cache`: public values, JSON, re-checked with the accountant when read);
            default ``<wildfed cache>/calibration`` (``$WILDFED_CACHE`` or ``~/.cache/wildfed``), shared by the
            sites of one machine.
        backbone: the frozen image backbone that embeds each record (``efficientnet-lite0``, ``efficientnet-lite1``
            or ``efficientnet-lite2``; ``shared.models.backbone_variants``). Every site of a federation must use
            the same backbone and input size: a head trained on one backbone's embeddings means nothing on
            another's. Default ``efficientnet-lite0``.
        embedding_input_size: the backbone's input size S in pixels; default the backbone's
            ``default_input_size`` (Lite0: 128, chosen by measurement; Lite1: 240; Lite2: 260, their native
            sizes). Comparison on real camera-trap photos: docs/results/real-photo-backbones.md.
        model_dir: folder of the ONNX graphs the gateway runs, as ``install-bundle`` writes them from the bundle:
            ``backbone/<variant>-<sha12>-p1-<S>px-opset17.onnx`` (the embedder of ``backbone`` at
            ``embedding_input_size``) and ``detector/yolox_tiny-<sha12>-opset17.onnx``
            (:mod:`shared.models.gateway_graphs`). Searched before the WildFed cache; a graph in neither is exported
            there, which needs torch. ``wildfed-edge check-config`` reports a missing one. Default: none (the cache).
        feature_centre: a public centre of the embeddings (safetensors, :mod:`shared.models.feature_centre`):
            local DP-SGD rounds then train on ``x - c`` (the updates stay in the plain form). It must come from
            public images, never from this site's records. Global DP rounds ignore it. Default: none.
        logit_adjustment: under CCDP, train with the logit-adjusted loss for the species table's categories (the
            head's bias shifted by ``log w_c``, the relative weight CCDP gives category c's records:
            ``edge_sdk.training.train_locally``), so that sampling the threatened species less often does not
            teach the model to predict them less often. A public constant; the privacy events are unchanged.
            It also hands the species table to the task's class re-weighting (``TrainingTask.class_reweighting``),
            which needs it. Default: on.
        num_classes: model output size; ``None`` means ``max(class_index) + 1``.
        class_names: ``{class index: scientific name}`` for every class of the federation's model (public; what
            ``wildfed-edge detect`` names a prediction of a species this site does not list). Naming only: the
            site's CCDP categories come from ``species`` alone. Default: the site's own species.
        allow_non_private: accept tasks whose ``privacy`` is ``"none"`` (default: refuse them).
        allow_global_dp: accept tasks whose ``privacy`` is ``"global"`` (secure aggregation; the coordinator adds
            the noise; default: refuse them, the site adds its own noise in ``"ccdp"`` mode only).
        allow_seeded_noise: honour a task's ``seed`` for sampling and noise (default: ignore it and use a
            cryptographically secure source).
        min_round_duration_s: seconds; refuse a task whose ``round_duration_s`` (the public time slot the site's
            replies wait for, :mod:`edge_sdk.privacy.timing`) is shorter. 0 (default): take the coordinator's
            value, none included. Set it where the timing of the site's replies should not depend on trusting the
            coordinator to pad them.
        missing_media: ``"error"`` or ``"skip"``: what the loader does with a media file that is absent.
        incoming: the folder new photos arrive in (an SD-card drop, a cellular camera's upload folder); ``wildfed-edge
            run`` watches it, detects and classifies each photo and appends it to the package (``dataset``); none:
            no watching (:mod:`edge_sdk.field`).
        field: how those photos are handled (:class:`edge_sdk.field.settings.FieldSettings`: settle time, event gap,
            thresholds, deployments).
        federation_plan: the coordinator's training plan written at provisioning (:mod:`edge_sdk.federation_plan`;
            the learnability report's plan before the first round).
        train_on: which records train: ``verified`` (default: photos whose last classification is a person's,
            ``classificationMethod: human``, as a ranger's review writes them) or ``machine`` (also photos the
            gateway's model classified with ``classificationProbability >= machine_threshold``, for operators who
            accept training on the model's own confident guesses).
        machine_threshold: the probability a machine observation needs with ``train_on: machine``.
        chunk_size_bytes: uploads larger than this go as a signed manifest and chunks of at most this many bytes
            (``shared.transfer``; default 256 KiB, at most 1 MiB: the coordinator's default chunk limit). Updates
            are sealed with the largest power of two not above it as their piece size
            (``shared.transfer.piece_size_for``), and their chunks are those pieces: a value that is a power of two
            is used exactly. Checked at load against ``broker_max_packet_bytes`` (a chunk adds 40 bytes, MQTT at
            most 256).
        broker_max_packet_bytes: the broker's limit on one MQTT message, bytes (Mosquitto ``max_packet_size``,
            EMQX ``mqtt.max_packet_size``); default what ``wildfed-coordinator broker-config`` sets,
            1,115,136. A broker drops larger messages, so a chunk size that does not fit is refused at start-up.
        max_chunk_requests: a chunk of an upload that this many of the coordinator's receipts still list although
            it was sent before the probe each answers, or a chunk of a stalled task download this gateway asked
            for this many times, is taken as dropped by the broker: the transfer is given up with an error naming
            ``chunk_size_bytes`` instead of being retried forever (edge_sdk.agent); >= 2, default 5.
        resend_interval_s: seconds between resends of an unacknowledged update (with +-50 % jitter); it is also
            resent at every reconnect.
        max_task_bytes: largest task download accepted, bytes (checked on its manifest, before any chunk).
        download_ttl_s: seconds after which an incomplete task download is dropped.
        health_interval_s: seconds between the gateway's signed health records (``shared.health``; also sent at
            start, after every reconnect and when a new global model is kept); 0 sends none. Default 900 (15 min).
        health_report_errors: put the newest ERROR line of the log (200 characters at most) in the health record;
            default on. Turn it off where a log line could name something the site keeps to itself (docs/privacy.md,
            "Public metadata").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    federation_id: str = Field(min_length=1)
    site_id: str = Field(min_length=1)
    task: Literal["camera", "radiomap"] = "camera"
    dataset: Path
    species: tuple[SpeciesEntry, ...] = ()
    private_key: Path
    coordinator_public_key: Path
    broker_url: str = "mqtt://127.0.0.1:1883"
    broker_failover_urls: tuple[str, ...] = ()
    broker_ca_file: Path | None = None
    broker_cert_file: Path | None = None
    broker_key_file: Path | None = None
    broker_username: str | None = Field(default=None, min_length=1)
    broker_password_file: Path | None = None
    outbox: Path
    profile: str | None = None
    backend: str | None = None
    artifact_cache: Path | None = None
    device: str | None = Field(default=None, pattern=r"^(cpu|cuda(:\d+)?)$")
    threads: int | None = Field(default=None, ge=1)
    microbatch_size: int | None = Field(default=None, ge=1)
    embedding_cache: Path | None = None
    calibration_cache: Path | None = None
    backbone: Literal[BACKBONE_NAMES] = DEFAULT_BACKBONE  # type: ignore[valid-type]  # the names of VARIANTS
    embedding_input_size: int = Field(default=128, ge=32, le=1024)
    model_dir: Path | None = None
    feature_centre: Path | None = None
    logit_adjustment: bool = True
    num_classes: int | None = Field(default=None, ge=2)
    class_names: dict[int, str] = Field(default_factory=dict)
    allow_non_private: bool = False
    allow_global_dp: bool = False
    allow_seeded_noise: bool = False
    min_round_duration_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    missing_media: str = "error"
    incoming: Path | None = None
    field: FieldSettings = Field(default_factory=FieldSettings)
    federation_plan: FederationPlan | None = None
    train_on: Literal["verified", "machine"] = "verified"
    machine_threshold: float = Field(default=0.95, gt=0, le=1)
    chunk_size_bytes: int = Field(default=256 * 1024, ge=1024, le=1 << 20)
    broker_max_packet_bytes: int = Field(default=DEFAULT_BROKER_MAX_PACKET_BYTES, ge=2048)
    max_chunk_requests: int = Field(default=5, ge=2)
    resend_interval_s: float = Field(default=60.0, gt=0)
    max_task_bytes: int = Field(default=512 << 20, ge=1024)
    download_ttl_s: float = Field(default=48 * 3600.0, gt=0)
    health_interval_s: float = Field(default=900.0, ge=0)
    health_report_errors: bool = True

    @model_validator(mode="before")
    @classmethod
    def _backbone_default_size(cls, data: Any) -> Any:
        """An ``embedding_input_size`` left out (or null) is the chosen backbone's default size."""
        if isinstance(data, Mapping) and data.get("embedding_input_size") is None:
            try:
                size = get_variant(data.get("backbone", DEFAULT_BACKBONE)).default_input_size
            except ConfigError:
                return data  # an unknown backbone: the field's own check reports it
            return {**data, "embedding_input_size": size}
        return data

    @field_validator("federation_id", "site_id")
    @classmethod
    def _topic_safe(cls, value: str) -> str:
        try:
            return validate_identifier(value, "identifier")
        except MalformedEnvelopeError as exc:  # pydantic reports ValueErrors with the field name
            raise ValueError(str(exc)) from None

    @field_validator("broker_url")
    @classmethod
    def _mqtt_url(cls, value: str) -> str:
        if not value.startswith(("mqtt://", "mqtts://")):
            raise ValueError("must look like mqtt://host:port or mqtts://host:port")
        return value

    @field_validator("broker_failover_urls", mode="before")
    @classmethod
    def _failover_urls(cls, value: Any, info: ValidationInfo) -> tuple[str, ...]:
        return check_failover_urls(info.data.get("broker_url", "mqtt://"), value)

    @model_validator(mode="after")
    def _broker_tls_consistent(self) -> SiteConfig:
        check_broker_fields(self.broker_url, self.broker_ca_file, self.broker_cert_file, self.broker_key_file)
        return self

    @model_validator(mode="after")
    def _chunks_fit_the_broker(self) -> SiteConfig:
        check_chunk_fits(self.chunk_size_bytes, self.broker_max_packet_bytes, field="chunk_size_bytes",
                         limit_field="broker_max_packet_bytes")  # a ConfigError (ValueError) naming both
        return self

    @field_validator("missing_media")
    @classmethod
    def _missing_media(cls, value: str) -> str:
        if value not in ("error", "skip"):
            raise ValueError("must be 'error' or 'skip'")
        return value

    @field_validator("species")
    @classmethod
    def _unique_species(cls, value: tuple[SpeciesEntry, ...]) -> tuple[SpeciesEntry, ...]:
        names = [s.scientific_name for s in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"species listed twice: {duplicates} (keep one entry per scientific name)")
        return value

    @model_validator(mode="after")
    def _species_consistent(self) -> SiteConfig:
        if self.task == "camera" and not self.species:
            raise ValueError("a camera site needs a species table (species: at least one entry); a radio "
                             "base station sets task: radiomap")
        if self.num_classes is not None:
            too_big = [s.scientific_name for s in self.species if s.class_index >= self.num_classes]
            if too_big:
                raise ValueError(f"class_index >= num_classes ({self.num_classes}) for {too_big}")
        for entry in self.species:
            named = self.class_names.get(entry.class_index)
            if named is not None and named != entry.scientific_name:
                raise ValueError(f"class_names[{entry.class_index}] is {named!r} but the species table gives that "
                                 f"class to {entry.scientific_name!r} (fix one of them)")
        if any(k < 0 or (self.num_classes is not None and k >= self.num_classes) for k in self.class_names):
            raise ValueError(f"class_names keys must be class indices in [0, num_classes), got "
                             f"{sorted(self.class_names)}")
        return self

    @property
    def backbone_id(self) -> str:
        """``shared.models.backbone.backbone_id(backbone, embedding_input_size)``: what this site's embeddings are,
        recorded with the global model it keeps."""
        from shared.models.backbone import backbone_id

        return backbone_id(self.backbone, self.embedding_input_size)

    @property
    def names_by_class(self) -> dict[int, str]:
        """``{class index: scientific name}``: :attr:`class_names` with the site's own species table on top."""
        return {**self.class_names, **{s.class_index: s.scientific_name for s in self.species}}

    @property
    def species_table(self) -> dict[str, SpeciesEntry]:
        """The species table indexed by scientific name."""
        return species_table_from_entries(list(self.species))

    @property
    def categories(self) -> tuple[IUCNCategory, ...]:
        """The site's CCDP categories (those of its species table), sorted by IUCN rank."""
        return tuple(sorted({s.iucn_category for s in self.species}, key=lambda c: c.rank))

    @property
    def model_classes(self) -> int:
        """Model output size: ``num_classes`` or ``max(2, max(class_index) + 1)``."""
        if self.num_classes is not None:
            return self.num_classes
        return max(2, max((s.class_index for s in self.species), default=0) + 1)


_PATH_FIELDS = ("dataset", "incoming", "private_key", "coordinator_public_key", "outbox", "artifact_cache", "embedding_cache",
                "calibration_cache", "feature_centre", "model_dir",
                "broker_ca_file", "broker_cert_file", "broker_key_file", "broker_password_file")


def global_model_path(config: SiteConfig) -> Path:
    """Where a camera gateway keeps the latest global model it received (``<outbox folder>/global-model.safetensors``:
    the weights of the newest task it accepted, with ``round`` and ``model_hash`` in the safetensors metadata);
    ``wildfed-edge detect --config`` classifies with it when no ``--weights`` is given."""
    return Path(config.outbox).parent / "global-model.safetensors"


def load_site_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> SiteConfig:
    """Load and validate a site config from YAML; relative paths are resolved against the file's directory.

    Args:
        path: the YAML file.
        overrides: values that replace those of the file (e.g. from the command line).

    Raises:
        ConfigError: the file is missing, is not a YAML mapping, or a field is invalid (the message names the
            file, the field and the fix).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("site config file not found", source=str(path), fix="pass the path of a site YAML file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=str(path), fix="fix the YAML syntax") from exc
    if not isinstance(raw, dict):
        raise ConfigError("expected a YAML mapping at the top level", source=str(path), fix="see edge_sdk/config.py")
    raw = {**raw, **dict(overrides or {})}
    for key in _PATH_FIELDS:
        if isinstance(raw.get(key), str) and not Path(raw[key]).is_absolute():
            raw[key] = str((path.parent / raw[key]).resolve())
    profile = raw.get("profile")
    if isinstance(profile, str) and profile.endswith((".yaml", ".yml")) and not Path(profile).is_absolute():
        raw["profile"] = str((path.parent / profile).resolve())
    try:
        return SiteConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if len(exc.errors()) == 1 and isinstance(cause, ConfigError):  # our check across fields: field and fix
            raise ConfigError(f"invalid site config: {cause.message}", source=str(path), field=cause.field,
                              fix=cause.fix) from exc
        problems = site_config_problems(exc)
        field, message = problems[0]
        if len(problems) > 1:
            message = f"{len(problems)} invalid field(s): " + "; ".join(f"{f}: {m}" for f, m in problems)
        raise ConfigError(f"invalid site config: {message}", source=str(path), field=field,
                          fix="correct the listed field(s) (docs/configuration.md; the SiteConfig docstring in "
                              "edge_sdk/config.py)") from exc


def site_config_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """``[(dotted field, message), ...]`` of a failed :class:`SiteConfig` validation, worded by the one config
    formatter (:func:`shared.config.validation_errors`: allowed fields and values, nearest field name, the fix; a
    check across fields names its own field, e.g. ``chunk_size_bytes``)."""
    from shared.config import validation_errors

    return validation_errors(exc, SiteConfig)
