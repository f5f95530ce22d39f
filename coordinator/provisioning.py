"""Provisioning: everything an operator flashes onto a new gateway, in one signed tar bundle, and the site's
enrolment, made together.

``provision_site`` writes the bundle of :mod:`shared.bundle`: the SDK wheel, the gateway profile, the site's fresh
Ed25519 key pair, the coordinator's public key, the broker CA (optional), a ``site.yaml``, a systemd unit that
runs ``wildfed-edge run`` with ``Restart=on-failure`` (but not after a configuration error, exit status 2), and the
ONNX graphs of the site's backbone and of the detector; and it enrols the site's public key in the registry.

The graphs (:mod:`shared.models.gateway_graphs`) are exported here, once per backbone and input size, into the
WildFed cache (``$WILDFED_CACHE``, default ``~/.cache/wildfed``; the detector's checkpoint is fetched once, about
41 MB), because exporting needs torch and a gateway installed from the bundle has none (the x86 profiles install
ONNX Runtime only). The gateway installs them under ``<prefix>/models/`` and its ``site.yaml`` names that folder
(``model_dir``): it runs ``run`` and ``detect`` with nothing else.

Secrets: the site's private key is generated in memory, written only into the bundle (tar member mode 0600; the
bundle file itself is created 0600) and never stored at the coordinator: not in the database, not in the data
folder. Whoever holds the bundle holds the site's identity until it is installed and deleted.

Atomicity (enrolment and bundle succeed or fail together):

1. check everything that can be checked first: site id free and topic-safe, profile valid, keys readable, output
   path free, wheel built, graphs exported;
2. write the complete bundle to a temporary file beside the output (0600, fsync);
3. enrol the site (if that fails, the temporary file is removed: no bundle);
4. rename the temporary file onto the output path (if that fails, the enrolment is deleted again: no site).

The SDK wheel is built from the project source (:mod:`coordinator.sdk_wheel`), or taken from ``--wheel``; the
``site.yaml`` is rendered by :mod:`coordinator.site_config`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared import bundle as fmt
from shared.errors import ConfigError
from shared.keys import generate_signing_key, key_fingerprint, load_private_key, load_public_key, public_key_to_pem
from shared.models.backbone_variants import DEFAULT_BACKBONE, get_variant
from shared.models.gateway_graphs import backbone_graph_relpath, detector_graph_relpath, ensure_gateway_graphs
from shared.profiles import check_profile_data, profile_path, read_profile_yaml

from coordinator.config import CoordinatorConfig
from coordinator.registry import SITE_ID_PATTERN, EnrolmentError, SiteRegistry, mark_keys_changed
from coordinator.sdk_wheel import build_sdk_wheel, project_source_root
from coordinator.site_config import render_site_config
from coordinator.storage import SiteRow, Store

__all__ = ["ProvisionResult", "provision_site", "build_sdk_wheel", "project_source_root", "render_site_config",
           "SYSTEMD_UNIT_TEMPLATE"]

log = logging.getLogger(__name__)

#: The unit template shipped in every bundle; ``edge_sdk.bundle`` fills in @PREFIX@, @EXEC@ (the wildfed-edge
#: command) and @USER@. Exit status 2 is a configuration error: restarting cannot fix it, so it is not retried.
SYSTEMD_UNIT_TEMPLATE = """\
[Unit]
Description=WildFed gateway agent (site @SITE@, profile @PROFILE@)
Wants=network-online.target
After=network-online.target time-sync.target

[Service]
Type=simple
User=@USER@
WorkingDirectory=@PREFIX@
ExecStart=@EXEC@ run --config @PREFIX@/site.yaml
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=2
KillSignal=SIGTERM
TimeoutStopSec=60
MemoryMax=@MEMORY_MIB@M
Environment=OMP_NUM_THREADS=@THREADS@
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=full

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class ProvisionResult:
    """What :func:`provision_site` made: the bundle path, the enrolled site, the site key's fingerprint, the
    profile name, the wheel file name, the bundle's member names and the coordinator key's fingerprint (what the
    gateway's installer can pin with ``--coordinator-fingerprint``)."""

    bundle_path: Path
    site_id: str
    fingerprint: str
    profile: str
    wheel: str
    members: tuple[str, ...]
    coordinator_fingerprint: str = ""
    broker_url: str = ""

    @property
    def broker_is_loopback(self) -> bool:
        """True when the gateway was told to reach the broker on its own loopback address (fine for a test rig,
        wrong for a gateway in the field)."""
        from urllib.parse import urlparse

        host = urlparse(self.broker_url).hostname or ""
        return host in ("localhost", "::1") or host.startswith("127.")


