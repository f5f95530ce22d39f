"""How well the federation names real camera-trap species: leave-one-site-out on the real photos, over MQTT.

For each reserve of :mod:`wildfed_sim.real_photo_sites` and each held-out site h, the other sites form a
federation that trains for real: a coordinator, one ``wildfed-edge run`` gateway process per site, a broker
(``--broker``, else an embedded one), signed updates; each gateway trains on the verified crops of its own package
(the labelled photos, each embedded as the detector's crop). The final served model then names the crops of h
(its package's labelled boxes, embedded exactly as ``wildfed-edge detect`` embeds a detection). Beside it:

- the **central head**: the same head trained non-privately on the pooled training crops with the same optimiser
  (full-batch gradient descent; learning rate and steps), the ceiling a federation can reach;
- the **federation without privacy** (``privacy: none``): one local full-batch step per round, FedAvg, server
  learning rate 1: with the same learning rate and as many rounds as the central head's steps it computes the same
  gradient steps, so it must match the ceiling up to float rounding;
- the **federation under the default DP** (local CCDP, gamma 1 with VU at epsilon 1, delta 1e-5), over
  ``--dp-seeds`` runs (the noise is drawn from the OS's secure source; only the round-0 model is seeded).

Hyperparameters are chosen per fold on the training sites only (an inner leave-one-site-out over the training
sites), from one grid for the central head (which the non-private federation then runs), and from one grid for
DP, tuned with the in-process replay of the federation on tuning noise draws that are not reported. A held-out
site is scored only on the species some training site holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key

from wildfed_sim.real_photo_sites import Reserve, SiteSource

__all__ = ["GD_GRID", "DP_GRID", "SiteCrops", "site_crops", "central_head", "predict", "scored_mask", "inner_choice",
           "run_federation"]

#: (learning rate, gradient steps) of the central head and the non-private federation (steps = rounds)
GD_GRID = list(itertools.product((0.3, 1.0, 3.0), (30, 100)))
#: (learning rate, rounds) of the DP federation (one local step per round, expected batch 64, C = 1)
DP_GRID = list(itertools.product((1.0, 4.0, 12.0), (10, 30)))


@dataclasses.dataclass(frozen=True)
class SiteCrops:
    """A site's verified crops as the gateway trains on them: float32 (N, 1280) embeddings, int64 (N,) classes."""

    site_id: str
    features: np.ndarray
    labels: np.ndarray


def site_crops(source: SiteSource, reserve: Reserve, cache: Path) -> SiteCrops:
    """Load and embed a site's package as its gateway does (:func:`edge_sdk.data.camtrap_dp.load_camtrap_dp`,
    :func:`edge_sdk.data.embedding.embed_dataset`)."""
    from edge_sdk.data.camtrap_dp import load_camtrap_dp
    from edge_sdk.data.embedding import embed_dataset

    table = {e["scientific_name"]: (e["class_index"], e["iucn_category"]) for e in reserve.species_table()}
    data = embed_dataset(load_camtrap_dp(source.package, table), cache / source.site_id)
    return SiteCrops(source.site_id, data.features, data.labels)


def central_head(features: np.ndarray, labels: np.ndarray, *, num_classes: int, learning_rate: float,
                 steps: int) -> dict[str, np.ndarray]:
    """The head (``psi`` on the 1280-d embedding) by full-batch gradient descent on the softmax cross-entropy from
    zero, in float64 numpy: ``W -= lr * mean_i (softmax(W x_i + b) - onehot_i) x_i^T``."""
    x = np.asarray(features, np.float64)
    onehot = np.eye(num_classes)[labels]
    w = np.zeros((num_classes, x.shape[1]))
    b = np.zeros(num_classes)
    for _ in range(steps):
        logits = x @ w.T + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(x)
        w -= learning_rate * g.T @ x
        b -= learning_rate * g.sum(axis=0)
    return {"psi.weight": w.astype(np.float32), "psi.bias": b.astype(np.float32)}


