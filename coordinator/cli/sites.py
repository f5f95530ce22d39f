"""``wildfed-coordinator`` commands for sites and their keys: ``enrol``, ``keys``, ``rotate-key``, ``revoke-key``,
``provision``.

::

    wildfed-coordinator enrol SITE --public-key FILE [--metadata JSON]
    wildfed-coordinator keys SITE                                             a site's keys and their validity
    wildfed-coordinator rotate-key SITE --public-key FILE [--grace-hours H]   new current key; old one valid H hours
    wildfed-coordinator revoke-key SITE [--fingerprint F]                     revoke one key, or all of the site's
    wildfed-coordinator provision SITE --profile P [--broker-url U] ...       a signed bundle for a new gateway, and
                                                                              its enrolment, together or not at all
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError

from coordinator.cli.common import config_option, console, err_console, friendly, open_state, parse_metadata
from coordinator.config import load_config
from coordinator.registry import read_site_key_file

__all__ = ["app"]

app = typer.Typer()


@app.command()
@friendly
def enrol(site_id: str = typer.Argument(..., help="site id (letters, digits, _.-)"),
          public_key: Path = typer.Option(..., "--public-key", help="the site's Ed25519 public key file (PEM; DER and OpenSSH are converted)"),
          metadata: str = typer.Option("{}", "--metadata", help='public metadata JSON, e.g. {"capacity": 500, '
                                       '"species": [...]}: capacity is a round number you declare, never the exact '
                                       'record count (docs/privacy.md)'),
          config: Path = config_option()) -> None:
    """Enrol a site with its public key and public metadata."""
    cfg = load_config(config)
    meta = parse_metadata(metadata)
    key_pem = read_site_key_file(public_key)  # PEM, DER or OpenSSH; a clear error otherwise
    store, registry, _ = open_state(cfg)
    try:
        site = registry.enrol(site_id, key_pem, meta)
    finally:
        store.dispose()
    console.print(f"[green]enrolled[/] {site.site_id} (key {site.fingerprint[:16]})")
    sensitive = {e.scientific_name for e in cfg.species or [] if e.iucn_category.value in ("CR", "EN")}
    listed = sorted(sensitive & {str(n) for n in meta.get("species", []) if isinstance(n, str)})
    if listed:
        console.print(f"[yellow]warning:[/] the public metadata of {site.site_id} lists CR/EN species "
                      f"{escape(str(listed))}: "
                      "species lists are public (NIRA clustering), and a threatened species' presence can locate "
                      "it; leave them out unless that is intended")


@app.command("rotate-key")
@friendly
def rotate_key(site_id: str = typer.Argument(..., help="an enrolled site"),
               public_key: Path = typer.Option(..., "--public-key", help="the site's NEW Ed25519 public key file (PEM, DER or OpenSSH)"),
               grace_hours: float = typer.Option(24.0, "--grace-hours", help="hours the old key stays valid (0: "
                                                 "ends now)"),
               config: Path = config_option()) -> None:
    """Make a new key the site's current key; its old key keeps verifying for --grace-hours (docs/security.md)."""
    cfg = load_config(config)
    key_pem = read_site_key_file(public_key)  # PEM, DER or OpenSSH; a clear error otherwise
    store, registry, _ = open_state(cfg)
    try:
        key = registry.rotate_key(site_id, key_pem, grace_s=grace_hours * 3600.0)
        valid = registry.verification_keys(site_id)
    finally:
        store.dispose()
    console.print(f"[green]rotated[/] {site_id}: current key {key.fingerprint[:16]}; "
                  f"{len(valid)} key(s) valid now (old key until {grace_hours:g} h from now)")


@app.command("revoke-key")
@friendly
def revoke_key(site_id: str = typer.Argument(..., help="an enrolled site"),
               fingerprint: str | None = typer.Option(None, "--fingerprint", help="the key to revoke (full hex or a "
                                                      "unique prefix of >= 8 characters); default: ALL the site's "
                                                      "keys"),
               config: Path = config_option()) -> None:
    """Revoke one key of a site, or all of them, at once: messages signed with it stop verifying. A site with no
    valid key cannot send until `rotate-key` gives it a fresh one; rerun `broker-config` to remove its broker
    account too."""
    cfg = load_config(config)
    store, registry, _ = open_state(cfg)
    try:
        revoked = registry.revoke_key(site_id, fingerprint)
        valid = registry.verification_keys(site_id)
    finally:
        store.dispose()
    console.print(f"[yellow]revoked[/] {len(revoked)} key(s) of {site_id}: "
                  f"{', '.join(f[:16] for f in revoked) or 'none left to revoke'}; {len(valid)} key(s) still valid")
    if not valid:
        err_console.print(f"[bold yellow]warning:[/] {site_id} has no valid key: it cannot send until rotated")


