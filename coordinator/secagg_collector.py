"""Collecting the sites' secure-aggregation messages of a Global DP round (stage 3 of :mod:`coordinator.global_dp`).

The service subscribes a :class:`SecAggCollector` to ``shared.topics.secagg_filter``; it verifies each signed SECAGG
envelope and files its body in the open round's :class:`StageInbox`, from which
:class:`coordinator.secagg_round.SecureAggregationRound` takes each stage's messages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from shared.envelope import Envelope, MessageKind
from shared.errors import PayloadError
from shared.iucn import IUCNCategory, parse_category
from shared.protocol import SITE_STAGES, SecAggMessage, decode_secagg
from shared.secagg import AdvertisedKeys, EncryptedShare, RecoveryShares, SecAggError

from coordinator.inbound.reject import Reject, RejectReason
from coordinator.inbound.site_checks import parse_site_envelope, verify_site_envelope
from coordinator.registry import SiteRegistry
from coordinator.storage import Store

__all__ = ["StageInbox", "SecAggCollector"]

log = logging.getLogger("coordinator.global_dp")  # Global DP's log, whichever of its modules writes


@dataclass
class StageInbox:
    """The verified secure-aggregation messages of one round, per stage and site.

    Attributes:
        keys: ``{site: AdvertisedKeys}``. shares: ``{sender: {recipient: EncryptedShare}}``.
        masked: ``{site: (masked vector uint32/uint64 (d,), N_k, active categories)}``, in arrival order.
        recovery: ``{site: RecoveryShares}``.
    """

    round: int
    model_hash: str
    selected: frozenset[str]
    keys: dict[str, AdvertisedKeys] = field(default_factory=dict)
    shares: dict[str, dict[str, EncryptedShare]] = field(default_factory=dict)
    masked: dict[str, tuple[np.ndarray, int, tuple[IUCNCategory, ...]]] = field(default_factory=dict)
    recovery: dict[str, RecoveryShares] = field(default_factory=dict)

    def stage(self, name: str) -> dict:
        """The dict of stage ``name`` (``keys``, ``shares``, ``masked``, ``recovery``)."""
        return {"keys": self.keys, "shares": self.shares, "masked": self.masked, "recovery": self.recovery}[name]


class SecAggCollector:
    """Transport callback for ``site/+/secagg``: verify each SECAGG envelope and file it in the open round's
    :class:`StageInbox`.

    Checks, in order (reason codes of :class:`coordinator.inbound.reject.RejectReason`, stored and counted in ``status``):
    envelope, topic, kind, federation, site as in ingest; enrolled site and Ed25519 signature; a Global DP round is
    open and the header names it (``wrong_round``); the site was selected (``not_selected``); the base model is
    the round's (``stale_model``); the payload decodes to a site stage (``malformed_payload``); the body is
    well-formed and names the sender (``secagg_protocol``); one message per site and stage (``duplicate``).
    Never raises for bad input. Thread-safe; ``changed`` is notified after each message.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry) -> None:
        self.federation_id = federation_id
        self._store = store
        self._registry = registry
        self._inbox: StageInbox | None = None
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)

    def open_round(self, round: int, model_hash: str, selected: Iterable[str]) -> StageInbox:
        """Start collecting for ``round``; returns its (live) inbox."""
        with self._lock:
            self._inbox = StageInbox(round=round, model_hash=model_hash, selected=frozenset(selected))
            return self._inbox

    def inbox(self, round: int) -> StageInbox:
        """The live inbox of ``round``.

        Raises:
            SecAggError: ``round`` is not the round being collected.
        """
        inbox = self._inbox
        if inbox is None or inbox.round != round:
            raise SecAggError(f"round {round} is no longer being collected")
        return inbox

    def record_rejection(self, round: int, site: str, detail: str) -> None:
        """Store and count a ``secagg_protocol`` rejection the round driver decided (e.g. an unusable masked sum)."""
        log.warning("secagg: round %d: site %s %s", round, site, detail)
        self._store.add_rejection(round=round, site_id=site, topic="secagg", reason=RejectReason.SECAGG_PROTOCOL.value,
                                  error_kind="check", detail=detail)

    def close_round(self) -> None:
        """Stop collecting (later messages are ``wrong_round``)."""
        with self._lock:
            self._inbox = None
            self.changed.notify_all()

    def wait_for(self, stage: str, expected: Iterable[str], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> set[str]:
        """Block until every site of ``expected`` has sent ``stage`` or ``timeout_s`` passes; return who has."""
        expected = set(expected)
        deadline = clock() + timeout_s
        with self.changed:
            while True:
                inbox = self._inbox
                have = set(inbox.stage(stage)) & expected if inbox is not None else set()
                left = deadline - clock()
                if have >= expected or left <= 0 or inbox is None:
                    return have
                self.changed.wait(timeout=min(left, 0.5))

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    def handle(self, topic: str, raw: bytes) -> str | None:
        """File one message; returns None if it was filed, else the rejection reason code."""
        with self._lock:
            env: Envelope | None = None
            try:
                env = parse_site_envelope(topic, raw, federation_id=self.federation_id, kind=MessageKind.SECAGG)
                verify_site_envelope(env, self._registry)
                self._file(env)
                return None
            except Reject as rej:
                h = env.header if env is not None else None
                log.warning("secagg: rejected message on %s: %s: %s", topic, rej.reason.value, rej.detail)
                self._store.add_rejection(round=h.round if h else None, site_id=h.site_id if h else None,
                                          topic=topic, reason=rej.reason.value, error_kind=rej.error_kind,
                                          detail=rej.detail)
                return rej.reason.value
            finally:
                self.changed.notify_all()

    def _file(self, env: Envelope) -> None:
        h, inbox = env.header, self._inbox
        if inbox is None or h.round != inbox.round:
            raise Reject(RejectReason.WRONG_ROUND, f"secagg message for round {h.round}, open Global DP round is "
                          f"{'none' if inbox is None else inbox.round}")
        if h.site_id not in inbox.selected:
            raise Reject(RejectReason.NOT_SELECTED, f"site {h.site_id!r} was not selected for round {h.round}")
        if h.base_model_hash != inbox.model_hash:
            raise Reject(RejectReason.STALE_MODEL, f"secagg message for model {h.base_model_hash[:12]}")
        try:
            message = decode_secagg(env.payload, stages=SITE_STAGES)
        except PayloadError as exc:
            raise Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
        site, stage = h.site_id, message.stage
        if site in inbox.stage(stage):
            raise Reject(RejectReason.DUPLICATE, f"site {site!r} already sent its {stage} for round {h.round}")
        try:
            self._parse_stage(inbox, site, message)
        except (PayloadError, SecAggError, ValueError) as exc:
            raise Reject(RejectReason.SECAGG_PROTOCOL, f"{stage}: {exc}", exc) from exc

    @staticmethod
    def _parse_stage(inbox: StageInbox, site: str, message: SecAggMessage) -> None:
        body = message.body
        if message.stage == "keys":
            keys = AdvertisedKeys.from_json(dict(body))
            if keys.site_id != site:
                raise PayloadError(f"keys name site {keys.site_id!r}, the envelope {site!r}")
            inbox.keys[site] = keys
        elif message.stage == "shares":
            raw = body.get("shares")
            if not isinstance(raw, list) or set(body) != {"shares"}:
                raise PayloadError("shares body must be {'shares': [...]}")
            shares = [EncryptedShare.from_json(x) for x in raw]
            if any(s.sender != site for s in shares) or len({s.recipient for s in shares}) != len(shares):
                raise PayloadError("every share must come from the sender, one per recipient")
            inbox.shares[site] = {s.recipient: s for s in shares}
        elif message.stage == "masked":
            n, cats = body.get("num_examples"), body.get("categories")
            if set(body) != {"num_examples", "categories"} or type(n) is not int or n < 1:
                raise PayloadError("masked body must be {'num_examples': positive int, 'categories': [...]}")
            if not isinstance(cats, list) or not cats:
                raise PayloadError("categories must be a non-empty list of IUCN codes")
            categories = tuple(sorted({parse_category(c, field="categories") for c in cats}, key=lambda c: c.rank))
            assert message.masked is not None  # decode_secagg guarantees it for this stage
            inbox.masked[site] = (message.masked, n, categories)
        else:  # recovery
            shares = RecoveryShares.from_json(dict(body))
            if shares.sender != site:
                raise PayloadError(f"recovery shares name sender {shares.sender!r}, the envelope {site!r}")
            inbox.recovery[site] = shares