def predict(weights: dict[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    """Arg-max class of each embedding under a head model (``psi`` only)."""
    logits = np.asarray(features, np.float64) @ np.asarray(weights["psi.weight"], np.float64).T
    return np.argmax(logits + np.asarray(weights["psi.bias"], np.float64), axis=1)


def scored_mask(test: SiteCrops, train: Sequence[SiteCrops]) -> np.ndarray:
    """bool (N,): the held-out crops whose species some training site holds (the ones a fold scores)."""
    held = set(np.concatenate([s.labels for s in train]).tolist())
    return np.array([int(y) in held for y in test.labels], bool)


def inner_choice(train: Sequence[SiteCrops], num_classes: int, grid: Sequence[tuple[float, int]]
                 ) -> tuple[float, int]:
    """The grid point with the most correct held-out crops over an inner leave-one-site-out on ``train`` (ties:
    the first in grid order)."""
    best, best_score = grid[0], -1
    for lr, steps in grid:
        score = 0
        for i, inner in enumerate(train):
            rest = [s for j, s in enumerate(train) if j != i]
            w = central_head(np.concatenate([s.features for s in rest]), np.concatenate([s.labels for s in rest]),
                             num_classes=num_classes, learning_rate=lr, steps=steps)
            mask = scored_mask(inner, rest)
            score += int(np.sum(predict(w, inner.features)[mask] == inner.labels[mask]))
        if score > best_score:
            best, best_score = (lr, steps), score
    return best


def _site_config(work: Path, source: SiteSource, reserve: Reserve, *, federation_id: str, broker_url: str,
                 coordinator_pub: Path, cache: Path, privacy: str) -> tuple[Path, str]:
    site_dir = work / source.site_id
    key = generate_signing_key()
    save_private_key(key, site_dir / "keys" / "site.key")
    config = {"federation_id": federation_id, "site_id": source.site_id, "dataset": str(source.package),
              "species": reserve.species_table(), "num_classes": len(reserve.classes),
              "private_key": "keys/site.key", "coordinator_public_key": str(coordinator_pub),
              "broker_url": broker_url, "outbox": "state/outbox.sqlite", "backend": "torch", "threads": 1,
              "embedding_cache": str(cache / source.site_id), "allow_non_private": privacy == "none"}
    path = site_dir / "site.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, public_key_to_pem(key.public_key())


def run_federation(train: Sequence[SiteSource], crops: Sequence[SiteCrops], reserve: Reserve, *, work: Path,
                   cache: Path, privacy: str, learning_rate: float, rounds: int, broker_url: str | None,
                   seed: int, console: Any) -> dict[str, np.ndarray]:
    """One real federation of the ``train`` sites over MQTT (module docstring); returns the final served model.

    ``privacy``: ``none`` (one full-batch local step per round) or ``ccdp`` (the coordinator's default CCDP; one
    local step, expected batch 64, clipping norm 1).
    """
    from coordinator.config import config_from_dict
    from coordinator.service import Coordinator
    from wildfed_sim.embedded_broker import embedded_broker
    from wildfed_sim.gateway_processes import running_gateways

    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    (work / "ready").mkdir(exist_ok=True)
    federation_id = f"real-photos-{secrets.token_hex(4)}"
    coord_key = generate_signing_key()
    save_private_key(coord_key, work / "coordinator" / "keys" / "coordinator.key")
    coordinator_pub = save_public_key(coord_key.public_key(), work / "coordinator" / "keys" / "coordinator.pub")
    with ExitStack() as stack:
        url = broker_url or stack.enter_context(embedded_broker(log_path=work / "logs" / "broker.log"))
        configs = [_site_config(work, s, reserve, federation_id=federation_id, broker_url=url,
                                coordinator_pub=coordinator_pub, cache=cache, privacy=privacy) for s in train]
        n_max = max(len(c.labels) for c in crops)
        config = config_from_dict({
            "federation_id": federation_id, "data_dir": str(work / "coordinator"), "broker_url": url,
            "signing_key_path": str(work / "coordinator" / "keys" / "coordinator.key"),
            "public_key_path": str(coordinator_pub), "rounds": rounds, "round_deadline_s": 120,
            "local_steps": 1, "expected_batch_size": n_max if privacy == "none" else 64,
            "learning_rate": learning_rate, "clipping_norm": 1.0, "privacy": privacy, "model": "head",
            "adapter_width": 0, "num_classes": len(reserve.classes), "posthoc_logit_adjustment": 0.0,
            "server_optimizer": {"kind": "sgd", "momentum": 0.0}, "seed": seed,
            "species": reserve.species_table()}).resolved(work)
        zero = {"psi.weight": np.zeros((len(reserve.classes), 1280), np.float32),
                "psi.bias": np.zeros(len(reserve.classes), np.float32)}  # the central head's start
        coordinator = stack.enter_context(Coordinator(config, initial_weights=zero))
        for (path, pem), c in zip(configs, crops):
            coordinator.enrol(path.parent.name, pem, {"capacity": int(len(c.labels))})
        stack.enter_context(running_gateways([p for p, _ in configs], work / "logs", work / "ready", console))
        started = time.monotonic()
        for result in coordinator.iter_rounds():
            if len(result.accepted) != len(train):
                console.log(f"round {result.round}: {len(result.accepted)}/{len(train)} updates ({result.status})")
        console.log(f"{rounds} rounds ({privacy}) in {time.monotonic() - started:.0f} s")
        _, trained = coordinator.rounds.current_model()
        return coordinator.rounds.served_model(trained)