def _check_broker_url(url: str) -> str:
    if not url.startswith(("mqtt://", "mqtts://")):
        raise ConfigError(f"broker URL {url!r} is not mqtt://host:port or mqtts://host:port", field="broker_url",
                          fix="use mqtts://host:8883 (TLS, with --broker-ca) or mqtt://host:1883")
    return url


def _coordinator_key_pair(config: CoordinatorConfig) -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """The coordinator's signing key and public key (which must match).

    Raises:
        ConfigError: a key cannot be read, or the public key is not the signing key's.
    """
    coordinator_key = load_private_key(config.signing_key_path)
    coordinator_pub = load_public_key(config.public_key_path)
    if coordinator_pub != coordinator_key.public_key():
        raise ConfigError("the coordinator's public key does not match its signing key", source=config.public_key_path,
                          field="public_key_path", fix="point public_key_path at the key pair's .pub file")
    return coordinator_key, coordinator_pub


def _read_broker_ca(broker_ca: Path) -> bytes:
    """The broker's CA certificate (PEM bytes) to ship in the bundle.

    Raises:
        ConfigError: the file is missing or not a PEM certificate.
    """
    if not Path(broker_ca).is_file():
        raise ConfigError("broker CA file not found", source=broker_ca, field="broker_ca",
                          fix="pass the PEM certificate of the CA that signed the broker's certificate")
    ca_bytes = Path(broker_ca).read_bytes()
    if b"-----BEGIN CERTIFICATE-----" not in ca_bytes:
        raise ConfigError("broker CA is not a PEM certificate", source=broker_ca, field="broker_ca",
                          fix="pass a PEM file (-----BEGIN CERTIFICATE-----)")
    return ca_bytes


def _sdk_wheel(wheel: Path | None, wheel_cache: Path) -> Path:
    """The given SDK wheel (checked), or one built from the source and cached in ``wheel_cache``.

    Raises:
        ConfigError: the given wheel is not a ``.whl`` file.
    """
    if wheel is not None:
        wheel = Path(wheel)
        if not (wheel.is_file() and wheel.name.endswith(".whl")):
            raise ConfigError("SDK wheel not found", source=wheel, field="wheel", fix="pass a wildfed-*.whl file")
        return wheel
    return build_sdk_wheel(wheel_cache)


