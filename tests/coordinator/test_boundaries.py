"""Import boundaries: the coordinator never imports edge_sdk, and imports torch only lazily."""

from __future__ import annotations

import subprocess
import sys

from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport, topic_matches
from tests.coordinator.helpers import make_config


def test_coordinator_modules_import_neither_torch_nor_edge_sdk():
    code = ("import sys\n"
            "import coordinator, coordinator.cli, coordinator.service, coordinator.rounds, coordinator.ingest\n"
            "import coordinator.ledger, coordinator.registry, coordinator.storage, coordinator.transport\n"
            "import coordinator.strategies.fedavg, coordinator.optimizers.server_sgd\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('edge_sdk') or m.startswith('paho')]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_default_round0_model_is_the_camera_cnn(tmp_path):
    coord = Coordinator(make_config(tmp_path), transport=InMemoryTransport(), signing_key=generate_signing_key())
    coord.start()
    h, weights = coord.rounds.current_model()
    assert len(h) == 64 and weights and all(k.startswith(("phi.", "psi.")) for k in weights)
    assert all(w.dtype.name == "float32" for w in weights.values())
    coord.close()


def test_topic_filter_matching():
    assert topic_matches("wildfed/v1/f/site/+/update", "wildfed/v1/f/site/s1/update")
    assert not topic_matches("wildfed/v1/f/site/+/update", "wildfed/v1/f/site/s1/ack")
    assert topic_matches("wildfed/#", "wildfed/v1/f/site/s1/ack")
    assert not topic_matches("wildfed/v1/f/site/+", "wildfed/v1/f/site/s1/update")
