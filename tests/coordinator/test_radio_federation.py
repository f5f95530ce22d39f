"""A radio-map federation in one process: the coordinator (model radio_unet) and three base-station gateways
(real EdgeAgents with task: radiomap) over an in-process bus; signed tasks carrying the city raster, the gateways'
adaptive grouped noise, ingest's event check, the ledger under NE."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from shared.codec import decode_tensors  # noqa: E402
from shared.iucn import IUCNCategory  # noqa: E402
from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key  # noqa: E402
from shared.privacy.accounting import epsilon_spent  # noqa: E402
from shared.privacy.events import DPSGDEvent  # noqa: E402
from shared.radio import PathLossModel, RadioMapGeometry, city_tiles, generate_maps, transmitter_specs  # noqa: E402

from edge_sdk.agent import EdgeAgent  # noqa: E402
from edge_sdk.radio import ALLOCATOR_FILE  # noqa: E402
from edge_sdk.uplink.transport import Transport  # noqa: E402

from coordinator.service import Coordinator  # noqa: E402
from coordinator.transport import InMemoryTransport  # noqa: E402
from tests.coordinator.helpers import make_config  # noqa: E402

RADIO = {"defence": "adaptive", "noise_multiplier": 3.0, "floor_fraction": 0.5, "clipping_norm": 0.01,
         "width": 2, "proxy_sites": 3, "proxy_maps": 2, "size_px": 32, "metres_per_pixel": 8.0, "epsilon": 30.0,
         "allocator_every": 1}
GEOMETRY = RadioMapGeometry(size_px=32, metres_per_pixel=8.0)


class Bridge(Transport):
    """An edge Transport on the coordinator's in-process bus (tests only)."""

    def __init__(self, bus: InMemoryTransport) -> None:
        self.bus = bus

    def connect(self, timeout_s: float = 10.0) -> None:
        pass

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = 10.0) -> None:
        self.bus.publish(topic, payload)

    def subscribe(self, topic_filter: str, callback) -> None:
        self.bus.subscribe(topic_filter, callback)

    def add_connect_listener(self, listener) -> None:
        pass

    def close(self) -> None:
        pass


def radio_site(root: Path, site_id: str, coordinator_key, seed: int):
    """A base-station site folder: keys, 4 radio maps on its own tile, site.yaml with task: radiomap."""
    key = generate_signing_key()
    save_private_key(key, root / "keys" / "site.key")
    save_public_key(coordinator_key.public_key(), root / "keys" / "coordinator.pub")
    rng = np.random.default_rng(seed)
    tiles = city_tiles(rng, 1, geometry=GEOMETRY)
    generate_maps(tiles, transmitter_specs(tiles, 4, rng), model=PathLossModel(max_walls=4),
                  geometry=GEOMETRY).save(root / "maps.safetensors")
    config = {"federation_id": "testfed", "site_id": site_id, "task": "radiomap", "dataset": "maps.safetensors",
              "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
              "outbox": "state/outbox.sqlite", "profile": "radio-base-station"}
    (root / "site.yaml").write_text(yaml.safe_dump(config))
    return key


