"""Installing a provisioning bundle on a gateway (``wildfed-edge install-bundle``).

The bundle (format: :mod:`shared.bundle`) is read and verified completely in memory first: every member a regular
file with a safe relative name (no ``..``, no absolute paths, no links), the manifest signed by the bundled
coordinator key, every member's SHA-256 as listed; optionally the coordinator key pinned by fingerprint. Only then
is anything written, and only inside the prefix (storage folders the profile puts elsewhere are created if
possible).

Layout under the prefix (default ``/opt/wildfed``)::

    site.yaml  profile.yaml  bundle-manifest.json  wildfed-edge.service
    keys/site.key (0600)  keys/site.pub  keys/coordinator.pub  [keys/broker-ca.pem]   (profile ``identity``)
    wheels/wildfed-*.whl  venv/ (unless --no-venv)
    current -> venv   stable -> venv   sdk/install.json  sdk/state.json              (updates: edge_sdk.updates)
    models/backbone/<name>.onnx  models/detector/<name>.onnx                        (site.yaml ``model_dir``)
    state/  cache/artifacts/  cache/engines/  data/                                   (profile ``storage``)

The graphs are the ONNX files the coordinator exported at provisioning (:mod:`shared.models.gateway_graphs`): with
them ``run`` and ``detect`` need no torch. ``wildfed-edge run --config <prefix>/site.yaml`` then starts the agent;
the rendered systemd unit starts it through the launcher (``<prefix>/stable/bin/python -m edge_sdk.updates.launch
--prefix <prefix> run --config <prefix>/site.yaml``, which runs the ``current`` version and supervises a new one on
trial after a signed update) with ``Restart=on-failure`` and ``RestartPreventExitStatus=2`` (a configuration error
is reported once, not retried every 10 s). The venv: ``python -m venv`` (with ``--system-site-packages`` it also sees the
packages of the interpreter running the install, e.g. JetPack's torch), then (:func:`pip_install_commands`):

1. ``pip install --no-deps --no-index --force-reinstall <prefix>/wheels/wildfed-*.whl`` (the SDK itself);
2. ``pip install '<wheel>[<extras>]'`` with the extras of the profile's training backend
   (:func:`edge_sdk.profiles.backend_extras`: ``edge,torch`` for torch, ``edge-ort`` for ort; ``auto`` is
   ``edge-ort`` on an x86_64 CPU gateway, else torch). Offline (``--no-index --find-links``) from the bundle's
   ``wheels/`` folder when the bundle carries wheels besides the SDK's, and from every ``--find-links DIR`` the
   operator gives (e.g. a wheelhouse made with ``pip download`` on a connected machine); from the configured
   package index otherwise. Packages already present (JetPack's torch through ``--system-site-packages``) are
   kept. ``--no-deps`` skips this step.

Afterwards the installed interpreter imports the profile's backend (:func:`edge_sdk.profiles.backend_import_problem`);
when it does not, the result carries a warning with the install command (``check-config`` then fails too).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from shared import bundle as fmt
from shared.bundle import Bundle, BundleError, read_bundle
from shared.keys import write_file_atomic
from shared.errors import ConfigError
from shared.profiles import JETSON_KINDS, GatewayProfile, check_profile_data
from shared.software import sdk_wheel_version

from edge_sdk.profiles import backend_extras
from edge_sdk.updates.layout import InstallLayout

__all__ = ["InstallResult", "install_bundle", "pip_install_commands", "pip_install", "make_venv", "venv_python",
           "BundleError"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = Path("/opt/wildfed")


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install_bundle` did.

    Attributes:
        prefix: the install prefix (absolute).
        site_id, federation_id, profile: from the bundle.
        site_config: ``<prefix>/site.yaml``.
        unit: the rendered systemd unit file.
        executable: the command the unit runs, before ``run --config ...``: the launcher of the stable version
            (:mod:`edge_sdk.updates.launch`), or ``python -m edge_sdk.cli`` with ``--no-venv`` (no updates then).
        venv: the virtual environment, or ``None`` with ``--no-venv``.
        coordinator_fingerprint: hex SHA-256 of the bundled coordinator key.
        warnings: things the operator must still do (e.g. fill in the species table).
    """

    prefix: Path
    site_id: str
    federation_id: str
    profile: str
    site_config: Path
    unit: Path
    executable: str
    venv: Path | None
    coordinator_fingerprint: str
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _inside(prefix: Path, relative: Path | str) -> Path:
    target = (prefix / relative).resolve()
    if target != prefix and prefix not in target.parents:
        raise BundleError(f"{relative} would be written outside the prefix", field=str(relative),
                          fix="the bundle or its profile is unsafe: ask the operator for a fresh one")
    return target


