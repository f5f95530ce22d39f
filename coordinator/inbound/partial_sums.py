"""Partial sums: what each ingest worker keeps of the updates it accepted, and the finaliser's merge of them.

Written by :class:`coordinator.inbound.workers.IngestWorker` after every accepted update (``partial_sums`` table + a
blob); merged by the round manager when it closes a scale-out round (:func:`collect_round`, called from
:mod:`coordinator.rounds`). Both import this module; neither imports the other for it. The blob is safetensors
(float64 running sums) with the total weight, count, contributors and template dtypes in its metadata: never
pickled. The design is :mod:`coordinator.inbound.workers`' docstring.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from sqlalchemy import select

from shared.codec import decode_tensors, encode_tensors
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import decode_update

from coordinator.inbound.context import Accepted
from coordinator.storage import PartialSumRow, Store
from coordinator.strategies.fedavg import RunningWeightedSum, add_weighted, merge, new_running_sum

__all__ = ["encode_partial", "decode_partial", "accepted_to_json", "accepted_from_json", "collect_round"]

log = logging.getLogger(__name__)


def _event_json(e: DPSGDEvent) -> list[float]:
    return [e.noise_multiplier, e.sampling_rate, e.steps]


def _event(v: list) -> DPSGDEvent:
    return DPSGDEvent(float(v[0]), float(v[1]), int(v[2]))


def accepted_to_json(a: Accepted) -> dict[str, Any]:
    """One accepted update as the JSON a partial-sum row keeps (``sites_json``): its identity, weight, blob digest,
    DP events as ``[noise_multiplier, sampling_rate, steps]`` per IUCN category, and its species counts."""
    return {"site_id": a.site_id, "sequence": a.sequence, "num_examples": a.num_examples, "weight": a.weight,
            "payload_sha256": a.payload_sha256, "events": {c.value: _event_json(e) for c, e in a.events.items()},
            "count_events": {c.value: _event_json(e) for c, e in a.count_events.items()},
            "species_counts": {str(k): v for k, v in a.species_counts.items()}}


def accepted_from_json(round: int, d: Mapping[str, Any]) -> Accepted:
    """Inverse of :func:`accepted_to_json` for an update of ``round``.

    Raises:
        KeyError, ValueError: ``d`` is not what :func:`accepted_to_json` wrote.
    """
    return Accepted(site_id=d["site_id"], round=round, sequence=int(d["sequence"]),
                    num_examples=int(d["num_examples"]), weight=float(d["weight"]),
                    payload_sha256=d["payload_sha256"],
                    events={IUCNCategory(c): _event(e) for c, e in d["events"].items()},
                    count_events={IUCNCategory(c): _event(e) for c, e in d["count_events"].items()},
                    species_counts={int(k): float(v) for k, v in d["species_counts"].items()})


def encode_partial(acc: RunningWeightedSum) -> bytes:
    """A partial sum as safetensors: the float64 sums, with total weight, count, contributors and the template
    dtypes in the metadata (never pickled)."""
    meta = {"total_weight": repr(float(acc.total_weight)), "count": str(acc.count),
            "contributors": json.dumps(acc.contributors),
            "dtypes": json.dumps({k: np.dtype(v).str for k, v in acc.dtypes.items()})}
    return encode_tensors(acc.sums, meta)


def decode_partial(data: bytes) -> RunningWeightedSum:
    """Inverse of :func:`encode_partial`.

    Raises:
        PayloadError: not a partial-sum blob.
    """
    sums, meta = decode_tensors(data)
    return RunningWeightedSum(sums={k: np.asarray(v, dtype=np.float64) for k, v in sums.items()},
                              dtypes={k: np.dtype(v) for k, v in json.loads(meta["dtypes"]).items()},
                              total_weight=float(meta["total_weight"]), count=int(meta["count"]),
                              contributors=list(json.loads(meta["contributors"])))


def collect_round(store: Store, round: int, template: Mapping[str, np.ndarray]
                  ) -> tuple[RunningWeightedSum, dict[str, Accepted]]:
    """The finaliser's merge (module docstring): the workers' partial sums of ``round``, plus every stored update no
    partial covers, read from its blob. Only updates with a row in ``updates`` count (a partial never covers more).

    Returns:
        ``(merged running sum, {site: Accepted})`` over exactly the round's stored updates.
    """
    stored = {u.site_id: u for u in store.updates_for_round(round)}
    with store.session() as s:
        partials = list(s.scalars(select(PartialSumRow).where(PartialSumRow.round == round)
                                  .order_by(PartialSumRow.worker_id)))
    acc = new_running_sum(template)
    accepted: dict[str, Accepted] = {}
    for p in partials:
        covered = [accepted_from_json(round, d) for d in json.loads(p.sites_json)]
        if not covered or any(a.site_id not in stored for a in covered):
            continue  # cannot happen (partials are written after the rows), but never merge unstored updates
        if any(a.site_id in accepted for a in covered):
            continue  # a site in two partials cannot happen (unique round+site rows); skip rather than double
        acc = merge(acc, decode_partial(store.get_blob(p.blob_sha256)))
        for a in covered:
            accepted[a.site_id] = a
    for site_id, upd in stored.items():
        if site_id in accepted:
            continue
        report, delta = decode_update(store.get_blob(upd.payload_sha256))
        add_weighted(acc, delta, float(report.num_examples))
        acc.contributors.append(site_id)
        accepted[site_id] = Accepted(site_id=site_id, round=round, sequence=upd.sequence,
                                     num_examples=upd.num_examples, weight=float(report.num_examples),
                                     payload_sha256=upd.payload_sha256, events=report.events,
                                     count_events=dict(report.count_events),
                                     species_counts=dict(report.species_counts))
        log.warning("collect: round %d update of %s was in no partial sum (its worker stopped?); read from its blob",
                    round, site_id)
    return acc, accepted
