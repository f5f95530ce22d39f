"""Model releases: every new global model reaches every camera gateway, signed and retained on the broker.

A task carries the global model only to the sites selected for a round, and no task follows the last round, so
without this a gateway's ``detect`` and field loop would keep the model of the last task it trained on. After every
round that makes a new model (:meth:`coordinator.rounds.RoundManager` calls :meth:`ModelPublisher.release`; the
last round of ``run``, and of ``service`` once ``schedule.max_rounds`` is reached, among them), the coordinator
publishes to each enrolled camera site with a valid key a MODEL envelope (``shared.releases``), signed with its key
as tasks are, addressed to the site, on the site's ``model`` topic, **retained**: a gateway that connects later (or
restarts) receives it on subscribing, from the broker, whether or not a coordinator runs then.

- NIRA releases each site its cluster's model (``Strategy.site_weights``: phi with its cluster's head), as its task
  would carry; FedAvg the global model. The post-hoc logit adjustment goes beside the weights
  (``prediction_offsets``), as in tasks.
- A model larger than ``transfer.chunk_size_bytes`` goes as its signed manifest on ``model`` and its chunks on
  ``model/0``, ``model/1``, ... (each retained; ``shared.topics.model_chunk_topic``); chunk topics left over from
  a larger earlier model are cleared (an empty retained message).
- What each site was released is kept in the strategy-state table (``model_release/<site>``: the model version,
  the site's model hash, its round, the number of chunk topics). :meth:`ModelPublisher.catch_up` releases the
  current model to the sites that lack it: at every coordinator start (sites enrolled meanwhile, a release that
  failed, a database from before releases existed) and, in ``service``, at every look at the schedule. It reads one
  row per site when nothing changed.
- A failure to publish is logged and never fails a round: the site is tried again at the next catch-up.

Radio federations (``model: radio_unet``) release nothing: a base station predicts nothing on its own. Nothing here
is charged to any budget: the model is post-processing of what the ledger charged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from shared.codec import decode_tensors, model_hash
from shared.envelope import Envelope, MessageKind, readdress, seal
from shared.releases import ModelRelease, encode_release
from shared.topics import model_chunk_topic, model_topic
from shared.transfer import piece_size_for

from coordinator.config import CoordinatorConfig
from coordinator.registry import SiteRegistry
from coordinator.retained import publish_retained
from coordinator.storage import RoundRow, Store
from coordinator.strategies.base import Strategy
from coordinator.transport import Transport

__all__ = ["ModelPublisher", "release_state_key"]

log = logging.getLogger(__name__)


def release_state_key(site_id: str) -> str:
    """The strategy-state key under which the model released to ``site_id`` is recorded (module docstring)."""
    return f"model_release/{site_id}"


class ModelPublisher:
    """Publishes model releases (module docstring). Built by :class:`coordinator.service.Coordinator`.

    Args:
        config: the coordinator config (federation, model kind, ``release_models``, chunk size).
        store, registry: coordinator state (the current model, the sites and their keys, what was released).
        transport: where releases are published (retained).
        signing_key: the coordinator's Ed25519 key (signs releases, as it signs tasks).
        strategy: the aggregation strategy (``site_weights``: what each site's model is).
        offsets: ``offsets()`` -> the post-hoc logit adjustment of the current registry, or None
            (:meth:`coordinator.rounds.RoundManager.prediction_offsets`).
    """

    def __init__(self, *, config: CoordinatorConfig, store: Store, registry: SiteRegistry, transport: Transport,
                 signing_key: Ed25519PrivateKey, strategy: Strategy,
                 offsets: Callable[[], tuple[float, ...] | None] = lambda: None) -> None:
        self.config = config
        self._store = store
        self._registry = registry
        self._transport = transport
        self._key = signing_key
        self._strategy = strategy
        self._offsets = offsets
        self._names: frozenset[str] | None = None
        self._skipped: set[tuple[str, str]] = set()  # (site, model version) not releasable: said once

    @property
    def enabled(self) -> bool:
        """Whether this federation releases models: ``release_models`` and the head model (camera traps)."""
        return bool(self.config.release_models) and self.config.model == "head"

    def _model_names(self) -> frozenset[str]:
        """The tensor names of a site's model (the head model's, as the config defines it)."""
        if self._names is None:
            from shared.models.kinds import model_spec

            self._names = frozenset(model_spec("head", self.config.num_classes,
                                               adapter_width=self.config.adapter_width).initial_weights(0))
        return self._names

    def _sites(self) -> list[str]:
        """Enrolled sites with a valid key (a revoked site is released nothing)."""
        return [s.site_id for s in self._registry.list() if self._registry.verification_keys(s.site_id)]

    # ---- releasing -----------------------------------------------------------------------------------------------
    def release(self, round_: int, bundle_hash: str, bundle: Mapping[str, np.ndarray],
                sites: list[str] | None = None) -> dict[str, str]:
        """Publish the model version ``bundle_hash`` (made by round ``round_``) to ``sites`` (default: every enrolled
        site with a valid key), each its own model (``strategy.site_weights``). Never raises: what fails is logged
        and left for :meth:`catch_up`.

        Returns:
            ``{site: hash of the model released to it}`` for the sites it was published to.
        """
        if not self.enabled or round_ < 1:
            return {}
        try:
            return self._release(round_, bundle_hash, bundle, self._sites() if sites is None else sites)
        except Exception:  # noqa: BLE001 - a release is a convenience: it must never cost a round
            log.exception("releases: the model of round %d could not be released; tried again at the next start",
                          round_)
            return {}

    def _release(self, round_: int, bundle_hash: str, bundle: Mapping[str, np.ndarray],
                 sites: list[str]) -> dict[str, str]:
        cfg = self.config
        offsets = self._offsets()
        sealed: dict[str, Envelope] = {}  # site model hash -> the first envelope sealed for it
        released: dict[str, str] = {}
        for site_id in sites:
            try:
                weights = self._strategy.site_weights(bundle, site_id)
                problem = None if set(weights) == self._model_names() else (
                    f"not a whole head model: {sorted(set(weights) ^ self._model_names())[:4]}")
            except KeyError as exc:  # NIRA: a site enrolled after the round's clustering has no cluster yet
                problem = f"no cluster yet ({exc})"
            if problem is not None:  # NIRA: the site's (new) cluster gets its head at the next round
                if (site_id, bundle_hash) not in self._skipped:
                    self._skipped.add((site_id, bundle_hash))
                    log.info("releases: no model of version %s for %s: %s; released after its next round",
                             bundle_hash[:12], site_id, problem)
                continue
            h = model_hash(weights)
            first = sealed.get(h)
            if first is None:
                payload = encode_release(ModelRelease(federation_id=cfg.federation_id, round=round_, model_hash=h,
                                                      prediction_offsets=offsets), weights)
                env = sealed[h] = seal(private_key=self._key, federation_id=cfg.federation_id, site_id=site_id,
                                       round=round_, base_model_hash=h, kind=MessageKind.MODEL, sequence=round_,
                                       payload=payload, piece_size=piece_size_for(cfg.transfer.chunk_size_bytes))
            else:
                env = readdress(first, private_key=self._key, site_id=site_id)
            try:
                chunks = self._publish(site_id, env)
            except Exception as exc:  # noqa: BLE001 - e.g. TransportError: the next catch-up tries again
                log.error("releases: round %d model not published to %s (%s: %s); tried again at the next start",
                          round_, site_id, type(exc).__name__, exc)
                continue
            self._store.set_state(release_state_key(site_id), {"bundle": bundle_hash, "model": h, "round": round_,
                                                               "chunks": chunks})
            released[site_id] = h
        if released:
            log.info("releases: round %d model released to %d site(s) (%s)", round_, len(released),
                     ", ".join(sorted({v[:12] for v in released.values()})))
        return released

    def _publish(self, site_id: str, env: Envelope) -> int:
        """Publish one sealed MODEL retained on the site's topics (:func:`coordinator.retained.publish_retained`);
        returns the number of chunk topics it uses."""
        fed = self.config.federation_id
        before = int((self._store.get_state(release_state_key(site_id)) or {}).get("chunks", 0))
        return publish_retained(self._transport, env, topic=model_topic(fed, site_id),
                                chunk_topic=lambda i: model_chunk_topic(fed, site_id, i),
                                chunk_size_bytes=self.config.transfer.chunk_size_bytes, signing_key=self._key,
                                previous_chunks=before)

    # ---- catching up ---------------------------------------------------------------------------------------------
    def current(self) -> tuple[int, str] | None:
        """``(round, model version hash)`` of the newest closed round, or None when no round made a model yet."""
        with self._store.session() as s:
            row = s.execute(select(RoundRow.round, RoundRow.new_model_hash).where(RoundRow.status == "closed")
                            .order_by(RoundRow.round.desc())).first()
        return None if row is None or row[1] is None else (int(row[0]), str(row[1]))

    def pending_sites(self) -> list[str]:
        """The sites whose recorded release is not the current model version (empty when none is made yet)."""
        current = self.current()
        if current is None or not self.enabled:
            return []
        return [s for s in self._sites()
                if (self._store.get_state(release_state_key(s)) or {}).get("bundle") != current[1]]

    def catch_up(self) -> dict[str, str]:
        """Release the current model to every site that lacks it (module docstring). Never raises.

        Returns:
            ``{site: hash of the model released to it}``.
        """
        try:
            sites = self.pending_sites()
            if not sites:
                return {}
            round_, bundle_hash = self.current()  # type: ignore[misc]
            bundle, _ = decode_tensors(self._store.get_model(bundle_hash))
        except Exception:  # noqa: BLE001 - e.g. the database is briefly away: the next look tries again
            log.exception("releases: could not read the current model to release it")
            return {}
        return self.release(round_, bundle_hash, bundle, sites)
