"""Helpers for coordinator tests: a tiny float32 model, a config, fake in-process sites (imported by the tests)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.envelope import DEFAULT_PIECE_SIZE, Envelope, MessageKind, seal, verify
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.privacy.events import DPSGDEvent
from shared.protocol import (COORDINATOR_STAGES, SecAggMessage, TrainingTask, UpdateReport, canonical_flatten,
                             decode_ack, decode_secagg, decode_task, encode_secagg, encode_update)
from shared.secagg import AdvertisedKeys, EncryptedShare, RecoveryRequest, SecAggClient
from shared.topics import ack_topic, secagg_topic, task_topic, update_topic

from coordinator.config import config_from_dict
from coordinator.transport import InMemoryTransport

FED = "testfed"


def tiny_weights() -> dict[str, np.ndarray]:
    """A two-tensor float32 'model': phi.w (3, 2) and psi.b (2,)."""
    return {"phi.w": np.arange(6, dtype=np.float32).reshape(3, 2) / 10, "psi.b": np.array([0.5, -0.5], np.float32)}


def make_config(tmp_path: Path, **overrides: object):
    data = {"federation_id": FED, "data_dir": str(tmp_path / "data"), "rounds": 2, "quorum_fraction": 1.0,
            "round_deadline_s": 2.0, "local_steps": 5, "expected_batch_size": 8, "learning_rate": 0.1,
            "clipping_norm": 1.0, "target_delta": 1e-5, "privacy": "ccdp",
            "budget": {"kind": "from_anchor", "category": "VU", "epsilon": 1.0, "gamma": 1.0}, "seed": 0,
            "signing_key_path": str(tmp_path / "k.key"), "public_key_path": str(tmp_path / "k.pub")}
    # FakeSite reads the model from its task, so these federations send tasks that carry their weights
    # (transfer.models_by_digest false); the default, models by digest, has its own tests
    # (test_models_by_digest.py) and is what the real gateways' end-to-end tests run
    transfer = {"models_by_digest": False, **dict(overrides.pop("transfer", None) or {})}
    data.update(overrides, transfer=transfer)
    return config_from_dict(data).resolved(tmp_path)


@dataclass
class FakeSite:
    """An in-process gateway: answers each verified TASK with a fixed delta (``value`` everywhere) and events."""

    site_id: str
    transport: InMemoryTransport
    coordinator_public_key: object
    value: float
    num_examples: int
    events: Mapping[IUCNCategory, DPSGDEvent]
    key: object = field(default_factory=generate_signing_key)
    tasks: list[TrainingTask] = field(default_factory=list)
    acks: list = field(default_factory=list)
    tamper: bool = False
    sequence: int = 0
    fed: str = FED
    last_weights: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)  # {class index: count} reported when a task asks for counts
    piece_size: int = DEFAULT_PIECE_SIZE  # of its updates' payload digest: the chunk size if they travel chunked

    def attach(self) -> "FakeSite":
        self.transport.subscribe(task_topic(self.fed, self.site_id), self._on_task)
        self.transport.subscribe(ack_topic(self.fed, self.site_id), self._on_ack)
        return self

    @property
    def public_pem(self) -> str:
        return public_key_to_pem(self.key.public_key())

    def _on_task(self, topic: str, raw: bytes) -> None:
        env = Envelope.from_bytes(raw)
        verify(env, self.coordinator_public_key)
        task, weights = decode_task(env.payload)
        self.tasks.append(task)
        self.last_weights = weights
        delta = {k: np.full_like(v, self.value) for k, v in weights.items()}
        events = {c: e for c, e in self.events.items() if c not in task.halted}  # never sample halted categories
        extra = {}
        if task.count_noise_multiplier is not None:
            z = task.count_noise_multiplier
            extra = {"species_counts": dict(self.counts),
                     "count_events": {c: DPSGDEvent(z, 1.0, 1) for c in events} if z > 0 else {}}
        raw = self.envelope(task.round, task.model_hash, self.payload(delta, events=events, **extra))
        self.transport.publish(update_topic(self.fed, self.site_id), raw)

    def _on_ack(self, topic: str, raw: bytes) -> None:
        env = Envelope.from_bytes(raw)
        verify(env, self.coordinator_public_key)
        self.acks.append(decode_ack(env.payload))

    def payload(self, delta: Mapping[str, np.ndarray], **report_kw: object) -> bytes:
        kw = {"num_examples": self.num_examples, "local_steps": 5, "events": dict(self.events)}
        kw.update(report_kw)
        return encode_update(UpdateReport(**kw), delta)

    def envelope(self, round: int, model_hash: str, payload: bytes, *, key=None, site_id: str | None = None,
                 kind=MessageKind.UPDATE, federation_id: str | None = None) -> bytes:
        self.sequence += 1
        env = seal(private_key=key or self.key, federation_id=federation_id or self.fed, site_id=site_id or self.site_id,
                   round=round, base_model_hash=model_hash, kind=kind, sequence=self.sequence, payload=payload,
                   piece_size=self.piece_size)
        raw = env.to_bytes()
        if self.tamper:
            raw = raw[:-1] + bytes([raw[-1] ^ 0xFF])
        return raw

    def send(self, round: int, model_hash: str, delta: Mapping[str, np.ndarray]) -> None:
        raw = self.envelope(round, model_hash, self.payload(delta))
        self.transport.publish(update_topic(self.fed, self.site_id), raw)


EVENT = DPSGDEvent(noise_multiplier=1.2, sampling_rate=0.05, steps=5)




class SecAggSite:
    """A site that runs the real client side of secure aggregation with a vector chosen by the test.

    ``vector(task)`` gives its clipped sum as ``{name: array}``; ``vanish_after`` names the last stage it sends
    (``"shares"``: it drops before its masked sum, as a gateway losing power would)."""

    def __init__(self, site_id, transport, coordinator_key, *, value, num_examples, categories,
                 vanish_after=None, fed=FED):
        self.site_id, self.transport, self.coordinator_key = site_id, transport, coordinator_key
        self.value, self.num_examples, self.categories = value, num_examples, categories
        self.vanish_after = vanish_after
        self.fed = fed
        self.key = generate_signing_key()
        self.client = None
        self.sent: dict[str, bytes] = {}
        self.history: dict[str, list[bytes]] = {}
        self.ends: list[dict] = []
        self.plain: np.ndarray | None = None
        self.task = None
        transport.subscribe(task_topic(fed, site_id), self.on_message)

    @property
    def public_pem(self):
        return public_key_to_pem(self.key.public_key())

    def send(self, stage, body, masked=None):
        if self.vanish_after is not None and list(self.sent) and list(self.sent)[-1] == self.vanish_after:
            return
        env = seal(private_key=self.key, federation_id=self.fed, site_id=self.site_id, round=self.task.round,
                   base_model_hash=self.task.model_hash, kind=MessageKind.SECAGG, sequence=len(self.sent) + 1,
                   payload=encode_secagg(SecAggMessage(stage, body, masked)))
        self.sent[stage] = env.to_bytes()
        self.history.setdefault(stage, []).append(env.to_bytes())
        self.transport.publish(secagg_topic(self.fed, self.site_id), env.to_bytes())

    def on_message(self, topic, raw):
        env = Envelope.from_bytes(raw)
        verify(env, self.coordinator_key)
        if env.header.kind == MessageKind.TASK:
            self.task, weights = decode_task(env.payload)
            self.client = SecAggClient(self.site_id, self.task.secagg.params(self.fed, self.task.round))
            self.plain = canonical_flatten({k: np.full_like(v, self.value) for k, v in weights.items()})
            self.sent = {}
            self.send("keys", self.client.public_keys().to_json())
            return
        msg = decode_secagg(env.payload, stages=COORDINATOR_STAGES)
        if msg.stage == "key_list":
            shares = self.client.shares_for({k.site_id: k for k in map(AdvertisedKeys.from_json, msg.body["keys"])})
            self.send("shares", {"shares": [s.to_json() for s in shares.values()]})
        elif msg.stage == "share_inbox":
            self.client.receive_shares({s.sender: s for s in map(EncryptedShare.from_json, msg.body["shares"])})
            self.send("masked", {"num_examples": self.num_examples, "categories": self.categories},
                      self.client.mask(self.plain))
        elif msg.stage == "recovery_request":
            self.send("recovery", self.client.reveal_for_recovery(RecoveryRequest.from_json(msg.body)).to_json())
        else:
            self.ends.append(dict(msg.body))


def wide_cli_consoles(monkeypatch, width: int = 1000) -> None:
    """Give every ``wildfed-coordinator`` command module (coordinator/cli/) wide consoles, so that long temporary paths
    are not folded across lines in the captured output (``monkeypatch``: pytest's fixture)."""
    import importlib
    import pkgutil

    from rich.console import Console

    import coordinator.cli

    for info in pkgutil.iter_modules(coordinator.cli.__path__, "coordinator.cli."):
        if info.name.endswith(".__main__"):  # importing it runs the CLI
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "console"):
            monkeypatch.setattr(module, "console", Console(width=width))
        if hasattr(module, "err_console"):
            monkeypatch.setattr(module, "err_console", Console(stderr=True, width=width))