def provision_site(*, config: CoordinatorConfig, store: Store, site_id: str, profile: str | Path, out: Path,
                   broker_ca: Path | None = None, broker_url: str | None = None,
                   species: Sequence[Mapping[str, Any]] | None = None, dataset: str | None = None,
                   metadata: Mapping[str, Any] | None = None, wheel: Path | None = None,
                   wheel_cache: Path | None = None, profiles_directory: Path | None = None,
                   force: bool = False, backbone: str = DEFAULT_BACKBONE, embedding_input_size: int | None = None,
                   graph_cache: Path | None = None, replace: bool = False) -> ProvisionResult:
    """Write a site's bundle and enrol its public key, atomically (module docstring).

    Args (keyword-only):
        config: the coordinator's config (resolved paths); its signing key signs the manifest.
        store: the coordinator's database (the registry lives there).
        site_id: the new site (topic-safe, not yet enrolled).
        profile: profile name (``firmware_configs/<name>.yaml``) or path.
        out: bundle path (created 0600).
        broker_ca: the broker's CA certificate (PEM), shipped as ``keys/broker-ca.pem``.
        broker_url: what the gateway connects to; default the profile's ``broker.url``, else ``config.broker_url``.
        species: the site's species table rows (``scientific_name``, ``class_index``, ``iucn_category``).
        dataset: the Camtrap DP folder on the gateway (default ``<profile data>/camtrap``).
        metadata: public enrolment metadata (``capacity``, ``species``, ...; see coordinator.registry).
        wheel: a prebuilt ``wildfed-*.whl`` (default: build from the source, cached in ``wheel_cache``).
        wheel_cache: default ``<data_dir>/wheels``.
        force: replace an existing file at ``out``.
        backbone: the site's frozen backbone (every site of a federation uses the same); written into ``site.yaml``.
        embedding_input_size: its input size S in pixels (default the backbone's default size).
        graph_cache: where the exported graphs are kept (default the WildFed cache); a graph found there under its
            name (``shared.models.gateway_graphs``) is shipped as it is, without exporting.

        replace: the site is enrolled already: write it a new bundle and make the bundle's key its only valid key
            (:meth:`coordinator.registry.SiteRegistry.rotate_key` with no grace; its ledger and history stay).

    Raises:
        EnrolmentError: the site id is taken (without ``replace``) or invalid, or the metadata is bad (no bundle is
            left).
        ConfigError: bad profile, keys, CA, broker URL, wheel or backbone; ``out`` exists (without ``force``); the
            graphs cannot be exported (no torch here, or the detector's weights cannot be fetched).
        OSError: the bundle cannot be written (the site is not enrolled).
    """
    # 1. everything that can fail before any side effect
    if not SITE_ID_PATTERN.match(site_id):
        raise EnrolmentError(f"site id {site_id!r} is not topic-safe", field="site_id",
                             fix="use letters, digits, '_', '.', '-' (no '/', '+', '#', spaces)")
    registry = SiteRegistry(store)
    if registry.is_enrolled(site_id) and not replace:
        raise EnrolmentError(f"site {site_id!r} is already enrolled", field="site_id",
                             fix="choose another site id, or pass --replace to give this site a new bundle and key "
                             "(its old keys stop at once; its ledger and history stay)")
    _check_species(config, species)
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError("output file exists", source=out, field="out", fix="choose another --out or pass --force")
    ppath = profile_path(profile, profiles_directory)
    profile_text = ppath.read_text(encoding="utf-8")
    prof = check_profile_data(read_profile_yaml(ppath), source=ppath)
    url = _check_broker_url(broker_url or prof.broker.url or config.broker_url)
    coordinator_key, coordinator_pub = _coordinator_key_pair(config)
    ca_bytes = _read_broker_ca(broker_ca) if broker_ca is not None else None
    wheel = _sdk_wheel(wheel, wheel_cache or config.data_dir / "wheels")
    size = embedding_input_size or get_variant(backbone).default_input_size
    graphs = ensure_gateway_graphs(backbone=backbone, input_size=size, root=graph_cache)

    site_key = generate_signing_key()  # in memory only; it goes into the bundle and nowhere else
    site_pub_pem = public_key_to_pem(site_key.public_key())
    site_key_pem = site_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
    unit = (SYSTEMD_UNIT_TEMPLATE.replace("@SITE@", site_id).replace("@PROFILE@", prof.name)
            .replace("@MEMORY_MIB@", str(prof.memory_cap_mib)).replace("@THREADS@", str(prof.threads)))
    members = [
        fmt.BundleMember(fmt.PROFILE, profile_text.encode("utf-8")),
        fmt.BundleMember(fmt.SITE_CONFIG, render_site_config(
            config=config, profile=prof, profile_file=fmt.PROFILE, site_id=site_id, broker_url=url,
            species=species, dataset=dataset, backbone=backbone, embedding_input_size=size,
            capacity=_declared_capacity(metadata)).encode("utf-8")),
        fmt.BundleMember(fmt.SITE_KEY, site_key_pem, 0o600),
        fmt.BundleMember(fmt.SITE_PUBLIC_KEY, site_pub_pem.encode("ascii")),
        fmt.BundleMember(fmt.COORDINATOR_PUBLIC_KEY, public_key_to_pem(coordinator_pub).encode("ascii")),
        fmt.BundleMember(fmt.SYSTEMD_UNIT, unit.encode("utf-8")),
        fmt.BundleMember(f"{fmt.WHEELS_DIR}/{wheel.name}", wheel.read_bytes()),
    ]
    if ca_bytes is not None:
        members.append(fmt.BundleMember(fmt.BROKER_CA, ca_bytes))
    models = _graph_members(graphs, backbone=backbone, input_size=size)
    members += [member for member, _ in models.values()]
    info = {"federation_id": config.federation_id, "site_id": site_id, "profile": prof.name,
            "site_key_fingerprint": key_fingerprint(site_key.public_key()),
            "coordinator_key_fingerprint": key_fingerprint(coordinator_pub),
            "models": {role: entry for role, (_, entry) in models.items()}}

    # 2. the complete bundle in a temporary file beside the output
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            fmt.write_bundle(handle, members, signing_key=coordinator_key, info=info)
            handle.flush()
            os.fsync(handle.fileno())
        if replace and registry.is_enrolled(site_id):  # 3'. publish the bundle, then make its key the site's
            os.replace(tmp, out)
            try:
                registry.rotate_key(site_id, site_pub_pem, grace_s=0.0)
            except BaseException:
                out.unlink(missing_ok=True)
                raise
        else:  # 3. enrol; 4. publish the bundle under its name, or undo the enrolment
            registry.enrol(site_id, site_pub_pem, metadata or {})
            try:
                os.replace(tmp, out)
            except BaseException:
                _unenrol(store, site_id)
                raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("provisioned site %s (profile %s, key %s) -> %s", site_id, prof.name, info["site_key_fingerprint"][:16],
             out)
    return ProvisionResult(bundle_path=out, site_id=site_id, fingerprint=info["site_key_fingerprint"],
                           profile=prof.name, wheel=wheel.name,
                           members=tuple(sorted(m.name for m in members)),
                           coordinator_fingerprint=info["coordinator_key_fingerprint"], broker_url=url)


