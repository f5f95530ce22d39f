"""The agent's side of signed SDK updates: a published version from the broker, verified, then staged when idle.

The gateway subscribes to ``software/#`` (``shared.topics.software_filter``) and receives the retained SOFTWARE
envelope, whole or chunked (:class:`edge_sdk.rounds.retained.RetainedDownload`: the coordinator's signature, kind,
federation, addressee, the chunks' leaves). :meth:`SoftwareUpdates.handle` then decodes the release
(``shared.software``: every file's size and SHA-256 against the signed listing) and checks, in order:

| check | refusal (``rejected:<reason>`` / counter) |
|---|---|
| the release names the header's federation, its ``issued`` is the header's ``sequence`` and its SDK wheel's SHA-256 the header's ``base_model_hash`` | ``header_mismatch`` |
| this install takes updates (``sdk/install.json`` beside ``site.yaml``: installed from a bundle with a venv) | ``software_not_updatable`` (logged once) |
| the version is not the one running | ``software_current`` |
| the version did not fail here before (``sdk/state.json`` ``failed``) | ``software_failed_before`` (logged once) |
| ``issued`` is newer than the last release acted on (a replayed older release would take the gateway back) | ``rejected:stale_release`` |

A release that passes waits (in memory) until the agent is idle: no round's reply waiting for its time slot, no
secure-aggregation round, nothing in the outbox. Then :meth:`SoftwareUpdates.stage` installs and checks it
(:mod:`edge_sdk.updates.stage`); a failure is logged as an ERROR (the next health record carries it) and recorded
as failed. A staged version is handed to ``wildfed-edge run``, which stops the agent and switches
(:func:`edge_sdk.updates.trial.begin`, then the launcher).
"""

from __future__ import annotations

import logging
from pathlib import Path

from shared.envelope import Envelope, EnvelopeHeader, MessageKind
from shared.errors import EnvelopeError
from shared.software import SoftwareRelease, decode_software

from edge_sdk.rounds.context import AgentContext
from edge_sdk.rounds.retained import RetainedDownload
from edge_sdk.updates.layout import InstallLayout
from edge_sdk.updates.stage import StagedVersion, StageError, stage_release

__all__ = ["SoftwareUpdates"]

log = logging.getLogger(__name__)


class SoftwareUpdates:
    """Published SDK versions for one agent (module docstring).

    Args:
        ctx: the agent's shared state (keys, config, statistics).
        site_config: the path of the site's ``site.yaml`` (its folder is the install prefix), or None when the
            agent was built from a config object (no updates then).
        running_version: the version running now (``edge_sdk.uplink.health.sdk_version``).
    """

    def __init__(self, ctx: AgentContext, *, site_config: Path | None, running_version: str) -> None:
        self.ctx = ctx
        self.site_config = site_config
        self.layout = InstallLayout.find(site_config) if site_config is not None else None
        self.running_version = running_version
        self.pending: tuple[SoftwareRelease, dict[str, bytes]] | None = None
        self._said: set[tuple[str, str]] = set()
        self._download = RetainedDownload(ctx, kind=MessageKind.SOFTWARE, what="software",
                                          max_bytes=ctx.config.max_task_bytes, wanted=self._wanted)

    def _once(self, key: tuple[str, str], level: int, message: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, message, *args)

    def _wanted(self, header: EnvelopeHeader, _inner_timestamp: int | None) -> bool:
        """A chunked release is received only when it is newer than the last one acted on (its ``sequence`` is the
        release's ``issued``): a release seen before is not downloaded again at every reconnect."""
        return self.layout is None or header.sequence > int(self.layout.state()["last_issued"])

    def handle(self, data: bytes) -> bool:
        """One message from the site's software topics; True when a release now waits to be staged. Never raises
        for bad input from the wire: every refusal is counted and logged."""
        envelope = self._download.handle(data)
        return envelope is not None and self._take(envelope)

    def _take(self, envelope: Envelope) -> bool:
        ctx, h = self.ctx, envelope.header
        try:
            release, files = decode_software(envelope.payload)
        except EnvelopeError as exc:  # PayloadError
            ctx.reject("software", exc.reason, str(exc))
            return False
        if (release.federation_id != h.federation_id or release.issued != h.sequence
                or release.sdk_wheel.sha256 != h.base_model_hash):
            ctx.reject("software", "header_mismatch", "the release's federation/issued/wheel differ from the header")
            return False
        if self.layout is None:
            ctx.stats["software_not_updatable"] += 1
            self._once(("updatable", release.version), logging.WARNING, "site %s: SDK version %s is published, but "
                       "this install takes no updates (no sdk/install.json beside its site.yaml: installed without "
                       "a venv or by hand); reinstall the bundle (wildfed-edge install-bundle --force) or install "
                       "it by hand", ctx.site_id, release.version)
            return False
        if release.version == self.running_version:
            ctx.stats["software_current"] += 1
            return False
        state = self.layout.state()
        if release.version in state["failed"]:
            ctx.stats["software_failed_before"] += 1
            self._once(("failed", release.version), logging.INFO, "site %s: SDK version %s failed here before (%s); "
                       "not tried again until a new release is published", ctx.site_id, release.version,
                       state["failed"][release.version])
            return False
        if release.issued <= int(state["last_issued"]):
            ctx.reject("software", "stale_release", f"version {release.version} issued {release.issued} is not "
                       f"newer than the last release acted on ({state['last_issued']})")
            return False
        self.pending = (release, files)
        log.info("site %s: SDK version %s received (running %s); installed beside it once idle", ctx.site_id,
                 release.version, self.running_version)
        return True

    def report_start(self) -> None:
        """At ``run``'s start, once the agent reached the broker: confirm this version's trial
        (:func:`edge_sdk.updates.trial.confirm`), and report a rollback to this version as an ERROR (the next
        health record carries it)."""
        if self.layout is None:
            return
        from edge_sdk.updates.trial import confirm, take_rollback_notice

        if confirm(self.layout, self.running_version):
            log.info("site %s: SDK version %s came back and is confirmed", self.ctx.site_id, self.running_version)
        notice = take_rollback_notice(self.layout)
        if notice is not None:
            log.error("site %s: SDK update to %s rolled back to %s: %s", self.ctx.site_id, notice.get("version"),
                      notice.get("back_to"), notice.get("reason"))

    def stage(self) -> StagedVersion | None:
        """Install and check the waiting release (:func:`edge_sdk.updates.stage.stage_release`); the staged version,
        or None when there is none or it failed (logged as an ERROR, recorded as failed)."""
        if self.pending is None or self.layout is None or self.site_config is None:
            return None
        release, files = self.pending
        self.pending = None
        self.layout.note("received", release.version, f"issued {release.issued}",
                         last_issued=max(int(self.layout.state()["last_issued"]), release.issued))
        log.info("site %s: installing SDK version %s beside %s", self.ctx.site_id, release.version,
                 self.running_version)
        try:
            staged = stage_release(self.layout, release, files, site_config=self.site_config,
                                   running_version=self.running_version)
        except StageError as exc:
            body = self.layout.state()
            body["failed"][release.version] = str(exc)
            self.layout.save_state(body)
            self.layout.note("failed", release.version, str(exc)[:300])
            self.ctx.stats["software_failed"] += 1
            log.error("site %s: SDK update to %s failed, staying on %s: %s", self.ctx.site_id, release.version,
                      self.running_version, exc)
            return None
        self.ctx.stats["software_staged"] += 1
        log.info("site %s: SDK version %s installed and checked; switching", self.ctx.site_id, release.version)
        return staged