@app.command("keys")
@friendly
def keys_command(site_id: str = typer.Argument(..., help="an enrolled site"),
                 config: Path = config_option()) -> None:
    """List a site's keys: fingerprint, current or not, valid-until (grace period end), revoked-at (UTC)."""
    cfg = load_config(config)
    store, registry, _ = open_state(cfg)
    try:
        keys = registry.keys(site_id)
        valid = {fp for fp, _ in registry.verification_keys(site_id)}
    finally:
        store.dispose()
    table = Table(title=f"keys of {site_id} (times UTC)")
    for col in ("fingerprint", "current", "valid now", "created", "valid until", "revoked at"):
        table.add_column(col, no_wrap=col == "fingerprint")
    for k in keys:
        table.add_row(k.fingerprint[:16], "yes" if k.current else "", "yes" if k.fingerprint in valid else "[red]no[/]",
                      f"{k.created_at:%Y-%m-%d %H:%M}" if k.created_at else "",
                      f"{k.valid_until:%Y-%m-%d %H:%M}" if k.valid_until else "",
                      f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "")
    console.print(table)


@app.command()
@friendly
def provision(
    site_id: str = typer.Argument(..., help="the new site's id (letters, digits, _.-)"),
    profile: str = typer.Option(..., "--profile", "-p", help="gateway profile name (firmware_configs/) or path"),
    config: Path = config_option(),
    out: Path | None = typer.Option(None, "--out", "-o", help="bundle file (default ./<SITE>.wildfed-bundle.tar)"),
    broker_ca: Path | None = typer.Option(None, "--broker-ca", help="PEM certificate of the broker's CA"),
    broker_url: str | None = typer.Option(None, "--broker-url", help="broker URL the gateway uses (default: the "
                                          "profile's, else this config's)"),
    species: Path | None = typer.Option(None, "--species", help="YAML/JSON list of the site's species rows "
                                        "(scientific_name, class_index, iucn_category)"),
    dataset: str | None = typer.Option(None, "--dataset", help="Camtrap DP folder on the gateway (default "
                                       "<profile data>/camtrap)"),
    metadata: str = typer.Option("{}", "--metadata", help='public metadata JSON, e.g. {"capacity": 500, '
                                       '"species": [...]}: capacity is a round number you declare, never the exact '
                                       'record count (docs/privacy.md)'),
    wheel: Path | None = typer.Option(None, "--wheel", help="a prebuilt wildfed-*.whl (default: build it)"),
    backbone: str = typer.Option("efficientnet-lite0", "--backbone", help="the site's frozen backbone "
                                 "(efficientnet-lite0, -lite1 or -lite2; the same for every site of the federation): "
                                 "its ONNX graph goes into the bundle"),
    embedding_input_size: int | None = typer.Option(None, "--embedding-input-size", min=32, help="its input size in "
                                                    "px (default: the backbone's default size)"),
    force: bool = typer.Option(False, help="overwrite an existing bundle file"),
    replace: bool = typer.Option(False, "--replace", help="the site is enrolled already (a lost or broken gateway, "
                                 "a wrong species table): write a new bundle whose key replaces the site's keys at "
                                 "once; its ledger and history stay"),
) -> None:
    """Write a site's provisioning bundle (SDK wheel, profile, fresh key pair, coordinator key, broker CA,
    site.yaml, systemd unit, the backbone's and the detector's ONNX graphs) and enrol the site's public key,
    together or not at all. Exporting the graphs needs torch here (once per backbone and size; cached)."""
    import yaml

    from coordinator.provisioning import provision_site

    cfg = load_config(config)
    meta = parse_metadata(metadata)
    rows = None
    if species is not None:
        if not species.is_file():
            raise ConfigError("species file not found", source=species, field="species", fix="check the path")
        try:
            loaded = yaml.safe_load(species.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}", source=species, field="species", fix="fix the syntax") from exc
        rows = loaded.get("species") if isinstance(loaded, dict) else loaded
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError("expected a list of species rows", source=species, field="species",
                              fix="write - {scientific_name: ..., class_index: 0, iucn_category: CR} per species")
    store, _, _ = open_state(cfg)
    try:
        with console.status("building the SDK wheel, exporting the ONNX graphs (first time: a minute) and writing "
                            "the bundle"):
            result = provision_site(config=cfg, store=store, site_id=site_id, profile=profile,
                                    out=out or Path(f"{site_id}.wildfed-bundle.tar"), broker_ca=broker_ca,
                                    broker_url=broker_url, species=rows, dataset=dataset, metadata=meta,
                                    wheel=wheel, force=force, backbone=backbone,
                                    embedding_input_size=embedding_input_size, replace=replace)
    finally:
        store.dispose()
    console.print(f"[green]provisioned[/] {result.site_id} (profile {result.profile}, key {result.fingerprint[:16]})")
    console.print(escape(f"  bundle      {result.bundle_path} ({result.bundle_path.stat().st_size / 1e6:.1f} MB; "
                         "holds the site's private key: mode 0600, delete after install)"))
    if result.broker_is_loopback:
        err_console.print(f"[bold yellow]warning:[/] the gateway will connect to {escape(result.broker_url)}, its own "
                          "loopback "
                          "address; pass --broker-url mqtt://<broker host>:1883 for a gateway in the field")
    if not cfg.species and cfg.model != "radio_unet":
        err_console.print("[bold yellow]warning:[/] the coordinator config has no species table (`species`), so the "
                          "bundle cannot name the federation's classes: the gateway names a species only its own "
                          "table lists, others as class_N; add `species` (class index, scientific name, IUCN "
                          "category per class) and provision again")
    console.print(escape(f"  on the gateway: wildfed-edge install-bundle {result.bundle_path.name} --prefix "
                         f"/opt/wildfed --coordinator-fingerprint {result.coordinator_fingerprint[:32]}"))
