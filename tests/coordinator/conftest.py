"""Fixtures for coordinator tests: an in-memory federation over SQLite with the tiny model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shared.keys import generate_signing_key

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import make_config, tiny_weights


@pytest.fixture
def federation(tmp_path: Path) -> Callable[..., tuple[Coordinator, InMemoryTransport, object]]:
    """Factory: ``(coordinator, transport, coordinator_key)`` over SQLite in tmp_path with the tiny model."""
    made: list[Coordinator] = []

    def build(**overrides: object):
        transport = InMemoryTransport()
        key = generate_signing_key()
        coord = Coordinator(make_config(tmp_path, **overrides), transport=transport, signing_key=key,
                            initial_weights=tiny_weights())
        made.append(coord)
        return coord, transport, key

    yield build
    for c in made:
        c.close()
