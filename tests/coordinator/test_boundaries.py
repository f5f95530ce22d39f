"""Import boundaries: the coordinator never imports edge_sdk, and imports torch only lazily."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport, topic_matches
from tests.coordinator.helpers import make_config


def test_coordinator_modules_import_neither_torch_nor_edge_sdk():
    code = ("import sys\n"
            "import coordinator, coordinator.cli, coordinator.service, coordinator.rounds, coordinator.inbound.ingest\n"
            "import coordinator.ledger, coordinator.registry, coordinator.storage, coordinator.transport\n"
            "import coordinator.strategies.fedavg, coordinator.optimizers.server_sgd\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('edge_sdk') or m.startswith('paho')]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_default_round0_model_is_the_head_model(tmp_path):
    """The coordinator's round-0 model is the head model on backbone embeddings (adapter_width 0 by default: psi
    alone, a zero-initialised 1280 -> K linear head), built without torch; adapter_width H adds phi (H, 1280)."""
    config = make_config(tmp_path)
    coord = Coordinator(config, transport=InMemoryTransport(), signing_key=generate_signing_key())
    coord.start()
    h, weights = coord.rounds.current_model()
    k = config.num_classes
    assert len(h) == 64 and {n: w.shape for n, w in weights.items()} == {"psi.weight": (k, 1280), "psi.bias": (k,)}
    assert all(w.dtype.name == "float32" and not w.any() for w in weights.values())  # zero head (De et al. 2022)
    coord.close()

    wide = make_config(tmp_path / "wide", adapter_width=32)
    coord = Coordinator(wide, transport=InMemoryTransport(), signing_key=generate_signing_key())
    coord.start()
    _, weights = coord.rounds.current_model()
    assert {n: w.shape for n, w in weights.items()} == {"phi.0.weight": (32, 1280), "phi.0.bias": (32,),
                                                        "psi.weight": (k, 32), "psi.bias": (k,)}
    bound = 1 / np.sqrt(1280)  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert 0 < np.abs(weights["phi.0.weight"]).max() <= bound
    coord.close()


def test_topic_filter_matching():
    assert topic_matches("wildfed/v1/f/site/+/update", "wildfed/v1/f/site/s1/update")
    assert not topic_matches("wildfed/v1/f/site/+/update", "wildfed/v1/f/site/s1/ack")
    assert topic_matches("wildfed/#", "wildfed/v1/f/site/s1/ack")
    assert not topic_matches("wildfed/v1/f/site/+", "wildfed/v1/f/site/s1/update")