@pytest.mark.slow
def test_radio_rounds_end_to_end(tmp_path):
    bus = InMemoryTransport()
    key = generate_signing_key()
    config = make_config(tmp_path, model="radio_unet", privacy="grouped", radio=RADIO, rounds=2,
                         round_deadline_s=120.0)
    coord = Coordinator(config, transport=bus, signing_key=key)
    agents = []
    for i in range(3):
        sid = f"bs-{i}"
        site_key = radio_site(tmp_path / sid, sid, key, seed=i)
        coord.enrol(sid, public_key_to_pem(site_key.public_key()), {"capacity": 4, "categories": ["NE"]})
        agent = EdgeAgent.from_config(tmp_path / sid / "site.yaml", transport=Bridge(bus))
        agent.start()
        agents.append(agent)
    threads = [threading.Thread(target=a.run, kwargs={"max_rounds": 2, "idle_timeout_s": 120}) for a in agents]
    for t in threads:
        t.start()
    try:
        results = coord.run()
    finally:
        for t in threads:
            t.join(timeout=180)
    # every round closed with all three gateways
    assert [r.status for r in results] == ["closed", "closed"]
    assert all(r.accepted == ("bs-0", "bs-1", "bs-2") for r in results)
    # the ledger holds, per gateway, one upload event per round: the Gaussian mechanism at the floor,
    # sensitivity 2C: z_eff = sqrt(phi) z / 2
    z_eff = math.sqrt(0.5) * 3.0 / 2
    for sid in ("bs-0", "bs-1", "bs-2"):
        events = coord.ledger.events(sid, IUCNCategory.NE)
        assert [(e.sampling_rate, e.steps) for e in events] == [(1.0, 1), (1.0, 1)]
        assert all(e.noise_multiplier == pytest.approx(z_eff, rel=1e-12) for e in events)
        assert coord.ledger.spent(sid, IUCNCategory.NE) == pytest.approx(
            epsilon_spent([DPSGDEvent(z_eff, 1.0, 2)], target_delta=1e-5))
    # the global model moved by the mean of three noisy uploads (noise std >= sqrt(phi) z C per coordinate)
    _, after = coord.rounds.current_model()
    first = decode_tensors(coord.store.get_model(coord.store.rounds()[0].base_model_hash))[0]
    moved = np.concatenate([(after[k] - first[k]).ravel() for k in first])
    assert moved.std() > 0.5 * math.sqrt(0.5) * 3.0 * 0.01 / math.sqrt(3)
    # each gateway trained its allocator on the task's public city and stored it with its model
    for i, agent in enumerate(agents):
        assert (agent.artifact_cache.root / "radio" / ALLOCATOR_FILE).exists()
        assert agent.stats["tasks_trained"] == 2
        agent.close()
    coord.close()


def test_radio_task_is_refused_by_a_camera_site_and_wrong_events_by_ingest(tmp_path):
    from shared.protocol import RadioTask, TrainingTask
    from shared.errors import PayloadError

    with pytest.raises(PayloadError, match="privacy"):
        TrainingTask(federation_id="f", round=1, model_hash="0" * 64, local_steps=1, expected_batch_size=2,
                     learning_rate=1e-3, clipping_norm=0.01, target_delta=1e-5, planned_rounds=2, privacy="none",
                     budgets={}, artifacts={"radio-city.safetensors": "0" * 64},
                     radio=RadioTask(defence="adaptive", noise_multiplier=3.0))
    with pytest.raises(PayloadError, match="city raster"):
        TrainingTask(federation_id="f", round=1, model_hash="0" * 64, local_steps=1, expected_batch_size=2,
                     learning_rate=1e-3, clipping_norm=0.01, target_delta=1e-5, planned_rounds=2, privacy="grouped",
                     budgets={IUCNCategory.NE: 30.0}, radio=RadioTask(defence="adaptive", noise_multiplier=3.0))
    with pytest.raises(PayloadError, match="radio settings"):
        TrainingTask(federation_id="f", round=1, model_hash="0" * 64, local_steps=1, expected_batch_size=2,
                     learning_rate=1e-3, clipping_norm=0.01, target_delta=1e-5, planned_rounds=2, privacy="grouped",
                     budgets={IUCNCategory.NE: 30.0})
    from coordinator.radio import expected_events

    config = make_config(tmp_path, model="radio_unet", privacy="grouped", radio=RADIO)
    assert expected_events(config) == {IUCNCategory.NE: DPSGDEvent(math.sqrt(0.5) * 3.0 / 2, 1.0, 1)}
    steered = make_config(tmp_path, model="radio_unet", privacy="none", radio={**RADIO, "defence": "steered-uniform"})
    assert expected_events(steered) == {}
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="privacy: none"):
        make_config(tmp_path, model="radio_unet", privacy="grouped", radio={**RADIO, "defence": "clip-only"})