def venv_python(venv: Path) -> Path:
    """The interpreter of the venv ``venv``."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_venv(venv: Path, *, system_site_packages: bool, python: str, inherit: tuple[str, ...] = ()) -> None:
    """``python -m venv [--system-site-packages] venv``; the new venv also sees the site folders ``inherit`` (and,
    with ``system_site_packages`` from inside a venv, that venv's) through a ``.pth`` file.

    Raises:
        ConfigError: venv creation failed (python3-venv missing).
    """
    cmd = [python, "-m", "venv"] + (["--system-site-packages"] if system_site_packages else []) + [str(venv)]
    log.info("creating the venv: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"creating the venv failed: {(proc.stderr or proc.stdout).strip()[-600:]}", source=venv,
                          fix="install python3-venv, or pass --no-venv to use this interpreter")
    parents = list(inherit)
    if system_site_packages and sys.prefix != sys.base_prefix:
        # this interpreter is itself a venv: let the new one see its packages too (torch, onnxruntime, ...)
        parents += sorted({*site.getsitepackages(), sysconfig.get_paths()["purelib"]})
    if parents:
        purelib = Path(subprocess.run([str(venv_python(venv)), "-c", "import sysconfig; "
                                       "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                      check=True).stdout.strip())
        (purelib / "_wildfed_parent_site.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(parents)))


def pip_install_commands(python: str | Path, wheel: Path, *, extras: tuple[str, ...], find_links: tuple[Path, ...] = (),
                         no_deps: bool = False) -> list[list[str]]:
    """The pip command lines that install the SDK wheel and its backend's dependencies (module docstring).

    Args:
        python: the interpreter of the target environment.
        wheel: the ``wildfed-*.whl`` file.
        extras: the wheel's extras to install (``("edge", "torch")``, ``("edge-ort",)``).
        find_links: folders of wheels; when any is given, the dependencies are installed from them only
            (``--no-index``): nothing is downloaded.
        no_deps: the SDK wheel alone (first command only).

    Returns:
        One or two argument lists for :func:`subprocess.run`.
    """
    pip = [str(python), "-m", "pip", "install", "-q"]
    commands = [pip + ["--no-deps", "--no-index", "--force-reinstall", str(wheel)]]
    if not no_deps:
        offline = ["--no-index"] + [arg for d in find_links for arg in ("--find-links", str(d))] if find_links else []
        commands.append(pip + offline + [f"{wheel}[{','.join(extras)}]"])
    return commands


def pip_install(venv: Path, wheel: Path, *, extras: tuple[str, ...], find_links: tuple[Path, ...],
                no_deps: bool) -> None:
    """Run :func:`pip_install_commands` in ``venv``.

    Raises:
        ConfigError: pip failed (its output's tail and where the wheels would come from).
    """
    for cmd in pip_install_commands(venv_python(venv), wheel, extras=extras, find_links=find_links,
                                    no_deps=no_deps):
        log.info("installing the SDK: %s", shlex.join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            where = (f"the wheels in {', '.join(map(str, find_links))} (add the missing ones: `pip download "
                     f"'wildfed[{','.join(extras)}]'` on a connected machine of the same platform)" if find_links
                     else "network access to the package index, or pass --find-links DIR (a folder of wheels)")
            raise ConfigError(f"pip install of {wheel.name} failed ({shlex.join(cmd)}): "
                              f"{(proc.stderr or proc.stdout).strip()[-800:]}", source=wheel,
                              fix=f"check {where}; or pass --no-deps with --system-site-packages where the "
                              "dependencies are installed already")


def _backend_warning(python: str | Path, backend: str, device: str) -> str | None:
    """Run :func:`edge_sdk.profiles.backend_import_problem` in the installed interpreter; its message or None.
    (In this process when that interpreter is this one.)"""
    if str(python) == sys.executable:
        from edge_sdk.profiles import backend_import_problem

        return backend_import_problem(backend, device=device)
    code = ("import sys; from edge_sdk.profiles import backend_import_problem as p; "
            "print(p(sys.argv[1], device=sys.argv[2], python=sys.executable) or '')")
    proc = subprocess.run([str(python), "-c", code, backend, device], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"the installed SDK does not import ({(proc.stderr or proc.stdout).strip()[-300:]})"
    return proc.stdout.strip() or None


def _profile(bundle: Bundle) -> GatewayProfile:
    try:
        data = yaml.safe_load(bundle.members[fmt.PROFILE])
    except yaml.YAMLError as exc:
        raise BundleError(f"profile.yaml is not YAML: {exc}", field=fmt.PROFILE, fix="ask for a fresh bundle") from exc
    return check_profile_data(data, source=f"bundle:{fmt.PROFILE}")


def _make_storage(profile: GatewayProfile, prefix: Path) -> list[str]:
    """Create the profile's storage folders; a warning for each that cannot be created."""
    warnings = []
    for folder in (profile.storage.outbox.parent, profile.storage.artifact_cache, profile.storage.engine_cache,
                   profile.storage.data):
        target = folder if folder.is_absolute() else prefix / folder
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            warnings.append(f"could not create {target} ({exc}); create it before starting the agent")
    return warnings


def _site_warnings(bundle: Bundle, prefix: Path, site_config: Path) -> list[str]:
    """What the operator must still do before the agent starts: graphs, species table, the site's package."""
    warnings = []
    site_data = yaml.safe_load(bundle.members[fmt.SITE_CONFIG]) or {}
    if not bundle.models():
        warnings.append("the bundle carries no ONNX graphs (made by an older coordinator): without torch the gateway "
                        "cannot embed or detect; ask the operator for a bundle from `wildfed-coordinator provision`")
    if not site_data.get("species"):
        warnings.append(f"{site_config}: fill in `species` (the site's species table) before starting the agent")
    dataset = Path(str(site_data.get("dataset", "")))
    if not (dataset if dataset.is_absolute() else prefix / dataset).exists():
        warnings.append(f"put the site's Camtrap DP package at {dataset} (relative to {prefix}) before starting")
    return warnings


def install_bundle(bundle_path: str | Path, *, prefix: str | Path = DEFAULT_PREFIX, venv: bool = True,
                   system_site_packages: bool = False, no_deps: bool = False, force: bool = False,
                   coordinator_fingerprint: str | None = None, service_user: str = "wildfed",
                   python: str = sys.executable, find_links: tuple[str | Path, ...] = (),
                   check_backend: bool = True) -> InstallResult:
    """Verify a bundle, then install it under ``prefix`` (module docstring).

    Args:
        bundle_path: the ``.tar`` file from ``wildfed-coordinator provision``.
        prefix: install folder (created).
        venv: create ``<prefix>/venv`` and pip-install the bundled wheel into it; ``False``: the SDK of this
            interpreter runs the agent (``python -m edge_sdk.cli``).
        system_site_packages: the venv also sees this interpreter's packages (JetPack torch; tests).
        no_deps: install the wheel alone (no index, no download); the backend must be there already.
        find_links: folders of wheels for the backend's dependencies (offline install, ``--no-index``), tried
            with the bundle's own ``wheels/`` when it carries more than the SDK wheel.
        force: replace an existing install (its keys too; the outbox and data stay).
        coordinator_fingerprint: expected hex SHA-256 of the coordinator key (pinning); a prefix of at least 16
            hex digits is accepted.
        service_user: ``User=`` of the systemd unit.
        python: interpreter that creates the venv (and, with ``venv=False``, runs the agent).
        check_backend: import the profile's training backend in the installed interpreter afterwards and add a
            warning naming the install command when it does not import.

    Raises:
        BundleError: the bundle fails verification (nothing is written).
        ConfigError: an install exists already (without ``force``), bad profile, or venv/pip failure.
    """
    bundle = read_bundle(bundle_path)
    fingerprint = bundle.coordinator_fingerprint
    if coordinator_fingerprint is not None:
        pin = coordinator_fingerprint.strip().lower()
        if len(pin) < 16 or not fingerprint.startswith(pin):
            raise BundleError(f"coordinator key fingerprint {fingerprint[:16]}... does not match the expected "
                              f"{pin[:16]}...", source=bundle_path, field=fmt.COORDINATOR_PUBLIC_KEY,
                              fix="do not install it; the bundle was not made by your coordinator")
    profile = _profile(bundle)
    prefix = Path(prefix).expanduser().resolve()
    site_config = prefix / fmt.SITE_CONFIG
    if site_config.exists() and not force:
        raise ConfigError("a WildFed site is installed here already", source=site_config, field="prefix",
                          fix="pass --force to replace it (new keys; outbox and data are kept), or another --prefix")

    # every destination, checked to lie inside the prefix before anything is written
    destinations: list[tuple[Path, bytes, int]] = [
        (_inside(prefix, fmt.PROFILE), bundle.members[fmt.PROFILE], 0o644),
        (_inside(prefix, profile.identity.private_key), bundle.members[fmt.SITE_KEY], 0o600),
        (_inside(prefix, fmt.SITE_PUBLIC_KEY), bundle.members[fmt.SITE_PUBLIC_KEY], 0o644),
        (_inside(prefix, profile.identity.coordinator_public_key), bundle.members[fmt.COORDINATOR_PUBLIC_KEY],
         0o644),
        (_inside(prefix, "bundle-manifest.json"), json.dumps(bundle.manifest, indent=2).encode(), 0o644),
    ]
    destinations += [(_inside(prefix, name), bundle.members[name], 0o644) for name in bundle.models()]
    if fmt.BROKER_CA in bundle.members:
        ca_target = profile.broker.ca_file or Path(fmt.BROKER_CA)
        destinations.append((_inside(prefix, ca_target), bundle.members[fmt.BROKER_CA], 0o644))
    wheels = [(_inside(prefix, name), bundle.members[name]) for name in bundle.wheels()]
    sdk_wheels = [path for path, _ in wheels if path.name.startswith("wildfed-")]
    if not sdk_wheels:
        raise BundleError("the bundle holds no SDK wheel (wheels/wildfed-*.whl)", source=bundle_path,
                          field=fmt.WHEELS_DIR, fix="ask for a fresh bundle")
    links = [Path(d).expanduser().resolve() for d in find_links]
    for folder in links:
        if not folder.is_dir():
            raise ConfigError("wheel folder not found", source=folder, field="find_links",
                              fix="pass a folder of .whl files (pip download on a connected machine)")
    if len(wheels) > len(sdk_wheels):  # the bundle carries dependency wheels: install from them, offline
        links.insert(0, prefix / fmt.WHEELS_DIR)
    backend = profile.training.backend.value
    extras = backend_extras(backend, device=profile.training.device)

    prefix.mkdir(parents=True, exist_ok=True)
    for path, data in wheels:
        write_file_atomic(path, data, 0o644)
    venv_dir: Path | None = None
    if venv:
        venv_dir = prefix / "venv"
        if not venv_python(venv_dir).exists():
            make_venv(venv_dir, system_site_packages=system_site_packages, python=python)
        pip_install(venv_dir, sdk_wheels[0], extras=extras, find_links=tuple(links), no_deps=no_deps)
        layout = InstallLayout.create(prefix, version=sdk_wheel_version(sdk_wheels[0].name) or "unknown",
                                      venv=venv_dir, options={
                                          "python": python, "system_site_packages": system_site_packages,
                                          "no_deps": no_deps, "extras": list(extras),
                                          "find_links": [str(p) for p in links]})
        executable = shlex.join(layout.launcher_command())  # updates: edge_sdk.updates.launch
        agent_python: str | Path = venv_python(venv_dir)
    else:
        executable = f"{python} -m edge_sdk.cli"
        agent_python = python

    for path, data, mode in destinations:
        write_file_atomic(path, data, mode)
    warnings: list[str] = []
    if check_backend:
        problem = _backend_warning(agent_python, backend, profile.training.device)
        if problem is not None:
            warnings.append(problem)
    if profile.kind in JETSON_KINDS and venv and not system_site_packages:
        warnings.append("a Jetson trains with NVIDIA's JetPack torch (PyPI's aarch64 torch has no CUDA): "
                        "reinstall with --system-site-packages --force where JetPack's torch is installed")
    warnings += _make_storage(profile, prefix)
    unit_text = (bundle.members[fmt.SYSTEMD_UNIT].decode("utf-8").replace("@PREFIX@", str(prefix))
                 .replace("@EXEC@", executable).replace("@USER@", service_user))
    unit = prefix / "wildfed-edge.service"
    write_file_atomic(unit, unit_text.encode("utf-8"), 0o644)
    write_file_atomic(site_config, bundle.members[fmt.SITE_CONFIG], 0o644)

    warnings += _site_warnings(bundle, prefix, site_config)
    log.info("installed site %s (profile %s) under %s", bundle.site_id, profile.name, prefix)
    return InstallResult(prefix=prefix, site_id=bundle.site_id, federation_id=bundle.federation_id,
                         profile=profile.name, site_config=site_config, unit=unit, executable=executable,
                         venv=venv_dir, coordinator_fingerprint=fingerprint, warnings=tuple(warnings))