def _graph_members(graphs: Mapping[str, Path], *, backbone: str, input_size: int
                   ) -> dict[str, tuple[fmt.BundleMember, dict[str, Any]]]:
    """The bundle members of the exported graphs (``models/<role>/<name>``, mode 0644) and their manifest entries."""
    from shared.models.backbone import backbone_id

    out: dict[str, tuple[fmt.BundleMember, dict[str, Any]]] = {}
    for role, path in graphs.items():
        data = path.read_bytes()
        relpath = backbone_graph_relpath(backbone, input_size) if role == "backbone" else detector_graph_relpath()
        name = f"{fmt.MODELS_DIR}/{relpath}"
        entry: dict[str, Any] = {"member": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if role == "backbone":
            entry.update(backbone=backbone, input_size=input_size, backbone_id=backbone_id(backbone, input_size))
        out[role] = (fmt.BundleMember(name, data, 0o644), entry)
    return out


def _check_species(config: CoordinatorConfig, species: Sequence[Mapping[str, Any]] | None) -> None:
    """Each species row's ``class_index`` is below the federation's ``num_classes`` and, where the coordinator
    config has a federation species table, names the same species there (class indices are federation-wide).

    Raises:
        ConfigError: naming the row and the fix, before anything is enrolled or written.
    """
    federation = {e.class_index: e.scientific_name for e in config.species or []}
    for row in species or []:
        name, index = row.get("scientific_name"), row.get("class_index")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < config.num_classes:
            raise ConfigError(f"species {name!r}: class_index {index!r} is not in 0..{config.num_classes - 1} "
                              f"(num_classes {config.num_classes})", field="species.class_index",
                              fix="class indices are federation-wide: raise num_classes in the coordinator config "
                              "(before the first round) or renumber the site's species")
        if federation and federation.get(index) not in (None, name):
            raise ConfigError(f"species {name!r}: class_index {index} is {federation[index]!r} in the coordinator's "
                              "species table", field="species.class_index",
                              fix="use the federation's class index of each species (coordinator config `species`)")


def _unenrol(store: Store, site_id: str) -> None:
    """Delete a just-made enrolment (rollback of a provisioning whose bundle could not be written)."""
    with store.session() as s:
        row = s.get(SiteRow, site_id)
        if row is not None:
            s.delete(row)
            mark_keys_changed(s)  # a running coordinator's key cache drops the site
    log.warning("provisioning of %s failed after enrolment; enrolment rolled back", site_id)


def _declared_capacity(metadata: Mapping[str, Any] | None) -> int | None:
    """The ``capacity`` of enrolment metadata as an int >= 1, or None when absent or not such a number (the
    registry checks the metadata itself)."""
    value = (metadata or {}).get("capacity")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None
