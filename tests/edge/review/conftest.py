"""Fixtures of the review page's tests: a site config without photos (accounts and commands), and a site built by
the field loop (tests.edge.review.support.build_site)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.keys import generate_signing_key, save_private_key, save_public_key

from tests.edge.review.support import SPECIES


@pytest.fixture
def site_config(tmp_path: Path) -> Path:
    """A minimal site.yaml (keys written; no package, no photos)."""
    save_private_key(generate_signing_key(), tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "package", "incoming": "incoming",
              "species": SPECIES, "num_classes": 3, "private_key": "keys/site.key",
              "coordinator_public_key": "keys/coordinator.pub", "outbox": "state/outbox.sqlite"}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "site.yaml"
